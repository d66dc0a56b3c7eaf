"""A data-parallel front's engine calls and answers: each call acts on every replica, or on none.

`FleetControl` implements the calls the RL routes make (`EngineClient`, as `AsyncEngine` names
them) and what the server answers of itself (`ServerView`), over the replicas.

The rules of an update are each replica's own ([`LiveWeights`][weightsync.engine.weights.LiveWeights],
the same as one engine's): every replica gets every message, and decides as one engine would. The
front keeps only what spans replicas:

- fan-out: a call goes to every replica at once, and answers once all of them did;
- the two-phase pause: `/pause` answers once every replica stopped at its own step boundary;
- the two-phase commit: the version moves on every replica or on none. A replica's bare update
  waits for the front's finish (`finish_bare_updates=False`); a finish first asks every replica
  whether its own would pass (`/prepare_weight_update`), then finishes all of them. If every one
  refuses, each finishes as one engine would (and refuses the same way); if only some refuse,
  the update ends on all of them, the version stays.
- a message some replicas accepted and others refused ends the update on all of them (their
  weights as one engine's failed update leaves them); one every replica refused changed nothing.
- a replica that dies: its completions end with `finish_reason="error"` (the relay), the update
  in progress ends on the survivors, which resume and keep serving completions; the RL routes
  answer 503 naming it, except `/abort_weight_update`, `/abort_requests` and `/health`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from weightsync.engine.outputs import WeightVersion
from weightsync.engine.pause import PauseMode
from weightsync.engine.weights import AdapterCommit
from weightsync.errors import EngineStateError, WeightSyncError, WeightTransferError
from weightsync.serve import _metrics
from weightsync.serve._front.fleet import Fleet, Replica, raise_failures
from weightsync.serve._view import Body
from weightsync.serve.config import ServerConfig

logger = logging.getLogger("weightsync.serve")


@dataclass
class FleetControl:
    """The engine calls and the answers of a data-parallel front, over its replicas.

    Attributes:
        fleet: The replicas.
        config: The HTTP layer's settings (the front's keys; `world_size` is the replicas').
        live: Each running completion's id -> the index of the replica running it.
    """

    fleet: Fleet
    config: ServerConfig
    live: dict[str, int] = field(default_factory=dict)
    # Serializes the weight-update calls (and a replica's death), so a finish's check and commit
    # see the same updates.
    _updates: asyncio.Lock = field(default_factory=asyncio.Lock)
    _weight_update: Body | None = None  # replica 0's, as the last update_weights left it
    _last_adapter_commit: AdapterCommit | None = None  # see last_adapter_commit

    def watch_replicas(self) -> None:
        """From now on, a replica's death ends the update on the others (call on the loop)."""
        loop = asyncio.get_running_loop()
        tasks: set[asyncio.Task[None]] = set()

        def on_death(replica: Replica) -> None:  # a reader thread's call
            def schedule() -> None:
                task = loop.create_task(self._replica_died(replica))
                tasks.add(task)
                task.add_done_callback(tasks.discard)

            loop.call_soon_threadsafe(schedule)

        self.fleet.on_death = on_death

    async def _replica_died(self, replica: Replica) -> None:
        """Ends the update in progress on the survivors and resumes them: they keep serving."""
        logger.error("%s exited with status %s: the update in progress ends on the others, "
                     "which keep serving completions", replica.name, replica.process.exit_status)  # fmt: skip
        async with self._updates:
            survivors = self.fleet.live()
            await self.fleet.each("POST", "/abort_weight_update", replicas=survivors)
            resumed = await self.fleet.each("POST", "/resume", replicas=survivors)
        for survivor, answer in zip(survivors, resumed, strict=True):
            if isinstance(answer, BaseException):  # torn weights, say: it stays paused
                logger.error("%s stays paused: %s", survivor.name, answer)

    # --- pause and requests -----------------------------------------------------------------

    async def pause(self, mode: PauseMode, clear_cache: bool, timeout_s: float | None) -> Body:
        """Pauses every replica at its own step boundary; answers once all of them are paused.

        A replica that misses `timeout_s` makes the call fail naming it, while the others stay
        paused: the fleet never serves mixed weights.
        """
        params = {"mode": mode, "clear_cache": str(clear_cache).lower()}
        timeout = timeout_s or self.fleet.timeout_s
        await self.fleet.all("POST", "/pause", params=params, timeout_s=timeout)
        return {"status": "paused"}

    async def arm_pause(
        self, after_tokens: int, *, mode: PauseMode = "keep", clear_cache: bool = True
    ) -> None:
        """Arms the same pause on every replica."""
        params = {
            "after_tokens": after_tokens,
            "mode": mode,
            "clear_cache": str(clear_cache).lower(),
        }
        await self.fleet.all("POST", "/arm_pause", params=params)

    async def resume_generation(self) -> None:
        """Resumes every replica."""
        await self.fleet.all("POST", "/resume")

    async def is_paused(self) -> Body:
        """Whether every replica is paused; `replicas` gives each one's answer."""
        each = [bool(a["is_paused"]) for a in await self.fleet.all("GET", "/is_paused")]
        return {"is_paused": all(each), "replicas": each}

    async def abort_all(self) -> int:
        """Aborts every running completion on every live replica; returns how many ran."""
        running = len(self.live)
        await self.fleet.each("POST", "/abort_requests", body={}, timeout_s=10,
                              replicas=self.fleet.live())  # fmt: skip
        return running

    def _by_replica(self, completion_ids: list[str]) -> dict[int, list[str]]:
        """The running completions of `completion_ids`, grouped by the replica that runs each."""
        owners: dict[int, list[str]] = {}
        for completion_id in completion_ids:
            if completion_id in self.live:
                owners.setdefault(self.live[completion_id], []).append(completion_id)
        return owners

    async def abort_requests(self, completion_ids: list[str] | None) -> Body:
        """Aborts running completions by id on the replica running each (every one when None).

        Acts on the replicas that run: a dead replica's completions have ended already.
        """
        if not completion_ids:
            answers = raise_failures(
                await self.fleet.each(
                    "POST", "/abort_requests", body={}, replicas=self.fleet.live()
                )
            )
            return {"status": "aborted", "aborted": sum(int(a["aborted"]) for a in answers)}
        aborted = 0
        for index, owned in self._by_replica(completion_ids).items():
            answer = await self.fleet.replicas[index].call(
                "POST", "/abort_requests", body={"request_ids": owned}
            )
            aborted += int(answer["aborted"])
        return {"status": "aborted", "aborted": aborted}

    async def unfinished_requests(self, completion_ids: list[str]) -> Body:
        """The given completion ids still unfinished on their replica."""
        unfinished: list[str] = []
        for index, owned in self._by_replica(completion_ids).items():
            answer = await self.fleet.replicas[index].call(
                "POST", "/unfinished_requests", body={"request_ids": owned}
            )
            unfinished += answer["unfinished"]
        return {"unfinished": unfinished}

    # --- the weight update ------------------------------------------------------------------

    async def init_weight_transfer_engine(self, request: Mapping[str, Any]) -> None:
        """Joins every replica to the trainer's transfer, each as its own rank."""
        await self.fleet.all("POST", "/init_weight_transfer_engine", body=dict(request))

    async def shutdown_weight_transfer_engine(self) -> None:
        """Every replica leaves the trainer's transfer."""
        async with self._updates:
            await self.fleet.all("POST", "/shutdown_weight_transfer_engine")

    async def start_weight_update(
        self, *, lora_name: str | None = None, lora_config: Mapping[str, Any] | None = None
    ) -> None:
        """Opens the transaction on every replica; if one refuses, none keeps it open.

        With `lora_name`, the transaction is that LoRA adapter's on every replica (each one
        checks it against its own copy of the adapter).
        """
        body: Body | None = None
        if lora_name is not None:
            body = {"lora_name": lora_name, "lora_config": lora_config}
        async with self._updates:
            self.fleet.require_alive()
            outcomes = await self.fleet.each("POST", "/start_weight_update", body=body)
            if any(isinstance(o, BaseException) for o in outcomes):
                opened = [r for r, o in zip(self.fleet.replicas, outcomes, strict=True)
                          if not isinstance(o, BaseException)]  # fmt: skip
                # Nothing moved yet: ending the ones this call opened leaves all as they were.
                await self.fleet.each("POST", "/abort_weight_update", replicas=opened)
            raise_failures(outcomes)

    async def update_weights(self, request: Mapping[str, Any]) -> Body:
        """Delivers one update message to every replica at once (a broadcast needs them all).

        A bare update's transaction finishes on every replica, or on none, once its last
        message landed everywhere; so does a `weight_dir`, which each replica checks against
        its model and loads as a bare update.

        Returns:
            Replica 0's stats, as it answered them.
        """
        body = dict(request)
        async with self._updates:
            self.fleet.require_alive()
            outcomes = await self.fleet.each("POST", "/update_weights", body=body)
            failures = [o for o in outcomes if isinstance(o, BaseException)]
            if failures:
                if len(failures) < len(outcomes) or any(
                    isinstance(f, WeightTransferError) for f in failures
                ):
                    await self._end_everywhere()  # replicas would hold different updates
                raise_failures(outcomes)  # every one refused: nothing changed anywhere
            answers = raise_failures(outcomes)
            states = [a.get("weight_update") for a in answers]
            if all(s is not None and not s["explicit"] and s["complete"] for s in states):
                await self._commit(None)
                states = [None]
            self._weight_update = states[0]
        stats: Body = answers[0]["stats"]
        return stats

    @property
    def weight_update(self) -> Body | None:
        """The update in progress as replica 0 answered the last `update_weights`, or None."""
        return self._weight_update

    async def finish_weight_update(self, weight_version: WeightVersion | None = None) -> bool:
        """Moves the version on every replica, or on none: each is checked before any commits."""
        async with self._updates:
            self.fleet.require_alive()
            self._weight_update = None
            return await self._commit(weight_version)

    async def _commit(self, weight_version: WeightVersion | None) -> bool:
        """The two-phase commit of the update in progress (see the module docstring).

        Returns whether the update was applied: an update that a refused message left open
        ends unapplied on every replica (each decides it as one engine would).
        """
        body = {"weight_version": weight_version}
        checks = await self.fleet.each("POST", "/prepare_weight_update", body=body)
        refusals = [c for c in checks if isinstance(c, BaseException)]
        if refusals and len(refusals) < len(checks):
            await self._end_everywhere()
            first = refusals[0]
            if isinstance(first, WeightSyncError):
                first.args = (f"{first} (the other replicas would have finished: the update "
                              "ended on every replica, the version stays)",)  # fmt: skip
        elif refusals:  # each one ends it as one engine would, and refuses the same way
            with contextlib.suppress(WeightSyncError):
                raise_failures(await self.fleet.each("POST", "/finish_weight_update", body=body))
        raise_failures(checks)
        answers = raise_failures(await self.fleet.each("POST", "/finish_weight_update", body=body))
        if "lora_name" in answers[0]:  # an adapter's update: what any replica dropped
            dropped: list[WeightVersion] = []
            for answer in answers:
                dropped += [v for v in answer["dropped_versions"] if v not in dropped]
            self._last_adapter_commit = AdapterCommit(
                answers[0]["lora_name"], answers[0]["weight_version"], dropped
            )
        return all(bool(a.get("applied", True)) for a in answers)

    @property
    def last_adapter_commit(self) -> AdapterCommit | None:
        """What the last finish of an adapter's update did, as the replicas answered."""
        return self._last_adapter_commit

    async def _end_everywhere(self) -> None:
        """Ends the update on every live replica (each restores or marks what it touched)."""
        await self.fleet.each("POST", "/abort_weight_update", replicas=self.fleet.live())

    async def abort_weight_update(self) -> bool:
        """Ends the transaction on every live replica; returns whether one was open somewhere.

        Answers even when a replica is gone: its survivors are the ones to end it on.
        """
        async with self._updates:
            self._weight_update = None
            answers = raise_failures(
                await self.fleet.each("POST", "/abort_weight_update", replicas=self.fleet.live())
            )
        return any(a["aborted"] for a in answers)

    async def update_weight_version(self, new_version: WeightVersion) -> None:
        """Relabels the weights of every replica."""
        async with self._updates:
            await self.fleet.all(
                "POST", "/update_weight_version", body={"new_version": new_version}
            )

    async def weight_info(self) -> Body:
        """The weight version (replica 0's); `replicas` gives each one's."""
        versions = [a["weight_version"] for a in await self.fleet.all("GET", "/weight_info")]
        return {"weight_version": versions[0], "replicas": versions}

    async def weight_checksums(self) -> list[dict[str, str]]:
        """Each replica's checksums, in order."""
        body = {"action": "checksum"}
        return [a["checksums"] for a in await self.fleet.all("POST", "/weight_checker", body=body)]

    async def reset_weights(self) -> None:
        """Writes zeros over every replica's weights."""
        async with self._updates:
            await self.fleet.all("POST", "/weight_checker", body={"action": "reset"})

    async def sleep(self, level: int = 1, *, mode: PauseMode = "abort") -> None:
        """Puts every replica to sleep."""
        async with self._updates:
            await self.fleet.all("POST", "/sleep", params={"level": level, "mode": mode})

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Wakes `tags` on every replica."""
        params = [("tags", tag) for tag in tags or []]
        async with self._updates:
            await self.fleet.all("POST", "/wake_up", params=params)

    async def is_sleeping(self) -> Body:
        """Whether any replica sleeps; `replicas` gives each one's answer."""
        each = [bool(a["is_sleeping"]) for a in await self.fleet.all("GET", "/is_sleeping")]
        return {"is_sleeping": any(each), "replicas": each}

    async def reset_prefix_cache(self) -> bool:
        """Forgets every replica's cached prompt prefixes."""
        answers = await self.fleet.all("POST", "/reset_prefix_cache")
        return all(a["success"] for a in answers)

    async def engine_stats(self) -> Body:
        """Each replica's counters, and their sums."""
        answers = await self.fleet.all("GET", "/engine_stats")
        return {
            "num_steps": sum(a["num_steps"] for a in answers),
            "num_unfinished": sum(a["num_unfinished"] for a in answers),
            "num_rendering": sum(a["num_rendering"] for a in answers),
            "is_paused": all(a["is_paused"] for a in answers),
            "is_sleeping": any(a["is_sleeping"] for a in answers),
            "weight_version": answers[0]["weight_version"],
            "weight_update": answers[0]["weight_update"],
            "replicas": answers,
        }

    async def health(self) -> tuple[int, Body]:
        """`ok` while every replica runs; `degraded`, naming the replicas gone, once one exited.

        A degraded front still answers 200: its survivors serve completions.
        """
        replicas = [
            {"replica": r.index, "alive": r.alive, "pid": r.process.pid}
            for r in self.fleet.replicas
        ]
        dead = self.fleet.dead()
        if not dead:
            return 200, {"status": "ok", "replicas": replicas}
        return 200, {
            "status": "degraded",
            "message": "; ".join(str(r.unavailable()) for r in dead),
            "replicas": replicas,
        }

    async def vllm_config(self) -> Body:
        """A live replica's config tree, with the front's data-parallel size."""
        tree = (
            await self.fleet.pick().call("GET", "/server_info", params={"config_format": "json"})
        )["vllm_config"]
        tree["parallel_config"]["data_parallel_size"] = self.config.world_size
        return dict(tree)

    async def lora_cards(self) -> list[Body]:
        """The adapters' model cards, as a live replica lists them (every replica holds the same)."""
        models = await self.fleet.pick().call("GET", "/v1/models")
        return list(models["data"][1:])

    # --- LoRA adapters ----------------------------------------------------------------------

    async def load_lora_adapter(
        self, lora_name: str, lora_path: str, *, load_inplace: bool = False
    ) -> None:
        """Loads the adapter on every replica, or on none (see `_undo_lora`).

        A replica that refuses makes the others undo their load: a name new to them is
        unloaded, an in-place load reloads the previous version's directory in place (its
        weights come back, under the next version number). The answer is the refusal.
        """
        body = {"lora_name": lora_name, "lora_path": lora_path, "load_inplace": load_inplace}
        async with self._updates:
            self.fleet.require_alive()
            undo: tuple[str, Body] | None = ("/v1/unload_lora_adapter", {"lora_name": lora_name})
            if load_inplace:
                previous = {c["id"]: c["root"] for c in await self.lora_cards()}
                if lora_name in previous:  # a directory to reload; a live update's has none
                    root = previous[lora_name]
                    undo = None if root is None else (
                        "/v1/load_lora_adapter",
                        {"lora_name": lora_name, "lora_path": root, "load_inplace": True},
                    )  # fmt: skip
            outcomes = await self.fleet.each("POST", "/v1/load_lora_adapter", body=body)
            await self._undo_lora(lora_name, outcomes, undo)

    async def unload_lora_adapter(self, lora_name: str) -> None:
        """Unloads the adapter from every replica, or from none (see `_undo_lora`).

        A replica that refuses makes the others load it back from its directory.
        """
        async with self._updates:
            self.fleet.require_alive()
            roots = {c["id"]: c["root"] for c in await self.lora_cards()}
            undo: tuple[str, Body] | None = None
            if roots.get(lora_name) is not None:
                undo = ("/v1/load_lora_adapter",
                        {"lora_name": lora_name, "lora_path": roots[lora_name]})  # fmt: skip
            outcomes = await self.fleet.each(
                "POST", "/v1/unload_lora_adapter", body={"lora_name": lora_name}
            )
            await self._undo_lora(lora_name, outcomes, undo)

    async def _undo_lora(
        self,
        lora_name: str,
        outcomes: list[Body | BaseException],
        undo: tuple[str, Body] | None,
    ) -> None:
        """All or none for a load or an unload: the replicas that took it undo it if one refused.

        Raises:
            WeightSyncError: The refusal, as one server answers it, once the others undid
                theirs (every replica refused: nothing changed anywhere).
            EngineStateError: Undoing failed on a replica (its call failed, or the previous
                version was built by a live update and has no directory to reload): rather
                than serve different adapters under the name, every replica unloads it. The
                message names the refusal, the replica that could not undo, and what to do.
        """
        took = [r for r, o in zip(self.fleet.replicas, outcomes, strict=True)
                if not isinstance(o, BaseException)]  # fmt: skip
        if len(took) == len(outcomes):
            return
        if took:
            if undo is None:
                why = (f"the previous version of {lora_name!r} was built by a live update and "
                       "has no directory to reload")  # fmt: skip
                undone: list[Body | BaseException] = [EngineStateError(why) for _ in took]
            else:
                undone = await self.fleet.each("POST", undo[0], body=undo[1], replicas=took)
            failed = [(r, u) for r, u in zip(took, undone, strict=True)
                      if isinstance(u, BaseException)]  # fmt: skip
            if failed:
                await self.fleet.each("POST", "/v1/unload_lora_adapter",
                                      body={"lora_name": lora_name}, replicas=self.fleet.live())  # fmt: skip
                try:
                    raise_failures(outcomes)
                except WeightSyncError as refusal:
                    replica, reason = failed[0]
                    raise EngineStateError(
                        f"{refusal}; undoing it on {replica.name} failed ({reason}), so every "
                        f"replica unloaded {lora_name!r} rather than serve different versions "
                        "of it: load it again (/v1/load_lora_adapter)"
                    ) from refusal
        raise_failures(outcomes)

    async def metrics(self) -> bytes:
        """Each live replica's metrics under its `engine` index, and their sums (`total`)."""
        live = self.fleet.live()
        pages = await asyncio.gather(*(r.metrics_page() for r in live), return_exceptions=True)
        answered = []
        for replica, page in zip(live, pages, strict=True):
            if isinstance(page, BaseException):  # died since: the scrape shows the survivors
                logger.warning("metrics of %s left out: %s", replica.name, page)
            else:
                answered.append((replica.index, page))
        return _metrics.render(_metrics.merge_replicas(answered))
