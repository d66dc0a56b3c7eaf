"""The `weightsync` command: `weightsync serve [MODEL]` runs an engine behind HTTP.

```
weightsync serve tiny --port 8000 --weight-transfer-config '{"backend": "gloo"}'
weightsync serve ./my-llama --weight-transfer-config.backend nccl --admin-api-key "$KEY"
```

The model is a preset name (`debug`, `tiny`, `small`: random weights from `--seed`) or a local
Hugging Face directory (`config.json` + safetensors). `--weight-transfer-config` takes JSON or
dotted keys, as vLLM's does. Without `--admin-api-key` the server binds loopback addresses only:
its RL routes replace the model's weights.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

import weightsync
from weightsync import (
    AsyncEngine,
    EngineConfig,
    LlamaConfig,
    LlamaForCausalLM,
    LLMEngine,
    WeightSyncError,
    WeightTransferConfig,
    parse_weight_transfer_config,
)

__all__ = ["build_parser", "main", "parse_serve_args"]

logger = logging.getLogger("weightsync.serve")

_API_KEY_ENV = "WEIGHTSYNC_API_KEY"
_ADMIN_API_KEY_ENV = "WEIGHTSYNC_ADMIN_API_KEY"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "float64": torch.float64}  # fmt: skip


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def _add_serve_arguments(serve: argparse.ArgumentParser) -> None:
    defaults = EngineConfig()
    serve.add_argument("model", nargs="?", default="tiny",
                       help="a preset (debug, tiny, small) or a local Hugging Face directory "
                       "(default: %(default)s)")  # fmt: skip
    net = serve.add_argument_group("network")
    net.add_argument("--host", default="127.0.0.1",
                     help="address to bind (default: %(default)s); any non-loopback address "
                     "needs --admin-api-key")  # fmt: skip
    net.add_argument("--port", type=int, default=8000,
                     help="port to bind; 0 picks a free one (default: %(default)s)")  # fmt: skip
    net.add_argument("--api-key", default=os.environ.get(_API_KEY_ENV),
                     metavar="KEY", help=f"key the /v1 routes require as 'Authorization: Bearer KEY' "
                     f"(default: ${_API_KEY_ENV}; none: open)")  # fmt: skip
    net.add_argument("--admin-api-key", default=os.environ.get(_ADMIN_API_KEY_ENV),
                     metavar="KEY", help=f"key the RL routes (/pause, /update_weights, ...) require "
                     f"(default: ${_ADMIN_API_KEY_ENV}; none: loopback only)")  # fmt: skip
    net.add_argument("--max-request-bytes", type=_positive_int, default=64 * 1024 * 1024,
                     help="largest request body in bytes; larger ones get 413 "
                     "(default: %(default)s)")  # fmt: skip
    net.add_argument("--served-model-name", default=None,
                     help="the model id of /v1/models (default: MODEL)")  # fmt: skip
    net.add_argument("--log-level", default="info",
                     choices=["debug", "info", "warning", "error"])  # fmt: skip
    model = serve.add_argument_group("model and weights")
    model.add_argument("--dtype", default="float32", choices=sorted(_DTYPES),
                       help="parameter dtype (default: %(default)s)")  # fmt: skip
    model.add_argument("--seed", type=int, default=0,
                       help="seed of a preset's weights and of unseeded sampling "
                       "(default: %(default)s)")  # fmt: skip
    model.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                       help="auto: a preset's random weights or the directory's safetensors; "
                       "dummy: zero weights of the preset's or config.json's shapes, for a "
                       "trainer to fill with its first update (default: %(default)s)")  # fmt: skip
    model.add_argument("--device", default="cpu",
                       help="where transfer buffers live: cpu, or cuda:N, which becomes the "
                       "process's CUDA device (nccl); the engine computes on the CPU "
                       "(default: %(default)s)")  # fmt: skip
    model.add_argument("--weight-transfer-config", metavar="JSON",
                       help='transfer backend, as JSON (\'{"backend": "gloo"}\') or dotted keys '
                       "(--weight-transfer-config.backend gloo); default: the backend the "
                       "trainer's init info names")  # fmt: skip
    model.add_argument("--worker-index", type=int, default=0,
                       help="this server's index among the engines one trainer updates: its "
                       "broadcast rank is 1 + index (default: %(default)s)")  # fmt: skip
    model.add_argument("--weight-update-staging", action="store_true",
                       help="copy weights before an update touches them, so a failed update "
                       "restores them instead of leaving them torn")  # fmt: skip
    sched = serve.add_argument_group("scheduler and KV cache")
    sched.add_argument("--max-num-seqs", type=_positive_int, default=defaults.max_num_seqs,
                       help="most requests running at once (default: %(default)s)")  # fmt: skip
    sched.add_argument("--max-num-batched-tokens", type=_positive_int,
                       default=defaults.max_num_batched_tokens,
                       help="token budget of one step (default: %(default)s)")  # fmt: skip
    sched.add_argument("--block-size", type=_positive_int, default=defaults.block_size,
                       help="tokens per KV-cache block (default: %(default)s)")  # fmt: skip
    sched.add_argument("--num-kv-blocks", type=_positive_int, default=defaults.num_kv_blocks,
                       help="blocks in the KV cache (default: %(default)s)")  # fmt: skip
    sched.add_argument("--max-model-len", type=_positive_int, default=None,
                       help="longest sequence in tokens (default: the model's)")  # fmt: skip
    sched.add_argument("--sampling-seed", type=int, default=None,
                       help="seed of unseeded requests' sampling (default: --seed)")  # fmt: skip
    sched.add_argument("--no-prefix-caching", action="store_true",
                       help="do not reuse the KV of identical prompt prefixes")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    """The `weightsync` command's parser (the CLI reference page is generated from it)."""
    parser = argparse.ArgumentParser(
        prog="weightsync",
        description="Live weight updates for LLM inference engines.",
        epilog="Run 'weightsync serve --help' for the server's options.",
    )
    parser.add_argument(
        "--version", action="version", version=f"weightsync {weightsync.__version__}"
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    serve = commands.add_parser(
        "serve",
        help="serve a model over HTTP: OpenAI routes and vLLM's RL routes",
        description="Serve a model over HTTP: OpenAI-compatible /v1 routes, and vLLM's RL routes "
        "(/pause, /resume, /init_weight_transfer_engine, /start_weight_update, /update_weights, "
        "/finish_weight_update, ...) through which a trainer updates its weights live.",
    )
    _add_serve_arguments(serve)
    return parser


def _zero_model(name: str, dtype: torch.dtype) -> LlamaForCausalLM:
    """A model of a preset's or a directory's `config.json` shapes, every weight zero."""
    path = Path(name) / "config.json"
    config = (
        LlamaConfig.from_hf_dict(json.loads(path.read_text()))
        if path.is_file()
        else LlamaConfig.preset(name)
    )
    model = LlamaForCausalLM(config, dtype=dtype)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
    return model


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve anywhere


def _fail(message: str, *, status: int) -> int:
    """Says why the server cannot start, in one line (the command's output, not a log)."""
    print(f"weightsync serve: error: {message}", file=sys.stderr)
    return status


def parse_serve_args(
    argv: Sequence[str],
) -> tuple[argparse.Namespace, WeightTransferConfig | None]:
    """Parses a `weightsync serve ...` command line.

    Returns:
        The options, and the `--weight-transfer-config` (JSON or dotted keys), if given.

    Raises:
        WeightValidationError: A malformed `--weight-transfer-config`.
        SystemExit: Any other malformed option (argparse prints why).

    >>> args, config = parse_serve_args(["serve", "--weight-transfer-config.backend", "gloo"])
    >>> args.model, args.host, config.backend
    ('tiny', '127.0.0.1', 'gloo')
    """
    transfer_config, rest = parse_weight_transfer_config(argv)
    return build_parser().parse_args(rest), transfer_config


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the `weightsync` command; returns its exit status."""
    try:
        args, transfer_config = parse_serve_args(list(sys.argv[1:] if argv is None else argv))
    except WeightSyncError as exc:
        return _fail(str(exc), status=2)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if not args.admin_api_key and not _is_loopback(args.host):
        return _fail(
            f"refusing to serve on {args.host}, which is not a loopback address, without an admin "
            "key: anyone who reaches it could replace the model's weights. Give --admin-api-key "
            f"KEY (or set ${_ADMIN_API_KEY_ENV}), or bind --host 127.0.0.1",
            status=2,
        )
    from weightsync.serve._server import bind, serve_forever
    from weightsync.serve.app import ServerConfig, create_app

    try:
        sock = bind(args.host, args.port)
    except OSError as exc:
        return _fail(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}", status=1)
    try:
        engine_config = EngineConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            block_size=args.block_size,
            num_kv_blocks=args.num_kv_blocks,
            enable_prefix_caching=not args.no_prefix_caching,
            max_model_len=args.max_model_len,
            seed=args.seed if args.sampling_seed is None else args.sampling_seed,
            weight_update_staging=args.weight_update_staging,
        )
        if torch.device(args.device).type == "cuda":  # nccl receives on the current device
            torch.cuda.set_device(torch.device(args.device))
        engine = LLMEngine(
            _zero_model(args.model, _DTYPES[args.dtype])
            if args.load_format == "dummy"
            else args.model,
            engine_config=engine_config,
            weight_transfer_config=transfer_config,
            seed=args.seed,
            dtype=_DTYPES[args.dtype],
            worker_index=args.worker_index,
        )
        config = ServerConfig(
            model_name=args.served_model_name or args.model,
            api_key=args.api_key,
            admin_api_key=args.admin_api_key,
            max_request_bytes=args.max_request_bytes,
        )
    except WeightSyncError as exc:
        sock.close()
        return _fail(str(exc), status=2)
    app = create_app(AsyncEngine(engine), config)
    logger.info("engine config: %s", dataclasses.asdict(engine_config))
    return serve_forever(app, sock, log_level=args.log_level)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
