"""LoRA adapters in the engine: PEFT directories checked before loading, many adapters in one
batch, base rows untouched, the prefix cache kept apart per adapter version, and versions that a
running request keeps."""

from __future__ import annotations

import asyncio
import json
import math
import re
from pathlib import Path

import pytest
import torch
from engine_helpers import DTYPE, debug_model, greedy, make_engine

from lora_adapters import (
    adapter_tensors,
    merged_model,
    peft_config,
    peft_name,
    write_adapter,
)
from weightsync.engine import AsyncEngine, CompletionOutput, EngineConfig, LLMEngine
from weightsync.engine import lora as lora_module
from weightsync.engine.lora import LoRABatch
from weightsync.errors import (
    EngineConfigError,
    LoRAAdapterError,
    LoRAAdapterNotFoundError,
)

PROMPT = "LoRA adapters ride on the base weights"  # 3+ blocks of 8 tokens
MAX_TOKENS = 10


def lora_engine(**config: object) -> LLMEngine:
    settings = {"enable_lora": True, "max_loras": 4, "max_lora_rank": 8, **config}
    return make_engine(**settings)


def tokens(engine: LLMEngine, prompt: str = PROMPT, lora_name: str | None = None) -> list[int]:
    output = engine.generate([prompt], greedy(MAX_TOKENS), lora_name=lora_name)[0]
    return output.outputs[0].token_ids


@pytest.fixture(scope="module")
def base_model():
    return debug_model()


@pytest.mark.parametrize("use_rslora", [False, True])
def test_adapter_tokens_equal_the_merged_weights(tmp_path, base_model, use_rslora):
    tensors = adapter_tensors(base_model, rank=4, seed=3)
    path = write_adapter(tmp_path / "a", tensors, peft_config(4, 16, use_rslora=use_rslora))
    engine = lora_engine()
    adapter = engine.load_lora_adapter("a", str(path))
    scaling = 16 / math.sqrt(4) if use_rslora else 16 / 4
    assert adapter.scaling == scaling and adapter.rank == 4
    assert adapter.base_model_name_or_path == "debug" and adapter.version == 1
    merged = make_engine(merged_model(base_model, tensors, scaling))
    with_adapter = tokens(engine, lora_name="a")
    assert with_adapter == tokens(merged)
    assert with_adapter != tokens(engine)  # the adapter changes the answer


def test_an_adapter_on_some_modules_only_equals_its_merged_weights(tmp_path, base_model):
    tensors = adapter_tensors(base_model, rank=2, seed=4, modules=("v_proj", "up_proj"))
    config = peft_config(2, 4, target_modules=["v_proj", "up_proj"])
    engine = lora_engine()
    engine.load_lora_adapter("vu", str(write_adapter(tmp_path / "vu", tensors, config)))
    merged = make_engine(merged_model(base_model, tensors, 2.0))
    assert tokens(engine, lora_name="vu") == tokens(merged)


def run_together(
    engine: LLMEngine, requests: list[tuple[str, str | None]], **params: object
) -> dict[str, CompletionOutput]:
    """Adds every request before the first step, so they share batches; returns each output."""
    for request_id, lora_name in requests:
        engine.add_request(request_id, f"{PROMPT} {request_id}", greedy(MAX_TOKENS, **params),
                           lora_name=lora_name)  # fmt: skip
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output.outputs[0]
    return finals


def test_a_batch_mixing_base_rows_and_two_adapters_gives_each_row_its_own_answer(
    tmp_path, base_model
):
    engine = lora_engine()
    for name, seed in (("a", 5), ("b", 6)):
        tensors = adapter_tensors(base_model, seed=seed)
        engine.load_lora_adapter(name, str(write_adapter(tmp_path / name, tensors, peft_config())))
    requests = [("base1", None), ("a1", "a"), ("b1", "b"), ("base2", None), ("a2", "a")]
    together = run_together(engine, requests, logprobs=2)
    for request_id, lora_name in requests:
        alone = tokens(engine, f"{PROMPT} {request_id}", lora_name)
        assert together[request_id].token_ids == alone, request_id
    assert together["a1"].token_ids != tokens(engine, f"{PROMPT} a1")  # the adapter acted
    # The same batch on an engine without LoRA: its base rows answer to the last bit.
    plain = run_together(make_engine(debug_model()), [(rid, None) for rid, _ in requests],
                         logprobs=2)  # fmt: skip
    for request_id in ("base1", "base2"):
        assert together[request_id].logprobs == plain[request_id].logprobs
        assert together[request_id].top_logprobs == plain[request_id].top_logprobs


