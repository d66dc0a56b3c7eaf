"""vLLM's RL routes: pause and resume, the weight-update transaction, versions and checksums.

Paths, query parameters and success bodies are vLLM's, so a trainer written against vLLM's HTTP
server drives this one unchanged. Unlike vLLM's, every route takes the admin key when the server
has one, and every failure is JSON naming the field and the weightsync error type with the status
of its class (never a 500 for a known failure). Transfer calls (`/init_weight_transfer_engine`,
`/update_weights`) block on a worker thread, never on the event loop, so streams keep flowing
while a transfer waits for its trainer. IPC handles arrive as JSON records: nothing is unpickled.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, Depends, Request
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from weightsync import (
    AsyncEngine,
    EngineStateError,
    InvalidRequestError,
    WeightUpdateStateError,
    weight_checksums,
)
from weightsync.engine._armed_pause import ArmedPause
from weightsync.serve._auth import require_admin_key
from weightsync.serve._errors import _RequestRefused
from weightsync.serve.app import PauseRecord, ServerState

__all__ = [
    "AbortRequestsRequest",
    "FinishWeightUpdateRequest",
    "InitWeightTransferRequest",
    "StartWeightUpdateRequest",
    "UpdateWeightVersionRequest",
    "UpdateWeightsRequest",
    "WeightCheckerRequest",
    "router",
]

router = APIRouter(tags=["rl"], dependencies=[Depends(require_admin_key)])
"""The RL routes; each needs the admin key when the server has one."""

_PAUSE_MODES = ("abort", "wait", "keep")
# A label travels with every generated token: bounded, so one call cannot bloat every stream.
_MAX_VERSION_CHARS = 256
_Version = Annotated[StrictStr, Field(max_length=_MAX_VERSION_CHARS)] | StrictInt


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class AbortRequestsRequest(_Body):
    """`/abort_requests`: the completion ids to abort; empty or absent aborts every one."""

    request_ids: list[str] | None = None


class InitWeightTransferRequest(_Body):
    """`/init_weight_transfer_engine`: the init info the trainer's `trainer_init` made."""

    init_info: dict[str, Any]


class StartWeightUpdateRequest(_Body):
    """`/start_weight_update`: an optional body (older vLLM sent `is_checkpoint_format`)."""

    is_checkpoint_format: bool = True


class UpdateWeightsRequest(_Body):
    """`/update_weights`: one update message (names, dtype names, shapes; IPC handle records)."""

    update_info: dict[str, Any]


class FinishWeightUpdateRequest(_Body):
    """`/finish_weight_update`: the version the weights take (None counts updates)."""

    weight_version: _Version | None = None


class UpdateWeightVersionRequest(_Body):
    """`/update_weight_version`: relabels the current weights."""

    new_version: _Version


class WeightCheckerRequest(_Body):
    """`/weight_checker`: `checksum`, `compare` against a `baseline` of digests, or `reset`."""

    action: Literal["checksum", "compare", "reset"]
    baseline: dict[str, str] | None = Field(None, description="name -> SHA-256 hex (compare).")


def _state(request: Request) -> ServerState:
    state: ServerState = request.app.state.serve
    return state


def _engine(request: Request) -> AsyncEngine:
    return _state(request).engine


@router.post("/pause", operation_id="pause")
async def _pause(
    request: Request,
    mode: str = "abort",
    clear_cache: bool = True,
    wait_for_inflight_requests: bool | None = None,
) -> dict[str, Any]:
    """Pauses generation at a step boundary: `abort`, `wait` (drain first) or `keep` (freeze).

    `wait_for_inflight_requests=true` is the deprecated spelling of `mode=wait`. The engine's
    step counts when the request was handled and when the pause landed are kept for
    `/engine_stats` (`last_pause`); the body stays vLLM's.
    """
    if mode not in _PAUSE_MODES:
        raise _RequestRefused(
            400,
            f"query parameter 'mode' must be one of {list(_PAUSE_MODES)}, got {mode!r}",
            param="mode",
        )
    if wait_for_inflight_requests:
        if mode not in ("abort", "wait"):  # abort is the default, so it may mean "not given"
            raise _RequestRefused(
                400,
                f"query parameters 'mode={mode}' and 'wait_for_inflight_requests=true' conflict: "
                "give mode=wait alone (wait_for_inflight_requests is deprecated)",
                param="wait_for_inflight_requests",
            )
        mode = "wait"
    state = _state(request)
    llm = state.engine.engine
    # Read on the event loop before anything waits: a step in flight now is counted once it ends.
    requested_at_step = llm.num_steps
    armed, started = llm.scheduler.armed_pause, state.armed_pause_started
    # It can land only while requests run; on an idle or paused engine, pause now instead.
    if armed is not None and started is not None and llm.has_unfinished_requests():
        if not llm.is_paused():
            await started.wait()  # a pause armed by /arm_pause lands where it was armed to
        mode, clear_cache = armed.mode, armed.clear_cache
    llm.scheduler.armed_pause = None
    # Pausing again is harmless; it also waits for a `wait` pause to finish draining.
    await state.engine.pause_generation(mode=mode, clear_cache=clear_cache)  # type: ignore[arg-type]
    # Paused now, so no step runs between the return above and this read.
    state.last_pause = PauseRecord(mode, requested_at_step, llm.num_steps)
    return {"status": "paused"}


