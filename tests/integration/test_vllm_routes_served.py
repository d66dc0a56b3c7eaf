"""vLLM's routes that RL clients read, served: one `weightsync serve`, and a front of two replicas.

`/server_info`, model cards, the token routes and `/metrics` over real sockets; on the front,
the token routes reach a replica and `/metrics` shows each replica under vLLM's `engine` label
and their sums under `engine="total"`.
"""

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from replica_support import broadcast_update, connect_gloo, get, post
from serve_support import Server

from weightsync import LlamaForCausalLM

N = 2


@pytest.fixture(scope="module")
def server():
    server = Server("debug", "--port", "0", "--weight-transfer-config.backend", "gloo")
    yield server
    server.kill()


@pytest.fixture(scope="module")
def front():
    front = Server("debug", "--port", "0", "--data-parallel-size", str(N),
                   "--weight-transfer-config.backend", "gloo")  # fmt: skip
    yield front
    front.kill()


def metric(base_url: str, name: str, **labels: str) -> dict[str, float]:
    """`{engine label: value}` of the samples `name` whose labels include `labels`."""
    found = {}
    text = httpx.get(base_url + "/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                found[sample.labels["engine"]] = sample.value
    return found


def generate(base_url: str, token_ids: list[int], **sampling) -> dict:
    body = {"token_ids": token_ids, "sampling_params": {"temperature": 0, **sampling}}
    return post(base_url, "/inference/v1/generate", json=body)


def test_one_server_answers_trls_config_reads_and_counts_an_update_in_bytes(server):
    url = server.base_url
    tree = get(url, "/server_info", params={"config_format": "json"})["vllm_config"]
    assert tree["weight_transfer_config"] == {"backend": "gloo"}
    assert tree["model_config"]["dtype"] == "torch.float32"
    assert (
        get(url, "/v1/models")["data"][0]["max_model_len"] == tree["model_config"]["max_model_len"]
    )

    tokens = post(url, "/tokenize", json={"prompt": "hello"})["tokens"]
    assert post(url, "/detokenize", json={"tokens": tokens[1:]}) == {"prompt": "hello"}
    choice = generate(url, tokens, max_tokens=4)["choices"][0]
    assert len(choice["token_ids"]) == 4 and choice["weight_versions"] == [0] * 4
    assert metric(url, "vllm:generation_tokens_total") == {"0": 4.0}

    policy = LlamaForCausalLM.from_preset("debug", seed=5)
    group = connect_gloo(url)
    try:
        broadcast_update(url, group, policy, version="v1")
    finally:
        group.close()
    sent = sum(t.numel() * t.element_size() for _, t in policy.named_weights())
    assert metric(url, "weightsync:weight_update_bytes_total") == {"0": float(sent)}
    assert metric(url, "weightsync:weight_updates_total") == {"0": 1.0}
    assert metric(url, "weightsync:pauses_total", mode="keep") == {"0": 1.0}
    assert metric(url, "weightsync:weight_version", version="v1") == {"0": 1.0}
    assert generate(url, tokens, max_tokens=2)["choices"][0]["weight_versions"] == ["v1"] * 2


def test_a_front_relays_the_token_routes_and_sums_its_replicas_metrics(front):
    url = front.base_url
    tree = get(url, "/server_info", params={"config_format": "json"})["vllm_config"]
    assert tree["parallel_config"]["data_parallel_size"] == N
    assert tree["weight_transfer_config"] == {"backend": "gloo"}
    assert (
        get(url, "/v1/models")["data"][0]["max_model_len"] == tree["model_config"]["max_model_len"]
    )
    tokens = post(url, "/tokenize", json={"prompt": "hi"})["tokens"]
    assert post(url, "/detokenize", json={"tokens": tokens[1:]}) == {"prompt": "hi"}
    refused = httpx.post(url + "/detokenize", json={"tokens": [10**6]}, timeout=30)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tokens[0]"

    answers = [generate(url, tokens, max_tokens=3, ignore_eos=True) for _ in range(2)]
    assert all(len(a["choices"][0]["token_ids"]) == 3 for a in answers)
    generated = metric(url, "vllm:generation_tokens_total")
    assert set(generated) == {"0", "1", "total"}
    assert generated["total"] == generated["0"] + generated["1"] == 6.0
    versions = metric(url, "weightsync:weight_version")
    assert set(versions) == {"0", "1"}  # a version has no sum
