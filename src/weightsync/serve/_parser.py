"""The `weightsync` command line, as an argparse parser alone.

It imports nothing from weightsync (nor torch), so the docs build generates the CLI reference
page from this very parser without installing the package. Its scheduler defaults are
`EngineConfig`'s; a test checks that they agree.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

API_KEY_ENV = "WEIGHTSYNC_API_KEY"
ADMIN_API_KEY_ENV = "WEIGHTSYNC_ADMIN_API_KEY"
DTYPE_NAMES = ("bfloat16", "float16", "float32", "float64")


def _int_in(low: int, high: int, what: str = "an integer") -> Callable[[str], int]:
    """An argparse type: an int in [low, high)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not low <= value < high:
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value

    return parse


_positive_int = _int_in(1, 2**63, "an integer >= 1")


def _positive_float(text: str) -> float:
    """An argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text}")
    return value


_port = _int_in(0, 65536, "a port in [0, 65535] (0 picks a free one)")
_index = _int_in(0, 2**31, "an integer >= 0")
# What torch.Generator.manual_seed takes.
_seed = _int_in(-(2**63), 2**64, "a seed in [-2**63, 2**64)")


def _add_serve_arguments(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("model", nargs="?", default="tiny",
                       help="a preset (debug, tiny, small) or a local Hugging Face directory "
                       "(default: %(default)s)")  # fmt: skip
    net = serve.add_argument_group("network")
    net.add_argument("--host", default="127.0.0.1",
                     help="address to bind (default: %(default)s); any non-loopback address "
                     "needs --admin-api-key")  # fmt: skip
    net.add_argument("--port", type=_port, default=8000,
                     help="port to bind; 0 picks a free one (default: %(default)s)")  # fmt: skip
    net.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                     metavar="KEY", help=f"key the /v1 routes require as 'Authorization: Bearer KEY' "
                     f"(default: ${API_KEY_ENV}; none: open)")  # fmt: skip
    net.add_argument("--admin-api-key", default=os.environ.get(ADMIN_API_KEY_ENV),
                     metavar="KEY", help=f"key the RL routes (/pause, /update_weights, ...) require "
                     f"(default: ${ADMIN_API_KEY_ENV}; none: loopback only)")  # fmt: skip
    net.add_argument("--max-request-bytes", type=_positive_int, default=64 * 1024 * 1024,
                     help="largest request body in bytes; larger ones get 413 "
                     "(default: %(default)s)")  # fmt: skip
    net.add_argument("--strict-request-fields", action="store_true",
                     help="refuse request fields the server does not know (400 naming them); "
                     "by default they are ignored as vLLM ignores them, logged and named in "
                     "the answer's X-Ignored-Fields header")  # fmt: skip
    net.add_argument("--served-model-name", default=None,
                     help="the model id of /v1/models (default: MODEL)")  # fmt: skip
    net.add_argument("--log-level", default="info",
                     choices=["debug", "info", "warning", "error"])  # fmt: skip
    _add_model_arguments(serve)
    _add_scheduler_arguments(serve)
    _add_lora_arguments(serve)
    _add_data_parallel_arguments(serve)


@dataclass(frozen=True)
class LoRAModule:
    """One `--lora-modules` entry: `name`, `path` and an optional `base_model_name`."""

    name: str
    path: str
    base_model_name: str | None = None


class _LoRAModules(argparse.Action):
    """`--lora-modules` as vLLM takes it: `name=path`, or JSON `{"name": ..., "path": ...}`."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        modules: list[LoRAModule] = []
        for item in [values] if isinstance(values, str) else values or []:
            if not item:
                continue
            if "=" in item and "," not in item and not item.lstrip().startswith("{"):
                name, path = item.split("=", 1)
                fields: Any = {"name": name, "path": path}
            else:
                try:
                    fields = json.loads(item)
                except ValueError:
                    parser.error(f"--lora-modules: {item!r} is neither name=path nor JSON")
            if (
                not isinstance(fields, dict)
                or not {"name", "path"} <= set(fields) <= {"name", "path", "base_model_name"}
                or not all(isinstance(fields[k], str) and fields[k] for k in ("name", "path"))
                or not isinstance(fields.get("base_model_name"), str | None)
            ):
                parser.error(
                    f"--lora-modules: {item!r} must be name=path or a JSON object with string "
                    "fields 'name' and 'path' (and optionally 'base_model_name')"
                )
            modules.append(LoRAModule(**fields))
        setattr(namespace, self.dest, modules)


