"""One conformance case (what it checks, how it runs) and its result."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from weightsync.conformance._probe import Probe

Outcome = Literal["passed", "failed", "skipped"]
Kind = Literal["safe", "destructive", "hazard"]
Run = Callable[[Probe], str]
"""What runs a case: returns a detail (passed) or raises `CaseFailed` / `CaseSkipped`."""


@dataclass(frozen=True)
class Case:
    """A case of the contract: its name, the rule in one sentence, and what checks it."""

    name: str  # route or area first: `pause.in_flight.keep`
    expect: str
    run: Run
    # destructive: overwrites the served weights (skipped with keep_weights); hazard: crashed
    # vLLM 0.32, so it runs last
    kind: Kind = "safe"
    note: str = ""  # a documented difference from vLLM 0.32, if the case has one


@dataclass(frozen=True)
class CaseResult:
    """The outcome of one case.

    Attributes:
        name: The case's name.
        outcome: `passed`, `failed` or `skipped`.
        detail: What was seen (the answer that broke the contract, or why it was skipped).
        expect: The contract the case checks.
        note: The case's documented difference from vLLM 0.32, if any.
    """

    name: str
    outcome: Outcome
    detail: str
    expect: str
    note: str = ""
