"""Cases of the weight-update routes that need no trainer.

The transaction's order rules, init payloads refused before any rendezvous, version labels, and
the routes around them (`/shutdown_weight_transfer_engine`,
`/start_draft_weight_update`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from weightsync.conformance._case import Case, Run
from weightsync.conformance._pause_cases import prompt
from weightsync.conformance._probe import (
    Answer,
    Background,
    CaseFailed,
    Probe,
    ServerDown,
    expect_ok,
    expect_refusal,
)
from weightsync.transfer.base import _is_int

_STARTED = "Weight update started"
_FINISHED = "Weight update finished"
# An update message of the shape every backend's update info has (no trainer behind it).
_UPDATE_INFO = {"names": ["conformance.weight"], "dtype_names": ["float32"], "shapes": [[1]]}
_STATE = (400, 409)
# How long a request sent during an open update is watched for an early answer.
_EARLY_S = 1.0


def _finish(probe: Probe) -> Answer:
    return probe.call("POST", "/finish_weight_update", json_body={})


@contextmanager
def _paused(probe: Probe) -> Iterator[None]:
    """A keep pause around the block, as a trainer's update runs; resumed afterwards."""
    expect_ok(probe.call("POST", "/pause", params={"mode": "keep"}), status="paused")
    try:
        yield
    finally:
        probe.call("POST", "/resume")


@contextmanager
def _update(probe: Probe) -> Iterator[None]:
    """A started weight update; a finish is sent afterwards whatever the block did."""
    expect_ok(probe.call("POST", "/start_weight_update"), message=_STARTED)
    try:
        yield
    finally:
        _finish(probe)


def _finish_without_start(probe: Probe) -> str:
    return expect_refusal(_finish(probe), (409,))


def _update_without_start(probe: Probe) -> str:
    answer = probe.call("POST", "/update_weights", json_body={"update_info": _UPDATE_INFO})
    return expect_refusal(answer, _STATE)


def _start_finish(probe: Probe) -> str:
    with _paused(probe):
        expect_ok(probe.call("POST", "/start_weight_update"), message=_STARTED)
        expect_ok(_finish(probe), message=_FINISHED)
    return "start and finish (no message between) each answer 200"


def _start_twice(probe: Probe) -> str:
    with _paused(probe), _update(probe):
        detail = expect_refusal(probe.call("POST", "/start_weight_update"), (409,))
        # The refused start leaves the first update open: its finish succeeds.
        expect_ok(_finish(probe), message=_FINISHED)
    return detail


def _finish_with_version(probe: Probe) -> str:
    with _paused(probe), _update(probe):
        answer = probe.call("POST", "/finish_weight_update", json_body={"weight_version": "c-1"})
        expect_ok(answer, message=_FINISHED)
    expect_ok(probe.call("GET", "/weight_info"), weight_version="c-1")
    return "finish {weight_version: 'c-1'} -> weight_info 'c-1'"


def _finish_int_version(probe: Probe) -> str:
    with _paused(probe), _update(probe):
        answer = probe.call("POST", "/finish_weight_update", json_body={"weight_version": 7})
        if answer.status == 200:
            expect_ok(probe.call("GET", "/weight_info"), weight_version=7)
            return "an int label taken, and given back as an int"
        detail = expect_refusal(answer, (400, 422), mentions="weight_version")
        # A malformed finish leaves the update open: a plain finish ends it.
        expect_ok(_finish(probe), message=_FINISHED)
    return detail


def _update_refused(update_info: Any, mentions: str = "") -> Run:
    def run(probe: Probe) -> str:
        with _paused(probe), _update(probe):
            answer = probe.call("POST", "/update_weights", json_body={"update_info": update_info})
            return expect_refusal(answer, _STATE, mentions=mentions)

    return run


def _update_list_shaped(probe: Probe) -> str:
    """The list form (one entry per worker rank) is answered as the dict form is."""
    with _paused(probe), _update(probe):
        single = probe.call("POST", "/update_weights", json_body={"update_info": _UPDATE_INFO})
    with _paused(probe), _update(probe):
        listed = probe.call("POST", "/update_weights", json_body={"update_info": [_UPDATE_INFO]})
    expect_refusal(single, _STATE)
    expect_refusal(listed, _STATE)
    if listed.status != single.status:
        raise CaseFailed(f"dict: {single.describe()}; list: {listed.describe()}")
    return f"both forms: {single.status} (no trainer behind either)"


