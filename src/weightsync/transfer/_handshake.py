"""The round that opens every broadcast update, held in the group's store: announce, answer, decide.

Before any tensor byte moves, the trainer announces its update `n`, every worker answers it
(ready, or refused and why), and the trainer publishes its decision; only a decision to go lets
the ranks into the collectives. The round lives in the store, not in a collective, so a worker
that refuses a message never waits for the trainer. A refusal reaches the trainer's update of
the same send (`_identity.send_identity`) and no other; a refusal kept from before its update
was on the line is taken only by an update announcing the very tensors the refused message
listed, and a later message of the same send that the worker accepts withdraws it.
docs/transfer/broadcast.md gives the rules and every interleaving. Keys, JSON values (`n` counts
the trainer's updates from 1): `update/latest`; `update/{n}` (the announcement);
`update/{n}/answer/{rank}`, written once; `update/{n}/decision`; `update/early/{rank}`
(refusals that found no update of theirs on the line, kept for the next one). Every value read
is checked for its form before use: any process that reaches the store can write into it.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any, Protocol

from weightsync.errors import WeightTransferError, WeightTransferTimeout, WeightValidationError
from weightsync.transfer._identity import metadata_digest
from weightsync.transfer.base import TensorSpec

__all__ = ["LATEST", "StoreGroup", "WorkerHandshake", "open_update"]

logger = logging.getLogger(__name__)

LATEST = "update/latest"
REASON_CHARS = 4000
"""A reason is cut to this many characters in the store (a refusal may list every tensor)."""
_EARLY_KEPT = 8
# The trainer polls its own store: every 0.5 ms while answers usually come, then backing off.
_EAGER_PAUSE_S, _EAGER_FOR_S, _LONGEST_PAUSE_S = 0.0005, 0.05, 0.05

answered_hook: Callable[[int], None] | None = None
"""Test hook: called on a worker with `n` once it answered update `n` ready, before it waits
for the trainer's decision. Fault tests stop the trainer there, to play that interleaving on
purpose. Unset, it does nothing."""


class StoreGroup(Protocol):
    """What the round needs of a group: its rank, world, timeout and store."""

    rank: int
    world_size: int
    timeout_s: float

    def set(self, key: str, value: Any) -> None: ...
    def has(self, keys: list[str]) -> bool: ...
    def lookup(self, key: str) -> Any: ...
    def get(self, key: str, timeout_s: float | None = None) -> Any: ...
    def set_once(self, key: str, value: Any) -> Any: ...
    def delete(self, key: str) -> None: ...
    def malformed(self, key: str, detail: str) -> WeightTransferError: ...


def _update_key(n: int) -> str:
    return f"update/{n}"


def _answer_key(n: int, rank: int) -> str:
    return f"update/{n}/answer/{rank}"


def _decision_key(n: int) -> str:
    return f"update/{n}/decision"


def _early_key(rank: int) -> str:
    return f"update/early/{rank}"


def _bounded(reason: str) -> str:
    return reason if len(reason) <= REASON_CHARS else reason[: REASON_CHARS - 3] + "..."


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _malformed(group: StoreGroup, key: str, value: object) -> WeightTransferError:
    return group.malformed(key, f"{value!r:.100}")


def _announcement(group: StoreGroup, n: int) -> dict[str, Any] | None:
    """The trainer's announcement of update `n`, checked (None if there is none)."""
    return _checked_announcement(group, n, group.lookup(_update_key(n)))


def _checked_announcement(group: StoreGroup, n: int, value: object) -> dict[str, Any] | None:
    """An announcement as read from the store, after checking its form."""
    if value is None:
        return None
    if isinstance(value, dict) and isinstance(value.get("send"), str):
        if "refused" in value and isinstance(value["refused"], str):
            return value
        if _is_int(value.get("tensors")) and _is_int(value.get("digest")):
            return value
    raise _malformed(group, _update_key(n), value)


def _checked_answer(value: object) -> dict[str, Any] | None:
    """An answer as stored, if it has the form of one."""
    if isinstance(value, dict) and (
        value.get("ok") is True or isinstance(value.get("refused"), str)
    ):
        return value
    return None


def _checked_decision(group: StoreGroup, n: int, value: object) -> dict[str, Any] | None:
    """A decision as read from the store, after checking its form (None if there is none)."""
    if value is None:
        return None
    if isinstance(value, dict) and (
        value.get("go") is True
        or isinstance(value.get("refused"), str)
        or isinstance(value.get("timeout"), str)
    ):
        return value
    raise _malformed(group, _decision_key(n), value)


