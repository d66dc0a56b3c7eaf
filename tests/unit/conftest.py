"""Unit tests run in this process only: any attempt to start another one fails the test.

Tests that need real processes (spawned engines, transfer groups across processes) belong in
tests/integration, where they are marked `integration`.
"""

from __future__ import annotations

import multiprocessing.process
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import pytest

from model_dirs import write_model_dir

# The one process a unit test may cause: the shared-memory janitor that every IPC trainer session
# starts (a watchdog that unlinks leftover segments if the trainer dies; it runs no test code).
# Without it the in-process IPC tests could not open a session at all.
_ALLOWED_CALLERS = {"SegmentJanitor.__init__"}


def _refuse(what: str, original: Any = None) -> Any:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        caller = sys._getframe(1).f_code.co_qualname
        if original is not None and caller in _ALLOWED_CALLERS:
            return original(*args, **kwargs)
        _fail(what)

    return refuse


def _fail(what: str) -> NoReturn:
    pytest.fail(
        f"a unit test tried to start a process ({what}); unit tests run in one process: "
        "move the test to tests/integration, or test the code without a process",
        pytrace=False,
    )


@pytest.fixture(autouse=True)
def _no_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every multiprocessing context (fork, spawn, forkserver, torch.multiprocessing) starts its
    # processes through BaseProcess.start; subprocess.run/call/check_output all build a Popen.
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", _refuse("Process.start"))
    popen = subprocess.Popen.__init__
    monkeypatch.setattr(subprocess.Popen, "__init__", _refuse("subprocess.Popen", popen))


@pytest.fixture(scope="session")
def family_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Builds (once per session) and returns the model directory of a family of `FAMILIES`."""
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = write_model_dir(tmp_path_factory.mktemp(name), name)
        return built[name]

    return get
