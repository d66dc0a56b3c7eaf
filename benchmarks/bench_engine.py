"""Engine benchmark: against `transformers`' `generate`, by concurrency, and pause latency.

    python benchmarks/bench_engine.py --json
    python benchmarks/model_dir.py DIR && python benchmarks/bench_engine.py --model DIR --only hf --json

Measures, on one model in one process (a preset, or a Hugging Face directory with its tokenizer:
`benchmarks/model_dir.py` writes a Qwen2-shaped one with the real vocabulary size):

- the engine against Hugging Face `transformers`' `generate` on the same weights (loaded into
  the family's `transformers` model through the engine's Hugging Face names) and the same greedy
  requests, checking that the outputs are token-for-token identical:
  - `hf_static_ratio`: 32 prompts of equal length, 64 tokens each, one batch for `generate` (its
    best case);
  - `hf_mixed_ratio`: 64 prompts of 16 to 64 tokens, `max_tokens` spread from 8 to 256 (as
    rollouts are); `generate` runs them as one left-padded batch until the longest is done, as a
    user would call it (`hf_sorted_ratio`: sorted by `max_tokens` into groups of 16);
  each round runs every contender once, so that a busy moment of the machine hits all alike, and
  each time is the median over the rounds (wall clock; process CPU time beside it);
- output tokens/s against the number of concurrent requests (1 to 64), each request 64 tokens;
- decode throughput (output tokens/s) of 32 requests with continuous batching against the same
  requests one at a time (`batching_speedup`);
- how long `pause_generation` takes under 64 concurrent streams, for each mode, in engine steps
  (forward passes that finished between the call and its return) and in seconds;
- after a `keep` pause with `clear_cache=True`, the steps from `resume_generation` to the next
  token (the first stream to get one, and every stream).

The last line of output is one JSON object with every figure. `--only` runs some parts (`hf`,
`concurrency`, `batching`, `pause`; repeat it for several), for quick comparisons while working;
the committed results run them all.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import os
import resource
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from machine import describe_machine  # benchmarks/machine.py, beside this script
from weightsync.engine.async_engine import AsyncEngine
from weightsync.engine.config import EngineConfig
from weightsync.engine.llm_engine import LLMEngine
from weightsync.engine.loader import load_model
from weightsync.engine.model import LlamaForCausalLM
from weightsync.engine.model_config import _PRESETS
from weightsync.engine.sampling import SamplingParams
from weightsync.engine.tokenizer import Tokenizer

MODES = ("abort", "wait", "keep")
PARTS = ("hf", "concurrency", "batching", "pause")


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def summary(values: list[float]) -> dict[str, float]:
    return {"p50": percentile(values, 50), "p99": percentile(values, 99), "max": max(values)}


def prompts(count: int) -> list[str]:
    return [f"Request {i}: tell me about weight {i * 7 % 13}." for i in range(count)]


def engine_config(model: LlamaForCausalLM, **settings: Any) -> EngineConfig:
    """An engine config of `settings` and sequences of at most 4,096 tokens.

    A real checkpoint's 32,768 positions would not fit the default KV cache; these requests need
    a few hundred.
    """
    return EngineConfig(max_model_len=min(model.config.max_position_embeddings, 4096), **settings)


def bench_batching(
    model: LlamaForCausalLM, tokenizer: Tokenizer, requests: int, max_tokens: int
) -> dict[str, Any]:
    engine = LLMEngine(
        model, tokenizer=tokenizer, engine_config=engine_config(model, max_num_seqs=requests)
    )
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


def hf_twin(model: LlamaForCausalLM) -> Any:
    """The family's `transformers` model with `model`'s config and weights (by Hugging Face name)."""
    import transformers  # the dev extra; only this benchmark needs it

    fields = model.config.to_hf_dict()
    config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    # Every request runs to its max_tokens (the engine's run ignore EOS): no early end, pad with 0.
    config.bos_token_id = config.eos_token_id = None
    config.pad_token_id = 0
    hf = transformers.AutoModelForCausalLM.from_config(config).to(model.dtype).eval()
    hf.load_state_dict(dict(model.named_weights()), strict=not model.config.tie_word_embeddings)
    hf.generation_config.pad_token_id = 0
    hf.generation_config.eos_token_id = None
    return hf


def hf_generate(hf: Any, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """Greedy `generate` on one left-padded batch until the longest request is done.

    Each request's output is cut to its own `max_tokens`: what `generate` computed past it is
    the padded batch's waste.
    """
    longest = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = hf.generate(
            ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=max(max_tokens),
            min_new_tokens=max(max_tokens),
        )
    return [row[longest : longest + n] for row, n in zip(out.tolist(), max_tokens, strict=True)]


def hf_generate_sorted(
    hf: Any, prompts: list[list[int]], max_tokens: list[int], group_size: int
) -> list[list[int]]:
    """`hf_generate` on groups of `group_size` requests of similar `max_tokens`, in turn."""
    order = sorted(range(len(prompts)), key=lambda i: max_tokens[i])
    outputs: dict[int, list[int]] = {}
    for start in range(0, len(order), group_size):
        group = order[start : start + group_size]
        tokens = hf_generate(hf, [prompts[i] for i in group], [max_tokens[i] for i in group])
        outputs.update(zip(group, tokens, strict=True))
    return [outputs[i] for i in range(len(prompts))]


def engine_generate(
    engine: LLMEngine, prompts: list[list[int]], max_tokens: list[int]
) -> list[list[int]]:
    """Greedy outputs of the engine, each request with its own `max_tokens`."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    return [o.outputs[0].token_ids for o in engine.generate(prompts, params)]


