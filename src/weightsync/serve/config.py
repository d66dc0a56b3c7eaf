"""[`ServerConfig`][weightsync.serve.config.ServerConfig]: what the HTTP layer needs besides the engine."""

from __future__ import annotations

from dataclasses import dataclass

from weightsync._keys import check_api_key
from weightsync.errors import EngineConfigError

__all__ = ["ServerConfig"]

_DEFAULT_MAX_REQUEST_BYTES = 64 * 1024 * 1024  # room for the IPC handle records of large models


@dataclass
class ServerConfig:
    """What the HTTP layer needs besides the engine.

    Attributes:
        model_name: The model id `/v1/models` lists and completions echo.
        api_key: When set, `/v1` routes need `Authorization: Bearer <api_key>` (the admin key
            works there too).
        admin_api_key: When set, the RL routes need `Authorization: Bearer <admin_api_key>`.
        max_request_bytes: Largest request body in bytes (64 MiB by default: room for the IPC
            handle records of large models); larger ones get a 413.
        world_size: Transfer workers behind this server (`/get_world_size`).
        strict_request_fields: Refuse request fields the server does not know (a 400 naming
            them). By default they are ignored as vLLM ignores them: logged once per request
            and named in the answer's `X-Ignored-Fields` header.
        model_path: The model's directory or preset as given on the command line (`root` of
            `/v1/models`, `model` of `/server_info`); None: the model's name.

    Raises:
        EngineConfigError: A value is out of range.
    """

    model_name: str = "tiny"
    api_key: str | None = None
    admin_api_key: str | None = None
    max_request_bytes: int = _DEFAULT_MAX_REQUEST_BYTES
    world_size: int = 1
    strict_request_fields: bool = False
    model_path: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_request_bytes, int) or self.max_request_bytes < 1:
            raise EngineConfigError(
                f"max_request_bytes must be an int >= 1, got {self.max_request_bytes!r}"
            )
        if not isinstance(self.strict_request_fields, bool):
            raise EngineConfigError(
                f"strict_request_fields must be True or False, got {self.strict_request_fields!r}"
            )
        for name in ("api_key", "admin_api_key"):
            check_api_key(getattr(self, name), name=name)
