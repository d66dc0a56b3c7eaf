"""The soak benchmark, short: streaming clients through a few pause / update / resume cycles.

`benchmarks/soak.py` (see its docstring for what each figure counts) runs here with a few
cycles and clients, once with each trainer backend; nothing may be lost, duplicated, out of
order or left behind.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ZEROS = ("requests_lost", "tokens_lost", "tokens_duplicated", "versions_non_monotonic",
         "fds_left", "segments_left")  # fmt: skip


@pytest.mark.reliability("soak")
@pytest.mark.parametrize("backend", ["ipc", "gloo"])
def test_a_short_soak_loses_nothing(backend, record_property):
    """A short soak: 8 clients streaming through 8 cycles of random pause modes; zeros."""
    done = subprocess.run(
        [sys.executable, "soak.py", "--json", "--cycles", "8", "--clients", "8",
         "--backend", backend, "--seed", "1"],
        cwd=ROOT / "benchmarks", env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["cycles"] == 8 and result["requests"] > 0
    assert {key: result[key] for key in ZEROS} == dict.fromkeys(ZEROS, 0), result
    for key in (*ZEROS, "requests", "requests_aborted", "rss_growth", "cycles"):
        record_property(key, result[key])
