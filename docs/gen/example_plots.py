"""Pictures of example runs, drawn at build time from logs committed in `benchmarks/results/examples/`.

An example that accepts `--log PATH` writes its run as JSON; `docs/gen/example_pages.py` calls
`pictures` for each example page, which writes SVG files (by hand, no plotting library) and
returns the Markdown that shows them. An example without a committed log gets no pictures.

- `async_rl.json`: the mean reward of every batch (the learning curve) and one batch's rollouts,
  each token coloured by the weight version that drew it.
- `pause_resume.json`: per pause mode, each request's tokens placed at the engine step that
  produced them, coloured by weight version, with the pause marked.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from html import escape
from pathlib import Path
from typing import Any

import mkdocs_gen_files

ROOT = Path(__file__).resolve().parents[2]
LOGS = ROOT / "benchmarks" / "results" / "examples"
VERSION_COLORS = ("#c5cae9", "#ffcc80", "#b2dfdb", "#e1bee7", "#d7ccc8")
FONT = 'font-family="sans-serif" font-size="13"'


def _printable(token: str) -> str:
    """The token as one visible character: control and undecodable bytes become a middle dot."""
    return token if len(token) == 1 and token.isprintable() and token != "\ufffd" else "\u00b7"


def _svg(width: float, height: float, body: list[str]) -> str:
    return "\n".join(
        [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
            f'viewBox="0 0 {width:.0f} {height:.0f}" {FONT}>',
            f'<rect width="{width:.0f}" height="{height:.0f}" fill="#ffffff"/>',
            *body,
            "</svg>",
            "",
        ]
    )


def _legend(versions: list[Any], x: float, y: float, label: str = "weight version") -> list[str]:
    out = [f'<text x="{x}" y="{y + 11}">{escape(label)}:</text>']
    x += 8 * len(label) + 16
    for index, version in enumerate(versions):
        color = VERSION_COLORS[index % len(VERSION_COLORS)]
        out.append(
            f'<rect x="{x}" y="{y}" width="14" height="14" fill="{color}" stroke="#555555"/>'
        )
        out.append(f'<text x="{x + 20}" y="{y + 11}">{escape(str(version))}</text>')
        x += 30 + 8 * len(str(version))
    return out


def learning_curve(rewards: list[float], marked: int) -> str:
    """Mean reward per batch as a line, batch `marked` highlighted."""
    left, top, plot_w, plot_h = 60, 40, 520, 220
    width, height = left + plot_w + 30, top + plot_h + 60
    last = max(len(rewards) - 1, 1)

    def x(i: float) -> float:
        return left + plot_w * i / last

    def y(v: float) -> float:
        return top + plot_h * (1 - v)

    body = ['<text x="10" y="22" font-size="15" font-weight="bold">mean reward per batch</text>']
    for tick in (0.0, 0.25, 0.5, 0.75, 1.0):
        body.append(
            f'<line x1="{left}" y1="{y(tick):.1f}" x2="{left + plot_w}" y2="{y(tick):.1f}" '
            'stroke="#e0e0e0"/>'
        )
        body.append(f'<text x="{left - 8}" y="{y(tick) + 4:.1f}" text-anchor="end">{tick:g}</text>')
    for i in range(0, len(rewards), 5):
        body.append(f'<text x="{x(i):.1f}" y="{top + plot_h + 18}" text-anchor="middle">{i}</text>')
    body.append(
        f'<line x1="{x(marked):.1f}" y1="{top}" x2="{x(marked):.1f}" y2="{top + plot_h}" '
        'stroke="#ff9800" stroke-dasharray="4 3"/>'
    )
    body.append(
        f'<text x="{x(marked) + 4:.1f}" y="{top + plot_h - 6}" fill="#e65100">'
        f"batch {marked}, below</text>"
    )
    points = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(rewards))
    body.append(f'<polyline points="{points}" fill="none" stroke="#3f51b5" stroke-width="2"/>')
    body += [
        f'<circle cx="{x(i):.1f}" cy="{y(v):.1f}" r="2.5" fill="#3f51b5"/>'
        for i, v in enumerate(rewards)
    ]
    body.append(
        f'<text x="{left + plot_w / 2}" y="{height - 12}" text-anchor="middle" fill="#555555">'
        "batch (drawn by the policies of the step before and of its own step)</text>"
    )
    return _svg(width, height, body)


def token_grid(rollouts: list[dict[str, Any]], title: str) -> str:
    """One row per rollout, one cell per token, filled by the token's weight version."""
    versions = sorted({v for r in rollouts for v in r["weight_versions"]})
    colors = {v: VERSION_COLORS[i % len(VERSION_COLORS)] for i, v in enumerate(versions)}
    cell_w, cell_h, left, top = 20, 20, 46, 62
    columns = max(len(r["tokens"]) for r in rollouts)
    width = left + columns * cell_w + 70
    height = top + len(rollouts) * cell_h + 16
    body = [f'<text x="10" y="22" font-size="15" font-weight="bold">{escape(title)}</text>']
    body += _legend(versions, 10, 34)
    body.append(f'<text x="{left + columns * cell_w + 8}" y="{top - 6}">reward</text>')
    for row, rollout in enumerate(rollouts):
        y = top + row * cell_h
        body.append(f'<text x="{left - 6}" y="{y + 14}" text-anchor="end">{row + 1}</text>')
        for col, (token, version) in enumerate(
            zip(rollout["tokens"], rollout["weight_versions"], strict=True)
        ):
            x = left + col * cell_w
            body.append(
                f'<rect x="{x}" y="{y}" width="{cell_w - 1}" height="{cell_h - 1}" '
                f'fill="{colors[version]}"/>'
            )
            body.append(
                f'<text x="{x + cell_w / 2 - 0.5}" y="{y + 14}" text-anchor="middle" '
                f'font-family="monospace">{escape(_printable(token))}</text>'
            )
        if "reward" in rollout:
            body.append(
                f'<text x="{left + columns * cell_w + 8}" y="{y + 14}">{rollout["reward"]:.2f}</text>'
            )
    return _svg(width, height, body)


