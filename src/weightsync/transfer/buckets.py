"""Buckets: where each tensor of an update lies inside a few large byte buffers, and their journey.

Both ends derive the same [`plan_buckets`][weightsync.transfer.buckets.plan_buckets] from the
update's metadata, so the wire carries bytes only; tensors start at multiples of `ALIGN_BYTES`, so
bucket bytes view as typed tensors without a copy. Then the pipeline: reused buffers, a window of
buckets in flight, and the sender's check of each tensor against the announcement.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Generic, TypeVar

import torch
from torch import nn

from weightsync.errors import WeightValidationError
from weightsync.transfer.base import TensorSpec, WireParams

__all__ = [
    "ALIGN_BYTES",
    "Bucket",
    "Slot",
    "flat_layout",
    "flat_tensors",
    "flatten_module",
    "pack_bucket",
    "plan_buckets",
    "unpack_bucket",
]

_BufferT = TypeVar("_BufferT")
_ItemT = TypeVar("_ItemT")

ALIGN_BYTES = 256
"""Byte alignment of every tensor inside a bucket (and inside a flat parameter buffer)."""


# --- the layout ----------------------------------------------------------------------------------
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
    """Groups `specs`, in send order, into buckets of at most `bucket_size_bytes` bytes.

    A bucket closes when the next tensor would not fit; a tensor larger than a bucket gets a
    bucket of its own size. The plan depends only on the arguments: both ends derive the same.

    Raises:
        WeightValidationError: `bucket_size_bytes` is not an int >= 1.

    >>> specs = [TensorSpec(f"w{i}", torch.float32, (64,)) for i in range(3)]
    >>> [len(b.slots) for b in plan_buckets(specs, bucket_size_bytes=512)]
    [2, 1]
    """
    WireParams(bucket_size_bytes=bucket_size_bytes)  # the one check of a bucket size
    return _layout(specs, bucket_size_bytes)


def flat_layout(specs: Sequence[TensorSpec]) -> Bucket:
    """The layout of `specs` in one flat buffer: the bucket plan without a size limit.

    [`flatten_module`][weightsync.transfer.buckets.flatten_module] lays parameters out this way,
    so every bucket of a plan over the same tensors is a slice of that buffer.
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
    return -(-nbytes // multiple) * multiple


# --- the copies in and out of buckets, and in place ----------------------------------------------
def _typed_view(buffer: torch.Tensor, slot: Slot) -> torch.Tensor:
    return buffer[slot.offset : slot.end].view(slot.spec.dtype).view(slot.spec.shape)


def pack_bucket(
    bucket: Bucket, tensors: Sequence[torch.Tensor], buffer: torch.Tensor
) -> torch.Tensor:
    """Copies `tensors` (one per slot, any layout or device) into `buffer` at the plan's offsets.

    Returns `buffer[:bucket.nbytes]`, the bytes to send.
    """
    for slot, tensor in zip(bucket.slots, tensors, strict=True):
        _typed_view(buffer, slot).copy_(tensor)
    return buffer[: bucket.nbytes]


def unpack_bucket(bucket: Bucket, buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Returns `(name, view)` pairs over a received bucket; the views share `buffer`'s memory."""
    return [(slot.spec.name, _typed_view(buffer, slot)) for slot in bucket.slots]


@dataclass
class _DirectRegion:
    """A bucket's bytes in place (uint8), and the padding `gaps` that no tensor of it owns."""

    data: torch.Tensor
    gaps: list[tuple[int, int]]

    def save_gaps(self) -> list[torch.Tensor]:
        """Copies the gap bytes out before `data` is overwritten: other tensors may live there."""
        return [self.data[start:end].clone() for start, end in self.gaps]

    def restore_gaps(self, saved: list[torch.Tensor]) -> None:
        for (start, end), gap in zip(self.gaps, saved, strict=True):
            self.data[start:end].copy_(gap)


def _direct_region(bucket: Bucket, tensors: Sequence[torch.Tensor]) -> _DirectRegion | None:
    """The bucket's bytes in place if `tensors` lie in one storage at the plan's offsets, else None."""
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
    gaps = [(a.end, b.offset) for a, b in pairwise(bucket.slots) if b.offset > a.end]
    return _DirectRegion(data, gaps)


# --- the flat layout of a module -----------------------------------------------------------------
def flatten_module(module: nn.Module) -> torch.Tensor:
    """Moves every parameter of `module` into one flat uint8 buffer and returns the buffer.

    The parameters become views of the buffer, in `named_parameters()` order, where a bucket plan
    puts them: a sender broadcasts slices of parameter memory as they are, and a receiver laid out
    the same way receives straight into its parameters. Dtypes may be mixed. Each `nn.Parameter`
    is kept (only its `.data` changes), so hooks work unchanged; create optimizers after
    flattening, since state built before refers to the old memory. Later calls that replace
    `.data` (such as `module.to(dtype)`) undo the layout: transfers then pack again.

    Returns:
        The buffer (keep it alive as long as the module; the parameters share its memory).

    Raises:
        WeightValidationError: The parameters are not all on one device.

    >>> layer = nn.Linear(4, 2)
    >>> buffer = flatten_module(layer)
    >>> layer.bias.data_ptr() - layer.weight.data_ptr()
    256
    """
    params = list(module.named_parameters())
    devices = {p.device for _, p in params}
    if len(devices) > 1:
        raise WeightValidationError(
            f"flatten_module needs all parameters on one device, found {sorted(map(str, devices))}"
        )
    device = devices.pop() if devices else torch.device("cpu")
    buffer, views = flat_tensors([TensorSpec.of(name, p) for name, p in params], device=device)
    with torch.no_grad():
        for name, param in params:
            views[name].copy_(param.data)
            param.data = views[name]
    return buffer


def flat_tensors(
    specs: Sequence[TensorSpec], *, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Returns a zeroed flat buffer laid out for `specs` as a bucket plan is, and its views by name.

    >>> specs = [TensorSpec("a", torch.float32, (3,)), TensorSpec("b", torch.int8, ())]
    >>> buffer, views = flat_tensors(specs)
    >>> buffer.numel(), views["b"].shape
    (512, torch.Size([]))
    """
    layout = flat_layout(specs)
    buffer = torch.zeros(layout.aligned_nbytes, dtype=torch.uint8, device=device)
    return buffer, dict(unpack_bucket(layout, buffer))


# --- the pipeline: reusable buffers and a window of buckets in flight ----------------------------
class _BufferPool(Generic[_BufferT]):
    """`count` buffers made by `allocate`, grown when smaller than asked, reused across updates."""

    def __init__(
        self,
        count: int,
        allocate: Callable[[int], _BufferT],
        size: Callable[[_BufferT], int],
        release: Callable[[_BufferT], None] | None = None,
    ) -> None:
        self._buffers: list[_BufferT | None] = [None] * count
        self._allocate, self._size, self._release = allocate, size, release
        self.free: list[int] = list(range(count))

    def take(self, nbytes: int) -> tuple[int, _BufferT]:
        """Takes a free buffer of at least `nbytes`; returns its index and the buffer."""
        index = self.free.pop()
        buffer = self._buffers[index]
        if buffer is None or self._size(buffer) < nbytes:
            self._buffers[index] = None  # free the old one before allocating
            if buffer is not None and self._release is not None:
                self._release(buffer)
            buffer = self._buffers[index] = self._allocate(nbytes)
        return index, buffer

    def give_back(self, index: int) -> None:
        self.free.append(index)

    def reset(self) -> None:
        """Marks every buffer free, at the start of an update."""
        self.free = list(range(len(self._buffers)))

    def clear(self) -> None:
        """Releases every buffer; the next `take` allocates anew."""
        buffers, self._buffers = self._buffers, [None] * len(self._buffers)
        for buffer in buffers:
            if buffer is not None and self._release is not None:
                self._release(buffer)
        self.reset()


def _byte_buffers(count: int, device: torch.device) -> _BufferPool[torch.Tensor]:
    return _BufferPool(
        count,
        lambda nbytes: torch.empty(nbytes, dtype=torch.uint8, device=device),
        torch.Tensor.numel,
    )


class _Window(Generic[_ItemT]):
    """At most `depth` items in flight; `land` waits for the oldest and finishes it."""

    def __init__(self, depth: int, land: Callable[[_ItemT], None]) -> None:
        self._depth, self._land = depth, land
        self._items: deque[_ItemT] = deque()

    def __len__(self) -> int:
        return len(self._items)

    def make_room(self) -> None:
        """Lands the oldest item if the window is full, so that one more may be posted."""
        if len(self._items) >= self._depth:
            self._land(self._items.popleft())

    def push(self, item: _ItemT) -> None:  # call make_room before posting it
        self._items.append(item)

    def drain(self) -> None:
        while self._items:
            self._land(self._items.popleft())

    def clear(self) -> None:
        """Forgets the items in flight (after a failure: they pin resources open)."""
        self._items.clear()


# --- the sender's side: the trainer's tensors against the announcement ---------------------------
@dataclass
class _AnnouncedTensors:
    """A trainer's `(name, tensor)` pairs, each checked against the announcement (after `post`)."""

    # A tensor the receivers do not expect would hang a collective or load garbage: every sender
    # takes its tensors through here and stops at the first divergence.
    pairs: Iterator[tuple[str, torch.Tensor]]
    post: Callable[[tuple[str, torch.Tensor]], torch.Tensor] | None

    def take(self, spec: TensorSpec, index: int) -> torch.Tensor:
        """Returns the next tensor, which must be announced tensor `index`, matching `spec`."""
        pair = next(self.pairs, None)
        if pair is None:
            raise WeightValidationError(
                f"the iterator ended after {index} tensors but the update announced more, "
                f"starting with {spec.name!r}"
            )
        name, tensor = pair
        if self.post is not None:
            tensor = self.post(pair)
        if name != spec.name:
            raise WeightValidationError(
                f"tensor #{index} is {name!r} but the update announced {spec.name!r}"
            )
        got = TensorSpec.of(name, tensor)
        if got.shape != spec.shape or got.dtype != spec.dtype:
            raise WeightValidationError(
                f"tensor {name!r} is {got.describe()} but the update announced {spec.describe()}"
            )
        return tensor

    def check_exhausted(self, count: int) -> None:
        """Refuses a tensor after the `count` announced ones, naming it."""
        extra = next(self.pairs, None)
        if extra is not None:
            raise WeightValidationError(
                f"the iterator yields more tensors than the {count} announced, "
                f"starting with {extra[0]!r}"
            )


def _announced_buckets(
    buckets: Sequence[Bucket], source: _AnnouncedTensors, total: int
) -> Iterator[tuple[int, Bucket, list[torch.Tensor]]]:
    """Yields each bucket's first tensor index, the bucket and its checked tensors from `source`."""
    first = 0
    for number, bucket in enumerate(buckets):
        tensors = [source.take(slot.spec, first + i) for i, slot in enumerate(bucket.slots)]
        if number == len(buckets) - 1:
            source.check_exhausted(total)
        yield first, bucket, tensors
        first += len(bucket.slots)
    if not buckets:
        source.check_exhausted(0)
