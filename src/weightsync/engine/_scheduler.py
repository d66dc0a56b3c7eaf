"""`Scheduler`: continuous batching under a token budget, and the pause state machine.

Every step the scheduler picks the tokens to compute: first one more token for each running
sequence (or the next chunk of an unfinished prefill), then, while the budget, `max_num_seqs` and
the KV cache allow, it admits waiting sequences, reusing cached prefix blocks. When the KV cache
runs out, the most recently admitted sequence is preempted: its blocks are freed and it goes back
to the front of the queue, to be recomputed from its tokens later.

Pause states (see `PauseState`):

- `abort` finishes every unfinished sequence with `finish_reason="abort"`, then pauses.
- `wait` stops admitting and lets running sequences finish (`DRAINING`), then pauses.
- `keep` pauses at once; running sequences stay as they are and continue after resume.

While paused nothing is scheduled and new requests queue. `reset_cache` (for `clear_cache=True`)
frees every block: kept sequences go back to the queue and recompute their KV on resume.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import get_args

from weightsync.engine._armed_pause import ArmedPause
from weightsync.engine._kv_cache import BlockManager
from weightsync.engine._sequence import Sequence, SequenceStatus
from weightsync.engine.config import EngineConfig
from weightsync.engine.pause import PauseMode, PauseState
from weightsync.errors import InvalidRequestError

logger = logging.getLogger(__name__)

_PAUSE_MODES = get_args(PauseMode)


def check_pause_mode(mode: object) -> PauseMode:
    """The pause mode, checked: `abort`, `wait` or `keep`.

    Raises:
        InvalidRequestError: Another value.
    """
    if mode not in _PAUSE_MODES:
        raise InvalidRequestError(f"pause mode must be one of {list(_PAUSE_MODES)}, got {mode!r}")
    return mode  # type: ignore[return-value]


@dataclass
class ScheduledSequence:
    """A sequence and how many of its tokens this step computes.

    Attributes:
        seq: The sequence.
        num_tokens: Tokens computed this step, starting at `seq.num_computed_tokens`.
    """

    seq: Sequence
    num_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this step reaches the sequence's last token, so a next token is sampled."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens


class Scheduler:
    """Decides each step's batch and holds the waiting and running sequences.

    Args:
        config: Budgets and limits.
        block_manager: The KV cache's blocks.
    """

    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.state = PauseState.UNPAUSED
        self.num_preemptions = 0
        self.armed_pause: ArmedPause | None = None

    def armed_pause_is_due(self) -> bool:
        """Whether the armed pause is due: generation runs and every request has its tokens.

        Checked only while running, so a caller may arm on a paused engine, then resume.
        """
        armed = self.armed_pause
        if armed is None or self.state is not PauseState.UNPAUSED:
            return False
        return all(
            s.num_output_tokens >= armed.after_tokens for s in [*self.running, *self.waiting]
        )

    def fire_armed_pause(self, start_pause: Callable[..., None]) -> None:
        """Starts the armed pause through `start_pause(mode=, clear_cache=)` if it is due."""
        armed = self.armed_pause
        if armed is not None and self.armed_pause_is_due():
            self.armed_pause = None
            start_pause(mode=armed.mode, clear_cache=armed.clear_cache)
            if armed.on_pause is not None:
                armed.on_pause()

    @property
    def num_unfinished(self) -> int:
        """Waiting plus running sequences."""
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence) -> None:
        """Queues a new sequence (also while paused: it starts after resume)."""
        self.waiting.append(seq)

    def can_schedule(self) -> bool:
        """Whether `schedule` may return work: not paused and something is unfinished."""
        if self.state is PauseState.PAUSED:
            return False
        if self.state is PauseState.DRAINING:
            return bool(self.running) or bool(self.waiting and self.waiting[0].was_started)
        return self.num_unfinished > 0

    # --- one step -----------------------------------------------------------------------------

    def schedule(self) -> list[ScheduledSequence]:
        """Returns this step's batch and reserves KV slots for it (empty while paused)."""
        if self.state is PauseState.PAUSED:
            return []
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        queue = list(self.running)
        self.running = []
        preempted = False
        while queue:
            seq = queue.pop(0)
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            if num_tokens == 0:  # out of budget: it waits for the next step, keeping its blocks
                self.running.append(seq)
                continue
            while not self.block_manager.can_append(seq, num_tokens):
                preempted = True
                victim = queue.pop() if queue else seq
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                self.block_manager.append_slots(seq, num_tokens)
                scheduled.append(ScheduledSequence(seq, num_tokens))
                self.running.append(seq)
                budget -= num_tokens
        if not preempted:
            self._admit(scheduled, budget)
        return scheduled

    def _admit(self, scheduled: list[ScheduledSequence], budget: int) -> None:
        """Moves waiting sequences into the batch while budget, seats and blocks allow."""
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self._next_waiting()
            # A wait-mode pause admits only sequences that were preempted, never new ones.
            if seq is None or (self.state is PauseState.DRAINING and not seq.was_started):
                break
            hits = self.block_manager.match_prefix(seq)
            cached_tokens = len(hits) * self.block_manager.block_size
            num_tokens = min(seq.num_tokens - cached_tokens, budget)
            if not self.block_manager.can_allocate(hits, cached_tokens + num_tokens):
                break
            self.waiting.remove(seq)
            self.block_manager.allocate(seq, hits, cached_tokens + num_tokens)
            if not seq.was_started:
                seq.num_cached_tokens = cached_tokens
            seq.was_started = True
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSequence(seq, num_tokens))
            budget -= num_tokens

    def _next_waiting(self) -> Sequence | None:
        """The first waiting sequence whose LoRA adapter fits `max_loras` beside the running ones.

        A sequence whose adapter would be one too many keeps its place in the queue (vLLM holds
        it back the same way), and later sequences of the running adapters may start before it;
        the base model always fits. So that it never waits for ever while those keep coming, it
        lets at most `max_num_seqs` of them pass: then the running adapters drain (only the base
        model's sequences pass it) until a slot frees for its adapter.
        """
        active = {id(s.lora) for s in self.running if s.lora is not None}
        held: list[Sequence] = []
        for seq in self.waiting:
            if seq.lora is None:
                return seq
            if id(seq.lora) not in active and len(active) >= self.config.max_loras:
                held.append(seq)
            elif any(h.times_passed >= self.config.max_num_seqs for h in held):
                continue  # draining: no more of the running adapters before the held one
            else:
                for h in held:
                    h.times_passed += 1
                return seq
        return None

    def _preempt(self, seq: Sequence) -> None:
        """Frees `seq`'s blocks and queues it first, to be recomputed from its tokens."""
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        logger.debug("preempted %s: the KV cache is full", seq.request_id)

    def finish_step(self, batch: list[ScheduledSequence]) -> None:
        """Records the computed tokens of a step, offers full blocks for reuse, drops finished."""
        for item in batch:
            item.seq.num_computed_tokens += item.num_tokens
            if not item.seq.is_finished:
                self.block_manager.register_full_blocks(item.seq)
        if any(s.is_finished for s in self.running):
            for seq in [s for s in self.running if s.is_finished]:
                self.block_manager.free(seq)
            self.running = [s for s in self.running if not s.is_finished]
        self._end_drain_if_done()

    def _end_drain_if_done(self) -> None:
        """Completes a `wait` pause once nothing it waits for is left."""
        if self.state is PauseState.DRAINING and not self.can_schedule():
            self.state = PauseState.PAUSED

    # --- aborts and pauses ----------------------------------------------------------------------

    def abort(self, request_ids: set[str]) -> list[Sequence]:
        """Finishes the unfinished sequences among `request_ids` with reason `abort`."""
        aborted = [s for s in (*self.running, *self.waiting) if s.request_id in request_ids]
        for seq in aborted:
            self.block_manager.free(seq)
            seq.finish("abort")
        if aborted:
            self.running = [s for s in self.running if not s.is_finished]
            self.waiting = deque(s for s in self.waiting if not s.is_finished)
            self._end_drain_if_done()
        return aborted

    def pause(self, mode: PauseMode) -> list[Sequence]:
        """Enters a pause; returns the sequences aborted by an `abort` pause.

        Pausing again is harmless: `abort` aborts what is unfinished now, `keep` freezes a
        draining `wait` pause at once, `wait` on a paused scheduler changes nothing.

        Raises:
            InvalidRequestError: `mode` is not one of `abort`, `wait`, `keep`.
        """
        check_pause_mode(mode)
        aborted: list[Sequence] = []
        if mode == "abort":
            aborted = self.abort({s.request_id for s in (*self.running, *self.waiting)})
            self.state = PauseState.PAUSED
        elif mode == "keep":
            self.state = PauseState.PAUSED
        elif self.state is PauseState.UNPAUSED:
            self.state = PauseState.DRAINING
            self._end_drain_if_done()
        return aborted

    def resume(self) -> None:
        """Leaves any pause (a draining `wait` pause is cancelled)."""
        self.state = PauseState.UNPAUSED

    def reset_cache(self) -> None:
        """Frees every KV block and the prefix cache; kept sequences will recompute their KV.

        Running sequences go back to the front of the queue, in order, keeping their tokens.
        """
        for seq in reversed(self.running):
            seq.reset_kv()
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)
        self.running = []
        self.block_manager.reset()