def step_grid(scenario: dict[str, Any]) -> str:
    """A scenario's requests, each token at the engine step that produced it; the pause marked."""
    requests = scenario["requests"]
    versions = sorted({v for r in requests.values() for v in r["weight_versions"]})
    colors = {v: VERSION_COLORS[i % len(VERSION_COLORS)] for i, v in enumerate(versions)}
    last_step = max((max(r["steps"], default=0) for r in requests.values()), default=1)
    cell_w, cell_h, left, top = 24, 22, 40, 76
    width = max(left + last_step * cell_w + 150, 460)  # room for the labels and the caption
    height = top + len(requests) * cell_h + 40
    mode = f"mode={scenario['mode']!r}, clear_cache={scenario['clear_cache']}"
    body = [f'<text x="10" y="22" font-size="15" font-weight="bold">{escape(mode)}</text>']
    body += _legend(versions, 10, 34)
    pause_x = left + scenario["resumed_at_step"] * cell_w
    body.append(
        f'<line x1="{pause_x}" y1="{top - 14}" x2="{pause_x}" y2="{top + len(requests) * cell_h}" '
        'stroke="#d32f2f" stroke-width="2"/>'
    )
    body.append(
        f'<text x="{pause_x + 4}" y="{top - 4}" fill="#d32f2f">pause, update, resume</text>'
    )
    for row, (request_id, request) in enumerate(requests.items()):
        y = top + row * cell_h
        body.append(f'<text x="{left - 8}" y="{y + 15}" text-anchor="end">{request_id}</text>')
        for token, step, version in zip(
            request["tokens"], request["steps"], request["weight_versions"], strict=True
        ):
            x = left + (step - 1) * cell_w
            body.append(
                f'<rect x="{x}" y="{y}" width="{cell_w - 1}" height="{cell_h - 1}" '
                f'fill="{colors[version]}"/>'
            )
            body.append(
                f'<text x="{x + cell_w / 2}" y="{y + 15}" text-anchor="middle" '
                f'font-family="monospace">{escape(_printable(token))}</text>'
            )
        end = left + (max(request["steps"], default=0)) * cell_w + 6
        body.append(
            f'<text x="{end}" y="{y + 15}" fill="#555555">{request["finish_reason"]}</text>'
        )
    body.append(
        f'<text x="{left}" y="{height - 12}" fill="#555555">engine step 1 to {last_step}, '
        "left to right; each cell is one token</text>"
    )
    return _svg(width, height, body)


