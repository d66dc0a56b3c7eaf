"""What every weightsync HTTP app shares: its assembly, the server routes, the size limit.

The assembly is around an engine client and the server's view of itself; the server routes are
`/health`, `/version`, `/v1/models`, `/metrics` and `/server_info`.

[`create_app`][weightsync.serve.app.create_app] (one engine) and a data-parallel front build
their apps here, so both answer the same RL routes with the same errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Literal, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import weightsync
from weightsync.serve._auth import require_admin_key, require_api_key
from weightsync.serve._errors import error_body, install_error_handlers
from weightsync.serve._fields import RequestFields
from weightsync.serve._info import model_card, server_info
from weightsync.serve._metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from weightsync.serve._rl_routes import EngineClient
from weightsync.serve._rl_routes import router as rl_router
from weightsync.serve._view import ServerView

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
    engine: EngineClient,
    view: ServerView,
    routers: Sequence[APIRouter],
    *,
    close: Callable[[], Awaitable[None]],
    title: str,
    start: Callable[[], None] | None = None,
) -> FastAPI:
    """The app of one engine client: its RL routes, the generation routes, the server routes.

    Args:
        engine: What the RL routes call (an `AsyncEngine`, or a front's replicas behind the
            same calls; see `EngineClient`).
        view: What the server answers of itself (see `ServerView`).
        routers: The generation routes, `/v1` completions and the token routes (the engine's
            own, or a front's relay).
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
            await view.abort_all()
            await close()

    app = FastAPI(
        title=title,
        version=weightsync.__version__,
        description="An inference engine that takes live weight updates: OpenAI-compatible "
        "completions, and vLLM's RL routes for pause, resume and weight transfer.",
        lifespan=lifespan,
    )
    app.state.engine_client = engine
    app.state.serve = view
    app.state.stopping = asyncio.Event()  # set by the server at SIGINT/SIGTERM
    install_error_handlers(app)
    app.add_middleware(RequestFields, strict=view.config.strict_request_fields)
    app.add_middleware(_BodyLimit, max_bytes=view.config.max_request_bytes)
    app.include_router(_server_router)
    app.include_router(_models_router)
    app.include_router(_info_router)
    for router in routers:
        app.include_router(router)
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
# What vLLM keeps behind its development mode: the admin key here, as the RL routes.
_info_router = APIRouter(tags=["server"], dependencies=[Depends(require_admin_key)])


@_models_router.get("/models", operation_id="list_models")
async def _list_models(request: Request) -> dict[str, Any]:
    """The model served, as vLLM's model card, then each LoRA adapter loaded.

    Each adapter's card is vLLM's: `root` its path, `parent` the served model's name.
    """
    surface: ServerView = request.app.state.serve
    max_model_len = (await surface.vllm_config())["model_config"]["max_model_len"]
    adapters = await surface.lora_cards()
    return {"object": "list", "data": [model_card(surface.config, max_model_len), *adapters]}


@_server_router.get("/metrics", response_class=Response, operation_id="metrics")
async def _metrics_page(request: Request) -> Response:
    """Prometheus's text format: vLLM's request metrics and weightsync's pause and update ones.

    No key needed, as vLLM's: it says how much was served, nothing of what.
    """
    surface: ServerView = request.app.state.serve
    return Response(await surface.metrics(), media_type=METRICS_CONTENT_TYPE)


@_info_router.get("/server_info", operation_id="server_info")
async def _server_info(
    request: Request, config_format: Literal["text", "json"] = "text"
) -> dict[str, Any]:
    """The server's config in vLLM's shape; `config_format=json` makes `vllm_config` a tree.

    TRL reads `vllm_config.model_config.dtype`, `weight_transfer_config` and
    `parallel_config.data_parallel_size` before it syncs.
    """
    surface: ServerView = request.app.state.serve
    return server_info(await surface.vllm_config(), config_format)


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
