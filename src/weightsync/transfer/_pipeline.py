"""The bucket pipeline every backend runs: reusable buffers and a window of buckets in flight.

A side moves bucket k+1 (pack, post, copy) while bucket k is still in flight, and never holds more
than `num_buffers` buckets at once: `Window` waits for the oldest before a new one is posted,
and `BufferPool` hands out the buffers they use, grown on demand and kept across updates.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Generic, TypeVar

import torch

from weightsync.transfer._sender import AnnouncedTensors
from weightsync.transfer.packing import Bucket

_BufferT = TypeVar("_BufferT")
_ItemT = TypeVar("_ItemT")


class BufferPool(Generic[_BufferT]):
    """`count` buffers, allocated on first use, grown when too small, reused across updates.

    Args:
        count: Number of buffers (the `num_buffers` wire parameter).
        allocate: Makes a buffer of at least the given number of bytes.
        size: A buffer's size in bytes.
        release: Frees a buffer that is replaced or cleared (e.g. unlinks its segment).
    """

    def __init__(
        self,
        count: int,
        allocate: Callable[[int], _BufferT],
        size: Callable[[_BufferT], int],
        release: Callable[[_BufferT], None] | None = None,
    ) -> None:
        self._buffers: list[_BufferT | None] = [None] * count
        self._allocate = allocate
        self._size = size
        self._release = release
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
        """Returns buffer `index` to the free list."""
        self.free.append(index)

    def reset(self) -> None:
        """Marks every buffer free (at the start of an update)."""
        self.free = list(range(len(self._buffers)))

    def clear(self) -> None:
        """Releases every buffer; the next `take` allocates anew."""
        buffers, self._buffers = self._buffers, [None] * len(self._buffers)
        for buffer in buffers:
            if buffer is not None and self._release is not None:
                self._release(buffer)
        self.reset()


def byte_buffers(count: int, device: torch.device) -> BufferPool[torch.Tensor]:
    """A pool of plain uint8 tensors on `device`."""
    return BufferPool(
        count,
        lambda nbytes: torch.empty(nbytes, dtype=torch.uint8, device=device),
        torch.Tensor.numel,
    )


class Window(Generic[_ItemT]):
    """At most `depth` items in flight, landed oldest first.

    Args:
        depth: The most items in flight (the `num_buffers` wire parameter).
        land: Waits for an item and finishes it (loads it, gives its buffer back).
    """

    def __init__(self, depth: int, land: Callable[[_ItemT], None]) -> None:
        self._depth = depth
        self._land = land
        self._items: deque[_ItemT] = deque()

    def __len__(self) -> int:
        return len(self._items)

    def make_room(self) -> None:
        """Lands the oldest item when the window is full, so that one more may be posted."""
        if len(self._items) >= self._depth:
            self._land(self._items.popleft())

    def push(self, item: _ItemT) -> None:
        """Adds a posted item; call `make_room` before posting it."""
        self._items.append(item)

    def drain(self) -> None:
        """Lands every item, oldest first."""
        while self._items:
            self._land(self._items.popleft())

    def clear(self) -> None:
        """Forgets the items in flight (after a failure: they pin resources open)."""
        self._items.clear()


def announced_buckets(
    buckets: Sequence[Bucket], source: AnnouncedTensors, total: int
) -> Iterator[tuple[int, Bucket, list[torch.Tensor]]]:
    """Yields each bucket's first tensor index, the bucket and its tensors, taken from `source`.

    Every tensor is checked against the announcement; after the last bucket, `source` must be
    exhausted (`total` tensors announced).

    Raises:
        WeightValidationError: A tensor differs from the announcement, or the counts differ.
    """
    first = 0
    for number, bucket in enumerate(buckets):
        tensors = [source.take(slot.spec, first + i) for i, slot in enumerate(bucket.slots)]
        if number == len(buckets) - 1:
            source.check_exhausted(total)
        yield first, bucket, tensors
        first += len(bucket.slots)
    if not buckets:
        source.check_exhausted(0)