def test_base_rows_answer_bit_for_bit_as_an_engine_without_lora(tmp_path, base_model):
    engine = lora_engine()
    tensors = adapter_tensors(base_model, seed=7)
    engine.load_lora_adapter("a", str(write_adapter(tmp_path / "a", tensors, peft_config())))
    plain = make_engine(debug_model())
    params = greedy(MAX_TOKENS, logprobs=3)
    prompts = [f"{PROMPT} {i}" for i in range(3)]
    with_lora = engine.generate(prompts, params)
    without = plain.generate(prompts, params)
    for got, expected in zip(with_lora, without, strict=True):
        assert got.outputs[0].token_ids == expected.outputs[0].token_ids
        assert got.outputs[0].logprobs == expected.outputs[0].logprobs  # exact floats
        assert got.outputs[0].top_logprobs == expected.outputs[0].top_logprobs


def test_a_batch_without_adapter_rows_takes_the_base_path():
    rows = [(None, 0, 5), (None, 5, 1)]
    assert LoRABatch.of_rows(rows, torch.device("cpu")) is None


class _CountMatmuls(torch.overrides.TorchFunctionMode):
    """Counts the matrix products torch is asked for while it is active."""

    PRODUCTS = frozenset({"matmul", "mm", "__matmul__"})  # `a @ b` arrives as Tensor.matmul

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += getattr(func, "__name__", None) in self.PRODUCTS
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(("fused", "parts"), [("qkv_proj", 3), ("gate_up_proj", 2)])
def test_an_adapter_adds_two_matmuls_per_fused_module_whatever_its_parts(
    tmp_path, base_model, fused, parts
):
    """The q/k/v (gate/up) parts of an adapter are applied together: one shrink, one expand."""
    engine = lora_engine()
    tensors = adapter_tensors(base_model, seed=8)
    adapter = engine.load_lora_adapter(
        "a", str(write_adapter(tmp_path / "a", tensors, peft_config()))
    )
    rows = torch.tensor([0, 2])
    batch = LoRABatch([(adapter, rows)])
    parent = "self_attn" if fused == "qkv_proj" else "mlp"
    linear = base_model.get_submodule(f"model.layers.0.{parent}.{fused}")
    x = torch.randn(3, linear.weight.shape[1], dtype=DTYPE)
    out = torch.zeros(3, linear.weight.shape[0], dtype=DTYPE)
    with _CountMatmuls() as counter:
        batch.add(out, x, 0, fused)
    assert counter.count == 2, f"{counter.count} matmuls for {parts} parts"
    # What they add is each part's scaling * (x @ A.T) @ B.T, in its rows of the fused output.
    expected = torch.zeros_like(out)
    offset = 0
    names = ("q_proj", "k_proj", "v_proj") if fused == "qkv_proj" else ("gate_proj", "up_proj")
    for module in names:
        a, b = (tensors[peft_name(0, module, kind)].to(DTYPE) for kind in "AB")
        expected[rows, offset : offset + b.shape[0]] = adapter.scaling * (x[rows] @ a.T) @ b.T
        offset += b.shape[0]
    torch.testing.assert_close(out, expected)


def test_the_prefix_cache_never_shares_kv_between_adapters_or_versions(tmp_path, base_model):
    engine = lora_engine()
    for name, seed in (("a", 8), ("b", 9)):
        tensors = adapter_tensors(base_model, seed=seed)
        engine.load_lora_adapter(name, str(write_adapter(tmp_path / name, tensors, peft_config())))

    def cached(lora_name: str | None) -> int:
        output = engine.generate([PROMPT], greedy(2), lora_name=lora_name)[0]
        return output.num_cached_tokens

    assert cached("a") == 0
    assert cached("b") == 0  # same prompt, another adapter: nothing reused
    assert cached(None) == 0  # nor by the base model
    assert cached("a") > 0 and cached("b") > 0 and cached(None) > 0  # same adapter: reused
    newer = adapter_tensors(base_model, seed=10)
    path = write_adapter(tmp_path / "a2", newer, peft_config())
    engine.load_lora_adapter("a", str(path), load_inplace=True)
    assert cached("a") == 0  # a new version computes its own KV


