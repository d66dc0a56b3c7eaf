"""`create_app`: an `AsyncEngine` served over HTTP by FastAPI.

The app carries OpenAI-compatible routes under `/v1`, vLLM's RL routes, its token routes
(`/tokenize`, `/detokenize`, `/inference/v1/generate`), `/server_info`, `/metrics`, `/health` and
`/version` (the docs' serving page describes each route, their OpenAPI schema has every body). The routes
and their request models live in private modules: the HTTP shapes are the API, not the Python
classes that parse them. Errors come back as JSON in OpenAI's error shape, naming the weightsync
error type and the field at fault, with the status of their class (400 invalid, 401 key, 409
state conflict, 413 too large, 502 transfer failed, 503 a replica is gone, 504 transfer timeout).
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import FastAPI

from weightsync.engine.async_engine import AsyncEngine
from weightsync.serve._http import build_app
from weightsync.serve._server import ENGINE_SHUTDOWN_TIMEOUT_S
from weightsync.serve._view import EngineView
from weightsync.serve.config import ServerConfig

__all__ = ["create_app"]

logger = logging.getLogger(__name__)


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
    from weightsync.serve._lora_routes import router as lora
    from weightsync.serve._openai_routes import router as completions
    from weightsync.serve._token_routes import router as tokens

    async def close() -> None:
        if not own_engine:
            return
        try:
            await asyncio.wait_for(engine.shutdown(), ENGINE_SHUTDOWN_TIMEOUT_S)
        except TimeoutError:
            logger.warning("the engine's shutdown waits for a transfer call still waiting in "
                           "torch; the server stops without it")  # fmt: skip
            return
        logger.info("engine shut down")

    view = EngineView(engine, config or ServerConfig())
    # vLLM mounts its LoRA routes only with an environment flag; here, with LoRA enabled.
    routers = [completions, tokens, *([lora] if engine.engine.config.enable_lora else [])]
    return build_app(engine, view, routers, close=close, title="weightsync serve")
