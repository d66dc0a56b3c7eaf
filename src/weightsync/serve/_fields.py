"""Request fields the server does not know: vLLM's rule, or refused with `--strict-request-fields`.

vLLM accepts a request body with fields it does not know and logs their names as ignored, so a
client that sends one more field keeps working. Every request body here derives from
`RequestBody`, which does the same: the unknown names (nested ones with their path, such as
`messages[0].foo`) are logged once per request, with its id, and named in the answer's
`X-Ignored-Fields` header. A server started with `--strict-request-fields` refuses them instead,
with a 400 that names them (a misspelt `max_token` then fails loudly).

A field of vLLM's that would change the answer is never among the ignored: each route declares
it, and honours it or refuses it by name.

The server's rule reaches the body models through `RequestFields`, an ASGI middleware that opens
one report per request: the models write their unknown names into it while they are validated,
and the middleware adds the header as the answer starts.
"""

from __future__ import annotations

import contextvars
import logging
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic_core import PydanticCustomError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger("weightsync.serve")

IGNORED_FIELDS_HEADER = "X-Ignored-Fields"
"""The answer's header that names the request's ignored fields, comma-separated."""

_MAX_NAMED = 32  # a body of thousands of unknown keys must not make a header of them all
_MAX_NAME_CHARS = 64  # nor one key of a megabyte a header of a megabyte


def _shown(name: str) -> str:
    """A field name or a request id as the header and the log line show it: ASCII, bounded."""
    # Both come from the client: a CR or LF would end the header line and forge log lines.
    shown = name.encode("unicode_escape").decode("ascii")
    return shown if len(shown) <= _MAX_NAME_CHARS else shown[:_MAX_NAME_CHARS] + "..."


@dataclass
class _Report:
    """One request's unknown fields, under the server's rule."""

    strict: bool
    ignored: list[str] = field(default_factory=list)
    request_id: str | None = None


_current: contextvars.ContextVar[_Report | None] = contextvars.ContextVar(
    "weightsync_request_fields", default=None
)


class RequestBody(BaseModel):
    """The base of every request body: unknown fields are kept aside, reported, or refused.

    A model that hands its unknown fields on (a chat message's `tool_calls` go to the chat
    template, as vLLM passes messages) sets `passes_unknown_fields`: they are not ignored.
    """

    model_config = ConfigDict(extra="allow")
    passes_unknown_fields: ClassVar[bool] = False

    @model_validator(mode="after")
    def _report_unknown_fields(self) -> RequestBody:
        report = _current.get()
        if report is None:  # built outside a request (a test, a client): nothing to say
            return self
        own = sorted(self.model_extra or {}) if not self.passes_unknown_fields else []
        if report.strict and own:
            raise PydanticCustomError(
                "unknown_field",
                "unknown field(s) {names}",
                {"names": own},
            )
        # Inner models are validated first: the outermost, the body, writes the whole list last.
        report.ignored = self.unknown_fields()
        return self

    def unknown_fields(self) -> list[str]:
        """The names this body ignores, nested ones with their path (`messages[0].foo`)."""
        names = [] if self.passes_unknown_fields else sorted(self.model_extra or {})
        for name in type(self).model_fields:
            value = getattr(self, name)
            items = enumerate(value) if isinstance(value, list) else [(None, value)]
            for index, item in items:
                if isinstance(item, RequestBody):
                    where = name if index is None else f"{name}[{index}]"
                    names += [f"{where}.{inner}" for inner in item.unknown_fields()]
        return names


def name_request(request_id: str) -> None:
    """Names the current request in its ignored-fields log line (a completion's id)."""
    report = _current.get()
    if report is not None:
        report.request_id = request_id


def unknown_field_message(location: str, names: Any) -> tuple[str, str]:
    """A strict server's refusal of unknown fields: `(param, message)`."""
    listed = [str(n) for n in names] if isinstance(names, list) else [str(names)]
    prefix = "" if location == "body" else f"{location}."
    param = prefix + listed[0]
    message = (
        f"unknown field(s) {', '.join(repr(prefix + n) for n in listed)}: this server refuses "
        "fields it does not know (--strict-request-fields); remove them, or see the route's "
        "documented fields"
    )
    return param, message


class RequestFields:
    """ASGI middleware: opens each request's report, names its ignored fields as it answers.

    Args:
        app: The app it wraps.
        strict: Refuse unknown fields (400) instead of ignoring them.
    """

    def __init__(self, app: ASGIApp, *, strict: bool) -> None:
        self.app = app
        self.strict = strict

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        report = _Report(self.strict)
        token = _current.set(report)

        async def send_naming_ignored(message: Message) -> None:
            if message["type"] == "http.response.start" and report.ignored:
                names = ", ".join(_shown(name) for name in report.ignored[:_MAX_NAMED])
                if len(report.ignored) > _MAX_NAMED:
                    names += f" (and {len(report.ignored) - _MAX_NAMED} more)"
                who = _shown(report.request_id or f"{scope['method']} {scope['path']}")
                logger.warning("request %s: ignored unknown field(s) %s", who, names)
                header = (IGNORED_FIELDS_HEADER.lower().encode(), names.encode("ascii"))
                message = {**message, "headers": [*message.get("headers", []), header]}
            await send(message)

        try:
            await self.app(scope, receive, send_naming_ignored)
        finally:
            _current.reset(token)
