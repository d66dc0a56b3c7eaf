"""Bucket plans: where each tensor of an update lies inside a few large byte buffers.

Pure functions shared by every backend (the copies in and out of buckets are private).
Sender and receiver compute the same
[`plan_buckets`][weightsync.transfer.packing.plan_buckets] from the update's metadata alone, so
the wire carries bytes only. Inside a bucket each tensor starts at a multiple of
`ALIGN_BYTES`, so a bucket's bytes can be viewed as typed tensors without copying, and a module
laid out with [`flatten_module`][weightsync.transfer.flat.flatten_module] (same order, same
alignment) can be sent from, and received into, its own parameter memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from weightsync.transfer._bucket_io import round_up
from weightsync.transfer.base import TensorSpec
from weightsync.transfer.wire import WireParams

__all__ = ["ALIGN_BYTES", "Bucket", "Slot", "flat_layout", "plan_buckets"]

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
        offset = round_up(end, ALIGN_BYTES)
        if slots and bucket_size_bytes is not None and offset + spec.nbytes > bucket_size_bytes:
            buckets.append(Bucket(tuple(slots), end))
            slots, offset = [], 0
        slots.append(Slot(spec, offset))
        end = offset + spec.nbytes
    if slots:
        buckets.append(Bucket(tuple(slots), end))
    return buckets
