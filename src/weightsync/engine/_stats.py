"""What an engine has served and how its weights moved: counts, sums and histograms.

One place records everything a metrics page shows: [`AsyncEngine`][weightsync.engine.async_engine.AsyncEngine]
records each request as it ends, each pause and each weight update; the server renders these
numbers in Prometheus's format (`GET /metrics`). Plain numbers, no metrics library: the engine
knows nothing of how they are shown. Every record happens on the event loop that drives the
engine, so nothing here needs a lock.
"""

from __future__ import annotations

import bisect
import contextlib
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from weightsync.engine.outputs import RequestOutput

# Bucket upper bounds, in seconds. vLLM's for the request latencies, so dashboards built for it
# read these; the pause and update buckets span a pause of a step to an update of a large model.
E2E_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                  5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
RL_BUCKETS_S = (0.001, 0.01, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0)


@dataclass
class Histogram:
    """Observations counted into buckets, Prometheus's way.

    Attributes:
        bounds: Upper bounds of the buckets, increasing (a last `+Inf` bucket is implied).
        counts: Observations per bucket, not cumulative; one more entry than `bounds`.
        total: Sum of the observations.
    """

    bounds: tuple[float, ...]
    counts: list[int] = field(init=False)
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        """Counts one observation (in the first bucket whose bound is at least `value`)."""
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    @property
    def count(self) -> int:
        """Observations so far."""
        return sum(self.counts)


@dataclass
class ServingStats:
    """Everything an engine counts for `GET /metrics`, since it started.

    Attributes:
        prompt_tokens: Prompt tokens of the requests that ended.
        generation_tokens: Output tokens of the requests that ended.
        finished: Requests that ended, by finish reason (`stop`, `length`, `abort`, ...).
        e2e_latency_s: Seconds from a request's arrival to its end.
        time_to_first_token_s: Seconds from a request's arrival to its first output token.
        pauses: Pauses that landed, by mode.
        pause_duration_s: Seconds from a pause landing to the resume that ended it.
        weight_updates: Updates that moved the weight version (a finish, or a bare update).
        weight_update_failures: Weight-update calls that raised (start, a message, a finish).
        weight_update_bytes: Payload bytes the update messages received.
        weight_update_s: Seconds each update message took to receive.
    """

    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: Counter[str] = field(default_factory=Counter)
    e2e_latency_s: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS_S))
    time_to_first_token_s: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS_S))
    pauses: Counter[str] = field(default_factory=Counter)
    pause_duration_s: Histogram = field(default_factory=lambda: Histogram(RL_BUCKETS_S))
    weight_updates: int = 0
    weight_update_failures: int = 0
    weight_update_bytes: int = 0
    weight_update_s: Histogram = field(default_factory=lambda: Histogram(RL_BUCKETS_S))
    # When the pause in force landed (monotonic seconds), None while running.
    _paused_at: float | None = None

    def record_request(
        self, last: RequestOutput | None, arrived_at: float, first_token_at: float | None
    ) -> None:
        """Counts a request that ended: finished, or left (an abort) with what it had.

        Args:
            last: Its last output (None: it ended before its first).
            arrived_at: When it was submitted (`time.monotonic()`).
            first_token_at: When its first output token came, if one did.
        """
        outputs = last.outputs if last is not None else []
        self.prompt_tokens += len(last.prompt_token_ids or []) if last is not None else 0
        self.generation_tokens += sum(len(o.token_ids) for o in outputs)
        self.finished[next((o.finish_reason for o in outputs if o.finish_reason), "abort")] += 1
        self.e2e_latency_s.observe(time.monotonic() - arrived_at)
        if first_token_at is not None:
            self.time_to_first_token_s.observe(first_token_at - arrived_at)

    def record_pause(self, mode: str) -> None:
        """Counts a pause that landed (a second pause while paused counts, but keeps the start)."""
        self.pauses[mode] += 1
        if self._paused_at is None:
            self._paused_at = time.monotonic()

    def record_resume(self) -> None:
        """Ends the pause in force, if any, and observes how long it lasted."""
        if self._paused_at is not None:
            self.pause_duration_s.observe(time.monotonic() - self._paused_at)
            self._paused_at = None

    def record_update_message(self, num_bytes: int, seconds: float) -> None:
        """Counts one update message received."""
        self.weight_update_bytes += num_bytes
        self.weight_update_s.observe(seconds)

    @contextlib.contextmanager
    def counting_update_failures(self) -> Iterator[None]:
        """Counts a weight-update call that raises in the block (`weight_update_failures`)."""
        try:
            yield
        except Exception:
            self.weight_update_failures += 1
            raise
