"""The Python code blocks of the built pages, as a reader's "copy" button gives them, and a runner.

What runs is what a reader copies: the text of each `<code>` element of the rendered page, taken
the way Material's copy button takes it (the element's text, code annotations left out, trailing
whitespace trimmed), not the Markdown source. Two markers, written in the Markdown, change how a
block runs:

- `<!-- skip: next "reason" -->` just before a block: the block is not run here (it needs CUDA,
  say); the tests report it as skipped with that reason. The comment passes into the HTML as is.
- A block whose title is "Continues the block above" (```` ```python title="Continues the block
  above" ````) runs in the same interpreter as the block before it, after it. The title is shown
  above the block, so the reader sees it too. Every other block runs alone, in a fresh interpreter
  started in an empty directory.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

CONTINUES = "Continues the block above"
SKIP = re.compile(r'^\s*skip:\s*next\s+"(?P<reason>[^"]*)"\s*$')
FENCE = re.compile(r"^(?P<indent>[ \t]*)```python\b(?P<info>[^\n]*)$", re.MULTILINE)


@dataclass
class CodeBlock:
    """One Python block of a page: its copied text and its markers."""

    text: str
    title: str = ""
    skip_reason: str | None = None

    @property
    def continues(self) -> bool:
        """Whether it runs after the block before it, in the same interpreter."""
        return self.title.startswith(CONTINUES)


@dataclass
class _Open:
    block: CodeBlock
    depth: int  # the div nesting depth of the block's wrapper
    parts: list[str] = field(default_factory=list)
    in_title: bool = False
    in_code: bool = False
    hidden_depth: int = 0  # > 0 inside an element the copy button leaves out


class _PythonBlocks(HTMLParser):
    """Collects the Python blocks of a page rendered by pymdownx.highlight."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.blocks: list[CodeBlock] = []
        self._skip: str | None = None  # a skip comment not yet followed by anything else
        self._open: _Open | None = None
        self._div_depth = 0

    def handle_comment(self, data: str) -> None:
        match = SKIP.match(data)
        self._skip = match["reason"] if match else None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        classes = (dict(attrs).get("class") or "").split()
        if tag == "div":
            self._div_depth += 1
        current = self._open
        if current is None:
            if tag == "div" and "highlight" in classes and "language-python" in classes:
                self._open = _Open(CodeBlock("", skip_reason=self._skip), self._div_depth)
            self._skip = None
            return
        if current.hidden_depth:
            current.hidden_depth += 1
        elif "md-annotation" in classes:
            current.hidden_depth = 1
        elif tag == "span" and "filename" in classes:
            current.in_title = True
        elif tag == "code":
            current.in_code = True

    def handle_endtag(self, tag: str) -> None:
        current = self._open
        if current is not None:
            if current.hidden_depth:
                current.hidden_depth -= 1
            elif tag == "span":
                current.in_title = False
            elif tag == "code":
                current.in_code = False
            if tag == "div" and self._div_depth == current.depth:
                current.block.text = "".join(current.parts).rstrip()
                self.blocks.append(current.block)
                self._open = None
        else:
            self._skip = None
        if tag == "div":
            self._div_depth -= 1

    def handle_data(self, data: str) -> None:
        current = self._open
        if current is None:
            if data.strip():
                self._skip = None
        elif current.hidden_depth:
            pass
        elif current.in_title:
            current.block.title += data.strip()
        elif current.in_code:
            current.parts.append(data)


def html_blocks(html: str) -> list[CodeBlock]:
    """The Python blocks of a built page, each with the text its copy button copies."""
    parser = _PythonBlocks()
    parser.feed(html)
    parser.close()
    return parser.blocks


def markdown_fence_lines(markdown: str) -> list[int]:
    """The 1-based line of every ```` ```python ```` fence of a Markdown source."""
    return [markdown.count("\n", 0, m.start()) + 1 for m in FENCE.finditer(markdown)]


def markdown_blocks(markdown: str) -> list[CodeBlock]:
    """The Python blocks of a Markdown file read as raw text (how GitHub's copy button gives them).

    Used for the README, which is read on GitHub rather than on the site.
    """
    blocks = []
    skip: str | None = None
    lines = markdown.splitlines()
    index = 0
    while index < len(lines):
        line = lines[index]
        comment = re.fullmatch(r"\s*<!--(.*)-->\s*", line)
        fence = FENCE.fullmatch(line)
        if comment:
            match = SKIP.match(comment[1])
            skip = match["reason"] if match else None
        elif fence:
            indent = len(fence["indent"])
            body = []
            index += 1
            while index < len(lines) and lines[index].strip() != "```":
                body.append(lines[index][indent:])
                index += 1
            title = re.search(r'title="([^"]*)"', fence["info"])
            blocks.append(CodeBlock("\n".join(body).rstrip(), title[1] if title else "", skip))
            skip = None
        elif line.strip():
            skip = None
        index += 1
    return blocks


def chains(blocks: list[CodeBlock]) -> list[list[int]]:
    """Indices of the blocks grouped by interpreter: a block and the blocks that continue it."""
    groups: list[list[int]] = []
    for index, block in enumerate(blocks):
        if block.continues and groups:
            groups[-1].append(index)
        else:
            groups.append([index])
    return groups


# Run in a fresh interpreter: reads the blocks as JSON on stdin, runs them in order in one
# namespace (like pasting them into one Python session), and writes one outcome per block to the
# file named by argv[1]: "ok", a traceback, or "not run" once an earlier block failed.
_RUNNER = r"""
import json, linecache, sys, traceback
blocks = json.load(sys.stdin)
outcomes = []
namespace = {"__name__": "__main__"}
failed = False
for name, text in blocks:
    if failed:
        outcomes.append("not run")
        continue
    # Tracebacks then quote the block's lines.
    linecache.cache[name] = (len(text), None, text.splitlines(True), name)
    try:
        exec(compile(text, name, "exec"), namespace)
        outcomes.append("ok")
    except BaseException:
        outcomes.append(traceback.format_exc())
        failed = True
with open(sys.argv[1], "w", encoding="utf-8") as out:
    json.dump(outcomes, out)
"""


def run_chain(
    named_texts: list[tuple[str, str]], python_path: Path, timeout_s: float = 240.0
) -> tuple[list[str], str]:
    """Runs blocks in order in one fresh interpreter, in an empty directory.

    Args:
        named_texts: `(name for tracebacks, code)` per block.
        python_path: Prepended to `PYTHONPATH` (the package's source tree).
        timeout_s: Bound on the whole run.

    Returns:
        One outcome per block ("ok", a traceback, or "not run"), and the interpreter's output.
    """
    with tempfile.TemporaryDirectory(prefix="weightsync-docs-block-") as directory:
        result_file = Path(directory) / ".outcomes.json"
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(python_path), env.get("PYTHONPATH", "")) if p
        )
        try:
            completed = subprocess.run(
                [sys.executable, "-c", _RUNNER, str(result_file)],
                input=json.dumps(named_texts),
                cwd=directory,
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired as error:
            output = "".join(
                part.decode(errors="replace") if isinstance(part, bytes) else part or ""
                for part in (error.stdout, error.stderr)
            )
            return [f"did not finish within {timeout_s:g} s"] * len(named_texts), output
        output = completed.stdout + completed.stderr
        if not result_file.is_file():
            reason = f"the interpreter exited with {completed.returncode} before reporting"
            return [reason] * len(named_texts), output
        outcomes: list[str] = json.loads(result_file.read_text(encoding="utf-8"))
        return outcomes, output
