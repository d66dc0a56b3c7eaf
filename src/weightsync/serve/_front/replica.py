"""The route only a replica of a data-parallel front serves: the finish check.

A `weightsync serve --data-parallel-size N` front starts N plain `weightsync serve` children
(`--replica`). Each one runs bare updates without finishing them itself
(`finish_bare_updates=False`) and answers the route below, which the front calls on every replica
before any of them moves its weight version: all or none.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Request

from weightsync.engine.async_engine import AsyncEngine
from weightsync.serve._auth import require_admin_key
from weightsync.serve._rl_routes import FinishWeightUpdateRequest

router = APIRouter(dependencies=[Depends(require_admin_key)], include_in_schema=False)
"""Routes only a replica serves, for its front; they are not part of the public API."""


@router.post("/prepare_weight_update")
async def _prepare_weight_update(
    request: Request, body: Annotated[FinishWeightUpdateRequest | None, Body()] = None
) -> dict[str, Any]:
    """Whether `/finish_weight_update` would succeed now: `ready`, or its error (nothing moves)."""
    # Read on the event loop, which no update call runs on meanwhile: the check and the front's
    # commit that follows see the same update (the front sends nothing between).
    engine: AsyncEngine = request.app.state.engine_client
    engine.check_finish_weight_update(body.weight_version if body else None)
    return {"ready": True}
