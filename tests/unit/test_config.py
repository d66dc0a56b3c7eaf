import pytest

from weightsync.config import WeightTransferConfig, parse_weight_transfer_config
from weightsync.errors import WeightValidationError
from weightsync.transfer.base import _default_registry, _EngineRegistry
from weightsync.transfer.nccl import GlooWeightTransferEngine

FLAG = "--weight-transfer-config"


def test_unknown_backend_lists_known_ones():
    with pytest.raises(
        WeightValidationError,
        match=r"unknown weight transfer backend 'tcp'; known backends: .*gloo.*nccl",
    ):
        WeightTransferConfig(backend="tcp")


@pytest.mark.parametrize(
    "argv",
    [
        [FLAG, '{"backend": "gloo"}'],
        [f'{FLAG}={{"backend": "gloo"}}'],
        [f"{FLAG}.backend", "gloo"],
        [f"{FLAG}.backend=gloo"],
        [FLAG, '{"backend": "nccl"}', f"{FLAG}.backend", "gloo"],  # dotted keys override
    ],
)
def test_parse_both_forms(argv):
    config, rest = parse_weight_transfer_config(["--port", "8000", *argv, "--verbose"])
    assert config == WeightTransferConfig(backend="gloo")
    assert rest == ["--port", "8000", "--verbose"]


def test_absent_flag_gives_none():
    assert parse_weight_transfer_config(["--other", "1"]) == (None, ["--other", "1"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([FLAG, '{"backend": gloo}'], r"must be a JSON object like .*Expecting value at column 13"),
        ([FLAG, '["gloo"]'], "must be a JSON object"),
        ([f"{FLAG}.bakend", "gloo"], r"unknown keys \['bakend'\]; valid keys: \['backend'\]"),
        ([FLAG, '{"packed": true}'], r"unknown keys \['packed'\]"),
        ([f"{FLAG}.backend"], "needs a value"),
        ([f"{FLAG}.backend", "tcp"], "unknown weight transfer backend 'tcp'"),
    ],
)
def test_parse_errors_are_clear(argv, message):
    with pytest.raises(WeightValidationError, match=message):
        parse_weight_transfer_config(argv)


def test_registry_register_lazy_duplicate_and_create():
    registry = _EngineRegistry()
    registry.register("cpu-broadcast", "weightsync.transfer.nccl:GlooWeightTransferEngine")
    assert registry.get("cpu-broadcast") is GlooWeightTransferEngine
    with pytest.raises(WeightValidationError, match="already registered; pass replace=True"):
        registry.register("cpu-broadcast", GlooWeightTransferEngine)
    registry.register("cpu-broadcast", GlooWeightTransferEngine, replace=True)
    engine = registry.create("cpu-broadcast", worker_index=1)
    assert isinstance(engine, GlooWeightTransferEngine) and engine.worker_index == 1
    registry.register("broken", "weightsync.config:WeightTransferConfig")
    with pytest.raises(WeightValidationError, match="not a WeightTransferEngine subclass"):
        registry.get("broken")
    with pytest.raises(WeightValidationError, match=r"package\.module:ClassName"):
        registry.register("bad", "no_colon_here")


def test_third_party_backend_is_selectable_by_config():
    class MyEngine(GlooWeightTransferEngine):
        pass

    _default_registry.register("test-third-party", MyEngine)
    try:
        assert isinstance(
            WeightTransferConfig(backend="test-third-party").create_engine(), MyEngine
        )
    finally:
        _default_registry._engines.pop("test-third-party")
