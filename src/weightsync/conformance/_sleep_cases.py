"""Cases of `/sleep`, `/wake_up`, `/is_sleeping` and what an asleep server refuses."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from weightsync.conformance._case import Case, Run
from weightsync.conformance._pause_cases import prompt
from weightsync.conformance._probe import CaseFailed, Probe, expect_ok, expect_refusal

# An asleep server should refuse at once; a request it queues instead is given this long.
_REFUSE_WITHIN_S = 5.0


@contextmanager
def _asleep(probe: Probe, level: int) -> Iterator[None]:
    """The server asleep at `level` for the block, woken whole afterwards."""
    answer = probe.call("POST", "/sleep", params={"level": level})
    try:
        expect_ok(answer, status="sleeping", level=level)
        yield
    finally:
        probe.call("POST", "/wake_up")


def _is_sleeping(probe: Probe) -> str:
    expect_ok(probe.call("GET", "/is_sleeping"), is_sleeping=False)
    return "{is_sleeping: false}"


def _cycle(level: int) -> Run:
    def run(probe: Probe) -> str:
        with _asleep(probe, level):
            expect_ok(probe.call("GET", "/is_sleeping"), is_sleeping=True)
            expect_ok(probe.call("POST", "/wake_up"), status="awake", tags=None)
        expect_ok(probe.call("GET", "/is_sleeping"), is_sleeping=False)
        expect_ok(probe.completion(prompt=prompt(20), max_tokens=2), choices=...)
        return (f"{{status: sleeping, level: {level}}}, is_sleeping true, "
                "{status: awake, tags: null}, then a completion answers 200")  # fmt: skip

    return run


def _bad_level(probe: Probe) -> str:
    answer = probe.call("POST", "/sleep", params={"level": 3})
    try:
        return expect_refusal(answer, (400, 422), mentions="level")
    finally:
        if answer.status == 200:
            probe.call("POST", "/wake_up")


def _wake_by_tags(probe: Probe) -> str:
    with _asleep(probe, 1):
        answer = probe.call("POST", "/wake_up", params={"tags": "weights"})
        expect_ok(answer, status="sleeping", tags=["weights"])
        expect_ok(probe.call("GET", "/is_sleeping"), is_sleeping=True)
        rest = [("tags", "kv_cache"), ("tags", "scheduling")]
        answer = probe.call("POST", "/wake_up", params=rest)
        expect_ok(answer, status="awake", tags=["kv_cache", "scheduling"])
    return "tags=weights: still sleeping; tags=kv_cache&tags=scheduling: awake"


def _generation_while_asleep(probe: Probe) -> str:
    with _asleep(probe, 1):
        answer = probe.completion(prompt=prompt(21), max_tokens=2, timeout_s=_REFUSE_WITHIN_S)
        if answer.status is None:
            raise CaseFailed(
                f"no answer within {_REFUSE_WITHIN_S:g} s (the request waits for a wake_up)"
            )
        return expect_refusal(answer, (409, 503))


def _update_while_asleep(probe: Probe) -> str:
    with _asleep(probe, 1):
        answer = probe.call("POST", "/start_weight_update")
        try:
            return expect_refusal(answer, (409,))
        finally:
            if answer.status == 200:
                probe.call("POST", "/finish_weight_update", json_body={})


CASES = [
    Case(
        "sleep.is_sleeping",
        "is_sleeping answers {is_sleeping: false} on an awake server",
        _is_sleeping,
    ),
    Case(
        "sleep.level1_cycle",
        "sleep?level=1, is_sleeping, wake_up answer vLLM's bodies; the server serves again after",
        _cycle(1),
    ),
    Case("sleep.bad_level", "level=3 is a typed 400 naming level", _bad_level),
    Case(
        "sleep.wake_by_tags",
        "wake_up?tags=weights leaves it sleeping; the remaining tags wake it",
        _wake_by_tags,
    ),
    Case(
        "sleep.generation_while_asleep",
        "a completion while asleep is a typed 409 at once",
        _generation_while_asleep,
    ),
    Case(
        "sleep.update_while_asleep",
        "start_weight_update while asleep is a typed 409",
        _update_while_asleep,
    ),
    Case(
        "sleep.level2_cycle",
        "sleep?level=2 (weights discarded) and wake_up answer vLLM's bodies",
        _cycle(2),
        kind="destructive",
    ),
]