def _rejected(reasons: str) -> WeightValidationError:
    return WeightValidationError(f"update rejected before any byte moved by {reasons}")


# --- the trainer's side -----------------------------------------------------------------------


def open_update(
    group: StoreGroup,
    n: int,
    send: str,
    specs: Sequence[TensorSpec] | None,
    problem: WeightValidationError | None,
    *,
    receiving: Sequence[Future[Any]] = (),
    rank_offset: int = 1,
) -> None:
    """Announces update `n`, collects every worker's answer, and publishes the decision.

    Args:
        group: The trainer's end of the group (rank 0).
        n: The update's number: one more than the trainer's previous one.
        send: `send_identity` of the update info the workers were given.
        specs: The announced tensors; None when the trainer cannot send them.
        problem: The trainer's own reason to refuse its update, if any.
        receiving: The workers' calls that deliver the message, in worker order, when this
            process made them: one that failed is that worker's refusal.
        rank_offset: Rank of the first worker (whose call is `receiving[0]`).

    Raises:
        WeightValidationError: Some worker (or the trainer) refused; nothing moved, the group
            stays usable. The message names each refusing rank and its reason.
        WeightTransferTimeout: Some worker did not answer within `timeout_s`.
    """
    if specs is None or problem is not None:
        problem = problem or WeightValidationError("the trainer has no tensors to send")
        reason = _bounded(str(problem))
        _decide(group, n, {"refused": f"rank 0: {reason}"})  # first: no worker answers it
        group.set(_update_key(n), {"send": send, "refused": reason})
        group.set(LATEST, n)
        raise problem
    digest = metadata_digest(specs)
    group.set(_update_key(n), {"send": send, "tensors": len(specs), "digest": digest})
    group.set(LATEST, n)
    deadline = time.monotonic() + group.timeout_s
    answers = _collect(group, n, send, digest, receiving, rank_offset, deadline)
    silent = [rank for rank in range(1, group.world_size) if rank not in answers]
    refusals = [
        f"rank {r}: {_bounded(a['refused'])}" for r, a in sorted(answers.items()) if "refused" in a
    ]
    if refusals:
        if silent:
            refusals.append(f"ranks {silent} did not answer within {group.timeout_s:g} s")
        reasons = "; ".join(refusals)
        _decide(group, n, {"refused": _bounded(reasons)})
        raise _rejected(reasons)
    if silent:
        message = (
            f"the update handshake timed out after {group.timeout_s:g} s (timeout_s): ranks "
            f"{silent} never answered update #{n}: their engines got no update_weights call "
            "for it, or are stuck"
        )
        _decide(group, n, {"timeout": message})
        raise WeightTransferTimeout(message)
    _decide(group, n, {"go": True})


def _decide(group: StoreGroup, n: int, decision: dict[str, Any]) -> None:
    """Publishes the decision on update `n`, then forgets the rounds no worker reads any more."""
    group.set(_decision_key(n), decision)
    _forget(group, n - 2)


def _collect(
    group: StoreGroup,
    n: int,
    send: str,
    digest: int,
    receiving: Sequence[Future[Any]],
    rank_offset: int,
    deadline: float,
) -> dict[int, dict[str, Any]]:
    """Every worker's answer to update `n` that came before `deadline`, by rank."""
    answers: dict[int, dict[str, Any]] = {}
    eager_until, pause = time.monotonic() + _EAGER_FOR_S, _EAGER_PAUSE_S
    while True:
        for rank in range(1, group.world_size):
            if rank in answers:
                continue
            key = _answer_key(n, rank)
            value = group.lookup(key)
            if value is None:
                early = _early_refusal(group, rank, n, send, digest)
                failed = _failed_call(receiving, rank - rank_offset)
                if early is not None:
                    value = group.set_once(key, {"refused": _bounded(early)})
                elif failed is not None:  # the worker never saw the message: "unseen"
                    value = group.set_once(key, {"refused": _bounded(failed), "unseen": True})
            if value is not None:
                answer = _checked_answer(value)
                if answer is None:  # no weightsync worker wrote it: the store is not to trust
                    raise _malformed(group, key, value)
                answers[rank] = answer
        now = time.monotonic()
        if len(answers) == group.world_size - 1 or now >= deadline:
            return answers
        calls = [call for call in receiving if not call.done()]
        if calls:  # a call that fails wakes this up at once
            wait(calls, timeout=pause, return_when=FIRST_COMPLETED)
        else:
            time.sleep(pause)
        if now > eager_until:
            pause = min(2 * pause, _LONGEST_PAUSE_S)


