"""vLLM's request fields on the OpenAI routes: taken with their meaning, checked, streamed alike.

The server's answer to each field is compared with the engine's own run of the same
`SamplingParams` (the sampler's arithmetic has tests of its own); bad values and typos are 400s
that name the field.
"""

import itertools
import json

import pytest
from fastapi.testclient import TestClient

from weightsync import AsyncEngine, EngineConfig, LLMEngine, SamplingParams
from weightsync.serve import ServerConfig, create_app

PROMPT = "The weights move"


@pytest.fixture(scope="module")
def client():
    engine = AsyncEngine("debug", engine_config=EngineConfig(num_kv_blocks=128))
    with TestClient(create_app(engine, ServerConfig(model_name="debug"))) as client:
        yield client


@pytest.fixture(scope="module")
def engine():
    return LLMEngine("debug", engine_config=EngineConfig(num_kv_blocks=128))


def complete(client, **fields):
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, **fields}
    answer = client.post("/v1/completions", json=body)
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]


def streamed(client, **fields):
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "stream": True, **fields}
    with client.stream("POST", "/v1/completions", json=body) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: {")]
    deltas = [json.loads(line.removeprefix("data: "))["choices"][0] for line in lines]
    return "".join(d["text"] for d in deltas), [t for d in deltas for t in d["token_ids"]]


@pytest.mark.parametrize(
    "fields",
    [
        {"top_k": 5, "temperature": 1.0, "seed": 3},
        {"min_p": 0.2, "temperature": 1.0, "seed": 3},
        {"repetition_penalty": 1.8},
        {"presence_penalty": 1.5, "frequency_penalty": 0.5},
        {"min_tokens": 6, "stop_token_ids": [33]},
        {"skip_special_tokens": False, "ignore_eos": True},
    ],
    ids=["top_k", "min_p", "repetition_penalty", "presence_frequency", "min_tokens", "skip"],
)
def test_each_field_means_what_sampling_params_means(client, engine, fields):
    choice = complete(client, **fields)
    params = SamplingParams(max_tokens=12, **{"temperature": 0, **fields})
    expected = engine.generate(PROMPT, params)[0].outputs[0]
    assert (choice["token_ids"], choice["text"]) == (expected.token_ids, expected.text)


def test_penalties_change_a_greedy_answer(client):
    plain = complete(client, max_tokens=24, ignore_eos=True)["token_ids"]
    assert len(set(plain)) < len(plain)  # a random model repeats itself
    penalised = complete(client, max_tokens=24, ignore_eos=True, repetition_penalty=50.0)
    # A huge penalty keeps every seen token out while unseen ones remain: no repeats at all.
    assert len(set(penalised["token_ids"])) == len(penalised["token_ids"])


@pytest.mark.parametrize(("name", "value"), [("top_k", 1), ("min_p", 1.0)])
def test_top_k_1_and_min_p_1_give_the_greedy_tokens_at_temperature_1(client, name, value):
    greedy = complete(client)["token_ids"]
    assert complete(client, temperature=1.0, seed=5, **{name: value})["token_ids"] == greedy


@pytest.mark.parametrize(
    ("include", "min_tokens", "skip"), list(itertools.product([False, True], [0, 5], [True, False]))
)
def test_streamed_text_is_the_whole_text_for_every_combination(client, include, min_tokens, skip):
    free = complete(client, max_tokens=24, ignore_eos=True)["text"]
    fields = {"max_tokens": 24, "ignore_eos": True, "stop": [free[6:9]],
              "include_stop_str_in_output": include, "min_tokens": min_tokens,
              "skip_special_tokens": skip}  # fmt: skip
    whole = complete(client, **fields)
    if min_tokens == 0:
        index = free.index(free[6:9])
        assert whole["text"] == free[: index + 3 if include else index]
    assert streamed(client, **fields) == (whole["text"], whole["token_ids"])


def test_token_ids_come_with_or_without_return_token_ids(client):
    for value in (None, True, False):
        choice = complete(client, return_token_ids=value)
        assert len(choice["token_ids"]) == 12 and choice["prompt_token_ids"][0] == 256


def test_chat_gives_a_top_level_prompt_token_ids(client):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "return_token_ids": True}  # fmt: skip
    answer = client.post("/v1/chat/completions", json=body).json()
    assert answer["prompt_token_ids"] == answer["choices"][0]["prompt_token_ids"]
    assert answer["prompt_token_ids"][:2] == [256, ord("<")]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("top_k", -2),
        ("top_k", "five"),
        ("min_p", 1.5),
        ("repetition_penalty", 0),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("min_tokens", -1),
        ("min_tokens", 13),  # more than max_tokens
        ("skip_special_tokens", "perhaps"),
        # Refused by SamplingParams rather than by the request model: the 400 names them too.
        ("stop_token_ids", [-1]),
        ("stop_token_ids", list(range(200))),
        ("stop", ""),
        ("seed", 2**64),
    ],
)
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_bad_values_and_typos_are_400s_naming_the_field(client, field, value, chat):
    if chat:
        route, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}
    else:
        route, body = "/v1/completions", {"prompt": PROMPT}
    answer = client.post(route, json={**body, "max_tokens": 12, field: value})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == field
    assert field in answer.json()["error"]["message"]


def test_a_seed_that_overflows_on_a_later_choice_names_seed_and_n(client):
    # Choice i samples with seed + i: the message names what the client sent, not seed + 1.
    answer = client.post("/v1/completions", json={"prompt": PROMPT, "seed": 2**64 - 1, "n": 2})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "seed"
    assert f"seed {2**64 - 1} with n=2" in error["message"]
    assert str(2**64) not in error["message"]
