"""Two OpenAI-compatible servers side by side (e.g. vLLM and `weightsync serve`, same model).

    python benchmarks/bench_vs_vllm.py URL_A URL_B --json
    python benchmarks/bench_vs_vllm.py http://127.0.0.1:8001 http://127.0.0.1:8002 --json
        --label-a vllm --start-a "./serve-vllm.sh 8001"
        --label-b weightsync --start-b "weightsync serve DIR --port 8002 --num-threads 1"

(the second command is one line).

Each server is reached at its URL. How it got there is up to the caller, in one of two ways per
server:

- `--start-a CMD` (`--start-b`): the script runs CMD through the shell in a session of its own,
  times it until `/health` and `/v1/models` answer (`startup_s`; the servers start one after
  the other, never together), measures it, and stops the whole session at the end.
- `--pid-a PID` (`--pid-b`): a server already running; measured, not started or stopped.
- neither: the server is only reached; no start-up time and no memory figure.

Figures (medians over `--rounds` rounds after one warm-up round; the servers take turns in each
round, the first one alternating, so drift in the machine's load falls on both):

- `tokens_per_s`: completion tokens per second of `--concurrency` streamed greedy completions
  sent at once (`ignore_eos`, `--max-tokens` each). Every prompt is token ids never sent before
  to either server, so no prefix cache helps. `throughput_ratio_b_over_a` divides the medians;
  `throughput_ratio_b_over_a_paired` takes the ratio within each round (the two runs of a round
  share the machine's load at that moment), less sensitive to other work on the machine.
- `ttft_under_load_s`: time to the first streamed token of those requests (median per round).
- `ttft_idle_s`: time to the first streamed token of one request on an idle server.
- `rss_gib`, `processes`: resident memory of the server's process tree (Linux `/proc`), after
  the rounds; `startup_s` as above.
- `greedy`: the servers' greedy token ids on the same `--compare-prompts` token-id prompts,
  compared token by token, one request at a time and all at once. Token ids come from
  `return_token_ids` (vLLM's field); a server that refuses it is asked again without it and
  read from `choices[0].token_ids` (weightsync's equivalent).

The machine (`benchmarks/machine.py`), both servers' `/version` and the load average before
and after are recorded: on a shared machine, re-run when it is quiet. The last line of output
is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import signal
import statistics
import subprocess
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from machine import describe_machine  # benchmarks/machine.py, beside this script

START_TIMEOUT_S = 600.0
REQUEST_TIMEOUT_S = 300.0
GIB = 1024**3


@dataclass
class Server:
    """One server under test."""

    label: str
    url: str
    command: str | None = None
    pid: int | None = None
    process: subprocess.Popen[bytes] | None = None
    model: str = ""
    version: str | None = None
    startup_s: float | None = None
    sends_return_token_ids: bool = True
    throughput: list[float] = field(default_factory=list)
    ttft_load: list[float] = field(default_factory=list)
    ttft_idle: list[float] = field(default_factory=list)


def start(server: Server) -> None:
    """Runs the server's command in a session of its own and waits until it serves."""
    assert server.command is not None
    began = time.perf_counter()
    server.process = subprocess.Popen(server.command, shell=True, start_new_session=True)
    server.pid = server.process.pid
    while time.perf_counter() - began < START_TIMEOUT_S:
        if server.process.poll() is not None:
            raise RuntimeError(f"{server.label}: '{server.command}' exited with "
                               f"{server.process.returncode} before serving")  # fmt: skip
        try:
            serving = all(httpx.get(f"{server.url}{path}", timeout=5).status_code == 200
                          for path in ("/health", "/v1/models"))  # fmt: skip
        except httpx.HTTPError:
            serving = False
        if serving:
            server.startup_s = time.perf_counter() - began
            return
        time.sleep(0.5)
    raise RuntimeError(f"{server.label} did not serve within {START_TIMEOUT_S:g} s")


def stop(server: Server) -> None:
    """Stops a server this script started: its whole session, SIGTERM then SIGKILL."""
    if server.process is None or server.process.poll() is not None:
        return
    os.killpg(server.process.pid, signal.SIGTERM)
    try:
        server.process.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(server.process.pid, signal.SIGKILL)
        server.process.wait(30)


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants, from `/proc`."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry.name))
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo += children.get(current, [])
    return tree


