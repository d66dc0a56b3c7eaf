"""Every error message the transfer library and its configuration can raise is on the Troubleshooting page.

Read statically: for each `WeightValidationError(...)`, `WeightTransferError(...)` or
`WeightTransferTimeout(...)` built in `src/weightsync/transfer/` or `src/weightsync/config.py`, one
of its message's literal parts of at least 20 characters is quoted on the page, so that a new or
reworded message shows up here until the page explains it. The process harnesses used by tests
and benchmarks (`worker.py`, `ipc_worker.py`) are not user-facing and are left out.
"""

from __future__ import annotations

import ast
import re

import pytest
from docs_support import DOCS, ROOT

ERRORS = {"WeightValidationError", "WeightTransferError", "WeightTransferTimeout"}
HARNESSES = {"worker.py", "ipc_worker.py"}
SOURCES = [
    p
    for p in sorted((ROOT / "src" / "weightsync" / "transfer").glob("*.py"))
    if p.name not in HARNESSES
] + [ROOT / "src" / "weightsync" / "config.py"]
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


def test_messages_are_found():
    assert len(MESSAGES) >= 50


@pytest.mark.parametrize(("where", "parts"), MESSAGES, ids=[where for where, _ in MESSAGES])
def test_message_is_documented(where: str, parts: list[str]):
    page = _normalize((DOCS / "troubleshooting.md").read_text(encoding="utf-8"))
    assert any(part in page for part in parts), (
        f"{where}: quote one of {parts} in docs/troubleshooting.md, with its meaning and fix"
    )


def test_every_error_class_is_documented():
    page = (DOCS / "troubleshooting.md").read_text(encoding="utf-8")
    for name in [*sorted(ERRORS), "WeightSyncError"]:
        assert f"[`{name}`]" in page, name
