"""Where weight updates meet the scheduler: who may update, who may generate, what pause follows.

[`LLMEngine`][weightsync.engine.llm_engine.LLMEngine]'s weight-update calls go through one
`UpdateGate`. It refuses an update on a busy, unpaused engine (and tells a broadcast's trainer
why), holds the scheduler paused while an update is in progress or weights are torn, and resumes
an engine that an update paused once the update ends. The rules of the update itself are
[`LiveWeights`][weightsync.engine.weights.LiveWeights]'.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from weightsync.engine._scheduler import Scheduler
from weightsync.engine.outputs import WeightVersion
from weightsync.engine.pause import PauseState
from weightsync.engine.weights import LiveWeights
from weightsync.errors import (
    EngineBusyError,
    EngineStateError,
    InvalidRequestError,
    TornWeightsError,
    WeightUpdateStateError,
)
from weightsync.transfer.base import TransferStats

logger = logging.getLogger(__name__)


def unwrap_request(request: Any, key: str, method: str) -> Any:
    """Takes `key` out of a vLLM-style request envelope (`{"update_info": {...}}`)."""
    if isinstance(request, Mapping) and key in request:
        return request[key]
    if not isinstance(request, Mapping) and hasattr(request, key):
        return getattr(request, key)
    got = sorted(request) if isinstance(request, Mapping) else type(request).__name__
    raise InvalidRequestError(
        f"{method} expects {{'{key}': {{...}}}} as in vLLM's LLM.{method}; got {got}"
    )


class UpdateGate:
    """Couples the weight updates of `weights` to the pause state of `scheduler`.

    An update that begins on a running engine pauses it (`keep`) and resumes it when it ends,
    unless the caller paused the engine meanwhile, or the update left weights torn.
    """

    def __init__(self, scheduler: Scheduler, weights: LiveWeights) -> None:
        self.scheduler = scheduler
        self.weights = weights
        self._resume_when_done = False  # an update paused the running engine

    def start(self) -> None:
        """Opens a transaction; an idle, unpaused engine pauses for it and resumes after it."""
        self.check_idle("start_weight_update")
        running = self.scheduler.state is PauseState.UNPAUSED
        self.weights.start()
        self._settle(running)

    def update(self, update_info: Any) -> TransferStats:
        """Receives one update message; a busy engine refuses it, and the trainer learns why."""
        try:
            self.check_idle("update_weights")
        except EngineBusyError as exc:
            self.weights.refuse(update_info, exc)
            raise
        running = self.scheduler.state is PauseState.UNPAUSED
        try:
            return self.weights.update(update_info)
        finally:
            self._settle(running)

    def finish(self, weight_version: WeightVersion | None) -> bool:
        """Ends the transaction; the engine returns to the pause state it had before it.

        Returns whether the update was applied (see `LiveWeights.finish`).
        """
        try:
            return self.weights.finish(weight_version)
        finally:
            self._settle(running=False)

    def abort(self) -> bool:
        """Ends the transaction on purpose; returns whether one was open."""
        try:
            return self.weights.abort()
        finally:
            self._settle(running=False)

    def caller_paused(self) -> None:
        """The caller paused the engine: the pause is theirs, and no update's end resumes it."""
        self._resume_when_done = False

    def _settle(self, running: bool) -> None:
        """Pauses while an update is open or weights are torn; resumes what an update paused.

        Args:
            running: The engine was unpaused when the call began.
        """
        in_update, torn = self.weights.in_update, self.weights.is_torn
        if in_update or torn:
            if self.scheduler.state is not PauseState.PAUSED:
                self.scheduler.pause("keep")  # queued and frozen requests wait for the update
                self._resume_when_done = running and in_update
            if torn:
                self._resume_when_done = False  # a torn engine resumes only when asked to
                logger.error("weights are torn: the engine stays paused")
        elif self._resume_when_done:
            self._resume_when_done = False
            self.scheduler.resume()

    def check_idle(self, call: str) -> None:
        """Raises `EngineBusyError` when requests run on an engine that is not paused."""
        # Requests still in the inbox have not started: they will simply run on the new weights.
        # While the weights hold generation (an open update, torn weights) nothing computes.
        state = self.scheduler.state
        busy = state is not PauseState.PAUSED and not self.weights.holds_generation
        if busy and self.scheduler.num_unfinished:
            what = (
                "a wait-mode pause is still draining"
                if state is PauseState.DRAINING
                else "it is not paused"
            )
            raise EngineBusyError(
                f"{call} needs a paused or idle engine, but {self.scheduler.num_unfinished} "
                f"requests are in flight and {what}: call pause_generation(mode='keep', 'wait' or "
                f"'abort') first, then {call}, then resume_generation()"
            )

    def check_can_generate(self, call: str) -> None:
        """Raises when `call` (`generate()` or `resume_generation()`) could not generate."""
        if self.weights.is_torn:
            raise TornWeightsError(
                f"{call}: {self.weights.torn_cause()}, so the engine does not generate: land an "
                "update that covers them with update_weights(...) first"
            )
        if self.weights.in_update:
            raise WeightUpdateStateError(
                f"{call}: a weight update is in progress: finish_weight_update(...) or "
                "abort_weight_update() first"
            )
        if call == "generate()" and self.scheduler.state is PauseState.PAUSED:
            raise EngineStateError(
                "the engine is paused, so generate() would wait forever: call "
                "resume_generation() first"
            )
