"""Sleep and wake up (vLLM's `/sleep?level=` and `/wake_up?tags=`): what sleeps, what memory goes.

A colocated trainer puts the engine to sleep to take its memory for a training step, then wakes
it in parts: the weights first (an update may land), then the KV cache and scheduling. What is
asleep is a set of tags:

- level 0: `scheduling` (nothing runs; no memory freed);
- level 1: also `kv_cache` (its memory freed; requests kept by the pause recompute their KV once
  it is back) and `weights` (no update lands until they wake);
- level 2: also the weights' memory: woken, they hold nothing valid, and are torn until an
  update covering them lands.

No request is taken while any tag sleeps, and generation resumes only once every tag is awake;
as in vLLM, waking the last of the memory (`weights`, `kv_cache`) wakes `scheduling` with it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from weightsync.engine._model_runner import ModelRunner
from weightsync.engine.weights import LiveWeights
from weightsync.errors import InvalidRequestError

logger = logging.getLogger(__name__)

SLEEP_TAGS = ("weights", "kv_cache", "scheduling")
"""What a `wake_up(tags)` may wake, as vLLM names them."""
_LEVELS = {0: {"scheduling"}, 1: set(SLEEP_TAGS), 2: set(SLEEP_TAGS)}


class Sleep:
    """The tags asleep, and the memory sleeping frees and waking restores.

    Args:
        runner: Holds the KV cache.
        weights: The live weights.
    """

    def __init__(self, runner: ModelRunner, weights: LiveWeights) -> None:
        self._runner = runner
        self._weights = weights
        self.asleep: set[str] = set()
        self.level: int | None = None

    @staticmethod
    def check_level(level: object) -> int:
        """The level, checked: 0, 1 or 2.

        Raises:
            InvalidRequestError: Another value.
        """
        if isinstance(level, bool) or level not in _LEVELS:
            raise InvalidRequestError(f"sleep level must be 0, 1 or 2, got {level!r}")
        assert isinstance(level, int)
        return level

    def sleep(self, level: int) -> None:
        """Puts the tags of `level` to sleep and frees their memory (the engine paused already)."""
        tags = _LEVELS[level]
        if "weights" in tags:
            self._weights.sleep(discard=level == 2)
        if "kv_cache" in tags and "kv_cache" not in self.asleep:
            self._runner.release_kv_cache()
        self.asleep |= tags
        self.level = max(level, self.level or 0)
        logger.info("asleep at level %d: %s", level, sorted(self.asleep))

    def wake(self, tags: Iterable[str] | None) -> None:
        """Wakes `tags` (every one when None).

        Raises:
            InvalidRequestError: An unknown tag (nothing is woken then).
        """
        wanted = set(SLEEP_TAGS) if tags is None else set(tags)
        unknown = sorted(wanted - set(SLEEP_TAGS))
        if unknown:
            raise InvalidRequestError(
                f"wake_up tags must be some of {list(SLEEP_TAGS)}, got unknown {unknown}"
            )
        if "weights" in wanted & self.asleep:
            self._weights.wake()
        if "kv_cache" in wanted & self.asleep:
            self._runner.restore_kv_cache()
        self.asleep -= wanted
        # vLLM's rule: scheduling resumes once no memory sleeps, whichever call woke the last of
        # it (SkyRL wakes `weights`, then `kv_cache`, and expects to generate).
        if not self.asleep & {"weights", "kv_cache"}:
            self.asleep.discard("scheduling")
        if not self.asleep:
            self.level = None
