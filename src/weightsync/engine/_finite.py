"""The one check of weights for NaN and infinity, shared by live updates and LoRA adapters."""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["non_finite_names"]


def non_finite_names(weights: Iterable[tuple[str, torch.Tensor]], names: set[str]) -> list[str]:
    """The names among `names` whose tensor holds a NaN or an infinity, sorted."""
    # One flag per tensor, read back at once: a model on a GPU pays one synchronization.
    checked = [(name, tensor) for name, tensor in weights if name in names]
    if not checked:
        return []
    flags = torch.stack([torch.isfinite(t).all() for _, t in checked]).tolist()
    return sorted(name for (name, _), ok in zip(checked, flags, strict=True) if not ok)
