"""Every Python code block a reader may copy runs on its own, as the built page gives it.

The text run is taken from the built HTML, the way the page's copy button gives it
(`tests/docs/code_blocks.py`), for the hand-written pages under `docs/`; the README's blocks are
taken from its Markdown, which is what GitHub shows. Each block runs alone in a fresh interpreter
in an empty directory, except a block titled "Continues the block above", which runs after the
block before it in the same interpreter. A block marked `<!-- skip: next "reason" -->` is reported
as skipped with that reason.

The generated pages' code runs elsewhere: each example page embeds a script that
`tests/integration/test_examples.py` runs, and the API pages' examples are doctests.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from code_blocks import (
    CodeBlock,
    chains,
    html_blocks,
    markdown_blocks,
    markdown_fence_lines,
    run_chain,
)
from docs_support import DOCS, ROOT, BuiltSite

README = ROOT / "README.md"
PAGES = sorted(p for p in DOCS.rglob("*.md") if p.name != "SUMMARY.md")
SOURCES = [README, *PAGES]


def _name(path: Path) -> str:
    return path.relative_to(ROOT if path == README else DOCS).as_posix()


def _html_path(site: Path, page: Path) -> Path:
    """Where mkdocs (with directory URLs) writes the page built from `page`."""
    relative = page.relative_to(DOCS).with_suffix("")
    if relative.name == "index":
        relative = relative.parent
    return site / relative / "index.html"


FENCE_LINES = {path: markdown_fence_lines(path.read_text(encoding="utf-8")) for path in SOURCES}
BLOCKS = [(path, i) for path in SOURCES for i in range(len(FENCE_LINES[path]))]


class _Runs:
    """Runs each chain of blocks once, whichever of its blocks a test asks for first."""

    def __init__(self, site: Callable[[], BuiltSite]) -> None:
        self._site = site  # built on first use: the README's blocks need no site
        self._outcomes: dict[tuple[Path, int], str] = {}
        self._blocks: dict[Path, list[CodeBlock]] = {}

    def blocks(self, path: Path) -> list[CodeBlock]:
        """The page's Python blocks as a reader copies them."""
        if path not in self._blocks:
            if path == README:
                self._blocks[path] = markdown_blocks(path.read_text(encoding="utf-8"))
            else:
                html = _html_path(self._site().require(), path)
                assert html.is_file(), f"{_name(path)} was not built to {html}"
                self._blocks[path] = html_blocks(html.read_text(encoding="utf-8"))
        return self._blocks[path]

    def outcome(self, path: Path, index: int) -> str:
        """The block's outcome ("ok", a traceback, or why it did not run); runs its chain once."""
        if (path, index) not in self._outcomes:
            blocks = self.blocks(path)
            chain = next(c for c in chains(blocks) if index in c)
            skipped = [i for i in chain if blocks[i].skip_reason is not None]
            if skipped:
                # A block that continues a skipped one cannot run either.
                for i in chain:
                    if i > skipped[0]:
                        self._outcomes[path, i] = f"skip: continues the skipped block {skipped[0]}"
                chain = [i for i in chain if i < skipped[0]]
            lines = FENCE_LINES[path]
            named = [(f"{_name(path)}, block at line {lines[i]}", blocks[i].text) for i in chain]
            outcomes, output = run_chain(named, ROOT / "src") if named else ([], "")
            for i, outcome in zip(chain, outcomes, strict=True):
                if outcome not in ("ok", "not run"):
                    outcome = f"{outcome}\n--- the interpreter's output ---\n{output}"
                self._outcomes[path, i] = outcome
        return self._outcomes[path, index]


@pytest.fixture(scope="session")
def runs(request: pytest.FixtureRequest) -> _Runs:
    return _Runs(lambda: request.getfixturevalue("built_site"))


def test_blocks_are_found():
    assert len(BLOCKS) >= 10, "the pages should hold runnable Python examples"


@pytest.mark.parametrize("path", SOURCES, ids=[_name(p) for p in SOURCES])
def test_every_python_fence_is_a_python_block(path: Path, runs: _Runs):
    """A fence the HTML shows other than as a Python block would silently escape execution."""
    blocks = runs.blocks(path)
    assert len(blocks) == len(FENCE_LINES[path]), (
        f"{_name(path)}: {len(FENCE_LINES[path])} ```python fences, {len(blocks)} Python blocks "
        "in the built page"
    )
    for index, block in enumerate(blocks):
        assert block.text.strip(), f"{_name(path)}: block {index} copies as empty text"
        if path == README:
            assert not block.continues, "README blocks must run alone (GitHub shows no title)"
        elif index == 0:
            assert not block.continues, f"{_name(path)}: the first block continues nothing"


@pytest.mark.parametrize(
    ("path", "index"),
    BLOCKS,
    ids=[f"{_name(p)}:{FENCE_LINES[p][i]}" for p, i in BLOCKS],
)
def test_code_block(path: Path, index: int, runs: _Runs):
    blocks = runs.blocks(path)
    if index >= len(blocks):
        pytest.fail(f"{_name(path)} has fewer Python blocks in its built page than fences")
    if blocks[index].skip_reason is not None:
        pytest.skip(blocks[index].skip_reason)
    outcome = runs.outcome(path, index)
    if outcome.startswith("skip: "):
        pytest.skip(outcome.removeprefix("skip: "))
    if outcome == "not run":
        pytest.fail("the block it continues failed")
    assert outcome == "ok", outcome


def test_markers_are_read_from_the_html():
    """A skip comment applies to the block right after it only; a title marks a continuation."""
    html = (
        '<p>Intro</p>\n<!-- skip: next "needs CUDA" -->\n\n'
        '<div class="language-python highlight"><pre><span></span><code>'
        '<a id="l1"></a>x = 1 &lt; 2\n</code></pre></div>\n'
        '<!-- skip: next "stale" -->\n<p>Then:</p>\n'
        '<div class="language-python highlight"><span class="filename">Continues the block above'
        '</span><pre><span></span><code>print(x)<span class="md-annotation">(1)</span>\n\n'
        "</code></pre></div>\n"
        '<div class="language-bash highlight"><pre><code>ls</code></pre></div>'
    )
    first, second = html_blocks(html)
    assert (first.text, first.skip_reason, first.continues) == ("x = 1 < 2", "needs CUDA", False)
    assert (second.text, second.skip_reason, second.continues) == ("print(x)", None, True)
    assert chains([first, second]) == [[0, 1]]


def test_the_pages_use_both_markers(runs: _Runs):
    blocks = [block for path in SOURCES for block in runs.blocks(path)]
    assert any(block.skip_reason for block in blocks), "no block is marked skipped any more"
    assert any(block.continues for block in blocks), "no block continues another any more"
