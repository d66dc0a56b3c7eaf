"""Copies between tensors and bucket bytes, and in-place regions: the private half of packing."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # packing imports round_up from here
    from weightsync.transfer.packing import Bucket, Slot


def round_up(nbytes: int, multiple: int) -> int:
    """Rounds `nbytes` up to a multiple of `multiple`.

    >>> round_up(1, 256), round_up(256, 256), round_up(257, 256)
    (256, 256, 512)
    """
    return -(-nbytes // multiple) * multiple


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
class DirectRegion:
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


def direct_region(bucket: Bucket, tensors: Sequence[torch.Tensor]) -> DirectRegion | None:
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
    return DirectRegion(data, gaps)
