"""Buckets: where each tensor of an update lies inside a few large byte buffers, and the copies.

Shared by every backend. Sender and receiver compute the same
[`plan_buckets`][weightsync.transfer.packing.plan_buckets] from the update's metadata alone, so
the wire carries bytes only. Inside a bucket each tensor starts at a multiple of
`ALIGN_BYTES`, so a bucket's bytes can be viewed as typed tensors without copying
([`unpack_bucket`][weightsync.transfer.packing.unpack_bucket]), and a module laid out with
[`flatten_module`][weightsync.transfer.flat.flatten_module] (same order, same alignment) can be
sent from, and received into, its own parameter memory
(`_direct_region`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from weightsync.transfer.base import TensorSpec
from weightsync.transfer.wire import WireParams

__all__ = [
    "ALIGN_BYTES",
    "Bucket",
    "Slot",
    "flat_layout",
    "pack_bucket",
    "plan_buckets",
    "unpack_bucket",
]

ALIGN_BYTES = 256
"""Byte alignment of every tensor inside a bucket (and inside a flat parameter buffer)."""


@dataclass(frozen=True)
class Slot:
    """Where one tensor lives inside a bucket: its spec and its byte offset."""

    spec: TensorSpec
    offset: int

    @property
    def end(self) -> int:
        """Byte offset just past the tensor's data."""
        return self.offset + self.spec.nbytes


@dataclass(frozen=True)
class Bucket:
    """A group of consecutive tensors sent as one byte buffer of `nbytes` bytes."""

    slots: tuple[Slot, ...]
    nbytes: int

    @property
    def aligned_nbytes(self) -> int:
        """`nbytes` rounded up to `ALIGN_BYTES`: the size of a buffer that holds the bucket."""
        return _round_up(self.nbytes, ALIGN_BYTES)


def plan_buckets(specs: Sequence[TensorSpec], bucket_size_bytes: int) -> list[Bucket]:
    """Groups tensors, in order, into buckets of at most `bucket_size_bytes` bytes.

    A bucket closes when the next tensor would not fit; a tensor larger than a bucket gets a
    bucket of its own (of its own size). The plan depends only on its arguments, so both ends of
    a transfer derive the same one.

    Args:
        specs: The tensors, in send order.
        bucket_size_bytes: Target size of a bucket in bytes; must be positive.

    Raises:
        WeightValidationError: `bucket_size_bytes` is not an int >= 1.

    >>> import torch
    >>> from weightsync.transfer.base import TensorSpec
    >>> specs = [TensorSpec(f"w{i}", torch.float32, (64,)) for i in range(3)]
    >>> [len(b.slots) for b in plan_buckets(specs, bucket_size_bytes=512)]
    [2, 1]
    """
    WireParams(bucket_size_bytes=bucket_size_bytes)  # the one check of a bucket size
    return _layout(specs, bucket_size_bytes)


def flat_layout(specs: Sequence[TensorSpec]) -> Bucket:
    """The layout of `specs` in one flat buffer: the bucket plan without a size limit.

    [`flatten_module`][weightsync.transfer.flat.flatten_module] lays parameters out this way, so
    every bucket of a plan over the same tensors is a slice of that buffer.

    >>> import torch
    >>> from weightsync.transfer.base import TensorSpec
    >>> flat_layout([TensorSpec("a", torch.float32, (3,)), TensorSpec("b", torch.int8, ())]).nbytes
    257
    """
    buckets = _layout(specs, None)
    return buckets[0] if buckets else Bucket((), 0)


def _layout(specs: Sequence[TensorSpec], bucket_size_bytes: int | None) -> list[Bucket]:
    """Places tensors in order, each at an aligned offset, closing a bucket when one is full."""
    buckets: list[Bucket] = []
    slots: list[Slot] = []
    end = 0
    for spec in specs:
        offset = _round_up(end, ALIGN_BYTES)
        if slots and bucket_size_bytes is not None and offset + spec.nbytes > bucket_size_bytes:
            buckets.append(Bucket(tuple(slots), end))
            slots, offset = [], 0
        slots.append(Slot(spec, offset))
        end = offset + spec.nbytes
    if slots:
        buckets.append(Bucket(tuple(slots), end))
    return buckets