def _write(path: str, svg: str) -> None:
    with mkdocs_gen_files.open(path, "w") as out:
        out.write(svg)


def _async_rl(log: dict[str, Any]) -> list[str]:
    batch = log["batch"]
    rollouts = batch["rollouts"]
    per_prompt = log["args"]["samples"]
    shown = rollouts[: 2 * per_prompt]
    _write("examples/assets/async_rl-reward.svg", learning_curve(log["mean_reward"], batch["step"]))
    title = f"batch {batch['step']}: the rollouts of the first two prompts"
    _write("examples/assets/async_rl-versions.svg", token_grid(shown, title))
    land_at = log["args"]["land_at"]
    versions = sorted({v for r in rollouts for v in r["weight_versions"]})
    straddle = sum(len(set(r["weight_versions"])) > 1 for r in rollouts)
    return [
        f"The mean reward of each batch over a run of {log['args']['steps']} steps (seed "
        f"{log['args']['seed']}): from a random policy to one that speaks in syllables.",
        "",
        "![Mean reward per batch](assets/async_rl-reward.svg)",
        "",
        f"Batch {batch['step']} token by token (its first {len(shown)} of {len(rollouts)} "
        "rollouts; a dot is a byte that does not print). Each token is coloured by the weight "
        f"version that drew it: the engine paused in `keep` mode when every rollout had "
        f"{land_at} tokens, took version {versions[-1]} and went on, so "
        f"{straddle} of {len(rollouts)} rollouts start with version {versions[0]} and end with "
        f"version {versions[-1]}, and the trainer knows exactly which tokens each policy drew.",
        "",
        "![Tokens of one batch coloured by weight version](assets/async_rl-versions.svg)",
    ]


def _pause_resume(log: dict[str, Any]) -> list[str]:
    lines = [
        f"Each scenario asks for the pause after engine step {log['pause_at']}. Each row is a "
        "request, each cell one of its tokens, placed at the engine step that produced it and "
        "coloured by weight version; the red line is where the pause landed, the engine took "
        "version 1 and resumed (no step runs while it is paused). Tokens left of the line came "
        "before the pause, tokens right of it after. `D` arrived during the pause.",
        "",
    ]
    for scenario in log["scenarios"]:
        name = f"{scenario['mode']}-{'clear' if scenario['clear_cache'] else 'keep-kv'}"
        _write(f"examples/assets/pause_resume-{name}.svg", step_grid(scenario))
        caption = f"mode={scenario['mode']}, clear_cache={scenario['clear_cache']}"
        lines += [f"![{caption}](assets/pause_resume-{name}.svg)", ""]
    return lines


DRAWERS: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "async_rl": _async_rl,
    "pause_resume": _pause_resume,
}


def pictures(stem: str) -> list[str]:
    """Markdown lines showing the pictures of example `stem`'s committed log (none if no log)."""
    path = LOGS / f"{stem}.json"
    if stem not in DRAWERS or not path.is_file():
        return []
    log = json.loads(path.read_text(encoding="utf-8"))
    relative = path.relative_to(ROOT).as_posix()
    command = f"python examples/rlhf/{stem}.py --log {relative}"
    return [
        "## What a run looks like",
        "",
        f"Drawn when the site is built from `{relative}`, which `{command}` writes.",
        "",
        *DRAWERS[stem](log),
        "",
    ]
