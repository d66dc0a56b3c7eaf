"""[`WireParams`][weightsync.transfer.wire.WireParams]: the four parameters every backend's wire shares.

The trainer decides them once (`trainer_init`, `ipc_trainer_init`, a weight sender) and, for the
broadcast backends, they travel in the init info so that both sides cannot disagree. Their
defaults and their validation live here only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, TypedDict

from weightsync.errors import WeightValidationError
from weightsync.transfer._checks import is_int

__all__ = ["CLIENT_MARGIN_S", "DEFAULT_TIMEOUT_S", "WireParams"]

DEFAULT_TIMEOUT_S = 120.0
"""Default limit, in seconds, of every blocking transfer step (`WireParams.timeout_s`)."""

CLIENT_MARGIN_S = 30.0
"""What a call that waits for a transfer step adds to that step's limit, in seconds.

The rule: a caller's bound exceeds the bound of what it waits for, so the inner step times out
first and its error (which names the step) is what the caller sees. A trainer's call into an
engine therefore defaults to `DEFAULT_TIMEOUT_S + CLIENT_MARGIN_S`
(see [`WireParams.client_timeout_s`][weightsync.transfer.wire.WireParams.client_timeout_s]).
"""


@dataclass(frozen=True)
class WireParams:
    """How tensors travel: packed into buckets or not, bucket size, buffers, timeout.

    Attributes:
        packed: Pack tensors into byte buckets (True), or move each tensor on its own.
        bucket_size_bytes: Bucket size in bytes (packed mode); a tensor larger than a bucket gets
            a bucket of its own. Extra memory per side is at most `num_buffers` x this (or the
            largest tensor, if bigger).
        num_buffers: Buckets in flight at once, and reusable bucket buffers per side; 2 packs
            bucket k+1 while bucket k moves.
        timeout_s: Limit, in seconds, for every blocking step (rendezvous, each collective, each
            IPC hand-off).

    Raises:
        WeightValidationError: A field has the wrong type (a bool is not an int) or is out of
            range (a size or count below 1; a timeout that is not a finite number > 0); the
            message names the field, what it must be and what it got.

    >>> WireParams(bucket_size_bytes=256 << 20).num_buffers
    2
    """

    packed: bool = True
    bucket_size_bytes: int = 1 << 30
    num_buffers: int = 2
    timeout_s: float = DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        if not isinstance(self.packed, bool):
            raise WeightValidationError(f"packed must be a bool, got {self.packed!r}")
        if not is_int(self.bucket_size_bytes) or self.bucket_size_bytes < 1:
            raise WeightValidationError(
                f"bucket_size_bytes must be an int >= 1 (bytes), got {self.bucket_size_bytes!r}"
            )
        if not is_int(self.num_buffers) or self.num_buffers < 1:
            raise WeightValidationError(
                f"num_buffers must be an int >= 1, got {self.num_buffers!r}"
            )
        timeout = self.timeout_s
        if (
            not isinstance(timeout, int | float)
            or isinstance(timeout, bool)
            or not math.isfinite(timeout)
            or timeout <= 0
        ):
            raise WeightValidationError(
                f"timeout_s must be a finite number of seconds > 0, got {timeout!r}"
            )
        object.__setattr__(self, "timeout_s", float(timeout))

    @property
    def client_timeout_s(self) -> float:
        """Limit, in seconds, of a call that waits for one of these transfer steps.

        `timeout_s + CLIENT_MARGIN_S`: longer than the step it waits for, so that the step's
        own, more precise error comes first.
        """
        return self.timeout_s + CLIENT_MARGIN_S

    @classmethod
    def build(cls, wire: WireParams | None = None, **fields: Any) -> WireParams:
        """Returns `wire`, or a `WireParams` built from keyword `fields` (not both).

        This is what every entry point that takes wire parameters calls, so that they are given
        either as one object (`wire=WireParams(...)`) or as keywords (`bucket_size_bytes=...`).

        Raises:
            WeightValidationError: Both given, an unknown keyword, or a bad value.
        """
        if wire is not None:
            if fields:
                raise WeightValidationError(
                    f"pass the wire parameters either as wire=WireParams(...) or as keywords, "
                    f"not both: got wire and {sorted(fields)}"
                )
            if not isinstance(wire, WireParams):
                raise WeightValidationError(f"wire must be a WireParams, got {type(wire).__name__}")
            return wire
        unknown = sorted(set(fields) - set(cls.__dataclass_fields__))
        if unknown:
            raise WeightValidationError(
                f"unknown wire parameters {unknown}; expected some of "
                f"{sorted(cls.__dataclass_fields__)}"
            )
        return cls(**fields)

    def to_dict(self) -> dict[str, Any]:
        """Returns the JSON-safe dict form, with every field."""
        return {
            "packed": self.packed,
            "bucket_size_bytes": self.bucket_size_bytes,
            "num_buffers": self.num_buffers,
            "timeout_s": self.timeout_s,
        }


class _WireKeywords(TypedDict, total=False):
    """The fields of [`WireParams`][weightsync.transfer.wire.WireParams] as keyword arguments.

    Entry points take them as `**wire_fields` in place of a `wire=WireParams(...)` object.
    """

    packed: bool
    bucket_size_bytes: int
    num_buffers: int
    timeout_s: float
