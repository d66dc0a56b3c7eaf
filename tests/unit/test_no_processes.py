"""The unit tier's guard: a unit test that starts a process fails, with a message saying where to go."""

import multiprocessing
import subprocess
import sys

import pytest


def _noop() -> None:
    pass


def test_starting_a_multiprocessing_process_fails_the_test():
    process = multiprocessing.get_context("spawn").Process(target=_noop)
    with pytest.raises(pytest.fail.Exception, match="tests/integration"):
        process.start()


def test_running_a_subprocess_fails_the_test():
    with pytest.raises(pytest.fail.Exception, match=r"subprocess\.Popen"):
        subprocess.run([sys.executable, "-c", "pass"], check=False)
