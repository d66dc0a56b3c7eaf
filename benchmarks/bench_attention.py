"""Decode attention on CPU: torch's fused `scaled_dot_product_attention` against the engine's matmul form.

    python benchmarks/bench_attention.py --json
    python benchmarks/bench_attention.py --threads 1 2 --rounds 9 --json

A decode step attends one query per request over its decode lane (see `docs/engine.md`, "How a
step computes attention"). On the heads of the 27M Llama of `model_dir.py --kind llama-27m`
(8 query heads, head_dim 64; `--groups` query heads share a KV head, 2 in that model), for each
of `--rows` decodes, `--contexts` columns and `--threads` thread counts, with keys and values
read in place from a lane rectangle (its capacity wider than the context, as the engine's is) and
requests of mixed lengths (so a mask applies), two contenders compute the same output:

- `sdpa`: `F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)`, what the engine
  called for every decode batch before;
- `matmul`: the engine's `_matmul_attention` (scores, softmax, weighted sum as two batched
  matmuls), what it calls now for two decodes or more in float32 on CPU.

Each round times both once per case, in an order that alternates from round to round, each
time the median of `--calls` calls; a figure is the median over `--rounds` rounds and
`speedup_paired` the median of the per-round ratios sdpa / matmul (paired: both share the
machine's load of that moment). `max_abs_diff` compares the two outputs. The load average before
and after is recorded. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F  # noqa: N812

from bench_linear import time_call  # benchmarks/bench_linear.py, beside this script
from machine import describe_machine  # benchmarks/machine.py, beside this script
from weightsync.engine._attention import _matmul_attention

HEADS, HEAD_DIM = 8, 64


def _contenders(rows: int, context: int, groups: int) -> dict[str, Callable[[], torch.Tensor]]:
    """Both contenders on one decode batch: `rows` queries over a lane rectangle cut at `context`."""
    kv_heads = HEADS // groups
    lanes = torch.randn(2, rows, kv_heads, 2 * context, HEAD_DIM)  # capacity past the context
    keys, values = lanes[0, :, :, :context], lanes[1, :, :, :context]
    q = torch.randn(rows, kv_heads, groups, HEAD_DIM)
    ends = torch.randint(context // 2, context + 1, (rows,))
    ends[0] = context  # the longest request sets the context, as in the engine
    mask = (torch.arange(context) < ends[:, None])[:, None, None, :]
    return {
        "sdpa": lambda: F.scaled_dot_product_attention(q, keys, values, attn_mask=mask),
        "matmul": lambda: _matmul_attention(q, keys, values, mask),
    }


def _case(contenders: dict[str, Callable[[], torch.Tensor]], rounds: int, calls: int
          ) -> dict[str, float]:  # fmt: skip
    """Times both contenders over paired rounds; their medians, paired speedup and difference."""
    diff = float((contenders["sdpa"]() - contenders["matmul"]()).abs().max())
    times: dict[str, list[float]] = {label: [] for label in contenders}
    for round_index in range(rounds):
        for label in sorted(contenders, reverse=bool(round_index % 2)):
            times[label].append(time_call(contenders[label], calls))
    return {
        "sdpa_us": round(statistics.median(times["sdpa"]) * 1e6, 1),
        "matmul_us": round(statistics.median(times["matmul"]) * 1e6, 1),
        "speedup_paired": round(
            statistics.median(s / m for s, m in zip(times["sdpa"], times["matmul"], strict=True)), 3
        ),
        "max_abs_diff": diff,
    }


def main() -> None:
    """Runs the comparison and prints it (a table, or one JSON object with `--json`)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[96, 400])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--groups", type=int, nargs="+", default=[2],
                        help="query heads per KV head (of 8 query heads)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=7, help="paired rounds (median over them)")
    parser.add_argument("--calls", type=int, default=50, help="timed calls per contender")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    torch.manual_seed(0)
    load_before = os.getloadavg()

    results = {}
    for threads, groups, rows, context in itertools.product(
        args.threads, args.groups, args.rows, args.contexts
    ):
        torch.set_num_threads(threads)
        key = f"threads={threads}/groups={groups}/rows={rows}/context={context}"
        results[key] = _case(_contenders(rows, context, groups), args.rounds, args.calls)
    report = {
        "benchmark": "attention",
        "command": "python benchmarks/bench_attention.py --rows "
        + " ".join(map(str, args.rows))
        + " --contexts "
        + " ".join(map(str, args.contexts))
        + " --threads "
        + " ".join(map(str, args.threads))
        + " --groups "
        + " ".join(map(str, args.groups))
        + f" --rounds {args.rounds} --calls {args.calls} --json",
        "machine": describe_machine(),
        "load_average_before": [round(v, 2) for v in load_before],
        "load_average_after": [round(v, 2) for v in os.getloadavg()],
        "cases": results,
    }
    if args.json:
        print(json.dumps(report))
        return
    for key, row in results.items():
        print(f"{key:44s} sdpa {row['sdpa_us']:8.1f}us  matmul {row['matmul_us']:8.1f}us  "
              f"x{row['speedup_paired']:.2f}  diff {row['max_abs_diff']:.1e}")  # fmt: skip


if __name__ == "__main__":
    main()
