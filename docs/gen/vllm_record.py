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


def _spread(figure: dict[str, Any], scale: float = 1.0, digits: int = 0) -> str:
    return (
        f"{figure['median'] * scale:.{digits}f} "
        f"({figure['min'] * scale:.{digits}f} to {figure['max'] * scale:.{digits}f})"
    )


def side_by_side(bench: dict[str, Any]) -> str:
    """The benchmark's figures, one column per server."""
    servers = bench["servers"]
    names = list(servers)
    tps, idle, load = bench["tokens_per_s"], bench["ttft_idle_s"], bench["ttft_under_load_s"]
    rows = [
        ("version", [servers[n]["version"] for n in names]),
        (
            f"output tokens/s, {bench['concurrency']} concurrent requests of "
            f"{bench['max_tokens']} tokens (median, min to max of {bench['repeats']} rounds)",
            [_spread(tps[n]) for n in names],
        ),
        ("time to first token, idle (ms)", [_spread(idle[n], 1000) for n in names]),
        ("time to first token, under that load (ms)", [_spread(load[n], 1000) for n in names]),
        ("start-up (s)", [f"{servers[n]['startup_s']:.0f}" for n in names]),
        (
            "resident memory (GiB), processes",
            [f"{servers[n]['rss_gib']:.2f} in {servers[n]['processes']}" for n in names],
        ),
    ]
    greedy = bench["greedy"]
    ratio = bench["throughput_ratio_b_over_a_paired"]
    lines = [
        "## Side by side",
        "",
        f"`benchmarks/bench_vs_vllm.py` ran both servers on the same model directory, on "
        f"{_machine(bench)} (load average "
        f"{bench.get('load_average_1min_before', '?')} before, {bench['load_average_1min']} "
        "after), one compute thread each, alternating servers every round.",
        "",
        "| Figure | " + " | ".join(f"`{n}`" for n in names) + " |",
        "| --- |" + " ---: |" * len(names),
    ]
    lines += [f"| {label} | " + " | ".join(cells) + " |" for label, cells in rows]
    one, many = greedy["one_at_a_time"], greedy["all_at_once"]
    lines += [
        "",
        f"Throughput of `{names[1]}` over `{names[0]}`, paired round by round: median "
        f"{ratio['median']:.2f} ({ratio['min']:.2f} to {ratio['max']:.2f}). Greedy token ids: "
        f"{one['identical_tokens']} of {one['total_tokens']} identical one request at a time, "
        f"{many['identical_tokens']} of {many['total_tokens']} with all {greedy['prompts']} "
        "prompts at once.",
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