def _init_refused(init_info: Any, mentions: str = "") -> Run:
    def run(probe: Probe) -> str:
        answer = probe.call("POST", "/init_weight_transfer_engine", json_body=init_info)
        return expect_refusal(answer, (400, 422), mentions=mentions)

    return run


def _vllm_init_info(**changes: Any) -> dict[str, Any]:
    """The worker init info of vLLM 0.32 (what its trainer sends), with `changes`."""
    info = {
        "master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2,
        "packed": True, "packed_buffer_size_bytes": 1 << 20, "packed_num_buffers": 2,
    }  # fmt: skip
    return {"init_info": {**info, **changes}}


def _vllm_keys_checked(probe: Probe) -> str:
    answer = probe.call("POST", "/init_weight_transfer_engine",
                        json_body=_vllm_init_info(world_size=1))  # fmt: skip
    detail = expect_refusal(answer, (400, 422), mentions="world_size")
    # A refusal of the keys themselves may list world_size among the keys it knows.
    if any(word in answer.error_message().lower() for word in ("unknown", "unexpected")):
        raise CaseFailed(f"vLLM's init keys refused as unknown: {detail}")
    return detail


def _version_string(probe: Probe) -> str:
    answer = probe.call("POST", "/update_weight_version", json_body={"new_version": "c-2"})
    expect_ok(answer, success=True, new_version="c-2")
    expect_ok(probe.call("GET", "/weight_info"), weight_version="c-2")
    return "{success: true, new_version: 'c-2'}; weight_info 'c-2'"


# weightsync also takes int labels (a trainer's step) and gives them back as ints; vLLM takes
# strings only. Either is sound for a client that sends strings, so either passes.
_INT_LABELS = "vLLM takes string labels only; weightsync also takes ints and gives them back"


def _version_int(probe: Probe) -> str:
    answer = probe.call("POST", "/update_weight_version", json_body={"new_version": 5})
    if answer.status == 200:
        expect_ok(answer, success=True, new_version=5)
        expect_ok(probe.call("GET", "/weight_info"), weight_version=5)
        return "an int label taken, and given back as an int"
    return expect_refusal(answer, (400, 422), mentions="new_version")


def _version_missing(probe: Probe) -> str:
    answer = probe.call("POST", "/update_weight_version", json_body={})
    return expect_refusal(answer, (400, 422), mentions="new_version")


def _weight_info(probe: Probe) -> str:
    version = expect_ok(probe.call("GET", "/weight_info"), weight_version=...)["weight_version"]
    if version is not None and not (isinstance(version, str) or _is_int(version)):
        raise CaseFailed(f"weight_version {version!r} is neither a string, an int nor null")
    return f"weight_version {version!r}"


def _shutdown(probe: Probe) -> str:
    for _ in range(2):
        answer = probe.call("POST", "/shutdown_weight_transfer_engine")
        expect_ok(answer, message="Weight transfer shut down")
    return "answers {message: 'Weight transfer shut down'}, twice"


def _shutdown_during_update(probe: Probe) -> str:
    with _paused(probe), _update(probe):
        return expect_refusal(probe.call("POST", "/shutdown_weight_transfer_engine"), (409,))


def _draft(probe: Probe) -> str:
    answer = probe.call("POST", "/start_draft_weight_update")
    try:
        return expect_refusal(answer, _STATE, mentions="draft")
    finally:
        if answer.status == 200:
            _finish(probe)


