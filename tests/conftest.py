"""Shared test set-up: tests under integration/ and faults/ are marked `integration`; `gpu` tests skip
without CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
# Folders whose tests start real processes.
PROCESS_TIERS = (HERE / "integration", HERE / "faults")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        # The tier is where a test lives: `-m "not integration"` runs what needs no processes.
        if any(tier in item.path.parents for tier in PROCESS_TIERS):
            item.add_marker(pytest.mark.integration)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA; this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_ignore_collect(collection_path, config: pytest.Config) -> bool | None:
    # conftest files are plugins, loaded as such; --doctest-modules would also import each as a
    # module named "conftest", and two of them from different folders then collide.
    return True if collection_path.name == "conftest.py" else None
