"""The house rules a reader relies on: small files, short functions.

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
MAX_FILE_LINES = 400
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


def test_no_module_is_longer_than_the_limit(modules):
    long = {name: m["lines"] for name, m in modules.items() if m["lines"] > MAX_FILE_LINES}
    assert not long, f"modules over {MAX_FILE_LINES} lines (split them by concept): {long}"


def test_no_function_is_longer_than_the_limit(modules):
    long = {
        f"{name}:{function}": n
        for name, m in modules.items()
        for function, n in m["functions"].items()
        if n > MAX_FUNCTION_CODE_LINES
    }
    assert not long, f"functions over {MAX_FUNCTION_CODE_LINES} lines of code: {long}"
