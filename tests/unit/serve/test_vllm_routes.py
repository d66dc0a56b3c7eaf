"""vLLM's routes that RL clients read, in-process: `/server_info`, model cards, token routes,
`/metrics`, and `/abort_requests` without a body."""

import json

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from weightsync import AsyncEngine, EngineConfig, WeightTransferConfig
from weightsync.serve import ServerConfig, create_app


@pytest.fixture(scope="module")
def client():
    engine = AsyncEngine(
        "debug",
        engine_config=EngineConfig(num_kv_blocks=128),
        weight_transfer_config=WeightTransferConfig(backend="gloo"),
    )
    config = ServerConfig(model_name="debug", model_path="presets/debug")
    with TestClient(create_app(engine, config)) as client:
        yield client


def samples(client, name):
    """`{labels without model_name and engine: value}` of the metric sample `name`."""
    found = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name:
                labels = {
                    k: v for k, v in sample.labels.items() if k not in ("model_name", "engine")
                }
                found[json.dumps(labels, sort_keys=True)] = sample.value
    return found


def value(client, name, **labels):
    return samples(client, name).get(json.dumps(labels, sort_keys=True), 0.0)


def events(response):
    lines = [line for line in response.iter_lines() if line and not line.startswith(":")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def test_server_info_answers_what_trl_reads_before_it_syncs(client):
    info = client.get("/server_info", params={"config_format": "json"}).json()
    tree = info["vllm_config"]
    assert tree["model_config"]["dtype"] == "torch.float32"  # TRL's async GRPO: get_dtype()
    assert tree["model_config"]["max_model_len"] == 512
    assert tree["model_config"]["model"] == "presets/debug"
    assert tree["weight_transfer_config"] == {"backend": "gloo"}  # TRL: init_communicator()
    assert tree["parallel_config"]["data_parallel_size"] == 1
    assert tree["lora_config"] is None  # TRL: select_adapter_sync()'s probe
    text = client.get("/server_info").json()["vllm_config"]
    assert isinstance(text, str) and "model_config=" in text  # vLLM's default, config_format=text
    assert client.get("/server_info", params={"config_format": "yaml"}).status_code == 400


def test_models_lists_vllms_model_card(client):
    (card,) = client.get("/v1/models").json()["data"]
    assert card["id"] == "debug" and card["root"] == "presets/debug" and card["parent"] is None
    assert card["max_model_len"] == 512  # TRL's async GRPO: get_max_model_len()
    (permission,) = card["permission"]
    assert permission["object"] == "model_permission" and permission["allow_sampling"] is True


def test_tokenize_and_detokenize_round_trip_a_text_and_a_conversation(client):
    answer = client.post("/tokenize", json={"prompt": "hi", "return_token_strs": True}).json()
    assert answer == {"count": 3, "max_model_len": 512, "tokens": [256, 104, 105],
                      "token_strs": ["<|bos|>", "h", "i"]}  # fmt: skip
    bare = client.post("/tokenize", json={"prompt": "hi", "add_special_tokens": False}).json()
    assert bare["tokens"] == [104, 105] and bare["token_strs"] is None
    assert client.post("/detokenize", json={"tokens": [104, 105]}).json() == {"prompt": "hi"}
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    tokens = client.post("/tokenize", json=chat).json()["tokens"]
    # The same ids as the chat route's prompt: one template, one rendering.
    completion = {**chat, "max_tokens": 1}
    assert tokens == client.post("/v1/chat/completions", json=completion).json()["prompt_token_ids"]
    shorter = client.post("/tokenize", json={**chat, "add_generation_prompt": False}).json()
    assert shorter["count"] < len(tokens)


def test_tokenize_renders_a_conversation_as_the_chat_route_does_with_vllms_template_fields(client):
    chat = {
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}],
        "add_generation_prompt": False,
        "continue_final_message": True,
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "chat_template_kwargs": {"enable_thinking": False},
    }
    tokens = client.post("/tokenize", json=chat).json()["tokens"]
    completion = {**chat, "max_tokens": 1}
    assert tokens == client.post("/v1/chat/completions", json=completion).json()["prompt_token_ids"]
    assert client.post("/detokenize", json={"tokens": tokens}).json()["prompt"].endswith("ok")


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"},
            "chat_template",
        ),
        ("/detokenize", {"tokens": [1, 259]}, "tokens[1]"),
        (
            "/inference/v1/generate",
            {"token_ids": [1], "sampling_params": {"allowed_token_ids": [5]}},
            "sampling_params.allowed_token_ids",
        ),
        (
            "/inference/v1/generate",
            {"token_ids": [1], "sampling_params": {}, "kv_transfer_params": {}},
            "kv_transfer_params",
        ),
        ("/inference/v1/generate", {"token_ids": [], "sampling_params": {}}, "token_ids"),
    ],
)
def test_a_field_that_would_change_the_answer_is_refused_by_name(client, path, body, param):
    answer = client.post(path, json=body)
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == param


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"sampling_params": {"prompt_logprobs": 21}}, "sampling_params.prompt_logprobs"),
        (
            {"sampling_params": {"truncate_prompt_tokens": -2}},
            "sampling_params.truncate_prompt_tokens",
        ),
        ({"sampling_params": {}, "cache_salt": "s" * 1025}, "cache_salt"),
        ({"sampling_params": {}, "cache_salt": ""}, "cache_salt"),
    ],
)
def test_generate_applies_the_completions_bounds_as_400s_naming_its_own_field(client, body, param):
    answer = client.post("/inference/v1/generate", json={"token_ids": [1], **body})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and "internal" not in error["message"]
    assert client.get("/health").status_code == 200


