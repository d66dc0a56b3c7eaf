"""Adapter-only sync against a full-weights sync of the same model, over gloo and IPC, in one run.

The engine (an `LLMEngine` serving LoRA) and the trainer share this process; the trainer's
sender reaches the engine through the same calls as any trainer's (`sync_weights`, over a gloo
group on loopback or shared memory). Each round times, back to back, one full-weights sync of
the whole model (the engine paused, every weight sent, the version moved, resumed) and one
adapter-only sync of a rank-16 adapter on all seven target modules (`lora_name`: no pause, only
A and B sent, a new adapter version committed); which comes first alternates between rounds, so
that neither always runs on a warmer cache. One warm-up round, then `repeats` timed rounds:
medians, and the median of the per-round ratios.

The model is the `small` preset (23M parameters, float32) unless `--hidden-size` and
`--num-layers` ask for another Llama shape: the adapter's share of the bytes is about
`2 * r / hidden_size`, so it shrinks as models grow (a 4096-wide model at rank 16: under 1 %).

Torch runs on one thread (`--threads`): on a small machine shared with other work, a copy split
across threads waits for whichever thread the scheduler preempted, and a 9 MB copy then takes
anything from 5 to 200 ms; one thread measures the transfer, not that lottery.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from machine import describe_machine  # benchmarks/machine.py, beside this script
from weightsync import EngineConfig, LlamaForCausalLM, LLMEngine
from weightsync.engine.model_config import LlamaConfig
from weightsync.trainer import create_weight_sender, sync_weights

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _model_config(args: argparse.Namespace) -> LlamaConfig:
    if args.hidden_size is None:
        return LlamaConfig.preset("small")
    hidden = args.hidden_size
    return LlamaConfig.preset(
        "small", hidden_size=hidden, intermediate_size=round(hidden * 2.6875 / 64) * 64,
        num_hidden_layers=args.num_layers, num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 256),
    )  # fmt: skip


def _timed(run: Any) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def _bench_backend(
    backend: str, engine: LLMEngine, full: list[Any], adapter: list[Any], repeats: int
) -> dict[str, Any]:
    """Paired rounds of a full sync and an adapter sync through one sender of `backend`."""
    full_s, adapter_s = [], []
    with create_weight_sender(backend, [engine]) as sender:

        def sync_full() -> None:
            sync_weights(sender, full)

        def sync_adapter() -> None:
            sync_weights(sender, adapter, lora_name="bench")

        for index in range(1 + repeats):
            pair = (sync_full, sync_adapter) if index % 2 == 0 else (sync_adapter, sync_full)
            times = {run: _timed(run) for run in pair}
            if index == 0:
                continue  # the warm-up round: first-touch pages, mappings, group buffers
            full_s.append(times[sync_full])
            adapter_s.append(times[sync_adapter])
    ratios = [a / f for a, f in zip(adapter_s, full_s, strict=True)]
    return {
        "full_sync_s": {"median": statistics.median(full_s), "runs": full_s},
        "adapter_sync_s": {"median": statistics.median(adapter_s), "runs": adapter_s},
        "adapter_over_full": {"median_of_ratios": statistics.median(ratios), "runs": ratios},
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = _model_config(args)
    engine_config = EngineConfig(
        enable_lora=True,
        max_lora_rank=args.rank,
        num_kv_blocks=128,
        max_model_len=512,
        max_lora_versions=2,
    )
    engine = LLMEngine(LlamaForCausalLM(config), engine_config=engine_config)
    policy = LlamaForCausalLM(config)
    full = [(name, tensor.detach()) for name, tensor in policy.named_weights()]
    lora_config = {"r": args.rank, "lora_alpha": 2 * args.rank, "target_modules": MODULES}
    assert engine.weights.adapters is not None
    specs = engine.weights.adapters.adapter_specs("bench", lora_config)
    adapter = [(s.name, torch.randn(s.shape, dtype=s.dtype) * 0.01) for s in specs.values()]
    with create_weight_sender("ipc", [engine]) as sender:  # the adapter is created by its config
        sync_weights(sender, adapter, lora_name="bench", lora_config=lora_config)
    full_bytes = sum(t.numel() * t.element_size() for _, t in full)
    adapter_bytes = sum(t.numel() * t.element_size() for _, t in adapter)
    result: dict[str, Any] = {
        "benchmark": "lora_sync",
        "model": {
            "hidden_size": config.hidden_size,
            "num_layers": config.num_hidden_layers,
            "dtype": "float32",
            "parameters": sum(t.numel() for _, t in full),
        },
        "adapter": {"rank": args.rank, "target_modules": MODULES, "tensors": len(adapter)},
        "bytes": {
            "full": full_bytes,
            "adapter": adapter_bytes,
            "adapter_over_full": adapter_bytes / full_bytes,
        },
        "repeats": args.repeats,
        "threads": args.threads,
        "goal_adapter_over_full": 0.05,
    }
    for backend in args.backends:
        result[backend] = _bench_backend(backend, engine, full, adapter, args.repeats)
    result["adapter_version"] = engine.loras.get("bench").version if engine.loras else None
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rank", type=int, default=16, help="the adapter's rank r")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds (medians)")
    parser.add_argument("--backends", nargs="+", default=["gloo", "ipc"], choices=["gloo", "ipc"])
    parser.add_argument("--hidden-size", type=int, help="another model width (default: small)")
    parser.add_argument("--num-layers", type=int, default=8, help="with --hidden-size")
    parser.add_argument("--threads", type=int, default=1, help="torch's intra-op threads")
    parser.add_argument("--json", action="store_true", help="print only the JSON result line")
    args = parser.parse_args()
    result = run(args)
    result["machine"] = describe_machine()
    if not args.json:
        for backend in args.backends:
            ratio = result[backend]["adapter_over_full"]["median_of_ratios"]
            print(f"{backend}: adapter sync takes {ratio:.1%} of a full sync's time")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
