"""Decode throughput of a batch spread over 4 LoRA adapters against the base model alone.

One engine serves the base model and four rank-16 adapters on all seven target modules. Each
round decodes the same workload three ways, back to back: every stream on the base model, every
stream on one adapter, and the streams spread round-robin over the four adapters; the order
rotates between rounds so that none always runs on a warmer cache. One warm-up round, then
`repeats` timed rounds: medians of the tokens/s, and the medians of the per-round ratios to the
base model's.

Decode only is timed: the requests are added and stepped until each has its first token (the
prefill), then the clock runs until the last finishes; the figure is the output tokens made in
that time over it, per second of wall clock and per second of this process's CPU time. On a
machine shared with other work the wall clock also counts the time the process waited for a
core; with one torch thread, the CPU time counts only the work, so its ratios are the steadier
figure. Each stream has its own 16-token prompt and decodes `--max-tokens` tokens
greedily, with `ignore_eos`.

`--per-part` adds the forward pass the engine had before it stacked an adapter's parts (a
shrink, an expand and a scatter per q, k, v, o, gate, up and down, see `_PerPartForward`) as two
more contenders in the same rounds, on the same engine and adapters: the before and after of
that change in one run.

The model is the `small` preset (23M parameters, float32). Torch runs on one thread
(`--threads`), as `bench_lora_sync.py` does, so that a shared machine's scheduler weighs less.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from typing import Any

import torch

from machine import describe_machine  # benchmarks/machine.py, beside this script
from weightsync import EngineConfig, LlamaForCausalLM, LLMEngine, SamplingParams
from weightsync.engine.lora import LoRABatch, _module_shapes  # the rig's baseline reads them
from weightsync.engine.model_config import LlamaConfig
from weightsync.trainer import IPCWeightSender, sync_weights

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = ["a0", "a1", "a2", "a3"]
PROMPT_TOKENS = 16


def _load_adapters(engine: LLMEngine, rank: int) -> None:
    """Creates the four adapters in `engine` through a live sync, each with its own values."""
    lora_config = {"r": rank, "lora_alpha": 2 * rank, "target_modules": MODULES}
    assert engine.weights.adapters is not None
    specs = engine.weights.adapters.adapter_specs(ADAPTERS[0], lora_config)
    generator = torch.Generator().manual_seed(0)
    with IPCWeightSender([engine]) as sender:
        for name in ADAPTERS:
            tensors = [
                (s.name, torch.randn(s.shape, generator=generator, dtype=s.dtype) * 0.05)
                for s in specs.values()
            ]
            sync_weights(sender, tensors, lora_name=name, lora_config=lora_config)


class _PerPartForward:
    """`LoRABatch.add` as it was before the parts were stacked, installed while in a `with`.

    Each part (q, k, v, o, gate, up, down) pays its own shrink, expand and scatter; the parts
    are looked up as the engine looked them up, prepared once per adapter.
    """

    def __init__(self, engine: LLMEngine) -> None:
        assert engine.loras is not None
        shapes = _module_shapes(engine.model.config)
        self.parts: dict[int, dict[tuple[int, str], list[Any]]] = {}
        for adapter in engine.loras.list():
            by_fused: dict[tuple[int, str], list[Any]] = {}
            for (layer, module), (a, b) in adapter.weights.items():
                shape = shapes[module]
                by_fused.setdefault((layer, shape.fused), []).append((shape.offset, a, b))
            self.parts[id(adapter)] = by_fused
        self._stacked_add = LoRABatch.add

    def add(
        self, batch: LoRABatch, out: torch.Tensor, x: torch.Tensor, layer: int, fused: str
    ) -> None:
        for adapter, rows in batch.groups:
            parts = self.parts[id(adapter)].get((layer, fused))
            if not parts:
                continue
            x_rows = x.index_select(0, rows)  # (rows, in_features)
            for offset, a, b in parts:
                delta = (x_rows @ a.T) @ b.T  # (rows, out_features of the part)
                delta.mul_(adapter.scaling)
                out[:, offset : offset + b.shape[0]].index_add_(0, rows, delta)

    def __enter__(self) -> None:
        forward = self

        def add(
            batch: LoRABatch, out: torch.Tensor, x: torch.Tensor, layer: int, fused: str
        ) -> None:
            forward.add(batch, out, x, layer, fused)

        LoRABatch.add = add  # type: ignore[method-assign, assignment]

    def __exit__(self, *exc_info: object) -> None:
        LoRABatch.add = self._stacked_add  # type: ignore[method-assign]


def _decode(
    engine: LLMEngine, streams: int, max_tokens: int, lora_names: list[str | None]
) -> tuple[int, int, int]:
    """Runs `streams` requests, request i on adapter `lora_names[i % len(lora_names)]`.

    Returns:
        (decode nanoseconds of wall clock, of this process's CPU time, output tokens made).
    """
    generator = torch.Generator().manual_seed(1)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for index in range(streams):
        prompt = torch.randint(0, 256, (PROMPT_TOKENS,), generator=generator).tolist()
        lora_name = lora_names[index % len(lora_names)]
        engine.add_request(f"s{index}", prompt, params, lora_name=lora_name)
    made: dict[str, int] = {}
    while len(made) < streams:  # the prefill: until every stream has its first token
        made |= {o.request_id: len(o.outputs[0].token_ids) for o in engine.step()}
    before = sum(made.values())
    start, start_cpu = time.perf_counter_ns(), time.process_time_ns()
    while engine.has_unfinished_requests():
        made |= {o.request_id: len(o.outputs[0].token_ids) for o in engine.step()}
    elapsed, elapsed_cpu = time.perf_counter_ns() - start, time.process_time_ns() - start_cpu
    assert sum(made.values()) == streams * max_tokens, made
    return elapsed, elapsed_cpu, streams * max_tokens - before


def _bench_streams(engine: LLMEngine, streams: int, args: argparse.Namespace) -> dict[str, Any]:
    """Paired rounds of base, one adapter and four adapters at `streams` streams."""
    workloads: dict[str, tuple[list[str | None], Any]] = {
        "base": ([None], contextlib.nullcontext()),
        "one_adapter": ([ADAPTERS[0]], contextlib.nullcontext()),
        "four_adapters": (list(ADAPTERS), contextlib.nullcontext()),
    }
    if args.per_part:
        per_part = _PerPartForward(engine)
        workloads["one_adapter_per_part"] = ([ADAPTERS[0]], per_part)
        workloads["four_adapters_per_part"] = (list(ADAPTERS), per_part)
    names = list(workloads)
    rates: dict[str, dict[str, list[float]]] = {
        name: {"tokens_per_s": [], "tokens_per_cpu_s": []} for name in names
    }
    for index in range(1 + args.repeats):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            lora_names, forward = workloads[name]
            with forward:
                wall_ns, cpu_ns, tokens = _decode(engine, streams, args.max_tokens, lora_names)
            if index > 0:  # round 0 warms up: first-touch pages, packed weights, caches
                rates[name]["tokens_per_s"].append(tokens / (wall_ns / 1e9))
                rates[name]["tokens_per_cpu_s"].append(tokens / (cpu_ns / 1e9))
    result: dict[str, Any] = {
        name: {
            figure: {"median": statistics.median(runs), "runs": runs}
            for figure, runs in figures.items()
        }
        for name, figures in rates.items()
    }
    for name in names[1:]:
        for figure, runs in rates[name].items():
            ratios = [a / b for a, b in zip(runs, rates["base"][figure], strict=True)]
            result[name][f"over_base_{figure.removeprefix('tokens_')}"] = {
                "median_of_ratios": statistics.median(ratios),
                "runs": ratios,
            }
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = LlamaConfig.preset("small")
    top = max(args.streams)
    engine_config = EngineConfig(
        enable_lora=True,
        max_loras=len(ADAPTERS),
        max_lora_rank=args.rank,
        max_num_seqs=top,
        max_model_len=PROMPT_TOKENS + args.max_tokens,
        num_kv_blocks=top * ((PROMPT_TOKENS + args.max_tokens) // 16 + 2),
        enable_prefix_caching=False,  # every round prefills the same prompts afresh
    )
    model = LlamaForCausalLM(config)
    model.init_weights(0)
    engine = LLMEngine(model, engine_config=engine_config)
    _load_adapters(engine, args.rank)
    result: dict[str, Any] = {
        "benchmark": "lora_batch",
        "model": {
            "preset": "small",
            "hidden_size": config.hidden_size,
            "num_layers": config.num_hidden_layers,
            "dtype": "float32",
        },
        "adapters": {"count": len(ADAPTERS), "rank": args.rank, "target_modules": MODULES},
        "max_tokens": args.max_tokens,
        "prompt_tokens": PROMPT_TOKENS,
        "repeats": args.repeats,
        "threads": args.threads,
        "per_part": args.per_part,
    }
    for streams in args.streams:
        result[f"streams_{streams}"] = _bench_streams(engine, streams, args)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rank", type=int, default=16, help="the adapters' rank r")
    parser.add_argument("--streams", type=int, nargs="+", default=[8, 64], help="batch sizes")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens each stream decodes")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds (medians)")
    parser.add_argument("--threads", type=int, default=1, help="torch's intra-op threads")
    parser.add_argument(
        "--per-part", action="store_true", help="also time the forward before parts were stacked"
    )
    parser.add_argument("--json", action="store_true", help="print only the JSON result line")
    args = parser.parse_args()
    started = time.perf_counter()
    result = run(args)
    # The machine's load over the run's last minute, at its end: a shared machine's other work
    # weighs on every figure above.
    result["load_average_1min"] = round(os.getloadavg()[0], 2)
    result["total_seconds"] = time.perf_counter() - started
    result["machine"] = describe_machine()
    if not args.json:
        for streams in args.streams:
            figures = result[f"streams_{streams}"]
            ratios = ", ".join(
                f"{name} x{figure['over_base_per_cpu_s']['median_of_ratios']:.2f}"
                for name, figure in figures.items()
                if name != "base"
            )
            base = figures["base"]["tokens_per_s"]["median"]
            print(f"{streams} streams: base {base:.0f} tokens/s; per CPU second: {ratios}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