def test_generate_honours_the_fields_completions_honour(client):
    prompt = [256, 104, 105, 106]
    fields = {"max_tokens": 3, "temperature": 0, "prompt_logprobs": 2, "logit_bias": {"107": 100}}
    generated = client.post(
        "/inference/v1/generate",
        json={"token_ids": prompt, "sampling_params": fields, "cache_salt": "policy-3"},
    ).json()
    completed = client.post(
        "/v1/completions", json={"prompt": prompt, **fields, "cache_salt": "policy-3"}
    ).json()
    assert generated["choices"][0]["token_ids"] == [107, 107, 107]  # the bias decides
    assert generated["prompt_logprobs"][0] is None
    assert generated["prompt_logprobs"] == completed["choices"][0]["prompt_logprobs"]
    truncated = client.post(
        "/inference/v1/generate",
        json={"token_ids": prompt, "sampling_params": {"max_tokens": 1, "prompt_logprobs": 0,
                                                        "truncate_prompt_tokens": 2}},
    ).json()  # fmt: skip
    assert len(truncated["prompt_logprobs"]) == 2
    assert truncated["usage"]["prompt_tokens"] == 2


def test_generate_is_tokens_in_tokens_out_as_a_completion_of_the_same_ids(client):
    prompt = [256, 104, 105]
    sampling = {"max_tokens": 5, "temperature": 0, "logprobs": 2}
    answer = client.post("/inference/v1/generate",
                         json={"token_ids": prompt, "sampling_params": sampling}).json()  # fmt: skip
    same = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 5,
                                                "temperature": 0, "logprobs": 2}).json()  # fmt: skip
    (choice,) = answer["choices"]
    assert choice["token_ids"] == same["choices"][0]["token_ids"]
    assert choice["weight_versions"] == [0] * 5 and choice["finish_reason"] == "length"
    assert answer["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    assert answer["prompt_logprobs"] is None and answer["request_id"].startswith("generate-tokens-")
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert [c["logprob"] for c in content] == same["choices"][0]["logprobs"]["token_logprobs"]
    # vLLM lists the sampled token first, then the others: `logprobs` entries in all.
    assert all(len(c["top_logprobs"]) == 2 and c["top_logprobs"][0]["token"] == c["token"]
               for c in content)  # fmt: skip


def test_generate_streams_deltas_that_add_up_and_runs_n_choices(client):
    body = {"token_ids": [256, 97], "stream": True, "stream_options": {"include_usage": True},
            "sampling_params": {"max_tokens": 4, "temperature": 0.8, "seed": 3, "n": 2}}  # fmt: skip
    with client.stream("POST", "/inference/v1/generate", json=body) as response:
        chunks = events(response)
    whole = client.post("/inference/v1/generate", json={**body, "stream": False}).json()
    for index in (0, 1):
        streamed = [t for c in chunks[:-1] for ch in c["choices"] if ch["index"] == index
                    for t in ch["token_ids"]]  # fmt: skip
        assert streamed == whole["choices"][index]["token_ids"]
    assert chunks[-1]["usage"]["completion_tokens"] == 8
    assert max_tokens_default(client) == 512 - 2


def max_tokens_default(client):
    """vLLM's rule: without `max_tokens`, what the model has room for after the prompt."""
    body = {"token_ids": [256, 97], "sampling_params": {"temperature": 0, "ignore_eos": True}}
    return len(client.post("/inference/v1/generate", json=body).json()["choices"][0]["token_ids"])


def test_metrics_use_vllms_names_and_count_requests_pauses_and_updates(client):
    prompt_before = value(client, "vllm:prompt_tokens_total")
    generated_before = value(client, "vllm:generation_tokens_total")
    latencies_before = value(client, "vllm:e2e_request_latency_seconds_count")
    body = {"prompt": [256, 120, 121], "max_tokens": 4, "ignore_eos": True}
    assert client.post("/v1/completions", json=body).status_code == 200
    assert value(client, "vllm:prompt_tokens_total") == prompt_before + 3
    assert value(client, "vllm:generation_tokens_total") == generated_before + 4
    assert value(client, "vllm:e2e_request_latency_seconds_count") == latencies_before + 1
    assert value(client, "vllm:request_success_total", finished_reason="length") >= 1
    assert value(client, "vllm:num_requests_running") == 0
    assert "vllm:time_to_first_token_seconds_bucket" in client.get("/metrics").text

    pauses = value(client, "weightsync:pauses_total", mode="keep")
    client.post("/pause", params={"mode": "keep"})
    assert value(client, "weightsync:is_paused") == 1
    client.post("/resume")
    assert value(client, "weightsync:pauses_total", mode="keep") == pauses + 1
    assert value(client, "weightsync:pause_duration_seconds_count") >= 1

    updates = value(client, "weightsync:weight_updates_total")
    failures = value(client, "weightsync:weight_update_failures_total")
    assert client.post("/finish_weight_update", json={}).status_code == 409  # none in progress
    client.post("/start_weight_update", json={})
    client.post("/finish_weight_update", json={"weight_version": "step-9"})
    assert value(client, "weightsync:weight_updates_total") == updates + 1
    assert value(client, "weightsync:weight_update_failures_total") == failures + 1
    assert value(client, "weightsync:weight_version", version="step-9") == 1


def test_abort_requests_without_a_body_is_a_400_as_vllms(client):
    answer = client.post("/abort_requests")
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "body"
    assert client.post("/abort_requests", json={}).json() == {"status": "aborted", "aborted": 0}
