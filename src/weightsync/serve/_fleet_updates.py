"""A data-parallel front's weight-update routes: an update lands on every replica, or on none.

- `/finish_weight_update` first asks every replica whether its finish would succeed (the update
  landed whole, nothing torn), and moves the version only when all say yes: all or none.
- A bare `/update_weights` becomes such a transaction on every replica, and ends as it would on
  one engine: a message every replica refused moved nothing; a sound announcement of a new
  update replaces one its sender gave up on; a busy replica rejects a broadcast in the trainer's
  handshake; a finish refused for NaNs or torn weights ends the transaction everywhere.
"""

from __future__ import annotations

import contextlib
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
from weightsync.serve._fleet import raise_failures
from weightsync.serve._fleet_app import FleetState
from weightsync.serve._fleet_routes import _state
from weightsync.serve._rl_routes import (
    FinishWeightUpdateRequest,
    StartWeightUpdateRequest,
    UpdateWeightsRequest,
    UpdateWeightVersionRequest,
)

router = APIRouter(tags=["rl"], dependencies=[Depends(require_admin_key)])


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
        except BaseException as exc:
            delivered = not any(isinstance(o, BaseException) for o in outcomes)
            refused = all(isinstance(o, WeightValidationError) for o in outcomes)
            if state.transaction != "implicit":
                raise
            if delivered and isinstance(exc, TornWeightsError):
                await _end_torn(state, None)  # the implicit transaction's finish was refused
            elif opened or not refused:
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


async def _end_torn(state: FleetState, version: Any) -> None:
    """Ends a transaction whose finish was refused for torn weights, as one engine does.

    A replica refused for torn weights takes the same refusal (its finish ends the transaction:
    what landed is no longer torn, the version stays, the torn rest still holds generation); a
    replica whose finish would pass cannot keep the update without its version moving, so it
    aborts it.
    """
    body = {"weight_version": version}
    checks = await state.fleet.each("POST", "/prepare_weight_update", body=body)
    state.transaction = state.update_id = None
    for replica, check in zip(state.fleet.replicas, checks, strict=True):
        with contextlib.suppress(WeightSyncError):  # the refusal raised is the one that counts
            if isinstance(check, TornWeightsError):
                await replica.call("POST", "/finish_weight_update", body=body)
            else:
                await replica.call("POST", "/abort_weight_update")


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
        except (NonFiniteWeightsError, TornWeightsError) as exc:
            # One engine ends its transaction on these; so does the fleet, on every replica.
            await (
                _end_torn(state, version)
                if isinstance(exc, TornWeightsError)
                else _abort_all(state)
            )
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
