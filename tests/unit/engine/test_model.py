import json

import pytest
import torch

from weightsync.engine.errors import EngineConfigError
from weightsync.engine.loader import _read_safetensors, load_hf_directory, save_hf_directory
from weightsync.engine.model import LlamaForCausalLM
from weightsync.engine.model_config import LlamaConfig
from weightsync.transfer._safetensors import write_safetensors
from weightsync.transfer.base import WeightValidationError

transformers = pytest.importorskip("transformers")


def hf_twin(model: LlamaForCausalLM):
    """transformers' LlamaForCausalLM with the same config and weights."""
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**model.config.to_hf_dict())).eval()
    hf.load_state_dict(dict(model.named_weights()), strict=not model.config.tie_word_embeddings)
    return hf


@pytest.mark.parametrize("tied", [False, True])
def test_logits_match_transformers(tied):
    model = LlamaForCausalLM.from_preset("debug", seed=3, tie_word_embeddings=tied)
    hf = hf_twin(model)
    ids = torch.tensor([256, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100])
    with torch.no_grad():
        ours = model.compute_logits(model(ids))  # (seq, vocab)
        theirs = hf(ids[None]).logits[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_weight_names_shapes_and_order_match_transformers():
    for tied in (False, True):
        model = LlamaForCausalLM.from_preset("debug", tie_word_embeddings=tied)
        hf = hf_twin(model)
        ours = [(n, tuple(s.shape)) for n, s in model.weight_specs().items()]
        theirs = [(n, tuple(p.shape)) for n, p in hf.named_parameters()]
        assert ours == theirs


def test_load_weights_copies_into_fused_parameters():
    model = LlamaForCausalLM.from_preset("debug", seed=0)
    other = LlamaForCausalLM.from_preset("debug", seed=1)
    buffer = {n: t.clone() for n, t in other.named_weights()}
    loaded = model.load_weights(buffer.items())
    assert loaded == list(model.weight_specs())
    for tensor in buffer.values():
        tensor.zero_()  # the model must not alias the caller's tensors
    for (name, ours), (_, theirs) in zip(model.named_weights(), other.named_weights(), strict=True):
        assert torch.equal(ours, theirs), name


def test_load_weights_rejects_unknown_names_and_shapes():
    model = LlamaForCausalLM.from_preset("debug")
    with pytest.raises(WeightValidationError, match=r"unknown weight 'model\.nope'"):
        model.load_weights([("model.nope", torch.zeros(1))])
    with pytest.raises(WeightValidationError, match=r"shape \[3\] but the model's is \[64\]"):
        model.load_weights([("model.norm.weight", torch.zeros(3))])


def test_presets_and_config_validation():
    tiny = LlamaForCausalLM.from_preset("tiny")
    assert 2e6 < sum(p.numel() for p in tiny.parameters()) < 5e6
    with pytest.raises(EngineConfigError, match="unknown model preset 'huge'"):
        LlamaConfig.preset("huge")
    with pytest.raises(EngineConfigError, match="num_key_value_heads"):
        LlamaConfig(num_attention_heads=8, num_key_value_heads=3)
    with pytest.raises(EngineConfigError, match="rope type 'yarn' is not supported"):
        LlamaConfig.from_hf_dict(
            {**LlamaConfig().to_hf_dict(), "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
        )


def test_seed_gives_the_same_model_in_any_dtype():
    a = LlamaForCausalLM.from_preset("debug", seed=5)
    b = LlamaForCausalLM.from_preset("debug", seed=5, dtype=torch.bfloat16)
    for (_, x), (_, y) in zip(a.named_weights(), b.named_weights(), strict=True):
        assert torch.equal(x.to(torch.bfloat16), y)


def test_loads_a_directory_written_by_transformers(tmp_path):
    model = LlamaForCausalLM.from_preset("debug", seed=2, tie_word_embeddings=True)
    hf_twin(model).save_pretrained(tmp_path)
    loaded = load_hf_directory(tmp_path)
    assert loaded.config == model.config
    for (name, ours), (_, theirs) in zip(
        loaded.named_weights(), model.named_weights(), strict=True
    ):
        assert torch.equal(ours, theirs), name


def test_saved_directory_reads_back_and_in_transformers(tmp_path):
    model = LlamaForCausalLM.from_preset("debug", seed=4)
    save_hf_directory(model, tmp_path)
    assert (
        dict(_read_safetensors(tmp_path / "model.safetensors")).keys()
        == model.weight_specs().keys()
    )
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    for name, param in hf.named_parameters():
        assert torch.equal(param, dict(model.named_weights())[name]), name


def test_directory_errors_say_what_is_missing(tmp_path):
    with pytest.raises(EngineConfigError, match=r"no config\.json"):
        load_hf_directory(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(LlamaConfig.preset("debug").to_hf_dict()))
    with pytest.raises(EngineConfigError, match=r"no model\.safetensors"):
        load_hf_directory(tmp_path)
    (tmp_path / "config.json").write_text(
        json.dumps({**LlamaConfig().to_hf_dict(), "model_type": "gpt2"})
    )
    with pytest.raises(EngineConfigError, match="model_type 'gpt2' is not supported"):
        load_hf_directory(tmp_path)


def test_an_index_naming_a_file_outside_the_directory_is_refused(tmp_path):
    outside = tmp_path / "elsewhere"
    save_hf_directory(LlamaForCausalLM.from_preset("debug", seed=4), outside)
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text((outside / "config.json").read_text())
    names = LlamaForCausalLM.from_preset("debug").weight_specs()
    weight_map = dict.fromkeys(names, "../elsewhere/model.safetensors")
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(EngineConfigError, match="file names of this directory"):
        load_hf_directory(checkpoint)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("layer_types", 5, "layer_types must be a list"),
        ("rms_norm_eps", 10**400, "rms_norm_eps must be a finite number > 0"),
        ("rms_norm_eps", float("nan"), "rms_norm_eps must be a finite number > 0"),
        ("rms_norm_eps", -1.0, "rms_norm_eps must be a finite number > 0"),
        ("rms_norm_eps", "1e-6", "rms_norm_eps must be a finite number > 0"),
        ("rope_theta", float("inf"), "rope_theta must be a finite number > 0"),
        ("rope_theta", -5, "rope_theta must be a finite number > 0"),
        ("rope_theta", 10**400, "rope_theta must be a finite number > 0"),
        ("tie_word_embeddings", "false", "tie_word_embeddings must be true or false"),
        ("attention_bias", "false", "attention_bias must be true or false"),
        ("num_key_value_heads", 0, "num_key_value_heads must be an int >= 1"),
        ("rope_scaling", {"rope_type": "linear", "factor": "2"}, "factor must be a finite"),
        ("rope_scaling", {"rope_type": "linear", "factor": float("inf")}, "factor must be a fin"),
        ("rope_scaling", {"rope_type": "linear", "factor": 10**400}, "factor must be a finite"),
        (
            "rope_scaling",
            {
                "rope_type": "llama3",
                "factor": 8,
                "low_freq_factor": 1,
                "high_freq_factor": 4,
                "original_max_position_embeddings": 0,
            },
            "original_max_position_embeddings must be an int from 1",
        ),
        (
            "rope_scaling",
            {
                "rope_type": "llama3",
                "factor": 8,
                "low_freq_factor": 1,
                "high_freq_factor": 4,
                "original_max_position_embeddings": "8192",
            },
            "original_max_position_embeddings must be an int from 1",
        ),
    ],
    ids=lambda value: str(value)[:24],
)
def test_a_config_value_of_the_wrong_type_or_range_is_refused_naming_the_file(
    tmp_path, key, value, message
):
    save_hf_directory(LlamaForCausalLM.from_preset("debug"), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, key: value}))
    with pytest.raises(EngineConfigError, match=message) as refused:
        load_hf_directory(tmp_path)
    assert str(refused.value).startswith(str(tmp_path / "config.json"))


