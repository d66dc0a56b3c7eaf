"""The "Read the code" page stays true: its files are the ones each update runs through, and
every function it names is defined where it says."""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from pathlib import Path

import pytest
from docs_support import DOCS, ROOT

PAGE = DOCS / "read-the-code.md"
PACKAGE = ROOT / "src" / "weightsync"
TOURS = {  # the page's section -> the update of benchmarks/reader_path.py it describes
    "## A broadcast update in one process": "readme",
    "## A shared-memory update": "ipc",
    "## The same update over HTTP": "http",
}
_FILE = re.compile(r"^(?:transfer|engine|serve|trainer)/\w+\.py$|^config\.py$")


def _sections() -> dict[str, str]:
    text = PAGE.read_text()
    parts = re.split(r"^(## .*)$", text, flags=re.M)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def _spans(text: str, *, links: bool = True) -> list[str]:
    """Code spans in order; with `links`, an autoref link `[`x`][a.b.c]` counts as `x` (the site's
    strict build checks where a link leads)."""
    if not links:
        text = re.sub(r"\[`[^`]+`\]\[[\w.]+\]", "", text)
    return re.findall(r"`([^`]+)`", text)


def _definitions(path: Path) -> set[str]:
    """Every name a reader can find in `path`: top-level names, `Class.method` and bare methods."""
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            for member in node.body:
                if isinstance(member, ast.FunctionDef | ast.AsyncFunctionDef):
                    names.update({member.name, f"{node.name}.{member.name}"})
    return names


def _named(section: str) -> list[tuple[str, str]]:
    """(file, name) for every name in the section's table rows, each read in the file before it."""
    found = []
    for row in (line for line in section.splitlines() if line.startswith("| ")):
        current = None
        for span in _spans(row, links=False):
            if _FILE.match(span):
                current = span
            elif current is not None and re.fullmatch(r"[A-Za-z_][\w.]*", span):
                found.append((current, span))
    return found


def _files(section: str) -> set[str]:
    return {span for span in _spans(section) if _FILE.match(span)}


@pytest.mark.parametrize("heading", list(TOURS))
def test_every_name_the_tour_gives_is_defined_in_its_file(heading):
    named = _named(_sections()[heading])
    assert named, f"{heading}: no function named"
    missing = [
        f"{file}: {name}" for file, name in named if name not in _definitions(PACKAGE / file)
    ]
    assert not missing, f"the page names what its file does not define: {missing}"


def test_the_transfer_table_lists_every_file_of_the_package():
    listed = _files(_sections()["## The files of `weightsync.transfer`"])
    actual = {
        f"transfer/{p.name}" for p in (PACKAGE / "transfer").glob("*.py") if p.name != "__init__.py"
    }
    assert listed == actual


@pytest.fixture(scope="module")
def recorded() -> dict[str, list[str]]:
    spec = importlib.util.spec_from_file_location("reader_path", ROOT / "benchmarks/reader_path.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["reader_path"] = module
    spec.loader.exec_module(module)
    return {name: figures["file_list"] for name, figures in module.measure().items()}


@pytest.mark.parametrize("heading", list(TOURS))
def test_the_tour_names_exactly_the_files_its_update_runs_through(heading, recorded):
    ran = {path.removeprefix("weightsync/") for path in recorded[TOURS[heading]]}
    assert _files(_sections()[heading]) == ran
