"""WireParams: the one place the four wire parameters get their defaults and their checks."""

import math

import pytest

from weightsync.errors import WeightValidationError
from weightsync.transfer.base import WireParams


def test_defaults_and_dict_form():
    wire = WireParams()
    assert wire.to_dict() == {
        "packed": True,
        "bucket_size_bytes": 1 << 30,
        "num_buffers": 2,
        "timeout_s": 120.0,
    }
    assert WireParams(**wire.to_dict()) == wire


def test_timeout_is_stored_as_float():
    assert isinstance(WireParams(timeout_s=5).timeout_s, float)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"packed": 1}, "packed must be a bool, got 1"),
        ({"bucket_size_bytes": 0}, r"bucket_size_bytes must be an int >= 1 \(bytes\), got 0"),
        ({"bucket_size_bytes": -5}, "bucket_size_bytes must be an int >= 1"),
        ({"bucket_size_bytes": True}, "bucket_size_bytes must be an int >= 1.*got True"),
        ({"bucket_size_bytes": 1.5}, "bucket_size_bytes must be an int"),
        ({"num_buffers": 0}, "num_buffers must be an int >= 1, got 0"),
        ({"num_buffers": True}, "num_buffers must be an int >= 1, got True"),
        ({"timeout_s": 0}, "timeout_s must be a finite number of seconds > 0, got 0"),
        ({"timeout_s": -1.0}, "timeout_s must be a finite number"),
        ({"timeout_s": math.nan}, "timeout_s must be a finite number.*got nan"),
        ({"timeout_s": math.inf}, "timeout_s must be a finite number.*got inf"),
        ({"timeout_s": True}, "timeout_s must be a finite number.*got True"),
        ({"timeout_s": "5"}, "timeout_s must be a finite number"),
    ],
)
def test_each_field_is_refused_by_name(fields, message):
    with pytest.raises(WeightValidationError, match=message):
        WireParams(**fields)


def test_wire_params_are_frozen():
    with pytest.raises(AttributeError):
        WireParams().packed = False  # type: ignore[misc]


def test_build_takes_an_object_or_keywords_not_both():
    wire = WireParams(num_buffers=3)
    assert WireParams.build(wire) is wire
    assert WireParams.build(None, num_buffers=3) == wire
    assert WireParams.build() == WireParams()
    with pytest.raises(WeightValidationError, match="not both"):
        WireParams.build(wire, num_buffers=3)
    with pytest.raises(WeightValidationError, match="wire must be a WireParams, got dict"):
        WireParams.build({"num_buffers": 3})  # type: ignore[arg-type]
    with pytest.raises(WeightValidationError, match=r"unknown wire parameters \['bucket_mb'\]"):
        WireParams.build(bucket_mb=3)


def test_a_client_waits_longer_than_the_transfer_step_it_waits_for():
    import inspect

    from weightsync.trainer.engine_process import EngineProcess
    from weightsync.trainer.http_client import HTTPEngineClient
    from weightsync.transfer.base import CLIENT_MARGIN_S, DEFAULT_TIMEOUT_S

    assert WireParams().timeout_s == DEFAULT_TIMEOUT_S
    assert WireParams(timeout_s=7).client_timeout_s == 7 + CLIENT_MARGIN_S
    for client in (HTTPEngineClient, EngineProcess):
        default = inspect.signature(client).parameters["timeout_s"].default
        assert default == WireParams().client_timeout_s > WireParams().timeout_s, client
