"""Checkpoints of each supported family against `transformers` on the same weights.

The directories are built offline (tests/model_dirs.py): a random model of the family, saved by
`transformers`, with a tokenizer trained here. Greedy comparisons run in float64, where no two
kernels can split a near-tie differently; float32 and bfloat16 are compared as logits.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from engine_helpers import small_config

from model_dirs import FAMILIES
from weightsync.engine.llm_engine import LLMEngine
from weightsync.engine.sampling import SamplingParams
from weightsync.errors import EngineConfigError

transformers = pytest.importorskip("transformers")

PROMPTS = ["The quick brown fox", "Héllo wörld, ça va? 🤖 日本語", "def main():\n", "the answer is"]
MAX_TOKENS = [24, 9, 17, 32]


def hf_generate(hf, prompt_ids: list[int], max_tokens: int) -> list[int]:
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=max_tokens)  # fmt: skip
    return out[0, len(prompt_ids) :].tolist()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_tokens_equal_transformers_generate_alone_and_in_a_mixed_batch(family_dir, name):
    path = family_dir(name)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    engine = LLMEngine(str(path), dtype=torch.float64, engine_config=small_config())
    params = [SamplingParams(temperature=0, max_tokens=n) for n in MAX_TOKENS]
    alone = [engine.generate(p, sp)[0] for p, sp in zip(PROMPTS, params, strict=True)]
    mixed = engine.generate(PROMPTS, params)  # prompts and lengths differ: prefills and decodes mix
    for prompt, n, one, batched in zip(PROMPTS, MAX_TOKENS, alone, mixed, strict=True):
        prompt_ids = tokenizer(prompt).input_ids
        assert one.prompt_token_ids == prompt_ids, prompt  # the directory's own tokenizer
        expected = hf_generate(hf, prompt_ids, n)
        assert one.outputs[0].token_ids == expected, prompt
        assert batched.outputs[0].token_ids == expected, prompt
        # The text is what the tokens add to the prompt's text, merged and multi-byte alike.
        whole = tokenizer.decode(prompt_ids + expected, skip_special_tokens=True)
        assert tokenizer.decode(prompt_ids, skip_special_tokens=True) + one.outputs[0].text == whole


@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-4), (torch.bfloat16, 0.125)])
def test_logits_equal_transformers_in_float32_and_bfloat16(family_dir, name, dtype, tolerance):
    path = family_dir(name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    engine = LLMEngine(str(path), dtype=dtype, engine_config=small_config())
    ids = engine.tokenizer.encode(PROMPTS[1])
    with torch.no_grad():
        ours = engine.model.compute_logits(engine.model(torch.tensor(ids)))  # (seq, vocab)
        theirs = hf(torch.tensor([ids])).logits[0]
    assert ours.dtype == dtype
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=0, atol=tolerance)
    # The paged KV-cache path computes in that dtype too: its first greedy token is the argmax.
    out = engine.generate([ids], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert out.outputs[0].token_ids[0] == int(ours[-1].argmax())
    assert len(out.outputs[0].token_ids) == 4


@pytest.mark.parametrize("name", list(FAMILIES))
def test_weight_names_and_order_are_the_transformers_models(family_dir, name):
    path = family_dir(name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    engine = LLMEngine(str(path), engine_config=small_config())
    ours = [(n, tuple(s.shape)) for n, s in engine.model.weight_specs().items()]
    assert ours == [(n, tuple(p.shape)) for n, p in hf.named_parameters()]
    for name_, param in hf.named_parameters():
        assert torch.equal(dict(engine.model.named_weights())[name_], param), name_


def test_an_eos_id_listed_in_generation_config_ends_a_request(family_dir, tmp_path):
    path = shutil.copytree(family_dir("llama3"), tmp_path / "llama3")
    free = LLMEngine(str(path), dtype=torch.float64, engine_config=small_config()).generate(
        PROMPTS[0], SamplingParams(temperature=0, max_tokens=24)
    )[0]
    tokens = free.outputs[0].token_ids
    assert free.outputs[0].finish_reason == "length"
    # An id the output reaches later, not yet among the EOS ids: list it as one.
    end = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])
    generation = json.loads((path / "generation_config.json").read_text())
    assert tokens[end] not in generation["eos_token_id"]
    generation["eos_token_id"].append(tokens[end])
    (path / "generation_config.json").write_text(json.dumps(generation))

    engine = LLMEngine(str(path), dtype=torch.float64, engine_config=small_config())
    out = engine.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    assert out.token_ids == tokens[: end + 1] and out.finish_reason == "stop"
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    assert hf_generate(hf, free.prompt_token_ids, 24) == out.token_ids  # generate stops there too
    ignoring = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    assert engine.generate(PROMPTS[0], ignoring)[0].outputs[0].token_ids == tokens


def _edit_json(name: str, **changes):
    def edit(path, family_dir):
        data = json.loads((path / name).read_text())
        for key, value in changes.items():
            if value is None:
                data.pop(key, None)
            else:
                data[key] = value
        (path / name).write_text(json.dumps(data))

    return edit


def _write(name: str, text: str):
    return lambda path, family_dir: (path / name).write_text(text)


def _copy_tokenizer_of(family: str):
    def copy(path, family_dir):
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(family_dir(family) / name, path / name)

    return copy


def _token_id_past_the_model(path, family_dir):
    """One token of tokenizer.json gets an id past config.json's vocab_size; the count is kept."""
    data = json.loads((path / "tokenizer.json").read_text())
    data["model"]["vocab"]["\u0120the"] = 10**6
    (path / "tokenizer.json").write_text(json.dumps(data))


