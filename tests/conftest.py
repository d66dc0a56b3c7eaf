"""Shared test set-up: `gpu`-marked tests skip cleanly where CUDA is absent."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
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
