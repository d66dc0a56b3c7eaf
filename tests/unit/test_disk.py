"""The `disk` backend: a checkpoint directory checked against the model, then loaded in place."""

import json
import os
import struct
import threading

import pytest
import torch

from weightsync import EngineConfig, LLMEngine, WeightTransferConfig
from weightsync.engine.model import LlamaForCausalLM
from weightsync.errors import WeightTransferError, WeightValidationError
from weightsync.transfer._safetensors import write_safetensors
from weightsync.transfer.disk import (
    DiskWeightTransferEngine,
    DiskWeightTransferUpdateInfo,
    save_weight_dir,
)


def _weights(model):
    return {name: tensor.clone() for name, tensor in model.named_weights()}


def _same(model, weights) -> bool:
    return all(torch.equal(t, weights[name]) for name, t in model.named_weights())


def _raw_file(path, header: bytes, data: bytes = b"") -> None:
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


def _entry(dtype="F32", shape=(2,), offsets=(0, 8)):
    return {"w": {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}}


HOSTILE = {
    "too short": lambda p: p.write_bytes(b"\x01\x02"),
    "length past the file": lambda p: p.write_bytes(struct.pack("<Q", 1 << 40) + b"{}"),
    "not JSON": lambda p: _raw_file(p, b"{not json"),
    "not an object": lambda p: _raw_file(p, b"[1, 2]"),
    "nested too deep": lambda p: _raw_file(p, b"[" * 100_000 + b"]" * 100_000),
    "entry not an object": lambda p: _raw_file(p, json.dumps({"w": 3}).encode()),
    "unknown dtype": lambda p: _raw_file(p, json.dumps(_entry(dtype="F128")).encode(), b"\0" * 8),
    "dtype not a string": lambda p: _raw_file(p, json.dumps(_entry(dtype=[])).encode(), b"\0" * 8),
    "negative dim": lambda p: _raw_file(p, json.dumps(_entry(shape=(-2,))).encode(), b"\0" * 8),
    "dim past int64": lambda p: _raw_file(  # no bytes (a dim 0), yet no tensor can have it
        p, json.dumps(_entry(shape=(0, 1 << 64), offsets=(0, 0))).encode()
    ),
    "thousands of dims": lambda p: _raw_file(  # their product would take minutes
        p, json.dumps(_entry(shape=(3,) * 300_000, offsets=(0, 8))).encode(), b"\0" * 8
    ),
    "bool dim": lambda p: _raw_file(p, json.dumps(_entry(shape=(True,))).encode(), b"\0" * 8),
    "offsets past the data": lambda p: _raw_file(
        p, json.dumps(_entry(offsets=(0, 8))).encode(), b"\0" * 4
    ),
    "offsets not the shape's size": lambda p: _raw_file(
        p, json.dumps(_entry(offsets=(0, 4))).encode(), b"\0" * 8
    ),
    "offsets not ints": lambda p: _raw_file(
        p, json.dumps(_entry(offsets=("0", "8"))).encode(), b"\0" * 8
    ),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_header_is_refused_and_nothing_changes(tmp_path, case):
    model = LlamaForCausalLM.from_preset("debug", seed=1)
    before = _weights(model)
    save_weight_dir(LlamaForCausalLM.from_preset("debug", seed=2).named_weights(), tmp_path)
    HOSTILE[case](tmp_path / "model-00002.safetensors")  # beside a valid file
    engine = DiskWeightTransferEngine(expected_specs=model.weight_specs())
    with pytest.raises(WeightValidationError, match=r"model-00002\.safetensors"):
        engine.receive_weights({"path": str(tmp_path)}, model.load_weights)
    assert _same(model, before)


@pytest.mark.parametrize("fault", ["unknown name", "wrong shape", "wrong dtype", "missing"])
def test_a_directory_that_does_not_fit_the_model_is_refused_before_any_write(tmp_path, fault):
    model = LlamaForCausalLM.from_preset("debug", seed=1)
    before = _weights(model)
    tensors = _weights(LlamaForCausalLM.from_preset("debug", seed=2))
    name = "model.layers.0.mlp.down_proj.weight"
    if fault == "unknown name":
        tensors["model.layers.9.mlp.down_proj.weight"] = tensors[name]
    elif fault == "wrong shape":
        tensors[name] = tensors[name][:, :-1].contiguous()
    elif fault == "wrong dtype":
        tensors[name] = tensors[name].to(torch.bfloat16)
    else:
        del tensors[name]
    save_weight_dir(tensors.items(), tmp_path)
    loads = []
    engine = DiskWeightTransferEngine(expected_specs=model.weight_specs())
    with pytest.raises(WeightValidationError, match="before any byte moved") as refused:
        engine.receive_weights({"path": str(tmp_path)}, loads.append)
    assert "model.layers" in str(refused.value)
    assert loads == []
    assert _same(model, before)


def test_a_directory_loads_every_weight_in_place_fused_ones_included(tmp_path):
    model = LlamaForCausalLM.from_preset("debug", seed=1)
    policy = LlamaForCausalLM.from_preset("debug", seed=2)
    info = save_weight_dir(policy.named_weights(), tmp_path, weight_version="step-3")
    assert info == {"path": str(tmp_path), "weight_version": "step-3"}
    loads = []  # every weight, fused ones' row blocks included, is read in place
    engine = DiskWeightTransferEngine(
        expected_specs=model.weight_specs(), params=dict(model.named_weights())
    )
    stats = engine.receive_weights(info, loads.append)
    assert loads == []
    assert _same(model, _weights(policy))
    assert stats.num_tensors == len(policy.weight_specs())
    assert stats.num_bytes == sum(s.nbytes for s in policy.weight_specs().values())


def test_shards_follow_their_index(tmp_path):
    model = LlamaForCausalLM.from_preset("debug", seed=1)
    policy = LlamaForCausalLM.from_preset("debug", seed=2)
    _two_shards(tmp_path, policy)
    DiskWeightTransferEngine(expected_specs=model.weight_specs()).receive_weights(
        {"path": str(tmp_path)}, model.load_weights
    )
    assert _same(model, _weights(policy))

    index = tmp_path / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    weight_map[next(iter(weight_map))] = "b.safetensors"  # the index disagrees with the files
    index.write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(WeightValidationError, match="maps"):
        DiskWeightTransferUpdateInfo.from_directory(tmp_path)


def test_not_a_checkpoint_directory_is_refused(tmp_path):
    with pytest.raises(WeightValidationError, match="not a directory"):
        DiskWeightTransferUpdateInfo.from_directory(tmp_path / "absent")
    with pytest.raises(WeightValidationError, match=r"no \*\.safetensors"):
        DiskWeightTransferUpdateInfo.from_directory(tmp_path)
    engine = DiskWeightTransferEngine()
    with pytest.raises(WeightValidationError, match="unknown keys"):
        engine.receive_weights({"path": str(tmp_path), "names": []}, print)


def test_an_index_nested_too_deep_is_refused_naming_it(tmp_path):
    save_weight_dir(LlamaForCausalLM.from_preset("debug", seed=2).named_weights(), tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(WeightValidationError, match=r"index\.json: not readable JSON: .*deep"):
        DiskWeightTransferUpdateInfo.from_directory(tmp_path)


@pytest.mark.parametrize(
    "file", ["a\x00.safetensors", "a\ud800.safetensors"], ids=["nul", "surrogate"]
)
def test_an_index_naming_a_file_no_path_can_hold_is_refused_naming_it(tmp_path, file):
    model = LlamaForCausalLM.from_preset("debug", seed=2)
    save_weight_dir(model.named_weights(), tmp_path)
    index = {"weight_map": dict.fromkeys(model.weight_specs(), file)}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(WeightValidationError, match=r"index\.json: weight_map must map"):
        DiskWeightTransferEngine().receive_weights({"path": str(tmp_path)}, model.load_weights)


def _refused_without_blocking(fifo, call):
    """Runs `call`, which must raise `WeightValidationError` without waiting on `fifo`'s writer."""
    outcome = []

    def run():
        try:
            call()
        except Exception as exc:
            outcome.append(exc)

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    runner.join(timeout=30)
    if runner.is_alive():  # blocked in open(): a writer lets it go, so the test can fail
        with open(fifo, "wb"):
            pass
        runner.join()
        pytest.fail(f"blocked on {fifo.name}, waiting for a writer")
    (error,) = outcome
    assert isinstance(error, WeightValidationError), error
    return str(error)


def test_a_fifo_named_by_the_index_is_refused_without_waiting_for_a_writer(tmp_path):
    second = _two_shards(tmp_path, LlamaForCausalLM.from_preset("debug", seed=2))
    second.unlink()
    os.mkfifo(second)
    message = _refused_without_blocking(
        second, lambda: DiskWeightTransferUpdateInfo.from_directory(tmp_path)
    )
    assert "b.safetensors" in message and "not a regular file" in message


def test_a_file_swapped_for_a_fifo_after_its_header_is_refused_before_any_write(tmp_path):
    model = LlamaForCausalLM.from_preset("debug", seed=1)
    before = _weights(model)
    second = _two_shards(tmp_path, LlamaForCausalLM.from_preset("debug", seed=2))
    info = DiskWeightTransferUpdateInfo.from_directory(tmp_path)  # headers read: both fit
    second.unlink()
    os.mkfifo(second)  # the directory is rewritten under the reader
    engine = DiskWeightTransferEngine(expected_specs=model.weight_specs())
    message = _refused_without_blocking(
        second, lambda: engine.receive_weights(info, model.load_weights)
    )
    assert "b.safetensors" in message and "before any byte" in message
    assert _same(model, before)


def test_a_path_too_long_for_the_filesystem_is_refused_naming_it():
    with pytest.raises(WeightValidationError, match="not a directory visible"):
        DiskWeightTransferUpdateInfo.from_directory("/" + "a" * 100_000)


def _two_shards(directory, model):
    """Writes `model` as two safetensors files with their index; returns the second file."""
    tensors = _weights(model)
    names = list(tensors)
    halves = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2 :]}
    for file, part in halves.items():
        write_safetensors({n: tensors[n] for n in part}, directory / file)
    weight_map = {n: f for f, part in halves.items() for n in part}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return directory / "b.safetensors"


