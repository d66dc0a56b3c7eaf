"""vLLM's request fields through the whole engine: min_tokens, stop text, special tokens.

Each outcome is checked against a computation of its own: the model run by hand, the
tokenizer's `decode`, or the same request without the field.
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import PROMPTS, greedy, small_config

from weightsync.engine.llm_engine import LLMEngine
from weightsync.engine.model import LlamaForCausalLM
from weightsync.engine.sampling import SamplingParams
from weightsync.engine.tokenizer import ByteTokenizer


class EosTokenizer(ByteTokenizer):
    """The byte tokenizer with one chosen token as its end of sequence."""

    def __init__(self, eos: int) -> None:
        super().__init__()
        self.eos_token_ids = frozenset({eos})


def texts_of(engine: LLMEngine, prompt: str, params) -> list[str]:
    """The text of every output of one request, step by step, as a stream delivers them."""
    engine.add_request("watched", prompt, params)
    texts = []
    while engine.has_unfinished_requests():
        texts += [out.outputs[0].text for out in engine.step() if out.request_id == "watched"]
    return texts


@torch.inference_mode()
def greedy_avoiding(model: LlamaForCausalLM, ids: list[int], banned: int, steps: int) -> list[int]:
    """Greedy by hand, the whole sequence through the model each step, `banned` never taken."""
    ids = list(ids)
    for _ in range(steps):
        logits = model.compute_logits(model(torch.tensor(ids))[-1:])[0]
        logits[banned] = float("-inf")
        ids.append(int(logits.argmax()))
    return ids[-steps:]


def test_min_tokens_keeps_eos_out_of_the_first_tokens(debug_model):
    plain = LLMEngine(debug_model, engine_config=small_config())
    prompt_ids = plain.tokenize(PROMPTS[0])
    first = plain.generate(PROMPTS[0], greedy(8))[0].outputs[0].token_ids[0]
    engine = LLMEngine(debug_model, engine_config=small_config(), tokenizer=EosTokenizer(first))
    # The greedy first token is EOS: without min_tokens the answer ends at once.
    alone = engine.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=8))[0]
    assert (alone.outputs[0].token_ids, alone.outputs[0].finish_reason) == ([first], "stop")
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=3)
    out = engine.generate(PROMPTS[0], params)[0].outputs[0]
    assert out.token_ids[:3] == greedy_avoiding(debug_model, prompt_ids, first, 3)
    assert first not in out.token_ids[:3]
    assert len(out.token_ids) > 3


def test_min_tokens_keeps_stop_token_ids_and_stop_strings_waiting(debug_model):
    engine = LLMEngine(debug_model, engine_config=small_config())
    free = engine.generate(PROMPTS[1], greedy(12))[0].outputs[0]
    stop = free.text[1]  # the second character (a one-byte token) would end the answer
    assert len(stop.encode()) == 1 and stop not in free.text[2:5]
    early = engine.generate(PROMPTS[1], greedy(12, stop=[stop]))[0].outputs[0]
    assert early.text == free.text[:1]
    late = engine.generate(PROMPTS[1], greedy(12, stop=[stop], min_tokens=4))[0].outputs[0]
    assert late.text.startswith(free.text[:4])


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_stays_in_the_text_when_asked_and_streams_agree(debug_model, include):
    engine = LLMEngine(debug_model, engine_config=small_config())
    free = engine.generate(PROMPTS[1], greedy(24))[0].outputs[0].text
    stop = free[6:9]
    assert len(stop.encode()) == len(stop)
    texts = texts_of(
        engine, PROMPTS[1], greedy(24, stop=[stop], include_stop_str_in_output=include)
    )
    index = free.index(stop)
    assert texts[-1] == free[: index + len(stop) if include else index]
    for text in texts:
        assert texts[-1].startswith(text), (text, texts[-1])


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_token_s_text_is_kept_only_when_asked(debug_model, include):
    engine = LLMEngine(debug_model, engine_config=small_config())
    free = engine.generate(PROMPTS[2], greedy(12))[0].outputs[0]
    cut = next(i for i in range(1, 12) if free.token_ids[i] not in free.token_ids[:i])
    stop_id = free.token_ids[cut]
    params = greedy(12, stop_token_ids=[stop_id], include_stop_str_in_output=include)
    out = engine.generate(PROMPTS[2], params)[0].outputs[0]
    assert out.token_ids == free.token_ids[: cut + 1]  # the stop token's id is kept
    tokenizer = ByteTokenizer()
    assert out.text == tokenizer.decode(out.token_ids if include else out.token_ids[:-1])
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)


def test_skip_special_tokens_false_writes_their_names_as_decode_does():
    tokenizer = ByteTokenizer()
    ids = [104, 256, 0xC3, 257, 0xC3, 0xA9, 258, 300]  # a character cut short by a special token
    for skip in (True, False):
        decoder = tokenizer.incremental_decoder(skip_special_tokens=skip)
        streamed = "".join(decoder.add(i) for i in ids) + decoder.flush()
        if skip:
            assert streamed == "h\ufffdé"  # skipped tokens do not cut a character short
        else:
            assert streamed == tokenizer.decode(ids, skip_special_tokens=False)
            assert streamed == "h<|bos|>\ufffd<|eos|>é<|pad|>"