@router.post("/arm_pause", operation_id="arm_pause")
async def _arm_pause(
    request: Request, after_tokens: int, mode: str = "keep", clear_cache: bool = True
) -> dict[str, Any]:
    """Arms a pause for when every unfinished request has `after_tokens` output tokens.

    A weightsync extension: the pause lands exactly at that step boundary, however late the
    trainer is; `/pause` then waits for it. Queue the requests while paused, arm, then resume.
    """
    if mode not in _PAUSE_MODES:
        raise _RequestRefused(
            400,
            f"query parameter 'mode' must be one of {list(_PAUSE_MODES)}, got {mode!r}",
            param="mode",
        )
    state = _state(request)
    loop = asyncio.get_running_loop()
    started = asyncio.Event()

    def on_pause() -> None:  # called on the stepping thread
        loop.call_soon_threadsafe(started.set)

    try:
        armed = ArmedPause(after_tokens, mode, clear_cache, on_pause)  # type: ignore[arg-type]
    except InvalidRequestError as exc:  # the mode was checked above: it is `after_tokens`
        raise _RequestRefused(400, str(exc), param="after_tokens") from None
    # Only a pause that was armed replaces the event `/pause` waits on: a refused one leaves
    # the pause armed before it, and its event, as they were.
    state.armed_pause_started = started
    # The stepping thread reads it at its next step: one assignment, nothing half-set.
    state.engine.engine.scheduler.armed_pause = armed
    return {"status": "armed"}


@router.post("/resume", operation_id="resume")
async def _resume(request: Request) -> dict[str, Any]:
    """Resumes generation; kept requests continue."""
    await _engine(request).resume_generation()
    return {"status": "resumed"}


@router.get("/is_paused", operation_id="is_paused")
async def _is_paused(request: Request) -> dict[str, Any]:
    """Whether generation is paused."""
    return {"is_paused": await _engine(request).is_paused()}


@router.post("/abort_requests", operation_id="abort_requests")
async def _abort_requests(
    request: Request, body: Annotated[AbortRequestsRequest | None, Body()] = None
) -> dict[str, Any]:
    """Aborts running completions by id (every one when none is given)."""
    state = _state(request)
    if body is None or not body.request_ids:
        return {"status": "aborted", "aborted": await state.abort_all()}
    found = [rid for rid in body.request_ids if rid in state.live]
    for completion_id in found:
        for request_id in state.live.get(completion_id, []):
            await state.engine.abort(request_id)
    return {"status": "aborted", "aborted": len(found)}


@router.post("/unfinished_requests", operation_id="unfinished_requests")
async def _unfinished_requests(request: Request, body: AbortRequestsRequest) -> dict[str, Any]:
    """The given completion ids that are still unfinished in the engine (a weightsync extension).

    A completion that finished may still be on its way to its client; one listed here is
    queued, running or frozen by a pause.
    """
    state = _state(request)
    llm = state.engine.engine
    running = {seq.request_id for seq in [*llm.scheduler.running, *llm.scheduler.waiting]}
    unfinished = [
        completion_id
        for completion_id in body.request_ids or []
        if any(rid in running for rid in state.live.get(completion_id, []))
    ]
    return {"unfinished": unfinished}


@router.post("/init_weight_transfer_engine", operation_id="init_weight_transfer_engine")
async def _init_weight_transfer_engine(
    request: Request, body: InitWeightTransferRequest
) -> dict[str, Any]:
    """Joins the trainer's transfer; blocks (off the event loop) until it forms or times out."""
    await _engine(request).init_weight_transfer_engine({"init_info": body.init_info})
    return {"message": "Weight transfer initialized"}


@router.post("/start_weight_update", operation_id="start_weight_update")
async def _start_weight_update(
    request: Request, body: Annotated[StartWeightUpdateRequest | None, Body()] = None
) -> dict[str, Any]:
    """Opens a weight-update transaction; no forward pass runs until it ends."""
    if body is not None and not body.is_checkpoint_format:
        raise _RequestRefused(
            400,
            "field 'is_checkpoint_format': only checkpoint-format (Hugging Face) names are "
            "supported; send true or leave it out",
            param="is_checkpoint_format",
        )
    await _engine(request).start_weight_update()
    return {"message": "Weight update started"}


