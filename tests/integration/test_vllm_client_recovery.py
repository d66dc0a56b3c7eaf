"""A client that knows only vLLM's calls gets the server back to serving after a refused update.

TRL 1.16's clients speak to a vLLM server with four weight calls, `/pause` and `/resume`, and no
`/abort_weight_update`. On a failed update their failure path is `/finish_weight_update` (the
async GRPO client, then its next step: `/pause`, `/start_weight_update`, ..., `/resume`; the
synchronous client's `weight_update()` context: a finish on the way out). These cases drive those
exact calls and bodies against `weightsync serve`, with the trainer's broadcast on a thread as
TRL runs it. Each update info is TRL's shape for servers older than vLLM 0.28, `packed` included.

After a refusal, the finish answers 200 with `applied: false`: the previous weights and version
stay and the transaction is clean; the next step's update lands and moves the version. Only
weights that a refused update's earlier message had written, without staging, stay refused
(torn) until an update covers them.
"""

from __future__ import annotations

import threading
from typing import Any

import httpx
import pytest
import torch
from replica_support import WAIT_S, get, post
from serve_support import Server

from weightsync import (
    LlamaForCausalLM,
    NCCLTrainerSendWeightsArgs,
    TrainerGroup,
    trainer_init,
    trainer_send_weights,
)
from weightsync.errors import WeightSyncError

pytestmark = pytest.mark.reliability("fault")

BODY = {"prompt": "after", "max_tokens": 3, "temperature": 0, "ignore_eos": True}


@pytest.fixture(
    scope="module",
    params=[(1, False), (1, True), (2, False)],
    ids=["no-staging", "staging", "replica-front"],
)
def server(request):
    replicas, staging = request.param
    server = Server("debug", "--port", "0", "--weight-transfer-config.backend", "gloo",
                    "--num-kv-blocks", "64", "--data-parallel-size", str(replicas),
                    *(["--weight-update-staging"] if staging else []))  # fmt: skip
    server.staging = staging
    yield server
    server.stop()
    server.kill()


@pytest.fixture(scope="module")
def group(server):
    """TRL's init: its four-key init info (no backend, no wire keys) while the trainer joins."""
    url = server.base_url
    world_size = get(url, "/get_world_size")["world_size"] + 1
    group = trainer_init(world_size=world_size, backend="gloo")
    init_info = {key: group.init_info[key] for key in ("master_address", "master_port")}
    init_info |= {"rank_offset": 1, "world_size": world_size}
    joining = threading.Thread(
        target=post,
        args=(url, "/init_weight_transfer_engine"),
        kwargs={"json": {"init_info": init_info}},
    )
    joining.start()
    group.connect()
    joining.join(WAIT_S)
    yield group
    group.close()


