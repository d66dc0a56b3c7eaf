"""The engine's linears: torch's float32 `F.linear` against prepacked oneDNN and MKL weights.

    python benchmarks/bench_linear.py --json
    python benchmarks/bench_linear.py --threads 2 --rounds 9 --json

On the shapes of the `small` preset (hidden 512, 8 layers; q/k/v fused into `qkv_proj` and
gate/up into `gate_up_proj`, as the engine runs them) and two LM heads, at 1, 8 and 64 tokens per
call (a decode step of 1, 8 and 64 streams), each contender computes the same product:

- `dense`: `torch.nn.functional.linear(x, w, b)`, what the engine does without prepacking;
- `mkldnn_packed`: `torch.ops.mkldnn._linear_pointwise(x, W, b, "none", [], "")` with `W` from
  `torch.ops.mkldnn._reorder_linear_weight(w)`: a oneDNN weight in its blocked layout, the input
  and output plain (dense) tensors, no conversion per call;
- `mkldnn_packed_hint`: the same, the weight reordered for that batch size (`batch_size=`);
- `mkl_packed`: `torch.ops.mkl._mkl_linear` on `torch.ops.mkl._mkl_reorder_linear_weight(w, n)`,
  MKL's packed GEMM, valid only for the batch size `n` it was packed for (another one falls back
  to the plain weight);
- `mkldnn_tensor`: `torch._C._nn.mkldnn_linear` on `x.to_mkldnn()` and `w.to_mkldnn()`, then
  `.to_dense()` (what `torch.utils.mkldnn` does), conversions included.

Each round times every contender once per shape and batch, in an order that alternates from
round to round, each time the median of `--calls` calls; a figure is the median over `--rounds`
rounds and a ratio the median of the per-round ratios against `dense` (paired: both share the
machine's load of that moment). Outputs are compared to `dense` (max absolute difference). The
load average before and after is recorded: on a shared machine, read the ratios. The last line is
one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F  # noqa: N812

from machine import describe_machine  # benchmarks/machine.py, beside this script

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM = 512, 1376, 8, 4, 64
# (name, in_features, out_features): one decoder layer of the `small` preset, then two LM heads
# (the preset's byte vocabulary and an 8k one).
SHAPES = [
    ("qkv_proj", HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM),
    ("o_proj", HEADS * HEAD_DIM, HIDDEN),
    ("gate_up_proj", HIDDEN, 2 * INTERMEDIATE),
    ("down_proj", INTERMEDIATE, HIDDEN),
    ("lm_head_259", HIDDEN, 259),
    ("lm_head_8192", HIDDEN, 8192),
]
BATCHES = [1, 8, 64]


def time_call(fn: Callable[[], torch.Tensor], calls: int) -> float:
    """Median seconds of one call of `fn` over `calls` calls (after two warm-up calls)."""
    fn()
    fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _contenders(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, batch: int
) -> dict[str, Callable[[], torch.Tensor]]:
    packed = torch.ops.mkldnn._reorder_linear_weight(w)
    packed_hint = torch.ops.mkldnn._reorder_linear_weight(w, batch)
    mkl_packed = torch.ops.mkl._mkl_reorder_linear_weight(w, batch)
    w_mkldnn = w.to_mkldnn()
    return {
        "dense": lambda: F.linear(x, w, b),
        "mkldnn_packed": lambda: torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], ""),
        "mkldnn_packed_hint": lambda: torch.ops.mkldnn._linear_pointwise(
            x, packed_hint, b, "none", [], ""
        ),
        "mkl_packed": lambda: torch.ops.mkl._mkl_linear(x, mkl_packed, w, b, batch),
        "mkldnn_tensor": lambda: torch._C._nn.mkldnn_linear(x.to_mkldnn(), w_mkldnn, b).to_dense(),
    }


def main() -> None:
    """Runs the comparison and prints it (a table, or one JSON object with `--json`)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="paired rounds (median over them)")
    parser.add_argument("--calls", type=int, default=50, help="timed calls per contender")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    load_before = os.getloadavg()

    cases = {}
    for name, fan_in, fan_out in SHAPES:
        w = torch.randn(fan_out, fan_in) / fan_in**0.5
        for batch in BATCHES:
            x = torch.randn(batch, fan_in)
            contenders = _contenders(x, w, None, batch)
            reference = contenders["dense"]()
            max_diff = {
                label: float((fn() - reference).abs().max()) for label, fn in contenders.items()
            }
            cases[f"{name}/{batch}"] = (contenders, max_diff)

    times: dict[str, dict[str, list[float]]] = {key: {} for key in cases}
    for round_index in range(args.rounds):
        for key, (contenders, _) in cases.items():
            labels = list(contenders)
            if round_index % 2:
                labels.reverse()
            for label in labels:
                times[key].setdefault(label, []).append(time_call(contenders[label], args.calls))

    results = {}
    for key, (_, max_diff) in cases.items():
        dense = times[key]["dense"]
        results[key] = {
            label: {
                "median_us": round(statistics.median(values) * 1e6, 2),
                "speedup_paired": round(
                    statistics.median(d / v for d, v in zip(dense, values, strict=True)), 3
                ),
                "max_abs_diff": max_diff[label],
            }
            for label, values in times[key].items()
        }
    # A whole decoder layer (the four projections) per batch: what a decode step multiplies by 8.
    per_layer = {}
    for batch in BATCHES:
        layer_keys = [f"{name}/{batch}" for name, *_ in SHAPES[:4]]
        per_layer[str(batch)] = {
            label: round(
                statistics.median(
                    sum(times[k]["dense"][r] for k in layer_keys)
                    / sum(times[k][label][r] for k in layer_keys)
                    for r in range(args.rounds)
                ),
                3,
            )
            for label in times[layer_keys[0]]
        }
    report = {
        "benchmark": "linear",
        "command": "python benchmarks/bench_linear.py "
        f"--rounds {args.rounds} --calls {args.calls} --threads {args.threads} --json",
        "machine": describe_machine(),
        "threads": args.threads,
        "rounds": args.rounds,
        "calls": args.calls,
        "load_average_before": [round(v, 2) for v in load_before],
        "load_average_after": [round(v, 2) for v in os.getloadavg()],
        "layer_speedup_paired": per_layer,
        "cases": results,
    }
    if args.json:
        print(json.dumps(report))
        return
    for key, by_label in results.items():
        row = "  ".join(
            f"{label} {r['median_us']:8.1f}us x{r['speedup_paired']:.2f}"
            for label, r in by_label.items()
        )
        print(f"{key:18s} {row}")
    print("layer speedup (paired):", per_layer)


if __name__ == "__main__":
    main()
