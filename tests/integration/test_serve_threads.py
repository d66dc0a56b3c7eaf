"""How many threads `weightsync serve` computes on: every core other processes leave free, unless told."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from serve_support import Server

from weightsync.engine._cores import ComputeThreads, read_ticks, usable_cores

TICKS = 100  # clock ticks per second on Linux (SC_CLK_TCK)


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ((), f"computing on up to {len(usable_cores())} threads ({len(usable_cores())} cores)"),
        (("--num-threads", "1"), f"computing on 1 threads ({len(usable_cores())} cores)"),
    ],
    ids=["default", "one"],
)
def test_the_forward_pass_computes_on_every_free_core_unless_told(options, expected):
    server = Server("debug", "--port", "0", *options, log_level="info")
    try:
        assert expected in server.output
    finally:
        assert server.stop() == 0


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads Linux's /proc")
def test_a_process_spinning_on_the_cores_is_seen_as_other_work():
    cores = ComputeThreads().cores
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        first, start = read_ticks(cores), time.monotonic()
        assert first is not None
        # Until the spinner has used a second of CPU (bounded): its ticks are on the cores and
        # not this process's.
        others = 0.0
        while others < 1.0 * TICKS and time.monotonic() - start < 30:
            time.sleep(0.1)
            now = read_ticks(cores)
            assert now is not None and now[0] >= first[0] and now[1] >= first[1]
            others = (now[0] - first[0]) - (now[1] - first[1])
        assert others >= 1.0 * TICKS, "a spinning process's CPU time was not counted"
    finally:
        spinner.kill()
        spinner.wait(10)