def trl_update_info(pairs: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """TRL's update info for vLLM before 0.28: names, dtype names, shapes, `packed`."""
    return {
        "names": [name for name, _ in pairs],
        "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in pairs],
        "shapes": [list(t.shape) for _, t in pairs],
        "packed": True,
    }


def send(url: str, group: TrainerGroup, pairs, update_info: dict[str, Any]) -> httpx.Response:
    """`/update_weights` while the trainer broadcasts on a thread, as TRL's client runs them."""
    trainer_view = {k: v for k, v in update_info.items() if k != "packed"}
    errors: list[BaseException] = []

    def broadcast() -> None:
        try:
            trainer_send_weights(pairs, NCCLTrainerSendWeightsArgs(group, trainer_view))
        except WeightSyncError as exc:  # the server refused it: the trainer learns why
            errors.append(exc)

    trainer = threading.Thread(target=broadcast)
    trainer.start()
    answer = httpx.post(f"{url}/update_weights", json={"update_info": update_info}, timeout=WAIT_S)
    trainer.join(WAIT_S)
    assert not trainer.is_alive()
    assert bool(errors) == (answer.status_code != 200), (errors, answer.text)
    return answer


def wrong_shapes(pairs) -> list[tuple[str, torch.Tensor]]:
    """The same names, one tensor of another shape: a trainer with another model's config."""
    (name, first), *rest = pairs
    return [(name, torch.zeros(first.shape[0] + 1, *first.shape[1:], dtype=first.dtype)), *rest]


def observed(url: str) -> dict[str, Any]:
    stats = get(url, "/engine_stats")
    checksums = post(url, "/weight_checker", json={"action": "checksum"})["checksums"]
    return {
        "version": stats["weight_version"],
        "update": stats["weight_update"],
        "paused": stats["is_paused"],
        "checksums": checksums,
    }


def test_trl_async_grpo_failure_path_then_next_step(server, group):
    """pause, start, update (refused), finish; next step: pause, start, update, finish, resume."""
    url = server.base_url
    before = get(url, "/weight_info")["weight_version"]
    checksums = post(url, "/weight_checker", json={"action": "checksum"})["checksums"]
    policy = list(LlamaForCausalLM.from_preset("debug", seed=11).named_weights())
    # The failing step.
    assert httpx.post(f"{url}/pause", params={"mode": "keep"}, timeout=WAIT_S).status_code == 200
    start = httpx.post(f"{url}/start_weight_update", json={"is_checkpoint_format": True})
    assert start.status_code == 200, start.text
    bad = wrong_shapes(policy)
    refused = send(url, group, bad, trl_update_info(bad))
    assert refused.status_code == 400, refused.text
    finish = httpx.post(f"{url}/finish_weight_update", timeout=WAIT_S)  # TRL's failure path
    assert finish.status_code == 200, finish.text
    assert finish.json()["applied"] is False
    assert observed(url) == {"version": before, "update": None, "paused": True,
                             "checksums": checksums}  # fmt: skip
    # The next step, the same calls, now with the right weights.
    assert httpx.post(f"{url}/pause", params={"mode": "keep"}, timeout=WAIT_S).status_code == 200
    start = httpx.post(f"{url}/start_weight_update", json={"is_checkpoint_format": True})
    assert start.status_code == 200, start.text
    landed = send(url, group, policy, trl_update_info(policy))  # `packed` inside: taken
    assert landed.status_code == 200, landed.text
    finish = httpx.post(f"{url}/finish_weight_update", timeout=WAIT_S)
    assert finish.status_code == 200 and finish.json()["applied"] is True, finish.text
    assert httpx.post(f"{url}/resume", timeout=WAIT_S).status_code == 200
    version = get(url, "/weight_info")["weight_version"]
    assert version != before
    choice = post(url, "/v1/completions", json=BODY)["choices"][0]
    assert choice["weight_versions"] == [version] * BODY["max_tokens"]


def test_finish_then_resume_serves_the_previous_weights(server, group):
    """After a refused update, vLLM's finish and resume alone: serving, weights as before."""
    url = server.base_url
    assert httpx.post(f"{url}/pause", params={"mode": "keep"}, timeout=WAIT_S).status_code == 200
    before = observed(url)
    assert httpx.post(f"{url}/start_weight_update", json={}).status_code == 200
    bad = wrong_shapes(list(LlamaForCausalLM.from_preset("debug", seed=12).named_weights()))
    assert send(url, group, bad, trl_update_info(bad)).status_code == 400
    assert httpx.post(f"{url}/finish_weight_update", json={}, timeout=WAIT_S).json() == {
        "message": "Weight update finished", "applied": False
    }  # fmt: skip
    assert observed(url) == before
    assert httpx.post(f"{url}/resume", timeout=WAIT_S).status_code == 200
    choice = post(url, "/v1/completions", json=BODY)["choices"][0]
    assert choice["weight_versions"] == [before["version"]] * BODY["max_tokens"]


def test_trl_weight_update_context_on_a_running_server_serves_again(server, group):
    """TRL's `weight_update()`: start {}, update (refused), finish {} on the way out; no resume."""
    url = server.base_url
    assert httpx.post(f"{url}/resume", timeout=WAIT_S).status_code == 200
    version = get(url, "/weight_info")["weight_version"]
    assert httpx.post(f"{url}/start_weight_update", json={}).status_code == 200
    bad = wrong_shapes(list(LlamaForCausalLM.from_preset("debug", seed=13).named_weights()))
    assert send(url, group, bad, trl_update_info(bad)).status_code == 400
    assert httpx.post(f"{url}/finish_weight_update", json={}, timeout=WAIT_S).status_code == 200
    assert get(url, "/is_paused")["is_paused"] is False  # the update paused it, its end resumed
    choice = post(url, "/v1/completions", json=BODY)["choices"][0]
    assert choice["weight_versions"] == [version] * BODY["max_tokens"]


def test_a_start_after_a_refused_update_begins_a_new_one(server, group):
    """pause, start, update (refused), then the next step's start at once: a clean new update."""
    url = server.base_url
    assert httpx.post(f"{url}/pause", params={"mode": "keep"}, timeout=WAIT_S).status_code == 200
    assert httpx.post(f"{url}/start_weight_update", json={}).status_code == 200
    policy = list(LlamaForCausalLM.from_preset("debug", seed=14).named_weights())
    bad = wrong_shapes(policy)
    assert send(url, group, bad, trl_update_info(bad)).status_code == 400
    start = httpx.post(f"{url}/start_weight_update", json={"is_checkpoint_format": True})
    assert start.status_code == 200, start.text
    assert send(url, group, policy, trl_update_info(policy)).status_code == 200
    finish = httpx.post(f"{url}/finish_weight_update", json={"weight_version": "v14"})
    assert finish.status_code == 200 and finish.json()["applied"] is True
    assert httpx.post(f"{url}/resume", timeout=WAIT_S).status_code == 200
    assert get(url, "/weight_info")["weight_version"] == "v14"


def test_a_refusal_after_part_of_an_update_landed_stays_refused_without_staging(server, group):
    """Two messages; the second refused. Staging: finish restores (200). Without: torn (409)."""
    url = server.base_url
    policy = list(LlamaForCausalLM.from_preset("debug", seed=15).named_weights())
    assert httpx.post(f"{url}/pause", params={"mode": "keep"}, timeout=WAIT_S).status_code == 200
    before = observed(url)
    assert httpx.post(f"{url}/start_weight_update", json={}).status_code == 200
    half = len(policy) // 2
    assert send(url, group, policy[:half], trl_update_info(policy[:half])).status_code == 200
    bad = wrong_shapes(policy[half:])
    assert send(url, group, bad, trl_update_info(bad)).status_code == 400
    finish = httpx.post(f"{url}/finish_weight_update", json={}, timeout=WAIT_S)
    if server.staging:
        assert finish.status_code == 200 and finish.json()["applied"] is False, finish.text
        assert observed(url) == before  # what landed was restored
        assert httpx.post(f"{url}/resume", timeout=WAIT_S).status_code == 200
        return
    assert finish.status_code == 409, finish.text
    assert finish.json()["error"]["type"] == "TornWeightsError"
    assert get(url, "/engine_stats")["weight_update"] is None  # ended: the next start is clean
    assert httpx.post(f"{url}/resume", timeout=WAIT_S).status_code == 409  # torn: as documented
    assert httpx.post(f"{url}/start_weight_update", json={}).status_code == 200
    assert send(url, group, policy, trl_update_info(policy)).status_code == 200
    assert httpx.post(f"{url}/finish_weight_update", json={}, timeout=WAIT_S).status_code == 200
    assert httpx.post(f"{url}/resume", timeout=WAIT_S).status_code == 200
