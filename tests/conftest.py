"""Shared test set-up: tests under integration/, faults/ and ecosystem/ are marked `integration`;
`gpu` tests skip without CUDA."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
# Folders whose tests start real processes.
PROCESS_TIERS = (HERE / "integration", HERE / "faults", HERE / "ecosystem")


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


RELIABILITY_RECORD_ENV = "WEIGHTSYNC_RELIABILITY_RECORD"
"""Set to a file path, every `reliability` case appends a JSON line there: what it tried, and how
it ended (docs/gen/reliability_record.py turns the lines into docs/reliability.json)."""


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    report = yield
    marker = item.get_closest_marker("reliability")
    path = os.environ.get(RELIABILITY_RECORD_ENV)
    if marker is None or not path:
        return report
    if report.when != "call":
        if report.failed:  # a set-up, or a leftover check at tear-down, failed: say so
            entry = {"id": item.nodeid, "outcome": f"{report.when} failed"}
            with open(path, "a", encoding="utf-8") as f:
                f.write(json.dumps(entry) + "\n")
        return report
    doc = getattr(getattr(item, "function", None), "__doc__", None) or ""
    entry = {
        "id": item.nodeid,
        "kind": marker.args[0],
        "what": doc.strip().splitlines()[0] if doc.strip() else item.name,
        "outcome": report.outcome,
        "seconds": round(report.duration, 2),
        **dict(item.user_properties),
    }
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(entry, default=str) + "\n")
    return report
