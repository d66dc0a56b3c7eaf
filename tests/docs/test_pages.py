"""Every Python code block of the docs pages runs, in page order, with Sybil.

Blocks of one page share a namespace, like a reader pasting them into one Python session. A block
that cannot run here (it needs CUDA, say) is marked in the page with
`<!-- skip: next "reason" -->` and reported as skipped with that reason.
"""

from __future__ import annotations

import re
import unittest
from pathlib import Path

import pytest

sybil = pytest.importorskip("sybil")
from sybil import Document, Example  # noqa: E402
from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser  # noqa: E402

DOCS = Path(__file__).resolve().parents[2] / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md") if p.name != "SUMMARY.md")
PARSER = sybil.Sybil(parsers=[PythonCodeBlockParser(), SkipParser()])


class _Page:
    """A parsed page whose examples run once each, in order, whichever block is asked for first."""

    def __init__(self, path: Path) -> None:
        self.document: Document = PARSER.parse(path)
        self.examples: list[Example] = list(self.document)
        self.next = 0
        self.failed_at: int | None = None

    def code_blocks(self) -> list[int]:
        """Indices of the examples that are Python code blocks (not skip directives)."""
        return [i for i, e in enumerate(self.examples) if isinstance(e.parsed, str)]

    def run_through(self, index: int) -> None:
        if self.failed_at is not None and self.failed_at < index:
            pytest.fail(f"an earlier block of this page failed (line {self.line(self.failed_at)})")
        while self.next <= index:
            current = self.next
            self.next += 1
            try:
                self.examples[current].evaluate()
            except unittest.SkipTest:
                if current == index:
                    raise
            except Exception:
                self.failed_at = current
                raise

    def line(self, index: int) -> int:
        return self.examples[index].line


_PAGES = {path: _Page(path) for path in PAGES}
BLOCKS = [(path, i) for path, page in _PAGES.items() for i in page.code_blocks()]


def test_blocks_are_found():
    assert len(BLOCKS) >= 10, "the pages should hold runnable Python examples"


@pytest.mark.parametrize("path", PAGES, ids=[p.relative_to(DOCS).as_posix() for p in PAGES])
def test_every_python_fence_is_parsed(path: Path):
    """A fence Sybil cannot see would silently escape execution."""
    fences = len(re.findall(r"^\s*```python\b", path.read_text(encoding="utf-8"), re.MULTILINE))
    assert fences == len(_PAGES[path].code_blocks()), (
        f"{path.name}: some ```python fence is not parsed"
    )


@pytest.mark.parametrize(
    ("path", "index"),
    BLOCKS,
    ids=[f"{p.relative_to(DOCS).as_posix()}:{_PAGES[p].line(i)}" for p, i in BLOCKS],
)
def test_code_block(path: Path, index: int):
    _PAGES[path].run_through(index)
