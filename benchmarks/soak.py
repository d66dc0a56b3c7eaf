"""Soak: many streaming clients against `weightsync serve` while a trainer updates it, cycle after cycle.

    python benchmarks/soak.py --json

A `weightsync serve` child serves the debug model. `--clients` clients stream `/v1/completions`
requests one after another (random lengths, greedy or seeded sampling, `ignore_eos`, usage
asked for) while a trainer runs `--cycles` pause / update / resume cycles through
`sync_weights`, each in a random pause mode (`abort`, `wait`, `keep`) with `clear_cache` drawn
both ways, each update labelled with its cycle number. It prints, for the whole run:

- `requests_lost`: requests that did not end properly. A request ends properly when its stream
  ends with a `finish_reason`, its usage chunk and `[DONE]`, and (for `finish_reason="length"`)
  carries exactly `max_tokens` tokens. A request aborted by an `abort` pause ends with
  `finish_reason="abort"` and its partial tokens: that is proper, not lost. A request that never
  ends (an error, a stream cut short, no answer within `--request-timeout-s`), ends with
  `finish_reason="error"`, or ends without its tokens, is lost.
- `tokens_lost` / `tokens_duplicated`: over requests whose stream ended, the tokens the server
  counted as generated (`usage.completion_tokens`) that the client never received, and the
  tokens received beyond that count.
- `versions_non_monotonic`: requests whose per-token `weight_versions` go down anywhere, plus
  cycles after which `/weight_info` did not report the cycle's label.
- `rss_growth`: growth of the server process's resident memory, as a fraction, from after
  `--warmup-cycles` cycles under the clients' load to after the last cycle, under the same load.
- `fds_left`: the server's open file descriptors once the clients are gone, beyond those it
  had after a first update with no client connected (the trainer connected both times).
- `segments_left`: shared-memory segments of the trainer's IPC session still in /dev/shm after
  the trainer closed it (a gloo trainer makes none).

All but `rss_growth` must be zero; `rss_growth` at most 0.05. The last line of output is one
JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from machine import describe_machine  # benchmarks/machine.py, beside this script
from weightsync import LlamaForCausalLM
from weightsync.trainer import HTTPEngineClient, create_weight_sender, sync_weights

SRC = Path(__file__).resolve().parents[1] / "src"
MODEL = "debug"
MODES = ("abort", "wait", "keep")
SETTLE_S = 15.0  # how long closed connections may take to leave the server's fd table


@dataclass
class RequestRecord:
    """What one client saw of one request."""

    max_tokens: int
    tokens: int = 0
    versions: list[Any] = field(default_factory=list)
    finish_reason: str | None = None
    usage: int | None = None
    done: bool = False
    failure: str | None = None

    @property
    def lost(self) -> bool:
        """See the module docstring: never ended, ended in error, or ended without its tokens."""
        if self.failure is not None or not self.done or self.usage is None:
            return True
        if self.finish_reason not in ("length", "abort"):
            return True
        return self.finish_reason == "length" and self.tokens != self.max_tokens

    @property
    def non_monotonic(self) -> bool:
        return any(b < a for a, b in zip(self.versions[:-1], self.versions[1:], strict=True))


def start_server(max_num_seqs: int) -> tuple[subprocess.Popen[str], str]:
    command = [sys.executable, "-m", "weightsync.serve.cli", "serve", MODEL, "--port", "0",
               "--max-num-seqs", str(max_num_seqs), "--num-kv-blocks", "512",
               "--log-level", "warning"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
    assert server.stderr is not None
    for line in server.stderr:
        if match := re.search(r"listening on (http://\S+)", line):
            # Keep draining its log, so a chatty server never blocks on a full pipe.
            threading.Thread(target=server.stderr.read, daemon=True).start()
            return server, match.group(1)
    raise RuntimeError("weightsync serve did not start")


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def segments(session: str) -> set[str]:
    """The segments of one IPC session (other processes' segments are none of this run's)."""
    return {name for name in os.listdir("/dev/shm") if name.startswith(f"{session}-")}


async def one_request(
    client: httpx.AsyncClient, rng: random.Random, request_id: str, timeout_s: float
) -> RequestRecord:
    """Streams one completion and records what arrived."""
    record = RequestRecord(max_tokens=rng.randint(4, 48))
    body = {
        "prompt": f"soak {request_id}", "max_tokens": record.max_tokens, "ignore_eos": True,
        "temperature": rng.choice([0.0, 1.0]), "seed": rng.randrange(2**31), "stream": True,
        "stream_options": {"include_usage": True}, "request_id": request_id,
    }  # fmt: skip

    async def stream() -> None:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                record.failure = f"status {response.status_code}"
                return
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    record.done = True
                elif line.startswith("data: {"):
                    take_chunk(record, json.loads(line[6:]))

    try:
        await asyncio.wait_for(stream(), timeout_s)
    except (httpx.HTTPError, asyncio.TimeoutError) as exc:
        record.failure = f"{type(exc).__name__}: {exc}"
    return record


def take_chunk(record: RequestRecord, chunk: dict[str, Any]) -> None:
    if "error" in chunk:
        record.failure = chunk["error"]["message"]
    elif chunk.get("usage") is not None and not chunk.get("choices"):
        record.usage = chunk["usage"]["completion_tokens"]
    for choice in chunk.get("choices", []):
        record.tokens += len(choice["token_ids"])
        record.versions += choice["weight_versions"]
        record.finish_reason = choice["finish_reason"] or record.finish_reason


async def run_clients(
    url: str, clients: int, stop: threading.Event, timeout_s: float, seed: int
) -> list[RequestRecord]:
    """Each client sends requests one after another until `stop` is set."""
    records: list[RequestRecord] = []
    limits = httpx.Limits(max_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as client:

        async def loop(index: int) -> None:
            rng = random.Random(seed * 1000 + index)
            count = 0
            while not stop.is_set():
                request_id = f"soak-{index}-{count}"
                records.append(await one_request(client, rng, request_id, timeout_s))
                count += 1

        await asyncio.gather(*(loop(i) for i in range(clients)))
    return records


class Trainer:
    """Runs the update cycles over HTTP, as a trainer would, and checks each version."""

    def __init__(self, url: str, backend: str, seed: int) -> None:
        self.engine = HTTPEngineClient(url, timeout_s=120)
        self.sender = create_weight_sender(backend, [self.engine])
        self.sender.connect()
        self.rng = random.Random(seed)
        self.policies = [LlamaForCausalLM.from_preset(MODEL, seed=s) for s in (11, 12)]
        self.modes: dict[str, int] = {}
        self.bad_versions = 0
        self.cycles_done = 0

    def cycle(self, label: int) -> None:
        mode = self.rng.choice(MODES)
        clear_cache = self.rng.random() < 0.5
        key = f"{mode}/clear_cache={clear_cache}"
        self.modes[key] = self.modes.get(key, 0) + 1
        policy = self.policies[label % len(self.policies)]
        sync_weights(
            self.sender, policy.named_weights(), weight_version=label, mode=mode,
            clear_cache=clear_cache,
        )  # fmt: skip
        if self.engine.weight_version != label:
            self.bad_versions += 1
        self.cycles_done += 1

    def close(self) -> None:
        self.sender.close()
        self.engine.close()


def settled_fds(pid: int, baseline: int) -> int:
    """The server's fd count once closed connections have left (bounded wait)."""
    deadline = time.monotonic() + SETTLE_S
    while (count := fd_count(pid)) > baseline and time.monotonic() < deadline:
        time.sleep(0.1)  # the server closes sockets as it notices the clients' FINs
    return count


