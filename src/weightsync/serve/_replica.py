"""The replica side of a data-parallel server: the finish check, and dying with the front.

A `weightsync serve --data-parallel-size N` front starts N plain `weightsync serve` children. Each
one also gets the route below, which the front calls on every replica before any of them moves
its weight version (all or none), and a watch on its parent, so that no replica outlives a front
that was killed (SIGKILL leaves no time to stop its children). A trainer's `EngineProcess` gives
its server the same watch.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Request
from pydantic import BaseModel, ConfigDict, Field

from weightsync.engine._transaction import non_finite_names
from weightsync.engine.weights import LiveWeights
from weightsync.errors import (
    EngineStateError,
    IncompleteWeightUpdateError,
    NonFiniteWeightsError,
    TornWeightsError,
    WeightUpdateStateError,
    WeightValidationError,
)
from weightsync.serve._auth import require_admin_key
from weightsync.serve._rl_routes import FinishWeightUpdateRequest, UpdateWeightsRequest

logger = logging.getLogger("weightsync.serve")

# How often a child server checks that its parent is alive, in seconds; and how long it then
# gives its own graceful shutdown (abort requests, stop the engine) before it exits regardless.
_PARENT_POLL_S = 0.2
_ORPHAN_GRACE_S = 10.0

router = APIRouter(dependencies=[Depends(require_admin_key)], include_in_schema=False)
"""Routes only a replica serves, for its front; they are not part of the public API."""


def check_finish(weights: LiveWeights, weight_version: Any) -> None:
    """Raises what `LiveWeights.finish(weight_version)` would raise now, changing nothing.

    Raises:
        WeightValidationError: `weight_version` is not a string, an int or None.
        WeightUpdateStateError: No transaction is open.
        IncompleteWeightUpdateError: Announced weights have not landed.
        NonFiniteWeightsError: The engine refuses non-finite weights and one landed with a NaN
            or an infinity (the transaction stays open here: the front aborts it everywhere).
        TornWeightsError: Weights torn by an earlier failure would remain after the finish.
    """
    if weight_version is not None and (
        not isinstance(weight_version, str | int) or isinstance(weight_version, bool)
    ):
        raise WeightValidationError(
            f"weight_version must be a string, an int or None, got {weight_version!r}"
        )
    txn = weights.transaction
    if txn is None:
        raise WeightUpdateStateError(
            "finish_weight_update: no weight update is in progress: call "
            "start_weight_update() and update_weights(...) first"
        )
    missing = sorted(txn.announced - txn.landed)
    if missing:
        raise IncompleteWeightUpdateError(
            f"finish_weight_update: {len(missing)} announced weights have not landed "
            f"(e.g. {missing[:3]}): deliver them with update_weights(...) or end the update "
            "with abort_weight_update()"
        )
    # A pass over every landed weight: only an engine that refuses non-finite weights pays it.
    if weights.refuse_non_finite and (
        bad := non_finite_names(weights.model.named_weights(), txn.landed)
    ):
        raise NonFiniteWeightsError(
            f"finish_weight_update refused: {len(bad)} weights hold a NaN or an infinity "
            f"(e.g. {bad[:3]}); the version stays {weights.weight_version!r}: check the "
            "trainer's weights (a diverged step, a bad cast), then send a finite update"
        )
    torn = sorted(weights.torn_names - txn.landed)
    if torn:
        raise TornWeightsError(
            f"finish_weight_update: the update landed, but {len(torn)} weights are still torn by "
            f"an earlier failed update (e.g. {torn[:3]}); the version stays "
            f"{weights.weight_version!r}: send an update that covers them"
        )


@router.post("/prepare_weight_update")
async def _prepare_weight_update(
    request: Request, body: Annotated[FinishWeightUpdateRequest | None, Body()] = None
) -> dict[str, Any]:
    """Whether `/finish_weight_update` would succeed now: `ready`, or its error (nothing moves).

    Read on the event loop, which no weight-update call runs on while it is read, so the check
    and the front's commit that follows see the same transaction.
    """
    weights = request.app.state.serve.engine.engine.weights
    check_finish(weights, body.weight_version if body else None)
    return {"ready": True}


@router.post("/check_weight_update")
async def _check_weight_update(request: Request, body: UpdateWeightsRequest) -> dict[str, Any]:
    """Whether `/update_weights` would take this message's format and tensors (nothing moves)."""
    request.app.state.serve.engine.engine.weights.check(body.update_info)
    return {"ready": True}


class RefuseWeightUpdateRequest(BaseModel):
    """`/refuse_weight_update`: the update message a front refuses, and why."""

    model_config = ConfigDict(extra="forbid")
    update_info: dict[str, Any]
    reason: str = Field(max_length=4000)


@router.post("/refuse_weight_update")
async def _refuse_weight_update(
    request: Request, body: RefuseWeightUpdateRequest
) -> dict[str, Any]:
    """Answers the update's handshake with a refusal, as a busy engine does its own updates.

    The front calls it on every replica when it cannot open a bare update's transaction: a
    broadcast's trainer waits in the handshake for every rank, and this way learns the reason
    at once, its group still usable. The refusal never waits for the trainer. Without a group
    (ipc) nothing waits, and nothing happens.
    """
    weights = request.app.state.serve.engine.engine.weights
    reason = EngineStateError(body.reason)
    await asyncio.to_thread(weights.refuse, body.update_info, reason)  # store reads only
    return {"refused": True}


def watch_parent(parent_pid: int) -> None:
    """Stops this process when `parent_pid` is no longer its parent (the front or trainer died).

    A daemon thread polls the parent id; on a change it sends this process SIGTERM (the server's
    graceful shutdown), and exits outright if that has not ended it within a grace period.
    """

    def watch() -> None:
        while os.getppid() == parent_pid:
            if _stop.wait(_PARENT_POLL_S):
                return
        logger.error("the process that started this server (pid %d) is gone: shutting down",
                     parent_pid)  # fmt: skip
        os.kill(os.getpid(), signal.SIGTERM)
        if not _stop.wait(_ORPHAN_GRACE_S):
            os._exit(1)

    _stop = threading.Event()  # never set: the thread ends with the process
    if os.getppid() != parent_pid:  # the parent died before this process got here
        os._exit(1)
    threading.Thread(target=watch, name="weightsync-parent-watch", daemon=True).start()
