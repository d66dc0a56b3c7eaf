"""Engine benchmark: continuous batching, pause latency and resume, measured in one run.

    python benchmarks/bench_engine.py --json

Measures, on one model in one process:

- decode throughput (output tokens/s) of 32 requests with continuous batching against the same
  requests one at a time (`batching_speedup`);
- how long `pause_generation` takes under 64 concurrent streams, for each mode, in engine steps
  (forward passes that finished between the call and its return) and in seconds;
- after a `keep` pause with `clear_cache=True`, the steps from `resume_generation` to the next
  token (the first stream to get one, and every stream).

The last line of output is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import torch

from machine import describe_machine  # benchmarks/machine.py, beside this script
from weightsync.engine.async_engine import AsyncEngine
from weightsync.engine.config import EngineConfig
from weightsync.engine.llm_engine import LLMEngine
from weightsync.engine.model import LlamaForCausalLM
from weightsync.engine.sampling import SamplingParams

MODES = ("abort", "wait", "keep")


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def summary(values: list[float]) -> dict[str, float]:
    return {"p50": percentile(values, 50), "p99": percentile(values, 99), "max": max(values)}


def prompts(count: int) -> list[str]:
    return [f"Request {i}: tell me about weight {i * 7 % 13}." for i in range(count)]


def bench_batching(model: LlamaForCausalLM, requests: int, max_tokens: int) -> dict[str, Any]:
    engine = LLMEngine(model, engine_config=EngineConfig(max_num_seqs=requests))
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    texts = prompts(requests)
    engine.generate(texts[:4], params)  # warm-up
    start = time.perf_counter()
    batched = engine.generate(texts, params)
    batched_s = time.perf_counter() - start
    start = time.perf_counter()
    alone = [engine.generate([text], params)[0] for text in texts]
    alone_s = time.perf_counter() - start
    same = [o.outputs[0].token_ids for o in batched] == [o.outputs[0].token_ids for o in alone]
    tokens = requests * max_tokens
    return {
        "requests": requests,
        "max_tokens": max_tokens,
        "continuous_tokens_per_s": tokens / batched_s,
        "one_at_a_time_tokens_per_s": tokens / alone_s,
        "outputs_identical": same,
        "speedup": alone_s / batched_s,
    }


class _Stream:
    """Consumes one stream, signalling every change."""

    def __init__(
        self, engine: AsyncEngine, prompt: str, params: SamplingParams, request_id: str
    ) -> None:
        self.request_id = request_id
        self.num_tokens = 0
        self.changed = asyncio.Event()
        self.task = asyncio.create_task(self._run(engine, prompt, params))

    async def _run(self, engine: AsyncEngine, prompt: str, params: SamplingParams) -> None:
        async for output in engine.generate(prompt, params, request_id=self.request_id):
            self.num_tokens = len(output.outputs[0].token_ids)
            self.changed.set()

    async def wait_beyond(self, count: int) -> None:
        while self.num_tokens <= count and not self.task.done():
            self.changed.clear()
            await self.changed.wait()


async def _first(awaitables: list[Any]) -> None:
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for task in tasks:
        task.cancel()


async def bench_pause(
    model: LlamaForCausalLM, streams: int, trials: int, max_tokens: int
) -> dict[str, Any]:
    config = EngineConfig(max_num_seqs=streams, num_kv_blocks=1024)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    steps: dict[str, list[float]] = {mode: [] for mode in MODES}
    seconds: dict[str, list[float]] = {mode: [] for mode in MODES}
    resume_first: list[float] = []
    resume_all: list[float] = []
    async with AsyncEngine.from_engine(LLMEngine(model, engine_config=config)) as engine:
        for trial in range(trials):
            for mode in MODES:
                texts = prompts(streams)
                running = [
                    _Stream(engine, p, params, f"{trial}-{mode}-{i}") for i, p in enumerate(texts)
                ]
                progress = 2 + (trial * 5) % (max_tokens // 2)  # pause at varying depths
                await asyncio.gather(*(s.wait_beyond(progress - 1) for s in running))
                before, start = engine.num_steps, time.perf_counter()
                await engine.pause_generation(mode=mode)  # type: ignore[arg-type]
                seconds[mode].append(time.perf_counter() - start)
                steps[mode].append(engine.num_steps - before)
                if mode == "keep":
                    # Tokens each request holds now (its stream may not have read them all yet).
                    scheduler = engine.engine.scheduler
                    held = {
                        q.request_id: q.num_output_tokens
                        for q in (*scheduler.running, *scheduler.waiting)
                    }
                    counts = [held[s.request_id] for s in running]
                    before = engine.num_steps
                    await engine.resume_generation()
                    waits = [s.wait_beyond(n) for s, n in zip(running, counts, strict=True)]
                    await _first(waits)
                    resume_first.append(engine.num_steps - before)
                    await asyncio.gather(
                        *(s.wait_beyond(n) for s, n in zip(running, counts, strict=True))
                    )
                    resume_all.append(engine.num_steps - before)
                    await engine.pause_generation(mode="abort")
                await asyncio.gather(*(s.task for s in running))
                await engine.resume_generation()
    return {
        "pause_steps": {mode: summary(v) for mode, v in steps.items()},
        "pause_seconds": {mode: summary(v) for mode, v in seconds.items()},
        "resume_first_token_steps": summary(resume_first),
        "resume_all_streams_steps": summary(resume_all),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="tiny", help="model preset (default tiny)")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1 suits tiny models)"
    )
    parser.add_argument("--requests", type=int, default=32, help="requests for the batching figure")
    parser.add_argument("--max-tokens", type=int, default=32, help="output tokens per request")
    parser.add_argument("--streams", type=int, default=64, help="concurrent streams while pausing")
    parser.add_argument("--trials", type=int, default=10, help="pauses per mode")
    parser.add_argument("--json", action="store_true", help="print only the JSON result line")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = LlamaForCausalLM.from_preset(args.model, seed=0)
    batching = bench_batching(model, args.requests, args.max_tokens)
    if not args.json:
        print(f"batching: {batching}")
    pause = asyncio.run(bench_pause(model, args.streams, args.trials, args.max_tokens * 2))
    if not args.json:
        print(f"pause: {pause}")
    result = {
        "model": args.model,
        "parameters": sum(p.numel() for p in model.parameters()),
        "threads": args.threads,
        "batching": batching,
        "batching_speedup": batching["speedup"],
        "pause_streams": args.streams,
        "pause_trials": args.trials,
        **pause,
        "pause_p99_steps": {mode: s["p99"] for mode, s in pause["pause_steps"].items()},
        "resume_to_token_steps": pause["resume_first_token_steps"]["p99"],
    }
    result["machine"] = describe_machine()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
