"""Other people's RL clients, unmodified, against one `weightsync serve` of a tiny Qwen2 directory.

The tier needs the `ecosystem` extra (`pip install -e '.[ecosystem]'`); without a client's
package its tests skip. One server serves the whole tier: it starts once, in a few seconds.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# The server is started with the integration tests' helper (serve_support).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from serve_support import Server, serve_gloo

from model_dirs import write_model_dir


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Qwen2 checkpoint with its tokenizer and chat template."""
    return write_model_dir(tmp_path_factory.mktemp("qwen2"), "qwen2")


@pytest.fixture(scope="session")
def server(model_dir: Path) -> Iterator[Server]:
    """The tier's shared server (`serve_gloo`)."""
    yield from serve_gloo(model_dir)
