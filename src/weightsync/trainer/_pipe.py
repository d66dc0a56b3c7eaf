"""A spawned child process answering JSON commands on a pipe: `EngineProcess`'s transport.

Commands and replies are JSON objects (no pickle crosses the pipe); every wait for a reply is
bounded, and a child that died or stopped answering becomes a weightsync error.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
from collections.abc import Callable
from typing import Any

from weightsync.errors import EngineStateError, EngineTimeoutError


class PipeProcess:
    """Parent side of a spawned child that runs `target(conn, *args)` and answers on `conn`.

    Args:
        target: Spawn-safe function that serves commands until it receives `{"op": "exit"}`.
        args: Its further arguments (JSON-like values).
        timeout_s: Default limit for each reply, in seconds.
    """

    def __init__(
        self, target: Callable[..., None], args: tuple[Any, ...], timeout_s: float
    ) -> None:
        context = mp.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=target, args=(child, *args), daemon=True)
        self._process.start()
        child.close()
        self.timeout_s = timeout_s

    @property
    def pid(self) -> int | None:
        """The child's process id."""
        return self._process.pid

    def _start(self, op: str, **fields: Any) -> None:
        """Sends a command without waiting for its reply."""
        try:
            self._conn.send_bytes(json.dumps({"op": op, **fields}).encode())
        except (OSError, ValueError) as exc:  # a closed pipe or a child that exited
            raise EngineStateError(
                f"cannot send {op!r} to engine process {self.pid}: it exited or was closed "
                f"({type(exc).__name__}: {exc}); create a new EngineProcess"
            ) from exc

    def _reply(self, timeout_s: float | None = None) -> dict[str, Any]:
        """Waits for the next reply; a failed command raises `_error_from(reply)`.

        Raises:
            EngineTimeoutError: No reply within `timeout_s` (default: `self.timeout_s`).
            EngineStateError: The child exited without replying.
        """
        limit = self.timeout_s if timeout_s is None else timeout_s
        try:
            if not self._conn.poll(limit):
                raise EngineTimeoutError(
                    f"engine process {self.pid} did not answer within {limit:g} s (timeout_s): "
                    "it is stuck or overloaded; raise timeout_s or close it"
                )
            reply: dict[str, Any] = json.loads(self._conn.recv_bytes())
        except (EOFError, OSError) as exc:
            raise EngineStateError(
                f"engine process {self.pid} exited without answering "
                f"({type(exc).__name__}); create a new EngineProcess"
            ) from exc
        if not reply["ok"]:
            raise self._error_from(reply)
        return reply

    def _error_from(self, reply: dict[str, Any]) -> Exception:
        """The error to raise for a failed command's reply (`error_type`, `message`, ...)."""
        return EngineStateError(
            f"engine process {self.pid} failed: {reply.get('error_type')}: {reply.get('message')}"
        )

    def close(self) -> None:
        """Asks the child to exit; kills it if it does not within the timeout. Safe to call twice."""
        if self._process.is_alive():
            with contextlib.suppress(EngineStateError):
                self._start("exit")
                self._reply()
            self._process.join(self.timeout_s)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(self.timeout_s)
        self._conn.close()