def _add_lora_arguments(serve: argparse.ArgumentParser) -> None:
    lora = serve.add_argument_group("LoRA adapters")
    lora.add_argument("--enable-lora", action="store_true",
                      help="serve LoRA adapters: mounts /v1/load_lora_adapter and "
                      "/v1/unload_lora_adapter, and a request whose model names a loaded "
                      "adapter runs with it")  # fmt: skip
    lora.add_argument("--max-loras", type=_positive_int, default=1,
                      help="most distinct adapters among the running requests; a request whose "
                      "adapter would exceed it waits (default: %(default)s)")  # fmt: skip
    lora.add_argument("--max-lora-rank", type=_positive_int, default=16,
                      help="largest adapter rank r accepted (default: %(default)s)")  # fmt: skip
    lora.add_argument("--max-lora-versions", type=_positive_int, default=4,
                      help="most versions of one adapter kept at once when a live update "
                      "(/start_weight_update with lora_name) commits a new one: the current one "
                      "and those requests still run with; beyond it the oldest are dropped and "
                      "their requests aborted (default: %(default)s)")  # fmt: skip
    lora.add_argument("--lora-modules", nargs="+", action=_LoRAModules, default=None,
                      metavar="NAME=PATH",
                      help="adapters loaded at start, each name=path or JSON "
                      '\'{"name": ..., "path": ...}\' (needs --enable-lora)')  # fmt: skip


def _add_data_parallel_arguments(serve: argparse.ArgumentParser) -> None:
    dp = serve.add_argument_group("data parallel")
    dp.add_argument("--data-parallel-size", type=_positive_int, default=1,
                    help="engine replicas behind this server, each a process with its own model, "
                    "KV cache and scheduler, and its own transfer rank (worker index "
                    "--worker-index + i; with --device cuda, GPU i); /pause and weight "
                    "updates act on all of them (default: %(default)s)")  # fmt: skip
    # Set by whoever starts this server as its child (a data-parallel front, an `EngineProcess`):
    # the server stops when that process dies, even killed outright.
    dp.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    # Set by a data-parallel front on its replicas: they also answer its finish check.
    dp.add_argument("--replica", action="store_true", help=argparse.SUPPRESS)


def _add_model_arguments(serve: argparse.ArgumentParser) -> None:
    model = serve.add_argument_group("model and weights")
    model.add_argument("--dtype", default="float32", choices=sorted(DTYPE_NAMES),
                       help="parameter dtype (default: %(default)s)")  # fmt: skip
    model.add_argument("--seed", type=_seed, default=0,
                       help="seed of a preset's weights and of unseeded sampling "
                       "(default: %(default)s)")  # fmt: skip
    model.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                       help="auto: a preset's random weights or the directory's safetensors; "
                       "dummy: zero weights of the preset's or config.json's shapes, for a "
                       "trainer to fill with its first update (default: %(default)s)")  # fmt: skip
    model.add_argument("--device", default="cpu",
                       help="where the engine computes (model, KV cache, sampling) and weight "
                       "updates land: cpu, cuda or cuda:N, which also becomes the process's CUDA "
                       "device for nccl (default: %(default)s)")  # fmt: skip
    model.add_argument("--weight-transfer-config", metavar="JSON",
                       help='transfer backend, as JSON (\'{"backend": "gloo"}\') or dotted keys '
                       "(--weight-transfer-config.backend gloo); default: the backend the "
                       "trainer's init info names")  # fmt: skip
    model.add_argument("--worker-index", type=_index, default=0,
                       help="this server's index among the engines one trainer updates: its "
                       "broadcast rank is 1 + index (default: %(default)s)")  # fmt: skip
    model.add_argument("--weight-update-staging", action="store_true",
                       help="copy weights before an update touches them, so a failed update "
                       "restores them instead of leaving them torn")  # fmt: skip
    model.add_argument("--refuse-non-finite-weights", action="store_true",
                       help="refuse, at finish, an update that wrote a NaN or an infinity (the "
                       "version stays; see EngineConfig.refuse_non_finite_weights)")  # fmt: skip
    model.add_argument("--no-prepack-linears", action="store_true",
                       help="multiply by the plain weights, without the prepacked copies a "
                       "float32 model on a CPU otherwise gets (see "
                       "EngineConfig.prepack_linears)")  # fmt: skip


