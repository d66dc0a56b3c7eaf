"""Plots the benchmark results committed in `benchmarks/results/*.json` onto the performance page.

Each results file is the JSON object a benchmark prints (`benchmarks/bench_*.py --json`). Every
file gets a section with one chart per kind of figure it holds (an SVG written here, no plotting
library needed), the figures as tables, the run's recorded settings, and the machine that produced
it. The kinds of figure, found by name at any nesting depth:

- `*_gbps`: transfer throughput; top-level figures form one group, each nested object holding
  `*_gbps` figures (e.g. `two_receivers`) another;
- `*_tokens_per_s`: decode throughput;
- `*_steps` and `*_seconds` objects whose values are percentile summaries (`{"p50", "p99", ...}`),
  one bar per key and percentile (e.g. pause latency per mode).

The machine is the file's `machine` object (`benchmarks/machine.py`), or, for files written before
benchmarks recorded it, the file's row in `benchmarks/results/README.md`. Adding a results file adds
its section; a file with no figure of a known kind is listed with its settings and no chart.
A `tokens_per_s_by_concurrency` object (concurrent requests -> output tokens/s) becomes a line.
The sections go where the page says `<!-- results -->`, plots first: a reader sees them first.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from html import escape
from pathlib import Path
from typing import Any

import mkdocs_gen_files

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
RESULTS_README = RESULTS / "README.md"
COLORS = ("#3f51b5", "#ff9800", "#009688", "#9c27b0", "#795548", "#607d8b")
# Settings shown under each chart, when the results file records them.
SETTINGS = {
    "backend": "backend",
    "model": "model preset",
    "parameters": "model parameters",
    "threads": "torch threads",
    "total_bytes": "bytes moved per update",
    "num_tensors": "tensors per update",
    "bucket_size_bytes": "bucket size (bytes)",
    "num_buffers": "buffers in flight",
    "num_buckets": "buckets per update",
    "repeats": "timed repetitions",
    "pause_streams": "concurrent streams while pausing",
    "pause_trials": "pauses per mode",
    "batching_speedup": "continuous batching speed-up",
    "resume_to_token_steps": "steps from resume to the next token (p99)",
    "mixed_repeats": "timed repetitions of the mixed figure",
    "cpu_count": "CPU cores",
    "load_average_1min": "load average at the end (1 min)",
    "torch": "torch",
    "transformers": "transformers",
}
PERCENTILES = ("p50", "p99")
# Each results file's section: its title and one sentence on what its plots show.
SUMMARIES = {
    "transfer_gloo": (
        "Transfer over gloo",
        "About 1 GiB of bfloat16 weights from a trainer process into one or two receivers, each "
        "way of moving them against one broadcast of one buffer (`raw`, the baseline).",
    ),
    "transfer_ipc": (
        "Transfer over shared memory (IPC)",
        "The same weights through shared memory, packed or zero-copy, against one `memcpy` (the "
        "baseline) and pickled tensors through a pipe (the naive way).",
    ),
    "transfer_http": (
        "Transfer through weightsync serve",
        "The same broadcast into a `weightsync serve` driven over HTTP against a bare receiver: "
        "the HTTP control calls cost nothing measurable.",
    ),
    "transfer_staging": (
        "Staging",
        "An update with `weight_update_staging` (a copy of each weight kept to restore on "
        "failure) against one without.",
    ),
    "disk": (
        "Filesystem updates (the disk backend)",
        "An engine's whole update from a checkpoint directory (headers checked, every tensor "
        "read into its weight, the version moved) against a raw read of the same files into "
        "buffers allocated beforehand, both from the page cache.",
    ),
    "engine": (
        "The engine against transformers",
        "Decode throughput of the engine and of `transformers`' `generate` on the same greedy "
        "requests (identical outputs), and how many steps each pause mode takes to land.",
    ),
    "engine_qwen2": (
        "The engine on a Qwen2-shaped model",
        "The same comparison on a Qwen2-shaped model with the real 151,936-token vocabulary.",
    ),
    "serve": (
        "The server against the engine in process",
        "64 concurrent streamed completions through `weightsync serve` against the same requests "
        "through `AsyncEngine` in process, and the steps a `keep` pause takes to land.",
    ),
    "replicas": (
        "Data-parallel replicas",
        "One whole weight update through a `--data-parallel-size N` server for N = 1, 2, 3, and "
        "the steps a `keep` pause takes to land on each replica.",
    ),
}

Groups = dict[str, dict[str, float]]


@dataclass
class Chart:
    """One chart of a results file: grouped bars in one unit."""

    slug: str
    title: str
    axis: str
    groups: Groups


def figure_groups(result: dict[str, Any]) -> Groups:
    """`{group label: {figure name: GB/s}}` from a results object."""

    def gbps(mapping: dict[str, Any]) -> dict[str, float]:
        return {
            key.removesuffix("_gbps"): float(value)
            for key, value in mapping.items()
            if key.endswith("_gbps") and isinstance(value, int | float)
        }

    nested = {
        key.replace("_", " "): gbps(value)
        for key, value in result.items()
        if isinstance(value, dict) and gbps(value)
    }
    top = gbps(result)
    label = "one receiver" if any(k.endswith("receivers") for k in nested) else "all"
    return {label: top, **nested} if top else nested


def _leaves(mapping: dict[str, Any]) -> list[tuple[str, Any]]:
    """Every `(key, value)` pair at any depth."""
    pairs = []
    for key, value in mapping.items():
        pairs.append((key, value))
        if isinstance(value, dict):
            pairs += _leaves(value)
    return pairs


def _percentile_groups(summaries: dict[str, Any]) -> Groups:
    """`{"p50": {key: value}, "p99": {...}}` from `{key: {"p50": ..., "p99": ...}}`."""
    return {
        stat: {key: float(summary[stat]) for key, summary in summaries.items()}
        for stat in PERCENTILES
    }


def charts(result: dict[str, Any]) -> list[Chart]:
    """The charts a results object gives, in a fixed order (see the module docstring)."""
    found = []
    if groups := figure_groups(result):
        found.append(
            Chart("", "throughput", "GB/s (10^9 bytes per second), higher is better", groups)
        )
    tokens = {
        key.removesuffix("_tokens_per_s").replace("_", " "): float(value)
        for key, value in _leaves(result)
        if key.endswith("_tokens_per_s") and isinstance(value, int | float)
    }
    if tokens:
        axis = "output tokens per second, higher is better"
        found.append(Chart("tokens", "decode throughput", axis, {"tokens/s": tokens}))
    for key, value in result.items():
        unit = {"_steps": "engine steps", "_seconds": "seconds"}.get(
            next((s for s in ("_steps", "_seconds") if key.endswith(s)), ""), ""
        )
        is_summary = (
            isinstance(value, dict)
            and value
            and all(
                isinstance(v, dict) and all(p in v for p in PERCENTILES) for v in value.values()
            )
        )
        if unit and is_summary:
            title = key.replace("_", " ")
            axis = f"{unit}, lower is better"
            found.append(Chart(key.replace("_", "-"), title, axis, _percentile_groups(value)))
    return found


def _number(value: float) -> str:
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10 or value == int(value):
        return f"{value:.1f}".removesuffix(".0")
    return f"{value:.2f}" if value >= 0.1 else f"{value:.3f}"


def bar_chart(groups: Groups, title: str, axis: str) -> str:
    """A horizontal grouped bar chart as a standalone SVG document."""
    names = list(dict.fromkeys(name for figures in groups.values() for name in figures))
    peak = max((v for figures in groups.values() for v in figures.values()), default=1.0) or 1.0
    bar_h, gap, label_w, plot_w, top = 18, 14, 150, 460, 56
    height = top + len(names) * (len(groups) * bar_h + gap) + 40
    width = label_w + plot_w + 90
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="13">',
        f'<rect width="{width}" height="{height}" fill="#ffffff"/>',
        f'<text x="10" y="22" font-size="15" font-weight="bold">{escape(title)}</text>',
    ]
    for index, group in enumerate(groups):
        x = label_w + index * 170
        color = COLORS[index % len(COLORS)]
        out.append(f'<rect x="{x}" y="32" width="12" height="12" fill="{color}"/>')
        out.append(f'<text x="{x + 18}" y="43">{escape(group)}</text>')
    y = top
    for name in names:
        out.append(
            f'<text x="{label_w - 8}" y="{y + len(groups) * bar_h / 2 + 4:.0f}" '
            f'text-anchor="end">{escape(name)}</text>'
        )
        for index, figures in enumerate(groups.values()):
            if name in figures:
                value = figures[name]
                w = max(1.0, plot_w * value / peak)
                color = COLORS[index % len(COLORS)]
                out.append(
                    f'<rect x="{label_w}" y="{y}" width="{w:.1f}" height="{bar_h - 3}" '
                    f'fill="{color}"/>'
                )
                out.append(
                    f'<text x="{label_w + w + 6:.1f}" y="{y + bar_h - 6}">{_number(value)}</text>'
                )
            y += bar_h
        y += gap
    out.append(f'<text x="{label_w}" y="{height - 12}" fill="#555555">{escape(axis)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def line_chart(points: dict[str, float], title: str) -> str:
    """Output tokens/s against concurrent requests, as a standalone SVG document.

    The x axis is logarithmic in the request counts (evenly spaced 1, 2, 4, ...).
    """
    counts = list(points)
    peak = max(points.values(), default=1.0) or 1.0
    left, top, plot_w, plot_h = 70, 40, 460, 240
    width, height = left + plot_w + 40, top + plot_h + 60

    def xy(index: int, value: float) -> tuple[float, float]:
        x = left + plot_w * index / max(1, len(counts) - 1)
        return x, top + plot_h * (1 - value / peak)

    coords = [xy(i, points[c]) for i, c in enumerate(counts)]
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="13">',
        f'<rect width="{width}" height="{height}" fill="#ffffff"/>',
        f'<text x="10" y="22" font-size="15" font-weight="bold">{escape(title)}</text>',
        f'<line x1="{left}" y1="{top + plot_h}" x2="{left + plot_w}" y2="{top + plot_h}" '
        'stroke="#555555"/>',
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + plot_h}" stroke="#555555"/>',
        f'<text x="{left - 8}" y="{top + 4}" text-anchor="end">{peak:.0f}</text>',
        f'<text x="{left - 8}" y="{top + plot_h + 4}" text-anchor="end">0</text>',
        '<polyline fill="none" stroke="{}" stroke-width="2" points="{}"/>'.format(
            COLORS[0], " ".join(f"{x:.1f},{y:.1f}" for x, y in coords)
        ),
    ]
    for count, (x, y) in zip(counts, coords, strict=True):
        out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3.5" fill="{COLORS[0]}"/>')
        out.append(
            f'<text x="{x:.1f}" y="{y - 8:.1f}" text-anchor="middle">{points[count]:.0f}</text>'
        )
        out.append(
            f'<text x="{x:.1f}" y="{top + plot_h + 18}" text-anchor="middle">{escape(count)}</text>'
        )
    out.append(
        f'<text x="{left}" y="{height - 12}" fill="#555555">concurrent requests (x) against '
        "output tokens/s (y), higher is better</text>"
    )
    out.append("</svg>")
    return "\n".join(out) + "\n"


def concurrency_lines(path: Path, points: dict[str, float], image: str) -> list[str]:
    """The tokens/s-by-concurrency chart (written to `image`) and table of one results file."""
    with mkdocs_gen_files.open(image, "w") as svg:
        svg.write(line_chart(points, f"{path.stem}: output tokens/s by concurrent requests"))
    lines = [f"![{path.stem}: output tokens/s by concurrent requests]({image})", ""]
    lines += ["| Concurrent requests | Output tokens/s |", "| ---: | ---: |"]
    lines += [f"| {count} | {value:.0f} |" for count, value in points.items()]
    return [*lines, ""]


def recorded_machines() -> dict[str, str]:
    """`{file name: machine}` from the table in `benchmarks/results/README.md`."""
    machines: dict[str, str] = {}
    if RESULTS_README.is_file():
        for line in RESULTS_README.read_text(encoding="utf-8").splitlines():
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            if len(cells) == 3 and (name := re.fullmatch(r"`([^`]+\.json)`", cells[0])):
                # "the same machine" refers to the row above.
                same = cells[2].lower().startswith("the same machine") and machines
                machines[name[1]] = list(machines.values())[-1] if same else cells[2]
    return machines


def machine_of(path: Path, result: dict[str, Any]) -> str:
    """Which machine produced a results file, in words."""
    machine = result.get("machine")
    if isinstance(machine, dict):
        gpus = machine.get("gpus") or []
        parts = [
            f"{machine.get('cores', '?')} cores, {machine.get('cpu', 'unknown CPU')}",
            ", ".join(gpus) if gpus else "no GPU",
            str(machine.get("os", "")),
            f"Python {machine.get('python', '?')}",
            f"torch {machine.get('torch', '?')}",
        ]
        return "; ".join(part for part in parts if part)
    recorded = recorded_machines().get(path.name)
    if recorded:
        return f"{recorded} (from `benchmarks/results/README.md`)"
    return "not recorded"


def _table(chart: Chart) -> list[str]:
    groups = chart.groups
    unit = chart.axis.split(",")[0]
    lines = [
        "| Figure | " + " | ".join(f"{group} ({unit})" for group in groups) + " |",
        "| --- |" + " ---: |" * len(groups),
    ]
    names = list(dict.fromkeys(name for figures in groups.values() for name in figures))
    for name in names:
        cells = [_number(figures[name]) if name in figures else "" for figures in groups.values()]
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return lines


def _setting(key: str, value: Any) -> str:
    """A setting's value for a reader: bytes in MiB, big counts grouped, other numbers rounded."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    if key.endswith("_bytes"):
        return f"{value / 2**20:,.0f} MiB"
    if isinstance(value, int):
        return f"{value:,}"
    return _number(value)