def _round_up(nbytes: int, multiple: int) -> int:
    """Rounds `nbytes` up to a multiple of `multiple`."""
    return -(-nbytes // multiple) * multiple


# --- the copies in and out of buckets ------------------------------------------------------------


def _typed_view(buffer: torch.Tensor, slot: Slot) -> torch.Tensor:
    """Views the bytes of `slot` inside a uint8 `buffer` as the slot's tensor."""
    raw = buffer[slot.offset : slot.end]
    return raw.view(slot.spec.dtype).view(slot.spec.shape)


def pack_bucket(
    bucket: Bucket, tensors: Sequence[torch.Tensor], buffer: torch.Tensor
) -> torch.Tensor:
    """Copies `tensors` (one per slot, any layout or device) into `buffer` at the plan's offsets.

    Returns:
        `buffer[:bucket.nbytes]`, the bytes to send.
    """
    for slot, tensor in zip(bucket.slots, tensors, strict=True):
        _typed_view(buffer, slot).copy_(tensor)
    return buffer[: bucket.nbytes]


def unpack_bucket(bucket: Bucket, buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Returns `(name, view)` pairs over a received bucket; the views share `buffer`'s memory."""
    return [(slot.spec.name, _typed_view(buffer, slot)) for slot in bucket.slots]


@dataclass
class _DirectRegion:
    """A bucket's bytes found in place inside existing tensor memory.

    Attributes:
        data: uint8 view of the memory covering the whole bucket.
        gaps: Byte ranges inside `data` that belong to no tensor of the bucket (alignment
            padding). A receiver writing into `data` saves and restores them, since other tensors
            may live there.
    """

    data: torch.Tensor
    gaps: list[tuple[int, int]]

    def save_gaps(self) -> list[torch.Tensor]:
        """Copies the gap bytes out, before `data` is overwritten."""
        return [self.data[start:end].clone() for start, end in self.gaps]

    def restore_gaps(self, saved: list[torch.Tensor]) -> None:
        """Writes back what `save_gaps` copied."""
        for (start, end), gap in zip(self.gaps, saved, strict=True):
            self.data[start:end].copy_(gap)


def _direct_region(bucket: Bucket, tensors: Sequence[torch.Tensor]) -> _DirectRegion | None:
    """Finds the bucket's bytes in place, if `tensors` already sit at the plan's offsets.

    That is the case when every tensor is contiguous, has its slot's dtype and shape, and all
    share one storage at the same relative byte offsets as in the bucket (for instance a module
    laid out by [`flatten_module`][weightsync.transfer.flat.flatten_module]). Sending or receiving
    through the region skips the pack or unpack copy.

    Returns:
        The region, or None when the layout does not match (the caller then packs).
    """
    first = tensors[0]
    storage = first.untyped_storage()
    base = first.storage_offset() * first.element_size()
    for slot, tensor in zip(bucket.slots, tensors, strict=True):
        if (
            tensor.dtype != slot.spec.dtype
            or tuple(tensor.shape) != slot.spec.shape
            or not tensor.is_contiguous()
            or tensor.device != first.device
            or tensor.untyped_storage().data_ptr() != storage.data_ptr()
            or tensor.storage_offset() * tensor.element_size() - base != slot.offset
        ):
            return None
    if base + bucket.nbytes > storage.nbytes():
        return None
    data = torch.empty(0, dtype=torch.uint8, device=first.device)
    data.set_(storage, base, (bucket.nbytes,), (1,))
    gaps = []
    for prev, nxt in zip(bucket.slots, bucket.slots[1:], strict=False):
        if nxt.offset > prev.end:
            gaps.append((prev.end, nxt.offset))
    return _DirectRegion(data, gaps)
