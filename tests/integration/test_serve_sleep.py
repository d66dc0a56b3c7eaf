"""`/sleep`, `/wake_up` and `/is_sleeping` on a real server: the memory goes, and comes back.

Resident memory is read from /proc before and after each level: level 1 gives back the KV
cache, level 2 the weights too (vLLM 0.32 on a CPU gives back nothing and says it sleeps).
"""

from pathlib import Path

import httpx
import pytest
from serve_support import Server

from weightsync import LlamaConfig

pytestmark = pytest.mark.reliability("fault")

BLOCKS, BLOCK_SIZE = 2048, 16
COMPLETION = {"prompt": "hi", "max_tokens": 4, "temperature": 0, "ignore_eos": True}


def rss_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split("VmRSS:")[1].split()[0]) * 1024


def sizes() -> tuple[int, int]:
    """The KV cache's bytes and the weights' bytes of the `small` preset in float32."""
    config = LlamaConfig.preset("small")
    kv = config.num_hidden_layers * 2 * config.num_key_value_heads * config.kv_head_dim
    kv_bytes = kv * BLOCKS * BLOCK_SIZE * 4
    embed = config.vocab_size * config.hidden_size
    attention = (
        config.hidden_size
        * config.head_dim
        * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)
    )
    mlp = 3 * config.hidden_size * config.intermediate_size
    layers = config.num_hidden_layers * (attention + mlp)
    return kv_bytes, 4 * (layers + embed * (1 if config.tie_word_embeddings else 2))


def test_sleep_gives_the_memory_back_and_wake_up_serves_again(record_property):
    """sleep level 1 frees the KV cache, level 2 the weights too; wake_up serves again."""
    server = Server("small", "--port", "0", "--num-kv-blocks", str(BLOCKS),
                    "--block-size", str(BLOCK_SIZE), "--weight-transfer-config.backend", "gloo")  # fmt: skip
    try:
        with httpx.Client(base_url=server.base_url, timeout=60) as client:
            assert client.post("/v1/completions", json=COMPLETION).status_code == 200
            kv_bytes, weight_bytes = sizes()
            awake = rss_bytes(server.proc.pid)
            assert client.post("/sleep", params={"level": 1}).json() == {
                "status": "sleeping", "level": 1
            }  # fmt: skip
            level1 = rss_bytes(server.proc.pid)
            assert awake - level1 >= 0.8 * kv_bytes, (awake, level1, kv_bytes)
            refused = client.post("/v1/completions", json=COMPLETION)
            assert refused.status_code == 409 and "asleep" in refused.json()["error"]["message"]
            assert client.post("/sleep", params={"level": 2}).status_code == 200
            level2 = rss_bytes(server.proc.pid)
            assert level1 - level2 >= 0.8 * weight_bytes, (level1, level2, weight_bytes)
            assert client.get("/is_sleeping").json() == {"is_sleeping": True}
            assert client.post("/wake_up").json() == {"status": "awake", "tags": None}
            # The weights hold nothing valid until written: a reset writes them whole (zeros).
            assert client.post("/weight_checker", json={"action": "reset"}).status_code == 200
            assert client.post("/resume").status_code == 200
            answer = client.post("/v1/completions", json=COMPLETION)
            assert answer.status_code == 200
            assert len(answer.json()["choices"][0]["token_ids"]) == 4
        record_property(
            "message",
            f"resident memory {awake >> 20} MiB awake, {level1 >> 20} MiB at level 1 "
            f"(KV cache {kv_bytes >> 20} MiB), {level2 >> 20} MiB at level 2 "
            f"(weights {weight_bytes >> 20} MiB)",
        )
    finally:
        server.stop()
        server.kill()


def test_a_data_parallel_front_puts_every_replica_to_sleep_and_wakes_them():
    """A front's /sleep and /wake_up act on every replica."""
    server = Server("debug", "--port", "0", "--data-parallel-size", "2", "--num-kv-blocks", "64")
    try:
        with httpx.Client(base_url=server.base_url, timeout=60) as client:
            assert client.post("/sleep", params={"level": 1}).status_code == 200
            assert client.get("/is_sleeping").json() == {
                "is_sleeping": True,
                "replicas": [True] * 2,
            }
            assert client.post("/v1/completions", json=COMPLETION).status_code == 409
            woken = client.post("/wake_up", params={"tags": "weights"})
            assert woken.json() == {"status": "sleeping", "tags": ["weights"]}
            woken = client.post("/wake_up", params=[("tags", "kv_cache"), ("tags", "scheduling")])
            assert woken.json() == {"status": "awake", "tags": ["kv_cache", "scheduling"]}
            assert client.post("/v1/completions", json=COMPLETION).status_code == 200
    finally:
        server.stop()
        server.kill()