def _early_refusal(group: StoreGroup, rank: int, n: int, send: str, digest: int) -> str | None:
    """A refusal `rank` made before update `n` was on the line, if it refused this very update.

    That is a message of the same send that listed the very tensors update `n` announces: a
    refused message of the send listing other tensors (a stray or mangled copy) is no answer
    to this update, which waits for the worker's own.
    """
    key = _early_key(rank)
    kept = group.lookup(key)
    if kept is not None and not isinstance(kept, list):
        raise _malformed(group, key, kept)
    for entry in kept or ():
        if (
            isinstance(entry, dict)
            and entry.get("update") == n
            and entry.get("send") == send
            and _is_int(entry.get("digest"))
            and entry.get("digest") == digest
            and isinstance(entry.get("refused"), str)
        ):
            return entry["refused"]  # type: ignore[no-any-return]
    return None


def _failed_call(receiving: Sequence[Future[Any]], index: int) -> str | None:
    """Why the call delivering the message to worker `index` failed, if it did."""
    if not 0 <= index < len(receiving) or not receiving[index].done():
        return None
    error = receiving[index].exception()
    return None if error is None else f"{type(error).__name__}: {error}"


def _forget(group: StoreGroup, n: int) -> None:
    """Deletes the keys of update `n`, so that the store does not grow with every update."""
    if n < 1:
        return
    for key in (_update_key(n), _decision_key(n)):
        group.delete(key)
    for rank in range(1, group.world_size):
        group.delete(_answer_key(n, rank))


# --- a worker's side --------------------------------------------------------------------------