def test_a_tensor_with_a_dim_past_int64_is_refused_naming_the_file(tmp_path):
    # No data to read (another dim is 0), so only the bound on each dim stops it.
    save_hf_directory(LlamaForCausalLM.from_preset("debug"), tmp_path)
    header = json.dumps(
        {"x": {"dtype": "F32", "shape": [0, 10**30], "data_offsets": [0, 0]}}
    ).encode()
    (tmp_path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(EngineConfigError, match=r"shape must be a list of ints >= 0") as refused:
        load_hf_directory(tmp_path)
    assert str(refused.value).startswith(str(tmp_path / "model.safetensors"))


@pytest.mark.parametrize(
    "file", ["a\x00.safetensors", "a\ud800.safetensors"], ids=["nul", "surrogate"]
)
def test_an_index_naming_a_file_no_path_can_hold_is_refused(tmp_path, file):
    save_hf_directory(LlamaForCausalLM.from_preset("debug"), tmp_path)
    names = LlamaForCausalLM.from_preset("debug").weight_specs()
    index = json.dumps({"weight_map": dict.fromkeys(names, file)})
    (tmp_path / "model.safetensors.index.json").write_text(index)
    with pytest.raises(EngineConfigError, match="file names of this directory") as refused:
        load_hf_directory(tmp_path)
    assert str(refused.value).startswith(str(tmp_path / "model.safetensors.index.json"))


def test_a_flag_written_as_null_is_unset():
    config = {**LlamaConfig.preset("debug").to_hf_dict(), "tie_word_embeddings": None}
    assert not LlamaConfig.from_hf_dict({**config, "attention_bias": None}).tie_word_embeddings


def test_a_config_json_that_cannot_be_read_is_refused_naming_it(tmp_path):
    save_hf_directory(LlamaForCausalLM.from_preset("debug"), tmp_path)
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").symlink_to("/proc/self/mem")  # a regular file whose read fails
    with pytest.raises(EngineConfigError, match="cannot read") as refused:
        load_hf_directory(tmp_path)
    assert str(refused.value).startswith(str(tmp_path / "config.json"))


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json"])
def test_a_json_file_past_the_size_bound_is_refused_before_it_is_read(tmp_path, name):
    from weightsync.transfer._safetensors import MAX_TEXT_FILE_BYTES

    save_hf_directory(LlamaForCausalLM.from_preset("debug"), tmp_path)
    with open(tmp_path / name, "wb") as f:  # sparse: no disk, and no memory unless it is read
        f.truncate(MAX_TEXT_FILE_BYTES + 1)
    with pytest.raises(
        EngineConfigError, match=f"more than {MAX_TEXT_FILE_BYTES} bytes"
    ) as refused:
        load_hf_directory(tmp_path)
    assert str(refused.value).startswith(str(tmp_path / name))


def test_a_tensor_in_two_shards_is_refused_not_taken_from_the_last(tmp_path):
    weights = dict(LlamaForCausalLM.from_preset("debug", seed=3).named_weights())
    save_hf_directory(LlamaForCausalLM.from_preset("debug", seed=3), tmp_path)
    (tmp_path / "model.safetensors").unlink()
    name = "model.norm.weight"
    write_safetensors(weights, tmp_path / "a.safetensors")
    write_safetensors({name: torch.zeros_like(weights[name])}, tmp_path / "b.safetensors")
    index = {"weight_map": {**dict.fromkeys(weights, "a.safetensors"), name: "b.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(EngineConfigError, match=f"tensor '{name}' is also in another file"):
        load_hf_directory(tmp_path)


def test_a_tensor_with_thousands_of_dims_is_refused_naming_the_file(tmp_path):
    save_hf_directory(LlamaForCausalLM.from_preset("debug"), tmp_path)
    entry = {"dtype": "F32", "shape": [3] * 10_000, "data_offsets": [0, 4]}
    header = json.dumps({"x": entry}).encode()
    (tmp_path / "model.safetensors").write_bytes(
        len(header).to_bytes(8, "little") + header + bytes(8)
    )
    with pytest.raises(
        EngineConfigError, match=r"shape has 10000 dims, more than the 64"
    ) as refused:
        load_hf_directory(tmp_path)
    assert str(refused.value).startswith(str(tmp_path / "model.safetensors"))
