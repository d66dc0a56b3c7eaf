"""The `weightsync` command: `weightsync serve [MODEL]` runs an engine behind HTTP.

`weightsync conformance URL` checks a server against vLLM's contract (`weightsync.conformance`).

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
import logging
import os
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

import weightsync
from weightsync import (
    AsyncEngine,
    EngineConfig,
    EngineConfigError,
    LlamaConfig,
    LlamaForCausalLM,
    LLMEngine,
    WeightSyncError,
    WeightTransferConfig,
    parse_weight_transfer_config,
)
from weightsync.engine._cores import ComputeThreads, cpu_limit, usable_cores
from weightsync.engine.hf_tokenizer import _read_json, load_tokenizer
from weightsync.engine.tokenizer import Tokenizer
from weightsync.serve._parser import ADMIN_API_KEY_ENV
from weightsync.serve._parser import build_parser as _build_parser

__all__ = ["main"]

logger = logging.getLogger("weightsync.serve")

# How long the replicas of a data-parallel server may take to start (import torch, build models).
_REPLICA_START_TIMEOUT_S = 120.0
# torch's switch for transparent huge pages under its CPU tensors (read at the first tensor), and
# what the kernel offers, the choice in brackets: "always [madvise] never".
_HUGE_PAGES_ENV = "THP_MEM_ALLOC_ENABLE"
_HUGE_PAGES_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")

if TYPE_CHECKING:
    from fastapi import FastAPI

    from weightsync.serve.config import ServerConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "float64": torch.float64}  # fmt: skip


def _zero_model(name: str, dtype: torch.dtype) -> LlamaForCausalLM:
    """A model of a preset's or a directory's `config.json` shapes, every weight zero."""
    path = Path(name) / "config.json"
    config = (
        LlamaConfig.from_hf_dict(_read_json(path), source=str(path))
        if path.is_file()
        else LlamaConfig.preset(name)
    )
    model = LlamaForCausalLM(config, dtype=dtype)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
    return model


def _dummy_tokenizer(name: str, model: LlamaForCausalLM | str) -> Tokenizer | None:
    """The tokenizer of a model directory served with zero weights; None for a preset."""
    if isinstance(model, str) or not (Path(name) / "config.json").is_file():
        return None
    return load_tokenizer(name, vocab_size=model.config.vocab_size)


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


def _parse_serve_args(
    argv: Sequence[str],
) -> tuple[argparse.Namespace, WeightTransferConfig | None]:
    """Parses a `weightsync serve ...` command line.

    Returns:
        The options, and the `--weight-transfer-config` (JSON or dotted keys), if given.

    Raises:
        WeightValidationError: A malformed `--weight-transfer-config`.
        SystemExit: Any other malformed option (argparse prints why).

    >>> args, config = _parse_serve_args(["serve", "--weight-transfer-config.backend", "gloo"])
    >>> args.model, args.host, config.backend
    ('tiny', '127.0.0.1', 'gloo')
    """
    transfer_config, rest = parse_weight_transfer_config(argv)
    return _build_parser(weightsync.__version__).parse_args(rest), transfer_config


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the `weightsync` command; returns its exit status."""
    try:
        args, transfer_config = _parse_serve_args(list(sys.argv[1:] if argv is None else argv))
    except WeightSyncError as exc:
        return _fail(str(exc), status=2)
    if args.command == "conformance":
        from weightsync.conformance._command import run_command

        return run_command(args)
    from weightsync.serve._logging import configure_logging

    configure_logging(args.log_level)
    if not args.admin_api_key and not _is_loopback(args.host):
        return _fail(
            f"refusing to serve on {args.host}, which is not a loopback address, without an admin "
            "key: anyone who reaches it could replace the model's weights. Give --admin-api-key "
            f"KEY (or set ${ADMIN_API_KEY_ENV}), or bind --host 127.0.0.1",
            status=2,
        )
    from weightsync.serve._server import bind, serve_forever
    from weightsync.serve.app import create_app

    try:
        sock = bind(args.host, args.port)
    except OSError as exc:
        return _fail(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}", status=1)
    if args.data_parallel_size > 1:
        return _serve_data_parallel(args, transfer_config, sock)
    try:
        engine_config = _engine_config(args)
        threads = _compute_threads(args.num_threads)
        device = engine_config.resolve_device()  # a CUDA device this machine lacks: refused
        if device.type == "cuda" and device.index is not None:
            torch.cuda.set_device(device)  # nccl receives on the process's current device
        _large_tensors_on_huge_pages()
        model = (
            _zero_model(args.model, _DTYPES[args.dtype])
            if args.load_format == "dummy"
            else args.model
        )
        engine = LLMEngine(
            model,
            engine_config=engine_config,
            # Zero weights, but the directory's own tokenizer (a preset's is the byte tokenizer).
            tokenizer=_dummy_tokenizer(args.model, model) if args.load_format == "dummy" else None,
            weight_transfer_config=transfer_config,
            seed=args.seed,
            dtype=_DTYPES[args.dtype],
            worker_index=args.worker_index,
            finish_bare_updates=not args.replica,  # a replica's front finishes them, on all
        )
        config = _server_config(args)
        _load_lora_modules(engine, args, config.model_name)
    except WeightSyncError as exc:
        sock.close()
        return _fail(str(exc), status=2)
    app = create_app(AsyncEngine.from_engine(engine, compute_threads=threads), config)
    _serve_as_child(app, args.parent_pid, replica=args.replica)
    logger.info("engine config: %s", dataclasses.asdict(engine_config))
    return serve_forever(app, sock, log_level=args.log_level)


