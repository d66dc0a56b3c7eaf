"""A receiver's watch over what its trainer left behind, between the calls that use it.

A receiver only acts when called, yet its trainer may go away between two calls: close its
shared-memory session (whose segments this receiver still maps) or its group (whose connections
and listening port this receiver still holds). A `Watch` runs a receiver's sweep on a daemon
thread every `RELEASE_PERIOD_S`, so that such leftovers go within about that long, not at the
next init.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

__all__ = ["RELEASE_PERIOD_S", "Watch"]

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
