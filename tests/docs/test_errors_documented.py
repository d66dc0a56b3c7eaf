"""Every public error class, and every message the data plane can raise, is on the error pages.

Read statically. Every exception class the package defines under a public name, in any module,
has a row on the page. For each `WeightValidationError(...)`, `WeightTransferError(...)` or
`WeightTransferTimeout(...)` built in `src/weightsync/transfer/` or `src/weightsync/config.py`, one
of its message's literal parts of at least 20 characters is quoted on Troubleshooting or on
Transfer errors, so that a new or reworded message shows up here until a page explains it.
"""

from __future__ import annotations

import ast
import re

import pytest
from docs_support import DOCS, ROOT

ERRORS = {"WeightValidationError", "WeightTransferError", "WeightTransferTimeout"}
PACKAGE = ROOT / "src" / "weightsync"
HARNESSES = {"worker.py", "ipc_worker.py"}  # test rigs, on their way out of the package
SOURCES = [
    *(p for p in sorted((PACKAGE / "transfer").glob("*.py")) if p.name not in HARNESSES),
    PACKAGE / "config.py",
]
MIN_CHARS = 20


def _normalize(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip(" :;,.()")


def _literal_parts(node: ast.expr) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return [
            v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str)
        ]
    if isinstance(node, ast.BinOp):
        return _literal_parts(node.left) + _literal_parts(node.right)
    return []


def _messages() -> list[tuple[str, list[str]]]:
    found = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.Call) and node.args):
                continue
            name = node.func.id if isinstance(node.func, ast.Name) else ""
            if name not in ERRORS:
                continue
            parts = [_normalize(p) for p in _literal_parts(node.args[0])]
            parts = [p for p in parts if len(p) >= MIN_CHARS]
            if parts:
                found.append((f"{path.name}:{node.lineno}", parts))
    return found


MESSAGES = _messages()


def _troubleshooting() -> str:
    """The two pages that list the messages: the general one and the transfer's."""
    pages = (DOCS / "troubleshooting.md", DOCS / "transfer" / "errors.md")
    return "\n".join(page.read_text(encoding="utf-8") for page in pages)


def test_messages_are_found():
    assert len(MESSAGES) >= 50


@pytest.mark.parametrize(("where", "parts"), MESSAGES, ids=[where for where, _ in MESSAGES])
def test_message_is_documented(where: str, parts: list[str]):
    page = _normalize(_troubleshooting())
    assert any(part in page for part in parts), (
        f"{where}: quote one of {parts} in docs/troubleshooting.md (or docs/transfer/errors.md "
        "for a transfer's message), with its meaning and fix"
    )


def _bases(node: ast.ClassDef) -> set[str]:
    return {
        b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else ""
        for b in node.bases
    }


def _is_private(path) -> bool:
    """A module under a name with a leading underscore (its classes are nobody's API)."""
    return any(
        part.startswith("_") and part != "__init__.py" for part in path.relative_to(PACKAGE).parts
    )


def _public_error_classes() -> dict[str, str]:
    """Public exception classes defined in the package's public modules: name -> defining file."""
    classes: dict[str, tuple[str, set[str]]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name in HARNESSES:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                classes[node.name] = (str(path.relative_to(PACKAGE)), _bases(node))

    def is_error(name: str, seen: frozenset[str] = frozenset()) -> bool:
        if name in {"Exception", "BaseException"} or name.endswith(("Error", "Timeout")):
            return True
        return (
            name in classes
            and name not in seen
            and any(is_error(base, seen | {name}) for base in classes[name][1])
        )

    return {
        name: where
        for name, (where, bases) in classes.items()
        if not name.startswith("_")
        and not _is_private(PACKAGE / where)
        and any(is_error(base) for base in bases)
    }


PUBLIC_ERRORS = _public_error_classes()


def test_error_classes_are_found():
    assert {*ERRORS, "WeightSyncError", "EngineBusyError"} <= set(PUBLIC_ERRORS)


@pytest.mark.parametrize("name", sorted(PUBLIC_ERRORS))
def test_every_public_error_class_is_documented(name: str):
    page = (DOCS / "troubleshooting.md").read_text(encoding="utf-8")
    assert f"[`{name}`][weightsync.errors.{name}]" in page, (
        f"{name} ({PUBLIC_ERRORS[name]}) has no row on docs/troubleshooting.md; define it in "
        "weightsync/errors.py and document it, or make it private"
    )
