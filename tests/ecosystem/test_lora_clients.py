"""Other RL frameworks' LoRA calls, unchanged, against `weightsync serve --enable-lora`.

Each framework's adapter sync is replayed with its exact routes, bodies and answer reads:
- prime-rl (`src/prime_rl/utils/client.py`, not a published package): `POST /load_lora_adapter`
  (its vLLM extension's route, no `/v1`) with `{"lora_name", "lora_path"}` under one name at each
  step, `raise_for_status` and a retry on 404 or 500; requests then name the adapter as `model`.
- SkyRL 0.3.0 (`RemoteInferenceClient.load_lora_adapter`, not importable on Python 3.11: see
  test_skyrl_calls.py): `POST /skyrl/v1/load_lora_adapter` with the same body, one name reloaded
  from one directory that each sync overwrites, errors read from the JSON body's
  `error.message`; generation by `/inference/v1/generate` with `model` the adapter's name;
  `POST /v1/unload_lora_adapter`.
- TRL 1.16's async GRPO `VLLMClient`, the real class: a new name per policy version,
  `{lora_name}-v{N}`, loaded by vLLM's `/v1/load_lora_adapter` without `load_inplace`, the stale
  version unloaded; its rollout worker's `/v1/completions` payload names the version as `model`.
An adapter's answer is checked against greedy tokens of the merged weights, computed here.
"""

from __future__ import annotations

import shutil

import httpx
import pytest
import torch
from serve_support import Server

from lora_adapters import adapter_tensors, merged_model, peft_config, write_adapter
from weightsync import EngineConfig, LlamaForCausalLM, LLMEngine, SamplingParams

WAIT_S = 60
PROMPT = "adapters ride on the base weights"
MAX_TOKENS = 6
SCALING = 8 / 4  # peft_config(): lora_alpha 8, r 4
# SkyRL's get_vllm_sampling_params, greedy so that the tokens can be compared.
SKYRL_SAMPLING_PARAMS = {
    "min_tokens": 1, "skip_special_tokens": True, "include_stop_str_in_output": True,
    "max_tokens": MAX_TOKENS, "temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
    "logprobs": 0, "stop": None,
}  # fmt: skip


def _base_model() -> LlamaForCausalLM:
    # The server's weights: the debug preset from seed 0, in float64 (no rounding ties).
    return LlamaForCausalLM.from_preset("debug", seed=0, dtype=torch.float64)


@pytest.fixture(scope="module")
def policies(tmp_path_factory) -> dict[int, tuple[dict[str, torch.Tensor], str]]:
    """Three policy versions of one adapter: each version's tensors and its directory."""
    root = tmp_path_factory.mktemp("policies")
    model = _base_model()
    versions = {}
    for step in (1, 2, 3):
        tensors = adapter_tensors(model, seed=10 + step)
        versions[step] = (tensors, write_adapter(root / f"step_{step}", tensors, peft_config()))
    return {step: (tensors, path.as_posix()) for step, (tensors, path) in versions.items()}


