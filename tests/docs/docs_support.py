"""Paths and the built-site record shared by the docs tests (fixtures live in `conftest`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
# The tests build as Read the Docs would, from this clone URL: every page then links the repository
# whatever this checkout's remote is (tests/docs/test_site.py).
CLONE_URL = "https://github.com/example/weightsync.git"
REPO_URL = "https://github.com/example/weightsync"


@dataclass
class BuiltSite:
    """The outcome of `mkdocs build --strict` with `DOCS_OFFLINE=1`."""

    directory: Path
    returncode: int
    log: str

    def require(self) -> Path:
        """The site directory; fails the calling test when the build failed."""
        if self.returncode != 0:
            pytest.fail(f"the strict docs build failed:\n{self.log}")
        return self.directory
