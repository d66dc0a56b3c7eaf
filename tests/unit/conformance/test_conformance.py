"""The conformance check against a fake server: every case passes on sound answers, and each of
vLLM 0.32's measured unsound answers fails exactly the cases it breaks."""

from __future__ import annotations

import argparse
import json
import re

import httpx
import pytest
from fake_server import FakeServer

from weightsync.conformance import (
    CASES,
    ConformanceReport,
    _pause_cases,
    _sleep_cases,
    _update_cases,
    run_conformance,
)
from weightsync.conformance._case import CaseResult
from weightsync.conformance._command import run_command
from weightsync.conformance._probe import Answer, CaseFailed, expect_refusal
from weightsync.serve._parser import build_parser

URL = "http://fake"
AUTH_CASES = {"auth.admin_key_required", "auth.api_key_required"}


@pytest.fixture(autouse=True)
def _short_watches(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check watches a frozen stream for a second; a fraction does against the fake."""
    monkeypatch.setattr(_pause_cases, "_WATCH_S", 0.2)
    monkeypatch.setattr(_pause_cases, "_SETTLE_S", 0.05)
    monkeypatch.setattr(_update_cases, "_EARLY_S", 0.2)
    monkeypatch.setattr(_sleep_cases, "_REFUSE_WITHIN_S", 0.3)


def run(server: FakeServer, **options: object) -> ConformanceReport:
    options.setdefault("timeout_s", 5.0)
    return run_conformance(URL, transport=server.transport(), **options)  # type: ignore[arg-type]


def outcomes(report: ConformanceReport) -> dict[str, str]:
    return {result.name: result.outcome for result in report.cases}


def failed(report: ConformanceReport) -> dict[str, str]:
    return {r.name: r.detail for r in report.cases if r.outcome == "failed"}


def test_a_sound_server_passes_every_case_and_every_call_is_bounded():
    server = FakeServer()
    report = run(server)
    assert failed(report) == {}
    assert report.ok
    skipped = {r.name for r in report.cases if r.outcome == "skipped"}
    assert skipped == AUTH_CASES  # no keys given
    assert len(report.cases) == len(CASES)
    assert server.untimed_requests == []
    assert report.server == {"model": "fake-model", "version": "fake", "weight_version": "default"}


def test_the_version_label_the_server_started_with_is_put_back():
    server = FakeServer()
    run(server)
    assert server._version == "default"


def test_with_keys_the_auth_cases_run_and_every_call_carries_its_key():
    server = FakeServer(api_key="user-key", admin_api_key="admin-key")
    report = run(server, api_key="user-key", admin_api_key="admin-key")
    assert failed(report) == {}
    assert {name: outcomes(report)[name] for name in AUTH_CASES} == dict.fromkeys(
        AUTH_CASES, "passed"
    )


def test_a_wrong_admin_key_fails_the_rl_cases():
    report = run(FakeServer(admin_api_key="admin-key"), admin_api_key="wrong")
    assert "401" in failed(report)["pause.idle_cycle"]


def test_500s_for_refusals_fail_the_cases_that_expect_a_typed_refusal():
    report = run(FakeServer(errors_500=True))
    assert set(failed(report)) == {
        "init.unknown_key",
        "init.vllm_keys_checked",
        "shutdown_weight_transfer_engine.during_update",
        "sleep.generation_while_asleep",
        "sleep.update_while_asleep",
        "start_draft_weight_update",
        "transaction.finish_without_start",
        "transaction.start_twice",
        "transaction.update_list_shaped",
        "transaction.update_mismatched_lengths",
        "transaction.update_no_group",
        "transaction.update_unknown_key",
        "transaction.update_without_start",
    }
    assert (
        "got POST /finish_weight_update -> 500"
        in failed(report)["transaction.finish_without_start"]
    )


@pytest.mark.parametrize(
    ("ignore", "detail"), [(True, "ignored, as vLLM ignores it"), (False, "refused: ")]
)
def test_an_unknown_field_passes_ignored_as_vllm_does_or_refused_by_name(ignore, detail):
    report = run(FakeServer(ignore_unknown_fields=ignore))
    assert not failed(report)
    result = {r.name: r for r in report.cases}["completions.unknown_field"]
    assert result.outcome == "passed" and result.detail.startswith(detail)


def test_abort_by_id_that_aborts_nothing_fails_by_id_and_unknown_id():
    report = run(FakeServer(abort_by_id_is_noop=True))
    assert set(failed(report)) == {"abort_requests.by_id", "abort_requests.unknown_id"}
    assert "the stream ran on" in failed(report)["abort_requests.by_id"]


def test_refusing_vllms_init_keys_as_unknown_fails_even_when_the_message_lists_world_size():
    weightsync_keys = frozenset({"backend", "bucket_size_bytes", "master_address", "master_port",
                                 "num_buffers", "packed", "rank_offset", "timeout_s", "world_size"})  # fmt: skip
    report = run(FakeServer(known_init_keys=weightsync_keys))
    assert set(failed(report)) == {"init.vllm_keys_checked"}
    assert failed(report)["init.vllm_keys_checked"].startswith("vLLM's init keys refused")


def test_a_request_queued_while_asleep_fails_within_the_bound():
    report = run(FakeServer(sleep_queues_requests=True))
    assert failed(report) == {
        "sleep.generation_while_asleep": "no answer within 0.3 s (the request waits for a wake_up)"
    }


def test_digests_of_empty_weights_fail_the_coverage_case():
    report = run(FakeServer(empty_digests=True))
    assert set(failed(report)) == {"weight_checker.checksums_cover_bytes"}
    assert (
        "2 of 4 digests are of zero bytes" in failed(report)["weight_checker.checksums_cover_bytes"]
    )


def test_the_deprecated_wait_flag_passes_as_abort_or_wait_and_says_which():
    for means_abort, word in ((True, "an abort pause"), (False, "a wait pause")):
        report = run(FakeServer(wait_flag_means_abort=means_abort))
        result = next(r for r in report.cases if r.name.endswith("wait_for_inflight_requests"))
        assert (result.outcome, result.detail.startswith(word)) == ("passed", True)


def test_streamed_text_with_a_line_separator_is_read_whole():
    """vLLM streams U+2028 unescaped; splitting lines as str.splitlines does cut the JSON."""
    assert failed(run(FakeServer(raw_line_separators=True))) == {}


def test_a_crash_fails_its_case_and_skips_every_later_one():
    report = run(FakeServer(crash_on="/sleep"))
    names = [r.name for r in report.cases]
    crashed = names.index("sleep.level1_cycle")
    assert failed(report)["sleep.level1_cycle"].startswith("the server stopped answering")
    assert all(r.outcome == "passed" for r in report.cases[:crashed] if r.name not in AUTH_CASES)
    assert {r.outcome for r in report.cases[crashed + 1 :]} == {"skipped"}
    assert report.cases[-1].detail == "the server stopped answering during sleep.level1_cycle"


def test_a_crash_on_generation_during_an_update_fails_the_hazard_case_which_runs_last():
    report = run(FakeServer(crash_on="generation during update"))
    assert report.cases[-1].name == "transaction.generation_during_update"
    assert set(failed(report)) == {"transaction.generation_during_update"}


def test_a_route_that_never_answers_fails_at_the_timeout():
    report = run(FakeServer(hang_on="/is_sleeping"), timeout_s=0.2)
    assert failed(report)["sleep.is_sleeping"] == (
        "expected 200, got GET /is_sleeping -> no answer (ReadTimeout after 0.2 s)"
    )


def test_keep_weights_skips_the_cases_that_overwrite_weights():
    server = FakeServer()
    report = run(server, keep_weights=True)
    skipped = {r.name for r in report.cases if r.outcome == "skipped"} - AUTH_CASES
    assert skipped == {"weight_checker.reset_cycle", "sleep.level2_cycle"}
    assert set(server._weights.values()) != {bytes(8)}  # never reset


def test_an_unreachable_server_fails_one_case_and_skips_the_rest():
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    report = run_conformance(URL, transport=httpx.MockTransport(refuse))
    assert report.cases[0].name == "server.reachable" and not report.ok
    assert [r.outcome for r in report.cases[1:]] == ["skipped"] * len(CASES)


def test_timeout_must_be_positive():
    with pytest.raises(ValueError, match="timeout_s must be positive, got 0"):
        run_conformance(URL, timeout_s=0)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"error": "Bad"}, "untyped error body"),
        ({"detail": "Not Found"}, "untyped error body"),
        ({"error": {"message": "m", "type": "T", "param": None, "code": 500}}, "lacks"),
        ({"error": {"message": "m", "type": "T", "code": 400}}, "lacks ['param']"),
        ({"error": {"message": "m", "type": "T", "param": None, "code": 400}}, "does not name"),
    ],
)
def test_a_refusal_must_be_typed_and_name_what_it_refuses(body: object, message: str):
    answer = Answer("POST", "/pause", 400, body, None, 0.0)
    with pytest.raises(CaseFailed, match=re.escape(message)):
        expect_refusal(answer, (400,), mentions="mode")


def test_a_typed_refusal_naming_the_field_passes():
    body = {
        "error": {"message": "bad", "type": "InvalidRequestError", "param": "mode", "code": 400}
    }
    answer = Answer("POST", "/pause", 400, body, None, 0.0)
    assert expect_refusal(answer, (400,), mentions="mode") == "400 InvalidRequestError: bad"


def _report(*outcomes: str) -> ConformanceReport:
    cases = tuple(
        CaseResult(f"case.{i}", o, f"detail {i}", "expect") for i, o in enumerate(outcomes)
    )  # type: ignore[arg-type]
    return ConformanceReport(URL, {"model": "m"}, cases)


def test_the_table_has_a_row_per_case_and_a_count():
    table = _report("passed", "failed", "skipped").table().splitlines()
    assert table[0].split() == ["case", "result", "detail"]
    assert [line.split()[:2] for line in table[1:4]] == [
        ["case.0", "passed"], ["case.1", "failed"], ["case.2", "skipped"]
    ]  # fmt: skip
    assert table[4] == f"3 cases: 1 passed, 1 failed, 1 skipped ({URL})"


def test_the_json_report_counts_outcomes():
    data = json.loads(json.dumps(_report("passed", "failed").to_dict()))
    assert data["summary"] == {"passed": 1, "failed": 1, "skipped": 0, "total": 2}
    assert data["cases"][1] == {"name": "case.1", "outcome": "failed", "detail": "detail 1",
                                "expect": "expect", "note": ""}  # fmt: skip


def test_the_command_line_takes_the_check_options():
    args = build_parser().parse_args(
        ["conformance", URL, "--json", "--timeout-s", "2.5", "--keep-weights", "--api-key", "k"]
    )
    assert (args.command, args.url, args.json, args.timeout_s, args.keep_weights, args.api_key) == (
        "conformance", URL, True, 2.5, True, "k"
    )  # fmt: skip


@pytest.mark.parametrize("value", ["0", "-1", "inf", "soon"])
def test_the_command_line_refuses_a_timeout_that_is_not_a_positive_number(value: str):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["conformance", URL, "--timeout-s", value])
    assert exc.value.code == 2


@pytest.mark.parametrize(("outcome", "status"), [("passed", 0), ("failed", 1), ("skipped", 0)])
def test_the_command_exits_non_zero_only_when_a_case_failed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], outcome: str, status: int
):
    monkeypatch.setattr(
        "weightsync.conformance._command.run_conformance", lambda *a, **k: _report(outcome)
    )
    args = argparse.Namespace(url=URL, json=True, api_key=None, admin_api_key=None,
                              timeout_s=1.0, keep_weights=False)  # fmt: skip
    assert run_command(args) == status
    assert json.loads(capsys.readouterr().out)["cases"][0]["outcome"] == outcome