BAD_DIRECTORIES = [
    ("architecture-moe", "qwen2", _edit_json("config.json", model_type="qwen2_moe"),
     r"config\.json: model_type 'qwen2_moe' is not supported; weightsync serves the dense, "
     r"full-attention families llama, qwen2, qwen3"),
    ("architecture-sliding-window", "qwen2", _edit_json("config.json", use_sliding_window=True),
     r"config\.json: sliding-window attention .* is not supported"),
    ("architecture-rope-yarn", "llama3",
     _edit_json("config.json", rope_parameters={"rope_type": "yarn", "factor": 4.0}),
     r"config\.json: rope type 'yarn' is not supported; supported: default, linear, llama3"),
    ("config-missing-key", "qwen3", _edit_json("config.json", hidden_size=None),
     r"config\.json: required key 'hidden_size' is missing"),
    ("config-bad-value", "qwen3", _edit_json("config.json", num_hidden_layers="two"),
     r"config\.json: LlamaConfig\.num_hidden_layers must be an int >= 1, got 'two'"),
    ("config-not-json", "llama2", _write("config.json", "{'single quotes'}"),
     r"config\.json is not valid JSON"),
    ("config-nested-too-deep", "llama2", _write("config.json", "[" * 100_000 + "]" * 100_000),
     r"config\.json is not valid JSON: it nests too deeply"),
    ("tokenizer-config-nested-too-deep", "qwen2",
     _write("tokenizer_config.json", '{"a":' * 100_000 + "1" + "}" * 100_000),
     r"tokenizer_config\.json is not valid JSON: it nests too deeply"),
    ("tokenizer-does-not-parse", "qwen2", _write("tokenizer.json", '{"model": 3}'),
     r"tokenizer\.json does not parse as a tokenizers pipeline"),
    ("tokenizer-eos-unknown", "qwen2", _edit_json("tokenizer_config.json", eos_token="<|nope|>"),
     r"tokenizer_config\.json: eos_token '<\|nope\|>' is not in .*tokenizer\.json's vocabulary"),
    ("generation-eos-text", "llama3", _edit_json("generation_config.json", eos_token_id="eot"),
     r"generation_config\.json: eos_token_id must be a token id or a list of them, got 'eot'"),
    ("template-not-jinja", "qwen3", _write("chat_template.jinja", "{% for message in %}"),
     r"chat_template\.jinja is not a valid Jinja template: .* \(line 1\)"),
    ("checkpoint-shapes-differ", "llama2", _edit_json("config.json", vocab_size=300),
     r"model\.safetensors does not fit config\.json: .* has shape \[\d+, 64\] but the model's "
     r"is \[300, 64\]"),
    ("tokenizer-of-another-model", "qwen3", _copy_tokenizer_of("llama2"),
     r"tokenizer\.json knows \d+ token ids but config\.json's vocab_size is \d+: the tokenizer "
     r"does not belong to this model"),
    ("tokenizer-id-past-the-model", "llama3", _token_id_past_the_model,
     r"tokenizer\.json gives 'Ġthe' the id 1000000, but config\.json's vocab_size is \d+"),
]  # fmt: skip


@pytest.mark.parametrize(("family", "edit", "message"), [c[1:] for c in BAD_DIRECTORIES],
                         ids=[c[0] for c in BAD_DIRECTORIES])  # fmt: skip
def test_a_bad_directory_is_one_error_naming_the_file_and_key(
    family_dir, tmp_path, family, edit, message
):
    path = shutil.copytree(family_dir(family), tmp_path / family)
    edit(path, family_dir)
    with pytest.raises(EngineConfigError, match=message) as caught:
        LLMEngine(str(path), engine_config=small_config())
    assert "\n" not in str(caught.value)
