import json

import pytest
import torch

from weightsync.errors import WeightValidationError
from weightsync.transfer.base import (
    TensorSpec,
    WeightTransferUpdateInfo,
    dtype_from_name,
    dtype_name,
)
from weightsync.transfer.base import _parse_info as parse_info
from weightsync.transfer.base import _validate_specs as validate_specs
from weightsync.transfer.nccl import NCCLWeightTransferInitInfo


def test_dtype_names_round_trip_and_refuse_unknown():
    for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.bool, torch.int64):
        assert dtype_from_name(dtype_name(dtype)) is dtype
    with pytest.raises(WeightValidationError, match="unknown dtype name 'Tensor'"):
        dtype_from_name("Tensor")  # a torch attribute, but not a dtype: never resolved
    with pytest.raises(WeightValidationError, match="cannot be transferred"):
        dtype_name(torch.quint8)


def test_update_info_round_trips_through_json():
    info = WeightTransferUpdateInfo(
        names=["a", "b"], dtype_names=["float32", "bool"], shapes=[[2, 3], []], weight_version=7
    )
    again = parse_info(
        WeightTransferUpdateInfo, json.loads(json.dumps(info.to_dict())), what="update_info"
    )
    assert again == info
    assert again.specs() == [
        TensorSpec("a", torch.float32, (2, 3)),
        TensorSpec("b", torch.bool, ()),
    ]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"names": ["a"], "dtype_names": [], "shapes": [[1]]},
            "equal lengths, got names=1, dtype_names=0, shapes=1",
        ),
        (
            {"names": ["a", "a"], "dtype_names": ["int8"] * 2, "shapes": [[1]] * 2},
            "'a' appears twice",
        ),
        (
            {"names": ["a"], "dtype_names": ["float33"], "shapes": [[1]]},
            "unknown dtype name 'float33'",
        ),
        (
            {"names": ["a"], "dtype_names": ["int8"], "shapes": [[-1]]},
            "shape of 'a' must be a list of non-negative ints",
        ),
        (
            {"names": ["a"], "dtype_names": ["int8"], "shapes": [[1] * 65]},
            "shape of 'a' has 65 dims, more than the 64 a tensor may have",
        ),
        ({"names": "a", "dtype_names": ["int8"], "shapes": [[1]]}, "names must be a list"),
        (
            {"names": ["a"], "dtype_names": ["int8"], "shapes": [[1]], "weight_version": True},
            "weight_version must be a string, an int or null, got bool",
        ),
    ],
)
def test_update_info_rejects_malformed_fields(fields, message):
    with pytest.raises(
        WeightValidationError, match=message.replace("[", r"\[").replace("(", r"\(")
    ):
        parse_info(WeightTransferUpdateInfo, fields, what="update_info")


def test_parse_info_names_unknown_and_missing_keys():
    with pytest.raises(WeightValidationError) as excinfo:
        parse_info(NCCLWeightTransferInitInfo, {"master_address": "h", "port": 1}, what="init_info")
    message = str(excinfo.value)
    assert (
        "unknown keys ['port']" in message
        and "missing keys ['master_port', 'world_size']" in message
    )
    with pytest.raises(WeightValidationError, match="must be a JSON object"):
        parse_info(NCCLWeightTransferInitInfo, [1, 2], what="init_info")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"world_size": 1}, "world_size must be an int >= 2"),
        ({"rank_offset": 0}, "rank_offset must be an int >= 1"),
        ({"master_port": 0}, "master_port must be an int in 1-65535"),
        ({"master_port": 65536}, "master_port must be an int in 1-65535"),
        ({"num_buffers": 0}, "num_buffers must be an int >= 1"),  # the wire, as in test_wire
    ],
)
def test_init_info_validates_each_field(override, message):
    fields = {"master_address": "127.0.0.1", "master_port": 1234, "world_size": 3, **override}
    with pytest.raises(WeightValidationError, match=message):
        parse_info(NCCLWeightTransferInitInfo, fields, what="init_info")


def test_validate_specs_lists_every_problem_at_once():
    expected = {
        "a": TensorSpec("a", torch.float32, (2,)),
        "b": TensorSpec("b", torch.bfloat16, (3,)),
    }
    incoming = [
        TensorSpec("a", torch.float32, (3,)),
        TensorSpec("b", torch.float16, (3,)),
        TensorSpec("zz", torch.int8, ()),
    ]
    with pytest.raises(WeightValidationError) as excinfo:
        validate_specs(incoming, expected)
    message = str(excinfo.value)
    assert "3 of 3 tensors" in message
    assert "'a': model has float32[2], update has float32[3]" in message
    assert "'b': model has bfloat16[3], update has float16[3]" in message
    assert "unknown name 'zz'" in message
    validate_specs(incoming[:0], expected)  # an empty update (or a subset) is fine


def test_an_update_info_of_something_else_than_tensors_names_the_weight():
    with pytest.raises(WeightValidationError, match=r"'a' is a str, not a torch.Tensor"):
        WeightTransferUpdateInfo.from_named_tensors([("a", "not a tensor")])
