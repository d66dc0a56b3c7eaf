"""The data-parallel front: one HTTP server in front of N replicas (`--data-parallel-size N`).

Completions go to the replica with the fewest open requests, and its answer (a stream's bytes
as they come) goes back unchanged. A replica that dies ends its streams with
`finish_reason="error"` for every unfinished choice, then `[DONE]`; a non-streamed request it ran
is answered with the same finish reason. The RL routes are the one server's, over the replicas
(`FleetControl`). `/inference/v1/generate` is relayed as a completion is; `/tokenize` and
`/detokenize` go to any live replica. With `--enable-lora`, the LoRA routes load and unload an
adapter on every replica or on none, and a completion naming an adapter is routed as any other.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from weightsync.serve._auth import require_api_key
from weightsync.serve._errors import RequestRefused
from weightsync.serve._fields import IGNORED_FIELDS_HEADER as _IGNORED
from weightsync.serve._front.control import FleetControl
from weightsync.serve._front.fleet import Fleet, Replica
from weightsync.serve._http import build_app, unless_disconnected
from weightsync.serve.config import ServerConfig

logger = logging.getLogger("weightsync.serve")

_FINISH = re.compile(rb'"finish_reason":\s*"')  # an event that ends a choice (not `null`)
_STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass(frozen=True)
class _Shape:
    """What the front knows of a completion it relays: enough to end its choices itself."""

    completion_id: str
    chat: bool
    num_choices: int
    model: str
    created: int = field(default_factory=lambda: int(time.time()))

    def error_choice(self, index: int, *, stream: bool) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "logprobs": None, "finish_reason": "error",
                                  "token_ids": [], "weight_versions": []}  # fmt: skip
        if self.chat:
            choice["delta" if stream else "message"] = (
                {"content": ""} if stream else {"role": "assistant", "content": ""}
            )
        else:
            choice.update(text="", stop_reason=None)
        return choice

    def error_body(self, indices: list[int], *, stream: bool) -> dict[str, Any]:
        """A chunk (or a whole answer) that ends `indices` with `finish_reason="error"`."""
        kind = "chat.completion" if self.chat else "text_completion"
        body = {"id": self.completion_id, "object": kind + (".chunk" if self.chat and stream else ""),
                "created": self.created, "model": self.model,
                "choices": [self.error_choice(i, stream=stream) for i in indices]}  # fmt: skip
        if not stream:
            body["usage"] = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        return body


def _num_choices(body: dict[str, Any], chat: bool) -> int:
    n = body.get("n") if isinstance(body.get("n"), int) else 1
    prompt = body.get("prompt")
    if not chat and isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return int(n or 1) * len(prompt)  # a batch of prompts
    return int(n or 1)


def _finished_indices(event: bytes) -> list[int]:
    """The choices a server-sent event ends."""
    try:
        chunk = json.loads(event.removeprefix(b"data: "))
    except ValueError:
        return []
    return [c.get("index", 0) for c in chunk.get("choices", []) if c.get("finish_reason")]


async def _relay(
    state: FleetControl, replica: Replica, upstream: httpx.Response, shape: _Shape
) -> AsyncIterator[bytes]:
    """Passes a replica's stream through; ends it with error finishes if the replica dies."""
    finished: set[int] = set()
    pending, done = b"", False
    try:
        async for data in upstream.aiter_raw():
            yield data
            *events, pending = (pending + data).split(b"\n\n")
            for event in events:
                done = done or event == b"data: [DONE]"
                if _FINISH.search(event):
                    finished.update(_finished_indices(event))
    except httpx.HTTPError as exc:
        if not done:
            logger.error("%s broke off completion %s: %r", replica.name, shape.completion_id, exc)
            left = [i for i in range(shape.num_choices) if i not in finished]
            if left:
                yield b"data: " + json.dumps(shape.error_body(left, stream=True)).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"
    finally:
        _release(state, replica, shape.completion_id)
        await upstream.aclose()


