"""LoRA adapters over real HTTP: vLLM's flags and routes on a real `weightsync serve`.

An adapter is loaded by route (and one by `--lora-modules`), listed in `/v1/models`, served when
a request's `model` names it (its greedy tokens are those of the merged weights, computed in this
process), unloaded; refusals keep vLLM's statuses and change nothing.
"""

from __future__ import annotations

import httpx
import pytest
import torch
from serve_support import Server

from lora_adapters import adapter_tensors, merged_model, peft_config, peft_name, write_adapter
from weightsync import EngineConfig, LlamaForCausalLM, LLMEngine, SamplingParams

PROMPT = "adapters ride on the base weights"
MAX_TOKENS = 8
SCALING = 8 / 4  # peft_config(): lora_alpha 8, r 4


def base_model() -> LlamaForCausalLM:
    # The server's weights: the debug preset from seed 0, in float64 (no rounding ties).
    return LlamaForCausalLM.from_preset("debug", seed=0, dtype=torch.float64)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    model = base_model()
    tensors = {name: adapter_tensors(model, seed=seed) for name, seed in (("a", 1), ("s", 2))}
    paths = {name: write_adapter(root / name, t, peft_config()) for name, t in tensors.items()}
    bad = adapter_tensors(model, seed=3)
    bad[peft_name(1, "k_proj", "A")] = torch.zeros(4, 63)
    paths["bad"] = write_adapter(root / "bad", bad, peft_config())
    return tensors, paths


@pytest.fixture(scope="module")
def server(adapters):
    _, paths = adapters
    server = Server("debug", "--port", "0", "--dtype", "float64", "--num-kv-blocks", "256",
                    "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
                    "--lora-modules", f"s={paths['s']}")  # fmt: skip
    yield server
    server.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client


def merged_tokens(tensors: dict[str, torch.Tensor]) -> list[int]:
    engine = LLMEngine(merged_model(base_model(), tensors, SCALING),
                       engine_config=EngineConfig(num_kv_blocks=256))  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    return engine.generate([PROMPT], params)[0].outputs[0].token_ids


def complete(http: httpx.Client, model: str) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    return http.post("/v1/completions", json=body)


def model_ids(http: httpx.Client) -> list[str]:
    return [card["id"] for card in http.get("/v1/models").json()["data"]]


def test_load_list_generate_unload_as_vllm(http, adapters):
    tensors, paths = adapters
    load = {"lora_name": "a", "lora_path": str(paths["a"])}
    loaded = http.post("/v1/load_lora_adapter", json=load)
    assert loaded.status_code == 200, loaded.text
    assert loaded.text == "Success: LoRA adapter 'a' added successfully."
    cards = {card["id"]: card for card in http.get("/v1/models").json()["data"]}
    assert list(cards) == ["debug", "s", "a"]
    assert cards["a"]["parent"] == "debug" and cards["a"]["root"] == str(paths["a"])
    assert cards["debug"]["parent"] is None
    answer = complete(http, "a")
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == "a"
    tokens = answer.json()["choices"][0]["token_ids"]
    assert tokens == merged_tokens(tensors["a"])
    assert tokens != complete(http, "debug").json()["choices"][0]["token_ids"]
    chat = {"model": "a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    assert http.post("/v1/chat/completions", json=chat).json()["model"] == "a"
    unloaded = http.post("/v1/unload_lora_adapter", json={"lora_name": "a"})
    assert unloaded.status_code == 200, unloaded.text
    assert unloaded.text == "Success: LoRA adapter 'a' removed successfully."
    assert model_ids(http) == ["debug", "s"]
    refused = complete(http, "a")
    assert refused.status_code == 404 and refused.json()["error"]["param"] == "model"
    again = http.post("/v1/unload_lora_adapter", json={"lora_name": "a"})
    assert again.status_code == 404
    assert again.json()["error"]["message"] == "The lora adapter 'a' cannot be found."


def test_an_adapter_given_at_start_is_served(http, adapters):
    tensors, _ = adapters
    answer = complete(http, "s").json()
    assert answer["choices"][0]["token_ids"] == merged_tokens(tensors["s"])


def test_a_second_load_needs_load_inplace(http, adapters):
    _, paths = adapters
    load = {"lora_name": "twice", "lora_path": str(paths["a"])}
    assert http.post("/v1/load_lora_adapter", json=load).status_code == 200
    second = http.post("/v1/load_lora_adapter", json=load)
    assert second.status_code == 400
    assert "has already been loaded" in second.json()["error"]["message"]
    inplace = http.post("/v1/load_lora_adapter", json={**load, "load_inplace": True})
    assert inplace.status_code == 200, inplace.text
    assert model_ids(http).count("twice") == 1
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "twice"}).status_code == 200


def test_a_bad_adapter_is_a_400_naming_the_file_and_tensor_and_changes_nothing(http, adapters):
    _, paths = adapters
    before = model_ids(http)
    refused = http.post(
        "/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(paths["bad"])}
    )
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["type"] == "LoRAAdapterError"
    assert str(paths["bad"] / "adapter_model.safetensors") in error["message"]
    assert peft_name(1, "k_proj", "A") in error["message"]
    assert "expected a floating tensor of shape [4, 64]" in error["message"]
    assert model_ids(http) == before
    assert complete(http, "bad").status_code == 404


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"lora_name": "nowhere", "lora_path": "/nonexistent/adapter"}, 404),
        ({"lora_name": "", "lora_path": "/nonexistent/adapter"}, 400),
        ({"lora_name": "debug", "lora_path": "/nonexistent/adapter"}, 400),
        ({"lora_path": "/nonexistent/adapter"}, 400),
    ],
)
def test_loads_vllm_refuses_are_refused_with_its_status(http, body, status):
    before = model_ids(http)
    refused = http.post("/v1/load_lora_adapter", json=body)
    assert refused.status_code == status, refused.text
    assert model_ids(http) == before


def test_server_info_reports_the_lora_config(http):
    tree = http.get("/server_info", params={"config_format": "json"}).json()["vllm_config"]
    assert tree["lora_config"] == {"max_lora_rank": 8, "max_loras": 2}


def test_without_enable_lora_the_routes_are_not_mounted():
    server = Server("debug", "--port", "0", "--num-kv-blocks", "64")
    try:
        with httpx.Client(base_url=server.base_url, timeout=60) as http:
            for route in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
                answer = http.post(route, json={"lora_name": "a", "lora_path": "/x"})
                assert answer.status_code == 404, route
            info = http.get("/server_info", params={"config_format": "json"}).json()
            assert info["vllm_config"]["lora_config"] is None
    finally:
        server.stop()
