"""The reliability page's tables, from the suite's own record (`docs/reliability.json`).

Run by mkdocs-gen-files, it appends to `reliability.md` an overview and one folded table per
kind of case (bad input through the Python API, the CLI and HTTP; schema fuzzing; faults; soak),
and the committed soak results (`benchmarks/results/soak/*.json`). Run as a script, it turns the
JSON lines that the suite writes when `WEIGHTSYNC_RELIABILITY_RECORD` is set into
`docs/reliability.json`:

    WEIGHTSYNC_RELIABILITY_RECORD=/tmp/record.jsonl pytest -m reliability tests/unit tests/integration tests/faults
    python docs/gen/reliability_table.py /tmp/record.jsonl

It reads JSON only (no torch, no weightsync), so the docs build needs neither.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RECORD = ROOT / "docs" / "reliability.json"
SOAK_RESULTS = ROOT / "benchmarks" / "results" / "soak"
SOAK_FIGURES = ("requests", "requests_aborted", "requests_lost", "tokens_received", "tokens_lost",
                "tokens_duplicated", "versions_non_monotonic", "rss_growth", "fds_left",
                "segments_left", "cycles", "clients", "seconds")  # fmt: skip
# Where a case was tried, by the file that holds it.
SURFACES = {
    "tests/unit/engine/test_bad_input.py": "Python API",
    "tests/unit/engine/test_stop_strings.py": "Python API, streamed outputs",
    "tests/unit/serve/test_cli_bad_input.py": "`weightsync serve` flags",
    "tests/integration/test_serve_bad_input.py": "HTTP routes (and the real command)",
    "tests/integration/test_serve_bad_checkpoint.py": "`weightsync serve DIR`: a damaged checkpoint",
    "tests/integration/test_serve_chat_template.py": "a hostile chat template, through the server",
    "tests/integration/test_serve_schema.py": "OpenAPI schema, generated requests",
    "tests/faults/test_serve_faults.py": "faults through the server",
    "tests/faults/test_serve_signals.py": "signals to a server and to a replica front",
    "tests/faults/test_serve_logs.py": "the server's log of an expected failure",
    "tests/integration/test_soak.py": "soak, short",
    "tests/integration/test_serve_rl.py": "the RL routes' keys, through the real command",
    "tests/unit/test_handshake.py": "the broadcast handshake: a refusal against every trainer timing",
    "tests/unit/test_group.py": "the broadcast group: world size and timeouts",
    "tests/faults/test_hostile_store.py": "a hostile process writing into a broadcast group's store",
    "tests/unit/engine/test_llm_engine.py": "`LLMEngine`",
    "tests/unit/serve/test_app.py": "the app in-process: keys, streamed text",
    "tests/unit/serve/test_server.py": "the HTTP server's connection limits",
    "tests/unit/trainer/test_http_client.py": "`HTTPEngineClient`",
    "tests/integration/test_refusals_side_effects.py": "a refused control call during an update or a pause",
    "tests/integration/test_vllm_client_recovery.py": "a client that knows only vLLM's calls, after a refusal",
    "tests/integration/test_serve_sleep.py": "sleep and wake up, through the server",
}
DETAILS = ("error", "status", "exit_status", "message", "seconds_to_error", "max_examples")


def merge(lines: list[str]) -> dict[str, Any]:
    """The record's JSON lines as the committed object: one entry per case, sorted by id."""
    cases: dict[str, dict[str, Any]] = {}
    for line in lines:
        entry = json.loads(line)
        if entry["id"] in cases and "kind" not in entry:  # a failed set-up or tear-down
            cases[entry["id"]]["outcome"] = entry["outcome"]
        else:
            cases[entry["id"]] = entry
    return {"cases": [cases[key] for key in sorted(cases)]}


def _cell(value: Any) -> str:
    text = str(value).replace("|", "\\|").replace("\n", " ")
    return f"`{text}`" if text else ""


def _case_rows(cases: list[dict[str, Any]]) -> list[str]:
    """One row per case; a file of distinct tests (not one table) also says what each does."""
    distinct = len({case["what"] for case in cases}) > 1
    head = "| Case | What | Seen | Outcome |" if distinct else "| Case | Seen | Outcome |"
    rows = [head, "| --- | --- | --- | --- |" if distinct else "| --- | --- | --- |"]
    for case in cases:
        name = _cell(case["id"].split("::", 1)[1])
        seen = "; ".join(f"{key}: {_cell(case[key])}" for key in DETAILS if key in case)
        what = f" {case['what']} |" if distinct else ""
        rows.append(f"| {name} |{what} {seen} | {case['outcome']} |")
    return rows


def tables(record: dict[str, Any]) -> str:
    """The page's tables: one line per surface, then its cases, each surface's table folded."""
    by_file: dict[str, list[dict[str, Any]]] = {}
    for case in record["cases"]:
        by_file.setdefault(case["id"].split("::", 1)[0], []).append(case)
    total = len(record["cases"])
    passed = sum(case["outcome"] == "passed" for case in record["cases"])
    lines = [
        "## What the suite tried",
        "",
        f"{passed} of {total} cases passed in the recorded run. Each surface's cases, with what "
        "each expected and saw, are folded under it.",
        "",
        "| Where | Cases | Passed |",
        "| --- | ---: | ---: |",
    ]
    for path, cases in sorted(by_file.items()):
        ok = sum(case["outcome"] == "passed" for case in cases)
        lines.append(f"| {SURFACES.get(path, f'`{path}`')} | {len(cases)} | {ok} |")
    lines.append("")
    for path, cases in sorted(by_file.items()):
        surface = SURFACES.get(path, path)
        intro = "" if len({c["what"] for c in cases}) > 1 else f": {cases[0]['what']}"
        lines += [f"### {surface}", "", f"`{path}`{intro}", ""]
        lines += [f'??? note "{len(cases)} cases"', ""]
        lines += [f"    {row}" for row in _case_rows(cases)]
        lines.append("")
    return "\n".join(lines)


def soak_table() -> str:
    """The committed soak results, one column per run."""
    runs = {path.stem: json.loads(path.read_text()) for path in sorted(SOAK_RESULTS.glob("*.json"))}
    if not runs:
        return ""
    lines = [
        "## Load held",
        "",
        "`python benchmarks/soak.py --json` (see its docstring for each figure):",
        "",
    ]
    lines += ["| Figure | " + " | ".join(f"`{name}`" for name in runs) + " |"]
    lines += ["| --- |" + " --- |" * len(runs)]
    for figure in ("backend", *SOAK_FIGURES):
        lines.append(
            f"| {figure} | " + " | ".join(_cell(r.get(figure, "")) for r in runs.values()) + " |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    """Appends the tables to `reliability.md` (run by mkdocs-gen-files)."""
    import mkdocs_gen_files

    record = json.loads(RECORD.read_text(encoding="utf-8"))
    with mkdocs_gen_files.open("reliability.md", "a") as page:
        page.write("\n" + soak_table() + "\n" + tables(record))


if __name__ == "__main__":
    RECORD.write_text(
        json.dumps(merge(Path(sys.argv[1]).read_text().splitlines()), indent=1) + "\n"
    )
elif __name__ == "<run_path>":  # mkdocs-gen-files runs its scripts with runpy.run_path
    main()
