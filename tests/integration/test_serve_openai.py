"""The official `openai` client against a real `weightsync serve`: same greedy text both ways."""

import pytest
from serve_support import Server

from weightsync import EngineConfig, LLMEngine, SamplingParams

openai = pytest.importorskip("openai")

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def server():
    server = Server("debug", "--port", "0", "--num-kv-blocks", "256", "--api-key", "user-key")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="user-key", timeout=60) as client:
        yield client


def in_process_greedy(prompt: str) -> str:
    engine = LLMEngine("debug", engine_config=EngineConfig(num_kv_blocks=256))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    return engine.generate([prompt], params)[0].outputs[0].text


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == ["debug"]


def test_completions_streaming_and_not_give_the_same_greedy_text(client):
    prompt = "The weights move"
    whole = client.completions.create(
        model="debug", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
    )
    chunks = client.completions.create(
        model="debug", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    streamed = "".join(chunk.choices[0].text for chunk in chunks)
    assert whole.choices[0].text == streamed == in_process_greedy(prompt)
    assert whole.usage.completion_tokens == len(whole.choices[0].model_extra["token_ids"])
    assert whole.choices[0].model_extra["weight_versions"] == [0] * whole.usage.completion_tokens


def test_chat_streaming_and_not_give_the_same_greedy_text(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    whole = client.chat.completions.create(
        model="debug", messages=messages, max_tokens=MAX_TOKENS, temperature=0
    )
    chunks = client.chat.completions.create(
        model="debug", messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    expected = in_process_greedy("<|system|>\nBe brief.\n<|user|>\nhello\n<|assistant|>\n")
    assert whole.choices[0].message.content == streamed == expected


def test_logprobs_of_the_sampled_tokens(client):
    whole = client.completions.create(
        model="debug", prompt="abc", max_tokens=5, temperature=0, logprobs=2
    )
    logprobs = whole.choices[0].logprobs
    assert len(logprobs.token_logprobs) == 5
    # Greedy: the sampled token is the most likely one, first among the alternatives.
    for chosen, top in zip(logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert len(top) == 2
        assert chosen == max(top.values()) <= 0


def test_a_wrong_api_key_is_refused(server):
    bad = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="nope", timeout=30)
    with bad, pytest.raises(openai.AuthenticationError, match="wrong"):
        bad.models.list()
