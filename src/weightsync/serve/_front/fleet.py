"""The replicas behind a data-parallel front: their processes, their HTTP clients, their calls.

Each replica is a plain `weightsync serve` child on a free loopback port, with a private admin key
and transfer worker index `worker_index + i`, so it is receiver rank `rank_offset + worker_index
+ i` of a trainer's broadcast. The front reaches it over HTTP, like any client: one protocol.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import secrets
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx

from weightsync.config import WeightTransferConfig
from weightsync.errors import (
    EngineConfigError,
    EngineStateError,
    EngineTimeoutError,
    ReplicaUnavailableError,
    WeightSyncError,
    WeightValidationError,
)
from weightsync.serve._parser import ADMIN_API_KEY_ENV, API_KEY_ENV, _add_serve_arguments
from weightsync.trainer._serve_process import ServeProcess
from weightsync.trainer.http_client import _error_from_answer

logger = logging.getLogger("weightsync.serve")

DEFAULT_REPLICA_TIMEOUT_S = 300.0
"""Limit of one front-to-replica call, in seconds (a transfer call waits for its trainer)."""
_METRICS_TIMEOUT_S = 10.0  # a scrape: the replica renders counters, nothing waits
# A replica's shutdown, before it is killed: its own is bounded (about SHUTDOWN_GRACE_S +
# ENGINE_SHUTDOWN_TIMEOUT_S, see weightsync.serve._server), with room for a loaded machine.
_STOP_TIMEOUT_S = 8.0
# Options the front sets for each replica itself rather than passing its own on.
_NOT_PASSED_ON = {"command", "host", "port", "api_key", "admin_api_key", "worker_index", "device",
                  "data_parallel_size", "parent_pid", "replica", "num_threads", "weight_transfer_config"}  # fmt: skip


def replica_argv(args: argparse.Namespace, transfer: WeightTransferConfig | None) -> list[str]:
    """The `weightsync serve` options the front was given that every replica takes as they are."""
    serve = argparse.ArgumentParser()
    _add_serve_arguments(serve)
    argv: list[str] = []
    for action in serve._actions:
        value = getattr(args, action.dest, None)
        if action.dest in _NOT_PASSED_ON or not action.option_strings or value is None:
            continue
        if isinstance(action, argparse._StoreTrueAction):
            argv += [action.option_strings[0]] if value else []
        elif action.dest == "lora_modules":  # parsed entries: each goes on as its JSON form
            argv += [action.option_strings[0], *(json.dumps(dataclasses.asdict(m)) for m in value)]
        else:
            argv += [action.option_strings[0], str(value)]
    argv.insert(0, args.model)
    if transfer is not None:
        argv += ["--weight-transfer-config", json.dumps(dataclasses.asdict(transfer))]
    return argv


def replica_device(device: str, index: int) -> str:
    """Replica `index`'s device: `cuda` spreads replicas over the GPUs (NCCL needs one per rank)."""
    return f"cuda:{index}" if device == "cuda" else device


