"""Fault cases: each one checks that it left no process, thread, port, fd or segment behind."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from leftovers import Snapshot, assert_none_left

# Fault cases through the server start it with the integration tests' helper (serve_support).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))


@pytest.fixture
def no_leftovers() -> Iterator[Snapshot]:
    """Snapshot before the case; after it, everything the case started must be gone."""
    before = Snapshot.take()
    yield before
    assert_none_left(before)