def _release(state: FleetControl, replica: Replica, completion_id: str) -> None:
    replica.open_requests -= 1
    state.live.pop(completion_id, None)


def _identify(state: FleetControl, raw: bytes, chat: bool) -> tuple[bytes, dict[str, Any], _Shape]:
    """The request with its completion id set (the front routes `/abort_requests` by it)."""
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    except RecursionError:  # a JSON body nested thousands deep
        raise RequestRefused(
            400, "the body is not valid JSON: it nests too deeply", param="body"
        ) from None
    if not isinstance(body, dict):  # a replica answers it with its own 400
        body = {}
    completion_id = body.get("request_id")
    if completion_id is None:  # only a missing id is the front's to choose (a replica refuses "")
        completion_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    if not isinstance(completion_id, str):  # a list or a dict cannot even be looked up
        raise RequestRefused(
            400, f"request_id must be a string, got {completion_id!r}", param="request_id"
        )
    if completion_id in state.live:
        raise RequestRefused(
            400, f"request_id {completion_id!r} is already running; use a unique id",
            param="request_id",
        )  # fmt: skip
    if body:
        body["request_id"] = completion_id
        raw = json.dumps(body).encode()
    shape = _Shape(str(completion_id), chat, _num_choices(body, chat), state.config.model_name)
    return raw, body, shape


def _broken_off(shape: _Shape, *, stream: bool) -> Response:
    """The answer of a request whose replica died while it ran: every choice ends in error."""
    every = list(range(shape.num_choices))
    if not stream:
        return JSONResponse(shape.error_body(every, stream=False))
    chunk = b"data: " + json.dumps(shape.error_body(every, stream=True)).encode() + b"\n\n"
    events = iter([chunk, b"data: [DONE]\n\n"])
    return StreamingResponse(events, media_type="text/event-stream", headers=_STREAM_HEADERS)


async def _completion(request: Request, path: str, chat: bool) -> Response:
    """Sends a completion request to the least-loaded replica and relays its answer.

    A client that leaves before a non-streamed answer cancels the call to the replica, whose
    server then aborts the request (a stream's client that leaves closes the relay, likewise).
    """
    state: FleetControl = request.app.state.serve
    raw, body, shape = _identify(state, await request.body(), chat)
    replica = state.fleet.pick()
    replica.open_requests += 1
    state.live[shape.completion_id] = replica.index
    relayed = False
    try:
        answer = await unless_disconnected(
            request, _forward(state, replica, path, raw, shape, stream=bool(body.get("stream")))
        )
        relayed = isinstance(answer, StreamingResponse)  # the relay releases it when it ends
        return answer if answer is not None else Response(status_code=499)
    finally:
        if not relayed:
            _release(state, replica, shape.completion_id)


async def _forward(
    state: FleetControl, replica: Replica, path: str, raw: bytes, shape: _Shape, *, stream: bool
) -> Response:
    """The replica's answer: a relayed stream, its whole answer, or error finishes if it died."""
    assert replica.http is not None
    try:
        upstream = await replica.http.send(
            replica.http.build_request(
                "POST", path, content=raw, headers={"content-type": "application/json"}
            ),
            stream=True,
        )
    except httpx.ConnectError as exc:  # it never reached the replica: nothing started
        raise replica.unavailable() if not replica.alive else RequestRefused(
            503, f"{replica.name}: POST {path} failed: {exc!r}",
            error_type="ReplicaUnavailableError",
        ) from exc  # fmt: skip
    except httpx.HTTPError as exc:  # the replica broke off while it held the request
        logger.error("%s broke off completion %s: %r", replica.name, shape.completion_id, exc)
        return _broken_off(shape, stream=stream)
    # The replica validated the body: its note of the fields it ignored goes back too.
    relayed = {k: v for k, v in upstream.headers.items() if k.lower() == _IGNORED.lower()}
    if upstream.headers.get("content-type", "").startswith("text/event-stream"):
        return StreamingResponse(
            _relay(state, replica, upstream, shape),
            media_type="text/event-stream",
            headers={**_STREAM_HEADERS, **relayed},
        )
    try:
        content = await upstream.aread()
    except httpx.HTTPError:
        return _broken_off(shape, stream=False)
    finally:
        await upstream.aclose()
    return Response(
        content,
        upstream.status_code,
        headers=relayed,
        media_type=upstream.headers.get("content-type"),
    )


