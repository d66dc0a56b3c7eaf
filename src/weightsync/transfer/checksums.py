"""SHA-256 digests of named tensors: check that two sides hold bitwise-equal weights.

A digest covers a tensor's raw bytes in row-major order, so two tensors get the same digest exactly
when they have the same dtype, the same number of bytes and the same bits; shape and strides are
not hashed (compare shapes separately where they matter). Hashing needs only torch and the standard
library: the bytes are read through a zero-copy view, never through numpy.
"""

from __future__ import annotations

import ctypes
import hashlib
from collections.abc import Iterable, Mapping

import torch

__all__ = ["weight_checksums"]


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """A read-only, zero-copy view of `tensor`'s bytes that keeps them alive (copied if need be)."""
    flat = tensor.detach().cpu().contiguous()
    nbytes = flat.numel() * flat.element_size()
    if nbytes == 0:
        return memoryview(b"")
    # torch tensors do not export the buffer protocol; a ctypes array over the data pointer does,
    # for every dtype (bfloat16 and float8 included), without a copy.
    array = (ctypes.c_ubyte * nbytes).from_address(flat.data_ptr())
    array._tensor = flat  # type: ignore[attr-defined]  # the memoryview holds `array`, which holds `flat`
    return memoryview(array).cast("B").toreadonly()


def weight_checksums(
    named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
) -> dict[str, str]:
    """Returns the SHA-256 hex digest of each tensor's bytes, by name.

    Equal digests mean bitwise-equal contents: compare the trainer's digests with an engine's after
    an update to check that every weight arrived intact. Tensors on any device are hashed from a
    contiguous CPU copy (a CPU tensor that is already contiguous is read in place).

    Args:
        named_tensors: A mapping from name to tensor, or an iterable of `(name, tensor)` pairs such
            as `model.named_parameters()`.

    Returns:
        `{name: hex digest}`, in the order the tensors came.

    >>> import torch
    >>> a = weight_checksums({"w": torch.ones(2, 2)})
    >>> b = weight_checksums([("w", torch.ones(2, 2))])
    >>> a == b
    True
    >>> a == weight_checksums({"w": torch.zeros(2, 2)})
    False
    """
    pairs = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    return {name: hashlib.sha256(_byte_view(tensor)).hexdigest() for name, tensor in pairs}
