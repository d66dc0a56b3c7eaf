"""The "vLLM 0.32, measured" page's tables, from the committed records in `benchmarks/results/vllm/`.

Run by mkdocs-gen-files, it appends to `vllm-measured.md` the conformance record of a vLLM server
(`benchmarks/record_conformance.py`: every case of `weightsync conformance` with its outcome and
detail) and the side-by-side figures (`benchmarks/bench_vs_vllm.py --json`), so the page shows
exactly what the files say. It reads JSON only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mkdocs_gen_files

ROOT = Path(__file__).resolve().parents[2]
RECORDS = ROOT / "benchmarks" / "results" / "vllm"


def _cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ").strip()


def _machine(record: dict[str, Any]) -> str:
    machine = record.get("machine", {})
    return (
        f"{machine.get('cores', '?')} cores, {machine.get('cpu', '?')}, "
        f"{'no GPU' if not machine.get('gpus') else ', '.join(machine['gpus'])}, "
        f"Python {machine.get('python', '?')}, torch {machine.get('torch', '?')}"
    )


def conformance(record: dict[str, Any]) -> str:
    """The summary, every case that did not pass with its detail, and the passed ones' names."""
    summary = record["summary"]
    lines = [
        "## The conformance record",
        "",
        f"vLLM {record['server']['version']}: **{summary['passed']} passed, {summary['failed']} "
        f"failed, {summary['skipped']} skipped** of {summary['total']} cases, on {_machine(record)} "
        f"(load average {record.get('load_average_1min', '?')} at the end). The server ran as "
        f"`{_cell(record['server_command'])}`.",
        "",
        "| Case | Outcome | The contract | What vLLM did |",
        "| --- | --- | --- | --- |",
    ]
    for case in record["cases"]:
        if case["outcome"] != "passed":
            note = f" ({_cell(case['note'])})" if case.get("note") else ""
            lines.append(
                f"| `{case['name']}` | {case['outcome']} | {_cell(case['expect'])}{note} | "
                f"{_cell(case['detail'])} |"
            )
    passed = [case["name"] for case in record["cases"] if case["outcome"] == "passed"]
    lines += [
        "",
        f'??? note "The {len(passed)} cases vLLM passed"',
        "",
        "    " + ", ".join(f"`{name}`" for name in passed) + ".",
        "",
    ]
    return "\n".join(lines)


def _median(figure: dict[str, Any], scale: float = 1.0, digits: int = 0) -> str:
    return f"{figure['median'] * scale:.{digits}f}"


def _range(values: list[float], digits: int = 1) -> str:
    return f"{min(values):.{digits}f} to {max(values):.{digits}f}"


def _orders(rounds: list[dict[str, Any]]) -> str:
    """How the sides took turns, from the order each round recorded."""
    if len({tuple(r["order"]) for r in rounds}) > 2:
        return "each order of the sides in turn"
    return "the first side alternating"


