"""Pause modes and states: what `pause_generation(mode=...)` does to requests in flight.

- `abort`: every unfinished request ends now with `finish_reason="abort"`, then the engine pauses.
- `wait`: nothing new is admitted and running requests finish (`DRAINING`), then it pauses.
- `keep`: it pauses at once; running requests stay as they are and continue after resume.

While paused nothing is scheduled and new requests queue.
"""

from __future__ import annotations

import enum
from typing import Literal

__all__ = ["PauseMode", "PauseState"]

PauseMode = Literal["abort", "wait", "keep"]
"""How `pause_generation` treats requests in flight (see the module docstring)."""


class PauseState(enum.Enum):
    """An engine's pause state."""

    UNPAUSED = "unpaused"
    """Scheduling normally."""
    DRAINING = "draining"
    """A `wait` pause: running sequences continue, nothing new is admitted."""
    PAUSED = "paused"
    """Nothing is scheduled; new requests queue."""