def rss_bytes(pids: list[int]) -> int:
    """Resident memory of `pids`, summed (VmRSS; pages shared between them count twice)."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


def describe(server: Server) -> None:
    """Learns the server's model, version and whether it takes `return_token_ids`."""
    models = httpx.get(f"{server.url}/v1/models", timeout=30).json()
    server.model = models["data"][0]["id"]
    version = httpx.get(f"{server.url}/version", timeout=30)
    server.version = version.json().get("version") if version.status_code == 200 else None
    probe = httpx.post(f"{server.url}/v1/completions", timeout=REQUEST_TIMEOUT_S, json={
        "model": server.model, "prompt": [1, 2, 3], "max_tokens": 1, "return_token_ids": True})  # fmt: skip
    server.sends_return_token_ids = probe.status_code == 200


_fresh = itertools.count()


def fresh_prompt(length: int, max_token_id: int) -> list[int]:
    """A token-id prompt no server has seen: a new seed each call."""
    rng = random.Random(next(_fresh))
    return [rng.randint(1, max_token_id) for _ in range(length)]


async def sse_lines(response: httpx.Response) -> AsyncIterator[bytes]:
    """The lines of an event stream, split at newlines only.

    A completion's text may hold U+2028 and kin, at which `aiter_lines` would split a line.
    """
    pending = b""
    async for data in response.aiter_bytes():
        *lines, pending = (pending + data).split(b"\n")
        for line in lines:
            yield line
    if pending:
        yield pending