def soak(args: argparse.Namespace) -> dict[str, Any]:
    server, url = start_server(max_num_seqs=max(8, args.clients))
    try:
        trainer = Trainer(url, args.backend, args.seed)
        try:
            trainer.cycle(0)  # the transfer engine joins; its buffers are allocated
            fds_start = fd_count(server.pid)
            stop = threading.Event()
            result: dict[str, list[RequestRecord]] = {}
            clients = threading.Thread(
                target=lambda: result.setdefault(
                    "records",
                    asyncio.run(
                        run_clients(url, args.clients, stop, args.request_timeout_s, args.seed)
                    ),
                )
            )
            start = time.monotonic()
            clients.start()
            try:
                for label in range(1, args.warmup_cycles + args.cycles + 1):
                    if label == args.warmup_cycles + 1:  # warm: every code path has run
                        rss_start = rss_bytes(server.pid)
                    time.sleep(args.interval_s * trainer.rng.random())  # let streams run a while
                    trainer.cycle(label)
                rss_end = rss_bytes(server.pid)  # under the same load as at the start
            finally:
                stop.set()
                clients.join()
            seconds = time.monotonic() - start
            fds_end = settled_fds(server.pid, fds_start)
        finally:
            trainer.close()
        session = getattr(getattr(trainer.sender, "session", None), "session", None)
        segments_left = len(segments(session)) if session else 0
    finally:
        server.terminate()
        server.wait(60)
    records = result["records"]
    finished = [r for r in records if r.done and r.usage is not None]
    return {
        "benchmark": "soak",
        "model": MODEL,
        "backend": args.backend,
        "clients": args.clients,
        "cycles": trainer.cycles_done - 1 - args.warmup_cycles,
        "warmup_cycles": args.warmup_cycles,
        "modes": dict(sorted(trainer.modes.items())),
        "seconds": round(seconds, 1),
        "requests": len(records),
        "requests_aborted": sum(r.finish_reason == "abort" for r in records),
        "tokens_received": sum(r.tokens for r in records),
        "requests_lost": sum(r.lost for r in records),
        "tokens_lost": sum(max(0, r.usage - r.tokens) for r in finished if r.usage is not None),
        "tokens_duplicated": sum(
            max(0, r.tokens - r.usage) for r in finished if r.usage is not None
        ),
        "versions_non_monotonic": sum(r.non_monotonic for r in records) + trainer.bad_versions,
        "rss_start_bytes": rss_start,
        "rss_end_bytes": rss_end,
        "rss_growth": round((rss_end - rss_start) / rss_start, 4),
        "fds_left": max(0, fds_end - fds_start),
        "segments_left": segments_left,
        "lost_examples": [r.failure or r.finish_reason for r in records if r.lost][:5],
        "load_average_1min": round(os.getloadavg()[0], 2),
        "machine": describe_machine(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", type=int, default=16, help="concurrent streaming clients")
    parser.add_argument("--cycles", type=int, default=60, help="pause/update/resume cycles")
    parser.add_argument("--warmup-cycles", type=int, default=3,
                        help="cycles with clients before the RSS is first read")  # fmt: skip
    parser.add_argument("--interval-s", type=float, default=0.5,
                        help="most seconds between cycles (drawn uniformly)")  # fmt: skip
    parser.add_argument("--backend", default="ipc", choices=["ipc", "gloo"],
                        help="how the trainer sends its weights")  # fmt: skip
    parser.add_argument("--request-timeout-s", type=float, default=120.0,
                        help="a request not ended by then is lost")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="seeds modes, lengths and sampling")
    parser.add_argument("--json", action="store_true", help="print only the JSON result line")
    args = parser.parse_args()
    result = soak(args)
    if not args.json:
        for key in ("requests_lost", "tokens_lost", "tokens_duplicated", "versions_non_monotonic",
                    "rss_growth", "fds_left", "segments_left"):  # fmt: skip
            print(f"{key}: {result[key]}", file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
