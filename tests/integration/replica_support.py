"""Helpers for tests of a data-parallel `weightsync serve`: its replicas, and a broadcast into them."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx

from weightsync import (
    LlamaForCausalLM,
    NCCLTrainerSendWeightsArgs,
    TrainerGroup,
    WeightTransferUpdateInfo,
    trainer_init,
    trainer_send_weights,
)

WAIT_S = 120


def post(base_url: str, path: str, **kwargs) -> dict:
    response = httpx.post(f"{base_url}{path}", timeout=WAIT_S, **kwargs)
    assert response.status_code == 200, response.text
    return response.json()


def get(base_url: str, path: str, **kwargs) -> dict:
    response = httpx.get(f"{base_url}{path}", timeout=WAIT_S, **kwargs)
    assert response.status_code == 200, response.text
    return response.json()


def replica_pids(base_url: str) -> list[int]:
    return [r["pid"] for r in get(base_url, "/health")["replicas"]]


def per_replica(base_url: str, key: str) -> list:
    return [r[key] for r in get(base_url, "/engine_stats")["replicas"]]


def connect_gloo(base_url: str) -> TrainerGroup:
    """The trainer's group of a broadcast into every replica (world size from the server)."""
    world_size = get(base_url, "/get_world_size")["world_size"]
    group = trainer_init(world_size=world_size + 1, backend="gloo", timeout_s=60)
    joining = threading.Thread(
        target=post,
        args=(base_url, "/init_weight_transfer_engine"),
        kwargs={"json": {"init_info": group.init_info}},
    )
    joining.start()
    group.connect()
    joining.join(WAIT_S)
    return group


def broadcast_update(
    base_url: str, group: TrainerGroup, policy: LlamaForCausalLM, version: int | str
) -> None:
    """pause(keep) -> start -> update while the trainer broadcasts -> finish -> resume."""
    pairs = list(policy.named_weights())
    update_info = WeightTransferUpdateInfo.from_named_tensors(pairs).to_dict()
    post(base_url, "/pause", params={"mode": "keep"})
    post(base_url, "/start_weight_update")
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
    post(base_url, "/finish_weight_update", json={"weight_version": version})
    post(base_url, "/resume")


def one_per_replica(base_url: str, num_replicas: int, body: dict) -> list[dict]:
    """Runs `body` once on each replica: queued while paused, so each lands on its own one."""
    post(base_url, "/pause", params={"mode": "keep"})
    answers: list[dict] = [{} for _ in range(num_replicas)]

    def run(index: int) -> None:
        answers[index] = post(base_url, "/v1/completions", json=body)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(num_replicas)]
    for started, thread in enumerate(threads, start=1):
        thread.start()
        wait_for(lambda n=started: sum(per_replica(base_url, "num_unfinished")) >= n)
    assert per_replica(base_url, "num_unfinished") == [1] * num_replicas
    post(base_url, "/resume")
    for thread in threads:
        thread.join(WAIT_S)
    return answers


def wait_for(condition, timeout_s: float = WAIT_S) -> None:
    """Polls a server-side condition that has no event to await, until it holds."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition did not hold in time"
        time.sleep(0.02)


def is_gone(pid: int) -> bool:
    """Whether the process exited (a zombie nobody reaped counts as gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "State:\tZ" in status


def stream_lines(base_url: str, body: dict, out: list[dict], done: threading.Event) -> None:
    """Collects the JSON events of a streamed completion into `out`; sets `done` at its end."""
    try:
        with httpx.stream("POST", f"{base_url}/v1/completions", json={**body, "stream": True},
                          timeout=WAIT_S) as response:  # fmt: skip
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    out.append(json.loads(line[len("data: ") :]))
                elif line == "data: [DONE]":
                    out.append({"done": True})
    finally:
        done.set()
