"""`weightsync serve`: an inference engine behind HTTP, with OpenAI's routes and vLLM's RL routes.

[`create_app`][weightsync.serve.app.create_app] builds the FastAPI app around an
[`AsyncEngine`][weightsync.engine.async_engine.AsyncEngine]; the `weightsync serve` command
([`weightsync.serve.cli`][weightsync.serve.cli]) builds the engine and runs the app on uvicorn. A
trainer drives it with [`HTTPEngineClient`][weightsync.trainer.http_client.HTTPEngineClient].
"""

from weightsync.serve.app import create_app
from weightsync.serve.config import ServerConfig

__all__ = ["ServerConfig", "create_app"]
