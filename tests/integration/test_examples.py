"""Every example in examples/rlhf runs to completion as a subprocess and checks its own outcome."""

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples" / "rlhf").glob("*.py"))


def test_examples_are_found():
    assert EXAMPLES, "examples/rlhf holds no example"


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs_and_checks_itself(path):
    result = subprocess.run(
        [sys.executable, str(path)], capture_output=True, text=True, timeout=240, check=False
    )
    assert result.returncode == 0, f"{path.name} failed:\n{result.stdout}\n{result.stderr}"
    assert "ok" in result.stdout.lower()
