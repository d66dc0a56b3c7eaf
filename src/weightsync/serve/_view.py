"""The control surface every RL route calls, and its implementation over one engine.

The RL routes (`_rl_routes`) check a request's parameters and call a `ControlSurface`; they know
nothing else. `EngineControl` implements it over one
[`AsyncEngine`][weightsync.engine.async_engine.AsyncEngine]; a data-parallel front implements it
over N replica servers (`_fleet_control`). Each method returns the route's JSON body: vLLM's,
plus what a weightsync extension adds (a front adds each replica's answer).
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Protocol

from weightsync.engine.async_engine import AsyncEngine
from weightsync.engine.outputs import WeightVersion
from weightsync.engine.pause import PauseMode
from weightsync.engine.weights import WeightUpdateStatus
from weightsync.serve import _info, _metrics
from weightsync.serve.config import ServerConfig

Body = dict[str, Any]


@dataclass(frozen=True)
class PauseRecord:
    """Where the last `/pause` fell in the engine's steps, as the server saw it.

    Both counts are the engine's step counter (forward passes run) read on the event loop:
    network transit is not counted. For a `keep` or `abort` pause the difference is at most 1,
    the step in flight when the request arrived; a `wait` pause lands once its requests finished,
    and a pause armed by `/arm_pause` where it was armed to.

    Attributes:
        mode: The pause's mode, as applied (an armed pause's own mode).
        requested_at_step: Steps run when the server began handling the request.
        landed_at_step: Steps run when the pause had landed (the route about to answer).
    """

    mode: str
    requested_at_step: int
    landed_at_step: int


class ControlSurface(Protocol):
    """What the RL routes call: implemented over one engine, or over the replicas of a front."""

    config: ServerConfig
    live: dict[str, Any]
    """Each running completion's id -> where it runs (its engine requests, or its replica)."""

    async def abort_all(self) -> int:
        """Aborts every running completion; returns how many ran (the server's shutdown)."""
        ...

    async def pause(self, mode: PauseMode, clear_cache: bool, timeout_s: float | None) -> Body:
        """Pauses generation at a step boundary; answers once paused."""
        ...

    async def arm_pause(self, after_tokens: int, mode: PauseMode, clear_cache: bool) -> Body:
        """Arms a pause for when every unfinished request has `after_tokens` output tokens."""
        ...

    async def resume(self) -> Body:
        """Resumes generation."""
        ...

    async def is_paused(self) -> Body:
        """Whether generation is paused."""
        ...

    async def abort_requests(self, completion_ids: list[str] | None) -> Body:
        """Aborts running completions by id (every one when None)."""
        ...

    async def unfinished_requests(self, completion_ids: list[str]) -> Body:
        """The given completions still unfinished in the engine."""
        ...

    async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> Body:
        """Joins the trainer's transfer."""
        ...

    async def shutdown_weight_transfer_engine(self) -> Body:
        """Leaves the trainer's transfer and frees what it held."""
        ...

    async def start_weight_update(self) -> Body:
        """Opens a weight-update transaction."""
        ...

    async def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> Body:
        """Receives one update message."""
        ...

    async def update_weights_from_dir(self, weight_dir: str) -> Body:
        """Loads a checkpoint directory as one update (prime-rl's `weight_dir`)."""
        ...

    async def finish_weight_update(self, weight_version: WeightVersion | None) -> Body:
        """Ends the transaction; the version moves."""
        ...

    async def abort_weight_update(self) -> Body:
        """Ends the transaction on purpose."""
        ...

    async def update_weight_version(self, new_version: WeightVersion) -> Body:
        """Relabels the current weights."""
        ...

    async def weight_info(self) -> Body:
        """The current weight version."""
        ...

    async def weight_checksums(self) -> list[dict[str, str]]:
        """SHA-256 of every weight by name: one dict per replica (one for one engine)."""
        ...

    async def reset_weights(self) -> Body:
        """Writes zeros over every weight (the weight checker's `reset`)."""
        ...

    async def sleep(self, level: int, mode: PauseMode) -> Body:
        """Pauses and frees memory: level 0, 1 or 2."""
        ...

    async def wake_up(self, tags: list[str] | None) -> Body:
        """Wakes `tags` (all when None)."""
        ...

    async def is_sleeping(self) -> Body:
        """Whether anything sleeps."""
        ...

    async def reset_prefix_cache(self) -> Body:
        """Forgets every cached prompt prefix."""
        ...

    async def engine_stats(self) -> Body:
        """The engine's counters."""
        ...

    async def health(self) -> tuple[int, Body]:
        """The health status and body."""
        ...

    async def vllm_config(self) -> Body:
        """The server's config in vLLM's `/server_info` tree."""
        ...

    async def metrics(self) -> bytes:
        """The server's metrics in Prometheus's text format."""
        ...


