"""A linear layer that multiplies by a prepacked copy of its weight, where that is faster.

oneDNN (in torch's CPU wheels) lays a weight matrix out in blocks that its matmul reads faster
than the plain row-major weight: on a CPU in float32, 1.6x a decoder layer at 8 tokens and 1.2x
at 64 (`benchmarks/bench_linear.py`), equal within float32 rounding. The copy is built once and
read with plain input and output tensors, so a call converts nothing. The plain weight stays
the parameter (what updates write into); `LlamaForCausalLM.repack_linears` rebuilds the copies.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

__all__ = ["PackedLinear", "pack_weight", "packing_unavailable"]


def packing_unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why linears on `device` in `dtype` cannot use prepacked weights; None when they can.

    Measured to win only on a CPU in float32 (`benchmarks/bench_linear.py`); the ops come with
    torch's CPU wheels built with oneDNN, and a build without them falls back to plain weights.
    """
    if device.type != "cpu" or dtype != torch.float32:
        return (
            f"only float32 on a CPU is packed, not {str(dtype).removeprefix('torch.')} on {device}"
        )
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return "this torch build has no oneDNN (torch.backends.mkldnn.is_available() is False)"
    try:
        probe = torch.ones(1, 1)
        torch.ops.mkldnn._linear_pointwise(probe, pack_weight(probe), None, "none", [], "")
    except (AttributeError, RuntimeError, NotImplementedError) as exc:  # an op missing or refusing
        return f"oneDNN's prepacked linear is unavailable ({type(exc).__name__}: {exc})"
    return None


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A new oneDNN copy of `weight` (out_features, in_features) in the layout its matmul reads."""
    packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
    return packed


class PackedLinear(nn.Linear):
    """`nn.Linear` that multiplies by a prepacked copy of its weight when it holds one.

    `packed` is oneDNN's blocked copy of `weight` (None: none, the plain weight is read). The
    plain weight stays the one updates write into; the copy is rebuilt from it by
    `LlamaForCausalLM.repack_linears`, and read with plain input and output tensors, so a call
    converts nothing. The bias is always read live.
    """

    packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ weight.T + bias` for `x` (tokens, in_features), from the packed copy if any."""
        packed = self.packed  # read once: a repack swaps the attribute, never its contents
        if packed is None:
            return F.linear(x, self.weight, self.bias)
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")
        return out
