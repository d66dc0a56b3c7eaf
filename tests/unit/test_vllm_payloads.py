"""vLLM's payloads are taken as vLLM's trainers send them (its init-info keys, the older four-key
init info, update infos without null fields, the per-rank list of a data-parallel trainer)."""

import pytest
import torch

from weightsync.errors import WeightValidationError
from weightsync.transfer.base import WeightTransferUpdateInfo
from weightsync.transfer.nccl import GlooWeightTransferEngine
from weightsync.transfer.nccl import _send_identity as send_identity

VLLM_INIT = {  # what vLLM 0.32's trainer sends its workers
    "master_address": "127.0.0.1", "master_port": 29555, "rank_offset": 1, "world_size": 2,
    "packed": True, "packed_buffer_size_bytes": 1 << 20, "packed_num_buffers": 3,
}  # fmt: skip


def test_vllms_init_keys_are_its_wire_parameters():
    info = GlooWeightTransferEngine().parse_init_info(VLLM_INIT)
    assert (info.bucket_size_bytes, info.num_buffers, info.packed) == (1 << 20, 3, True)
    assert info.backend == "gloo"  # a vLLM init info names none: the engine's own


def test_the_older_four_key_init_info_is_taken_by_a_gloo_engine():
    # It was refused: "init_info.backend is 'nccl'" (the dataclass's default).
    four = {k: VLLM_INIT[k] for k in ("master_address", "master_port", "rank_offset", "world_size")}
    info = GlooWeightTransferEngine().parse_init_info(four)
    assert info.backend == "gloo" and info.world_size == 2


def test_vllms_unique_id_rendezvous_and_conflicting_names_are_refused_by_name():
    engine = GlooWeightTransferEngine()
    with pytest.raises(WeightValidationError, match="nccl_unique_id_b64: vLLM's NCCL unique-id"):
        engine.parse_init_info({**VLLM_INIT, "nccl_unique_id_b64": "AAAA"})
    with pytest.raises(
        WeightValidationError, match=r"packed_num_buffers .* and init_info.num_buffers"
    ):
        engine.parse_init_info({**VLLM_INIT, "num_buffers": 2})
    assert engine.parse_init_info({**VLLM_INIT, "num_buffers": 3}).num_buffers == 3  # agreeing


@pytest.mark.parametrize(
    ("vllm_value", "value"), [(True, 1), (3.0, 3), (3, 3.0)], ids=["bool", "float", "float-ours"]
)
def test_both_names_of_a_wire_parameter_with_equal_values_of_other_types_are_refused(
    vllm_value, value
):
    # Neither value may be dropped unseen: the kept one would decide the group's wire.
    with pytest.raises(
        WeightValidationError, match=r"packed_num_buffers .* and init_info.num_buffers"
    ):
        GlooWeightTransferEngine().parse_init_info(
            {**VLLM_INIT, "packed_num_buffers": vllm_value, "num_buffers": value}
        )


def test_an_update_info_writes_no_null_field():
    bare = WeightTransferUpdateInfo.from_named_tensors([("w", torch.zeros(2))]).to_dict()
    assert "weight_version" not in bare and None not in bare.values()
    labelled = WeightTransferUpdateInfo.from_named_tensors(
        [("w", torch.zeros(2))], weight_version="v1"
    ).to_dict()
    assert labelled["weight_version"] == "v1"


# What TRL sends servers older than vLLM 0.28: the wire parameters in every update info.
VLLM_OLD_UPDATE = {"names": ["w"], "dtype_names": ["float32"], "shapes": [[2]], "packed": True}


def test_vllms_older_update_info_with_the_wire_parameters_is_taken():
    # It was refused: "unknown keys ['packed']".
    engine = GlooWeightTransferEngine()
    info = engine.parse_update_info(VLLM_OLD_UPDATE)
    assert (info.names, info.shapes) == (["w"], [[2]])
    defaults = {"packed_buffer_size_bytes": 1 << 30, "packed_num_buffers": 2}
    assert engine.parse_update_info({**VLLM_OLD_UPDATE, **defaults}).names == ["w"]


@pytest.mark.parametrize(
    ("key", "value"),
    [("packed", False), ("packed", 1), ("packed_buffer_size_bytes", 1 << 20),
     ("packed_num_buffers", 3), ("packed_num_buffers", 2.0)],
)  # fmt: skip
def test_an_update_info_whose_wire_parameters_differ_from_the_groups_is_refused_by_name(key, value):
    with pytest.raises(WeightValidationError, match=rf"update_info.{key} is {value!r}, but the"):
        GlooWeightTransferEngine().parse_update_info({**VLLM_OLD_UPDATE, key: value})


def test_the_wire_parameters_do_not_change_which_send_a_message_belongs_to():
    plain = {k: v for k, v in VLLM_OLD_UPDATE.items() if k != "packed"}
    assert send_identity(VLLM_OLD_UPDATE) == send_identity(plain)