def timed_rounds(
    contenders: dict[str, Any], rounds: int, *, warm_up: bool = True
) -> dict[str, Any]:
    """Runs each contender once per round (after one warm-up run if asked); medians and outputs.

    Returns:
        Per contender: `seconds` and `cpu_seconds` (medians of wall clock and process CPU
        time) and `outputs` (of its last run).
    """
    results: dict[str, Any] = {}
    wall: dict[str, list[float]] = {name: [] for name in contenders}
    cpu: dict[str, list[float]] = {name: [] for name in contenders}
    for name, run in contenders.items():
        results[name] = {"outputs": run() if warm_up else None}
    for _ in range(rounds):
        for name, run in contenders.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            results[name]["outputs"] = run()
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    for name in contenders:
        results[name]["seconds"] = statistics.median(wall[name])
        results[name]["cpu_seconds"] = statistics.median(cpu[name])
    return results


def random_prompts(lengths: list[int], seed: int, high: int = 256) -> list[list[int]]:
    """Prompts of token ids below `high` (bytes for a preset), one per length."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, high, (n,), generator=generator).tolist() for n in lengths]


def bench_hf(
    model: LlamaForCausalLM, tokenizer: Tokenizer, rounds: int, mixed_rounds: int, high: int
) -> dict[str, Any]:
    """The engine against `generate`: a static batch, then requests of mixed lengths."""
    hf = hf_twin(model)
    config = engine_config(model, max_num_seqs=64)
    engine = LLMEngine(model, tokenizer=tokenizer, engine_config=config)
    static_prompts, static_tokens = random_prompts([32] * 32, seed=1, high=high), [64] * 32
    static = timed_rounds(
        {
            "engine": lambda: engine_generate(engine, static_prompts, static_tokens),
            "hf": lambda: hf_generate(hf, static_prompts, static_tokens),
        },
        rounds,
    )
    count = 64
    spread = torch.Generator().manual_seed(2)
    mixed_tokens = [8 + round(i * 248 / (count - 1)) for i in range(count)]  # 8 .. 256
    mixed_tokens = [mixed_tokens[i] for i in torch.randperm(count, generator=spread).tolist()]
    lengths = [16 + round(i * 48 / (count - 1)) for i in range(count)]  # 16 .. 64
    lengths = [lengths[i] for i in torch.randperm(count, generator=spread).tolist()]
    mixed_prompts = random_prompts(lengths, seed=3, high=high)
    mixed = timed_rounds(
        {
            "engine": lambda: engine_generate(engine, mixed_prompts, mixed_tokens),
            "hf": lambda: hf_generate(hf, mixed_prompts, mixed_tokens),
            "hf_sorted": lambda: hf_generate_sorted(hf, mixed_prompts, mixed_tokens, 16),
        },
        mixed_rounds,
        warm_up=False,  # the static figure warmed both up
    )

    def figures(results: dict[str, Any], tokens: list[int]) -> dict[str, Any]:
        ours = results["engine"]
        row: dict[str, Any] = {
            "requests": len(tokens),
            "output_tokens": sum(tokens),
            "engine_tokens_per_s": sum(tokens) / ours["seconds"],
        }
        for name, result in results.items():
            row[f"{name}_seconds"] = result["seconds"]
            row[f"{name}_cpu_seconds"] = result["cpu_seconds"]
            if name != "engine":
                row[f"{name}_outputs_identical"] = result["outputs"] == ours["outputs"]
                row[f"{name}_ratio"] = result["seconds"] / ours["seconds"]
                row[f"{name}_cpu_ratio"] = result["cpu_seconds"] / ours["cpu_seconds"]
        return row

    return {"static": figures(static, static_tokens), "mixed": figures(mixed, mixed_tokens)}


def bench_concurrency(
    model: LlamaForCausalLM, tokenizer: Tokenizer, rounds: int, max_tokens: int, levels: list[int]
) -> dict[str, float]:
    """Output tokens/s with `n` requests in flight at once, for each `n` in `levels`."""
    config = engine_config(model, max_num_seqs=max(levels))
    engine = LLMEngine(model, tokenizer=tokenizer, engine_config=config)
    prompts = random_prompts([32] * max(levels), seed=4)
    runs = {
        str(n): (lambda n=n: engine_generate(engine, prompts[:n], [max_tokens] * n)) for n in levels
    }
    results = timed_rounds(runs, rounds)
    return {name: int(name) * max_tokens / r["seconds"] for name, r in results.items()}


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
    model: LlamaForCausalLM, tokenizer: Tokenizer, streams: int, trials: int, max_tokens: int
) -> dict[str, Any]:
    config = engine_config(model, max_num_seqs=streams, num_kv_blocks=1024)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    steps: dict[str, list[float]] = {mode: [] for mode in MODES}
    seconds: dict[str, list[float]] = {mode: [] for mode in MODES}
    resume_first: list[float] = []
    resume_all: list[float] = []
    llm_engine = LLMEngine(model, tokenizer=tokenizer, engine_config=config)
    async with AsyncEngine.from_engine(llm_engine) as engine:
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


def hf_figures(hf: dict[str, Any]) -> dict[str, Any]:
    """The result file's entries for the comparison with `generate`."""
    return {
        "hf_static_ratio": hf["static"]["hf_ratio"],
        "hf_mixed_ratio": hf["mixed"]["hf_ratio"],
        "hf_sorted_ratio": hf["mixed"]["hf_sorted_ratio"],
        "outputs_identical": all(
            v for part in hf.values() for k, v in part.items() if k.endswith("_identical")
        ),
        "hf_static": hf["static"],
        "hf_mixed": hf["mixed"],
    }


