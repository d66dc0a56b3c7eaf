"""A receiver's watch over what its trainer left behind, between the calls that use it.

A receiver only acts when called, yet its trainer may go away between two calls: close its
shared-memory session (whose segments this receiver still maps) or its group (whose connections
and listening port this receiver still holds). A `Watch` runs a receiver's sweep on a daemon
thread every `RELEASE_PERIOD_S`, so that such leftovers go within about that long, not at the
next init.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import Concatenate, ParamSpec, Protocol, TypeVar

__all__ = ["RELEASE_PERIOD_S", "Watch", "exclusive"]

logger = logging.getLogger(__name__)

RELEASE_PERIOD_S = 1.0
"""How often, in seconds, a receiver looks for what its trainer left behind."""

_STOP_WAIT_S = 5.0


class Watch:
    """Runs `sweep()` every `period_s` on a daemon thread until stopped, or until it returns False.

    Args:
        sweep: Releases what is left over; returns whether there is anything left to watch.
        name: The thread's name.
        period_s: Seconds between sweeps.
    """

    def __init__(
        self, sweep: Callable[[], bool], *, name: str, period_s: float = RELEASE_PERIOD_S
    ) -> None:
        self._sweep = sweep
        self._period_s = period_s
        self._stopped = threading.Event()
        self.swept = threading.Event()
        """Set after each sweep: a test waits on it (and clears it) instead of sleeping."""
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(self._period_s):
            try:
                going_on = self._sweep()
            except Exception:  # a sweep must never take the receiver down with it
                logger.exception("releasing what the trainer left behind failed")
                going_on = True
            self.swept.set()
            if not going_on:
                return

    @property
    def is_running(self) -> bool:
        """Whether the thread still runs."""
        return self._thread.is_alive()

    def stop(self) -> None:
        """Stops the thread and waits for it (a sweep in progress ends first). Safe twice."""
        self._stopped.set()
        if self._thread is not threading.current_thread():
            self._thread.join(_STOP_WAIT_S)

    @staticmethod
    def stop_if_any(watch: Watch | None) -> None:
        """Stops `watch`, if there is one."""
        if watch is not None:
            watch.stop()


class _Watched(Protocol):
    _busy: threading.RLock


_W = TypeVar("_W", bound=_Watched)
_P = ParamSpec("_P")
_R = TypeVar("_R")


def exclusive(method: Callable[Concatenate[_W, _P], _R]) -> Callable[Concatenate[_W, _P], _R]:
    """Runs a receiver's method holding its `_busy` lock, which its watch's sweep never waits for.

    A sweep that finds the lock held skips its turn: the call in progress sees for itself.
    """

    def run(self: _W, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with self._busy:
            return method(self, *args, **kwargs)

    return functools.wraps(method)(run)  # type: ignore[return-value]
