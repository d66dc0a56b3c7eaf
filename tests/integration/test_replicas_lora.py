"""LoRA behind `weightsync serve --data-parallel-size 2 --enable-lora`: all or none across replicas.

A front and two replica processes for the module. Adapters reach both replicas or neither: from
`--lora-modules`, from `/v1/load_lora_adapter`, and from a trainer (this process) that pushes an
adapter over gloo through the front. To make one replica refuse what the other takes, a test
calls that replica directly, with the private admin key the front gave it, as no client would.
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

import httpx
import pytest
import torch
from replica_support import WAIT_S, connect_gloo, get, one_per_replica, post, replica_pids
from serve_support import Server

from lora_adapters import adapter_tensors, merged_model, peft_config, write_adapter
from weightsync import (
    EngineConfig,
    LlamaForCausalLM,
    LLMEngine,
    NCCLTrainerSendWeightsArgs,
    SamplingParams,
    WeightTransferUpdateInfo,
    trainer_send_weights,
)
from weightsync.serve._parser import ADMIN_API_KEY_ENV

N = 2
PROMPT = "adapters ride on the base weights"
MAX_TOKENS = 8
SCALING = 8 / 4  # peft_config(): lora_alpha 8, r 4


def base_model() -> LlamaForCausalLM:
    return LlamaForCausalLM.from_preset("debug", seed=0, dtype=torch.float64)


def adapter(seed: int) -> dict[str, torch.Tensor]:
    return {n: t.double() for n, t in adapter_tensors(base_model(), seed=seed).items()}


def merged_tokens(tensors: dict[str, torch.Tensor]) -> list[int]:
    engine = LLMEngine(merged_model(base_model(), tensors, SCALING),
                       engine_config=EngineConfig(num_kv_blocks=64))  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    return engine.generate([PROMPT], params)[0].outputs[0].token_ids


def greedy(model: str) -> dict:
    return {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}


def listening_ports(pid: int) -> set[int]:
    """The TCP ports process `pid` listens on (Linux: its socket inodes in /proc/net/tcp)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):  # a descriptor closed meanwhile
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    ports = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
            ports.add(int(fields[1].split(":")[1], 16))
    return ports


def replica_client(pid: int) -> httpx.Client:
    """A direct client of one replica: its one listening socket, and the key the front gave it.

    Called before any transfer group exists, so the replica's HTTP socket is its only one.
    """
    ports = listening_ports(pid)
    assert len(ports) == 1, ports
    environ = Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")
    key = next(e.split("=", 1)[1] for e in environ if e.startswith(f"{ADMIN_API_KEY_ENV}="))
    return httpx.Client(base_url=f"http://127.0.0.1:{ports.pop()}", timeout=WAIT_S,
                        headers={"Authorization": f"Bearer {key}"})  # fmt: skip


def adapter_names(http: httpx.Client) -> list[str]:
    return [card["id"] for card in http.get("/v1/models").json()["data"][1:]]


@pytest.fixture(scope="module")
def static(tmp_path_factory):
    tensors = adapter(31)
    return tensors, write_adapter(tmp_path_factory.mktemp("static"), tensors, peft_config())


@pytest.fixture(scope="module")
def server(static):
    server = Server("debug", "--port", "0", "--dtype", "float64", "--num-kv-blocks", "64",
                    "--data-parallel-size", str(N), "--enable-lora", "--max-lora-rank", "8",
                    "--lora-modules", f"static={static[1]}",
                    "--weight-transfer-config.backend", "gloo")  # fmt: skip
    server.replicas = [replica_client(pid) for pid in replica_pids(server.base_url)]
    yield server
    for client in server.replicas:
        client.close()
    server.kill()


def test_lora_modules_reach_every_replica_and_models_lists_each_adapter_once(server, static):
    models = get(server.base_url, "/v1/models")["data"]
    assert [(m["id"], m["parent"]) for m in models] == [("debug", None), ("static", "debug")]
    assert models[1]["root"] == str(static[1])
    answers = one_per_replica(server.base_url, N, greedy("static"))
    assert [a["choices"][0]["token_ids"] for a in answers] == [merged_tokens(static[0])] * N
    assert [a["model"] for a in answers] == ["static"] * N