def settings_rows(result: dict[str, Any]) -> list[str]:
    """The run's settings and ratios, each once, labelled in words and rounded."""
    rows = {label: _setting(key, result[key]) for key, label in SETTINGS.items() if key in result}
    figures = [(k, v) for k, v in result.items() if not isinstance(v, dict)]
    for part, nested in result.items():  # ratios inside nested objects, e.g. `hf_mixed`
        if isinstance(nested, dict) and part != "machine":
            figures += [(f"{part} {key}", value) for key, value in nested.items()]
    for key, value in figures:
        if "ratio" in key and isinstance(value, int | float) and not isinstance(value, bool):
            rows.setdefault(key.replace("_", " "), f"{value:.2f}")
    return [f"| {label} | {value} |" for label, value in rows.items()]


def section(path: Path) -> str:
    """The performance page's section for one results file (writes its charts too).

    The plots come first, under one sentence on what they show and on which machine; the
    figures as numbers and the run's settings follow, folded.
    """
    result = json.loads(path.read_text(encoding="utf-8"))
    relative = path.relative_to(ROOT).as_posix()
    title, summary = SUMMARIES.get(path.stem, (f"`{path.stem}`", ""))
    lines = [
        f"### {title}",
        "",
        f"{summary} From `{relative}`, measured on: {machine_of(path, result)}.".strip(),
        "",
    ]
    tables: list[str] = []
    for chart in charts(result):
        stem = f"{path.stem}-{chart.slug}" if chart.slug else path.stem
        image = f"assets/benchmarks/{stem}.svg"
        with mkdocs_gen_files.open(image, "w") as svg:
            svg.write(bar_chart(chart.groups, f"{title}: {chart.title}", chart.axis))
        lines += [f"![{title}: {chart.title}]({image})", ""]
        tables += [*_table(chart), ""]
    if isinstance(result.get("tokens_per_s_by_concurrency"), dict):
        image = f"assets/benchmarks/{path.stem}-concurrency.svg"
        concurrency = concurrency_lines(path, result["tokens_per_s_by_concurrency"], image)
        lines += concurrency[:2]
        tables += concurrency[2:]
    tables += ["| Setting | Value |", "| --- | --- |", *settings_rows(result)]
    lines += [f'??? note "{title}: the figures and settings"', ""]
    lines += [f"    {line}".rstrip() for line in tables]
    lines.append("")
    return "\n".join(lines)


def main() -> None:
    """Puts one section per results file where `performance.md` says `<!-- results -->`."""
    order = list(SUMMARIES)
    paths = sorted(
        RESULTS.glob("*.json"),
        key=lambda p: (order.index(p.stem) if p.stem in order else len(order), p.stem),
    )
    results = "## Results\n\n" + (
        "\n".join(section(path) for path in paths) if paths else "No results are committed yet.\n"
    )
    with mkdocs_gen_files.open("performance.md", "r") as page:
        text = page.read()
    with mkdocs_gen_files.open("performance.md", "w") as page:
        page.write(text.replace("<!-- results -->", results, 1))


main()
