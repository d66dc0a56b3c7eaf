"""Trainer-rooted broadcast, both ends: backend `nccl` (CUDA tensors) and `gloo` (CPU tensors).

Both backends speak one protocol over a group of their own (rank 0 the trainer, workers from
`rank_offset`). The trainer announces each update in the group's store; every worker answers,
ready or refused and why; the trainer decides, and a refusal anywhere stops everyone before any
byte moves. Then the buckets are broadcast, at most `num_buffers` in flight, and each worker loads
them as they land or receives them straight into its parameters. A rank that fails mid-transfer
writes its reason to the store and closes the group: its peers fail at once with that reason.
docs/transfer/broadcast.md gives the handshake's rules and every interleaving.

One concept: the broadcast protocol, both of its ends, so that one update reads in one file.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import json
import logging
import secrets
import threading
import time
import traceback
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, FIRST_EXCEPTION, Future, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from weightsync.errors import (
    DuplicateMessageError,
    WeightSyncError,
    WeightTransferError,
    WeightTransferTimeout,
    WeightValidationError,
)
from weightsync.transfer.base import (
    LoadWeightsFn,
    TensorSpec,
    TransferStats,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
    WireParams,
    _is_int,
    _parse_info,
    _Watch,
    _WireKeywords,
    dtype_name,
)
from weightsync.transfer.buckets import (
    Bucket,
    Slot,
    _announced_buckets,
    _AnnouncedTensors,
    _BufferPool,
    _byte_buffers,
    _direct_region,
    _DirectRegion,
    _Window,
    pack_bucket,
    plan_buckets,
    unpack_bucket,
)
from weightsync.transfer.group import (
    INIT_ERRORS,
    BroadcastGroup,
    BroadcastWork,
    check_backend,
    check_port,
)

if TYPE_CHECKING:  # typing.Unpack for **kwargs is Python 3.12+
    from typing_extensions import Unpack

__all__ = [
    "GlooWeightTransferEngine",
    "NCCLTrainerSendWeightsArgs",
    "NCCLWeightTransferEngine",
    "NCCLWeightTransferInitInfo",
    "TrainerGroup",
    "trainer_init",
    "trainer_send_weights",
]

logger = logging.getLogger(__name__)

_DEFAULT_WIRE = WireParams()  # the one place the wire's defaults are set
_WIRE_KEYS = ("backend", "world_size", *_DEFAULT_WIRE.to_dict())
_ERRORS_SHOWN = 5  # join errors quoted when the group does not form
_REPORT_READ_S = 1.0  # the reasons are in the trainer's own store: a read is instant


# --- the init info: how a worker joins ----------------------------------------------------------


@dataclass
class NCCLWeightTransferInitInfo(WeightTransferInitInfo):
    """How a worker joins a trainer's broadcast group; built by the trainer, never by hand.

    Take it from [`TrainerGroup.init_info`][weightsync.transfer.nccl.TrainerGroup.init_info]:
    the wire parameters (`packed` to `timeout_s`) are decided by the trainer and checked again
    against the trainer's own copy when the worker joins.

    Attributes:
        master_address: Host of the trainer (it runs the group's store).
        master_port: Port of the trainer's store.
        world_size: 1 (the trainer) + the number of workers.
        rank_offset: Rank of the first worker; worker `i` is rank `rank_offset + i`.
        backend: `"nccl"` (CUDA tensors) or `"gloo"` (CPU tensors).
        packed: Whether tensors travel packed into buckets (True) or one broadcast each.
        bucket_size_bytes: Bucket size in bytes (packed mode).
        num_buffers: Buckets in flight at once; also the number of reusable bucket buffers.
        timeout_s: Limit for the rendezvous and each collective, in seconds.
    """

    master_address: str
    master_port: int
    world_size: int
    rank_offset: int = 1
    backend: str = "nccl"
    packed: bool = _DEFAULT_WIRE.packed
    bucket_size_bytes: int = _DEFAULT_WIRE.bucket_size_bytes
    num_buffers: int = _DEFAULT_WIRE.num_buffers
    timeout_s: float = _DEFAULT_WIRE.timeout_s

    def __post_init__(self) -> None:
        if not isinstance(self.master_address, str) or not self.master_address:
            raise WeightValidationError(
                f"master_address must be a non-empty host name, got {self.master_address!r}"
            )
        check_port(self.master_port, allow_zero=False)
        for key, low in (("world_size", 2), ("rank_offset", 1)):
            value = getattr(self, key)
            if not _is_int(value) or value < low:
                raise WeightValidationError(f"{key} must be an int >= {low}, got {value!r}")
        self.timeout_s = self.wire.timeout_s  # validates the four, and keeps a float on the wire

    @classmethod
    def create(cls, *, wire: WireParams, **where: Any) -> NCCLWeightTransferInitInfo:
        """The init info of a group (`master_address`, ...) with these wire parameters."""
        return cls(**where, **wire.to_dict())

    @property
    def wire(self) -> WireParams:
        """The wire parameters, validated."""
        return WireParams(**{key: getattr(self, key) for key in _DEFAULT_WIRE.to_dict()})

    def wire_params(self) -> dict[str, object]:
        """Returns the parameters both sides must agree on."""
        return {key: getattr(self, key) for key in _WIRE_KEYS}


# vLLM's worker init info names two wire parameters its own way and no backend (a vLLM server
# takes it from its configuration); its update info of 0.16 to 0.25 repeated three wire
# parameters, which TRL still sends to servers older than 0.28.
_VLLM_INIT_KEYS = {
    "packed_buffer_size_bytes": "bucket_size_bytes",
    "packed_num_buffers": "num_buffers",
}
_VLLM_UPDATE_WIRE_KEYS = {"packed": "packed", **_VLLM_INIT_KEYS}


# --- what ties a worker's answer to the trainer's update ----------------------------------------


def _metadata_digest(specs: Sequence[TensorSpec]) -> int:
    """A 63-bit digest of names, dtypes and shapes, to catch sides that announce different things."""
    text = json.dumps([[s.name, dtype_name(s.dtype), list(s.shape)] for s in specs])
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def _send_identity(update_info: object) -> str:
    """Which send a message belongs to (16 hex digits): its `send_id`, else its content."""
    # A message mangled on its way keeps its send; a stray one has another.
    if isinstance(update_info, WeightTransferUpdateInfo):
        update_info = update_info.to_dict()
    key: Any = ["content", update_info]
    if isinstance(update_info, Mapping) and isinstance(update_info.get("send_id"), str):
        key = ["send_id", update_info["send_id"]]
    elif isinstance(update_info, Mapping):  # null fields are as good as absent (to_dict omits them)
        # vLLM's older wire keys describe the wire, not the message: a trainer's copy may lack them.
        wire_keys = _VLLM_UPDATE_WIRE_KEYS
        content = {k: v for k, v in update_info.items() if v is not None and k not in wire_keys}
        key = ["content", content]
    try:
        text = json.dumps(key, sort_keys=True, default=repr)
    except (TypeError, ValueError, RecursionError):  # keys of mixed types, a nesting too deep
        text = secrets.token_hex(8)  # nothing to recognise it by: it pairs with nothing
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


# --- steps 1 to 3: the handshake, one small state machine held in the group's store -------------
#
# Update n (counted from 1) in the store; any process that reaches it can write there, so every
# value read is checked for its form (docs/transfer/wire.md lists the keys):
#   update/{n}                {send, tensors, digest}, or the trainer's {send, refused}; then
#   update/latest = n         ANNOUNCED by the trainer
#   update/{n}/answer/{rank}  {ok: true} or {refused}, set once by the worker, or by the trainer
#                             for a failed call ({refused, unseen}) or a refusal kept for n
#   update/{n}/decision       {go: true}, {refused} or {timeout}: DECIDED by the trainer
#   update/early/{rank}       a worker's refusals that found no open update of their send
# The trainer: ANNOUNCE -> COLLECT answers (all, or until timeout_s) -> DECIDE, then forgets
# update n-2. A worker finds update n in one phase, where a message of send S does:
#   AWAITED  join waits for it;  refuse keeps its refusal for it
#   OPEN     join answers (refused, if the trainer announced other tensors) and waits for the
#            decision;  refuse answers refused, if n is S's
#   DECIDED  join goes on to n + 1, unless n was S's and went without this worker (the message
#            is late: refused);  refuse of S's unanswered update says nothing more

_LATEST = "update/latest"
_REASON_CHARS = 4000  # a reason is cut to this in the store (a refusal may list every tensor)
_EARLY_KEPT = 8
# The trainer polls its own store: every 0.5 ms while answers usually come, then backing off.
_EAGER_PAUSE_S, _EAGER_FOR_S, _LONGEST_PAUSE_S = 0.0005, 0.05, 0.05
_PEER_REASON_CHARS = 1000  # of a peer's abort note, in an error message
_ABORT_NOTE_S = 1.0  # a live store answers for notes at once; a stopped one is not waited out

# Test hook, called on a worker with `n` once it answered update `n` ready, before it waits for
# the decision (fault tests stop the trainer there).
_answered_hook: Callable[[int], None] | None = None


class _NotAnnounced(WeightTransferTimeout):
    """No update was announced for a worker's message: nothing is on the wire, the group is usable."""


class _Phase(enum.Enum):
    AWAITED = "not announced yet"
    OPEN = "announced, undecided"
    DECIDED = "decided"


_update_key, _decision_key = "update/{}".format, "update/{}/decision".format
_answer_key, _early_key = "update/{}/answer/{}".format, "update/early/{}".format


def _cut(reason: str) -> str:
    return reason if len(reason) <= _REASON_CHARS else reason[: _REASON_CHARS - 3] + "..."


def _checked(group: BroadcastGroup, key: str, value: Any) -> Any:
    """`value` read under `key` if None or of the form that key holds; else the store is untrusted."""
    v = value if isinstance(value, dict) else {}
    if key.endswith("/decision"):
        ok = v.get("go") is True or any(isinstance(v.get(k), str) for k in ("refused", "timeout"))
    elif "/answer/" in key:
        ok = v.get("ok") is True or isinstance(v.get("refused"), str)
    else:  # the announcement, update/{n}
        counted = _is_int(v.get("tensors")) and _is_int(v.get("digest"))
        ok = isinstance(v.get("send"), str) and (isinstance(v.get("refused"), str) or counted)
    if value is None or ok:
        return value
    raise group.malformed(key, f"{value!r:.100}")


def _rejected(reasons: str) -> WeightValidationError:
    return WeightValidationError(f"update rejected before any byte moved by {reasons}")


def _open_update(
    group: BroadcastGroup,
    n: int,
    send: str,
    specs: Sequence[TensorSpec] | None,
    problem: WeightValidationError | None,
    *,
    receiving: Sequence[Future[Any]] = (),
    rank_offset: int = 1,
) -> None:
    """The trainer's side: ANNOUNCE update `n`, COLLECT every answer, DECIDE; raises unless go."""
    # `receiving`: the workers' calls delivering the message (from rank `rank_offset`), when this
    # process made them: one that failed is that worker's refusal.
    if specs is None or problem is not None:  # the trainer refuses its own update
        problem = problem or WeightValidationError("the trainer has no tensors to send")
        _decide(group, n, {"refused": f"rank 0: {_cut(str(problem))}"})  # first: none answers it
        group.set(_update_key(n), {"send": send, "refused": _cut(str(problem))})
        group.set(_LATEST, n)
        raise problem
    digest = _metadata_digest(specs)
    group.set(_update_key(n), {"send": send, "tensors": len(specs), "digest": digest})
    group.set(_LATEST, n)
    calls = {rank_offset + i: call for i, call in enumerate(receiving)}
    answers = _collect(group, n, send, digest, calls)
    silent = [rank for rank in range(1, group.world_size) if rank not in answers]
    refusals = [
        f"rank {r}: {_cut(a['refused'])}" for r, a in sorted(answers.items()) if "refused" in a
    ]
    if refusals:
        if silent:
            refusals.append(f"ranks {silent} did not answer within {group.timeout_s:g} s")
        _decide(group, n, {"refused": _cut("; ".join(refusals))})
        raise _rejected("; ".join(refusals))
    if silent:
        message = (
            f"the update handshake timed out after {group.timeout_s:g} s (timeout_s): ranks "
            f"{silent} never answered update #{n}: their engines got no update_weights call "
            "for it, or are stuck"
        )
        _decide(group, n, {"timeout": message})
        raise WeightTransferTimeout(message)
    _decide(group, n, {"go": True})


def _decide(group: BroadcastGroup, n: int, decision: dict[str, Any]) -> None:
    """DECIDE: publishes the decision on `n`, then forgets update n-2, which no worker reads."""
    group.set(_decision_key(n), decision)
    if n > 2:
        answers = [_answer_key(n - 2, rank) for rank in range(1, group.world_size)]
        for key in [_update_key(n - 2), _decision_key(n - 2), *answers]:
            group.delete(key)


def _collect(
    group: BroadcastGroup, n: int, send: str, digest: int, calls: dict[int, Future[Any]]
) -> dict[int, dict[str, Any]]:
    """COLLECT: every worker's answer to `n` that came within `timeout_s`, by rank."""
    answers: dict[int, dict[str, Any]] = {}
    now = time.monotonic()
    deadline, eager_until, pause = now + group.timeout_s, now + _EAGER_FOR_S, _EAGER_PAUSE_S
    while True:
        for rank in range(1, group.world_size):
            key = _answer_key(n, rank)
            value = None if rank in answers else group.lookup(key)
            if rank not in answers and value is None:  # answered for it, or still awaited
                call = calls.get(rank)
                if (early := _early_refusal(group, rank, n, send, digest)) is not None:
                    value = group.set_once(key, {"refused": _cut(early)})
                elif call is not None and call.done() and (error := call.exception()) is not None:
                    failed = f"{type(error).__name__}: {error}"  # the worker never saw it: unseen
                    value = group.set_once(key, {"refused": _cut(failed), "unseen": True})
            if value is not None:
                answers[rank] = _checked(group, key, value)
        now = time.monotonic()
        if len(answers) == group.world_size - 1 or now >= deadline:
            return answers
        pending = [call for call in calls.values() if not call.done()]
        if pending:  # a call that fails wakes this up at once
            wait(pending, timeout=pause, return_when=FIRST_COMPLETED)
        else:
            time.sleep(pause)
        if now > eager_until:
            pause = min(2 * pause, _LONGEST_PAUSE_S)


def _early_refusal(group: BroadcastGroup, rank: int, n: int, send: str, digest: int) -> str | None:
    """A refusal `rank` kept for update `n`, if it refused a message of `n`'s very tensors."""
    # A refused copy of the send listing other tensors (stray, or mangled) answers nothing.
    key = _early_key(rank)
    kept = group.lookup(key)
    if kept is not None and not isinstance(kept, list):
        raise group.malformed(key, f"{kept!r:.100}")
    for entry in kept or ():
        mine = isinstance(entry, dict) and (entry.get("update"), entry.get("send")) == (n, send)
        mine = mine and _is_int(entry.get("digest")) and entry.get("digest") == digest
        if mine and isinstance(entry.get("refused"), str):
            return entry["refused"]  # type: ignore[no-any-return]
    return None


class _WorkerHandshake:
    """One worker's side of the handshake, for the life of its group."""

    def __init__(self, group: BroadcastGroup) -> None:
        self._group = group
        self._early: deque[dict[str, Any]] = deque(maxlen=_EARLY_KEPT)
        self._went = 0  # the last update this worker received: nothing more to read about it
        self._went_send: str | None = None  # that update's send

    def _latest(self) -> int:
        n = self._group.lookup(_LATEST)
        if n is not None and (not _is_int(n) or n < 1):
            raise self._group.malformed(_LATEST, f"{n!r:.100}")
        return n or 0

    def _phase(self, n: int, raw: Any) -> tuple[_Phase, dict[str, Any], dict[str, Any]]:
        """Update `n`'s phase, announcement (`raw`, as read) and decision; {} for none yet."""
        group = self._group
        announced = _checked(group, _update_key(n), raw)
        if announced is None:
            return _Phase.AWAITED, {}, {}
        decided = _checked(group, _decision_key(n), group.lookup(_decision_key(n)))
        if decided is None and "refused" in announced:  # the trainer refused its own
            decided = {"refused": f"rank 0: {announced['refused']}"}
        return (_Phase.DECIDED if decided else _Phase.OPEN), announced, decided or {}

    def refuse(self, send: str, reason: str, digest: int | None = None) -> bool:
        """Refuses `send`'s message at once; returns False when the trainer's store is gone."""
        # Answers the newest update if it is `send`'s and unanswered here; else kept for the next
        # update, which takes it only if of `send` and announcing `digest`'s tensors.
        group, reason = self._group, _cut(reason)
        try:
            n = self._latest()
            phase, announced, _ = self._phase(n, group.lookup(_update_key(n)) if n else None)
            key = _answer_key(n, group.rank)
            if announced.get("send") == send and group.lookup(key) is None:
                if phase is _Phase.OPEN:  # decided: the trainer went on without this rank
                    group.set_once(key, {"refused": reason})
                return True
            self._early.append({"update": n + 1, "send": send, "digest": digest, "refused": reason})
            group.set(_early_key(group.rank), list(self._early))
        except WeightTransferError as exc:
            logger.warning("rank %d refused an update, but the trainer's store is gone: %s",
                           group.rank, str(exc).splitlines()[0][:300])  # fmt: skip
            return False
        return True

    def join(self, send: str, specs: Sequence[TensorSpec], *, by_id: bool = False) -> None:
        """Answers the newest undecided update (or the next) for an accepted message; returns on go."""
        # by_id: `send` comes from the message's send_id (one per send, unless a client keeps one).
        group = self._group
        deadline = time.monotonic() + group.timeout_s
        kept = [entry for entry in self._early if entry["send"] != send]
        if len(kept) < len(self._early):  # this accepted message supersedes them
            self._early = deque(kept, maxlen=_EARLY_KEPT)
            group.set(_early_key(group.rank), kept)
        latest = self._latest()
        n = latest + 1 if latest == self._went else latest
        phase, announced, decided = self._phase(
            n, group.lookup(_update_key(n)) if n == latest else None
        )
        if phase is _Phase.AWAITED and n == latest:  # the trainer writes update/{n} before latest
            raise group.malformed(_LATEST, f"{n}, but update {n} was never announced")
        while True:
            if phase is _Phase.AWAITED:
                value = self._announcement(n, send, deadline, by_id=by_id)
                phase, announced, decided = self._phase(n, value)
                continue
            if phase is _Phase.OPEN:
                if by_id and send == self._went_send != announced["send"]:
                    raise self._repeat(f"the trainer sends another one now (update #{n})")
                return self._answer(n, announced, specs, deadline)
            if announced["send"] == send:  # DECIDED: a message late for its update is refused
                key = _answer_key(n, group.rank)
                mine = _checked(group, key, group.lookup(key))
                # Answered by this worker itself: the message is for a later update of the same
                # send (a retry, say). "unseen": only the trainer answered, for a call that failed.
                if mine is None or mine.get("unseen"):
                    reason = (mine or {}).get("refused")
                    reason = decided.get("refused") or decided.get("timeout") or reason
                    raise WeightValidationError(
                        f"update #{n}, which this message belongs to, was refused "
                        f"({str(reason)[:_REASON_CHARS]}): nothing moved; send the update again"
                    )
            n, phase = n + 1, _Phase.AWAITED

    def _answer(
        self, n: int, announced: dict[str, Any], specs: Sequence[TensorSpec], deadline: float
    ) -> None:
        """OPEN -> answered: answers update `n`, then waits for its decision."""
        group, key = self._group, _answer_key(n, self._group.rank)
        problem = None
        if announced["tensors"] != len(specs) or announced["digest"] != _metadata_digest(specs):
            problem = WeightValidationError(
                f"the update info this worker got ({len(specs)} tensors) differs from what the "
                f"trainer sends ({announced['tensors']} tensors): send both sides the same "
                "update_info"
            )
        mine = {"refused": _cut(str(problem))} if problem else {"ok": True}
        stored = group.set_once(key, mine)
        if stored != mine:  # the trainer took a refusal kept for this update as the answer
            answer = _checked(group, key, stored)
            if answer is None or "refused" not in answer:
                raise group.malformed(key, f"{stored!r:.100}")
            raise _rejected(f"rank {group.rank}: {_cut(answer['refused'])}")
        if problem is not None:
            raise problem
        if _answered_hook is not None:
            _answered_hook(n)
        value = self._wait(_decision_key(n), deadline, "the trainer decided nothing")
        decision = _checked(group, _decision_key(n), value)
        if decision.get("go") is True:
            self._went, self._went_send = n, announced["send"]
            return
        if isinstance(decision.get("refused"), str):
            raise _rejected(_cut(decision["refused"]))
        raise WeightTransferTimeout(_cut(decision["timeout"]))

    def _announcement(self, n: int, send: str, deadline: float, *, by_id: bool) -> Any:
        """Update `n`'s announcement, by `deadline`; a timeout says whether the message repeats."""
        # A message of the send_id of the update received last may still be the next update's
        # (a client may keep one send_id): only the trainer's silence tells.
        try:
            return self._wait(_update_key(n), deadline, "no update of the trainer's arrived")
        except WeightTransferTimeout as exc:
            if by_id and send == self._went_send:  # later updates, if any, went without it
                silent = f"no update of the trainer's came for it in {self._group.timeout_s:g} s"
                raise self._repeat(f"{silent} (timeout_s)") from None
            raise _NotAnnounced(str(exc)) from None

    def _repeat(self, why: str) -> DuplicateMessageError:
        """The refusal of a message of the update received last; `why` it is no later one's."""
        return DuplicateMessageError(
            f"this message is a repeat of update #{self._went}'s, which this worker received "
            f"already, and {why}: nothing moved, and an update in progress stays as it was (a "
            "client's retry after its own timeout, say)"
        )

    def _wait(self, key: str, deadline: float, what: str) -> Any:
        """The value the trainer writes under `key`, by `deadline`; a timeout names the handshake."""
        try:
            value = self._group.get(key, max(deadline - time.monotonic(), 0.001))
        except WeightTransferTimeout:
            raise WeightTransferTimeout(
                f"the update handshake timed out after {self._group.timeout_s:g} s (timeout_s): "
                f"{what}: the trainer did not call trainer_send_weights for this update, or is stuck"
            ) from None
        if value is None:  # a JSON null under the key: not the trainer's
            raise self._group.malformed(key, "None")
        return value

    def trainer_is_gone(self) -> bool:
        """Whether the trainer's store stopped answering (it closed its group or died)."""
        try:
            self._group.has([_LATEST])  # reaches the store without reading what another wrote
        except WeightTransferError as exc:  # expected when a trainer is done: one line
            logger.info("rank %d: the trainer closed its group or stopped (%s); its connections "
                        "are released, and the next trainer joins with "
                        "init_weight_transfer_engine", self._group.rank,
                        str(exc)[:300])  # fmt: skip
            logger.debug("rank %d: how the trainer's store failed", self._group.rank,
                         exc_info=exc)  # fmt: skip
            return True
        return False


# --- steps 4 and 5: the buckets, both ends, and what a rank does when they fail ------------------


@dataclass
class _InFlight:
    """One posted broadcast of a bucket, and what to do once it lands."""

    work: BroadcastWork | None  # None: a bucket of empty tensors, nothing on the wire
    bucket: Bucket
    data: torch.Tensor  # the bytes on the wire (a pool buffer or tensor memory)
    buffer_index: int | None = None
    region: _DirectRegion | None = None  # the bucket lies in tensor memory
    saved_gaps: list[torch.Tensor] | None = None  # a receiver's region gaps, restored on landing


def _plan(specs: Sequence[TensorSpec], wire: WireParams) -> list[Bucket]:
    """The buckets of one update: packed per `bucket_size_bytes`, or one per tensor."""
    if wire.packed:
        return plan_buckets(specs, wire.bucket_size_bytes)
    return [Bucket((Slot(spec, 0),), spec.nbytes) for spec in specs]


def _post(
    group: BroadcastGroup,
    pool: _BufferPool[torch.Tensor],
    bucket: Bucket,
    tensors: Sequence[torch.Tensor],
    stats: TransferStats,
) -> _InFlight:
    """Starts `bucket`'s broadcast: in the tensors' memory when it is one region, else a buffer."""
    # The trainer sends `tensors` (packed into the buffer); a worker passes the parameters it
    # may receive into, if it holds all of them.
    if bucket.nbytes == 0:
        return _InFlight(None, bucket, torch.empty(0, dtype=torch.uint8, device=group.device))
    receiving = group.rank > 0
    what = (
        f"{'receiving' if receiving else 'sending'} bucket of {len(bucket.slots)} tensors from "
        f"{bucket.slots[0].spec.name!r}"
    )
    region = None
    if len(tensors) == len(bucket.slots) and all(t.device == group.device for t in tensors):
        region = _direct_region(bucket, tensors)
    if region is not None:
        stats.direct_buckets += 1
        saved = region.save_gaps() if receiving else None  # other tensors may live in the gaps
        work = group.broadcast(region.data, what)
        return _InFlight(work, bucket, region.data, None, region, saved)
    index, buffer = pool.take(bucket.nbytes)
    data = buffer[: bucket.nbytes]
    if not receiving:
        with torch.no_grad():  # parameters that require grad are copied as plain bytes
            data = pack_bucket(bucket, tensors, data)
    return _InFlight(group.broadcast(data, what), bucket, data, index)


def _land(
    item: _InFlight, pool: _BufferPool[torch.Tensor], load_weights: LoadWeightsFn | None = None
) -> None:
    """Waits for a posted bucket; a worker then loads it (`load_weights`) unless it came in place."""
    if item.work is not None:
        item.work.wait()
    if item.region is not None:
        if item.saved_gaps is not None:
            item.region.restore_gaps(item.saved_gaps)
    elif load_weights is not None:
        with torch.no_grad():  # loaders copy into parameters that may require grad
            load_weights(unpack_bucket(item.bucket, item.data))
    if item.buffer_index is not None:
        pool.give_back(item.buffer_index)


def _abort(group: BroadcastGroup, reason: BaseException) -> None:
    """Publishes why this rank gives up on the group, then closes it."""
    with contextlib.suppress(Exception):  # the store may be gone or stopped with the trainer
        note = f"{type(reason).__name__}: {reason}"
        group.set(f"abort/{group.rank}", note, limit_s=min(group.timeout_s, _ABORT_NOTE_S))
    group.close()


def _peer_reasons(group: BroadcastGroup) -> str:
    """The reasons peers published when aborting, for an error message."""
    found = []
    limit_s = min(group.timeout_s, _ABORT_NOTE_S)  # after one read past it, none is tried
    for rank in range(group.world_size):
        if rank != group.rank and (reason := group.try_get(f"abort/{rank}", limit_s)) is not None:
            found.append(f"rank {rank} aborted: {str(reason)[:_PEER_REASON_CHARS]}")
    return "; ".join(found)


def _transfer_failed(
    group: BroadcastGroup, exc: Exception, *, partially_applied: bool
) -> WeightTransferError:
    """Closes the group after a failure past the handshake; returns the error to raise."""
    _abort(group, exc)
    reasons = _peer_reasons(group)
    side = "trainer" if group.rank == 0 else f"worker rank {group.rank}"
    message = f"weight transfer failed on the {side}: {exc}" + (f" ({reasons})" if reasons else "")
    message += "; the group is closed: initialize a new one before the next update"
    error_cls = type(exc) if isinstance(exc, WeightTransferError) else WeightTransferError
    return error_cls(message, partially_applied=partially_applied)


# --- the trainer's end ----------------------------------------------------------------------------


class TrainerGroup:
    """The trainer's end of a broadcast group, from [`trainer_init`][weightsync.transfer.nccl.trainer_init].

    The store is bound at creation; the group itself forms on
    [`connect`][weightsync.transfer.nccl.TrainerGroup.connect] (or the first send), once every
    worker was given [`init_info`][weightsync.transfer.nccl.TrainerGroup.init_info].
    """

    def __init__(self, group: BroadcastGroup, info: NCCLWeightTransferInitInfo) -> None:
        self._group, self._info, self._wire = group, info, info.wire
        self._pool = _byte_buffers(info.num_buffers, group.device)
        self._seq = 0  # the number of the last update announced
        self._closed = False

    @property
    def init_info(self) -> dict[str, Any]:
        """The JSON-safe init info every worker passes to `init_transfer_engine`."""
        return dict(vars(self._info))

    @property
    def world_size(self) -> int:
        """1 + the number of workers."""
        return self._info.world_size

    def connect(self, *, joining: Sequence[Future[Any]] = ()) -> None:
        """Blocks until every worker joined, `timeout_s` at most in all (idempotent).

        Args:
            joining: The workers' join calls, when this process made them (on threads, as
                `BroadcastWeightSender` does): one that fails ends the wait at once, with its
                error (a server that refused the join, or that nothing listens for).

        Raises:
            WeightTransferTimeout: Some worker did not join within `timeout_s`; the message
                includes the errors workers reported while joining.
            WeightTransferError: The group was closed after a failure.
            Exception: A join call of `joining` failed; its error.
        """
        if self._closed:
            raise WeightTransferError(
                "this trainer group was closed after a failure: call trainer_init again"
            )
        if self._group.is_connected:
            return
        deadline = time.monotonic() + self._group.timeout_s  # for the workers and the rendezvous
        try:
            if joining:
                self._await_workers(joining, deadline)
            self._group.connect(timeout_s=deadline - time.monotonic())
        except WeightTransferError as exc:
            errors = [str(e) for e in self._group.read_list(INIT_ERRORS, _REPORT_READ_S)]
            if not errors:
                raise
            shown = "; ".join(errors[:_ERRORS_SHOWN])
            more = len(errors) - _ERRORS_SHOWN
            shown += f" (and {more} more)" if more > 0 else ""
            raise type(exc)(f"{exc}; workers reported: {shown}") from exc

    def _await_workers(self, joining: Sequence[Future[Any]], deadline: float) -> None:
        """Waits until every worker claimed its rank, or one of `joining` failed."""
        # Forming the group blocks, uninterruptibly, until every rank is in: it starts only once
        # every worker is at the rendezvous, so that a failed join fails this call at once.
        keys = [f"rank/{rank}" for rank in range(1, self.world_size)]
        while not self._group.has(keys):
            for call in joining:
                if call.done() and (error := call.exception()) is not None:
                    raise error
            if time.monotonic() > deadline:  # the same bound as the group's: not twice it
                missing = [k for k in keys if not self._group.has([k])]
                raise WeightTransferTimeout(
                    f"forming the group timed out after {self._group.timeout_s:g} s (timeout_s): "
                    f"{', '.join(missing)} never joined; those workers are stuck or unreachable"
                )
            wait(joining, timeout=0.02, return_when=FIRST_EXCEPTION)  # or a store check again

    def _send(
        self, iterator: Iterable[tuple[str, torch.Tensor]], args: NCCLTrainerSendWeightsArgs
    ) -> TransferStats:
        """One update: the handshake (steps 1-3), then the buckets (step 4)."""
        self.connect()
        start = time.perf_counter()
        window: _Window[_InFlight] | None = None
        sent = -1  # tensors taken from the iterator; -1: the handshake has not said go
        try:
            specs: list[TensorSpec] | None = None
            problem: WeightValidationError | None = None
            try:
                info = _parse_info(WeightTransferUpdateInfo, args.update_info, what="update_info")
                specs = info.specs()
            except WeightValidationError as exc:
                problem = exc  # told to the workers in the handshake, then raised
            self._seq += 1
            _open_update(self._group, self._seq, _send_identity(args.update_info), specs, problem,
                        receiving=args.receiving, rank_offset=self._info.rank_offset)  # fmt: skip
            assert specs is not None
            sent = 0  # from the first tensor on, workers may hold new bytes
            buckets = _plan(specs, self._wire)
            tensors = _AnnouncedTensors(iter(iterator), args.post_iter_func)
            stats = TransferStats(len(specs), sum(s.nbytes for s in specs), len(buckets))
            self._pool.reset()
            window = _Window(self._wire.num_buffers, lambda item: _land(item, self._pool))
            for first, bucket, bucket_tensors in _announced_buckets(buckets, tensors, len(specs)):
                sent = first + len(bucket.slots)
                window.make_room()
                window.push(_post(self._group, self._pool, bucket, bucket_tensors, stats))
            window.drain()
        except Exception as exc:
            if sent < 0 and isinstance(exc, WeightValidationError):
                raise  # refused before any byte moved: the group stays usable
            if window is not None:
                window.clear()  # in-flight work pins the group's connections open
            # Raised without a local: it would hold the error in this frame, which its traceback
            # holds, a cycle that keeps the group's sockets until a full collection.
            raise self._failed(exc, partially_applied=sent > 0) from exc
        stats.seconds = time.perf_counter() - start
        logger.info(
            "sent %d tensors, %.1f MB to %d workers in %.3f s (%.2f GB/s, %d of %d buckets in place)",
            stats.num_tensors, stats.num_bytes / 1e6, self.world_size - 1, stats.seconds,
            stats.gbps, stats.direct_buckets, stats.num_buckets,
        )  # fmt: skip
        return stats

    def _failed(self, exc: Exception, *, partially_applied: bool) -> WeightSyncError:
        """The error ladder: closes the group, and maps `exc` onto the error the send raises."""
        # A pending wait in the traceback's frames holds its work, which pins the sockets.
        traceback.clear_frames(exc.__traceback__)
        self._closed = True
        error = _transfer_failed(self._group, exc, partially_applied=partially_applied)
        # A tensor that differs from the announcement stays a validation error; a timeout stays one.
        validation = isinstance(exc, WeightValidationError)
        return WeightValidationError(str(error)) if validation else error

    def close(self) -> None:
        """Closes the group and its store; workers blocked on it fail at once. Safe to call twice.

        The store's port is free again when this returns.
        """
        self._closed = True
        self._group.close(release_store=True)

    def __enter__(self) -> TrainerGroup:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def trainer_init(
    *,
    world_size: int,
    backend: str = "nccl",
    master_address: str = "127.0.0.1",
    master_port: int = 0,
    wire: WireParams | None = None,
    **wire_fields: Unpack[_WireKeywords],
) -> TrainerGroup:
    """Creates the trainer's end (rank 0) of a weight-transfer group and decides the wire parameters.

    Binds the group's store and returns at once; pass `group.init_info` to every worker's
    `init_transfer_engine`, then send. It never touches torch.distributed's default group.

    Args:
        world_size: 1 (this trainer) + the number of workers.
        backend: `"nccl"` for CUDA tensors, `"gloo"` for CPU tensors.
        master_address: Address workers reach this process at (loopback by default).
        master_port: Port for the store; 0 picks a free one.
        wire: The wire parameters ([`WireParams`][weightsync.transfer.base.WireParams]:
            packed or not, bucket size, buffers, timeout); the defaults when None.
        **wire_fields: The same, as keywords (`bucket_size_bytes=256 << 20`), instead of `wire`.

    Raises:
        WeightValidationError: A bad argument, `nccl` without CUDA, or a `world_size` larger
            than this process's open-file limit allows (every rank keeps up to two connections
            per other rank); the message gives the limit.

    >>> group = trainer_init(world_size=2, backend="gloo")
    >>> sorted(group.init_info)[:3]
    ['backend', 'bucket_size_bytes', 'master_address']
    >>> group.close()
    """
    params = WireParams.build(wire, **wire_fields)
    group = BroadcastGroup(
        backend=backend,
        master_address=master_address,
        master_port=master_port,
        rank=0,
        world_size=world_size,
        timeout_s=params.timeout_s,
    )
    info = NCCLWeightTransferInitInfo.create(
        master_address=master_address,
        master_port=group.port,
        world_size=world_size,
        backend=backend,
        wire=params,
    )
    group.set("wire", info.wire_params())
    group.claim_rank(uuid.uuid4().hex)  # the trainer's store is new: rank 0 is its own
    return TrainerGroup(group, info)


@dataclass
class NCCLTrainerSendWeightsArgs:
    """Arguments of [`trainer_send_weights`][weightsync.transfer.nccl.trainer_send_weights].

    Attributes:
        group: The trainer's group from `trainer_init`.
        update_info: The update info the workers were given (a dict or the dataclass); every
            tensor the iterator yields is checked against it, in order.
        post_iter_func: Optional map from each yielded `(name, tensor)` pair to the tensor to send
            (e.g. to gather a sharded parameter); by default the pair's tensor.
        receiving: The workers' calls that hand them `update_info` (their `update_weights`),
            in worker order, when this process made them on threads: one that fails before
            the worker answered the handshake is that worker's refusal, at once (a server that
            refused the request itself, or that nothing listens for). Optional: a worker's own
            refusal reaches the trainer through the group's store either way.
    """

    group: TrainerGroup
    update_info: Mapping[str, Any] | WeightTransferUpdateInfo
    post_iter_func: Callable[[tuple[str, torch.Tensor]], torch.Tensor] | None = None
    receiving: Sequence[Future[Any]] = ()


def trainer_send_weights(
    iterator: Iterable[tuple[str, torch.Tensor]], trainer_args: NCCLTrainerSendWeightsArgs
) -> TransferStats:
    """Broadcasts one update to every worker of the group.

    The workers must be inside `receive_weights` with the same update info. Packed mode packs
    bucket k+1 while bucket k is on the wire; a bucket whose tensors already sit in one storage at
    the plan's offsets (see [`flatten_module`][weightsync.transfer.buckets.flatten_module]) is sent
    from that memory without a copy.

    Args:
        iterator: `(name, tensor)` pairs in the announced order, e.g. `model.named_parameters()`.
        trainer_args: The group and the announced update info.

    Returns:
        What was sent and how fast.

    Raises:
        WeightValidationError: A worker rejected the update (nothing moved), or a yielded tensor
            differs from what was announced (the group is then closed and the workers fail too).
        WeightTransferError: The transfer failed; the group is closed.
    """
    return trainer_args.group._send(iterator, trainer_args)


# --- the workers' end -----------------------------------------------------------------------------


class _BroadcastWeightTransferEngine(WeightTransferEngine):
    """Worker side of the broadcast transfer; subclasses name the backend."""

    backend: ClassVar[str]
    init_info_cls: ClassVar[type[WeightTransferInitInfo]] = NCCLWeightTransferInitInfo

    def __init__(
        self,
        *,
        worker_index: int = 0,
        expected_specs: Mapping[str, TensorSpec] | None = None,
        params: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        super().__init__(worker_index=worker_index, expected_specs=expected_specs, params=params)
        self.device = check_backend(self.backend)
        self._group: BroadcastGroup | None = None
        self._wire = _DEFAULT_WIRE  # the group's, once joined
        self._pool: _BufferPool[torch.Tensor] | None = None
        self._handshake: _WorkerHandshake | None = None
        self._watch: _Watch | None = None  # frees what a trainer left, between updates
        self._busy = threading.RLock()  # held by every call that uses the group
        self._claimant = uuid.uuid4().hex  # the same engine retrying its join may claim again

    @property
    def is_initialized(self) -> bool:
        """Whether this worker is in a live group."""
        return self._group is not None and self._group.is_connected

    def parse_init_info(self, init_info: Mapping[str, Any] | WeightTransferInitInfo) -> Any:
        """Parses the init info: vLLM's key names too; the backend defaults to this engine's."""
        if isinstance(init_info, Mapping):
            data = dict(init_info)
            if (unique_id := "nccl_unique_id_b64") in data:
                raise WeightValidationError(
                    f"init_info.{unique_id}: vLLM's NCCL unique-id rendezvous is not weightsync's "
                    "wire; a weightsync worker joins the trainer's store at master_address:"
                    "master_port"
                )
            for vllm_key, key in _VLLM_INIT_KEYS.items():
                if vllm_key in data:
                    value = data.pop(vllm_key)
                    kept = data.setdefault(key, value)  # `True == 1`: one of them is mistyped
                    if type(kept) is not type(value) or kept != value:
                        raise WeightValidationError(
                            f"init_info.{vllm_key} ({value!r}) and init_info.{key} "
                            f"({data[key]!r}) name the same wire parameter with different "
                            "values: send one of them"
                        )
            init_info = {"backend": self.backend, **data}
        return super().parse_init_info(init_info)

    def parse_update_info(self, update_info: Mapping[str, Any] | WeightTransferUpdateInfo) -> Any:
        """Parses the update info; vLLM's older wire keys too, when they have the group's values."""
        if isinstance(update_info, Mapping):
            data = dict(update_info)
            for vllm_key, key in _VLLM_UPDATE_WIRE_KEYS.items():
                if vllm_key not in data:
                    continue
                value, expected = data.pop(vllm_key), getattr(self._wire, key)
                if type(value) is not type(expected) or value != expected:
                    raise WeightValidationError(
                        f"update_info.{vllm_key} is {value!r}, but the group's wire parameters, "
                        f"decided by the trainer at init, have {key}={expected!r}: leave "
                        f"{vllm_key} out of update_info (vLLM 0.28 moved it to the init info), "
                        "or give it the group's value"
                    )
            update_info = data
        return super().parse_update_info(update_info)

    def init_transfer_engine(self, init_info: Mapping[str, Any] | WeightTransferInitInfo) -> None:
        """Joins the trainer's group, replacing any current one; `timeout_s` at most in all."""
        with self._busy:
            info: NCCLWeightTransferInitInfo = self.parse_init_info(init_info)
            if info.backend != self.backend:
                raise WeightValidationError(
                    f"init_info.backend is {info.backend!r} but this engine speaks "
                    f"{self.backend!r}: create the worker's engine with backend {info.backend!r}"
                )
            self.shutdown()
            rank = info.rank_offset + self.worker_index
            if rank >= info.world_size:
                raise WeightValidationError(
                    f"rank_offset ({info.rank_offset}) + worker_index ({self.worker_index}) = "
                    f"{rank} is outside world_size {info.world_size}: world_size must be 1 + the "
                    "number of workers"
                )
            deadline = time.monotonic() + info.timeout_s
            group = BroadcastGroup(
                backend=info.backend,
                master_address=info.master_address,
                master_port=info.master_port,
                rank=rank,
                world_size=info.world_size,
                timeout_s=info.timeout_s,
            )
            try:
                trainer_wire = group.get("wire", timeout_s=max(deadline - time.monotonic(), 0.001))
                if not isinstance(trainer_wire, dict):  # a value from the network: check its type
                    raise WeightValidationError(
                        f"the store at {info.master_address}:{info.master_port} holds no "
                        f"trainer's wire parameters (got {type(trainer_wire).__name__}): pass the "
                        "worker the init_info of a weightsync trainer group"
                    )
                mismatched = ", ".join(
                    f"{k}: worker {v!r} vs trainer {trainer_wire.get(k)!r}"
                    for k, v in info.wire_params().items()
                    if trainer_wire.get(k) != v
                )
                if mismatched:
                    raise WeightValidationError(
                        f"init_info disagrees with the trainer's group ({mismatched}): pass the "
                        "worker the trainer's TrainerGroup.init_info unchanged"
                    )
                group.claim_rank(self._claimant)
                group.connect(timeout_s=deadline - time.monotonic())
            except Exception as exc:
                with contextlib.suppress(Exception):  # the store may be gone: the error matters
                    group.append(INIT_ERRORS, f"rank {rank}: {type(exc).__name__}: {exc}"[:4000])
                group.close()
                raise
            self._group, self._wire = group, info.wire
            self._pool = _byte_buffers(info.num_buffers, group.device)
            self._handshake = _WorkerHandshake(group)
            self._watch = _Watch(self._release_gone, name="weightsync-group-watch")
        logger.info("worker rank %d joined a %s group of %d", rank, info.backend, info.world_size)

    def receive_weights(
        self,
        update_info: Mapping[str, Any] | WeightTransferUpdateInfo,
        load_weights: LoadWeightsFn,
    ) -> TransferStats:
        """The handshake (after checking the message), then the buckets (step 5)."""
        with self._busy:
            group, pool, handshake = self._group, self._pool, self._handshake
            if group is None or pool is None or handshake is None or not group.is_connected:
                raise WeightTransferError(
                    "the transfer engine is not initialized (or its group closed after a "
                    "failure): call init_transfer_engine(init_info) first"
                )
            start = time.perf_counter()
            try:
                info = self.parse_update_info(update_info)
                specs = self.check_update(info)
            except WeightValidationError as exc:
                self._refuse(update_info, str(exc))
                raise
            window: _Window[_InFlight] | None = None
            touched = False  # whether any byte of the model may have been overwritten
            try:
                handshake.join(_send_identity(update_info), specs, by_id=info.send_id is not None)
                buckets = _plan(specs, self._wire)
                names = [s.name for s in specs]
                nbytes = sum(s.nbytes for s in specs)
                stats = TransferStats(len(specs), nbytes, len(buckets), loaded_names=names)
                pool.reset()
                depth, params = self._wire.num_buffers, self.params or {}
                window = _Window(depth, lambda item: _land(item, pool, load_weights))
                for bucket in buckets:
                    touched |= len(window) >= depth  # a bucket lands in make_room
                    window.make_room()
                    mine = [params[s.spec.name] for s in bucket.slots if s.spec.name in params]
                    item = _post(group, pool, bucket, mine, stats)
                    window.push(item)
                    touched |= item.region is not None  # received straight into the model
                touched |= len(window) > 0
                window.drain()
            except _NotAnnounced as exc:  # nothing went on the wire: the group stays usable
                raise WeightTransferTimeout(str(exc)) from None
            except Exception as exc:
                if window is None and isinstance(exc, WeightValidationError):
                    raise  # refused in the handshake: nothing moved, the group stays usable
                if window is not None:
                    window.clear()  # in-flight work pins the group's connections open
                raise _transfer_failed(group, exc, partially_applied=touched) from exc
        stats.seconds = time.perf_counter() - start
        logger.info("received %d tensors, %.1f MB in %.3f s (%.2f GB/s)", stats.num_tensors,
                    stats.num_bytes / 1e6, stats.seconds, stats.gbps)  # fmt: skip
        return stats

    def refuse_update(
        self,
        update_info: Mapping[str, Any] | WeightTransferUpdateInfo,
        reason: WeightSyncError,
    ) -> None:
        """Answers the update's handshake with `reason` at once (see the base class)."""
        with self._busy:
            if self.is_initialized:  # else no trainer can be waiting on this rank
                self._refuse(update_info, f"{type(reason).__name__}: {reason}")

    def _refuse(
        self, update_info: Mapping[str, Any] | WeightTransferUpdateInfo, reason: str
    ) -> None:
        if self._handshake is None:
            return
        try:  # what the message lists, so that only an update announcing it takes the refusal
            digest: int | None = _metadata_digest(self.parse_update_info(update_info).specs())
        except WeightValidationError:
            digest = None  # it lists nothing readable: no update announces it
        if not self._handshake.refuse(_send_identity(update_info), reason, digest):
            self.shutdown()  # the trainer is gone: leave its group

    def _release_gone(self) -> bool:
        """The watch's sweep: leaves the group if its trainer is gone; returns whether joined."""
        if not self._busy.acquire(blocking=False):  # a call in progress finds out for itself
            return True
        try:
            if self._handshake is not None and self._handshake.trainer_is_gone():
                self._leave()
            return self._group is not None
        finally:
            self._busy.release()

    def shutdown(self) -> None:
        """Leaves the group, frees the bucket buffers and stops the watch. Safe to call twice."""
        with self._busy:
            _Watch.stop_if_any(self._watch)
            self._watch = None
            self._leave()

    def _leave(self) -> None:
        if self._group is not None:
            self._group.close()
        self._group, self._pool, self._handshake, self._wire = None, None, None, _DEFAULT_WIRE


class NCCLWeightTransferEngine(_BroadcastWeightTransferEngine):
    """Worker side of the broadcast transfer over NCCL: CUDA tensors, one GPU per rank.

    Arguments and lifecycle as for
    [`WeightTransferEngine`][weightsync.transfer.base.WeightTransferEngine]; the worker's rank is
    `rank_offset + worker_index`. vLLM's init and update infos are taken too, but for its NCCL
    unique-id rendezvous. A message this worker refuses is answered at once (see
    `refuse_update`); an accepted one waits, `timeout_s` at most, for the trainer's update. A
    bucket whose tensors lie in `params` at the plan's offsets (a module laid out by
    [`flatten_module`][weightsync.transfer.buckets.flatten_module]) is received straight into
    them; memory beyond the model is at most `num_buffers` x the largest bucket.

    Raises:
        WeightValidationError: `nccl` without CUDA; at `init_transfer_engine`, malformed init
            info, another backend, a rank outside the world, or wire parameters other than the
            trainer's.
        WeightTransferTimeout: At `init_transfer_engine`, a rank did not join within `timeout_s`.
    """

    backend: ClassVar[str] = "nccl"


class GlooWeightTransferEngine(_BroadcastWeightTransferEngine):
    """Worker side of the broadcast transfer over gloo: the same protocol on CPU tensors.

    Everything [`NCCLWeightTransferEngine`][weightsync.transfer.nccl.NCCLWeightTransferEngine]
    says holds, with CPU tensors.
    """

    backend: ClassVar[str] = "gloo"
