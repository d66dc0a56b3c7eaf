"""Calls into several engines at once, each on a daemon thread, waited for with a bound."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from typing import Any, TypeVar

from weightsync.errors import WeightTransferTimeout, WeightValidationError

_T = TypeVar("_T")

logger = logging.getLogger(__name__)


def in_threads(engines: Sequence[_T], call: Callable[[_T], Any]) -> list[Future[Any]]:
    """Starts `call(engine)` for every engine on a daemon thread of its own; returns futures."""
    futures: list[Future[Any]] = [Future() for _ in engines]

    def run(engine: _T, future: Future[Any]) -> None:
        future.set_running_or_notify_cancel()
        try:
            future.set_result(call(engine))
        except BaseException as exc:  # handed to the waiting thread, which re-raises it
            future.set_exception(exc)

    for engine, future in zip(engines, futures, strict=True):
        name = "weightsync-call"
        threading.Thread(target=run, args=(engine, future), name=name, daemon=True).start()
    return futures


def collect(futures: Sequence[Future[Any]], *, timeout_s: float, what: str) -> list[Any]:
    """Waits for `in_threads`' futures, `timeout_s` at most; returns results or raises.

    Raises:
        WeightTransferTimeout: Some call is still running after `timeout_s`.
        Exception: The failures, as `call_each` describes.
    """
    _, pending = wait(futures, timeout=timeout_s)
    if pending:
        stuck = [i for i, f in enumerate(futures) if f in pending]
        raise WeightTransferTimeout(
            f"{what} did not return within {timeout_s:g} s (timeout_s) on engines {stuck}: "
            "they are stuck or unreachable; the calls are abandoned, not stopped"
        )
    errors = [f.exception() for f in futures]
    failures = [e for e in errors if e is not None]
    if failures:
        other = [e for e in failures if not isinstance(e, WeightValidationError)]
        raise (other or failures)[0]
    return [f.result() for f in futures]


def release_transfers(engines: Sequence[Any], *, timeout_s: float) -> None:
    """Has every engine leave the closing trainer's transfer; waits `timeout_s` at most, never raises.

    Each engine's `shutdown_weight_transfer_engine` frees what it held for the trainer (the
    group's connections and port, the mappings of its shared memory). An engine that fails or
    does not answer in time is logged: the trainer is closing, and its own close must finish.
    """
    futures = in_threads(engines, lambda engine: engine.shutdown_weight_transfer_engine())
    try:
        collect(futures, timeout_s=timeout_s, what="shutdown_weight_transfer_engine")
    except Exception as exc:
        logger.warning(
            "the engines did not all leave the transfer: %s: %s", type(exc).__name__, exc
        )
