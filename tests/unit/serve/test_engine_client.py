"""The RL routes call the engine as vLLM's routes call their engine client.

One server's routes call its `AsyncEngine` itself, with no layer between; a data-parallel front
offers the same calls, with the same parameters, over its replicas.
"""

import inspect

import pytest

from weightsync import AsyncEngine
from weightsync.serve import ServerConfig, create_app
from weightsync.serve._front.control import FleetControl
from weightsync.serve._rl_routes import EngineClient

CALLS = sorted(name for name in vars(EngineClient) if not name.startswith("_"))


def test_one_server_s_routes_call_its_engine_itself():
    engine = AsyncEngine("debug")
    app = create_app(engine, ServerConfig())
    assert app.state.engine_client is engine


@pytest.mark.parametrize("call", CALLS)
def test_the_front_offers_each_call_as_the_engine_names_it(call):
    def parameters(cls):
        member = inspect.getattr_static(cls, call)
        if isinstance(member, property):
            return "property"
        return [(p.name, p.kind, p.default) for p in inspect.signature(member).parameters.values()]

    assert parameters(FleetControl) == parameters(AsyncEngine)