@pytest.mark.parametrize("staging", [True, False])
def test_a_directory_that_fails_halfway_leaves_the_previous_weights_or_holds(tmp_path, staging):
    engine = LLMEngine(
        "debug",
        engine_config=EngineConfig(weight_update_staging=staging),
        weight_transfer_config=WeightTransferConfig(backend="disk"),
    )
    before = _weights(engine.model)
    second = _two_shards(tmp_path, LlamaForCausalLM.from_preset("debug", seed=2))
    info = DiskWeightTransferUpdateInfo.from_directory(tmp_path)  # headers read: both fit
    second.write_bytes(second.read_bytes()[: second.stat().st_size // 2])  # the writer truncates
    with pytest.raises(WeightTransferError, match="the file ended") as failed:
        engine.update_weights({"update_info": info})
    assert failed.value.partially_applied  # the first file's weights were written
    assert engine.weight_version == 0
    if staging:
        assert _same(engine.model, before)
        assert not engine.weights.is_torn
    else:
        assert engine.weights.is_torn  # never generated from until a complete update lands


def test_the_disk_backend_takes_vllms_four_calls_without_an_init(tmp_path):
    engine = LLMEngine("debug", weight_transfer_config=WeightTransferConfig(backend="disk"))
    policy = LlamaForCausalLM.from_preset("debug", seed=2)
    info = save_weight_dir(policy.named_weights(), tmp_path)
    engine.start_weight_update()
    engine.update_weights({"update_info": info})
    assert engine.weight_version == 0  # the version moves at finish
    engine.finish_weight_update("step-1")
    assert engine.weight_version == "step-1"
    assert _same(engine.model, _weights(policy))


def test_a_hand_built_update_info_is_read_from_its_directory(tmp_path):
    save_weight_dir(LlamaForCausalLM.from_preset("debug", seed=2).named_weights(), tmp_path)
    listed = DiskWeightTransferUpdateInfo(
        names=["w"], dtype_names=["float32"], shapes=[[1]], path=str(tmp_path)
    )
    model = LlamaForCausalLM.from_preset("debug", seed=1)
    parsed = DiskWeightTransferEngine(expected_specs=model.weight_specs()).parse_update_info(listed)
    assert parsed.names == list(model.weight_specs())  # what the files hold, not what it listed


def test_a_hand_built_update_info_without_a_path_is_refused_naming_the_path():
    listed = DiskWeightTransferUpdateInfo(names=[], dtype_names=[], shapes=[], path=None)
    with pytest.raises(WeightValidationError, match="path must name a checkpoint directory"):
        DiskWeightTransferEngine().parse_update_info(listed)