class WorkerHandshake:
    """One worker's side of the round, for the life of its group.

    Args:
        group: The worker's end of the group.
    """

    def __init__(self, group: StoreGroup) -> None:
        self._group = group
        self._early: deque[dict[str, Any]] = deque(maxlen=_EARLY_KEPT)
        self._went = 0  # the last update this worker received: nothing more to read about it

    def _latest(self) -> int:
        value = self._group.lookup(LATEST)
        if value is None:
            return 0
        if not _is_int(value) or value < 1:
            raise _malformed(self._group, LATEST, value)
        return int(value)

    def refuse(self, send: str, reason: str, digest: int | None = None) -> bool:
        """Refuses the message of `send` at once: this never waits for the trainer.

        It answers the trainer's newest update if that one is of `send` and undecided (decided:
        the trainer went on without this rank, nothing is left to say); otherwise it is kept
        for the trainer's next update, which takes it only if that one is of `send` and
        announces the tensors of `digest` (`metadata_digest` of the message's tensors; None
        when it lists none that can be read: then no later update takes it). Returns False when
        the store cannot be reached: the trainer is gone, and so is its group.
        """
        group, reason = self._group, _bounded(reason)
        try:
            n = self._latest()
            announced = _announcement(group, n) if n else None
            if announced is not None and announced["send"] == send:
                key = _answer_key(n, group.rank)
                if group.lookup(key) is None:
                    if group.lookup(_decision_key(n)) is None:
                        group.set_once(key, {"refused": reason})
                    return True
            self._early.append({"update": n + 1, "send": send, "digest": digest, "refused": reason})
            group.set(_early_key(group.rank), list(self._early))
        except WeightTransferError as exc:
            logger.warning("rank %d refused an update, but the trainer's store is gone: %s",
                           group.rank, str(exc).splitlines()[0][:300])  # fmt: skip
            return False
        return True

    def trainer_is_gone(self) -> bool:
        """Whether the trainer's store stopped answering (the trainer closed its group or died)."""
        try:
            self._group.has([LATEST])  # reaches the store without reading what another wrote
        except WeightTransferError as exc:
            # Expected (a trainer closes its group when it is done): one line; torch's own
            # failure, with its C++ frames, is the cause, for a debug log.
            logger.info("rank %d: the trainer closed its group or stopped (%s); its connections "
                        "are released, and the next trainer joins with "
                        "init_weight_transfer_engine", self._group.rank,
                        str(exc)[:300])  # fmt: skip
            logger.debug("rank %d: how the trainer's store failed", self._group.rank,
                         exc_info=exc)  # fmt: skip
            return True
        return False

    def join(self, send: str, specs: Sequence[TensorSpec]) -> None:
        """Answers the trainer's update of an accepted message; returns once it is to go.

        The message answers the trainer's newest undecided update, or the next one to come.
        Waits `timeout_s` at most in all, for the update and for the trainer's decision.

        Raises:
            WeightValidationError: A rank refused the update (this one, if the trainer announced
                other metadata than the message's); nothing moved.
            WeightTransferTimeout: No update came, or no decision, within `timeout_s`.
            WeightTransferError: The store cannot be reached (the trainer is gone).
        """
        group = self._group
        deadline = time.monotonic() + group.timeout_s
        self._withdraw(send)
        n = self._latest()
        announced = _announcement(group, n) if n and n != self._went else None
        if n and n != self._went and announced is None:  # the trainer writes it before `latest`
            raise _malformed(group, LATEST, f"{n}, but update {n} was never announced")
        while True:
            if announced is not None:
                decided = _checked_decision(group, n, group.lookup(_decision_key(n)))
                if decided is None and "refused" in announced:  # the trainer refuses its own
                    decided = {"refused": f"rank 0: {announced['refused']}"}
                if decided is None:
                    return self._answer(n, announced, specs, deadline)
                if announced["send"] == send:
                    mine = group.lookup(_answer_key(n, group.rank))
                    _refuse_again(n, _checked_answer(mine), decided)
            n += 1
            value = self._wait(_update_key(n), deadline, "no update of the trainer's arrived")
            announced = _checked_announcement(group, n, value)

    def _withdraw(self, send: str) -> None:
        """Withdraws the kept refusals of `send`: this accepted message of it supersedes them."""
        kept = [entry for entry in self._early if entry["send"] != send]
        if len(kept) < len(self._early):
            self._early = deque(kept, maxlen=_EARLY_KEPT)
            self._group.set(_early_key(self._group.rank), kept)

    def _answer(
        self, n: int, announced: dict[str, Any], specs: Sequence[TensorSpec], deadline: float
    ) -> None:
        """Answers update `n` for an accepted message, then waits for the decision."""
        group = self._group
        problem = None
        if announced["tensors"] != len(specs) or announced["digest"] != metadata_digest(specs):
            problem = WeightValidationError(
                f"the update info this worker got ({len(specs)} tensors) differs from what the "
                f"trainer sends ({announced['tensors']} tensors): send both sides the same "
                "update_info"
            )
        mine = {"refused": _bounded(str(problem))} if problem else {"ok": True}
        stored = group.set_once(_answer_key(n, group.rank), mine)
        if stored != mine:  # the trainer took an earlier refusal of this same send as the answer
            answer = _checked_answer(stored)
            if answer is None or "refused" not in answer:
                raise _malformed(group, _answer_key(n, group.rank), stored)
            raise _rejected(f"rank {group.rank}: {_bounded(answer['refused'])}")
        if problem is not None:
            raise problem
        if answered_hook is not None:
            answered_hook(n)
        value = self._wait(_decision_key(n), deadline, "the trainer decided nothing")
        decision = _checked_decision(group, n, value)
        if decision is None:  # a JSON null under the key: not the trainer's
            raise _malformed(group, _decision_key(n), value)
        if decision.get("go") is True:
            self._went = n
            return
        if isinstance(decision.get("refused"), str):
            raise _rejected(_bounded(decision["refused"]))
        raise WeightTransferTimeout(_bounded(decision["timeout"]))

    def _wait(self, key: str, deadline: float, what: str) -> Any:
        """Waits for `key` until `deadline`; a timeout names the whole round's limit."""
        timeout_s = self._group.timeout_s
        try:
            return self._group.get(key, max(deadline - time.monotonic(), 0.001))
        except WeightTransferTimeout:
            raise WeightTransferTimeout(
                f"the update handshake timed out after {timeout_s:g} s (timeout_s): {what}: the "
                "trainer did not call trainer_send_weights for this update, or is stuck"
            ) from None


def _refuse_again(n: int, mine: dict[str, Any] | None, decided: object) -> None:
    """Raises when a message of update `n`'s send comes after `n` was decided without it.

    That is when this worker never answered `n`, or only the trainer did for it (the call that
    was to bring the message failed): the message is late, and `n`'s refusal is its answer.
    Returns when this worker took part in `n`, ready or refusing a message of it: the message
    is then for a later update of the same send (a retry, say).
    """
    if mine is not None and not mine.get("unseen"):
        return
    reason: object = mine["refused"] if mine is not None else None
    if isinstance(decided, dict):
        reason = decided.get("refused") or decided.get("timeout") or reason
    raise WeightValidationError(
        f"update #{n}, which this message belongs to, was refused "
        f"({str(reason)[:REASON_CHARS]}): nothing moved; send the update again"
    )