def side_by_side(bench: dict[str, Any]) -> str:
    """The benchmark's figures: one row per stream count, then each side's costs."""
    servers, figures = bench["servers"], bench["by_streams"]
    a, b = list(servers)
    first, second = bench["start_order"]  # the server started second gains (the script's doc)
    rounds = bench["round_machine"]
    loads = [r["load_average_1min_start"] for r in rounds] + [
        r["load_average_1min_end"] for r in rounds
    ]
    rates = bench["roofline_rates"]["used"]
    model = bench["model"]
    lines = [
        "## Side by side",
        "",
        f"`benchmarks/bench_vs_vllm.py` started `{first}`, then `{second}`, and ran both on their "
        f"defaults on the same "
        f"{model['parameters'] / 1e6:.1f}M-parameter {model['config']['model_type']} directory "
        f"(hidden size {model['config']['hidden_size']}, {model['config']['num_hidden_layers']} "
        f"layers, {model['dtype']}), and `{b}`'s engine in process (`inprocess`, no HTTP), on "
        f"{_machine(bench)}: {bench['rounds']} rounds after a warm-up, {_orders(rounds)}, "
        f"each of {bench['prompt_tokens']}-token prompts and {bench['max_tokens']} streamed greedy "
        f"tokens per request. Load average {_range(loads)} during the rounds; cores busy with "
        f"other work {_range([r['other_cores'] for r in rounds], 2)}. One-thread roofline rates "
        f"measured in the same run: {rates['read_gb_s']:.1f} GB/s read, "
        f"{rates['matmul_gflop_s']:.0f} GFLOP/s.",
        "",
        f"| Streams | `{a}` tokens/s | `{b}` tokens/s | in process | `{b}` / `{a}` | served / in "
        f"process | time per output token (ms) | roofline tokens/s | of the roofline |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for count, figure in figures.items():
        tps, tpot = figure["tokens_per_s"], figure["tpot_ms"]
        fraction = figure["fraction_of_roofline"]
        lines.append(
            f"| {count} | {_median(tps[a])} | {_median(tps[b])} | {_median(tps['inprocess'])} | "
            f"{_median(figure['ratio_b_over_a'], digits=2)} | "
            f"{_median(figure['ratio_b_over_inprocess'], digits=2)} | "
            f"{_median(tpot[a], digits=1)} vs {_median(tpot[b], digits=1)} | "
            f"{figure['roofline_tokens_per_s']['overlapped_tokens_per_s']:.0f} | "
            f"{fraction[a]:.0%} vs {fraction[b]:.0%} |"
        )
    greedy = bench["greedy"]
    one, many = greedy["one_at_a_time"], greedy["all_at_once"]
    inprocess = bench["inprocess"]
    lines += [
        "",
        "Ratios are medians of the ratios within each round. The roofline takes each step of the "
        "workload (the prefill, then one decode step per token) at the slower of reading the "
        "weights and KV cache and computing its FLOPs, on one thread, at the rates this run "
        "measured before the servers started and after they stopped (the better of the two): on "
        "a loaded machine they are what one thread got then, not the machine's peak.",
        "",
        f"| Figure | `{a}` | `{b}` | in process |",
        "| --- | ---: | ---: | ---: |",
        f"| version | {servers[a]['version']} | {servers[b]['version']} | |",
        f"| start-up (s) | {servers[a]['startup_s']:.1f} | {servers[b]['startup_s']:.1f} | "
        f"{inprocess['startup_s']:.1f} |",
        f"| tokens per CPU second | {servers[a]['tokens_per_cpu_s']:.0f} | "
        f"{servers[b]['tokens_per_cpu_s']:.0f} | {inprocess['tokens_per_cpu_s']:.0f} |",
        "| cores used at "
        + ", ".join(figures)
        + " streams | "
        + " | ".join(
            ", ".join(f"{figures[c]['cpu_cores'][side]['median']:.2f}" for c in figures)
            for side in (a, b, "inprocess")
        )
        + " |",
        f"| resident memory (GiB), processes | {servers[a]['rss_gib']:.2f} in "
        f"{servers[a]['processes']} | {servers[b]['rss_gib']:.2f} in {servers[b]['processes']} | "
        f"{inprocess['rss_gib']:.2f} in {inprocess['processes']} |",
        "",
        f"Greedy token ids: {one['identical_tokens']} of {one['total_tokens']} identical one "
        f"request at a time, {many['identical_tokens']} of {many['total_tokens']} with all "
        f"{greedy['prompts']} prompts at once.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    """Appends both records to `vllm-measured.md`."""
    record = json.loads((RECORDS / "conformance.json").read_text(encoding="utf-8"))
    bench = json.loads((RECORDS / "bench_vs_vllm.json").read_text(encoding="utf-8"))
    with mkdocs_gen_files.open("vllm-measured.md", "a") as page:
        page.write("\n" + side_by_side(bench) + "\n" + conformance(record))


main()
