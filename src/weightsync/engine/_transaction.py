"""The record of one weight update in progress, and the checks its finish runs.

[`LiveWeights`][weightsync.engine.weights.LiveWeights] owns the state machine; this module holds
the data it carries between calls and the check of the landed values that a finish may run
before the version moves.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from weightsync.engine.outputs import WeightVersion


def info_field(info: Any, key: str) -> Any:
    """Reads `key` from an update info given as a dict or a dataclass; None when absent."""
    if isinstance(info, Mapping):
        return info.get(key)
    return getattr(info, key, None)


@dataclass
class Transaction:
    """One weight update in progress: what it announced, what landed, what it may have written.

    Attributes:
        explicit: Opened by `start()` (ended by `finish()` or `abort()`); else opened by a bare
            `update()` and finished by the call that completes it.
        update_id: The transfer's own id of the update, from its first message that has one;
            a message with another id belongs to another update.
        announced: Names the transaction's messages said they deliver.
        landed: Names delivered completely.
        touched: Names whose bytes may have been written, completely or not.
        label: The `weight_version` the messages carry, if any.
        staged: Copies of the weights taken before they were touched (staging only).
        resume_after: The engine was running when the transaction began and resumes after it.
    """

    explicit: bool
    update_id: str | None = None
    announced: set[str] = field(default_factory=set)
    landed: set[str] = field(default_factory=set)
    touched: set[str] = field(default_factory=set)
    label: WeightVersion | None = None
    staged: dict[str, torch.Tensor] | None = None
    resume_after: bool = False


def non_finite_names(weights: Iterable[tuple[str, torch.Tensor]], names: set[str]) -> list[str]:
    """The names among `names` whose tensor in `weights` holds a NaN or an infinity, sorted.

    One flag per tensor is computed on the tensor's device and the flags are read back at once,
    so a model on a GPU pays one synchronization, not one per tensor.
    """
    checked = [(name, tensor) for name, tensor in weights if name in names]
    if not checked:
        return []
    flags = torch.stack([torch.isfinite(t).all() for _, t in checked]).tolist()
    return sorted(name for (name, _), ok in zip(checked, flags, strict=True) if not ok)
