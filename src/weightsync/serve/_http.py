"""What every weightsync HTTP app shares: its assembly, the server routes, the size limit.

The assembly is around a control surface; the server routes are `/health`, `/version` and
`/v1/models`.

[`create_app`][weightsync.serve.app.create_app] (one engine) and a data-parallel front build
their apps here, so both answer the same RL routes with the same errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import weightsync
from weightsync.serve._auth import require_api_key
from weightsync.serve._control import ControlSurface
from weightsync.serve._errors import error_body, install_error_handlers
from weightsync.serve._rl_routes import router as rl_router
from weightsync.serve.config import ServerConfig

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


async def unless_disconnected(request: Request, work: Awaitable[_T]) -> _T | None:
    """Awaits `work`, unless the client disconnects first: then cancels it and returns None.

    A request its client gave up on must not go on costing compute: cancelling a completion's
    work ends its engine requests, as leaving a stream does.
    """
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if task in done:
        return task.result()
    await asyncio.gather(task, return_exceptions=True)  # its clean-up (aborts) has run
    logger.info("the client left before the answer: its requests were aborted")
    return None


async def _disconnected(request: Request) -> None:
    """Returns once the client disconnects (the body was read: nothing else comes before)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def build_app(
    surface: ControlSurface,
    completions: APIRouter,
    *,
    close: Callable[[], Awaitable[None]],
    title: str,
    start: Callable[[], None] | None = None,
) -> FastAPI:
    """The app of one control surface: its RL routes, the `completions` routes, the server routes.

    Args:
        surface: What the RL routes act on (one engine, or a front's replicas).
        completions: The `/v1` completion routes (the engine's own, or a front's relay).
        close: Run when the app stops, after every running request was aborted.
        title: The OpenAPI title.
        start: Run on the app's event loop when it starts.
    """

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if start is not None:
            start()
        try:
            yield
        finally:
            await surface.abort_all()
            await close()

    app = FastAPI(
        title=title,
        version=weightsync.__version__,
        description="An inference engine that takes live weight updates: OpenAI-compatible "
        "completions, and vLLM's RL routes for pause, resume and weight transfer.",
        lifespan=lifespan,
    )
    app.state.serve = surface
    app.state.stopping = asyncio.Event()  # set by the server at SIGINT/SIGTERM
    install_error_handlers(app)
    app.add_middleware(_BodyLimit, max_bytes=surface.config.max_request_bytes)
    app.include_router(_server_router)
    app.include_router(_models_router)
    app.include_router(completions)
    app.include_router(rl_router)
    return app


_server_router = APIRouter(tags=["server"])


@_server_router.get("/health")
async def health(request: Request) -> Any:
    """200 while the server serves (a data-parallel front: `degraded` once a replica is gone)."""
    status, body = await request.app.state.serve.health()
    return body if status == 200 else JSONResponse(body, status_code=status)


@_server_router.get("/version")
async def version() -> dict[str, Any]:
    """The weightsync version serving."""
    return {"version": weightsync.__version__}


_models_router = APIRouter(prefix="/v1", tags=["openai"], dependencies=[Depends(require_api_key)])


@_models_router.get("/models", operation_id="list_models")
async def _list_models(request: Request) -> dict[str, Any]:
    """The one model this server serves."""
    config: ServerConfig = request.app.state.serve.config
    model = {"id": config.model_name, "object": "model", "owned_by": "weightsync"}
    return {"object": "list", "data": [{**model, "created": 0}]}


class _BodyLimit:
    """Answers 413 to a request whose body passes `max_bytes`, before any route reads it."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit():
            if int(declared) > self.max_bytes:
                await self._refuse(send, int(declared))
                return
            # The HTTP parser delivers no more than the declared length: nothing to count, and
            # the response (a stream, say) goes out without a wrapper around each message.
            await self.app(scope, receive, send)
            return
        received = 0
        too_large = False

        async def counting_receive() -> Message:
            nonlocal received, too_large
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    too_large = True
                    raise _TooLarge(received)
            return message

        async def guarded_send(message: Message) -> None:
            if not too_large:  # the route's own answer to the broken read is replaced by a 413
                await send(message)

        with contextlib.suppress(_TooLarge):
            await self.app(scope, counting_receive, guarded_send)
        if too_large:
            await self._refuse(send, received)

    async def _refuse(self, send: Send, size: int) -> None:
        body = json.dumps(
            error_body(
                413,
                "InvalidRequestError",
                f"the request body has at least {size} bytes, more than the server's limit of "
                f"{self.max_bytes}: send less, or start the server with a larger "
                "--max-request-bytes",
                "body",
            )
        ).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.size = size
