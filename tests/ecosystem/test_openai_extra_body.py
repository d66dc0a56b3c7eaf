"""The `openai` client with the `extra_body` fields vLLM users send, against `weightsync serve`.

vLLM's sampling extras are honoured today; the fields that change the answer's shape or its
prompt (`return_tokens_as_token_ids`, `prompt_logprobs`, `cache_salt`, chat template options,
tools) are expected to fail until the server honours them.
"""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0) as client:
        yield client


@pytest.fixture
def model(client):
    return client.models.list().data[0].id


def test_vllms_sampling_extras_are_honoured(client, model):
    answer = client.completions.create(
        model=model, prompt="The quick brown fox", max_tokens=4, temperature=0.7, seed=1,
        extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True,
                    "min_tokens": 4, "return_token_ids": True},
    )  # fmt: skip
    choice = answer.choices[0]
    assert len(choice.model_extra["token_ids"]) == 4 and choice.finish_reason == "length"


def test_the_model_card_has_vllms_fields(client):
    card = client.models.list().data[0]
    assert card.model_extra["max_model_len"] > 0 and card.model_extra["root"] == card.id


def test_return_tokens_as_token_ids(client, model):
    answer = client.completions.create(
        model=model, prompt="hi", max_tokens=3, temperature=0, logprobs=1,
        extra_body={"return_tokens_as_token_ids": True},
    )  # fmt: skip
    choice = answer.choices[0]
    assert choice.logprobs.tokens == [f"token_id:{t}" for t in choice.model_extra["token_ids"]]


def test_prompt_logprobs(client, model):
    answer = client.completions.create(
        model=model, prompt="The quick brown fox", max_tokens=1, temperature=0,
        extra_body={"prompt_logprobs": 1},
    )  # fmt: skip
    prompt_logprobs = answer.choices[0].model_extra["prompt_logprobs"]
    assert prompt_logprobs[0] is None and all(p for p in prompt_logprobs[1:])


def test_cache_salt(client, model):
    answer = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=2, extra_body={"cache_salt": "policy-7"}
    )
    assert answer.choices[0].finish_reason is not None


def test_chat_template_kwargs(client, model):
    answer = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=2,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )  # fmt: skip
    assert answer.choices[0].finish_reason is not None


def test_tools_that_the_model_need_not_call(client, model):
    tool = {"type": "function", "function": {"name": "add", "description": "Adds two numbers.",
            "parameters": {"type": "object", "properties": {"a": {"type": "number"}}}}}  # fmt: skip
    answer = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=2, tools=[tool], tool_choice="none"
    )
    assert answer.choices[0].finish_reason is not None
