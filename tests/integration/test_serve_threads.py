"""How many threads `weightsync serve` computes on: every core it may run on but one, unless told."""

from __future__ import annotations

import os

import pytest
from serve_support import Server


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@pytest.mark.parametrize(
    ("options", "expected"),
    [((), max(1, _cores() - 1)), (("--num-threads", "1"), 1)],
    ids=["default", "one"],
)
def test_the_forward_pass_computes_on_every_core_but_one_unless_told(options, expected):
    server = Server("debug", "--port", "0", *options, log_level="info")
    try:
        assert f"computing on {expected} threads ({_cores()} cores)" in server.output
    finally:
        assert server.stop() == 0
