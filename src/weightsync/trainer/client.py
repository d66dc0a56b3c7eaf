"""`EngineClient`: the control calls a trainer makes on an inference engine, wherever it runs.

An engine in the trainer's own process ([`LLMEngine`][weightsync.engine.llm_engine.LLMEngine]) and
one in a process of its own ([`EngineProcess`][weightsync.trainer.engine_process.EngineProcess])
answer the same blocking calls, named as in vLLM's `LLM`: `init_weight_transfer_engine`, the
update transaction (`start_weight_update`, `update_weights`, `finish_weight_update`, and
weightsync's `abort_weight_update`), `shutdown_weight_transfer_engine`, `pause_generation` and
`resume_generation`. The weight senders and
[`sync_weights`][weightsync.trainer.sync.sync_weights] are written against this protocol only, so
one sync flow serves both. [`call_each`][weightsync.trainer.client.call_each] runs one call on
several engines (data-parallel replicas) at once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from weightsync.engine.outputs import WeightVersion
from weightsync.engine.pause import PauseMode
from weightsync.trainer._calls import collect, in_threads
from weightsync.transfer.base import CLIENT_MARGIN_S, DEFAULT_TIMEOUT_S, TransferStats

__all__ = ["EngineClient", "call_each"]

_T = TypeVar("_T")


class EngineClient(Protocol):
    """What the trainer side needs from an inference engine: weight transfer and pause control.

    Every call blocks until the engine has done it. `LLMEngine` and `EngineProcess` satisfy it
    as they are.
    """

    def init_weight_transfer_engine(self, request: Mapping[str, Any]) -> None:
        """Joins the trainer's transfer (`{"init_info": {...}}`); may block until it forms."""

    def start_weight_update(self) -> None:
        """Opens a weight-update transaction; no forward pass runs until it ends."""

    def update_weights(self, request: Mapping[str, Any]) -> TransferStats:
        """Receives one update message (`{"update_info": {...}}`); while paused or idle."""
        ...

    def finish_weight_update(self, weight_version: WeightVersion | None = None) -> None:
        """Ends the transaction; the version moves if every announced weight landed."""

    def abort_weight_update(self) -> bool:
        """Ends the transaction on purpose: as before if nothing moved, else torn or restored."""
        ...

    def shutdown_weight_transfer_engine(self) -> None:
        """Leaves the trainer's transfer and frees what it held; the trainer closes."""

    def pause_generation(self, *, mode: PauseMode = ..., clear_cache: bool = ...) -> None:
        """Pauses generation at a step boundary (`abort`, `wait` or `keep`)."""

    def resume_generation(self) -> None:
        """Resumes generation."""

    def get_world_size(self) -> int:
        """Transfer workers behind this engine: 1, or one per replica of a data-parallel server."""
        ...


def call_each(
    engines: Sequence[_T],
    call: Callable[[_T], Any],
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S + CLIENT_MARGIN_S,
    what: str = "the call",
) -> list[Any]:
    """Runs `call(engine)` for every engine at once and waits for all of them, `timeout_s` at most.

    Engines are independent (data-parallel replicas, say), so one slow engine does not hold up
    the others' calls; a broadcast receive needs exactly this, since every rank must be inside
    the collective before any of them can leave it. Each call runs on a daemon thread: one that
    never returns cannot keep the trainer from exiting.

    Args:
        engines: The engines (any objects `call` accepts).
        call: What to do with each one.
        timeout_s: Limit for all of them together, in seconds; keep it above the limit of what
            the calls wait for (see `CLIENT_MARGIN_S`).
        what: How the timeout's message names the call.

    Returns:
        The results, in the order of `engines`.

    Raises:
        WeightTransferTimeout: Some call did not return within `timeout_s`; the message lists
            the engines (by index) still inside it.
        Exception: When any call failed, after all of them ended: a `WeightValidationError` if
            every failure was one (the update was rejected and nothing moved), else the first
            other failure.

    >>> call_each([1, 2, 3], lambda n: n * 10)
    [10, 20, 30]
    """
    return collect(in_threads(engines, call), timeout_s=timeout_s, what=what)
