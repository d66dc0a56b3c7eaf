"""What a server answers of itself, and one engine's answers.

The RL routes call the engine's own methods for every call of an update (`EngineClient`, in
`_rl_routes`). What the server answers of itself (the completions it runs, where its last pause
fell, its state, counters and config) comes from a `ServerView`: `EngineView` is one engine's; a
data-parallel front answers for all its replicas (`weightsync.serve._front`), adding each one's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Protocol

from weightsync.engine.async_engine import AsyncEngine
from weightsync.engine.pause import PauseMode
from weightsync.errors import EngineStateError
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


class ServerView(Protocol):
    """What the server answers of itself: over one engine, or over the replicas of a front."""

    config: ServerConfig
    live: dict[str, Any]
    """Each running completion's id -> where it runs (its engine requests, or its replica)."""

    async def abort_all(self) -> int:
        """Aborts every running completion; returns how many ran (the server's shutdown)."""
        ...

    async def pause(self, mode: PauseMode, clear_cache: bool, timeout_s: float | None) -> Body:
        """Pauses generation at a step boundary; answers once paused."""
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

    async def weight_info(self) -> Body:
        """The current weight version."""
        ...

    async def weight_checksums(self) -> list[dict[str, str]]:
        """SHA-256 of every weight by name: one dict per replica (one for one engine)."""
        ...

    async def is_sleeping(self) -> Body:
        """Whether anything sleeps."""
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

    async def lora_cards(self) -> list[Body]:
        """The loaded LoRA adapters' model cards (`/v1/models` lists them after the base model)."""
        ...


@dataclass
class EngineView:
    """What a server of one engine answers of itself.

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

    async def pause(self, mode: PauseMode, clear_cache: bool, timeout_s: float | None) -> Body:
        """Pauses; answers once paused (`timeout_s` bounds a front's replicas: none here)."""
        del timeout_s  # a pause waits at most for the step in flight, or requests that all end
        # Read on the event loop before anything waits: a step in flight now counts once it ends.
        requested_at_step = self.engine.num_steps
        mode = await self.engine.pause_generation(mode=mode, clear_cache=clear_cache)
        if not await self.engine.is_paused():  # a /resume came first (a `wait` pause drains)
            raise EngineStateError(
                f"the {mode} pause did not hold: a /resume came before it answered (a wait pause "
                "waits for the running requests to finish), and generation is running; pause "
                "again before updating weights"
            )
        # Paused now, so no step runs between the return above and this read.
        self.last_pause = PauseRecord(mode, requested_at_step, self.engine.num_steps)
        return {"status": "paused"}

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

    async def weight_info(self) -> Body:
        """The current weight version."""
        return {"weight_version": self.engine.weight_version}

    async def weight_checksums(self) -> list[dict[str, str]]:
        """SHA-256 of every weight, by name."""
        return [await self.engine.weight_checksums()]

    async def is_sleeping(self) -> Body:
        """Whether anything sleeps."""
        return {"is_sleeping": await self.engine.is_sleeping()}

    async def engine_stats(self) -> Body:
        """Requests in flight and rendering, pause, sleep, version, update, last pause."""
        last, update = self.last_pause, self.engine.weight_update
        return {
            "num_steps": self.engine.num_steps,
            "num_unfinished": self.engine.num_unfinished_requests(),
            "num_rendering": self.engine.num_rendering,
            "is_paused": await self.engine.is_paused(),
            "is_sleeping": await self.engine.is_sleeping(),
            "weight_version": self.engine.weight_version,
            "weight_update": dataclasses.asdict(update) if update is not None else None,
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

    async def lora_cards(self) -> list[Body]:
        """The engine's LoRA adapters' model cards, in load order."""
        return [_info.lora_card(self.config, a) for a in self.engine.list_lora_adapters()]
