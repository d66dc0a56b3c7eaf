"""Cases of `/pause`, `/resume`, `/is_paused` and `/abort_requests`, idle and in flight.

A request in flight is a streamed greedy completion the case watches while it pauses.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from weightsync.conformance._case import Case, Run
from weightsync.conformance._probe import (
    Background,
    CaseFailed,
    Probe,
    StreamRecord,
    expect_ok,
    expect_refusal,
    wait_until,
)

# Long enough to be running when the pause lands, on a CPU or a GPU.
_LONG = 256
# Short enough for `wait` to drain quickly.
_SHORT = 24
# How long a frozen stream is watched for tokens that should not come.
_WATCH_S = 1.0
# Chunks already on the wire when a pause returns may still arrive for a moment.
_SETTLE_S = 0.3


def prompt(seed: int) -> list[int]:
    """A token-id prompt no other case sends (ids small enough for any vocabulary)."""
    return [11 + (seed * 37 + i * 13) % 200 for i in range(12)]


def _resume(probe: Probe) -> None:
    probe.call("POST", "/resume")


@contextmanager
def _in_flight(probe: Probe, seed: int, max_tokens: int) -> Iterator[StreamRecord]:
    """A running streamed completion; the server is resumed when the block ends."""
    with probe.stream(prompt(seed), max_tokens) as record:
        try:
            wait_until(record.running, probe.timeout_s, "the stream's second token")
            if record.ended.is_set():
                raise CaseFailed(f"the stream ended before the pause: {record.describe()}")
            yield record
        finally:
            _resume(probe)


def _idle_cycle(probe: Probe) -> str:
    expect_ok(probe.call("POST", "/pause"), status="paused")
    try:
        expect_ok(probe.call("GET", "/is_paused"), is_paused=True)
    finally:
        resumed = probe.call("POST", "/resume")
    expect_ok(resumed, status="resumed")
    expect_ok(probe.call("GET", "/is_paused"), is_paused=False)
    return "{status: paused}, is_paused true, {status: resumed}, is_paused false"


def _each_mode(probe: Probe) -> str:
    for mode in ("abort", "wait", "keep"):
        try:
            expect_ok(probe.call("POST", "/pause", params={"mode": mode}), status="paused")
        finally:
            _resume(probe)
    return "mode=abort, wait, keep each answer {status: paused} on an idle server"


def _twice(probe: Probe) -> str:
    try:
        for _ in range(2):
            expect_ok(probe.call("POST", "/pause"), status="paused")
    finally:
        _resume(probe)
    expect_ok(probe.call("POST", "/resume"), status="resumed")
    return "a second pause and a resume of a running server both answer 200"


def _clear_cache_false(probe: Probe) -> str:
    try:
        expect_ok(
            probe.call("POST", "/pause", params={"mode": "keep", "clear_cache": "false"}),
            status="paused",
        )
    finally:
        _resume(probe)
    return "mode=keep&clear_cache=false -> {status: paused}"


def _bad_query(name: str, value: str) -> Run:
    def run(probe: Probe) -> str:
        try:
            detail = expect_refusal(
                probe.call("POST", "/pause", params={name: value}), (400, 422), mentions=name
            )
        finally:
            _resume(probe)
        expect_ok(probe.call("GET", "/is_paused"), is_paused=False)
        return detail

    return run


def _in_flight_abort(probe: Probe) -> str:
    with _in_flight(probe, 1, _LONG) as record:
        expect_ok(probe.call("POST", "/pause", params={"mode": "abort"}), status="paused")
        # The aborted request ends while the server is still paused.
        wait_until(record.ended, probe.timeout_s, "the aborted stream's end")
    if record.finish_reason != "abort" or not record.done:
        raise CaseFailed(f"expected finish_reason 'abort' and [DONE]: {record.describe()}")
    if record.completion_tokens is not None and record.completion_tokens >= _LONG:
        raise CaseFailed(f"the request ran to its end: {record.describe()}")
    return f"the client saw {record.describe()}"


def _in_flight_wait(probe: Probe) -> str:
    with _in_flight(probe, 2, _SHORT) as record:
        expect_ok(probe.call("POST", "/pause", params={"mode": "wait"}), status="paused")
        wait_until(record.ended, probe.timeout_s, "the drained stream's end")
    if record.finish_reason != "length" or record.completion_tokens not in (None, _SHORT):
        raise CaseFailed(f"expected the request to finish whole: {record.describe()}")
    return f"the pause returned once the request finished: {record.describe()}"


def _in_flight_keep(probe: Probe) -> str:
    with _in_flight(probe, 3, _LONG) as record:
        expect_ok(probe.call("POST", "/pause", params={"mode": "keep"}), status="paused")
        time.sleep(_SETTLE_S)
        frozen_at = record.chunks
        time.sleep(_WATCH_S)
        if record.ended.is_set() or record.chunks != frozen_at:
            raise CaseFailed(
                f"the stream moved while paused ({frozen_at} -> {record.chunks} chunks in "
                f"{_WATCH_S:g} s): {record.describe()}"
            )
    wait_until(record.ended, probe.timeout_s, "the resumed stream's end")
    if record.finish_reason != "length" or record.completion_tokens not in (None, _LONG):
        raise CaseFailed(f"expected the kept request to finish whole: {record.describe()}")
    return f"frozen at {frozen_at} chunks for {_WATCH_S:g} s, then {record.describe()}"


def _deprecated_wait_flag(probe: Probe) -> str:
    with _in_flight(probe, 4, _LONG) as record:
        answer = probe.call("POST", "/pause", params={"wait_for_inflight_requests": "true"})
        expect_ok(answer, status="paused")
        _resume(probe)
        wait_until(record.ended, probe.timeout_s, "the stream's end")
    if record.finish_reason == "abort":
        return f"an abort pause (vLLM 0.32 ignores the flag): {record.describe()}"
    if record.finish_reason == "length":
        return f"a wait pause (the flag's documented meaning): {record.describe()}"
    raise CaseFailed(f"the stream neither finished nor was aborted: {record.describe()}")


def _request_while_paused(probe: Probe) -> str:
    expect_ok(probe.call("POST", "/pause", params={"mode": "abort"}), status="paused")
    try:
        request = Background(lambda: probe.completion(prompt=prompt(5), max_tokens=4))
        early = request.wait(_WATCH_S)
        if early is not None:  # answered while paused: only a refusal is sound
            return "refused while paused: " + expect_refusal(early, (409, 503))
    finally:
        _resume(probe)
    answer = request.wait(probe.timeout_s)
    if answer is None:
        raise CaseFailed(f"no answer within {probe.timeout_s:g} s of the resume")
    expect_ok(answer, choices=...)
    return "queued while paused, answered 200 after the resume"


def _abort_all(probe: Probe) -> str:
    with _in_flight(probe, 6, _LONG) as record:
        body = expect_ok(probe.call("POST", "/abort_requests", json_body={}), status="aborted")
        wait_until(record.ended, probe.timeout_s, "the aborted stream's end")
    if not isinstance(body.get("aborted"), int) or body["aborted"] < 1:
        raise CaseFailed(f"expected aborted >= 1, got {body}")
    if record.finish_reason != "abort":
        raise CaseFailed(f"the stream was not aborted: {record.describe()}")
    return f"{body}; the client saw {record.describe()}"


def _abort_by_id(probe: Probe) -> str:
    with _in_flight(probe, 7, _LONG) as record:
        ids = [record.completion_id]
        body = expect_ok(
            probe.call("POST", "/abort_requests", json_body={"request_ids": ids}), status="aborted"
        )
        wait_until(record.ended, probe.timeout_s, "the stream's end")
    if record.finish_reason != "abort":
        raise CaseFailed(f"answered {body} for {ids}, but the stream ran on: {record.describe()}")
    return f"{body}; the client saw {record.describe()}"


def _abort_unknown_id(probe: Probe) -> str:
    answer = probe.call(
        "POST", "/abort_requests", json_body={"request_ids": ["conformance-no-such-request"]}
    )
    body = expect_ok(answer, status="aborted")
    if body.get("aborted") != 0:
        raise CaseFailed(f"nothing ran, yet {answer.describe()}")
    return str(body)


def _abort_no_body(probe: Probe) -> str:
    answer = probe.call("POST", "/abort_requests")
    if answer.status == 200:
        expect_ok(answer, status="aborted", aborted=...)
        return f"taken as 'abort every request': {answer.body}"
    return expect_refusal(answer, (400, 422))


def _abort_bad_ids(probe: Probe) -> str:
    answer = probe.call("POST", "/abort_requests", json_body={"request_ids": "conformance"})
    return expect_refusal(answer, (400, 422), mentions="request_ids")


CASES = [
    Case("pause.idle_cycle", "pause, is_paused, resume answer vLLM's bodies", _idle_cycle),
    Case("pause.modes", "each mode pauses an idle server", _each_mode),
    Case("pause.twice", "pausing twice and resuming a running server are harmless", _twice),
    Case("pause.clear_cache_false", "clear_cache=false is taken", _clear_cache_false),
    Case(
        "pause.bad_mode",
        "an unknown mode is a typed 400 naming it; nothing pauses",
        _bad_query("mode", "conformance"),
    ),
    Case(
        "pause.bad_clear_cache",
        "a non-boolean clear_cache is a typed 400 naming it",
        _bad_query("clear_cache", "conformance"),
    ),
    Case(
        "pause.in_flight.abort",
        "the in-flight request ends at once with finish_reason "
        "'abort', its partial output and [DONE]",
        _in_flight_abort,
    ),
    Case(
        "pause.in_flight.wait",
        "the pause returns once the in-flight request finished whole",
        _in_flight_wait,
    ),
    Case(
        "pause.in_flight.keep",
        "the in-flight request is frozen while paused and finishes whole after the resume",
        _in_flight_keep,
    ),
    Case(
        "pause.in_flight.wait_for_inflight_requests",
        "the deprecated flag pauses; the request is aborted or drained, never broken",
        _deprecated_wait_flag,
        note="vLLM 0.32 ignores the flag (an abort pause); weightsync takes it as mode=wait, "
        "its documented meaning",
    ),
    Case(
        "pause.request_while_paused",
        "a request sent while paused is queued until the "
        "resume (or refused with a typed 409/503), never served while paused",
        _request_while_paused,
    ),
    Case(
        "abort_requests.all",
        "an empty body aborts every request in flight and counts them",
        _abort_all,
    ),
    Case("abort_requests.by_id", "a request's completion id aborts that request", _abort_by_id),
    Case(
        "abort_requests.unknown_id",
        "an id that names no request aborts nothing: aborted 0",
        _abort_unknown_id,
    ),
    Case(
        "abort_requests.no_body", "no body aborts every request, or is a typed 400", _abort_no_body
    ),
    Case(
        "abort_requests.bad_ids",
        "request_ids that is not a list is a typed 400 naming it",
        _abort_bad_ids,
    ),
]
