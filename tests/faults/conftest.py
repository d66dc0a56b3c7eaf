"""Fault cases: each one checks that it left no process, thread, port, fd or segment behind."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from leftovers import Snapshot, assert_none_left


@pytest.fixture
def no_leftovers() -> Iterator[Snapshot]:
    """Snapshot before the case; after it, everything the case started must be gone."""
    before = Snapshot.take()
    yield before
    assert_none_left(before)
