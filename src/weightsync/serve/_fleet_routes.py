"""vLLM's RL routes on a data-parallel front: each call acts on every replica, or on none.

- `/pause` is two-phase: it goes to every replica at once and answers only once all of them
  stopped at their own step boundary. A replica that does not answer within `timeout_s` makes the
  call fail naming it, while the others stay paused: the fleet never serves mixed weights.
- `/finish_weight_update` first asks every replica whether its finish would succeed (the update
  landed whole, nothing torn), and moves the version only when all say yes: all or none. A bare
  `/update_weights` becomes such a transaction on every replica.
- A replica that exited makes every route here fail at once (503) naming it.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Request

from weightsync.errors import (
    IncompleteWeightUpdateError,
    NonFiniteWeightsError,
    ReplicaUnavailableError,
    TornWeightsError,
    WeightSyncError,
    WeightValidationError,
)
from weightsync.serve._auth import require_admin_key
from weightsync.serve._errors import _RequestRefused
from weightsync.serve._fleet import Fleet, raise_failures
from weightsync.serve._fleet_app import FleetState
from weightsync.serve._rl_routes import (
    AbortRequestsRequest,
    FinishWeightUpdateRequest,
    InitWeightTransferRequest,
    StartWeightUpdateRequest,
    UpdateWeightsRequest,
    UpdateWeightVersionRequest,
    WeightCheckerRequest,
)

router = APIRouter(tags=["rl"], dependencies=[Depends(require_admin_key)])

_PAUSE_MODES = ("abort", "wait", "keep")


def _state(request: Request) -> FleetState:
    state: FleetState = request.app.state.serve
    return state


def _fleet(request: Request) -> Fleet:
    return _state(request).fleet


def _check_mode(mode: str) -> None:
    if mode not in _PAUSE_MODES:
        raise _RequestRefused(
            400,
            f"query parameter 'mode' must be one of {list(_PAUSE_MODES)}, got {mode!r}",
            param="mode",
        )


@router.post("/pause", operation_id="pause")
async def _pause(
    request: Request,
    mode: str = "abort",
    clear_cache: bool = True,
    wait_for_inflight_requests: bool | None = None,
    timeout_s: float | None = None,
) -> dict[str, Any]:
    """Pauses every replica at its own step boundary; answers once all of them are paused.

    `timeout_s` (a weightsync extension) bounds each replica's answer; a replica that misses it
    makes the call fail naming it, and the others stay paused.
    """
    _check_mode(mode)
    if timeout_s is not None and not 0 < timeout_s < math.inf:  # NaN fails both
        raise _RequestRefused(
            400,
            f"query parameter 'timeout_s' must be a number of seconds > 0, got {timeout_s!r}",
            param="timeout_s",
        )
    params: dict[str, Any] = {"mode": mode, "clear_cache": str(clear_cache).lower()}
    if wait_for_inflight_requests is not None:
        params["wait_for_inflight_requests"] = str(wait_for_inflight_requests).lower()
    fleet = _fleet(request)
    await fleet.all("POST", "/pause", params=params, timeout_s=timeout_s or fleet.timeout_s)
    return {"status": "paused"}


@router.post("/arm_pause", operation_id="arm_pause")
async def _arm_pause(
    request: Request, after_tokens: int, mode: str = "keep", clear_cache: bool = True
) -> dict[str, Any]:
    """Arms the same pause on every replica (see a replica's `/arm_pause`)."""
    _check_mode(mode)
    params = {"after_tokens": after_tokens, "mode": mode, "clear_cache": str(clear_cache).lower()}
    await _fleet(request).all("POST", "/arm_pause", params=params)
    return {"status": "armed"}


@router.post("/resume", operation_id="resume")
async def _resume(request: Request) -> dict[str, Any]:
    """Resumes every replica."""
    await _fleet(request).all("POST", "/resume")
    return {"status": "resumed"}


@router.get("/is_paused", operation_id="is_paused")
async def _is_paused(request: Request) -> dict[str, Any]:
    """Whether every replica is paused; `replicas` gives each one's answer."""
    answers = await _fleet(request).all("GET", "/is_paused")
    each = [bool(a["is_paused"]) for a in answers]
    return {"is_paused": all(each), "replicas": each}


@router.post("/abort_requests", operation_id="abort_requests")
async def _abort_requests(
    request: Request, body: Annotated[AbortRequestsRequest | None, Body()] = None
) -> dict[str, Any]:
    """Aborts running completions by id on the replica running each (every one when none)."""
    state = _state(request)
    ids = body.request_ids if body is not None else None
    if not ids:
        answers = raise_failures(await state.fleet.each("POST", "/abort_requests", body={}))
        return {"status": "aborted", "aborted": sum(int(a["aborted"]) for a in answers)}
    aborted = 0
    for index, owned in _by_replica(state, ids).items():
        answer = await state.fleet.replicas[index].call(
            "POST", "/abort_requests", body={"request_ids": owned}
        )
        aborted += int(answer["aborted"])
    return {"status": "aborted", "aborted": aborted}


def _by_replica(state: FleetState, ids: list[str]) -> dict[int, list[str]]:
    """The running completions of `ids`, grouped by the replica that runs each."""
    owners: dict[int, list[str]] = {}
    for completion_id in ids:
        if completion_id in state.live:
            owners.setdefault(state.live[completion_id], []).append(completion_id)
    return owners


@router.post("/unfinished_requests", operation_id="unfinished_requests")
async def _unfinished_requests(request: Request, body: AbortRequestsRequest) -> dict[str, Any]:
    """The given completion ids still unfinished on their replica (a weightsync extension)."""
    state = _state(request)
    unfinished: list[str] = []
    for index, owned in _by_replica(state, body.request_ids or []).items():
        answer = await state.fleet.replicas[index].call(
            "POST", "/unfinished_requests", body={"request_ids": owned}
        )
        unfinished += answer["unfinished"]
    return {"unfinished": unfinished}


@router.post("/init_weight_transfer_engine", operation_id="init_weight_transfer_engine")
async def _init_weight_transfer_engine(
    request: Request, body: InitWeightTransferRequest
) -> dict[str, Any]:
    """Joins every replica to the trainer's transfer, each as its own rank."""
    await _fleet(request).all("POST", "/init_weight_transfer_engine", body=body.model_dump())
    return {"message": "Weight transfer initialized"}


@router.post("/start_weight_update", operation_id="start_weight_update")
async def _start_weight_update(
    request: Request, body: Annotated[StartWeightUpdateRequest | None, Body()] = None
) -> dict[str, Any]:
    """Opens the transaction on every replica; if one refuses, none keeps it open."""
    state = _state(request)
    async with state.lock:
        payload = body.model_dump() if body is not None else None
        await _start_all(state, payload)
        state.transaction = "explicit"
    return {"message": "Weight update started"}


async def _start_all(state: FleetState, payload: dict[str, Any] | None) -> None:
    state.fleet.require_alive()
    outcomes = await state.fleet.each("POST", "/start_weight_update", body=payload)
    if any(isinstance(o, BaseException) for o in outcomes):
        opened = [
            r for r, o in zip(state.fleet.replicas, outcomes, strict=True) if isinstance(o, dict)
        ]
        for replica in opened:  # nothing moved yet: ending it leaves them as they were
            await replica.call("POST", "/abort_weight_update")
    raise_failures(outcomes)


@router.post("/update_weights", operation_id="update_weights")
async def _update_weights(request: Request, body: UpdateWeightsRequest) -> dict[str, Any]:
    """Delivers one update message to every replica at once (a broadcast needs them all in).

    A bare message (no `/start_weight_update` before it) becomes a transaction on every replica,
    finished on all of them, or none, once its last part landed. A message every replica
    refused moved nothing: the transaction goes on, as on one engine. `stats` are replica 0's.
    """
    state = _state(request)
    info = body.update_info
    async with state.lock:
        state.fleet.require_alive()
        if state.transaction == "implicit" and _announces_another_update(state, info):
            # As on one engine: the sender gave up on the bare update in progress and announces
            # a new one, so the abandoned one ends (restored or torn) and the new one begins;
            # but only once every replica found the announcement sound (a refusal moves nothing).
            await state.fleet.all("POST", "/check_weight_update", body=body.model_dump())
            await _abort_all(state)
        opened = state.transaction is None
        if opened:
            await _start_bare(state, info)
            state.transaction, state.update_id = "implicit", info.get("update_id")
        if _is_announcement(info):  # of an explicit update too: a late one is not a new one
            state.seen_update_ids.append(info["update_id"])
        outcomes = await state.fleet.each("POST", "/update_weights", body=body.model_dump())
        try:
            answers = raise_failures(outcomes)
            if state.transaction == "implicit" and await _all_ready(
                state, None, parts_to_come=True
            ):
                await _commit(state, None)
        except BaseException:
            refused = all(isinstance(o, WeightValidationError) for o in outcomes)
            if state.transaction == "implicit" and (opened or not refused):
                await _abort_all(state)
            raise
    return {"message": "Weights updated", "stats": answers[0]["stats"]}


async def _start_bare(state: FleetState, info: dict[str, Any]) -> None:
    """Opens a bare update's transaction on every replica; if one refuses, the trainer learns why.

    A broadcast's trainer waits in the update's handshake for every replica, as one engine's
    would: each replica joins it only to reject the update, so the trainer fails at once with
    the reason and its group stays usable (a dead replica cannot join: the trainer times out).
    """
    try:
        await _start_all(state, None)
    except ReplicaUnavailableError:
        raise
    except WeightSyncError as exc:
        body = {"update_info": info, "reason": str(exc)[:4000]}
        await state.fleet.each("POST", "/refuse_weight_update", body=body)
        raise


def _announces_another_update(state: FleetState, info: dict[str, Any]) -> bool:
    """Whether `info` is an IPC announcement of a new update, not the bare one in progress.

    An id seen before is a late or repeated announcement: the replicas refuse it themselves,
    and the update in progress goes on.
    """
    return (
        _is_announcement(info)
        and info["update_id"] != state.update_id
        and info["update_id"] not in state.seen_update_ids
    )


def _is_announcement(info: dict[str, Any]) -> bool:
    """Whether `info` is an IPC announcement (handles null) with a well-formed `update_id`."""
    return isinstance(info.get("update_id"), str) and info.get("ipc_handles") is None


async def _abort_all(state: FleetState) -> None:
    """Ends the transaction on every replica (each one restores or marks what it touched)."""
    state.transaction = state.update_id = None
    await state.fleet.each("POST", "/abort_weight_update")


async def _all_ready(state: FleetState, version: Any, *, parts_to_come: bool = False) -> bool:
    """Whether every replica's finish would succeed; False while parts are still to come.

    Raises:
        WeightSyncError: A replica's finish would fail (for another reason than missing parts,
            when `parts_to_come`).
    """
    body = {"weight_version": version}
    try:
        await state.fleet.all("POST", "/prepare_weight_update", body=body)
    except IncompleteWeightUpdateError:
        if parts_to_come:
            return False
        raise
    return True


async def _commit(state: FleetState, version: Any) -> None:
    state.transaction = state.update_id = None
    await state.fleet.all("POST", "/finish_weight_update", body={"weight_version": version})


@router.post("/finish_weight_update", operation_id="finish_weight_update")
async def _finish_weight_update(
    request: Request, body: Annotated[FinishWeightUpdateRequest | None, Body()] = None
) -> dict[str, Any]:
    """Moves the version on every replica, or on none: each one is checked before any commits."""
    state = _state(request)
    version = body.weight_version if body is not None else None
    async with state.lock:
        try:
            await _all_ready(state, version)
        except (NonFiniteWeightsError, TornWeightsError):
            # One engine ends its transaction on these; so does the fleet, on every replica.
            await _abort_all(state)
            raise
        await _commit(state, version)
    return {"message": "Weight update finished"}


@router.post("/abort_weight_update", operation_id="abort_weight_update")
async def _abort_weight_update(request: Request) -> dict[str, Any]:
    """Ends the transaction on every replica; `aborted`: one was open somewhere."""
    state = _state(request)
    async with state.lock:
        answers = await state.fleet.all("POST", "/abort_weight_update")
        state.transaction = state.update_id = None
    return {"message": "Weight update aborted", "aborted": any(a["aborted"] for a in answers)}


@router.post("/update_weight_version", operation_id="update_weight_version")
async def _update_weight_version(
    request: Request, body: UpdateWeightVersionRequest
) -> dict[str, Any]:
    """Relabels the weights of every replica."""
    state = _state(request)
    async with state.lock:
        await state.fleet.all("POST", "/update_weight_version", body=body.model_dump())
    return {"success": True, "new_version": body.new_version}


@router.get("/weight_info", operation_id="weight_info")
async def _weight_info(request: Request) -> dict[str, Any]:
    """The weight version (replica 0's); `replicas` gives each one's."""
    answers = await _fleet(request).all("GET", "/weight_info")
    versions = [a["weight_version"] for a in answers]
    return {"weight_version": versions[0], "replicas": versions}


@router.post("/weight_checker", operation_id="weight_checker")
async def _weight_checker(request: Request, body: WeightCheckerRequest) -> dict[str, Any]:
    """Checksums (replica 0's) or a comparison with `baseline`, with per-replica mismatches.

    `replicas[i].mismatches` lists the names whose digest on replica i differs from the
    `baseline` (compare) or from replica 0's (checksum).
    """
    if body.action == "reset":
        return {"status": "reset"}
    answers = await _fleet(request).all(
        "POST", "/weight_checker", body={"action": "checksum", "baseline": None}
    )
    sums = [a["checksums"] for a in answers]
    if body.action == "compare" and body.baseline is None:
        raise _RequestRefused(
            400, "field 'baseline' is required with action 'compare'", param="baseline"
        )
    reference = body.baseline if body.action == "compare" else sums[0]
    assert reference is not None
    differing = [
        sorted(n for n in s.keys() | reference.keys() if s.get(n) != reference.get(n)) for s in sums
    ]
    per_replica = [{"replica": i, "mismatches": names} for i, names in enumerate(differing)]
    if body.action == "checksum":
        return {"checksums": sums[0], "replicas": per_replica}
    mismatches = sorted({n for names in differing for n in names})
    return {"match": not mismatches, "mismatches": mismatches, "replicas": per_replica}


@router.get("/engine_stats", operation_id="engine_stats")
async def _engine_stats(request: Request) -> dict[str, Any]:
    """Each replica's counters (a weightsync extension), and their sums."""
    answers = await _fleet(request).all("GET", "/engine_stats")
    return {
        "num_steps": sum(a["num_steps"] for a in answers),
        "num_unfinished": sum(a["num_unfinished"] for a in answers),
        "is_paused": all(a["is_paused"] for a in answers),
        "weight_version": answers[0]["weight_version"],
        "replicas": answers,
    }


@router.get("/get_world_size", operation_id="get_world_size")
async def _get_world_size(request: Request, include_dp: bool = True) -> dict[str, Any]:
    """Transfer workers behind this server: one per replica (1 with `include_dp=false`)."""
    world_size = _state(request).config.world_size
    return {"world_size": world_size if include_dp else 1}
