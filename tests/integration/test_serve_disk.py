"""Filesystem weight updates over HTTP: prime-rl's `weight_dir`, and vLLM's four calls with `disk`.

The trainer writes a checkpoint directory; the server loads it inside its update transaction,
on one server or on every replica of a data-parallel front.
"""

from pathlib import Path

import httpx
import pytest
from serve_support import Server

from weightsync import LlamaForCausalLM, weight_checksums
from weightsync.engine.loader import save_hf_directory
from weightsync.transfer.disk import save_weight_dir

WAIT_S = 120


def post(url: str, path: str, **kwargs) -> httpx.Response:
    return httpx.post(f"{url}{path}", timeout=WAIT_S, **kwargs)


def version(url: str):
    return httpx.get(f"{url}/weight_info", timeout=WAIT_S).json()["weight_version"]


def holds(url: str, policy: LlamaForCausalLM) -> dict:
    """The server's comparison of its weights with `policy`'s (every replica's, on a front)."""
    baseline = weight_checksums(policy.named_weights())
    answer = post(url, "/weight_checker", json={"action": "compare", "baseline": baseline})
    assert answer.status_code == 200, answer.text
    return answer.json()


def prime_rl_update(url: str, weight_dir: Path | None) -> httpx.Response:
    """prime-rl's orchestrator's calls, as its `update_weights` makes them (one server)."""
    paused = post(url, "/pause", params={"mode": "keep", "clear_cache": "false"})
    assert paused.status_code == 200, paused.text
    try:
        if weight_dir is not None:
            (weight_dir / "NCCL_READY").touch()  # its marker file, beside the checkpoint
        return post(
            url,
            "/update_weights",
            json={"weight_dir": weight_dir.as_posix() if weight_dir is not None else None},
        )
    finally:
        resumed = post(url, "/resume")
        assert resumed.status_code == 200, resumed.text


def checkpoint(root: Path, step: int, seed: int) -> tuple[Path, LlamaForCausalLM]:
    """A trainer's checkpoint of step `step`, as Hugging Face writes it: config and safetensors."""
    policy = LlamaForCausalLM.from_preset("debug", seed=seed)
    directory = root / f"step_{step}"
    save_hf_directory(policy, directory)
    return directory, policy


def misfit(root: Path) -> Path:
    """A directory whose down_proj has one column too few: refused before any write."""
    tensors = dict(LlamaForCausalLM.from_preset("debug", seed=99).named_weights())
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_weight_dir(tensors.items(), root / "misfit")
    return root / "misfit"


@pytest.fixture(scope="module")
def server():
    server = Server("debug", "--port", "0")
    yield server
    server.kill()


def test_prime_rls_sequence_loads_each_step_and_the_version_moves(server, tmp_path):
    url = server.base_url
    for step, seed in ((1, 11), (2, 12)):
        directory, policy = checkpoint(tmp_path, step, seed)
        answer = prime_rl_update(url, directory)
        assert answer.status_code == 200, answer.text
        assert answer.json()["weight_update"] is None  # a whole transaction: it finished
        assert holds(url, policy)["match"]
        assert version(url) == step
    completion = post(url, "/v1/completions", json={"prompt": "hi", "max_tokens": 4})
    assert completion.status_code == 200, completion.text
    assert set(completion.json()["choices"][0]["weight_versions"]) == {2}


def test_a_null_weight_dir_changes_nothing(server, tmp_path):
    url = server.base_url
    directory, policy = checkpoint(tmp_path, 3, 13)
    assert prime_rl_update(url, directory).status_code == 200
    before = version(url)
    answer = prime_rl_update(url, None)  # what prime-rl's NCCL mode sends
    assert answer.status_code == 200, answer.text
    assert version(url) == before
    assert holds(url, policy)["match"]


def test_a_directory_that_does_not_fit_is_refused_and_changes_nothing(server, tmp_path):
    url = server.base_url
    directory, policy = checkpoint(tmp_path, 4, 14)
    assert prime_rl_update(url, directory).status_code == 200
    before = version(url)
    answer = prime_rl_update(url, misfit(tmp_path))
    assert answer.status_code == 400, answer.text
    assert "model.layers.1.mlp.down_proj.weight" in answer.json()["error"]["message"]
    assert version(url) == before
    assert holds(url, policy)["match"]
    both = post(url, "/update_weights", json={"weight_dir": str(directory), "update_info": {}})
    assert both.status_code == 400
    assert both.json()["error"]["param"] == "weight_dir"


def test_vllms_four_calls_load_a_directory_with_the_disk_backend(tmp_path):
    server = Server("debug", "--port", "0", "--weight-transfer-config", '{"backend": "disk"}')
    try:
        url = server.base_url
        directory, policy = checkpoint(tmp_path, 1, 21)
        for path, body in (
            ("/init_weight_transfer_engine", {"init_info": {}}),
            ("/start_weight_update", {}),
            ("/update_weights", {"update_info": {"path": str(directory)}}),
        ):
            answer = post(url, path, json=body)
            assert answer.status_code == 200, (path, answer.text)
        assert version(url) == 0  # the version moves at finish
        finished = post(url, "/finish_weight_update", json={"weight_version": "step-1"})
        assert finished.status_code == 200, finished.text
        assert version(url) == "step-1"
        assert holds(url, policy)["match"]
    finally:
        server.kill()


def test_a_replica_front_loads_a_directory_on_every_replica_or_on_none(tmp_path):
    server = Server("debug", "--port", "0", "--data-parallel-size", "2")
    try:
        url = server.base_url
        directory, policy = checkpoint(tmp_path, 1, 31)
        answer = prime_rl_update(url, directory)
        assert answer.status_code == 200, answer.text
        checked = holds(url, policy)
        assert checked["match"]
        assert [r["mismatches"] for r in checked["replicas"]] == [[], []]
        assert version(url) == 1

        refused = prime_rl_update(url, misfit(tmp_path))
        assert refused.status_code == 400, refused.text
        assert version(url) == 1
        assert httpx.get(f"{url}/weight_info", timeout=WAIT_S).json()["replicas"] == [1, 1]
        assert holds(url, policy)["match"]
    finally:
        server.kill()