@pytest.fixture(scope="module")
def merged(policies) -> dict[int, list[int]]:
    """Each version's greedy tokens for PROMPT, from the merged weights."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    tokens = {}
    for step, (tensors, _) in policies.items():
        engine = LLMEngine(merged_model(_base_model(), tensors, SCALING),
                           engine_config=EngineConfig(num_kv_blocks=64))  # fmt: skip
        tokens[step] = engine.generate([PROMPT], params)[0].outputs[0].token_ids
    assert len({tuple(t) for t in tokens.values()}) == 3  # the versions are told apart
    return tokens


@pytest.fixture(scope="module")
def server() -> Server:
    server = Server("debug", "--port", "0", "--dtype", "float64", "--num-kv-blocks", "256",
                    "--enable-lora", "--max-loras", "4", "--max-lora-rank", "8")  # fmt: skip
    yield server
    server.stop()


@pytest.fixture
def admin(server):
    with httpx.Client(base_url=server.base_url, timeout=WAIT_S) as client:
        yield client


def _completion_tokens(admin: httpx.Client, model: str) -> list[int]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    answer = admin.post("/v1/completions", json=body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == model
    return answer.json()["choices"][0]["token_ids"]


def _model_ids(admin: httpx.Client) -> list[str]:
    return [card["id"] for card in admin.get("/v1/models").json()["data"]]


def test_prime_rl_reloads_one_name_at_each_step(admin, policies, merged):
    for step in (1, 2):
        # load_lora_adapter: its body, its timeouts, raise_for_status.
        answer = admin.post(
            "/load_lora_adapter",
            json={"lora_name": "prime-policy", "lora_path": policies[step][1]},
            timeout=httpx.Timeout(connect=10.0, read=30.0, write=60.0, pool=10.0),
        )
        answer.raise_for_status()
        assert answer.json() == {"status": "ok"}  # its extension's answer
        # The orchestrator then names the adapter as the model of its requests.
        assert _completion_tokens(admin, "prime-policy") == merged[step]
    assert _model_ids(admin).count("prime-policy") == 1
    # unload_lora_adapter: vLLM's route.
    admin.post("/v1/unload_lora_adapter", json={"lora_name": "prime-policy"})
    assert "prime-policy" not in _model_ids(admin)


def test_skyrl_reloads_one_name_and_generates_with_it(admin, policies, merged, tmp_path):
    ids = []
    lora_sync_path = tmp_path / "lora_sync"  # SkyRL writes every version into one directory
    for step in (1, 3):
        shutil.copytree(policies[step][1], lora_sync_path, dirs_exist_ok=True)
        answer = admin.post(
            "/skyrl/v1/load_lora_adapter",
            json={"lora_name": "skyrl-lora", "lora_path": str(lora_sync_path)},
        )
        assert answer.status_code < 400, answer.text
        body = answer.json()  # its extension's answer
        assert body["status"] == "ok" and body["lora_name"] == "skyrl-lora"
        ids.append(body["lora_int_id"])
        # _generate_single: tokens in, tokens out, `model` the adapter's name.
        generated = admin.post("/inference/v1/generate", json={
            "sampling_params": SKYRL_SAMPLING_PARAMS, "model": "skyrl-lora",
            "token_ids": admin.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"],
            "cache_salt": "0",
        })  # fmt: skip
        assert generated.status_code == 200, generated.text
        assert generated.json()["choices"][0]["token_ids"] == merged[step]
    assert ids[0] == ids[1]  # vLLM keeps the name's id across reloads
    unloaded = admin.post("/v1/unload_lora_adapter", json={"lora_name": "skyrl-lora"})
    assert unloaded.status_code == 200, unloaded.text
    assert "skyrl-lora" not in _model_ids(admin)


@pytest.mark.parametrize("route", ["/load_lora_adapter", "/skyrl/v1/load_lora_adapter"])
def test_the_extension_routes_refuse_as_vllms_route(admin, policies, route):
    before = _model_ids(admin)
    # A directory not there yet (NFS lag): 404, which prime-rl retries.
    missing = admin.post(route, json={"lora_name": "late", "lora_path": "/nonexistent/adapter"})
    assert missing.status_code == 404
    assert missing.json()["error"]["message"]  # what SkyRL's raise_for_status reads
    for body in (
        {"lora_path": policies[1][1]},
        {"lora_name": "debug", "lora_path": policies[1][1]},
    ):
        assert admin.post(route, json=body).status_code == 400
    assert _model_ids(admin) == before


def test_trl_async_grpo_publishes_a_new_name_per_version(server, admin, policies, merged):
    client_module = pytest.importorskip("trl.experimental.async_grpo.vllm_client")
    pytest.importorskip("accelerate")
    client = client_module.VLLMClient(server.base_url, server_timeout=WAIT_S)
    assert client.get_max_model_len() > 0  # the base model's card comes first
    prompt_ids = admin.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    for version in (1, 2):
        client.load_lora_adapter(f"trl-policy-v{version}", policies[version][1])
        # _generate_one_turn's payload, its model the published version.
        answer = admin.post("/v1/completions", json={
            "model": f"trl-policy-v{version}", "prompt": prompt_ids, "max_tokens": MAX_TOKENS,
            "temperature": 0.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "n": 1,
            "return_token_ids": True, "logprobs": 0, "seed": 12345,
        })  # fmt: skip
        assert answer.status_code == 200, answer.text
        choice = answer.json()["choices"][0]
        assert choice["token_ids"] == merged[version]
        assert len(choice["logprobs"]["token_logprobs"]) == MAX_TOKENS
    client.unload_lora_adapter("trl-policy-v1")  # the stale version
    client.unload_lora_adapter("trl-policy-v1")  # missing: not an error to the client
    ids = _model_ids(admin)
    assert "trl-policy-v1" not in ids and "trl-policy-v2" in ids
    client.unload_lora_adapter("trl-policy-v2")


@pytest.fixture(scope="module")
def openai_client(server):
    openai = pytest.importorskip("openai")
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def served_adapter(server, policies):
    """An adapter loaded by vLLM's route for the `openai` client's requests: version 2's."""
    with httpx.Client(base_url=server.base_url, timeout=WAIT_S) as admin:
        load = {"lora_name": "oa", "lora_path": policies[2][1]}
        assert admin.post("/v1/load_lora_adapter", json=load).status_code == 200
        yield "oa"
        assert admin.post("/v1/unload_lora_adapter", json={"lora_name": "oa"}).status_code == 200


