"""The house rules a reader relies on: small files, short functions."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "weightsync"
MAX_FILE_LINES = 400
MAX_FUNCTION_CODE_LINES = 60


def _code_lines(source: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines of code in a function: no blank lines, comments or docstring."""
    lines = source[node.lineno - 1 : node.end_lineno]
    first = node.body[0]
    docstring = 0
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
        docstring = (first.end_lineno or first.lineno) - first.lineno + 1
    return sum(1 for line in lines if line.strip() and not line.strip().startswith("#")) - docstring


def test_no_module_is_longer_than_the_limit():
    long = {
        str(path.relative_to(PACKAGE)): n
        for path in PACKAGE.rglob("*.py")
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_FILE_LINES
    }
    assert not long, f"modules over {MAX_FILE_LINES} lines (split them by concept): {long}"


def test_no_function_is_longer_than_the_limit():
    long = {}
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        source = text.splitlines()
        for node in ast.walk(ast.parse(text)):
            is_function = isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            if is_function and (n := _code_lines(source, node)) > MAX_FUNCTION_CODE_LINES:
                long[f"{path.relative_to(PACKAGE)}:{node.name}"] = n
    assert not long, f"functions over {MAX_FUNCTION_CODE_LINES} lines of code: {long}"
