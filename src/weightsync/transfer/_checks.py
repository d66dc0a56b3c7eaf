"""Checks of values that cross the wire: ints, and payload dicts parsed into their dataclasses."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

from weightsync.errors import WeightValidationError

_InfoT = TypeVar("_InfoT")


def is_int(value: object) -> bool:
    """Whether `value` is an int and not a bool (JSON's `true` must not pass for 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def parse_info(cls: type[_InfoT], data: Any, *, what: str) -> _InfoT:
    """Builds the dataclass `cls` from a plain dict, as received over a control channel.

    Args:
        cls: The dataclass to build.
        data: A mapping of field names to values, or an instance of `cls` (returned as is).
        what: How the payload is called in error messages, e.g. `"init_info"`.

    Raises:
        WeightValidationError: `data` is not a mapping, has unknown keys, lacks required ones, or
            holds values the dataclass rejects. The message names every offending key.
    """
    if isinstance(data, cls):
        return data
    if not isinstance(data, Mapping):
        raise WeightValidationError(
            f"{what} must be a JSON object (dict) or {cls.__name__}, got {type(data).__name__}"
        )
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(fields))
    missing = sorted(
        name
        for name, f in fields.items()
        if name not in data
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    )
    problems = []
    if unknown:
        problems.append(f"unknown keys {unknown}")
    if missing:
        problems.append(f"missing keys {missing}")
    if problems:
        raise WeightValidationError(
            f"invalid {what} for {cls.__name__}: {'; '.join(problems)}; "
            f"expected keys: {sorted(fields)}"
        )
    try:
        return cls(**data)
    except WeightValidationError as exc:
        raise WeightValidationError(f"invalid {what}: {exc}") from None
    except (TypeError, ValueError) as exc:
        raise WeightValidationError(f"invalid {what} for {cls.__name__}: {exc}") from None
