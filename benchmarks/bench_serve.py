"""Serving benchmark: completions through `weightsync serve` against the engine in process.

    python benchmarks/bench_serve.py --json

- `http_tokens_per_s`: completion tokens per second of `--streams` concurrent streaming
  `/v1/completions` requests to a `weightsync serve` child. The client is lean (HTTP/1.1 by
  hand over asyncio streams) but parses and checks every SSE chunk.
- `inprocess_tokens_per_s`: the same requests (prompts, seeds, lengths) as concurrent
  `AsyncEngine.generate` streams in this process, with the same engine configuration and the
  same fixed torch threads: every core but one (given to the server as `--num-threads`; its
  default, which follows the machine's load, would differ from the in-process side's).
- `http_throughput_ratio` = http / in-process (target >= 0.8).
- CPU, which on a small machine is what the two modes compete for: `http_client_cpu_cores`
  (the client's CPU seconds per second of its runs: it runs on the same cores as the server),
  `http_server_cpu_us_per_token` (the server process, every thread, per completion token) and
  `inprocess_cpu_us_per_token` (this process during its in-process runs). CPU time per token
  changes less with other work on the machine than tokens per second does.
- `keep_pause_p99_steps`: while the streams run, a trainer sends `/pause?mode=keep`; the server
  records the engine's step counter when it handles the request and again once the pause has
  landed (`/engine_stats` -> `last_pause`). The figure is landed - requested, p99 over `--pauses`
  pauses (target <= 1): the step in flight when the request arrived, and nothing else. Network
  transit is not in it.
- `keep_pause_client_p99_steps`: the same pauses seen from the client, transit included: the
  engine steps between a `/engine_stats` read sent just before the `/pause` and one sent just
  after it returned. It adds the steps run while each request was on its way.

The two throughput modes take turns, one run each per round, after a warm-up of each; figures
are medians over the rounds. The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from machine import describe_machine  # benchmarks/machine.py, beside this script
from weightsync import AsyncEngine, EngineConfig, SamplingParams
from weightsync.serve.cli import _large_tensors_on_huge_pages

SRC = Path(__file__).resolve().parents[1] / "src"
MODEL = "tiny"


def requests(streams: int, max_tokens: int) -> list[dict[str, Any]]:
    """The benchmark's requests: one per stream, seeded, of a fixed length."""
    return [
        {"prompt": f"request {i}: the weights", "max_tokens": max_tokens, "temperature": 1.0,
         "seed": i, "ignore_eos": True}
        for i in range(streams)
    ]  # fmt: skip


def start_server(streams: int, threads: int) -> tuple[subprocess.Popen[str], str]:
    command = [sys.executable, "-m", "weightsync.serve.cli", "serve", MODEL, "--port", "0",
               "--max-num-seqs", str(streams), "--num-threads", str(threads),
               "--log-level", "warning"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
    assert server.stderr is not None
    for line in server.stderr:
        if match := re.search(r"listening on (http://\S+)", line):
            return server, match.group(1)
    raise RuntimeError("weightsync serve did not start")


async def _stream_one(host: str, port: int, body: dict[str, Any]) -> int:
    """One streaming completion over a raw connection; returns its tokens, each one checked.

    A lean client, so that the client's own Python takes as little as possible of the cores
    the server runs on: HTTP/1.1 written by hand, the chunked body read as it comes. Every
    event is still parsed: each carries as many weight versions as token ids, the stream ends
    with `finish_reason="length"` and `[DONE]`, and the tokens add up to `max_tokens`.
    """
    reader, writer = await asyncio.open_connection(host, port)
    payload = json.dumps({**body, "stream": True}).encode()
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\nconnection: close\r\n\r\n%s"
        % (host.encode(), len(payload), payload)
    )
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    tokens, finish, done, pending = 0, None, False, b""
    while not done:
        size = int((await reader.readline()).split(b";")[0], 16)
        if size == 0:
            break
        pending += (await reader.readexactly(size + 2))[:-2]
        *events, pending = pending.split(b"\n\n")
        for event in events:
            if event.startswith(b"data: {"):
                for choice in json.loads(event[6:])["choices"]:
                    assert len(choice["token_ids"]) == len(choice["weight_versions"]), choice
                    tokens += len(choice["token_ids"])
                    finish = choice["finish_reason"] or finish
            done = done or event == b"data: [DONE]"
    writer.close()
    assert done and finish == "length" and tokens == body["max_tokens"], (done, finish, tokens)
    return tokens


