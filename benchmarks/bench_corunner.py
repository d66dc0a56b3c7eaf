"""A decode step beside a small co-runner: what a process that wakes up now and then costs.

    python benchmarks/bench_corunner.py --json
    python benchmarks/bench_corunner.py --threads 1 2 --busy-ms 1 --idle-ms 4.3 --rounds 7 --json

Served over HTTP, a burst runs beside its client, which wakes up for every streamed chunk. This
measures what such a neighbour costs the engine, without HTTP: the engine of `weightsync serve`
(the 27M Llama of `model_dir.py --kind llama-27m`, written to a temporary directory unless
`--model-dir` names one) decodes `--streams` greedy requests in process, and a step is timed
(the median of `--steps` steps, after the prompts are in) alone and beside a co-runner: a process
that spins for `--busy-ms` and sleeps for `--idle-ms`, over and over (by default about a fifth
of a core in 1 ms slices, like an HTTP client reading chunks). Each round times both, the order
alternating, for each of `--threads` compute thread counts; `slowdown_paired` is the median of
the per-round ratios (beside / alone). The co-runner's own CPU share is recorded. The last line
is one JSON object.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from machine import describe_machine  # benchmarks/machine.py, beside this script
from weightsync import LLMEngine, SamplingParams

SPIN = """
import sys, time
busy, idle = float(sys.argv[1]) / 1000, float(sys.argv[2]) / 1000
while True:
    began = time.perf_counter()
    while time.perf_counter() - began < busy:
        pass
    time.sleep(idle)
"""
_request_ids = itertools.count()


def step_ms(engine: LLMEngine, streams: int, steps: int, seed: int) -> float:
    """Median milliseconds of a decode step with `streams` requests running."""
    params = SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True)
    for index in range(streams):
        prompt = [(seed * 7919 + index * 104729 + k * 31) % 8000 + 10 for k in range(32)]
        engine.add_request(str(next(_request_ids)), prompt, params)
    engine.step()  # the prefill
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - began)
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(times) * 1000


def beside_corunner(args: argparse.Namespace, measure: Callable[[], float]) -> tuple[float, float]:
    """`measure()` while the co-runner runs; returns its result and the co-runner's cores."""
    corunner = subprocess.Popen([sys.executable, "-c", SPIN, str(args.busy_ms), str(args.idle_ms)])
    try:
        began = time.perf_counter()
        result = measure()
        seconds = time.perf_counter() - began
        with open(f"/proc/{corunner.pid}/stat") as stat:
            fields = stat.read().rpartition(")")[2].split()
        cores = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK") / seconds
    finally:
        corunner.kill()
        corunner.wait()
    return result, cores


def main() -> None:
    """Runs the comparison and prints it (a table, or one JSON object with `--json`)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40, help="decode steps timed per run")
    parser.add_argument("--busy-ms", type=float, default=1.0)
    parser.add_argument("--idle-ms", type=float, default=4.3)
    parser.add_argument("--rounds", type=int, default=7, help="paired rounds (median over them)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = args.model_dir or Path(scratch) / "model"
        if not (model_dir / "config.json").is_file():
            from model_dir import write_llama_27m  # benchmarks/model_dir.py: tests/ helpers

            write_llama_27m(model_dir)
        engine = LLMEngine(str(model_dir))
        load_before = os.getloadavg()
        results = {}
        for threads in args.threads:
            torch.set_num_threads(threads)
            step_ms(engine, args.streams, 4, seed=-1)  # warm-up
            alone, beside, cores = [], [], []
            for round_index in range(args.rounds):

                def measure(seed: int = round_index) -> float:
                    return step_ms(engine, args.streams, args.steps, seed)

                if round_index % 2:
                    ms, share = beside_corunner(args, measure)
                    alone.append(measure())
                else:
                    alone.append(measure())
                    ms, share = beside_corunner(args, measure)
                beside.append(ms)
                cores.append(share)
            results[str(threads)] = {
                "alone_step_ms": round(statistics.median(alone), 2),
                "beside_step_ms": round(statistics.median(beside), 2),
                "slowdown_paired": round(
                    statistics.median(b / a for a, b in zip(alone, beside, strict=True)), 3
                ),
                "corunner_cores": round(statistics.median(cores), 3),
            }
    report = {
        "benchmark": "corunner",
        "command": "python benchmarks/bench_corunner.py --threads "
        + " ".join(map(str, args.threads))
        + f" --streams {args.streams} --steps {args.steps} --busy-ms {args.busy_ms}"
        f" --idle-ms {args.idle_ms} --rounds {args.rounds} --json",
        "machine": describe_machine(),
        "load_average_before": [round(v, 2) for v in load_before],
        "load_average_after": [round(v, 2) for v in os.getloadavg()],
        "by_threads": results,
    }
    if args.json:
        print(json.dumps(report))
        return
    for threads, row in results.items():
        print(f"{threads} threads: alone {row['alone_step_ms']} ms, beside "
              f"{row['beside_step_ms']} ms (x{row['slowdown_paired']}), co-runner "
              f"{row['corunner_cores']} cores")  # fmt: skip


if __name__ == "__main__":
    main()