async def stream_one(
    client: httpx.AsyncClient, server: Server, prompt: list[int], max_tokens: int
) -> tuple[int, float]:
    """One streamed greedy completion; returns (completion tokens, seconds to first token)."""
    body = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    began, first, tokens = time.perf_counter(), None, 0
    async with client.stream("POST", f"{server.url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in sse_lines(response):
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and first is None:
                first = time.perf_counter() - began
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    if first is None or tokens != max_tokens:
        raise RuntimeError(f"{server.label}: {tokens} tokens of {max_tokens}, first at {first}")
    return tokens, first


async def one_round(server: Server, args: argparse.Namespace, keep: bool) -> None:
    """A burst of concurrent requests, then one request alone; figures kept if `keep`."""
    limits = httpx.Limits(max_connections=args.concurrency + 8)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        prompts = [fresh_prompt(args.prompt_tokens, args.max_token_id)
                   for _ in range(args.concurrency)]  # fmt: skip
        began = time.perf_counter()
        results = await asyncio.gather(
            *(stream_one(client, server, p, args.max_tokens) for p in prompts)
        )
        seconds = time.perf_counter() - began
        alone = await stream_one(client, server, fresh_prompt(args.prompt_tokens,
                                                              args.max_token_id), 4)  # fmt: skip
    if keep:
        server.throughput.append(sum(tokens for tokens, _ in results) / seconds)
        server.ttft_load.append(statistics.median(first for _, first in results))
        server.ttft_idle.append(alone[1])


async def greedy_ids(server: Server, prompts: list[list[int]], tokens: int, at_once: bool
                     ) -> list[list[int]]:  # fmt: skip
    """The server's greedy token ids for each prompt."""

    async def one(client: httpx.AsyncClient, prompt: list[int]) -> list[int]:
        body: dict[str, Any] = {"model": server.model, "prompt": prompt, "max_tokens": tokens,
                                "temperature": 0, "ignore_eos": True}  # fmt: skip
        if server.sends_return_token_ids:
            body["return_token_ids"] = True
        response = await client.post(f"{server.url}/v1/completions", json=body)
        response.raise_for_status()
        return list(response.json()["choices"][0]["token_ids"])

    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
        if at_once:
            return list(await asyncio.gather(*(one(client, p) for p in prompts)))
        return [await one(client, p) for p in prompts]


async def compare_greedy(a: Server, b: Server, args: argparse.Namespace) -> dict[str, Any]:
    """Token-by-token comparison of the two servers' greedy outputs on the same prompts."""
    prompts = [fresh_prompt(args.prompt_tokens, args.max_token_id)
               for _ in range(args.compare_prompts)]  # fmt: skip
    result: dict[str, Any] = {"prompts": len(prompts), "tokens_per_prompt": args.compare_tokens}
    for mode, at_once in (("one_at_a_time", False), ("all_at_once", True)):
        ids_a = await greedy_ids(a, prompts, args.compare_tokens, at_once)
        ids_b = await greedy_ids(b, prompts, args.compare_tokens, at_once)
        same = [
            sum(x == y for x, y in zip(p, q, strict=True))
            for p, q in zip(ids_a, ids_b, strict=True)
        ]
        divergence = [next((i for i, (x, y) in enumerate(zip(p, q, strict=True)) if x != y), None)
                      for p, q in zip(ids_a, ids_b, strict=True)]  # fmt: skip
        result[mode] = {
            "identical_prompts": sum(p == q for p, q in zip(ids_a, ids_b, strict=True)),
            "identical_tokens": sum(same),
            "total_tokens": sum(len(p) for p in ids_a),
            "first_divergence": [d for d in divergence if d is not None],
        }
    return result


def summary(values: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "rounds": [round(v, 4) for v in values]}  # fmt: skip


def server_record(server: Server) -> dict[str, Any]:
    pids = process_tree(server.pid) if server.pid is not None else []
    return {
        "label": server.label, "url": server.url, "model": server.model,
        "version": server.version, "startup_s": server.startup_s,
        "rss_gib": rss_bytes(pids) / GIB if pids else None,
        "processes": len(pids) or None,
        "started_by_script": server.command is not None,
        "takes_return_token_ids": server.sends_return_token_ids,
    }  # fmt: skip


async def bench(a: Server, b: Server, args: argparse.Namespace) -> dict[str, Any]:
    for round_index in range(args.rounds + 1):  # round 0 warms both up
        order = (a, b) if round_index % 2 == 0 else (b, a)
        for server in order:
            await one_round(server, args, keep=round_index > 0)
    greedy = await compare_greedy(a, b, args)
    ratio = statistics.median(b.throughput) / statistics.median(a.throughput)
    # Each round's pair ran back to back: its ratio sees the same load on the machine.
    paired = [tb / ta for ta, tb in zip(a.throughput, b.throughput, strict=True)]
    return {
        "tokens_per_s": {s.label: summary(s.throughput) for s in (a, b)},
        "throughput_ratio_b_over_a": ratio,
        "throughput_ratio_b_over_a_paired": summary(paired),
        "ttft_under_load_s": {s.label: summary(s.ttft_load) for s in (a, b)},
        "ttft_idle_s": {s.label: summary(s.ttft_idle) for s in (a, b)},
        "greedy": greedy,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("url_a")
    parser.add_argument("url_b")
    for side in ("a", "b"):
        parser.add_argument(f"--label-{side}", default=side, help="name in the results")
        parser.add_argument(f"--start-{side}", metavar="CMD", help="shell command that starts it")
        parser.add_argument(f"--pid-{side}", type=int, help="pid of the running server")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds (after a warm-up)")
    parser.add_argument("--concurrency", type=int, default=64, help="requests sent at once")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per request")
    parser.add_argument("--prompt-tokens", type=int, default=32, help="tokens per prompt")
    parser.add_argument("--max-token-id", type=int, default=255, help="largest prompt token id")
    parser.add_argument("--compare-prompts", type=int, default=16, help="greedy prompts compared")
    parser.add_argument("--compare-tokens", type=int, default=32, help="tokens each")
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")

    servers = [
        Server(
            getattr(args, f"label_{s}"),
            getattr(args, f"url_{s}").rstrip("/"),
            getattr(args, f"start_{s}"),
            getattr(args, f"pid_{s}"),
        )
        for s in ("a", "b")
    ]
    load_before = os.getloadavg()[0]
    try:
        for server in servers:
            if server.command:
                start(server)
            describe(server)
        result = asyncio.run(bench(*servers, args))
        records = {server.label: server_record(server) for server in servers}
    finally:
        for server in servers:
            stop(server)
    if not args.json:
        for server in servers:
            print(f"{server.label}: {statistics.median(server.throughput):.1f} tokens/s")
    print(json.dumps({
        "benchmark": "vs_vllm",
        "servers": records,
        "concurrency": args.concurrency, "max_tokens": args.max_tokens,
        "prompt_tokens": args.prompt_tokens, "repeats": args.rounds,
        **result,
        "load_average_1min_before": round(load_before, 2),
        "load_average_1min": round(os.getloadavg()[0], 2),
        "machine": describe_machine(),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
