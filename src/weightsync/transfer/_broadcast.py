"""The broadcast protocol both ends of an `nccl` / `gloo` transfer follow.

One update is:

1. **Handshake.** The trainer broadcasts a header (update sequence number, tensor count, total
   bytes and a digest of the announced metadata). Every receiver compares it with the update
   info it got over the control channel and validates that info against its model. All ranks
   then all-reduce a status vector, so a rejection anywhere stops everyone before any tensor
   byte moves; the rejecting rank's message travels through the group's store.
2. **Data.** Packed: the buckets of [`plan_buckets`][weightsync.transfer.packing.plan_buckets],
   at most `num_buffers` in flight. Unpacked: one broadcast per non-empty tensor.

On a failure mid-transfer a rank writes its reason to the store and closes the group; its
peers' next collective then fails at once and they report that reason.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from weightsync.errors import WeightTransferError, WeightValidationError
from weightsync.transfer._group import BroadcastGroup, BroadcastWork
from weightsync.transfer.base import TensorSpec, dtype_name
from weightsync.transfer.packing import Bucket, DirectRegion, Slot, plan_buckets
from weightsync.transfer.wire import WireParams

__all__ = [
    "InFlight",
    "abort",
    "handshake",
    "metadata_digest",
    "peer_reasons",
    "plan",
    "transfer_failed",
]


@dataclass
class InFlight:
    """One posted broadcast of a bucket and what to do once it lands.

    Attributes:
        work: The pending broadcast (None for a bucket of empty tensors).
        bucket: The bucket it carries.
        data: The bytes on the wire (a pool buffer or a region of tensor memory).
        buffer_index: The pool buffer used, if any.
        region: The in-place region, when the bucket lands in tensor memory.
        saved_gaps: Bytes of the region's gaps, restored once it lands.
        keepalive: Tensors that must live until the broadcast is done.
    """

    work: BroadcastWork | None
    bucket: Bucket
    data: torch.Tensor | None = None
    buffer_index: int | None = None
    region: DirectRegion | None = None
    saved_gaps: list[torch.Tensor] | None = None
    keepalive: Sequence[torch.Tensor] = ()


def plan(specs: Sequence[TensorSpec], wire: WireParams) -> list[Bucket]:
    """The buckets of one update: packed per `bucket_size_bytes`, or one per tensor."""
    if wire.packed:
        return plan_buckets(specs, wire.bucket_size_bytes)
    return [Bucket((Slot(spec, 0),), spec.nbytes) for spec in specs]


def metadata_digest(specs: Sequence[TensorSpec]) -> int:
    """A 63-bit digest of names, dtypes and shapes, to catch sides that announce different things."""
    text = json.dumps([[s.name, dtype_name(s.dtype), list(s.shape)] for s in specs])
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def handshake(
    group: BroadcastGroup,
    seq: int,
    specs: Sequence[TensorSpec] | None,
    problem: Exception | None,
) -> None:
    """Runs the pre-transfer handshake on any rank (see the module docstring).

    Args:
        group: This rank's end of the group.
        seq: The update's sequence number on this side (1 for the first update).
        specs: The announced tensors as this side understood them; None if they were unusable.
        problem: This rank's reason to reject the update, if any.

    Raises:
        WeightValidationError: Some rank rejected the update; the message names it and says why.
        WeightTransferError: The handshake itself failed (a peer died, the group timed out).
    """
    header = torch.full((3,), -1, dtype=torch.int64, device=group.device)
    if group.rank == 0 and specs is not None:
        header.copy_(torch.tensor([seq, len(specs), metadata_digest(specs)]))
    group.broadcast(header, "the update handshake").wait()
    trainer_seq, trainer_count, trainer_digest = header.tolist()
    # trainer_seq -1: the trainer rejects the update itself and says why in the status round.
    if group.rank != 0 and problem is None and specs is not None and trainer_seq != -1:
        mine = metadata_digest(specs)
        if trainer_seq != seq:
            problem = WeightValidationError(
                f"update sequence mismatch: the trainer sends update #{trainer_seq}, this worker "
                f"expects #{seq}; a worker missed an update or took one twice: re-initialize the group"
            )
        elif trainer_count != len(specs) or trainer_digest != mine:
            problem = WeightValidationError(
                f"the update info this worker got ({len(specs)} tensors) differs from what the "
                f"trainer sends ({trainer_count} tensors): send both sides the same update_info"
            )
    status = torch.zeros(group.world_size, dtype=torch.int64, device=group.device)
    if problem is not None:
        group.set(f"reject/{seq}/{group.rank}", str(problem))
        status[group.rank] = 1
    group.all_reduce(status)
    rejecting = [rank for rank, flag in enumerate(status.tolist()) if flag]
    if problem is not None:
        raise problem
    if rejecting:
        reasons = [f"rank {r}: {group.get(f'reject/{seq}/{r}')}" for r in rejecting]
        raise WeightValidationError(
            "update rejected before any byte moved by " + "; ".join(reasons)
        )


def abort(group: BroadcastGroup, reason: BaseException) -> None:
    """Publishes why this rank gives up on the group, then closes it."""
    # The store may be gone with the trainer; closing the group matters more than the note.
    with contextlib.suppress(Exception):
        group.set(f"abort/{group.rank}", f"{type(reason).__name__}: {reason}")
    group.close()


def peer_reasons(group: BroadcastGroup) -> str:
    """Collects the reasons peers published when aborting, for an error message."""
    found = []
    for rank in range(group.world_size):
        if rank != group.rank:
            reason = group.try_get(f"abort/{rank}")
            if reason is not None:
                found.append(f"rank {rank} aborted: {reason}")
    return "; ".join(found)


def transfer_failed(
    group: BroadcastGroup, exc: Exception, *, partially_applied: bool
) -> WeightTransferError:
    """Closes the group after a mid-transfer failure and returns the error to raise."""
    abort(group, exc)
    reasons = peer_reasons(group)
    side = "trainer" if group.rank == 0 else f"worker rank {group.rank}"
    message = f"weight transfer failed on the {side}: {exc}"
    if reasons:
        message += f" ({reasons})"
    message += "; the group is closed: initialize a new one before the next update"
    error_cls = type(exc) if isinstance(exc, WeightTransferError) else WeightTransferError
    return error_cls(message, partially_applied=partially_applied)
