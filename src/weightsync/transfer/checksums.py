"""SHA-256 digests of named tensors: check that two sides hold bitwise-equal weights."""

from __future__ import annotations

import ctypes
import hashlib
from collections.abc import Iterable, Mapping

import torch

__all__ = ["weight_checksums"]


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """A read-only, zero-copy view of `tensor`'s row-major bytes, keeping them alive (no numpy)."""
    flat = tensor.detach().cpu().contiguous()
    nbytes = flat.numel() * flat.element_size()
    if nbytes == 0:
        return memoryview(b"")
    # torch tensors do not export the buffer protocol; a ctypes array over their memory does.
    array = (ctypes.c_ubyte * nbytes).from_address(flat.data_ptr())
    array._tensor = flat  # type: ignore[attr-defined]  # the memoryview holds `array`, which holds `flat`
    return memoryview(array).cast("B").toreadonly()


def weight_checksums(
    named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
) -> dict[str, str]:
    """Returns the SHA-256 hex digest of each tensor's bytes, by name.

    Equal digests mean bitwise-equal contents (dtype and shape are not hashed):
    compare the trainer's digests with an engine's after an update to check that every weight
    arrived intact. A tensor off the CPU or not contiguous is hashed from a contiguous CPU copy.

    Args:
        named_tensors: A mapping from name to tensor, or an iterable of `(name, tensor)` pairs such
            as `model.named_parameters()`.

    Returns:
        `{name: hex digest}`, in the order the tensors came.

    >>> import torch
    >>> weight_checksums({"w": torch.ones(2)}) == weight_checksums([("w", torch.ones(2))])
    True
    >>> weight_checksums({"w": torch.ones(2)}) == weight_checksums({"w": torch.zeros(2)})
    False
    """
    pairs = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    return {name: hashlib.sha256(_byte_view(tensor)).hexdigest() for name, tensor in pairs}