def update_status(status: WeightUpdateStatus | None) -> Body | None:
    """The `weight_update` field of an `/update_weights` answer (None: no update in progress)."""
    return None if status is None else dataclasses.asdict(status)


@dataclass
class EngineControl:
    """The control surface over one engine: each call is the engine's own.

    Attributes:
        engine: The engine served.
        config: The HTTP layer's settings.
        live: Each running completion's id -> the engine request ids of its choices.
        last_pause: Where the last `/pause` fell in the engine's steps (`/engine_stats`).
    """

    engine: AsyncEngine
    config: ServerConfig
    live: dict[str, list[str]] = field(default_factory=dict)
    last_pause: PauseRecord | None = None
    # One transaction call at a time, so an answer describes the update as its call left it.
    _updates: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def pause(self, mode: PauseMode, clear_cache: bool, timeout_s: float | None) -> Body:
        """Pauses; answers once paused.

        `timeout_s` bounds a front's replicas; one engine needs no bound: a pause waits at most
        for the step in flight, or for requests that all end.
        """
        del timeout_s
        # Read on the event loop before anything waits: a step in flight now counts once it ends.
        requested_at_step = self.engine.num_steps
        mode = await self.engine.pause_generation(mode=mode, clear_cache=clear_cache)
        # Paused now, so no step runs between the return above and this read.
        self.last_pause = PauseRecord(mode, requested_at_step, self.engine.num_steps)
        return {"status": "paused"}

    async def arm_pause(self, after_tokens: int, mode: PauseMode, clear_cache: bool) -> Body:
        """Arms the pause; `/pause` then waits for it to land."""
        await self.engine.arm_pause(after_tokens, mode=mode, clear_cache=clear_cache)
        return {"status": "armed"}

    async def resume(self) -> Body:
        """Resumes generation; kept requests continue."""
        await self.engine.resume_generation()
        return {"status": "resumed"}

    async def is_paused(self) -> Body:
        """Whether generation is paused."""
        return {"is_paused": await self.engine.is_paused()}

    async def abort_all(self) -> int:
        """Aborts every running completion (their streams end with `finish_reason="abort"`)."""
        running = len(self.live)
        for request_id in [rid for rids in self.live.values() for rid in rids]:
            await self.engine.abort(request_id)
        self.engine.close_streams_held_by_update()  # no step ends them until the update does
        return running

    async def abort_requests(self, completion_ids: list[str] | None) -> Body:
        """Aborts running completions by id (every one when none is given)."""
        if not completion_ids:
            return {"status": "aborted", "aborted": await self.abort_all()}
        found = [cid for cid in completion_ids if cid in self.live]
        for completion_id in found:
            for request_id in self.live.get(completion_id, []):
                await self.engine.abort(request_id)
        return {"status": "aborted", "aborted": len(found)}

    async def unfinished_requests(self, completion_ids: list[str]) -> Body:
        """The given completion ids with a choice still queued, running or frozen."""
        unfinished = [
            cid for cid in completion_ids if self.engine.unfinished(self.live.get(cid, []))
        ]
        return {"unfinished": unfinished}

    async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> Body:
        """Joins the trainer's transfer; blocks (off the event loop) until it forms."""
        await self.engine.init_weight_transfer_engine({"init_info": init_info})
        return {"message": "Weight transfer initialized"}

    async def shutdown_weight_transfer_engine(self) -> Body:
        """Leaves the trainer's transfer; the weights and their version stay."""
        async with self._updates:
            await self.engine.shutdown_weight_transfer_engine()
        return {"message": "Weight transfer shut down"}

    async def start_weight_update(self) -> Body:
        """Opens a weight-update transaction."""
        async with self._updates:
            await self.engine.start_weight_update()
        return {"message": "Weight update started"}

    async def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> Body:
        """Receives one update message; the answer says how the update stands after it."""
        return await self._update({"update_info": update_info})

    async def update_weights_from_dir(self, weight_dir: str) -> Body:
        """Loads a checkpoint directory as one update; see `LLMEngine.update_weights`."""
        return await self._update({"weight_dir": weight_dir})

    async def _update(self, request: dict[str, Any]) -> Body:
        async with self._updates:
            stats = await self.engine.update_weights(request)
            status = update_status(self.engine.weight_update)
        return {
            "message": "Weights updated",
            "stats": dataclasses.asdict(dataclasses.replace(stats, loaded_names=None)),
            "weight_update": status,
        }

    async def finish_weight_update(self, weight_version: WeightVersion | None) -> Body:
        """Ends the transaction: the version moves if every announced weight landed.

        `applied` is false when a refused message made the update end unapplied.
        """
        async with self._updates:
            applied = await self.engine.finish_weight_update(weight_version)
        return {"message": "Weight update finished", "applied": applied}

    async def abort_weight_update(self) -> Body:
        """Ends the transaction on purpose; `aborted`: one was open."""
        async with self._updates:
            aborted = await self.engine.abort_weight_update()
        return {"message": "Weight update aborted", "aborted": aborted}

    async def update_weight_version(self, new_version: WeightVersion) -> Body:
        """Relabels the current weights."""
        async with self._updates:
            await self.engine.update_weight_version(new_version)
        return {"success": True, "new_version": new_version}

    async def weight_info(self) -> Body:
        """The current weight version."""
        return {"weight_version": self.engine.weight_version}

    async def weight_checksums(self) -> list[dict[str, str]]:
        """SHA-256 of every weight, by name."""
        return [await self.engine.weight_checksums()]

    async def reset_weights(self) -> Body:
        """Writes zeros over every weight."""
        async with self._updates:
            await self.engine.reset_weights()
        return {"status": "reset"}

    async def sleep(self, level: int, mode: PauseMode) -> Body:
        """Pauses (`mode`) and frees the memory of `level`."""
        async with self._updates:
            await self.engine.sleep(level, mode=mode)
        return {"status": "sleeping", "level": level}

    async def wake_up(self, tags: list[str] | None) -> Body:
        """Wakes `tags` (all when None); `status` says whether anything still sleeps."""
        async with self._updates:
            await self.engine.wake_up(tags)
        asleep = await self.engine.is_sleeping()
        return {"status": "sleeping" if asleep else "awake", "tags": tags}

    async def is_sleeping(self) -> Body:
        """Whether anything sleeps."""
        return {"is_sleeping": await self.engine.is_sleeping()}

    async def reset_prefix_cache(self) -> Body:
        """Forgets every cached prompt prefix."""
        return {"success": await self.engine.reset_prefix_cache()}

    async def engine_stats(self) -> Body:
        """Requests in flight and rendering, pause, sleep, version, update, last pause."""
        last = self.last_pause
        return {
            "num_steps": self.engine.num_steps,
            "num_unfinished": self.engine.num_unfinished_requests(),
            "num_rendering": self.engine.num_rendering,
            "is_paused": await self.engine.is_paused(),
            "is_sleeping": await self.engine.is_sleeping(),
            "weight_version": self.engine.weight_version,
            "weight_update": update_status(self.engine.weight_update),
            "last_pause": dataclasses.asdict(last) if last is not None else None,
        }

    async def health(self) -> tuple[int, Body]:
        """200 while the server serves."""
        return 200, {"status": "ok"}

    async def vllm_config(self) -> Body:
        """The engine's config in vLLM's `/server_info` tree."""
        return _info.vllm_config(self.engine, self.config)

    async def metrics(self) -> bytes:
        """The engine's metrics in Prometheus's text format."""
        return _metrics.render(_metrics.engine_families(self.engine, self.config.model_name))
