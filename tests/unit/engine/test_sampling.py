import pytest
import torch

from weightsync.engine.errors import InvalidRequestError
from weightsync.engine.sampling import SamplingParams, sample


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"seed": "1"}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"seed": True}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_invalid_params_name_the_field(kwargs, field):
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**kwargs)


def test_stop_string_becomes_a_list():
    assert SamplingParams(stop="\n").stop == ["\n"]


def test_greedy_is_argmax_and_top_p_keeps_the_nucleus():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 2.9]])
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_p=0.01)]
    generators = [torch.Generator().manual_seed(0) for _ in params]
    assert sample(logits, params, generators) == [1, 0]


def test_seeded_sampling_is_reproducible_and_spreads():
    logits = torch.zeros(1, 50)
    params = [SamplingParams(temperature=1.0)]
    draws = [sample(logits, params, [torch.Generator().manual_seed(7)])[0] for _ in range(3)]
    assert len(set(draws)) == 1
    generator = torch.Generator().manual_seed(7)
    spread = {sample(logits, params, [generator])[0] for _ in range(30)}
    assert len(spread) > 10


def test_a_vanishing_temperature_samples_the_argmax_instead_of_nan():
    logits = torch.tensor([[0.0, 5.0, 1.0], [80.0, 0.0, 79.0]])
    params = [SamplingParams(temperature=1e-40), SamplingParams(temperature=1e-30)]
    generators = [torch.Generator().manual_seed(0) for _ in params]
    assert sample(logits, params, generators) == [1, 0]
