"""The IPC trainer's courier: deliveries run in order on a helper thread, each bounded in time."""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from weightsync.errors import WeightTransferTimeout

DeliverFn = Callable[[dict[str, Any]], None]
"""Hands one JSON-safe update info dict to every worker's `receive_weights`."""


class Courier:
    """Runs deliveries in order on a helper thread, so the trainer packs while workers copy.

    The thread is a daemon: a `deliver` that never returns cannot keep the trainer from exiting
    (the wait for it times out instead). After a failed delivery the queued ones are dropped.
    """

    def __init__(self, deliver: DeliverFn, timeout_s: float) -> None:
        self._deliver = deliver
        self._timeout_s = timeout_s
        self._jobs: queue.SimpleQueue[tuple[dict[str, Any], Future[None]] | None] = (
            queue.SimpleQueue()
        )
        self._pending: deque[tuple[Future[None], str]] = deque()
        self._thread = threading.Thread(target=self._run, name="weightsync-ipc", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        failed = False
        while (job := self._jobs.get()) is not None:
            info, future = job
            if failed or not future.set_running_or_notify_cancel():
                future.cancel()
                continue
            try:
                self._deliver(info)
            except BaseException as exc:  # handed to the trainer's thread, which re-raises it
                failed = True
                future.set_exception(exc)
            else:
                future.set_result(None)

    def __len__(self) -> int:
        return len(self._pending)

    def submit(self, info: dict[str, Any], what: str) -> None:
        future: Future[None] = Future()
        self._jobs.put((info, future))
        self._pending.append((future, what))

    def wait_oldest(self) -> None:
        future, what = self._pending.popleft()
        try:
            future.result(self._timeout_s)
        except concurrent.futures.TimeoutError:
            if future.done():  # the deliver callable raised a timeout of its own
                raise
            raise WeightTransferTimeout(
                f"delivering {what}: the workers did not acknowledge within timeout_s="
                f"{self._timeout_s:g} s"
            ) from None

    def raise_if_failed(self) -> None:
        """Raises a delivery's failure early; pending successes stay pending (a window counts them)."""
        if any(f.done() and not f.cancelled() and f.exception() for f, _ in self._pending):
            self.drain()  # raises the first failure, in delivery order

    def drain(self) -> None:
        while self._pending:
            self.wait_oldest()

    def close(self) -> None:
        for future, _ in self._pending:
            future.cancel()
        self._jobs.put(None)
