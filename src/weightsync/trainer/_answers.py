"""How an error answer of a weightsync (or vLLM) server becomes the weightsync error it names."""

from __future__ import annotations

import json
from typing import Any

from weightsync.errors import (
    EngineStateError,
    InvalidRequestError,
    WeightSyncError,
    WeightTransferError,
    WeightTransferTimeout,
)


def _error_classes() -> dict[str, type[WeightSyncError]]:
    """Every weightsync error class by name, so an error body's type maps back to its class."""
    found: dict[str, type[WeightSyncError]] = {}
    pending: list[type[WeightSyncError]] = [WeightSyncError]
    while pending:
        cls = pending.pop()
        found.setdefault(cls.__name__, cls)
        pending.extend(cls.__subclasses__())
    return found


ERRORS = _error_classes()
"""Every weightsync error class by name."""


def error_from_answer(call: str, status: int, text: str) -> WeightSyncError:
    """The weightsync error an error answer names by its type (else one fitting its status).

    Args:
        call: The call, for the message (`"POST /pause"`).
        status: The answer's HTTP status.
        text: The answer's body.
    """
    try:
        error = json.loads(text)["error"]
        error_type, message = str(error["type"]), str(error["message"])
    except (ValueError, KeyError, TypeError):
        error, error_type, message = {}, "", text[:500]
    message = f"{call} -> {status}: {message}"
    built = _error_of(error_type, status, message, error)
    if isinstance(error.get("param"), str):
        built.param = error["param"]  # a front passes its replica's answer on whole
    return built


def _error_of(error_type: str, status: int, message: str, error: dict[str, Any]) -> WeightSyncError:
    cls = ERRORS.get(error_type)
    if cls is not None and issubclass(cls, WeightTransferError):
        return cls(message, partially_applied=bool(error.get("partially_applied")))
    if cls is not None:
        return cls(message)
    if status == 504:
        return WeightTransferTimeout(message)
    if 400 <= status < 500 and status != 409:
        return InvalidRequestError(message)
    return EngineStateError(message)
