"""Transfer-engine calls of an `AsyncEngine`, off its event loop, on threads of their own.

A transfer call (joining a group, receiving an update) waits in torch and cannot be interrupted;
these helpers run it so that the event loop goes on meanwhile, a cancelled caller keeps its locks
until the call ends, and a stopping process is not held up by it (see `TRANSFER_THREAD_NAME`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["TRANSFER_THREAD_NAME", "on_transfer_thread", "to_thread_uninterrupted"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


TRANSFER_THREAD_NAME = "weightsync-transfer"
"""The name of the thread each transfer-engine call of an `AsyncEngine` runs on.

Such a call waits in torch (a rendezvous, a broadcast) up to its `timeout_s` and cannot be
interrupted. It runs on a thread of its own rather than on asyncio's executor, whose threads the
event loop's close waits for: a process that is stopping may then exit without waiting for it
with `os._exit` (`weightsync serve` does, on SIGINT or SIGTERM). The interpreter's own exit
still waits for it, as for any thread: torch must not be torn down under a call in progress."""


async def on_transfer_thread(fn: Callable[..., _T], *args: Any) -> _T:
    """Runs `fn(*args)` on a thread named `TRANSFER_THREAD_NAME`; returns its result."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[_T] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if done.cancelled():
            return
        if error is None:
            done.set_result(result)
        else:
            done.set_exception(error)

    def run() -> None:
        result, error = None, None
        try:
            result = fn(*args)
        except BaseException as exc:  # handed to the awaiting task, raised there
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: no one awaits it
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name=TRANSFER_THREAD_NAME).start()
    return await done


async def to_thread_uninterrupted(fn: Callable[..., _T], *args: Any) -> _T:
    """Runs `fn` on a transfer thread; if the caller is cancelled, still waits for `fn` to end.

    A transfer cannot be interrupted halfway, so the locks its caller holds must stay held until
    it ends: otherwise a step could run on half-written weights.
    """
    work = asyncio.ensure_future(on_transfer_thread(fn, *args))
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        logger.info("cancelled during %s: waiting for it to end first", fn.__name__)
        await asyncio.wait([work])
        raise