# vLLM's sampling extras, as `openai` users send them.
VLLM_EXTRAS = {"top_k": 1, "repetition_penalty": 1.0, "min_tokens": MAX_TOKENS, "ignore_eos": True,
               "return_token_ids": True}  # fmt: skip


def test_openai_completions_name_the_adapter_as_model(openai_client, served_adapter, merged):
    answer = openai_client.completions.create(
        model=served_adapter, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
        extra_body=VLLM_EXTRAS,
    )  # fmt: skip
    assert answer.model == served_adapter
    assert answer.choices[0].model_extra["token_ids"] == merged[2]
    stream = openai_client.completions.create(
        model=served_adapter, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        extra_body=VLLM_EXTRAS,
    )  # fmt: skip
    chunks = list(stream)
    assert {chunk.model for chunk in chunks} == {served_adapter}
    assert answer.choices[0].text
    assert "".join(c.choices[0].text for c in chunks if c.choices) == answer.choices[0].text


def test_openai_chat_names_the_adapter_as_model(openai_client, served_adapter):
    messages = [{"role": "user", "content": "hi"}]

    def chat(model: str) -> tuple[str, list[int]]:
        answer = openai_client.chat.completions.create(
            model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
            extra_body=VLLM_EXTRAS,
        )  # fmt: skip
        assert answer.model == model
        return answer.choices[0].message.content, answer.choices[0].model_extra["token_ids"]

    text, tokens = chat(served_adapter)
    assert text and len(tokens) == MAX_TOKENS
    assert tokens != chat("debug")[1]  # the adapter, not the base model, answered
    stream = openai_client.chat.completions.create(
        model=served_adapter, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
        stream=True, extra_body=VLLM_EXTRAS,
    )  # fmt: skip
    chunks = list(stream)
    assert {chunk.model for chunk in chunks} == {served_adapter}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text


def test_the_extension_routes_need_the_admin_key(policies):
    # prime-rl's and SkyRL's admin clients send the key as `Authorization: Bearer KEY`.
    keyed = Server("debug", "--port", "0", "--dtype", "float64", "--num-kv-blocks", "64",
                   "--enable-lora", "--max-lora-rank", "8",
                   env={"WEIGHTSYNC_ADMIN_API_KEY": "admin-secret"})  # fmt: skip
    try:
        for route in ("/load_lora_adapter", "/skyrl/v1/load_lora_adapter"):
            body = {"lora_name": "keyed", "lora_path": policies[1][1]}
            refused = httpx.post(keyed.base_url + route, json=body, timeout=WAIT_S)
            assert refused.status_code == 401, refused.text
            assert refused.json()["error"]["param"] == "Authorization"
            loaded = httpx.post(keyed.base_url + route, json=body, timeout=WAIT_S,
                                headers={"Authorization": "Bearer admin-secret"})  # fmt: skip
            assert loaded.status_code == 200, loaded.text
    finally:
        keyed.stop()
