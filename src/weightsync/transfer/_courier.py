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

_DeliverFn = Callable[[dict[str, Any]], None]
"""Hands one JSON-safe update info dict to every worker's `receive_weights`."""


class Courier:
    """Runs deliveries in order on a helper thread, so the trainer packs while workers copy.

    The thread is a daemon: a `deliver` that never returns cannot keep the trainer from exiting
    (the wait for it times out instead). After a failed or timed-out delivery, and once closed,
    the queued ones are dropped: a `deliver` still running when its wait timed out is abandoned,
    but nothing after it reaches the workers (who refuse late parts of an update they no longer
    wait for).
    """

    def __init__(self, deliver: _DeliverFn, timeout_s: float) -> None:
        self._deliver = deliver
        self._timeout_s = timeout_s
        self._jobs: queue.SimpleQueue[tuple[dict[str, Any], Future[None]] | None] = (
            queue.SimpleQueue()
        )
        self._pending: deque[tuple[Future[None], str]] = deque()
        # Set on a timeout and on close; checked before every delivery, between buckets.
        self._cancelled = threading.Event()
        self.thread = threading.Thread(target=self._run, name="weightsync-ipc", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        failed = False
        while (job := self._jobs.get()) is not None:
            info, future = job
            if failed or self._cancelled.is_set() or not future.set_running_or_notify_cancel():
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
            self._cancelled.set()  # what is queued behind it must never reach the workers
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
        """Drops what is still queued; a delivery already running is left to end on its own."""
        self._cancelled.set()
        for future, _ in self._pending:
            future.cancel()
        self._jobs.put(None)
