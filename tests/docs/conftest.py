"""Docs tests: one strict build of the site per session, and a summary of the executed code blocks."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from docs_support import CLONE_URL, ROOT, BuiltSite


@pytest.fixture(scope="session")
def built_site(tmp_path_factory: pytest.TempPathFactory) -> BuiltSite:
    pytest.importorskip(
        "mkdocs", reason="the docs tools are not installed: pip install -e '.[docs]'"
    )
    site = tmp_path_factory.mktemp("site")
    env = {
        **os.environ,
        "DOCS_OFFLINE": "1",
        "READTHEDOCS_GIT_CLONE_URL": CLONE_URL,
        "DISABLE_MKDOCS_2_WARNING": "true",
        "NO_MKDOCS_2_WARNING": "1",
    }
    command = [sys.executable, "-m", "mkdocs", "build", "--strict"]
    result = subprocess.run(
        [*command, "-f", str(ROOT / "mkdocs.yml"), "-d", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    return BuiltSite(site, result.returncode, result.stdout + result.stderr)


# --- "N ran, M skipped" for the code blocks of the pages (tests/docs/test_pages.py) -------------

_BLOCK_OUTCOMES: dict[str, tuple[str, str]] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if "test_pages.py::test_code_block[" not in report.nodeid:
        return
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        reason = ""
        if report.skipped and isinstance(report.longrepr, tuple):
            reason = str(report.longrepr[2]).removeprefix("Skipped: ")
        _BLOCK_OUTCOMES[report.nodeid] = (report.outcome, reason)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _BLOCK_OUTCOMES:
        return
    outcomes = [outcome for outcome, _ in _BLOCK_OUTCOMES.values()]
    reasons = sorted(
        {reason for outcome, reason in _BLOCK_OUTCOMES.values() if outcome == "skipped"}
    )
    line = (
        f"docs code blocks: {outcomes.count('passed')} ran, {outcomes.count('skipped')} skipped "
        f"as not runnable here, {outcomes.count('failed')} failed"
    )
    terminalreporter.write_sep("-", line)
    for reason in reasons:
        terminalreporter.write_line(f"  skipped: {reason}")
