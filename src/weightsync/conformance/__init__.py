"""`weightsync conformance URL`: checks any server against vLLM's RL and OpenAI contract.

The contract is vLLM 0.32's, as measured against vLLM itself: its routes, parameters, statuses
and body shapes, the three pause modes with a request in flight, the weight-update
transaction's order rules, the weight checker, sleep and wake up, and the request fields an RL
client sends. Where vLLM is unsound (a 500 for a refusal, a hang, a crash) the contract states
the sound answer, a typed 4xx `{"error": {"message", "type", "param", "code"}}`, so vLLM itself
fails those cases; a case whose rule deliberately differs from vLLM says so in its `note`.

The check needs no trainer and never joins a rendezvous: every init payload it sends is one a
server must refuse before connecting anywhere, and every call has a timeout. Run it against a
server no trainer has joined: its update messages name no real weight, which a sound server
refuses before it receives a byte, but a server with a live transfer group might wait for the
bytes (vLLM's NCCL receive has no timeout). It changes the
server's state while it runs (pauses, sleeps, version labels, which it puts back) and, unless
`keep_weights`, overwrites the served weights at the end (`weight_checker` reset, sleep level
2): run it against a server you can restart. Cases that crashed vLLM 0.32 run last; once a
server stops answering, the cases left are skipped.

```
weightsync conformance http://127.0.0.1:8000
weightsync conformance http://127.0.0.1:8000 --json --keep-weights
```

>>> report = run_conformance("http://127.0.0.1:8000")  # doctest: +SKIP
>>> report.ok, report.counts()  # doctest: +SKIP
(True, {'passed': 80, 'failed': 0, 'skipped': 0})
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from weightsync.conformance import (
    _checker_cases,
    _openai_cases,
    _pause_cases,
    _sleep_cases,
    _update_cases,
)
from weightsync.conformance._case import Case, CaseResult, Outcome
from weightsync.conformance._probe import (
    CaseFailed,
    CaseSkipped,
    Probe,
    ServerDown,
    expect_ok,
    expect_refusal,
)

__all__ = ["CASES", "CaseResult", "ConformanceReport", "run_conformance"]


def _basics(probe: Probe) -> str:
    expect_ok(probe.call("GET", "/is_paused"), is_paused=False)
    worlds = [
        expect_ok(probe.call("GET", "/get_world_size", params=params), world_size=...)["world_size"]
        for params in ({}, {"include_dp": "false"})
    ]
    if not all(isinstance(size, int) and size >= 1 for size in worlds) or worlds[1] > worlds[0]:
        raise CaseFailed(f"world sizes with and without data parallelism: {worlds}")
    return f"is_paused false; world_size {worlds[0]} ({worlds[1]} without data parallelism)"


def _bad_include_dp(probe: Probe) -> str:
    answer = probe.call("GET", "/get_world_size", params={"include_dp": "conformance"})
    return expect_refusal(answer, (400, 422), mentions="include_dp")


def _reset_prefix_cache(probe: Probe) -> str:
    expect_ok(probe.call("POST", "/reset_prefix_cache"), success=True)
    return "{success: true}"


def _admin_key_required(probe: Probe) -> str:
    if not probe.headers("/pause"):
        raise CaseSkipped("no admin API key given")
    return expect_refusal(probe.call("GET", "/is_paused", key=None), (401,))


def _api_key_required(probe: Probe) -> str:
    if not probe.headers("/v1/models"):
        raise CaseSkipped("no API key given")
    return expect_refusal(probe.call("GET", "/v1/models", key=None), (401,))


_BASICS = [
    Case(
        "routes.basics",
        "is_paused and get_world_size (with and without include_dp) answer vLLM's bodies",
        _basics,
    ),
    Case(
        "get_world_size.bad_include_dp", "a non-boolean include_dp is a typed 400", _bad_include_dp
    ),
    Case("reset_prefix_cache", "answers {success: true} on an idle server", _reset_prefix_cache),
    Case(
        "auth.admin_key_required",
        "the RL routes refuse a call without the admin key (401)",
        _admin_key_required,
    ),
    Case(
        "auth.api_key_required",
        "the /v1 routes refuse a call without the API key (401)",
        _api_key_required,
    ),
]

CASES: tuple[Case, ...] = (
    *_BASICS,
    *_pause_cases.CASES,
    *_update_cases.CASES,
    *_checker_cases.CASES,
    *_sleep_cases.CASES,
    *_openai_cases.CASES,
)
"""Every case, in the order they run within their kind (safe, then destructive, then hazard)."""


@dataclass(frozen=True)
class ConformanceReport:
    """What one run of the check found.

    Attributes:
        url: The server's base URL.
        server: What the server said of itself: `model` (from `/v1/models`), `version` (from
            `/version`, where it has one) and the `weight_version` it started with.
        cases: One result per case, in the order they ran.
    """

    url: str
    server: dict[str, Any] = field(default_factory=dict)
    cases: tuple[CaseResult, ...] = ()

    @property
    def ok(self) -> bool:
        """Whether no case failed (skipped cases do not count)."""
        return not any(result.outcome == "failed" for result in self.cases)

    def counts(self) -> dict[Outcome, int]:
        """`{"passed": n, "failed": n, "skipped": n}`."""
        outcomes: tuple[Outcome, ...] = ("passed", "failed", "skipped")
        return {o: sum(r.outcome == o for r in self.cases) for o in outcomes}

    def to_dict(self) -> dict[str, Any]:
        """The report as one JSON-ready object (what `--json` prints)."""
        return {
            "url": self.url,
            "server": self.server,
            "summary": {**self.counts(), "total": len(self.cases)},
            "cases": [asdict(result) for result in self.cases],
        }

    def table(self, *, width: int = 110) -> str:
        """The report as a table: one row per case (name, outcome, a short detail), then a count.

        Args:
            width: The longest line, in characters; longer details are cut.
        """
        name_width = max([len("case"), *(len(result.name) for result in self.cases)])
        lines = [f"{'case':<{name_width}}  {'result':<7}  detail"]
        for result in self.cases:
            row = f"{result.name:<{name_width}}  {result.outcome:<7}  {' '.join(result.detail.split())}"
            lines.append(row if len(row) <= width else row[: width - 3] + "...")
        counts = self.counts()
        lines.append(
            f"{len(self.cases)} cases: {counts['passed']} passed, {counts['failed']} failed, "
            f"{counts['skipped']} skipped ({self.url})"
        )
        return "\n".join(lines)


def run_conformance(
    url: str,
    *,
    api_key: str | None = None,
    admin_api_key: str | None = None,
    timeout_s: float = 30.0,
    keep_weights: bool = False,
    cases: Sequence[Case] = CASES,
    transport: httpx.BaseTransport | None = None,
) -> ConformanceReport:
    """Runs the contract's cases against the server at `url`.

    Args:
        url: The server's base URL (`http://127.0.0.1:8000`).
        api_key: Sent as a bearer token on the `/v1` routes.
        admin_api_key: Sent as a bearer token on the RL routes.
        timeout_s: The bound of each call, in seconds (a streamed request: of each read).
        keep_weights: Skip the cases that overwrite the served weights.
        cases: The cases to run (default: all of them).
        transport: An httpx transport to reach the server by (default: the network).

    Returns:
        The report. Its `ok` is False when a case failed; a server that cannot be reached
        fails the first case, `server.reachable`, and the others are skipped.

    Raises:
        ValueError: `timeout_s` is not positive.
    """
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    probe = Probe(url, api_key=api_key, admin_api_key=admin_api_key, timeout_s=timeout_s,
                  transport=transport)  # fmt: skip
    try:
        return _run(probe, cases, keep_weights)
    finally:
        probe.close()


def _run(probe: Probe, cases: Sequence[Case], keep_weights: bool) -> ConformanceReport:
    ordered = sorted(cases, key=lambda case: ("safe", "destructive", "hazard").index(case.kind))
    try:
        server = _discover(probe)
    except (ServerDown, CaseFailed) as exc:
        reason = f"server.reachable failed: {exc}"
        unreachable = CaseResult("server.reachable", "failed", str(exc),
                                 "GET /health answers 200 and /v1/models names a model")  # fmt: skip
        skipped = [CaseResult(c.name, "skipped", reason, c.expect, c.note) for c in ordered]
        return ConformanceReport(probe.url, {}, (unreachable, *skipped))
    not_ready = _not_ready(probe)
    if not_ready is not None:
        # Every case would fail on the state the server started in: report that, not them.
        reason = f"server.ready failed: {not_ready}"
        unready = CaseResult("server.ready", "failed", not_ready,
                             "the server is not paused, not asleep, and its weights are whole")  # fmt: skip
        skipped = [CaseResult(c.name, "skipped", reason, c.expect, c.note) for c in ordered]
        return ConformanceReport(probe.url, server, (unready, *skipped))
    results: list[CaseResult] = []
    down: str | None = None
    for case in ordered:
        if down is not None:
            results.append(CaseResult(case.name, "skipped",
                                      f"the server stopped answering during {down}", case.expect,
                                      case.note))  # fmt: skip
            continue
        if case.kind == "destructive" and keep_weights:
            results.append(CaseResult(case.name, "skipped", "overwrites the served weights "
                                      "(keep_weights)", case.expect, case.note))  # fmt: skip
            continue
        outcome: Outcome
        try:
            outcome, detail = "passed", case.run(probe)
        except CaseFailed as exc:
            outcome, detail = "failed", str(exc)
        except CaseSkipped as exc:
            outcome, detail = "skipped", str(exc)
        except ServerDown as exc:
            outcome, detail, down = "failed", f"the server stopped answering: {exc}", case.name
        results.append(CaseResult(case.name, outcome, detail, case.expect, case.note))
    if down is None:
        _restore_version(probe, server.get("weight_version"))
    return ConformanceReport(probe.url, server, tuple(results))


def _discover(probe: Probe) -> dict[str, Any]:
    """Checks that the server answers and learns its model (every /v1 request names it)."""
    health = probe.call("GET", "/health")
    if health.status != 200:
        raise CaseFailed(f"expected 200, got {health.describe()}")
    models = probe.call("GET", "/v1/models")
    data = models.body.get("data") if isinstance(models.body, dict) else None
    if models.status != 200 or not data or not isinstance(data[0].get("id"), str):
        raise CaseFailed(f"expected a model in /v1/models, got {models.describe()}")
    probe.model = data[0]["id"]
    server: dict[str, Any] = {"model": probe.model}
    version = probe.call("GET", "/version")
    if version.status == 200 and isinstance(version.body, dict):
        server["version"] = version.body.get("version")
    info = probe.call("GET", "/weight_info")
    if info.status == 200 and isinstance(info.body, dict):
        server["weight_version"] = info.body.get("weight_version")
    return server


def _not_ready(probe: Probe) -> str | None:
    """Why the server cannot be checked as it stands (paused, asleep, torn), or None.

    The cases need a running server. A paused one is asked, without changing it, whether its
    weights are torn: a sound server refuses `/weight_checker` on torn weights and names the
    cause (a failed update, or a level-2 sleep such as an earlier run of this check ends with).
    """
    paused = probe.call("GET", "/is_paused")
    if not (
        paused.status == 200 and isinstance(paused.body, dict) and paused.body.get("is_paused")
    ):
        return None
    causes = ["the server is paused"]
    sleeping = probe.call("GET", "/is_sleeping")
    if (
        sleeping.status == 200
        and isinstance(sleeping.body, dict)
        and sleeping.body.get("is_sleeping")
    ):
        causes.append("asleep")
    checked = probe.call("POST", "/weight_checker", json_body={"action": "checksum"})
    error = checked.body.get("error") if isinstance(checked.body, dict) else None
    torn = isinstance(error, dict) and error.get("type") == "TornWeightsError"
    if torn:
        causes.append(f"its weights are torn ({checked.error_message()})")
    if torn:
        remedy = "restart it (or land an update of every weight, then POST /resume)"
    elif len(causes) > 1:
        remedy = "POST /wake_up"
    else:
        remedy = "POST /resume"
    return (
        f"{' and '.join(causes)} at the start, so every case would fail on that state rather "
        f"than on the contract: {remedy}, then run the check again"
    )


def _restore_version(probe: Probe, version: Any) -> None:
    """Puts back the version label the server started with (the cases relabel it)."""
    if version is not None:
        probe.call("POST", "/update_weight_version", json_body={"new_version": version})
