"""SHA-256 of a model's weights by name, read without a copy and without numpy."""

from __future__ import annotations

import ctypes
import hashlib

import torch

from weightsync import LlamaForCausalLM


def _digest(tensor: torch.Tensor) -> str:
    flat = tensor.detach().cpu().contiguous()
    nbytes = flat.numel() * flat.element_size()
    if nbytes == 0:
        return hashlib.sha256(b"").hexdigest()
    # torch tensors do not export the buffer protocol; a ctypes array over their memory does.
    array = (ctypes.c_ubyte * nbytes).from_address(flat.data_ptr())
    return hashlib.sha256(memoryview(array)).hexdigest()


def model_checksums(model: LlamaForCausalLM) -> dict[str, str]:
    """SHA-256 hex digest of each weight's bytes, by Hugging Face name."""
    return {name: _digest(tensor) for name, tensor in model.named_weights()}
