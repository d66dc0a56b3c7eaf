"""Server-sent events as an ASGI response, with little between an engine step and the socket.

Every streamed chunk of every open completion goes through here once per engine step, on the
event loop that the engine's step thread shares a GIL with: each microsecond spent per event is
taken from the next step. So events arrive here already encoded (bytes), the constant parts of
a completion's chunks are encoded once per completion, and the response watches for a
disconnect with one plain asyncio task rather than a task group.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

# One encoder for every event: `json.dumps` would build one per call (same output either way).
encode_json = json.JSONEncoder().encode


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event: `data: <JSON or text>` and a blank line."""
    return f"data: {data if isinstance(data, str) else encode_json(data)}\n\n".encode()


class ChunkFrame:
    """The encoded constant parts of a completion's chunks: all but the one choice.

    `frame.event(choice)` is `sse({**fields, "choices": [choice]})`, byte for byte, but the
    fields (id, object, created, model) are encoded once, not once per chunk.
    """

    def __init__(self, fields: dict[str, Any]) -> None:
        # "choices" is the last key: the encoded fields end with `"choices": [null]}`.
        head, _, tail = encode_json({**fields, "choices": [None]}).rpartition("null")
        self._head = f"data: {head}".encode()
        self._tail = f"{tail}\n\n".encode()

    def event(self, choice: dict[str, Any]) -> bytes:
        """The event of a chunk that carries `choice`."""
        return self._head + encode_json(choice).encode() + self._tail


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStream(StreamingResponse):
    """A `text/event-stream` response that sends each event (bytes) of `events` as it comes.

    If the client disconnects first, the task iterating `events` is cancelled, which ends the
    iterator where it waits: a completion's iterator then aborts its engine requests.
    """

    def __init__(self, events: AsyncIterator[bytes]) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(events, media_type="text/event-stream", headers=headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sending = asyncio.ensure_future(self._send_events(send))
        watching = asyncio.ensure_future(_until_disconnect(receive))
        try:
            await asyncio.wait((sending, watching), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (sending, watching):
                task.cancel()
            await asyncio.gather(sending, watching, return_exceptions=True)
        if not sending.cancelled() and (error := sending.exception()) is not None:
            raise error

    async def _send_events(self, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        async for event in self.body_iterator:
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
