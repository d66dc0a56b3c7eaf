"""The app in-process (FastAPI's TestClient): shapes of answers, errors, auth, limits."""

import json

import pytest
from fastapi.testclient import TestClient

from weightsync import AsyncEngine, EngineConfig, EngineConfigError
from weightsync.serve import ServerConfig, create_app


def make_client(**config):
    engine = AsyncEngine("debug", engine_config=EngineConfig(num_kv_blocks=128))
    return TestClient(create_app(engine, ServerConfig(model_name="debug", **config)))


@pytest.fixture(scope="module")
def client():
    with make_client(max_request_bytes=2048) as client:
        yield client


def events(response):
    lines = [line for line in response.iter_lines() if line]
    assert lines[0] == ": accepted"  # an SSE comment: every request is in the engine
    lines = lines[1:]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def test_completion_choices_carry_tokens_versions_and_usage(client):
    body = {"prompt": ["ab", [256, 99]], "max_tokens": 3, "temperature": 0.7, "n": 2, "seed": 1}
    answer = client.post("/v1/completions", json=body).json()
    choices = answer["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert [c["prompt_token_ids"] for c in choices] == [[256, 97, 98]] * 2 + [[256, 99]] * 2
    assert all(len(c["token_ids"]) == len(c["weight_versions"]) == 3 for c in choices)
    assert answer["usage"] == {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17}
    # Choice j of a prompt samples with seed + j: the same request again gives the same choices.
    again = client.post("/v1/completions", json=body).json()["choices"]
    assert [c["token_ids"] for c in again] == [c["token_ids"] for c in choices]


def test_a_stream_adds_up_to_the_whole_answer(client):
    body = {"prompt": "xyz", "max_tokens": 6, "temperature": 0, "logprobs": 1}
    whole = client.post("/v1/completions", json=body).json()["choices"][0]
    with client.stream("POST", "/v1/completions",
                       json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:  # fmt: skip
        chunks = events(r)
    assert chunks[-1]["usage"]["completion_tokens"] == 6 and chunks[-1]["choices"] == []
    deltas = [c["choices"][0] for c in chunks[:-1]]
    assert "".join(d["text"] for d in deltas) == whole["text"]
    assert [t for d in deltas for t in d["token_ids"]] == whole["token_ids"]
    streamed_logprobs = [lp for d in deltas for lp in d["logprobs"]["token_logprobs"]]
    assert streamed_logprobs == whole["logprobs"]["token_logprobs"]
    assert deltas[-1]["finish_reason"] == "length"


def test_chat_uses_the_documented_template(client):
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    answer = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    prompt = "<|user|>\nhi\n<|assistant|>\n"  # after the byte tokenizer's BOS
    assert answer.json()["choices"][0]["prompt_token_ids"] == [256, *prompt.encode()]
    assert answer.json()["choices"][0]["message"]["role"] == "assistant"


def test_a_chunked_body_past_the_limit_is_a_413(client):
    def chunks():
        yield b'{"prompt": "'
        yield b"x" * 4096
        yield b'"}'

    answer = client.post("/v1/completions", content=chunks(),
                         headers={"content-type": "application/json"})  # fmt: skip
    assert answer.status_code == 413
    assert answer.json()["error"]["param"] == "body"


def test_keys_guard_their_routes():
    with make_client(api_key="user", admin_api_key="admin") as client:
        assert client.get("/v1/models").status_code == 401
        assert client.get("/v1/models", headers={"Authorization": "Bearer user"}).status_code == 200
        assert (
            client.get("/v1/models", headers={"Authorization": "Bearer admin"}).status_code == 200
        )
        refused = client.get("/is_paused", headers={"Authorization": "Bearer user"})
        assert refused.status_code == 401
        assert refused.headers["www-authenticate"] == "Bearer"
        assert client.get("/is_paused", headers={"Authorization": "Bearer admin"}).json() == {
            "is_paused": False
        }
        assert client.get("/health").status_code == 200


def test_openapi_schema_lists_every_route(client):
    paths = client.get("/openapi.json").json()["paths"]
    for path in ("/v1/completions", "/v1/chat/completions", "/pause", "/update_weights",
                 "/finish_weight_update", "/weight_checker", "/abort_weight_update"):  # fmt: skip
        assert path in paths


@pytest.mark.reliability("bad-input")
def test_a_key_outside_ascii_is_compared_as_the_utf8_bytes_it_travels_as(record_property):
    """An admin key outside ASCII, sent as UTF-8: accepted; a near miss is a 401."""
    key = "clé-🔑-ключ"
    with make_client(admin_api_key=key) as client:
        right = client.get("/is_paused", headers={"Authorization": b"Bearer " + key.encode()})
        assert right.status_code == 200, right.text
        wrong = client.get("/is_paused", headers={"Authorization": "Bearer clé".encode()})
        assert wrong.status_code == 401
        latin1 = client.get("/is_paused", headers={"Authorization": "Bearer clé".encode("latin-1")})
        assert latin1.status_code == 401  # the same text, other bytes: not the key
    record_property("status", right.status_code)


@pytest.mark.reliability("bad-input")
@pytest.mark.parametrize("key", ["two\nlines", " padded", "tab\tbed", ""])
def test_a_key_no_header_can_carry_is_refused_at_start(key, record_property):
    """A configured key with a control character or surrounding spaces: refused at start."""
    with pytest.raises(EngineConfigError, match="admin_api_key"):
        ServerConfig(admin_api_key=key)
    record_property("error", "EngineConfigError")


@pytest.mark.reliability("output")
def test_a_stream_with_a_stop_string_sends_exactly_the_answer(client):
    """With a multi-character stop string, the stream's text joins into the non-streamed text."""
    body = {"prompt": "xyz", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    free = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    stop = free[6:9]  # its first characters arrive a step before it completes
    whole = client.post("/v1/completions", json={**body, "stop": stop}).json()["choices"][0]
    assert whole["finish_reason"] == "stop" and whole["text"] == free[: free.index(stop)]
    with client.stream("POST", "/v1/completions", json={**body, "stop": stop, "stream": True}) as r:
        deltas = [chunk["choices"][0] for chunk in events(r)]
    assert "".join(d["text"] for d in deltas) == whole["text"]
    assert [t for d in deltas for t in d["token_ids"]] == whole["token_ids"]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "n": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ],
    ids=["completion", "n=2", "chat"],
)
def test_a_stream_sent_while_asleep_is_a_409_not_an_accepted_stream(path, body):
    """Asleep, a stream is refused as the plain request is: a 409, never `: accepted`."""
    with make_client() as client:
        assert client.post("/sleep", params={"level": 1}).status_code == 200
        with client.stream("POST", path, json={**body, "stream": True}) as response:
            response.read()
        assert response.status_code == 409, response.text
        assert "asleep" in response.json()["error"]["message"]
        assert client.post("/wake_up").status_code == 200
        with client.stream("POST", path, json={**body, "stream": True}) as response:
            assert events(response)[-1]["choices"][0]["finish_reason"] is not None