def _generation_during_update(probe: Probe) -> str:
    """A request while an update is open: refused, or held until the finish; never a crash."""
    request: Background | None = None
    try:
        with _paused(probe):
            expect_ok(probe.call("POST", "/start_weight_update"), message=_STARTED)
            try:
                probe.call("POST", "/resume")  # a trainer that resumes too early
                request = Background(lambda: probe.completion(prompt=prompt(9), max_tokens=4))
                early = request.wait(_EARLY_S)
            finally:
                _finish(probe)
                probe.call("POST", "/resume")  # where the early resume was refused
            answer = early or request.wait(probe.timeout_s)
        alive = probe.call("GET", "/health")
    except ServerDown as exc:
        seen = request.seen() if request is not None else "nothing"
        raise ServerDown(f"{exc} (the request sent during the update got {seen})") from exc
    if alive.status != 200:
        raise CaseFailed(f"the server broke: {alive.describe()}")
    if answer is None:
        raise CaseFailed(
            f"the request got no answer within {probe.timeout_s:g} s of the finish and resume"
        )
    if answer.status != 200:
        return "refused during the update: " + expect_refusal(answer, (409, 503))
    if early is not None:
        raise CaseFailed("served while the update was open, before its finish")
    return "held until the finish, then answered 200"


CASES = [
    Case(
        "weight_info",
        "weight_info answers {weight_version: string, int or null}",
        _weight_info,
        note="vLLM starts at 'default'; weightsync counts updates (0 at start) until one is labelled",
    ),
    Case(
        "update_weight_version.string",
        "a string label is taken and weight_info shows it",
        _version_string,
    ),
    Case(
        "update_weight_version.int",
        "an int label is a typed 400 naming new_version, or taken and given back as an int",
        _version_int,
        note=_INT_LABELS,
    ),
    Case(
        "update_weight_version.missing", "no new_version is a typed 400 naming it", _version_missing
    ),
    Case(
        "transaction.finish_without_start",
        "a finish with no update open is a typed 409",
        _finish_without_start,
    ),
    Case(
        "transaction.update_without_start",
        "an update message with no transfer engine joined is a typed 400/409",
        _update_without_start,
    ),
    Case(
        "transaction.start_finish",
        "start then finish answer vLLM's bodies, before any init_weight_transfer_engine",
        _start_finish,
    ),
    Case(
        "transaction.start_twice",
        "a second start while one is open is a typed 409 and leaves the first open",
        _start_twice,
    ),
    Case(
        "transaction.finish_version",
        "finish's weight_version becomes weight_info's",
        _finish_with_version,
    ),
    Case(
        "transaction.finish_int_version",
        "an int weight_version is a typed 400 that leaves the update open, or taken as an int",
        _finish_int_version,
        note=_INT_LABELS,
    ),
    Case(
        "transaction.update_mismatched_lengths",
        "names/dtype_names/shapes of different lengths are a typed 400/409",
        _update_refused({"names": ["a", "b"], "dtype_names": ["float32"], "shapes": [[1]]}),
    ),
    Case(
        "transaction.update_unknown_key",
        "an unknown update_info key is a typed 400/409",
        _update_refused({**_UPDATE_INFO, "conformance": 1}),
    ),
    Case(
        "transaction.update_no_group",
        "an update with no transfer engine joined is a typed 400/409",
        _update_refused(_UPDATE_INFO),
    ),
    Case(
        "transaction.update_list_shaped",
        "update_info as a list (one entry per worker rank) is answered as the dict form",
        _update_list_shaped,
    ),
    Case(
        "init.missing_init_info",
        "no init_info is a typed 400 naming it",
        _init_refused({}, "init_info"),
    ),
    Case(
        "init.init_info_not_object",
        "an init_info that is not an object is a typed 400",
        _init_refused({"init_info": [1]}, "init_info"),
    ),
    Case(
        "init.unknown_key",
        "an unknown init_info key is a typed 400 naming it (before any rendezvous)",
        _init_refused(_vllm_init_info(conformance=1), "conformance"),
    ),
    Case(
        "init.vllm_keys_checked",
        "vLLM's init keys are known; a world_size that leaves no "
        "rank for the worker is a typed 400 naming it (before any rendezvous)",
        _vllm_keys_checked,
    ),
    Case(
        "shutdown_weight_transfer_engine",
        "answers vLLM's body, also with nothing to shut",
        _shutdown,
    ),
    Case(
        "shutdown_weight_transfer_engine.during_update",
        "shutting down during an update is a typed 409",
        _shutdown_during_update,
    ),
    Case("start_draft_weight_update", "with no draft model, a typed 400/409 that says so", _draft),
    Case(
        "transaction.generation_during_update",
        "a request while an update is open is "
        "refused or held until the finish; the server survives",
        _generation_during_update,
        kind="hazard",
    ),
]