async def http_run(url: str, bodies: list[dict[str, Any]]) -> tuple[int, float]:
    """Streams every request at once; returns (completion tokens, seconds)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    start = time.perf_counter()
    counts = await asyncio.gather(*(_stream_one(host, int(port), body) for body in bodies))
    return sum(counts), time.perf_counter() - start


def process_cpu_s(pid: int | None = None) -> float:
    """CPU seconds (user + system, every thread) used so far by process `pid` (None: this one)."""
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def inprocess_run(engine: AsyncEngine, bodies: list[dict[str, Any]]) -> tuple[int, float]:
    """The same requests as `AsyncEngine.generate` streams; returns (tokens, seconds)."""

    async def one(body: dict[str, Any]) -> int:
        params = SamplingParams(max_tokens=body["max_tokens"], temperature=body["temperature"],
                                seed=body["seed"], ignore_eos=True)  # fmt: skip
        last = None
        async for output in engine.generate(body["prompt"], params):
            last = output
        assert last is not None
        return len(last.outputs[0].token_ids)

    start = time.perf_counter()
    counts = await asyncio.gather(*(one(body) for body in bodies))
    return sum(counts), time.perf_counter() - start


def keep_pause_steps(
    url: str, bodies: list[dict[str, Any]], pauses: int
) -> tuple[list[int], list[int]]:
    """Engine steps per keep pause: (as the server counts them, as the client sees them)."""

    async def steps_now(client: httpx.AsyncClient) -> int:
        steps: int = (await client.get("/engine_stats")).json()["num_steps"]
        return steps

    async def measure() -> tuple[list[int], list[int]]:
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            long = [{**body, "max_tokens": 100_000 // len(bodies)} for body in bodies]
            streams = asyncio.gather(*(
                client.post("/v1/completions", json=body) for body in long
            ))  # fmt: skip
            server_steps, client_steps = [], []
            while await steps_now(client) < 5:
                await asyncio.sleep(0.01)  # the streams are being admitted
            for _ in range(pauses):
                before = await steps_now(client)
                await client.post("/pause", params={"mode": "keep", "clear_cache": "false"})
                stats = (await client.get("/engine_stats")).json()
                pause = stats["last_pause"]
                server_steps.append(pause["landed_at_step"] - pause["requested_at_step"])
                client_steps.append(stats["num_steps"] - before)
                await client.post("/resume")
                resumed_at = stats["num_steps"]
                while await steps_now(client) < resumed_at + 3:
                    await asyncio.sleep(0.005)  # let it generate a few steps between pauses
            await client.post("/abort_requests")
            await streams
            return server_steps, client_steps

    return asyncio.run(measure())


def p99(values: list[int]) -> int:
    """The 99th percentile (nearest rank at or above it)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def main() -> None:
    _large_tensors_on_huge_pages()  # the engine in process as `weightsync serve` runs it
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, default=64, help="concurrent streams")
    parser.add_argument("--max-tokens", type=int, default=96, help="tokens per request")
    parser.add_argument("--repeats", type=int, default=7, help="rounds (median reported)")
    parser.add_argument("--pauses", type=int, default=100, help="keep pauses measured")
    parser.add_argument("--json", action="store_true", help="print only the JSON result line")
    args = parser.parse_args()
    bodies = requests(args.streams, args.max_tokens)
    # Both engines compute on the same fixed count: every core but one.
    threads = max(1, (os.cpu_count() or 2) - 1)
    torch.set_num_threads(threads)
    server, url = start_server(args.streams, threads)
    engine = AsyncEngine(MODEL, engine_config=EngineConfig(max_num_seqs=args.streams))
    loop = asyncio.new_event_loop()
    rates: dict[str, list[float]] = {"http": [], "inprocess": []}
    cpu_per_token: dict[str, list[float]] = {"http": [], "inprocess": []}
    client_cores: list[float] = []
    try:
        runs = {
            "http": lambda: asyncio.run(http_run(url, bodies)),
            "inprocess": lambda: loop.run_until_complete(inprocess_run(engine, bodies)),
        }
        for fn in runs.values():
            fn()  # warm-up
        for round_index in range(args.repeats):
            for name, fn in runs.items():
                watched = server.pid if name == "http" else None
                cpu_before, own_before = process_cpu_s(watched), process_cpu_s()
                tokens, seconds = fn()
                cpu_s, own_s = process_cpu_s(watched) - cpu_before, process_cpu_s() - own_before
                assert tokens == args.streams * args.max_tokens, (name, tokens)
                rates[name].append(tokens / seconds)
                cpu_per_token[name].append(cpu_s / tokens * 1e6)
                if name == "http":
                    client_cores.append(own_s / seconds)
            if not args.json:
                print(f"round {round_index}: " + ", ".join(
                    f"{n} {r[-1]:.0f} tok/s" for n, r in rates.items()), file=sys.stderr)  # fmt: skip
        steps, client_steps = keep_pause_steps(url, bodies, args.pauses)
    finally:
        loop.run_until_complete(engine.shutdown())
        loop.close()
        server.terminate()
        server.wait(60)
    http, inprocess = statistics.median(rates["http"]), statistics.median(rates["inprocess"])
    result = {
        "benchmark": "serve",
        "model": MODEL,
        "streams": args.streams,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "torch_threads": threads,
        "http_tokens_per_s": http,
        "inprocess_tokens_per_s": inprocess,
        "http_throughput_ratio": http / inprocess,
        "http_client_cpu_cores": statistics.median(client_cores),
        "http_server_cpu_us_per_token": statistics.median(cpu_per_token["http"]),
        "inprocess_cpu_us_per_token": statistics.median(cpu_per_token["inprocess"]),
        "keep_pause_p99_steps": p99(steps),
        "keep_pause_median_steps": statistics.median(steps),
        "keep_pause_max_steps": max(steps),
        "keep_pause_client_p99_steps": p99(client_steps),
        "keep_pause_client_median_steps": statistics.median(client_steps),
        "keep_pause_client_max_steps": max(client_steps),
        "keep_pauses": len(steps),
        "load_average_1min": round(os.getloadavg()[0], 2),
        "machine": describe_machine(),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
