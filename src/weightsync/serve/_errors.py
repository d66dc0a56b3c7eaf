"""How a weightsync error becomes an HTTP answer, and how a request's own mistakes are reported.

Every error body has one shape, OpenAI's, so that OpenAI clients show the message and a trainer
can re-raise the same class on its side:
`{"error": {"message": ..., "type": "<weightsync error class>", "param": <field or null>,
"code": <status>}}`.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from weightsync import (
    EngineConfigError,
    EngineStateError,
    InvalidRequestError,
    ReplicaUnavailableError,
    WeightSyncError,
    WeightTransferError,
    WeightTransferTimeout,
    WeightValidationError,
)
from weightsync.errors import LoRAAdapterNotFoundError
from weightsync.serve._fields import unknown_field_message

logger = logging.getLogger(__name__)

# Most specific first: the first class an error is an instance of gives its status.
_STATUS: tuple[tuple[type[WeightSyncError], int], ...] = (
    (WeightTransferTimeout, 504),  # the trainer (or a peer) did not show up in time
    (WeightTransferError, 502),  # the transfer with the trainer broke while bytes moved
    (ReplicaUnavailableError, 503),  # a data-parallel replica died: the fleet cannot act whole
    (EngineStateError, 409),  # busy, paused, torn, an update in progress, calls out of order
    (WeightValidationError, 400),
    (LoRAAdapterNotFoundError, 404),  # vLLM's answer to an adapter it does not hold
    (InvalidRequestError, 400),
    (EngineConfigError, 400),
)


class RequestRefused(WeightSyncError):
    """A request the server refuses before it reaches the engine (auth, size, malformed).

    Attributes:
        status: The HTTP status to answer with.
        param: The field, query parameter or header at fault, if one is.
        error_type: The error type the body names.
    """

    def __init__(
        self, status: int, message: str, *, param: str | None = None, error_type: str = ""
    ) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.error_type = error_type or "InvalidRequestError"


def status_of(exc: WeightSyncError) -> int:
    """The HTTP status of a weightsync error: 400, 404, 409, 502, 503 or 504 (500 if unknown)."""
    for cls, status in _STATUS:
        if isinstance(exc, cls):
            return status
    return 500


def error_body(
    status: int, error_type: str, message: str, param: str | None = None, **extra: Any
) -> dict[str, Any]:
    """The JSON body of an error answer."""
    return {
        "error": {"message": message, "type": error_type, "param": param, "code": status, **extra}
    }


def error_response(
    status: int,
    error_type: str,
    message: str,
    param: str | None = None,
    *,
    headers: dict[str, str] | None = None,
    **extra: Any,
) -> JSONResponse:
    """An error answer in the one error shape."""
    return JSONResponse(
        error_body(status, error_type, message, param, **extra), status_code=status, headers=headers
    )


def _field_name(location: tuple[Any, ...]) -> str:
    """`("body", "messages", 0, "role")` -> `"messages[0].role"`."""
    parts = [p for p in location if p not in ("body", "query", "header", "path")]
    name = ""
    for part in parts:
        name += f"[{part}]" if isinstance(part, int) else (f".{part}" if name else str(part))
    return name or "body"


def _describe(error: Any) -> tuple[str, str]:
    """One validation error as `(field, message)`."""
    field = _field_name(tuple(error.get("loc", ())))
    kind = error.get("type")
    if kind == "json_invalid":
        return "body", f"the body is not valid JSON: {error.get('ctx', {}).get('error', '')}"
    if kind == "unknown_field":
        return unknown_field_message(field, error.get("ctx", {}).get("names", []))
    if kind == "extra_forbidden":
        return field, f"unknown field {field!r}: remove it (see the route's documented fields)"
    if kind == "missing":
        return field, f"field {field!r} is required"
    where = "query parameter" if "query" in error.get("loc", ()) else "field"
    return (
        field,
        f"{where} {field!r}: {error.get('msg', 'invalid value')}; got {error.get('input')!r}",
    )


def _on_validation_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    described = [_describe(error) for error in exc.errors()]
    message = "; ".join(dict.fromkeys(message for _, message in described))
    return error_response(400, "InvalidRequestError", message, described[0][0])


def _on_weightsync_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, WeightSyncError)
    if isinstance(exc, RequestRefused):
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return error_response(exc.status, exc.error_type, str(exc), exc.param, headers=headers)
    status = status_of(exc)
    if status == 500:
        logger.exception("unmapped weightsync error", exc_info=exc)
    extra: dict[str, Any] = {}
    if isinstance(exc, WeightTransferError):
        extra["partially_applied"] = exc.partially_applied
    return error_response(
        status, type(exc).__name__, str(exc), getattr(exc, "param", None), **extra
    )


def _on_http_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    kind = {404: "NotFound", 405: "MethodNotAllowed"}.get(exc.status_code, "HTTPError")
    return error_response(exc.status_code, kind, str(exc.detail))


def _on_unexpected(_: Request, exc: Exception) -> JSONResponse:
    logger.exception("unexpected error while serving a request", exc_info=exc)
    return error_response(500, type(exc).__name__, f"internal error: {exc!r}")


def install_error_handlers(app: FastAPI) -> None:
    """Answers every error in the one error shape, with the status of its class."""
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(WeightSyncError, _on_weightsync_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected)