def pause_figures(pause: dict[str, Any], streams: int, trials: int) -> dict[str, Any]:
    """The result file's entries for pause latency."""
    return {
        "pause_streams": streams,
        "pause_trials": trials,
        **pause,
        "pause_p99_steps": {mode: s["p99"] for mode, s in pause["pause_steps"].items()},
        "resume_to_token_steps": pause["resume_first_token_steps"]["p99"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default="small", help="model preset (default small) or Hugging Face directory"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"], help="parameter dtype"
    )
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds of each figure")
    parser.add_argument(
        "--mixed-rounds", type=int, default=None, help="rounds of the mixed figure (--rounds)"
    )
    parser.add_argument("--requests", type=int, default=32, help="requests for the batching figure")
    parser.add_argument("--max-tokens", type=int, default=32, help="output tokens per request")
    parser.add_argument("--streams", type=int, default=64, help="concurrent streams while pausing")
    parser.add_argument("--trials", type=int, default=10, help="pauses per mode")
    parser.add_argument("--json", action="store_true", help="print only the JSON result line")
    parser.add_argument(
        "--only", action="append", choices=PARTS, help="run only this part (repeatable)"
    )
    args = parser.parse_args()
    parts = set(args.only or PARTS)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, seed=0, dtype=getattr(torch, args.dtype))
    preset = args.model in _PRESETS
    # A directory's prompts draw from its whole vocabulary; a preset's are bytes.
    high = 256 if preset else min(tokenizer.vocab_size, model.config.vocab_size)
    started = time.perf_counter()
    result: dict[str, Any] = {
        "model": args.model if preset else Path(args.model).name,
        "model_type": model.config.model_type,
        "vocab_size": model.config.vocab_size,
        "parameters": sum(p.numel() for p in model.parameters()),
        "threads": args.threads,
        "dtype": args.dtype,
        "repeats": args.rounds,
        "mixed_repeats": args.mixed_rounds or args.rounds,
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": importlib.metadata.version("transformers"),
    }
    if "hf" in parts:
        hf = bench_hf(model, tokenizer, args.rounds, args.mixed_rounds or args.rounds, high)
        if not args.json:
            print(f"transformers: {hf}")
        result.update(hf_figures(hf))
    if "concurrency" in parts:
        levels = [1, 2, 4, 8, 16, 32, 64]
        concurrency = bench_concurrency(model, tokenizer, args.rounds, 64, levels)
        if not args.json:
            print(f"tokens/s by concurrency: {concurrency}")
        result["tokens_per_s_by_concurrency"] = concurrency
    if "batching" in parts:
        batching = bench_batching(model, tokenizer, args.requests, args.max_tokens)
        if not args.json:
            print(f"batching: {batching}")
        result.update(batching=batching, batching_speedup=batching["speedup"])
    if "pause" in parts:
        pause = asyncio.run(
            bench_pause(model, tokenizer, args.streams, args.trials, args.max_tokens * 2)
        )
        if not args.json:
            print(f"pause: {pause}")
        result.update(pause_figures(pause, args.streams, args.trials))
    # Load average of the machine over the run's last minute, at its end: the committed runs
    # share their cores with other work, which the wall-clock figures feel.
    result["load_average_1min"] = round(os.getloadavg()[0], 2)
    # Peak resident memory of the process: the model (and its transformers twin, for `hf`),
    # the KV cache and the activations.
    result["max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result["total_seconds"] = time.perf_counter() - started
    result["machine"] = describe_machine()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