def bad_adapter(tmp_path: Path, base_model, case: str) -> tuple[Path, str]:
    """Writes an adapter broken as `case` says; returns it and what the error must name."""
    tensors = adapter_tensors(base_model, rank=4, seed=11)
    config = peft_config(4)
    name_a = peft_name(1, "k_proj", "A")
    named = name_a
    if case == "shape":
        tensors[name_a] = torch.zeros(4, 63)
    elif case == "rank":
        tensors = adapter_tensors(base_model, rank=16, seed=11)
        config, named = peft_config(16), "rank r=16 exceeds the maximum LoRA rank 8"
    elif case == "module":
        tensors[peft_name(0, "q_proj", "A").replace("q_proj", "qkv_proj")] = torch.zeros(4, 64)
        named = "qkv_proj"
    elif case == "layer":
        tensors[peft_name(9, "q_proj", "A")] = torch.zeros(4, 64)
        named = "layer 9 does not exist"
    elif case == "lm_head":
        config, named = peft_config(4, target_modules=["q_proj", "lm_head"]), "'lm_head'"
    elif case == "dora":
        config, named = peft_config(4, use_dora=True), "use_dora"
    elif case == "bias":
        config, named = peft_config(4, bias="all"), "bias='all'"
    elif case == "missing_b":
        del tensors[peft_name(1, "k_proj", "B")]
        named = peft_name(1, "k_proj", "B")
    elif case == "targets_int":
        config, named = peft_config(4, target_modules=5), "target_modules"
    elif case == "targets_nested":
        config, named = peft_config(4, target_modules=[["q_proj"]]), "target_modules"
    elif case == "rslora_string":  # truthy: it would silently scale by alpha / sqrt(r)
        config, named = peft_config(4, use_rslora="no"), "use_rslora"
    elif case == "alpha_huge":  # an int with no float: lora_alpha / r cannot be computed
        config, named = {**peft_config(4), "lora_alpha": 10**400}, "'lora_alpha' must be a finite"
    elif case in ("layer_superscript", "layer_arabic", "layer_leading_zero", "layer_digits"):
        # Digits that `int` fails on, or reads as layer 1 under a name PEFT never writes.
        digit = {"layer_superscript": "\u00b2", "layer_arabic": "\u0661",
                 "layer_leading_zero": "01", "layer_digits": "9" * 5000}[case]  # fmt: skip
        tensors[name_a.replace("layers.1.", f"layers.{digit}.")] = tensors.pop(name_a)
        named = "unexpected name"
    elif case == "duplicate":  # the same tensor with and without PEFT's prefix: which is meant?
        tensors[name_a.removeprefix("base_model.model.")] = torch.zeros(4, 64)
        named = "twice"
    path = write_adapter(tmp_path / case, tensors, config)
    if case == "missing_file":
        (path / "adapter_model.safetensors").unlink()
        named = "adapter_model.safetensors"
    elif case == "json":
        (path / "adapter_config.json").write_text("{'r': 4,")
        named = "adapter_config.json: not valid JSON"
    elif case == "safetensors":
        (path / "adapter_model.safetensors").write_bytes(b"\x00" * 4)
        named = "adapter_model.safetensors"
    return path, named


CASES = ["shape", "rank", "module", "layer", "lm_head", "dora", "bias", "missing_b",
         "missing_file", "json", "safetensors", "targets_int", "targets_nested", "rslora_string",
         "duplicate", "alpha_huge", "layer_superscript", "layer_arabic", "layer_leading_zero",
         "layer_digits"]  # fmt: skip
# The cases refused in the config; the others name the tensors' file.
CONFIG_CASES = {"rank", "lm_head", "dora", "bias", "json", "targets_int", "targets_nested",
                "rslora_string", "alpha_huge"}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_a_bad_adapter_is_refused_by_name_and_changes_nothing(tmp_path, base_model, case):
    engine = lora_engine()
    good = adapter_tensors(base_model, rank=4, seed=12)
    engine.load_lora_adapter("a", str(write_adapter(tmp_path / "good", good, peft_config(4))))
    before = engine.list_lora_adapters()
    answer = tokens(engine, lora_name="a")
    path, named = bad_adapter(tmp_path, base_model, case)
    for name, inplace in (("a", True), ("new", False)):
        with pytest.raises(LoRAAdapterError) as refused:
            engine.load_lora_adapter(name, str(path), load_inplace=inplace)
        message = str(refused.value)
        file = "adapter_config.json" if case in CONFIG_CASES else "adapter_model.safetensors"
        assert str(path / file) in message and named in message, message
    assert engine.list_lora_adapters() == before
    assert tokens(engine, lora_name="a") == answer
    with pytest.raises(LoRAAdapterNotFoundError):
        engine.add_request("r", PROMPT, lora_name="new")


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_an_engine_refusing_non_finite_weights_refuses_a_non_finite_adapter(
    tmp_path, base_model, value
):
    tensors = adapter_tensors(base_model, rank=4, seed=18)
    bad_name = peft_name(1, "up_proj", "B")
    tensors[bad_name][3, 1] = value
    path = write_adapter(tmp_path / "bad", tensors, peft_config(4))
    engine = lora_engine(refuse_non_finite_weights=True)
    with pytest.raises(LoRAAdapterError) as refused:
        engine.load_lora_adapter("a", str(path))
    message = str(refused.value)
    assert str(path / "adapter_model.safetensors") in message and bad_name in message, message
    assert "NaN or an infinity" in message and engine.list_lora_adapters() == []
    # Off (the default), as for the base weights, nothing is checked: the adapter loads.
    assert lora_engine().load_lora_adapter("a", str(path)).version == 1


