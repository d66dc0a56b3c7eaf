"""Griffe extension: renders a docstring's bare `>>>` examples as Python console code blocks.

weightsync's docstrings end with a short doctest (run by `pytest --doctest-modules`) without an
`Examples:` heading. Markdown would read `>>>` as nested block quotes and `[...]` in the expected
output as links; this wraps each run of doctest lines (up to the next blank line) that starts at
the docstring's left margin in a fenced `pycon` block, before the docstring is parsed. Examples
already inside a section or a fence are left alone.
"""

from __future__ import annotations

from typing import Any

import griffe


def fence_doctests(text: str) -> str:
    """Returns `text` with each left-margin run of doctest lines wrapped in a `pycon` fence."""
    out: list[str] = []
    in_fence = in_example = False
    for line in text.split("\n"):
        if in_example and not line.strip():
            out.append("```")
            in_example = False
        elif not in_example and not in_fence and line.startswith(">>>"):
            out.append("```pycon")
            in_example = True
        elif not in_example and line.lstrip().startswith(("```", "~~~")):
            in_fence = not in_fence
        out.append(line)
    if in_example:
        out.append("```")
    return "\n".join(out)


class DoctestBlocks(griffe.Extension):
    """Fences bare doctest examples in every docstring griffe loads."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Rewrites the object's docstring once the tree is built, before it is parsed."""
        if obj.docstring is not None and ">>>" in obj.docstring.value:
            obj.docstring.value = fence_doctests(obj.docstring.value)
