"""vLLM's request fields that the engine honours: logit_bias, prompt_logprobs, cache_salt,
truncate_prompt_tokens, and the chat template's options."""

import math

import pytest
import torch
from engine_helpers import debug_model, greedy, make_engine, reference_greedy

from weightsync import InvalidRequestError, SamplingParams
from weightsync.engine import _model_runner


def test_logit_bias_changes_the_greedy_choice():
    engine = make_engine()
    plain = engine.generate(["The quick brown fox"], greedy(1))[0].outputs[0]
    favoured = (plain.token_ids[0] + 7) % 259
    biased = engine.generate(
        ["The quick brown fox"], greedy(3, logit_bias={favoured: 100.0}, logprobs=0)
    )[0].outputs[0]
    assert plain.token_ids[0] != favoured
    assert biased.token_ids == [favoured] * 3
    # The log-probabilities stay those of the raw logits: the favoured token is unlikely there.
    assert biased.logprobs[0] < math.log(0.5)


def test_a_negative_logit_bias_bans_a_token():
    engine = make_engine()
    plain = engine.generate(["Hello, world"], greedy(4))[0].outputs[0]
    banned = engine.generate(
        ["Hello, world"], greedy(4, logit_bias={t: -100.0 for t in plain.token_ids})
    )[0].outputs[0]
    assert not set(banned.token_ids) & set(plain.token_ids)


@pytest.mark.parametrize(
    "bias", [{-1: 1.0}, {3: 101.0}, {3: float("nan")}, {"3": 1.0}, [1, 2], {3: True}]
)
def test_bad_logit_bias_is_refused_naming_it(bias):
    with pytest.raises(InvalidRequestError, match="logit_bias") as caught:
        SamplingParams(logit_bias=bias)
    assert caught.value.param == "logit_bias"


def test_logit_bias_beyond_the_vocabulary_is_refused():
    engine = make_engine()
    with pytest.raises(InvalidRequestError, match=r"outside the vocabulary \[0, 259\)"):
        engine.add_request("r", "abc", greedy(2, logit_bias={259: 1.0}))


@pytest.mark.parametrize(
    ("chunk", "scored_together"),
    [(None, 256), (5, 256), (None, 3)],
    ids=["one-prefill", "chunked-prefill", "scored-in-slices"],
)
def test_prompt_logprobs_equal_a_direct_forwards_log_softmax(monkeypatch, chunk, scored_together):
    monkeypatch.setattr(_model_runner, "_SCORED_POSITIONS", scored_together)
    model = debug_model()
    engine = make_engine(
        model, **({"max_num_batched_tokens": chunk, "max_num_seqs": chunk} if chunk else {})
    )
    prompt = "weights move from the trainer"
    out = engine.generate([prompt], greedy(2, prompt_logprobs=3))[0]
    ids = out.prompt_token_ids
    with torch.inference_mode():
        # Scored as the sampled tokens' logprobs are: the softmax in float32.
        logits = model.compute_logits(model(torch.tensor(ids))).float()
        expected = torch.log_softmax(logits, dim=-1)
    scored = out.prompt_logprobs
    assert len(scored) == len(ids) and scored[0] is None
    for position in range(1, len(ids)):
        entry, row = scored[position], expected[position - 1]
        token = ids[position]
        assert next(iter(entry)) == token  # the prompt token first, as vLLM lists it
        assert math.isclose(entry[token].logprob, row[token].item(), rel_tol=1e-5)
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        top_ids = row.topk(3).indices.tolist()
        assert set(top_ids) <= set(entry) and len(entry) <= 4
        assert [entry[t].rank for t in top_ids] == [1, 2, 3]
    assert out.outputs[0].token_ids == reference_greedy(model, ids, 2)


def test_prompt_logprobs_zero_scores_the_prompt_tokens_alone():
    engine = make_engine()
    out = engine.generate(["abc"], greedy(1, prompt_logprobs=0))[0]
    assert out.prompt_logprobs[0] is None
    assert [list(e) for e in out.prompt_logprobs[1:]] == [[t] for t in out.prompt_token_ids[1:]]
    assert engine.generate(["abc"], greedy(1))[0].prompt_logprobs is None