@router.post("/update_weights", operation_id="update_weights")
async def _update_weights(request: Request, body: UpdateWeightsRequest) -> dict[str, Any]:
    """Receives one update message (off the event loop); may come several times per update.

    The body adds `stats` (what was received and how fast) to vLLM's.
    """
    stats = await _engine(request).update_weights({"update_info": body.update_info})
    return {
        "message": "Weights updated",
        "stats": dataclasses.asdict(dataclasses.replace(stats, loaded_names=None)),
    }


@router.post("/finish_weight_update", operation_id="finish_weight_update")
async def _finish_weight_update(
    request: Request, body: Annotated[FinishWeightUpdateRequest | None, Body()] = None
) -> dict[str, Any]:
    """Ends the transaction: the version moves if every announced weight landed."""
    await _engine(request).finish_weight_update(body.weight_version if body else None)
    return {"message": "Weight update finished"}


@router.post("/abort_weight_update", operation_id="abort_weight_update")
async def _abort_weight_update(request: Request) -> dict[str, Any]:
    """Ends the transaction on purpose (a weightsync extension); `aborted`: one was open."""
    aborted = await _engine(request).abort_weight_update()
    return {"message": "Weight update aborted", "aborted": aborted}


@router.post("/shutdown_weight_transfer_engine", operation_id="shutdown_weight_transfer_engine")
async def _shutdown_weight_transfer_engine(request: Request) -> dict[str, Any]:
    """Leaves the trainer's transfer and frees what it held (vLLM's client calls it on close)."""
    await _engine(request).shutdown_weight_transfer_engine()
    return {"message": "Weight transfer engine shut down"}


@router.post("/update_weight_version", operation_id="update_weight_version")
async def _update_weight_version(
    request: Request, body: UpdateWeightVersionRequest
) -> dict[str, Any]:
    """Relabels the current weights; no byte changes."""
    weights = _engine(request).engine.weights
    if weights.transaction is not None:
        raise WeightUpdateStateError(
            "update_weight_version: a weight update is in progress; its "
            "finish_weight_update(weight_version) sets the version"
        )
    weights.weight_version = body.new_version
    return {"success": True, "new_version": body.new_version}


@router.get("/weight_info", operation_id="weight_info")
async def _weight_info(request: Request) -> dict[str, Any]:
    """The current weight version."""
    return {"weight_version": _engine(request).weight_version}


@router.post("/weight_checker", operation_id="weight_checker")
async def _weight_checker(request: Request, body: WeightCheckerRequest) -> dict[str, Any]:
    """SHA-256 of every weight (`checksum`), or a comparison with a `baseline` of them.

    Refused (409) while a weight update is in progress or weights are torn: the digests would
    describe weights that are about to change or are half-written.
    """
    if body.action == "reset":
        return {"status": "reset"}  # the checker keeps no state between calls
    if body.action == "compare" and body.baseline is None:
        raise _RequestRefused(
            400, "field 'baseline' is required with action 'compare'", param="baseline"
        )
    engine = _engine(request).engine
    if engine.weights.holds_generation:
        raise EngineStateError(
            "weight_checker: a weight update is in progress or weights are torn; check after "
            "finish_weight_update"
        )
    checksums = await asyncio.to_thread(weight_checksums, engine.model.named_weights())
    if body.action == "checksum":
        return {"checksums": checksums}
    baseline = body.baseline or {}
    mismatches = sorted(
        name for name in checksums.keys() | baseline.keys()
        if checksums.get(name) != baseline.get(name)
    )  # fmt: skip
    return {"match": not mismatches, "mismatches": mismatches}


@router.get("/engine_stats", operation_id="engine_stats")
async def _engine_stats(request: Request) -> dict[str, Any]:
    """Counters of the engine (a weightsync extension): forward passes run, requests in flight.

    `last_pause` says where the last `/pause` fell in the engine's steps: `requested_at_step`
    (steps run when the server handled it), `landed_at_step` (steps run once it had landed) and
    its `mode`; null before the first pause. Network transit is not in these counts.
    """
    state = _state(request)
    llm = state.engine.engine
    last = state.last_pause
    return {
        "num_steps": llm.num_steps,
        "num_unfinished": llm.scheduler.num_unfinished,
        "is_paused": llm.is_paused(),
        "weight_version": llm.weight_version,
        "last_pause": dataclasses.asdict(last) if last is not None else None,
    }


@router.get("/get_world_size", operation_id="get_world_size")
async def _get_world_size(request: Request, include_dp: bool = True) -> dict[str, Any]:
    """Transfer workers behind this server (the trainer not counted)."""
    del include_dp  # one replica: with or without data parallelism, the same count
    return {"world_size": _state(request).config.world_size}