_v1 = APIRouter(prefix="/v1", tags=["openai"], dependencies=[Depends(require_api_key)])


@_v1.post("/completions", response_model=None, operation_id="create_completion")
async def _create_completion(request: Request) -> Response:
    """Completes the prompts on the least-loaded replica (see `/v1/completions` of a replica)."""
    return await _completion(request, "/v1/completions", chat=False)


@_v1.post("/chat/completions", response_model=None, operation_id="create_chat_completion")
async def _create_chat_completion(request: Request) -> Response:
    """Replies on the least-loaded replica (see `/v1/chat/completions` of a replica)."""
    return await _completion(request, "/v1/chat/completions", chat=True)


_tokens = APIRouter(tags=["tokens"], dependencies=[Depends(require_api_key)])
_PASS_THROUGH_TIMEOUT_S = 60.0  # a tokenizer call on a replica: no engine step waits on it


async def _pass_through(request: Request, path: str) -> Response:
    """A replica's answer to the request as it came (a tokenizer call: any replica answers)."""
    state: FleetControl = request.app.state.serve
    replica = state.fleet.pick()
    assert replica.http is not None
    try:
        upstream = await replica.http.post(
            path, content=await request.body(), timeout=_PASS_THROUGH_TIMEOUT_S,
            headers={"content-type": request.headers.get("content-type", "application/json")},
        )  # fmt: skip
    except httpx.HTTPError as exc:
        raise replica.unavailable() if not replica.alive else RequestRefused(
            503, f"{replica.name}: POST {path} failed: {exc!r}",
            error_type="ReplicaUnavailableError",
        ) from exc  # fmt: skip
    return Response(
        upstream.content, upstream.status_code, media_type=upstream.headers.get("content-type")
    )


@_tokens.post("/tokenize", operation_id="tokenize")
async def _tokenize(request: Request) -> Response:
    """A replica's `/tokenize` (see `/tokenize` of a replica)."""
    return await _pass_through(request, "/tokenize")


@_tokens.post("/detokenize", operation_id="detokenize")
async def _detokenize(request: Request) -> Response:
    """A replica's `/detokenize` (see `/detokenize` of a replica)."""
    return await _pass_through(request, "/detokenize")


@_tokens.post("/inference/v1/generate", response_model=None, operation_id="generate_tokens")
async def _generate_tokens(request: Request) -> Response:
    """Tokens in, tokens out on the least-loaded replica (see its `/inference/v1/generate`)."""
    return await _completion(request, "/inference/v1/generate", chat=False)


def create_fleet_app(fleet: Fleet, config: ServerConfig, *, enable_lora: bool = False) -> FastAPI:
    """Builds the front's app over `fleet`; its shutdown stops the replicas.

    Args:
        fleet: The replicas, started.
        config: The front's keys and limits.
        enable_lora: The replicas serve LoRA adapters (`--enable-lora`): the front mounts the
            LoRA routes, which load and unload on every replica or on none.

    Returns:
        The app, ready for uvicorn.
    """

    async def close() -> None:
        await fleet.close()
        logger.info("replicas shut down")

    from weightsync.serve._lora_routes import router as lora

    control = FleetControl(fleet, config)
    routers = [_v1, _tokens, *([lora] if enable_lora else [])]
    return build_app(
        control, control, routers, close=close, start=control.watch_replicas,
        title="weightsync serve (data parallel)",
    )  # fmt: skip