class Replica:
    """One replica: its process, its client, and the requests it runs.

    Attributes:
        index: Its position among the replicas (its worker index is the front's plus this).
        open_requests: Completions it runs now, for least-loaded routing.
    """

    def __init__(
        self,
        index: int,
        argv: Sequence[str],
        *,
        threads: int,
        worker_index: int,
        device: str,
        on_exit: Callable[[Replica], None],
    ) -> None:
        self.index = index
        self.open_requests = 0
        self.http: httpx.AsyncClient | None = None
        self._key = secrets.token_urlsafe(24)  # in the child's environment, never its argv
        env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
        env[ADMIN_API_KEY_ENV] = self._key
        self.process = ServeProcess(
            [*argv, "--worker-index", str(worker_index), "--num-threads", str(threads),
             "--device", device, "--replica"],
            env=env,
            relay_prefix=f"replica {index}: ",
            on_exit=lambda status: on_exit(self),
        )  # fmt: skip

    @property
    def alive(self) -> bool:
        """Whether its process runs (a replica that exited never comes back)."""
        return self.process.alive

    @property
    def name(self) -> str:
        """How messages name it."""
        return f"replica {self.index} ({self.process.base_url or 'starting'})"

    def wait_listening(self, timeout_s: float) -> None:
        """Blocks until the child announces its address.

        Raises:
            EngineConfigError: It exited first (its log says why) or took over `timeout_s`.
        """
        try:
            url = self.process.wait_listening(timeout_s)
        except WeightSyncError as exc:
            raise EngineConfigError(f"replica {self.index} did not start: {exc}") from None
        headers = {"Authorization": f"Bearer {self._key}"}
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        self.http = httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=None)

    def unavailable(self) -> ReplicaUnavailableError:
        """The error of a call this replica cannot take: it exited."""
        # Its last warnings, errors or traceback lines say why; routine INFO lines do not.
        said = [line for line in self.process.log_lines() if not line.startswith(("INFO", "DEBUG"))]
        tail = "".join(said[-3:]).strip()
        status = self.process.exit_status
        how = f", killed by signal {-status}" if status is not None and status < 0 else ""
        return ReplicaUnavailableError(
            f"{self.name} exited (status {status}{how}){': ' + tail if tail else ''}; the "
            "other replicas serve completions, but pause and weight updates need every replica: "
            "restart the server"
        )

    async def call(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, Any] | list[tuple[str, Any]] | None = None,
        body: dict[str, Any] | None = None,
        timeout_s: float = DEFAULT_REPLICA_TIMEOUT_S,
    ) -> dict[str, Any]:
        """One RL call on this replica; its error answer is raised under its own class.

        Returns:
            Its JSON answer; a plain-text answer as `{"text": ...}`.

        Raises:
            ReplicaUnavailableError: It exited, or its connection broke.
            EngineTimeoutError: It did not answer within `timeout_s`.
            WeightSyncError: Its error answer, the message prefixed with its name.
        """
        if not self.alive or self.http is None:
            raise self.unavailable()
        try:
            response = await self.http.request(
                method, path, params=params, json=body, timeout=timeout_s
            )
        except httpx.TimeoutException as exc:
            raise EngineTimeoutError(
                f"{self.name} did not answer {method} {path} within {timeout_s} s (timeout_s): "
                "it may be stuck; the other replicas' calls completed (a pause holds there)"
            ) from exc
        except httpx.HTTPError as exc:
            if not self.alive:
                raise self.unavailable() from exc
            raise ReplicaUnavailableError(f"{self.name}: {method} {path} failed: {exc!r}") from exc
        if response.status_code >= 400:
            raise _error_from_answer(
                f"{self.name}: {method} {path}", response.status_code, response.text
            )
        if not response.headers.get("content-type", "").startswith("application/json"):
            return {"text": response.text}  # a plain-text answer (vLLM's LoRA routes answer so)
        answer: dict[str, Any] = response.json()
        return answer

    async def metrics_page(self, timeout_s: float = _METRICS_TIMEOUT_S) -> str:
        """The text of its `GET /metrics`.

        Raises:
            ReplicaUnavailableError: It exited, its connection broke, or it did not answer
                within `timeout_s`.
        """
        if not self.alive or self.http is None:
            raise self.unavailable()
        try:
            response = await self.http.get("/metrics", timeout=timeout_s)
            response.raise_for_status()
        except httpx.HTTPError as exc:
            raise ReplicaUnavailableError(f"{self.name}: GET /metrics failed: {exc!r}") from exc
        return response.text

    async def close(self) -> None:
        """Stops the process (SIGTERM, SIGKILL after a grace period) and closes its client."""
        if self.http is not None:
            await self.http.aclose()
        await asyncio.to_thread(self.stop)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after `_STOP_TIMEOUT_S`; safe to call twice."""
        self.process.stop(_STOP_TIMEOUT_S)


class Fleet:
    """The N replicas of a data-parallel front, started together and stopped together.

    Args:
        argv: `weightsync serve` options every replica takes (see `replica_argv`).
        size: Number of replicas.
        worker_index: The front's transfer worker index; replica i is `worker_index + i`.
        threads: Torch threads of each replica's forward pass.
        device: The front's `--device`; `cuda` gives replica i `cuda:i`.
        timeout_s: Limit, in seconds, for the replicas to start and of each RL call by default.

    Attributes:
        on_death: Called (from a reader thread) with a replica that exited unasked, once.

    Raises:
        EngineConfigError: A replica did not start (its log says why); the others are stopped.
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        size: int,
        worker_index: int,
        threads: int,
        device: str,
        timeout_s: float,
    ) -> None:
        self.timeout_s = timeout_s
        self.on_death: Callable[[Replica], None] = self._log_death
        self.replicas = [
            Replica(i, argv, threads=threads, worker_index=worker_index + i,
                    device=replica_device(device, i), on_exit=lambda r: self.on_death(r))
            for i in range(size)
        ]  # fmt: skip
        deadline = time.monotonic() + timeout_s
        try:
            for replica in self.replicas:
                replica.wait_listening(max(0.0, deadline - time.monotonic()))
        except BaseException:
            for replica in self.replicas:
                replica.stop()
            raise

    @staticmethod
    def _log_death(replica: Replica) -> None:
        logger.error("%s exited with status %s", replica.name, replica.process.exit_status)

    def dead(self) -> list[Replica]:
        """The replicas that exited."""
        return [r for r in self.replicas if not r.alive]

    def live(self) -> list[Replica]:
        """The replicas that run."""
        return [r for r in self.replicas if r.alive]

    def require_alive(self) -> None:
        """Raises `ReplicaUnavailableError` naming the first replica that exited, if any."""
        for replica in self.dead():
            raise replica.unavailable()

    def pick(self) -> Replica:
        """The live replica with the fewest open requests (the lowest index on a tie).

        Raises:
            ReplicaUnavailableError: Every replica exited.
        """
        live = [r for r in self.replicas if r.alive]
        if not live:
            raise self.replicas[0].unavailable()
        return min(live, key=lambda r: r.open_requests)

    async def each(
        self, method: str, path: str, *, replicas: Sequence[Replica] | None = None, **kwargs: Any
    ) -> list[dict[str, Any] | BaseException]:
        """The same call on every replica (or on `replicas`) at once; each one's answer or error."""
        chosen = self.replicas if replicas is None else replicas
        calls = [r.call(method, path, **kwargs) for r in chosen]
        return list(await asyncio.gather(*calls, return_exceptions=True))

    async def all(self, method: str, path: str, **kwargs: Any) -> list[dict[str, Any]]:
        """The same call on every replica at once; returns once all of them answered.

        Raises:
            ReplicaUnavailableError: A replica exited (checked first: nothing is sent then).
            WeightSyncError: After every call ended, a `WeightValidationError` if every failure
                was one, else the first other failure (as `call_each` does for engines).
        """
        self.require_alive()
        return raise_failures(await self.each(method, path, **kwargs))

    def terminate(self) -> None:
        """Signals every replica to stop (SIGTERM), without waiting: `close` waits."""
        for replica in self.replicas:
            replica.process.terminate()

    async def close(self) -> None:
        """Stops every replica (at once) and closes the clients."""
        await asyncio.gather(*(r.close() for r in self.replicas))


def raise_failures(outcomes: list[dict[str, Any] | BaseException]) -> list[dict[str, Any]]:
    """The answers, or the failure that stands for all of them (see `Fleet.all`)."""
    failures = [o for o in outcomes if isinstance(o, BaseException)]
    if failures:
        other = [f for f in failures if not isinstance(f, WeightValidationError)]
        first = (other or failures)[0]
        if isinstance(first, WeightSyncError | asyncio.CancelledError):
            raise first
        raise EngineStateError(f"a replica call failed: {first!r}") from first
    return [o for o in outcomes if isinstance(o, dict)]
