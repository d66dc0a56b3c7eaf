"""Lay a module's parameters out in one flat buffer, so transfers need no pack copy.

After [`flatten_module`][weightsync.transfer.flat.flatten_module], the parameters are views of one
byte buffer, in `named_parameters()` order, each at a multiple of
[`ALIGN_BYTES`][weightsync.transfer.packing.ALIGN_BYTES]: exactly where a bucket plan puts them. A
sender then broadcasts bucket-sized slices of parameter memory directly, and a receiver laid out
the same way receives straight into its parameters.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from weightsync.errors import WeightValidationError
from weightsync.transfer.base import TensorSpec
from weightsync.transfer.packing import flat_layout, unpack_bucket

__all__ = ["flat_tensors", "flatten_module"]


def flatten_module(module: nn.Module) -> torch.Tensor:
    """Moves every parameter of `module` into one flat uint8 buffer and returns the buffer.

    Each `nn.Parameter` object is kept (only its `.data` changes), so hooks and optimizers
    created afterwards work unchanged; create optimizers after flattening, since state built
    before refers to the old memory. Dtypes may be mixed: each parameter is a typed view. Later
    calls that replace `.data` (such as `module.to(dtype)`) undo the layout; transfers then fall
    back to packing, they do not break.

    Args:
        module: The module; all its parameters must be on one device.

    Returns:
        The buffer (keep it alive as long as the module; the parameters share its memory).

    Raises:
        WeightValidationError: Parameters span several devices.

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
    """Allocates zeroed tensors for `specs` as views of one flat buffer, in the bucket layout.

    Returns:
        The buffer and the views by name.

    >>> from weightsync.transfer.base import TensorSpec
    >>> buffer, views = flat_tensors([TensorSpec("a", torch.float32, (3,)), TensorSpec("b", torch.int8, ())])
    >>> buffer.numel(), views["b"].shape
    (512, torch.Size([]))
    """
    layout = flat_layout(specs)
    buffer = torch.zeros(layout.aligned_nbytes, dtype=torch.uint8, device=device)
    return buffer, dict(unpack_bucket(layout, buffer))