@pytest.mark.parametrize("case", ["rank", "module", "lm_head", "shape", "duplicate"])
def test_a_refused_adapter_s_tensor_data_is_never_read(tmp_path, base_model, monkeypatch, case):
    # The config and the safetensors header say all a refusal needs: a file of the wrong
    # shapes, or with an lm_head of vocab x hidden in it, is refused before its bytes are read.
    path, named = bad_adapter(tmp_path, base_model, case)
    read: list[str] = []
    real_read_tensor = lora_module.read_tensor

    def read_tensor(fd, entry):
        read.append(entry.spec.name)
        return real_read_tensor(fd, entry)

    monkeypatch.setattr(lora_module, "read_tensor", read_tensor)
    with pytest.raises(LoRAAdapterError, match=re.escape(named)):
        lora_engine().load_lora_adapter("a", str(path))
    assert read == []
    lora_engine().load_lora_adapter("a", str(write_adapter(tmp_path / "good", adapter_tensors(
        base_model), peft_config())))  # fmt: skip
    assert read  # the hook sees the reads of an adapter that is taken


def test_an_adapter_file_gone_after_its_header_was_read_is_refused_by_name(
    tmp_path, base_model, monkeypatch
):
    path = write_adapter(tmp_path / "a", adapter_tensors(base_model), peft_config())
    real_read_header = lora_module.read_header

    def read_header_then_lose_the_file(file):
        entries = real_read_header(file)
        Path(file).unlink()  # another process replaced or removed the adapter meanwhile
        return entries

    monkeypatch.setattr(lora_module, "read_header", read_header_then_lose_the_file)
    engine = lora_engine()
    with pytest.raises(LoRAAdapterError, match=r"adapter_model\.safetensors: cannot read"):
        engine.load_lora_adapter("a", str(path))
    assert engine.list_lora_adapters() == []


def test_a_path_that_is_no_directory_is_not_found(tmp_path):
    engine = lora_engine()
    with pytest.raises(LoRAAdapterNotFoundError, match="no adapter found there"):
        engine.load_lora_adapter("a", str(tmp_path / "nowhere"))
    assert engine.list_lora_adapters() == []


@pytest.mark.parametrize("path", ["", None, 5], ids=["empty", "none", "int"])
def test_a_lora_path_that_is_no_path_is_refused_not_read_as_the_working_directory(
    tmp_path, base_model, monkeypatch, path
):
    # The working directory holds an adapter: an empty path must not load it.
    write_adapter(tmp_path, adapter_tensors(base_model, rank=4, seed=11), peft_config(4))
    monkeypatch.chdir(tmp_path)
    engine = lora_engine()
    with pytest.raises(LoRAAdapterError, match="lora_path must name a PEFT adapter directory"):
        engine.load_lora_adapter("a", path)
    assert engine.list_lora_adapters() == []


def test_an_adapter_config_that_cannot_be_read_is_refused_naming_it(tmp_path, base_model):
    path = write_adapter(tmp_path, adapter_tensors(base_model, rank=4, seed=11), peft_config(4))
    (path / "adapter_config.json").unlink()
    (path / "adapter_config.json").symlink_to("/proc/self/mem")  # a regular file; reading fails
    engine = lora_engine()
    with pytest.raises(LoRAAdapterError, match=r"adapter_config\.json: cannot read"):
        engine.load_lora_adapter("a", str(path))
    assert engine.list_lora_adapters() == []


