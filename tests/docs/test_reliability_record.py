"""docs/reliability.json, the reliability page's record, lists exactly the suite's cases.

The cases are the tests marked `reliability`; the record is written by running them with
`WEIGHTSYNC_RELIABILITY_RECORD` set (see docs/reliability.md). A case added, renamed or removed
without regenerating the record fails here, so the page cannot drift from the suite.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

from docs_support import ROOT

RECORD = ROOT / "docs" / "reliability.json"
SCRIPT = ROOT / "docs" / "gen" / "reliability_table.py"
FOLDERS = ("tests/unit", "tests/integration", "tests/faults")


def collected_cases() -> set[str]:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "-m", "reliability", *FOLDERS],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return {line for line in done.stdout.splitlines() if "::" in line}


def recorded() -> list[dict]:
    return json.loads(RECORD.read_text(encoding="utf-8"))["cases"]


def test_the_record_lists_exactly_the_suites_cases():
    collected = collected_cases()
    # A test that runs sub-cases (schemathesis: one per operation) records each as `test[sub]`.
    cases = {
        case["id"].split("[")[0] if case["id"].split("[")[0] in collected else case["id"]
        for case in recorded()
    }
    assert len(collected) >= 100
    missing, stale = sorted(collected - cases), sorted(cases - collected)
    assert not missing and not stale, (
        f"docs/reliability.json is stale: not recorded {missing[:10]}, no longer in the suite "
        f"{stale[:10]}; regenerate it as docs/reliability.md says"
    )


def test_every_case_says_how_it_ended_and_the_bad_input_table_has_60():
    cases = recorded()
    assert all(case["outcome"] and case["kind"] for case in cases)
    assert sum(case["kind"] == "bad-input" for case in cases) >= 60


def test_the_page_renders_every_case():
    spec = importlib.util.spec_from_file_location("reliability_table", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # imported under its own name: it renders nothing
    text = module.tables({"cases": recorded()})
    for case in recorded():
        assert case["id"].split("::", 1)[1].replace("|", "\\|") in text, case["id"]
    assert "requests_lost" in module.soak_table()
