"""vLLM's RL routes on a data-parallel front: each call acts on every replica, or on none.

- `/pause` is two-phase: it goes to every replica at once and answers only once all of them
  stopped at their own step boundary. A replica that does not answer within `timeout_s` makes the
  call fail naming it, while the others stay paused: the fleet never serves mixed weights.
- The weight-update routes are in `_fleet_updates`: an update lands on every replica, or none.
- A replica that exited makes every route here fail at once (503) naming it.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Request

from weightsync.serve._auth import require_admin_key
from weightsync.serve._errors import _RequestRefused
from weightsync.serve._fleet import Fleet, raise_failures
from weightsync.serve._fleet_app import FleetState
from weightsync.serve._rl_routes import (
    AbortRequestsRequest,
    InitWeightTransferRequest,
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
