"""`benchmarks/bench_vs_vllm.py` end to end, with two weightsync servers in place of vLLM.

vLLM is never installed by CI; the script is run here with `weightsync serve` on both sides
and the engine in process, on a tiny model, one round at two stream counts: everything it
measures comes back, and the two servers' greedy tokens agree.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from model_dirs import write_model_dir

ROOT = Path(__file__).resolve().parents[2]
SIDES = ("weightsync-a", "weightsync", "inprocess")


def test_bench_vs_vllm_runs_with_two_weightsync_servers(tmp_path):
    model = write_model_dir(tmp_path / "model", "llama3")
    done = subprocess.run(
        [sys.executable, "bench_vs_vllm.py", "--json", "--model-dir", str(model),
         "--label-a", "weightsync-a",
         "--start-a", "{python} -m weightsync.serve.cli serve {model} --port {port}",
         "--rounds", "1", "--streams", "1,8", "--max-tokens", "8",
         "--compare-prompts", "2", "--compare-tokens", "8", "--roofline-mib", "32"],
        cwd=ROOT / "benchmarks", env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["streams"] == [1, 8] and set(result["by_streams"]) == {"1", "8"}
    for count, figures in result["by_streams"].items():
        assert set(figures["tokens_per_s"]) == set(SIDES), count
        assert all(figures["tokens_per_s"][side]["median"] > 0 for side in SIDES)
        assert len(figures["ratio_b_over_a"]["rounds"]) == 1
        assert len(figures["ratio_b_over_inprocess"]["rounds"]) == 1
        # The HTTP client's own work is counted for each served burst (it parses every chunk).
        assert all(figures["client_cores"][side]["median"] > 0 for side in SIDES[:2]), count
        ceiling = figures["roofline_tokens_per_s"]
        assert ceiling["overlapped_tokens_per_s"] >= ceiling["serial_tokens_per_s"] > 0
    assert result["start_order"] == ["weightsync", "weightsync-a"]  # B first, as documented
    for label in SIDES[:2]:
        server = result["servers"][label]
        assert server["startup_s"] > 0 and server["version"], server
        assert server["tokens_per_cpu_s"] is not None, server  # its CPU time was counted
    assert result["inprocess"]["startup_s"] > 0
    assert result["inprocess"]["tokens_per_cpu_s"] is not None
    (machine_round,) = result["round_machine"]
    assert set(machine_round["cpu_s"]) == set(SIDES)
    assert "load_average_1min_start" in machine_round and "other_cores" in machine_round
    assert 0 < machine_round["settle_s"] <= 6 * 5.5  # six bursts, each settled within 5 s
    rates = result["roofline_rates"]["used"]
    assert rates["read_gb_s"] > 0 and rates["matmul_gflop_s"] > 0
    for mode in ("one_at_a_time", "all_at_once"):
        agreed = result["greedy"][mode]
        assert agreed["identical_tokens"] == agreed["total_tokens"] == 16, agreed
