"""Adapter-only sync into a real `weightsync serve` over HTTP and gloo: the trainer (this process)
pushes an adapter's tensors alone with `sync_weights(..., lora_name=...)`; completions that name
the adapter then answer as its merged weights do, each token naming the adapter's version."""

from __future__ import annotations

import httpx
import pytest
import torch
from serve_support import Server

from lora_adapters import adapter_tensors, merged_model, peft_config
from weightsync import EngineConfig, LlamaForCausalLM, LLMEngine, SamplingParams
from weightsync.trainer import BroadcastWeightSender, HTTPEngineClient, sync_weights

PROMPT = "adapters ride on the base weights"
MAX_TOKENS = 8
SCALING = 8 / 4  # peft_config(): lora_alpha 8, r 4


def base_model() -> LlamaForCausalLM:
    return LlamaForCausalLM.from_preset("debug", seed=0, dtype=torch.float64)


def merged_tokens(tensors: dict[str, torch.Tensor]) -> list[int]:
    engine = LLMEngine(merged_model(base_model(), tensors, SCALING),
                       engine_config=EngineConfig(num_kv_blocks=256))  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    return engine.generate([PROMPT], params)[0].outputs[0].token_ids


@pytest.fixture(scope="module")
def server():
    server = Server("debug", "--port", "0", "--dtype", "float64", "--num-kv-blocks", "256",
                    "--enable-lora", "--max-lora-rank", "8",
                    "--weight-transfer-config.backend", "gloo")  # fmt: skip
    yield server
    server.stop()


def test_a_trainer_pushes_an_adapter_over_gloo_into_a_server(server):
    first = {n: t.double() for n, t in adapter_tensors(base_model(), seed=41).items()}
    second = {n: t.double() for n, t in adapter_tensors(base_model(), seed=42).items()}
    client = HTTPEngineClient(server.base_url)
    body = {"model": "policy", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    with BroadcastWeightSender([client], backend="gloo") as sender:
        sync_weights(sender, first.items(), lora_name="policy", lora_config=peft_config(),
                     weight_version="step-1")  # fmt: skip
        with httpx.Client(base_url=server.base_url, timeout=60) as http:
            answer = http.post("/v1/completions", json=body).json()["choices"][0]
            assert answer["token_ids"] == merged_tokens(first)
            assert answer["weight_versions"] == ["step-1"] * MAX_TOKENS
            sync_weights(sender, second.items(), lora_name="policy", weight_version="step-2")
            answer = http.post("/v1/completions", json=body).json()["choices"][0]
            assert answer["token_ids"] == merged_tokens(second)
            assert answer["weight_versions"] == ["step-2"] * MAX_TOKENS
            assert http.get("/weight_info").json()["weight_version"] == 0
            assert "policy" in [card["id"] for card in http.get("/v1/models").json()["data"]]
    assert client.last_adapter_commit is not None
    assert client.last_adapter_commit.weight_version == "step-2"
    client.close()