def test_an_adapter_config_past_the_size_bound_is_refused_before_it_is_read(tmp_path, base_model):
    from weightsync.transfer._safetensors import MAX_TEXT_FILE_BYTES

    path = write_adapter(tmp_path, adapter_tensors(base_model, rank=4, seed=11), peft_config(4))
    with open(path / "adapter_config.json", "wb") as f:  # sparse: no disk, no memory unread
        f.truncate(MAX_TEXT_FILE_BYTES + 1)
    engine = lora_engine()
    with pytest.raises(
        LoRAAdapterError, match=f"adapter_config.json: more than {MAX_TEXT_FILE_BYTES}"
    ):
        engine.load_lora_adapter("a", str(path))
    assert engine.list_lora_adapters() == []


def test_a_shape_refusal_says_expected_and_actual(tmp_path, base_model):
    path, _ = bad_adapter(tmp_path, base_model, "shape")
    with pytest.raises(LoRAAdapterError, match=r"expected .*\[4, 64\].* got float32 \[4, 63\]"):
        lora_engine().load_lora_adapter("a", str(path))


def test_loading_a_loaded_name_needs_load_inplace(tmp_path, base_model):
    engine = lora_engine()
    path = write_adapter(tmp_path / "a", adapter_tensors(base_model), peft_config())
    first = engine.load_lora_adapter("a", str(path))
    with pytest.raises(LoRAAdapterError, match=r"has already been loaded.*load_inplace"):
        engine.load_lora_adapter("a", str(path))
    second = engine.load_lora_adapter("a", str(path), load_inplace=True)
    assert (second.lora_int_id, second.version) == (first.lora_int_id, 2)
    assert engine.list_lora_adapters() == [second]


def test_an_adapter_name_is_refused_where_a_live_update_could_not_name_it(tmp_path, base_model):
    # /start_weight_update takes a lora_name of at most 256 characters: a longer name loaded
    # here could never be updated live, and every 404 listing the adapters would carry it.
    engine = lora_engine()
    path = write_adapter(tmp_path / "a", adapter_tensors(base_model), peft_config())
    with pytest.raises(LoRAAdapterError, match="lora_name must be at most 256 characters"):
        engine.load_lora_adapter("x" * 257, str(path))
    with pytest.raises(LoRAAdapterError, match="lora_name must be at most 256 characters"):
        engine.start_weight_update(lora_name="x" * 257, lora_config=peft_config())
    assert engine.weight_update is None and engine.list_lora_adapters() == []
    assert engine.load_lora_adapter("x" * 256, str(path)).version == 1


def test_unknown_or_unloaded_adapters_are_refused(tmp_path, base_model):
    engine = lora_engine()
    with pytest.raises(LoRAAdapterNotFoundError, match="'nope' is not loaded"):
        engine.add_request("r", PROMPT, lora_name="nope")
    path = write_adapter(tmp_path / "a", adapter_tensors(base_model), peft_config())
    engine.load_lora_adapter("a", str(path))
    engine.unload_lora_adapter("a")
    assert engine.list_lora_adapters() == []
    with pytest.raises(LoRAAdapterNotFoundError):
        engine.generate([PROMPT], greedy(2), lora_name="a")
    with pytest.raises(LoRAAdapterNotFoundError, match="cannot be found"):
        engine.unload_lora_adapter("a")


def test_an_engine_without_lora_refuses_adapters(tmp_path, base_model):
    engine = make_engine()
    path = write_adapter(tmp_path / "a", adapter_tensors(base_model), peft_config())
    with pytest.raises(LoRAAdapterNotFoundError, match="enable_lora=True"):
        engine.load_lora_adapter("a", str(path))
    with pytest.raises(LoRAAdapterNotFoundError, match="enable_lora=True"):
        engine.add_request("r", PROMPT, lora_name="a")


@pytest.mark.parametrize(
    ("field", "value"), [("max_loras", 0), ("max_lora_rank", 0), ("enable_lora", "yes")]
)
def test_lora_settings_are_checked_where_the_config_is_built(field, value):
    with pytest.raises(EngineConfigError, match=f"EngineConfig.{field}"):
        EngineConfig(**{field: value})


