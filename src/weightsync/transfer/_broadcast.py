"""The broadcast protocol both ends of an `nccl` / `gloo` transfer follow.

One update is:

1. **Handshake**, in the group's store (`_handshake`): the trainer announces the update, every
   worker answers it (ready, or refused and why), and the trainer decides. A refusal anywhere
   stops everyone before any tensor byte moves, and a worker that refuses never waits.
2. **Data.** Packed: the buckets of [`plan_buckets`][weightsync.transfer.buckets.plan_buckets],
   at most `num_buffers` in flight. Unpacked: one broadcast per non-empty tensor.

On a failure mid-transfer a rank writes its reason to the store and closes the group; its
peers' next collective then fails at once and they report that reason.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from weightsync.errors import WeightTransferError
from weightsync.transfer._group import BroadcastGroup, BroadcastWork
from weightsync.transfer.base import TensorSpec, WireParams
from weightsync.transfer.buckets import Bucket, Slot, _DirectRegion, plan_buckets

__all__ = ["InFlight", "abort", "peer_reasons", "plan", "transfer_failed"]

_REASON_CHARS = 1000  # of a peer's reason, in an error message


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
    region: _DirectRegion | None = None
    saved_gaps: list[torch.Tensor] | None = None
    keepalive: Sequence[torch.Tensor] = ()


def plan(specs: Sequence[TensorSpec], wire: WireParams) -> list[Bucket]:
    """The buckets of one update: packed per `bucket_size_bytes`, or one per tensor."""
    if wire.packed:
        return plan_buckets(specs, wire.bucket_size_bytes)
    return [Bucket((Slot(spec, 0),), spec.nbytes) for spec in specs]


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
            if reason is not None:  # a value from the store: cut, whoever wrote it
                found.append(f"rank {rank} aborted: {str(reason)[:_REASON_CHARS]}")
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
