"""`SamplingParams`' checks and the sampler's fields, each against a computation of its own."""

from dataclasses import dataclass, field

import pytest
import torch

from weightsync.engine._sampler import _penalised, sample
from weightsync.engine.errors import InvalidRequestError
from weightsync.engine.sampling import SamplingParams


@dataclass
class Row:
    """A request as the sampler sees it."""

    sampling_params: SamplingParams
    token_ids: list[int] = field(default_factory=lambda: [0])
    num_prompt_tokens: int = 1
    generator: torch.Generator = field(default_factory=lambda: torch.Generator().manual_seed(0))


def rows(*params, **fields):
    return [Row(sp, **fields) for sp in params]


@pytest.mark.parametrize(
    ("kwargs", "field_name"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"seed": "1"}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"seed": True}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 17, "max_tokens": 16}, "min_tokens"),
        ({"skip_special_tokens": "no"}, "skip_special_tokens"),
        ({"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
    ],
)
def test_invalid_params_name_the_field(kwargs, field_name):
    with pytest.raises(InvalidRequestError, match=field_name):
        SamplingParams(**kwargs)


def test_stop_string_becomes_a_list():
    assert SamplingParams(stop="\n").stop == ["\n"]


def test_greedy_is_argmax_and_top_p_keeps_the_nucleus():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 2.9]])
    params = rows(SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_p=0.01))
    assert sample(logits, params) == [1, 0]


def test_seeded_sampling_is_reproducible_and_spreads():
    logits = torch.zeros(1, 50)
    params = SamplingParams(temperature=1.0)
    draws = [sample(logits, rows(params))[0] for _ in range(3)]
    assert len(set(draws)) == 1
    row = Row(params, generator=torch.Generator().manual_seed(7))
    spread = {sample(logits, [row])[0] for _ in range(30)}
    assert len(spread) > 10


def test_a_vanishing_temperature_samples_the_argmax_instead_of_nan():
    logits = torch.tensor([[0.0, 5.0, 1.0], [80.0, 0.0, 79.0]])
    params = rows(SamplingParams(temperature=1e-40), SamplingParams(temperature=1e-30))
    assert sample(logits, params) == [1, 0]


@pytest.mark.parametrize("fields", [{"top_k": 1}, {"min_p": 1.0}])
def test_top_k_1_and_min_p_1_sample_the_argmax_at_temperature_1(fields):
    logits = torch.randn(64, 300, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=1.0, **fields)
    assert sample(logits, rows(*[params] * 64)) == logits.argmax(dim=-1).tolist()


def _draws(logits: torch.Tensor, params: SamplingParams, count: int = 400) -> set[int]:
    row = Row(params, generator=torch.Generator().manual_seed(3))
    return {sample(logits, [row])[0] for _ in range(count)}


def test_top_k_draws_only_the_k_most_likely():
    logits = torch.arange(10.0)[None]  # token 9 most likely, then 8, ...
    assert _draws(logits, SamplingParams(temperature=5.0, top_k=3)) == {7, 8, 9}
    assert len(_draws(logits, SamplingParams(temperature=5.0, top_k=-1))) > 3


def test_min_p_drops_the_tokens_below_its_share_of_the_top_one():
    # Probabilities 0.4, 0.3, 0.2, 0.1: min_p 0.6 keeps those >= 0.24.
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    assert _draws(logits, SamplingParams(min_p=0.6)) == {0, 1}
    assert _draws(logits, SamplingParams(min_p=0.0)) == {0, 1, 2, 3}


def _penalised_by_hand(logits, prompt, output, repetition, frequency, presence):
    """vLLM's penalties written out one token at a time."""
    expected = logits.clone()
    for token in range(logits.numel()):
        count = output.count(token)
        if token in prompt or count:
            value = expected[token].item()
            expected[token] = value / repetition if value > 0 else value * repetition
        expected[token] -= frequency * count + presence * (count > 0)
    return expected


def test_penalties_change_the_logits_as_vllm_defines_them():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -0.2, 1.0])
    prompt, output = [0, 1], [3, 3, 1, 4]
    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.25, presence_penalty=0.5)
    row = Row(params, token_ids=prompt + output, num_prompt_tokens=len(prompt))
    expected = _penalised_by_hand(logits, prompt, output, 1.5, 0.25, 0.5)
    assert torch.allclose(_penalised(logits[None], [row])[0], expected)


def test_greedy_rows_take_the_argmax_of_the_penalised_logits():
    logits = torch.tensor([[1.0, 3.0, 2.5]])
    seen_one = [0, 1, 1]  # the prompt, then token 1 once in the output
    plain = Row(SamplingParams(temperature=0), token_ids=seen_one)
    repeat = Row(SamplingParams(temperature=0, repetition_penalty=1.5), token_ids=seen_one)
    present = Row(SamplingParams(temperature=0, presence_penalty=1.0), token_ids=seen_one)
    assert sample(logits.repeat(3, 1), [plain, repeat, present]) == [1, 2, 2]


def test_penalties_leave_plain_rows_and_the_caller_s_logits_alone():
    logits = torch.tensor([[1.0, 2.0, 0.0], [1.0, 2.0, 0.0]])
    before = logits.clone()
    plain = Row(SamplingParams(temperature=0), token_ids=[1, 1, 1])
    penalised = Row(SamplingParams(temperature=0, presence_penalty=2.0), token_ids=[1, 1, 1])
    assert sample(logits, [plain, penalised]) == [1, 0]
    assert torch.equal(logits, before)


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    logits = torch.tensor([[0.0, 9.0, 8.0, 1.0]])  # EOS 1, then stop token 2, then 3
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2])
    short = Row(params, token_ids=[0, 3], num_prompt_tokens=1)  # one output token so far
    done = Row(params, token_ids=[0, 3, 3], num_prompt_tokens=1)
    assert sample(logits.repeat(2, 1), [short, done], frozenset({1})) == [3, 1]
    ignoring = SamplingParams(temperature=0, min_tokens=2, ignore_eos=True)
    assert sample(logits, [Row(ignoring)], frozenset({1})) == [1]  # EOS ends nothing then
