"""Fixtures of the engine tests (helpers live in `engine_helpers`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from engine_helpers import SOURCES, LocalSource, debug_model

from weightsync.engine.model import LlamaForCausalLM


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    # Tiny matmuls gain nothing from a second thread, and spinning threads slow down sharply
    # when other processes share the cores.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session", name="debug_model")
def debug_model_fixture() -> LlamaForCausalLM:
    return debug_model(seed=0)


@pytest.fixture(scope="session")
def new_weights() -> dict[str, torch.Tensor]:
    """A second set of weights for the debug model, as a trainer would push them."""
    return {n: t.clone() for n, t in debug_model(seed=1).named_weights()}


@pytest.fixture
def local_source(request: pytest.FixtureRequest) -> Iterator[LocalSource]:
    source = LocalSource(request.node.nodeid)
    SOURCES[source.key] = source
    yield source
    del SOURCES[source.key]
