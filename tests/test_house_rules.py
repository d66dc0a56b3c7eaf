"""The house rules a reader relies on: arrows that point one way, one concept per file, short
functions.

The source is read by `tests/house_scan.py` in a fresh interpreter, so no test that ran before
(and changed the recursion limit, say) can change what these rules see.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
PACKAGE = HERE.parent / "src" / "weightsync"
SOFT_MODULE_LINES = 500
"""A module longer than this says in its docstring why it is one concept ("One concept: ...")."""
MAX_FUNCTION_CODE_LINES = 60


@pytest.fixture(scope="module")
def modules() -> dict[str, dict]:
    scan = subprocess.run(
        [sys.executable, str(HERE / "house_scan.py"), str(PACKAGE)],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    return json.loads(scan.stdout)["modules"]


def test_the_scan_sees_the_whole_package(modules):
    assert len(modules) == len(list(PACKAGE.rglob("*.py")))
    assert "LLMEngine.step" in modules["weightsync.engine.llm_engine"]["functions"]
    # A name taken from the package's re-exports counts as an import of its own module, and an
    # import under TYPE_CHECKING counts too.
    assert "weightsync.engine.async_engine" in modules["weightsync.serve.cli"]["imports"]
    assert "weightsync.engine._processing" in modules["weightsync.engine._isolation"]["imports"]


def _cycles(graph: dict[str, list[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": ["b"], "b": []}) == []


def test_imports_point_one_way(modules):
    # Every import counts: at module level, in functions, under TYPE_CHECKING.
    graph = {name: m["imports"] for name, m in modules.items()}
    assert not _cycles(graph), f"import cycles (arrows must point one way): {_cycles(graph)}"


def test_a_long_module_says_why_it_is_one_concept(modules):
    # The budget is soft: a module cut to meet a number is worse than one long concept, so a
    # long one explains itself instead.
    unexplained = {
        name: m["lines"]
        for name, m in modules.items()
        if m["lines"] > SOFT_MODULE_LINES and "One concept:" not in m["docstring"]
    }
    assert not unexplained, (
        f"modules over {SOFT_MODULE_LINES} lines whose docstring does not say why they are one "
        f"concept ('One concept: ...'): {unexplained}"
    )


def test_no_function_is_longer_than_the_limit(modules):
    long = {
        f"{name}:{function}": n
        for name, m in modules.items()
        for function, n in m["functions"].items()
        if n > MAX_FUNCTION_CODE_LINES
    }
    assert not long, f"functions over {MAX_FUNCTION_CODE_LINES} lines of code: {long}"


INT_CHECK = "weightsync.transfer.base"
"""The one module that says what an integer is (`_is_int`: an int, and not a bool)."""


def test_one_integer_check(modules):
    # JSON's `true` must not pass for 1 anywhere, and the rule lives in one function, so that a
    # reader (and a fix) finds it in one place.
    copies = {
        name: m["int_checks"]
        for name, m in modules.items()
        if m["int_checks"] and name != INT_CHECK
    }
    assert not copies, (
        f"int checks spelled out inline (module: lines); call _is_int from {INT_CHECK}: {copies}"
    )
    assert modules[INT_CHECK]["int_checks"], "the scan no longer sees the one int check"
