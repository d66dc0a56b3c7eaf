"""vLLM's LoRA routes: `POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter`.

Mounted when the server runs with `--enable-lora` (vLLM mounts them only with its environment
flag `VLLM_ALLOW_RUNTIME_LORA_UPDATING`); without it they are a 404, as vLLM's are. Bodies and
success answers are vLLM's: `{"lora_name", "lora_path", "load_inplace"}` in, plain text
`Success: LoRA adapter '<name>' added successfully.` out. Refusals are weightsync's JSON errors
with vLLM's statuses and messages: a name already loaded without `load_inplace` is a 400, an
unknown name (or a `lora_path` that is no directory) a 404, and a bad adapter a 400 naming the
file and the tensor, where vLLM answers 500. They change weights the server computes with, so
they need the admin key when the server has one, as the RL routes. A data-parallel front serves
the same routes over its replicas: a load or an unload lands on every replica or on none.

Two RL frameworks load adapters through routes of their own vLLM extensions, and their clients
call those: prime-rl's `POST /load_lora_adapter` (no `/v1`) and SkyRL's
`POST /skyrl/v1/load_lora_adapter`. Both reload one name with each policy version, so both
always load in place (a new version of the name, or a first load); their answers are their
extensions' JSON: prime-rl's `{"status": "ok"}`, SkyRL's `{"status": "ok", "lora_name",
"lora_int_id"}` (behind a data-parallel front, whose replicas each number their adapters, without
`lora_int_id`: SkyRL's client reads only the status). They are the same load as vLLM's route,
with the same refusals.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse

from weightsync.engine.lora import LoRAAdapter
from weightsync.serve._auth import require_admin_key
from weightsync.serve._errors import RequestRefused
from weightsync.serve._fields import RequestBody
from weightsync.serve._rl_routes import EngineClient
from weightsync.serve._view import ServerView

__all__ = ["router"]

router = APIRouter(tags=["lora"], dependencies=[Depends(require_admin_key)])
"""The LoRA routes; each needs the admin key when the server has one."""


class LoadLoRAAdapterRequest(RequestBody):
    """`/v1/load_lora_adapter`: a PEFT adapter directory on the server's machine, by name.

    `load_inplace` loads a new version under a name already loaded; requests running on the
    old version finish on it.
    """

    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(RequestBody):
    """`/v1/unload_lora_adapter`: the adapter's name (vLLM's `lora_int_id` is accepted, unused)."""

    lora_name: str
    lora_int_id: int | None = None


async def _load(
    body: LoadLoRAAdapterRequest, request: Request, *, load_inplace: bool
) -> LoRAAdapter | None:
    """The load behind every load route: the body checked as vLLM checks it, then the engine's.

    Returns the adapter loaded; None behind a data-parallel front (each replica holds its own).
    """
    state: ServerView = request.app.state.serve
    engine: EngineClient = request.app.state.engine_client
    if not body.lora_name or not body.lora_path:
        raise RequestRefused(
            400, "Both 'lora_name' and 'lora_path' must be provided.", param="lora_name"
        )
    if body.lora_name == state.config.model_name:
        raise RequestRefused(
            400,
            f"The lora adapter '{body.lora_name}' conflicts with a served base model.",
            param="lora_name",
        )
    return await engine.load_lora_adapter(body.lora_name, body.lora_path, load_inplace=load_inplace)


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse,
             operation_id="load_lora_adapter")  # fmt: skip
async def _load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> str:
    """Loads a PEFT adapter directory under `lora_name`, checked against the model first."""
    await _load(body, request, load_inplace=body.load_inplace)
    return f"Success: LoRA adapter '{body.lora_name}' added successfully."


@router.post("/load_lora_adapter", operation_id="load_lora_adapter_prime_rl")
async def _load_lora_adapter_prime_rl(
    body: LoadLoRAAdapterRequest, request: Request
) -> dict[str, str]:
    """prime-rl's extension route: vLLM's load, always in place; answers `{"status": "ok"}`.

    prime-rl's orchestrator reloads one adapter name from a new directory at each step; its
    extension forces `load_inplace` (a `load_inplace` in the body is accepted and unused).
    """
    await _load(body, request, load_inplace=True)
    return {"status": "ok"}


@router.post("/skyrl/v1/load_lora_adapter", operation_id="load_lora_adapter_skyrl")
async def _load_lora_adapter_skyrl(
    body: LoadLoRAAdapterRequest, request: Request
) -> dict[str, Any]:
    """SkyRL's extension route: vLLM's load, always in place; answers the adapter's name and id.

    SkyRL's `RemoteInferenceClient.load_lora_adapter` loads and reloads a name through it; its
    extension forces `load_inplace` (a `load_inplace` in the body is accepted and unused).
    `lora_int_id` is the name's id, kept across versions, as vLLM's.
    """
    adapter = await _load(body, request, load_inplace=True)
    answer: dict[str, Any] = {"status": "ok", "lora_name": body.lora_name}
    if adapter is not None:
        answer["lora_int_id"] = adapter.lora_int_id
    return answer


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse,
             operation_id="unload_lora_adapter")  # fmt: skip
async def _unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request) -> str:
    """Unloads an adapter: new requests may not name it; running ones finish on it."""
    engine: EngineClient = request.app.state.engine_client
    if not body.lora_name:
        raise RequestRefused(
            400, "'lora_name' needs to be provided to unload a LoRA adapter.", param="lora_name"
        )
    await engine.unload_lora_adapter(body.lora_name)
    return f"Success: LoRA adapter '{body.lora_name}' removed successfully."
