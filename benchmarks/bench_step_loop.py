"""Served over HTTP against the engine stepped in process: what serving costs the step loop.

    python benchmarks/bench_step_loop.py --json
    python benchmarks/bench_step_loop.py --model tiny --streams 8 64
        --a-src OLD_CHECKOUT/src --a-label before --b-label after --json

(the second command is one line).

Each round runs, in each of their orders in turn (`bench_vs_vllm.round_order`):

- `inprocess`: the requests added to an `LLMEngine` in this process and stepped back to back,
  with no event loop and no HTTP: the ceiling of what a server of this engine can stream.
- `a`, `b`: the same requests (greedy, `ignore_eos`, `--max-tokens` each, all sent at once) as
  streamed `/v1/completions` to two `weightsync serve` children. Each server's code comes from
  `--a-src` / `--b-src` (default: this checkout's), with `--a-threads` / `--b-threads` torch
  threads (`default`: the server picks). So one run compares two versions of the server, or
  two thread counts, against the same in-process figure, on the same load. `b` starts first:
  a server started second came out ahead of an identical one (see `bench_vs_vllm.py`).

Prompts differ in every round (no prefix cache helps). Figures per stream count: tokens per
second, medians over `--rounds` rounds after one warm-up round; `ratio_<x>` is the median over
rounds of served / in-process within the round, and `ratio_b_over_a` the median of b / a
within the round, so drift in the machine's load falls on both sides. Each server's CPU
seconds per second of its runs (`cores_<x>`; `cores_inprocess`: this process's while it steps)
and the load average of each round are recorded:
on a shared machine, compare ratios within one run. The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench_serve import _stream_one, process_cpu_s  # beside this script
from bench_vs_vllm import round_order
from machine import describe_machine
from weightsync import EngineConfig, LLMEngine, SamplingParams
from weightsync.serve.cli import _large_tensors_on_huge_pages

SRC = Path(__file__).resolve().parents[1] / "src"


def bodies(round_index: int, streams: int, max_tokens: int) -> list[dict[str, Any]]:
    """One greedy request per stream; the round's number makes every prompt new."""
    return [
        {"prompt": f"round {round_index} request {i}: the weights", "max_tokens": max_tokens,
         "temperature": 0.0, "ignore_eos": True}
        for i in range(streams)
    ]  # fmt: skip


def start_server(model: str, src: Path, threads: str, max_num_seqs: int) -> tuple[Any, str]:
    """A `weightsync serve` child running the code under `src`; returns (process, url)."""
    command = [sys.executable, "-m", "weightsync.serve.cli", "serve", model, "--port", "0",
               "--max-num-seqs", str(max_num_seqs), "--log-level", "warning"]  # fmt: skip
    if threads != "default":
        command += ["--num-threads", threads]
    env = {**os.environ, "PYTHONPATH": str(src)}
    server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
    assert server.stderr is not None
    for line in server.stderr:
        if match := re.search(r"listening on (http://\S+)", line):
            return server, match.group(1)
    raise RuntimeError(f"weightsync serve from {src} did not start")