def test_a_load_and_an_unload_reach_every_replica(server, tmp_path):
    tensors = adapter(32)
    path = write_adapter(tmp_path / "b", tensors, peft_config())
    loaded = httpx.post(f"{server.base_url}/v1/load_lora_adapter", timeout=WAIT_S,
                        json={"lora_name": "b", "lora_path": str(path)})  # fmt: skip
    assert loaded.status_code == 200, loaded.text
    assert loaded.text == "Success: LoRA adapter 'b' added successfully."
    assert [adapter_names(r) for r in server.replicas] == [["static", "b"]] * N
    answers = one_per_replica(server.base_url, N, greedy("b"))
    assert [a["choices"][0]["token_ids"] for a in answers] == [merged_tokens(tensors)] * N
    post_text = httpx.post(f"{server.base_url}/v1/unload_lora_adapter", timeout=WAIT_S,
                           json={"lora_name": "b"})  # fmt: skip
    assert post_text.text == "Success: LoRA adapter 'b' removed successfully."
    assert [adapter_names(r) for r in server.replicas] == [["static"]] * N
    unknown = httpx.post(f"{server.base_url}/v1/completions", json=greedy("b"), timeout=WAIT_S)
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"


def test_a_load_one_replica_refuses_is_undone_on_the_other_and_answered_as_one_server(
    server, tmp_path
):
    first = write_adapter(tmp_path / "first", adapter(33), peft_config())
    second = write_adapter(tmp_path / "second", adapter(34), peft_config())
    lone = server.replicas[1].post("/v1/load_lora_adapter",
                                   json={"lora_name": "c", "lora_path": str(first)})  # fmt: skip
    assert lone.status_code == 200, lone.text
    try:
        answer = httpx.post(f"{server.base_url}/v1/load_lora_adapter", timeout=WAIT_S,
                            json={"lora_name": "c", "lora_path": str(second)})  # fmt: skip
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["type"] == "LoRAAdapterError"
        assert "replica 1" in error["message"] and "has already been loaded" in error["message"]
        # Replica 0 took it and unloaded it again; replica 1 kept its own, untouched.
        assert [adapter_names(r) for r in server.replicas] == [["static"], ["static", "c"]]
    finally:
        server.replicas[1].post("/v1/unload_lora_adapter", json={"lora_name": "c"})


def push(base_url: str, group, tensors: dict, version: str, *, config=None, before_finish=None):
    """start (lora_name) -> update_weights while the trainer broadcasts -> finish; no pause."""
    pairs = sorted(tensors.items())
    update_info = WeightTransferUpdateInfo.from_named_tensors(pairs).to_dict()
    post(base_url, "/start_weight_update",
         json={"lora_name": "policy", **({"lora_config": config} if config else {})})  # fmt: skip
    answers: list[dict] = []
    receiving = threading.Thread(
        target=lambda: answers.append(
            post(base_url, "/update_weights", json={"update_info": update_info})
        )
    )
    receiving.start()
    trainer_send_weights(pairs, NCCLTrainerSendWeightsArgs(group, update_info))
    receiving.join(WAIT_S)
    assert answers, "update_weights did not answer"
    if before_finish is not None:
        before_finish()
    return httpx.post(f"{base_url}/finish_weight_update", timeout=WAIT_S,
                      json={"weight_version": version})  # fmt: skip


def test_an_adapter_pushed_over_gloo_through_the_front_commits_on_every_replica_or_none(server):
    group = connect_gloo(server.base_url)
    try:
        first, second = adapter(41), adapter(42)
        finished = push(server.base_url, group, first, "step-1", config=peft_config())
        assert finished.status_code == 200, finished.text
        assert finished.json()["lora_name"] == "policy"
        assert finished.json()["weight_version"] == "step-1"
        answers = one_per_replica(server.base_url, N, greedy("policy"))
        assert [a["choices"][0]["token_ids"] for a in answers] == [merged_tokens(first)] * N
        assert {v for a in answers for v in a["choices"][0]["weight_versions"]} == {"step-1"}

        # Replica 1 ends the update by itself before the finish: the front's finish refuses,
        # and neither replica moves to the second version.
        def end_on_replica_1() -> None:
            ended = server.replicas[1].post("/abort_weight_update")
            assert ended.status_code == 200 and ended.json()["aborted"] is True, ended.text

        refused = push(server.base_url, group, second, "step-2", before_finish=end_on_replica_1)
        assert refused.status_code == 409, refused.text
        assert "replica 1" in refused.json()["error"]["message"]
        answers = one_per_replica(server.base_url, N, greedy("policy"))
        assert [a["choices"][0]["token_ids"] for a in answers] == [merged_tokens(first)] * N
        assert {v for a in answers for v in a["choices"][0]["weight_versions"]} == {"step-1"}
        assert get(server.base_url, "/engine_stats")["weight_update"] is None

        # The fleet takes the next update whole.
        finished = push(server.base_url, group, second, "step-3")
        assert finished.status_code == 200, finished.text
        answers = one_per_replica(server.base_url, N, greedy("policy"))
        assert [a["choices"][0]["token_ids"] for a in answers] == [merged_tokens(second)] * N
        assert {v for a in answers for v in a["choices"][0]["weight_versions"]} == {"step-3"}
    finally:
        group.close()
