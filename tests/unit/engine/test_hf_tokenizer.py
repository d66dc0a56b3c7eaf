"""A model directory's own tokenizer: the ids `transformers` gives, and text decoded incrementally
that joins into exactly the decoded text, for merged and multi-byte tokens alike."""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import shutil

import pytest
from engine_helpers import small_config

from model_dirs import FAMILIES
from weightsync.engine.async_engine import AsyncEngine
from weightsync.engine.hf_tokenizer import HFTokenizer
from weightsync.engine.llm_engine import LLMEngine
from weightsync.engine.sampling import SamplingParams
from weightsync.engine.tokenizer import ByteTokenizer

transformers = pytest.importorskip("transformers")

# Characters outside the tokenizers' training text (€, 😀, ß) are several byte tokens each.
TEXTS = [
    "Héllo wörld, ça va? 🤖 日本語 → ★ 😀 € ß",
    "The answer is: the answer.\n    indented code()",
    "<think>\nreasoning</think> done 🎉",
]


def streamed(tokenizer: HFTokenizer, prompt: list[int], ids: list[int]) -> list[str]:
    decoder = tokenizer.incremental_decoder(prompt)
    return [decoder.add(token_id) for token_id in ids] + [decoder.flush()]


def added_text(hf, prompt: list[int], ids: list[int]) -> str:
    """What `ids` add to the prompt's text, as `transformers` decodes the whole sequence."""
    whole = hf.decode(prompt + ids, skip_special_tokens=True)
    before = hf.decode(prompt, skip_special_tokens=True)
    assert whole.startswith(before)
    return whole[len(before) :]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_ids_are_the_ones_transformers_gives(family_dir, name):
    path = family_dir(name)
    tokenizer, hf = (
        HFTokenizer.from_directory(path),
        transformers.AutoTokenizer.from_pretrained(path),
    )
    for text in TEXTS:
        assert tokenizer.encode(text) == hf(text).input_ids
        assert (
            tokenizer.encode(text, add_special_tokens=False)
            == hf(text, add_special_tokens=False).input_ids
        )
        assert tokenizer.decode(hf(text).input_ids) == hf.decode(
            hf(text).input_ids, skip_special_tokens=True
        )
    assert tokenizer.vocab_size == len(hf)
    assert tokenizer.bos_token_id == hf.bos_token_id
    generation = transformers.GenerationConfig.from_pretrained(path)
    assert tokenizer.eos_token_ids == {hf.eos_token_id, *generation.eos_token_id}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_incremental_text_joins_into_the_decoded_text(family_dir, name):
    path = family_dir(name)
    tokenizer, hf = (
        HFTokenizer.from_directory(path),
        transformers.AutoTokenizer.from_pretrained(path),
    )
    prompt = tokenizer.encode("Say:")
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        pieces = streamed(tokenizer, prompt, ids)
        assert "".join(pieces) == added_text(hf, prompt, ids)
        if text == TEXTS[0]:
            assert "" in pieces[:-1]  # a character split over tokens waited for its last one
    # Whatever a model samples: ids of every kind in any order, special and unknown ones too.
    generator = random.Random(0)
    vocabulary = range(tokenizer.vocab_size + 8)  # past the tokenizer, as a padded model samples
    for _ in range(200):
        ids = [generator.choice(vocabulary) for _ in range(generator.randint(1, 24))]
        assert "".join(streamed(tokenizer, prompt, ids)) == added_text(hf, prompt, ids), ids


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_streamed_sampled_output_equals_the_output_generated_at_once(family_dir, name):
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=48, ignore_eos=True)

    async def main() -> tuple[list[str], str]:
        async with AsyncEngine(str(family_dir(name)), engine_config=small_config()) as engine:
            texts = [out.outputs[0].text async for out in engine.generate("Say:", params)]
        # A second engine: the first one's steps belong to its own step thread.
        reference = LLMEngine(str(family_dir(name)), engine_config=small_config())
        final = reference.generate("Say:", params)[0].outputs[0].text
        return texts, final

    texts, final = asyncio.run(main())
    assert texts[-1] == final
    # Each output's text extends the one before: a stream's deltas join into the final text.
    for before, after in itertools.pairwise(texts):
        assert after.startswith(before)
    assert len(set(texts)) > 10  # the text grew along the way, not only at the end


def test_a_directory_without_tokenizer_json_uses_the_byte_tokenizer(family_dir, tmp_path):
    from weightsync.engine.hf_tokenizer import load_tokenizer

    assert isinstance(load_tokenizer(tmp_path, vocab_size=300), ByteTokenizer)
    assert isinstance(load_tokenizer(family_dir("qwen2"), vocab_size=10**6), HFTokenizer)


@pytest.mark.parametrize(
    "name",
    ["tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"],
)
@pytest.mark.parametrize("kind", ["directory", "fifo", "device"])
def test_a_tokenizer_file_that_is_not_a_regular_file_is_refused_not_taken_for_absent(
    family_dir, tmp_path, name, kind
):
    from weightsync.engine.hf_tokenizer import load_tokenizer
    from weightsync.errors import EngineConfigError

    path = shutil.copytree(family_dir("llama3"), tmp_path / "llama3")
    (path / name).unlink()
    if kind == "directory":
        (path / name).mkdir()
    elif kind == "fifo":
        os.mkfifo(path / name)
    else:
        (path / name).symlink_to("/dev/zero")
    with pytest.raises(EngineConfigError, match="is not a regular file") as refused:
        load_tokenizer(path, vocab_size=10**6)
    assert str(refused.value).startswith(str(path / name))


@pytest.mark.parametrize(
    "name", ["tokenizer_config.json", "generation_config.json", "chat_template.jinja"]
)
def test_a_tokenizer_file_that_cannot_be_read_is_refused_naming_it(family_dir, tmp_path, name):
    from weightsync.engine.hf_tokenizer import load_tokenizer
    from weightsync.errors import EngineConfigError

    path = shutil.copytree(family_dir("llama3"), tmp_path / "llama3")
    (path / name).unlink()
    (path / name).symlink_to("/proc/self/mem")  # a regular file whose read fails (EIO)
    with pytest.raises(EngineConfigError, match="cannot read") as refused:
        load_tokenizer(path, vocab_size=10**6)
    assert str(refused.value).startswith(str(path / name))


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"])
def test_a_tokenizer_file_past_the_size_bound_is_refused_before_it_is_read(
    family_dir, tmp_path, name
):
    from weightsync.engine.hf_tokenizer import load_tokenizer
    from weightsync.errors import EngineConfigError
    from weightsync.transfer._safetensors import MAX_TEXT_FILE_BYTES

    path = shutil.copytree(family_dir("llama3"), tmp_path / "llama3")
    with open(path / name, "wb") as f:  # sparse: no disk, and no memory unless it is read
        f.truncate(MAX_TEXT_FILE_BYTES + 1)
    with pytest.raises(
        EngineConfigError, match=f"more than {MAX_TEXT_FILE_BYTES} bytes"
    ) as refused:
        load_tokenizer(path, vocab_size=10**6)
    assert str(refused.value).startswith(str(path / name))