def test_a_running_request_keeps_the_adapter_version_it_started_with(tmp_path, base_model):
    old = adapter_tensors(base_model, seed=13)
    new = adapter_tensors(base_model, seed=14)
    engine = lora_engine()
    engine.load_lora_adapter("a", str(write_adapter(tmp_path / "old", old, peft_config())))
    old_answer = tokens(engine, lora_name="a")
    engine.add_request("running", PROMPT, greedy(MAX_TOKENS), lora_name="a")
    outputs = []
    while not outputs or len(outputs[-1].outputs[0].token_ids) < 3:  # mid-generation
        outputs += engine.step()
    new_path = write_adapter(tmp_path / "new", new, peft_config())
    assert engine.load_lora_adapter("a", str(new_path), load_inplace=True).version == 2
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[-1].finished and outputs[-1].outputs[0].token_ids == old_answer
    merged_new = make_engine(merged_model(base_model, new, 2.0))
    assert tokens(engine, lora_name="a") == tokens(merged_new) != old_answer


def test_max_loras_holds_back_a_request_whose_adapter_would_exceed_it(tmp_path, base_model):
    engine = lora_engine(max_loras=1)
    for name, seed in (("a", 15), ("b", 16)):
        tensors = adapter_tensors(base_model, seed=seed)
        engine.load_lora_adapter(name, str(write_adapter(tmp_path / name, tensors, peft_config())))
    requests = [("a1", "a"), ("b1", "b"), ("base", None), ("a2", "a")]
    for request_id, lora_name in requests:
        engine.add_request(request_id, PROMPT, greedy(3), lora_name=lora_name)
    engine.step()
    running = {seq.request_id for seq in engine.scheduler.running}
    assert running == {"a1", "base", "a2"}  # b1 waits: a second adapter would exceed 1
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            finals[output.request_id] = output
        adapters = {id(s.lora) for s in engine.scheduler.running if s.lora is not None}
        assert len(adapters) <= 1
    assert all(finals[request_id].finished for request_id, _ in requests)


def test_a_held_back_adapter_starts_though_requests_of_the_running_one_keep_coming(
    tmp_path, base_model
):
    # max_loras 1: b's request waits for a's to end, but a's keep arriving, each of which fits
    # beside the running ones; only so many may pass b's before a drains and b starts.
    max_num_seqs = 4
    engine = lora_engine(max_loras=1, max_num_seqs=max_num_seqs)
    for name, seed in (("a", 15), ("b", 16)):
        tensors = adapter_tensors(base_model, seed=seed)
        engine.load_lora_adapter(name, str(write_adapter(tmp_path / name, tensors, peft_config())))
    engine.add_request("a0", PROMPT, greedy(3), lora_name="a")
    engine.step()
    engine.add_request("b0", PROMPT, greedy(3), lora_name="b")
    passed = 0  # requests of a that started after b0 was queued, while it waited
    for i in range(1, 100):
        if any(seq.request_id == "b0" for seq in engine.scheduler.running):
            break
        engine.add_request(f"a{i}", PROMPT, greedy(3), lora_name="a")
        waiting = {seq.request_id for seq in engine.scheduler.waiting}
        engine.step()
        passed += sum(seq.request_id in waiting for seq in engine.scheduler.running
                      if seq.request_id != "b0")  # fmt: skip
    else:
        pytest.fail("b0 never started: requests of the running adapter kept passing it")
    assert passed <= max_num_seqs
    engine.add_request("base", PROMPT, greedy(3))  # the base model never waits for adapters
    engine.step()
    assert "base" in {seq.request_id for seq in engine.scheduler.running}


def test_the_async_engine_loads_generates_and_unloads(tmp_path, base_model):
    tensors = adapter_tensors(base_model, seed=17)
    path = write_adapter(tmp_path / "a", tensors, peft_config())
    expected = tokens(make_engine(merged_model(base_model, tensors, 2.0)))

    async def main() -> None:
        engine = AsyncEngine.from_engine(lora_engine())
        try:
            adapter = await engine.load_lora_adapter("a", str(path))
            assert engine.list_lora_adapters() == [adapter]
            final = None
            async for output in engine.generate(PROMPT, greedy(MAX_TOKENS), lora_name="a"):
                final = output
            assert final is not None and final.outputs[0].token_ids == expected
            await engine.unload_lora_adapter("a")
            with pytest.raises(LoRAAdapterNotFoundError):
                async for _ in engine.generate(PROMPT, greedy(2), lora_name="a"):
                    pass
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_an_adapter_is_cast_to_the_model_dtype(tmp_path, base_model):
    engine = lora_engine()
    path = write_adapter(tmp_path / "a", adapter_tensors(base_model), peft_config())
    adapter = engine.load_lora_adapter("a", str(path))
    assert {t.dtype for pair in adapter.weights.values() for t in pair} == {DTYPE}
    assert json.loads((path / "adapter_config.json").read_text())["r"] == adapter.rank