def test_a_request_with_prompt_logprobs_takes_no_cached_prefix():
    engine = make_engine()
    prompt = "Once upon a time in a land far away"
    # A request registers its blocks after the steps it survives: two output tokens do.
    engine.generate([prompt], greedy(2))
    assert engine.generate([prompt], greedy(2))[0].num_cached_tokens > 0
    scored = engine.generate([prompt], greedy(2, prompt_logprobs=1))[0]
    assert scored.num_cached_tokens == 0
    assert all(entry is not None for entry in scored.prompt_logprobs[1:])


def _cached_tokens(engine, prompt, salt):
    engine.add_request(f"r-{salt}-{engine.num_steps}", prompt, greedy(2), cache_salt=salt)
    while True:
        for output in engine.step():
            if output.finished:
                return output.num_cached_tokens


def test_cache_salt_shares_the_prefix_cache_only_between_requests_of_the_same_salt():
    engine = make_engine()
    prompt = "x" * 40
    assert _cached_tokens(engine, prompt, "policy-1") == 0
    assert _cached_tokens(engine, prompt, "policy-1") > 0  # same salt: a hit
    assert _cached_tokens(engine, prompt, "policy-2") == 0  # another salt: computed afresh
    assert _cached_tokens(engine, prompt, None) == 0  # unsalted: apart from every salt
    assert _cached_tokens(engine, prompt, None) > 0
    assert _cached_tokens(engine, prompt, "policy-2") > 0


def test_truncate_prompt_tokens_keeps_the_last_tokens():
    model = debug_model()
    engine = make_engine(model)
    prompt = "Once upon a time in a land far away"
    full = engine.tokenize(prompt)
    out = engine.generate([prompt], greedy(3, truncate_prompt_tokens=5))[0]
    assert out.prompt_token_ids == full[-5:]
    assert out.outputs[0].token_ids == reference_greedy(model, full[-5:], 3)
    assert engine.tokenize(prompt, truncate_prompt_tokens=5) == full[-5:]


def test_truncate_prompt_tokens_minus_one_fits_the_prompt_to_the_model():
    engine = make_engine(max_model_len=16)
    out = engine.generate(["x" * 40], greedy(1, truncate_prompt_tokens=-1))[0]
    assert len(out.prompt_token_ids) == 15


@pytest.mark.parametrize("bad", [0, -2, 1.5, "3"])
def test_bad_truncate_prompt_tokens_is_refused(bad):
    with pytest.raises(InvalidRequestError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=bad)


MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello the"}]


def test_continue_final_message_ends_the_prompt_inside_the_last_message():
    engine = make_engine()
    tokenizer = engine.tokenizer
    continued = engine.apply_chat_template(
        MESSAGES, add_generation_prompt=False, continue_final_message=True
    )
    assert tokenizer.decode(continued).endswith("Hello the")
    closed = engine.apply_chat_template(MESSAGES, add_generation_prompt=False)
    assert not tokenizer.decode(closed).endswith("Hello the")
    with pytest.raises(InvalidRequestError, match="exclude each other"):
        engine.apply_chat_template(MESSAGES, continue_final_message=True)


def test_tools_and_template_kwargs_reach_the_template():
    from weightsync.engine.chat_template import ChatTemplate

    engine = make_engine()
    source = (
        "{% for m in messages %}{{ m.content }}{% endfor %}"
        "{% if tools %}|tools:{{ tools | map(attribute='function.name') | join(',') }}{% endif %}"
        "{% if enable_thinking %}|think{% endif %}"
    )
    engine.input_processor.chat_template = ChatTemplate(source)
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    ids = engine.apply_chat_template(
        MESSAGES[:1], tools=tools, template_kwargs={"enable_thinking": True}
    )
    assert engine.tokenizer.decode(ids) == "hi|tools:lookup|think"
    with pytest.raises(InvalidRequestError, match="may not set messages"):
        engine.apply_chat_template(MESSAGES[:1], template_kwargs={"messages": []})