def _add_scheduler_arguments(serve: argparse.ArgumentParser) -> None:
    sched = serve.add_argument_group("scheduler and KV cache")
    sched.add_argument("--max-num-seqs", type=_positive_int, default=64,
                       help="most requests running at once (default: %(default)s)")  # fmt: skip
    sched.add_argument("--max-num-batched-tokens", type=_positive_int,
                       default=2048,
                       help="token budget of one step (default: %(default)s)")  # fmt: skip
    sched.add_argument("--block-size", type=_positive_int, default=16,
                       help="tokens per KV-cache block (default: %(default)s)")  # fmt: skip
    sched.add_argument("--num-kv-blocks", type=_positive_int, default=1024,
                       help="blocks in the KV cache (default: %(default)s)")  # fmt: skip
    sched.add_argument("--max-model-len", type=_positive_int, default=None,
                       help="longest sequence in tokens (default: the model's)")  # fmt: skip
    sched.add_argument("--num-threads", type=_positive_int, default=None,
                       help="torch threads of the forward pass (default: every core this process "
                       "may run on that other processes leave free, re-decided as it steps)")  # fmt: skip
    sched.add_argument("--sampling-seed", type=_seed, default=None,
                       help="seed of unseeded requests' sampling (default: --seed)")  # fmt: skip
    sched.add_argument("--no-prefix-caching", action="store_true",
                       help="do not reuse the KV of identical prompt prefixes")  # fmt: skip


def _add_conformance_arguments(check: argparse.ArgumentParser) -> None:
    check.add_argument("url", help="the server's base URL, e.g. http://127.0.0.1:8000")
    check.add_argument("--json", action="store_true",
                       help="print one JSON object instead of the table")  # fmt: skip
    check.add_argument("--api-key", default=os.environ.get(API_KEY_ENV), metavar="KEY",
                       help=f"key sent on the /v1 routes (default: ${API_KEY_ENV})")  # fmt: skip
    check.add_argument("--admin-api-key", default=os.environ.get(ADMIN_API_KEY_ENV),
                       metavar="KEY", help=f"key sent on the RL routes "
                       f"(default: ${ADMIN_API_KEY_ENV})")  # fmt: skip
    check.add_argument("--timeout-s", type=_positive_float, default=30.0, metavar="S",
                       help="bound of each call in seconds (default: %(default)s)")  # fmt: skip
    check.add_argument("--keep-weights", action="store_true",
                       help="skip the cases that overwrite the served weights (weight_checker "
                       "reset, sleep level 2)")  # fmt: skip


class _Parser(argparse.ArgumentParser):
    """Says what is wrong in one line, without the usage block above it (`--help` has that)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def build_parser(version: str = "") -> argparse.ArgumentParser:
    """The `weightsync` command's parser (the CLI reference page is generated from it)."""
    parser = _Parser(
        prog="weightsync",
        description="Live weight updates for LLM inference engines.",
        epilog="Run 'weightsync serve --help' for the server's options.",
    )
    parser.add_argument("--version", action="version", version=f"weightsync {version}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    serve = commands.add_parser(
        "serve",
        help="serve a model over HTTP: OpenAI routes and vLLM's RL routes",
        description="Serve a model over HTTP: OpenAI-compatible /v1 routes, and vLLM's RL routes "
        "(/pause, /resume, /init_weight_transfer_engine, /start_weight_update, /update_weights, "
        "/finish_weight_update, ...) through which a trainer updates its weights live.",
    )
    _add_serve_arguments(serve)
    check = commands.add_parser(
        "conformance",
        help="check a server against vLLM's RL and OpenAI contract",
        description="Check any server that claims vLLM's RL and OpenAI contract (vLLM, "
        "weightsync serve, another engine): routes, statuses, body shapes, pause modes with a "
        "request in flight, the weight-update transaction's order rules, the weight checker, "
        "sleep and wake up, request fields. Needs no trainer. Prints a table (or --json) and "
        "exits 1 when a case fails. It pauses, relabels and, unless --keep-weights, overwrites "
        "the served weights: run it against a server you can restart.",
    )
    _add_conformance_arguments(check)
    return parser