def http_run(url: str, requests: list[dict[str, Any]]) -> tuple[int, float]:
    """Streams every request at once; returns (completion tokens, seconds)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)

    async def run() -> list[int]:
        return list(await asyncio.gather(*(_stream_one(host, int(port), b) for b in requests)))

    start = time.perf_counter()
    counts = asyncio.run(run())
    return sum(counts), time.perf_counter() - start


def inprocess_run(engine: LLMEngine, requests: list[dict[str, Any]]) -> tuple[int, float]:
    """Adds every request and steps until all are finished; returns (tokens, seconds)."""
    start = time.perf_counter()
    for index, body in enumerate(requests):
        params = SamplingParams(temperature=0.0, max_tokens=body["max_tokens"], ignore_eos=True)
        engine.add_request(f"{body['prompt']}#{index}", body["prompt"], params)
    tokens, left = 0, len(requests)
    while left:
        for output in engine.step():
            if output.finished:
                tokens += len(output.outputs[0].token_ids)
                left -= 1
    return tokens, time.perf_counter() - start


def main() -> None:
    _large_tensors_on_huge_pages()  # the engine in process as `weightsync serve` runs it
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="small", help="preset or directory (default: small)")
    parser.add_argument("--streams", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=12, help="each order of the three twice")
    parser.add_argument("--inprocess-threads", type=int, default=1)
    for side in ("a", "b"):
        parser.add_argument(f"--{side}-src", type=Path, default=SRC)
        parser.add_argument(f"--{side}-threads", default="1", help="number, or `default`")
        parser.add_argument(f"--{side}-label", default=side)
    parser.add_argument("--json", action="store_true", help="print only the JSON result line")
    args = parser.parse_args()
    torch.set_num_threads(args.inprocess_threads)
    most = max(args.streams)
    engine = LLMEngine(args.model, engine_config=EngineConfig(max_num_seqs=most))
    servers = {  # b first: the server started second gains (bench_vs_vllm's docstring)
        side: start_server(
            args.model, getattr(args, f"{side}_src"), getattr(args, f"{side}_threads"), most
        )
        for side in ("b", "a")
    }
    results: dict[str, Any] = {}
    try:
        for streams in args.streams:
            rates: dict[str, list[float]] = {"inprocess": [], "a": [], "b": []}
            cores: dict[str, list[float]] = {"inprocess": [], "a": [], "b": []}
            loads: list[float] = []
            for round_index in range(-1, args.rounds):  # -1: the warm-up
                requests = bodies(round_index + 1000 * streams, streams, args.max_tokens)
                order = round_order(round_index, ["inprocess", "a", "b"])
                for name in order:
                    if name == "inprocess":
                        cpu_before = process_cpu_s()
                        tokens, seconds = inprocess_run(engine, requests)
                        if round_index >= 0:
                            cores[name].append((process_cpu_s() - cpu_before) / seconds)
                    else:
                        server, url = servers[name]
                        cpu_before = process_cpu_s(server.pid)
                        tokens, seconds = http_run(url, requests)
                        if round_index >= 0:
                            cores[name].append((process_cpu_s(server.pid) - cpu_before) / seconds)
                    assert tokens == streams * args.max_tokens, (name, tokens)
                    if round_index >= 0:
                        rates[name].append(tokens / seconds)
                if round_index >= 0:
                    loads.append(round(os.getloadavg()[0], 2))
                    if not args.json:
                        print(f"{streams} streams, round {round_index}: " + ", ".join(
                            f"{n} {r[-1]:.0f}" for n, r in rates.items()), file=sys.stderr)  # fmt: skip
            within = {
                name: [r / i for r, i in zip(rates[name], rates["inprocess"], strict=True)]
                for name in ("a", "b")
            }
            results[str(streams)] = {
                "tokens_per_s": {
                    getattr(args, f"{n}_label", n): round(statistics.median(r), 1)
                    for n, r in rates.items()
                },
                **{
                    f"ratio_{getattr(args, f'{n}_label')}": round(statistics.median(w), 3)
                    for n, w in within.items()
                },
                "ratio_b_over_a": round(
                    statistics.median(b / a for a, b in zip(rates["a"], rates["b"], strict=True)),
                    3,
                ),
                **{
                    f"cores_{getattr(args, f'{n}_label', n)}": round(statistics.median(c), 2)
                    for n, c in cores.items()
                },
                "load_average_per_round": loads,
            }
    finally:
        for server, _ in servers.values():
            server.terminate()
            server.wait(60)
    print(
        json.dumps(
            {
                "benchmark": "step_loop",
                "model": args.model,
                "max_tokens": args.max_tokens,
                "rounds": args.rounds,
                "inprocess_threads": args.inprocess_threads,
                "servers": {
                    getattr(args, f"{s}_label"): {"threads": getattr(args, f"{s}_threads")}
                    for s in ("a", "b")
                },
                "streams": results,
                "machine": describe_machine(),
            }
        )
    )


if __name__ == "__main__":
    main()
