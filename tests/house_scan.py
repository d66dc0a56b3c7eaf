"""Reads the package's source as text and prints what the house rules check, as one JSON object.

Run as a script (`python tests/house_scan.py src/weightsync`) by `tests/test_house_rules.py`, in
a fresh interpreter: `ast.parse` on some Python 3.11 releases fails with "AST constructor
recursion depth mismatch" after another test changed the recursion limit, so parsing in the test
process would make the rules depend on which tests ran before.

The object: `{"modules": {dotted name: {"lines": n, "docstring": text, "imports": [dotted names
of package modules it imports], "functions": {qualified name: code lines}, "int_checks": [line
numbers]}}}`. Every import counts: at module level, inside functions, under `TYPE_CHECKING`. A
name imported from a package (`from weightsync import AsyncEngine`) counts as an import of the
module that defines it, which the package's `__init__` re-exports. An int check is a line that
spells out "an int and not a bool" instead of calling the package's one check.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path


def _code_lines(source: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines of code in a function: no blank lines, comments or docstring."""
    lines = source[node.lineno - 1 : node.end_lineno]
    first = node.body[0]
    docstring = 0
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
        docstring = (first.end_lineno or first.lineno) - first.lineno + 1
    return sum(1 for line in lines if line.strip() and not line.strip().startswith("#")) - docstring


def _functions(tree: ast.Module, source: list[str]) -> dict[str, int]:
    found: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                found[prefix + child.name] = _code_lines(source, child)
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def _int_checks(tree: ast.Module) -> list[int]:
    """Lines that test "an int and not a bool" inline: `isinstance(x, int)` beside
    `isinstance(x, bool)` on the same `x`, in one boolean expression."""

    def isinstance_of(node: ast.AST, names: set[str]) -> str | None:
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "isinstance"
            and len(node.args) == 2
        ):
            return None
        kinds = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
        return ast.dump(node.args[0]) if kinds & names and "float" not in kinds else None

    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.BoolOp):
            calls = [n.operand if isinstance(n, ast.UnaryOp) else n for n in node.values]
            ints = {isinstance_of(c, {"int"}) for c in calls} - {None}
            bools = {isinstance_of(c, {"bool"}) for c in calls} - {None}
            if ints & bools:
                found.add(node.lineno)
    return sorted(found)


def _imported(tree: ast.Module, module: str, is_package: bool) -> list[tuple[str, str | None]]:
    """`(module, name)` for each import: `name` is what `from module import name` takes."""
    package = module if is_package else module.rsplit(".", 1)[0]
    found: list[tuple[str, str | None]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            found += [(base, alias.name) for alias in node.names]
    return found


def scan(root: Path) -> dict[str, object]:
    """The house facts of the package whose folder is `root`."""
    files = {}
    for path in sorted(root.rglob("*.py")):
        parts = (root.name, *path.relative_to(root).with_suffix("").parts)
        files[".".join(parts).removesuffix(".__init__")] = path
    trees = {name: ast.parse(path.read_text(encoding="utf-8")) for name, path in files.items()}
    packages = {name for name, path in files.items() if path.name == "__init__.py"}
    raw = {name: _imported(trees[name], name, name in packages) for name in files}
    # What each package's __init__ re-exports: name -> the module it comes from.
    exports = {
        package: {name: source for source, name in raw[package] if name and source in files}
        for package in packages
    }

    def target(source: str, name: str | None) -> str | None:
        if name is not None and f"{source}.{name}" in files:
            return f"{source}.{name}"  # a submodule
        while source in packages and name is not None and name in exports[source]:
            source, name = exports[source][name], name  # a name the package re-exports
            if f"{source}.{name}" in files:
                return f"{source}.{name}"
        if source in files and source not in packages:
            return source
        return None

    modules = {}
    for name, path in files.items():
        text = path.read_text(encoding="utf-8")
        imports = {target(source, imported) for source, imported in raw[name]}
        imports.discard(None)
        imports.discard(name)
        modules[name] = {
            "lines": len(text.splitlines()),
            "docstring": ast.get_docstring(trees[name]) or "",
            "imports": sorted(m for m in imports if m is not None and m not in packages),
            "functions": _functions(trees[name], text.splitlines()),
            "int_checks": _int_checks(trees[name]),
        }
    return {"modules": modules}


if __name__ == "__main__":
    print(json.dumps(scan(Path(sys.argv[1]))))
