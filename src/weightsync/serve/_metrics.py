"""`GET /metrics`: an engine's numbers in Prometheus's text format, under vLLM's names.

The request metrics take vLLM's names (`vllm:num_requests_running`, `vllm:prompt_tokens_total`,
`vllm:e2e_request_latency_seconds`, ...) and its `model_name` and `engine` labels, so a dashboard
or alert built for a vLLM server reads a weightsync one. What only an RL server has goes under
`weightsync:`: pauses and how long they lasted, weight updates (count, bytes, seconds, failures)
and the live weight version. The numbers come from the engine's
[`ServingStats`][weightsync.engine._stats.ServingStats]; this module only renders them.

A data-parallel front scrapes each replica's page and serves every sample under the replica's
`engine` label, plus the sums across replicas under `engine="total"` (so a query that sums over
`engine` leaves `total` out).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.parser import text_string_to_metric_families

from weightsync.engine._stats import Histogram
from weightsync.engine.async_engine import AsyncEngine

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""The media type of Prometheus's text format."""

TOTAL = "total"
"""The `engine` label of a front's sums across its replicas."""

# Families whose sum across replicas means nothing: each replica's own value only.
_NOT_SUMMED = frozenset({"weightsync:weight_version"})


def _buckets(histogram: Histogram) -> list[tuple[str, float]]:
    """Prometheus's cumulative buckets, `+Inf` last."""
    buckets, running = [], 0
    for bound, count in zip([*histogram.bounds, float("inf")], histogram.counts, strict=True):
        running += count
        buckets.append(("+Inf" if bound == float("inf") else repr(bound), float(running)))
    return buckets


class _Builder:
    """Families of one engine, each sample labelled with the model's name and `engine` index."""

    def __init__(self, model_name: str, index: int) -> None:
        self.names, self.values = ["model_name", "engine"], [model_name, str(index)]
        self.families: list[Metric] = []

    def gauge(self, name: str, doc: str, value: float) -> None:
        family = GaugeMetricFamily(name, doc, labels=self.names)
        family.add_metric(self.values, value)
        self.families.append(family)

    def counter(self, name: str, doc: str, value: float) -> None:
        family = CounterMetricFamily(name, doc, labels=self.names)
        family.add_metric(self.values, value)
        self.families.append(family)

    def by_label(self, name: str, doc: str, label: str, counts: dict[str, int]) -> None:
        family = CounterMetricFamily(name, doc, labels=[*self.names, label])
        for key, count in sorted(counts.items()):
            family.add_metric([*self.values, key], count)
        self.families.append(family)

    def histogram(self, name: str, doc: str, observed: Histogram) -> None:
        family = HistogramMetricFamily(name, doc, labels=self.names)
        family.add_metric(self.values, _buckets(observed), observed.total)
        self.families.append(family)


def engine_families(engine: AsyncEngine, model_name: str, index: int = 0) -> list[Metric]:
    """Every metric of one engine, labelled with the model's name and its `engine` index."""
    out = _Builder(model_name, index)
    _request_metrics(out, engine)
    _rl_metrics(out, engine)
    return out.families


def _request_metrics(out: _Builder, engine: AsyncEngine) -> None:
    """vLLM's: the batch, tokens, finished requests and their latencies."""
    stats = engine.stats
    running = len(engine.engine.scheduler.running)
    out.gauge("vllm:num_requests_running", "Requests in the running batch.", running)
    out.gauge(
        "vllm:num_requests_waiting",
        "Requests queued (or frozen by a pause) and not running.",
        max(0, engine.num_unfinished_requests() - running),
    )
    out.counter(
        "vllm:prompt_tokens", "Prompt tokens of the requests that ended.", stats.prompt_tokens
    )
    out.counter(
        "vllm:generation_tokens", "Output tokens of the requests that ended.",
        stats.generation_tokens,
    )  # fmt: skip
    out.by_label("vllm:request_success", "Requests that ended, by finish reason.",
                 "finished_reason", stats.finished)  # fmt: skip
    out.histogram(
        "vllm:e2e_request_latency_seconds",
        "Seconds from a request's arrival to its end.",
        stats.e2e_latency_s,
    )
    out.histogram(
        "vllm:time_to_first_token_seconds",
        "Seconds from a request's arrival to its first output token.",
        stats.time_to_first_token_s,
    )


def _rl_metrics(out: _Builder, engine: AsyncEngine) -> None:
    """weightsync's: pauses, weight updates, the live version."""
    stats = engine.stats
    out.gauge("weightsync:is_paused", "1 while generation is paused.", engine.engine.is_paused())
    out.by_label("weightsync:pauses", "Pauses that landed, by mode.", "mode", stats.pauses)
    out.histogram(
        "weightsync:pause_duration_seconds",
        "Seconds from a pause landing to the resume that ended it.",
        stats.pause_duration_s,
    )
    out.counter(
        "weightsync:weight_updates", "Weight updates that moved the weight version.",
        stats.weight_updates,
    )  # fmt: skip
    out.counter(
        "weightsync:weight_update_failures",
        "Weight-update calls refused or failed (start, a message, a finish).",
        stats.weight_update_failures,
    )
    out.counter(
        "weightsync:weight_update_bytes", "Payload bytes received by weight updates.",
        stats.weight_update_bytes,
    )  # fmt: skip
    out.histogram(
        "weightsync:weight_update_seconds",
        "Seconds each weight-update message took to receive.",
        stats.weight_update_s,
    )
    version = GaugeMetricFamily(
        "weightsync:weight_version",
        "1, labelled with the live weight version.",
        labels=[*out.names, "version"],
    )
    version.add_metric([*out.values, str(engine.weight_version)], 1.0)
    out.families.append(version)


class _Families:
    """A collector that hands over families made already (one scrape's)."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterator[Metric]:
        yield from self._families


def render(families: Iterable[Metric]) -> bytes:
    """Prometheus's text format of `families`."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    return generate_latest(registry)


def merge_replicas(pages: Sequence[tuple[int, str]]) -> list[Metric]:
    """The families of a front: each replica's samples under its index, then the sums.

    Args:
        pages: `(replica index, the text of its /metrics)` for each replica that answered.

    Returns:
        One family per name, every sample labelled `engine=<index>`, plus `engine="total"`
        samples that add up the replicas' (except the weight version's, which has none).
    """
    merged: dict[str, Metric] = {}
    totals: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for index, text in pages:
        for family in text_string_to_metric_families(text):
            into = merged.setdefault(
                family.name, Metric(family.name, family.documentation, family.type)
            )
            sums = totals.setdefault(family.name, {})
            for sample in family.samples:
                into.add_sample(sample.name, {**sample.labels, "engine": str(index)}, sample.value)
                if family.name not in _NOT_SUMMED:
                    key = (sample.name, tuple(sorted(_without_engine(sample.labels).items())))
                    sums[key] = sums.get(key, 0.0) + sample.value
    for name, sums in totals.items():
        for (sample_name, pairs), value in sums.items():
            merged[name].add_sample(sample_name, {**dict(pairs), "engine": TOTAL}, value)
    return list(merged.values())


def _without_engine(labels: dict[str, Any]) -> dict[str, str]:
    return {key: str(value) for key, value in labels.items() if key != "engine"}