def _large_tensors_on_huge_pages() -> None:
    """Puts torch's tensors of 2 MiB or more on huge pages, unless the environment says not to."""
    # A decode step reads every weight once: on 4 KiB pages, an address translation every 4 KiB.
    # torch reads the variable at the process's first tensor, so this runs before the model loads.
    try:
        offered = "[never]" not in _HUGE_PAGES_SETTING.read_text(encoding="ascii")
    except OSError:  # not Linux, or a kernel built without them: torch's request would fail
        return
    if offered:
        os.environ.setdefault(_HUGE_PAGES_ENV, "1")


def _compute_threads(num_threads: int | None) -> ComputeThreads | None:
    """Sets torch's threads; returns what decides the step thread's, unless `num_threads` does."""
    cores = len(usable_cores())
    threads = None if num_threads else ComputeThreads()
    # Without num_threads, every core but one until the first step: a thread starts from the
    # count torch was last given, so the threads made after the step thread sets its own (a
    # transfer's, a repack's) start from its latest count and follow the load as steps do.
    torch.set_num_threads(num_threads or max(1, cpu_limit(cores) - 1))
    if threads is None:
        logger.info("computing on %d threads (%d cores)", num_threads, cores)
    else:
        logger.info("computing on up to %d threads (%d cores): every core other processes "
                    "leave free (--num-threads fixes it)", threads.limit, cores)  # fmt: skip
    return threads


def _server_config(args: argparse.Namespace, *, world_size: int = 1) -> ServerConfig:
    """The HTTP side's options (names, keys, body limit, field rule), from the command line."""
    from weightsync.serve.config import ServerConfig

    return ServerConfig(
        model_name=args.served_model_name or args.model,
        model_path=args.model,
        api_key=args.api_key,
        admin_api_key=args.admin_api_key,
        max_request_bytes=args.max_request_bytes,
        strict_request_fields=args.strict_request_fields,
        world_size=world_size,
    )


def _load_lora_modules(engine: LLMEngine, args: argparse.Namespace, model_name: str) -> None:
    """Loads the `--lora-modules` adapters before the server answers (vLLM's static adapters).

    Raises:
        EngineConfigError: `--lora-modules` without `--enable-lora`, or an adapter named as the
            model is served.
        LoRAAdapterError: An adapter refused (the message names the file and the tensor).
    """
    modules = args.lora_modules or []
    if modules and not args.enable_lora:
        raise EngineConfigError("--lora-modules needs --enable-lora")
    for module in modules:
        if module.name == model_name:
            raise EngineConfigError(
                f"--lora-modules: the adapter name {module.name!r} is the served model's name; "
                "give the adapter another name"
            )
        engine.load_lora_adapter(module.name, module.path)


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine's scheduler, cache, seed and device options, from the command line."""
    return EngineConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        enable_prefix_caching=not args.no_prefix_caching,
        max_model_len=args.max_model_len,
        seed=args.seed if args.sampling_seed is None else args.sampling_seed,
        weight_update_staging=args.weight_update_staging,
        refuse_non_finite_weights=args.refuse_non_finite_weights,
        prepack_linears=not args.no_prepack_linears,
        enable_lora=args.enable_lora,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_lora_versions=args.max_lora_versions,
        device=args.device,
    )


def _serve_as_child(app: FastAPI, parent_pid: int | None, *, replica: bool) -> None:
    """An exit when the parent that started this server dies; a replica's finish check."""
    from weightsync.trainer._serve_process import watch_parent

    if replica:  # the front's own route: imported only by a replica
        from weightsync.serve._front.replica import router

        app.include_router(router)
    if parent_pid is not None:
        watch_parent(parent_pid)


def _serve_data_parallel(
    args: argparse.Namespace, transfer_config: WeightTransferConfig | None, sock: socket.socket
) -> int:
    """Starts `--data-parallel-size` replicas and serves the front over them until stopped."""
    from weightsync.serve._front.app import create_fleet_app
    from weightsync.serve._front.fleet import Fleet, replica_argv
    from weightsync.serve._server import serve_forever

    size, cores = args.data_parallel_size, cpu_limit(len(usable_cores()))
    if size > cores:
        logger.warning("%d replicas share %d cores: each computes slowly and starts slowly; "
                       "fewer replicas serve faster here", size, cores)  # fmt: skip
    # The replicas share the cores: each takes its part of them, one left to serving HTTP.
    threads = args.num_threads or max(1, (cores - 1) // size)
    # The front's calls to its replicas are its own business: not a log line each.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        config = _server_config(args, world_size=size)
        fleet = Fleet(
            replica_argv(args, transfer_config),
            size=size,
            worker_index=args.worker_index,
            threads=threads,
            device=args.device,
            timeout_s=_REPLICA_START_TIMEOUT_S,
        )
    except WeightSyncError as exc:
        sock.close()
        return _fail(str(exc), status=2)
    try:
        # The replicas stop alongside the front, from its signal on: each one's shutdown is
        # bounded as the front's is, and the front then waits for them.
        app = create_fleet_app(fleet, config, enable_lora=args.enable_lora)
        return serve_forever(app, sock, log_level=args.log_level, on_signal=fleet.terminate)
    finally:
        for replica in fleet.replicas:  # already stopped by the app's shutdown, unless it failed
            replica.stop()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
