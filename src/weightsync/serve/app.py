"""`create_app`: an `AsyncEngine` served over HTTP by FastAPI.

The app carries OpenAI-compatible routes under `/v1`, vLLM's RL routes, `/health` and `/version`
(the docs' serving page describes each route, their OpenAPI schema has every body). The routes
and their request models live in private modules: the HTTP shapes are the API, not the Python
classes that parse them. Errors come back as JSON in OpenAI's error shape, naming the weightsync
error type and the field at fault, with the status of their class (400 invalid, 401 key, 409
state conflict, 413 too large, 502 transfer failed, 504 transfer timeout).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import weightsync
from weightsync import AsyncEngine, EngineConfigError
from weightsync._keys import check_api_key
from weightsync.serve._errors import error_body, install_error_handlers

__all__ = ["DEFAULT_MAX_REQUEST_BYTES", "PauseRecord", "ServerConfig", "ServerState", "create_app"]

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BYTES = 64 * 1024 * 1024
"""Largest request body accepted, in bytes: room for IPC handle records of large models."""


@dataclass
class ServerConfig:
    """What the HTTP layer needs besides the engine.

    Attributes:
        model_name: The model id `/v1/models` lists and completions echo.
        api_key: When set, `/v1` routes need `Authorization: Bearer <api_key>` (the admin key
            works there too).
        admin_api_key: When set, the RL routes need `Authorization: Bearer <admin_api_key>`.
        max_request_bytes: Largest request body in bytes; larger ones get a 413.
        world_size: Transfer workers behind this server (`/get_world_size`).

    Raises:
        EngineConfigError: A value is out of range.
    """

    model_name: str = "tiny"
    api_key: str | None = None
    admin_api_key: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    world_size: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.max_request_bytes, int) or self.max_request_bytes < 1:
            raise EngineConfigError(
                f"max_request_bytes must be an int >= 1, got {self.max_request_bytes!r}"
            )
        for name in ("api_key", "admin_api_key"):
            check_api_key(getattr(self, name), name=name)


@dataclass(frozen=True)
class PauseRecord:
    """Where the last `/pause` fell in the engine's steps, as the server saw it.

    Both counts are the engine's step counter (`num_steps`, forward passes run) read on the
    event loop: network transit is not counted. For a `keep` or `abort` pause the difference is
    at most 1, the step in flight when the request arrived; a `wait` pause lands once its
    requests finished, and a pause armed by `/arm_pause` where it was armed to.

    Attributes:
        mode: The pause's mode, as applied (an armed pause's own mode).
        requested_at_step: Steps run when the server began handling the request.
        landed_at_step: Steps run when the pause had landed (the route about to answer).
    """

    mode: str
    requested_at_step: int
    landed_at_step: int


@dataclass
class ServerState:
    """The app's state: the engine, its config, and the requests streaming now.

    Attributes:
        engine: The engine served.
        config: The HTTP layer's settings.
        live: Each running completion's id -> the engine request ids of its choices.
        armed_pause_started: Set when the pause armed by `/arm_pause` starts.
        last_pause: Where the last `/pause` fell in the engine's steps (`/engine_stats`).
    """

    engine: AsyncEngine
    config: ServerConfig
    live: dict[str, list[str]] = field(default_factory=dict)
    armed_pause_started: asyncio.Event | None = None
    last_pause: PauseRecord | None = None

    async def abort_all(self) -> int:
        """Aborts every running request (their streams end with `finish_reason="abort"`)."""
        ids = [rid for rids in self.live.values() for rid in rids]
        for request_id in ids:
            await self.engine.abort(request_id)
        return len(self.live)


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


def create_app(
    engine: AsyncEngine, config: ServerConfig | None = None, *, own_engine: bool = True
) -> FastAPI:
    """Builds the FastAPI app that serves `engine`.

    Args:
        engine: The engine to serve; the app's event loop drives it.
        config: Keys, limits and the model's name.
        own_engine: Shut the engine down (its transfer engine and threads) when the app stops.

    Returns:
        The app, ready for uvicorn (or `fastapi.testclient.TestClient`).

    >>> from weightsync import AsyncEngine
    >>> app = create_app(AsyncEngine("debug"), ServerConfig(model_name="debug"))
    >>> sorted(path for path in app.openapi()["paths"] if path.startswith("/v1"))
    ['/v1/chat/completions', '/v1/completions', '/v1/models']
    """
    from weightsync.serve._openai_routes import router as openai_router
    from weightsync.serve._rl_routes import router as rl_router

    config = config or ServerConfig()
    state = ServerState(engine, config)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await state.abort_all()
            if own_engine:
                await engine.shutdown()
            logger.info("engine shut down")

    app = FastAPI(
        title="weightsync serve",
        version=weightsync.__version__,
        description="An inference engine that takes live weight updates: OpenAI-compatible "
        "completions, and vLLM's RL routes for pause, resume and weight transfer.",
        lifespan=lifespan,
    )
    app.state.serve = state
    install_error_handlers(app)
    app.add_middleware(_BodyLimit, max_bytes=config.max_request_bytes)

    @app.get("/health", tags=["server"])
    async def health() -> dict[str, Any]:
        """Answers 200 while the server serves."""
        return {"status": "ok"}

    @app.get("/version", tags=["server"])
    async def version() -> dict[str, Any]:
        """The weightsync version serving."""
        return {"version": weightsync.__version__}

    app.include_router(openai_router)
    app.include_router(rl_router)
    return app
