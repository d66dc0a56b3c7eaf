"""prime-rl's orchestrator calls (`src/prime_rl/utils/client.py`), replayed with httpx.

prime-rl is not published as a package, so its calls are sent here as its client sends them:
the health and model checks, the prefill scoring of `prefill_logprobs`, the routes of its own
vLLM extension that it skips on a 404, and `update_weights` with a checkpoint directory that
transformers' `save_pretrained` wrote, as the trainer writes it.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from weightsync import weight_checksums

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

WAIT_S = 60


@pytest.fixture
def admin(server):
    """prime-rl's admin client: the server's root, no `/v1`."""
    with httpx.Client(base_url=server.base_url, timeout=WAIT_S) as client:
        yield client


def test_prime_rl_health_and_model_checks(admin, model_dir):
    assert admin.get("/health").status_code == 200  # check_health
    models = admin.get("/v1/models").json()["data"]  # maybe_check_has_model
    assert any(model["id"] == str(model_dir) for model in models)


def test_prime_rl_prefill_logprobs(admin, model_dir):
    token_ids = [1, 2, 3, 4, 5]
    answer = admin.post("/inference/v1/generate", json={
        "model": str(model_dir), "token_ids": token_ids,
        "sampling_params": {"max_tokens": 1, "temperature": 1.0, "top_p": 1.0,
                            "prompt_logprobs": 1},
    })  # fmt: skip
    assert answer.status_code == 200, answer.text
    # prefill_logprobs' flattening: 0.0 for the leading token, then each token's logprob.
    flat = []
    for entry in answer.json()["prompt_logprobs"]:
        flat.append(next(iter(entry.values()))["logprob"] if entry else 0.0)
    assert len(flat) == len(token_ids) and flat[0] == 0.0
    assert all(value <= 0.0 for value in flat[1:])


def test_prime_rl_extension_routes_answer_404_which_it_skips_or_refuses(admin):
    # init_nccl_broadcast logs "does not exist" on a 404 and goes on (the filesystem path).
    init = admin.post("/init_broadcaster", json={"host": "127.0.0.1", "port": 1, "rank_offset": 0,
                                                 "inference_world_size": 1, "timeout": 10,
                                                 "quantize_in_weight_transfer": False})  # fmt: skip
    assert init.status_code == 404
    # load_lora_adapter retries on 404, then raises: this server runs without --enable-lora
    # (with it, see test_lora_clients.py).
    lora = admin.post("/load_lora_adapter", json={"lora_name": "a", "lora_path": "/nowhere"})
    assert lora.status_code == 404


def test_prime_rl_update_from_a_save_pretrained_directory(admin, model_dir, tmp_path: Path):
    trainer = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for param in trainer.parameters():
            param.add_(0.03)
    weight_dir = tmp_path / "step_1"
    trainer.save_pretrained(weight_dir, safe_serialization=True)
    before = admin.get("/weight_info").json()["weight_version"]
    # update_weights: pause, the NCCL_READY marker, the directory, resume.
    assert admin.post("/pause", params={"mode": "keep", "clear_cache": "false"}).status_code == 200
    try:
        (weight_dir / "NCCL_READY").touch()
        updated = admin.post("/update_weights", json={"weight_dir": weight_dir.as_posix()})
    finally:
        assert admin.post("/resume").status_code == 200
    assert updated.status_code == 200, updated.text
    assert admin.get("/weight_info").json()["weight_version"] != before
    baseline = weight_checksums(trainer.named_parameters())
    checked = admin.post("/weight_checker", json={"action": "compare", "baseline": baseline})
    assert checked.json() == {"match": True, "mismatches": []}
    # NCCL mode's call: its bytes come another way, nothing changes here.
    assert admin.post("/update_weights", json={"weight_dir": None}).status_code == 200
