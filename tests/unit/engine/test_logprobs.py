import math

import pytest
import torch

from weightsync import EngineConfig, InvalidRequestError, LLMEngine, SamplingParams
from weightsync.engine._sampler import token_logprobs


def test_token_logprobs_are_those_of_the_raw_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.0, 5.0]])
    params = [SamplingParams(logprobs=2, temperature=0.5), SamplingParams()]
    result = token_logprobs(logits, params, [1, 2])
    expected = torch.log_softmax(logits[0], dim=-1)
    assert result[1] is None  # that request did not ask
    assert math.isclose(result[0].logprob, expected[1].item(), rel_tol=1e-6)
    assert [t for t, _ in result[0].top] == [0, 1]
    assert math.isclose(result[0].top[0][1], expected[0].item(), rel_tol=1e-6)


def test_outputs_carry_one_logprob_per_token_and_the_greedy_token_is_the_top_one():
    engine = LLMEngine("debug", engine_config=EngineConfig(num_kv_blocks=64))
    out = engine.generate(["abc"], SamplingParams(temperature=0, max_tokens=5, logprobs=3))[0]
    completion = out.outputs[0]
    assert len(completion.logprobs) == len(completion.top_logprobs) == 5
    for token, logprob, top in zip(
        completion.token_ids, completion.logprobs, completion.top_logprobs, strict=True
    ):
        assert len(top) == 3
        assert max(top, key=top.get) == token
        assert top[token] == logprob < 0
    plain = engine.generate(["abc"], SamplingParams(temperature=0, max_tokens=5))[0].outputs[0]
    assert plain.logprobs is None and plain.token_ids == completion.token_ids


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True])
def test_logprobs_out_of_range_is_refused(bad):
    with pytest.raises(InvalidRequestError, match="logprobs"):
        SamplingParams(logprobs=bad)
