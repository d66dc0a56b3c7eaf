"""The process rigs the transfer benchmarks share with the multi-process tests.

They live under `tests/` (`process_rigs.py`, `ipc_rigs.py`), not in the package; this module puts
that folder on the import path once, so a benchmark run as a script finds them.
"""

from __future__ import annotations

import sys
from pathlib import Path

_TESTS = str(Path(__file__).resolve().parents[1] / "tests")
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

from ipc_rigs import IPCReceiverProcess, deliver_to_processes  # noqa: E402
from process_rigs import (  # noqa: E402
    CommandProcess,
    allocate_tensors,
    fill_tensors,
    serve_commands,
)

__all__ = [
    "CommandProcess",
    "IPCReceiverProcess",
    "allocate_tensors",
    "deliver_to_processes",
    "fill_tensors",
    "serve_commands",
]
