"""Every example in examples/rlhf runs to completion as a subprocess and checks its own outcome.

The exit code is the verdict: each example checks what it demonstrates (bytes equal, reward
risen, pause promises kept) and exits non-zero when a check fails; what it prints is for people.
An example that cannot run on this machine (a missing optional dependency, say) prints why and
exits with code 77, and is skipped.
"""

import subprocess
import sys
from pathlib import Path

import pytest

SKIPPED = 77  # an example's exit code for "cannot run here"
EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples" / "rlhf").glob("*.py"))


def test_examples_are_found():
    assert EXAMPLES, "examples/rlhf holds no example"


@pytest.mark.slow
@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs_and_checks_itself(path):
    result = subprocess.run(
        [sys.executable, str(path)], capture_output=True, text=True, timeout=240, check=False
    )
    if result.returncode == SKIPPED:
        pytest.skip(result.stdout.strip() or f"{path.name} cannot run here")
    assert result.returncode == 0, f"{path.name} failed:\n{result.stdout}\n{result.stderr}"
