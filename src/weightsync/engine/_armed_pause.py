"""A pause armed to land when every unfinished request has N output tokens (a weightsync extension).

A trainer that wants its update to land exactly at token N of its rollouts cannot time a pause
call: the engine may run past N while the call travels. It queues the rollouts while paused, arms
the pause (`LLMEngine.scheduler.armed_pause`), then resumes; the scheduler starts the pause at the
first step boundary, while generation runs, where every unfinished request has at least N tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from weightsync.errors import InvalidRequestError
from weightsync.transfer.base import _is_int

__all__ = ["ArmedPause"]


@dataclass(frozen=True)
class ArmedPause:
    """A pause waiting for every unfinished request to reach `after_tokens` output tokens.

    Attributes:
        after_tokens: Output tokens each unfinished request must have.
        mode: The pause's mode (`abort`, `wait` or `keep`).
        clear_cache: Whether the pause drops the KV and prefix caches.
        on_pause: Called (from the stepping thread) when the pause starts.

    Raises:
        InvalidRequestError: A negative `after_tokens` or an unknown `mode`.
    """

    after_tokens: int
    mode: Literal["abort", "wait", "keep"] = "keep"
    clear_cache: bool = True
    on_pause: Callable[[], None] | None = None

    def __post_init__(self) -> None:
        n = self.after_tokens
        if not _is_int(n) or n < 0:
            raise InvalidRequestError(f"after_tokens must be an int >= 0, got {n!r}")
        if self.mode not in ("abort", "wait", "keep"):
            raise InvalidRequestError(f"mode must be 'abort', 'wait' or 'keep', got {self.mode!r}")
