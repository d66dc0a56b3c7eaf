"""SkyRL 0.3.0's `RemoteInferenceClient` calls, replayed with httpx against `weightsync serve`.

SkyRL's client cannot be imported on Python 3.11: importing any of `skyrl.backends` runs
`skyrl/tinker/types.py`, whose pydantic models use `typing.TypedDict` (pydantic asks for
`typing_extensions.TypedDict` before 3.12). So this test sends the client's requests itself:
the routes, query parameters, bodies and headers of
`skyrl/backends/skyrl_train/inference_servers/remote_inference_client.py`, and reads the answers
the way that client reads them. The weight update is the client's native path
(`init_weight_update_communicator`, then `update_named_weights` with the broadcast sender's
packed update info); its bytes go over gloo with `weightsync.trainer.vllm_gloo`, the stand-in
for the vLLM NCCL helpers SkyRL's sender imports.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from serve_support import Server, serve_gloo

from weightsync import weight_checksums
from weightsync.trainer.vllm_gloo import packed_nccl_broadcast_producer, trainer_init

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

WAIT_S = 60
# get_vllm_sampling_params with SkyRL's default SamplingParams and a few tokens.
SAMPLING_PARAMS = {
    "min_tokens": 1, "skip_special_tokens": True, "include_stop_str_in_output": True,
    "max_tokens": 4, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
    "logprobs": 0, "stop": None,
}  # fmt: skip


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[Server]:
    """A server of its own: a refused update after a level-2 sleep leaves its weights torn."""
    yield from serve_gloo(model_dir)


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=WAIT_S) as client:
        yield client


def _ok(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()


def _generate(http: httpx.Client, model: str, token_ids: list[int]) -> dict:
    """`_generate_single`: what SkyRL reads from `/inference/v1/generate`'s answer."""
    payload = {"sampling_params": SAMPLING_PARAMS, "model": model, "token_ids": token_ids,
               "cache_salt": "0"}  # fmt: skip
    answer = _ok(http.post("/inference/v1/generate", json=payload,
                           headers={"X-Session-ID": "trajectory-1"}))  # fmt: skip
    choice = answer["choices"][0]
    logprobs = [entry["logprob"] for entry in choice["logprobs"]["content"]]
    return {"response_ids": choice["token_ids"], "stop_reason": choice["finish_reason"],
            "response_logprobs": logprobs}  # fmt: skip


def test_skyrl_tokenize_generate_detokenize(http, model_dir):
    model = str(model_dir)
    # get_world_size: a GET with an empty JSON body, read as body["world_size"].
    assert _ok(http.request("GET", "/get_world_size", json={}))["world_size"] == 1
    tokens = _ok(http.post("/tokenize", json={"model": model, "prompt": "The quick brown fox",
                                              "add_special_tokens": True}))["tokens"]  # fmt: skip
    assert tokens and all(isinstance(token, int) for token in tokens)
    output = _generate(http, model, tokens)
    assert len(output["response_ids"]) == 4 and output["stop_reason"] == "length"
    assert len(output["response_logprobs"]) == 4
    text = _ok(http.post("/detokenize", json={"model": model, "tokens": tokens}))["prompt"]
    assert text == "The quick brown fox"


def test_skyrl_pause_resume_and_reset_prefix_cache(http):
    assert http.post("/pause", params={"mode": "keep", "clear_cache": "false"}).status_code == 200
    assert http.get("/is_paused").json() == {"is_paused": True}
    assert http.post("/resume").status_code == 200
    assert http.get("/is_paused").json() == {"is_paused": False}
    reset = http.post("/reset_prefix_cache", json={"reset_running_requests": False})
    assert reset.status_code == 200, reset.text


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# SkyRL's broadcast sender puts vLLM's older `packed` key in the update info; the server refuses
# it (400, unknown key) until it accepts that key as vLLM does.
def _colocated_sync(http: httpx.Client, model_dir: Path, update_extra: dict) -> list:
    """`sleep()`, `wake_up(["weights"])`, the broadcast sync, `wake_up(["kv_cache"])`.

    Returns the trainer's new `(name, tensor)` pairs.
    """
    trainer = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for param in trainer.parameters():
            param.add_(0.02)
    pairs = list(trainer.named_parameters())

    assert _ok(http.post("/sleep", params={"level": "2"}))["level"] == 2
    assert http.get("/is_sleeping").json() == {"is_sleeping": True}
    assert http.post("/wake_up", params={"tags": ["weights"]}).status_code == 200

    # BroadcastInitInfo.to_api_payload() for one server, world size 1 + 1. SkyRL sends no
    # timeout_s (120 s by default): a shorter one ends a refused update's wait sooner.
    init_info = {"master_address": "127.0.0.1", "master_port": _free_port(), "rank_offset": 1,
                 "world_size": 2, "timeout_s": 20}  # fmt: skip
    joined: list[httpx.Response] = []
    joining = threading.Thread(
        target=lambda: joined.append(
            http.post("/init_weight_transfer_engine", json={"init_info": init_info})
        )
    )
    joining.start()
    # create_sender's trainer_init(dict(master_address, master_port, world_size)), swapped.
    group = trainer_init({key: init_info[key] for key in
                          ("master_address", "master_port", "world_size", "timeout_s")})  # fmt: skip
    joining.join(WAIT_S)
    assert joined and joined[0].status_code == 200, joined
    # update_named_weights({**weight_metadata, "packed": True}) beside the packed broadcast.
    update_info = {"names": [name for name, _ in pairs],
                   "dtype_names": [str(p.dtype).removeprefix("torch.") for _, p in pairs],
                   "shapes": [list(p.shape) for _, p in pairs], **update_extra}  # fmt: skip
    updated: list[httpx.Response] = []
    receiving = threading.Thread(
        target=lambda: updated.append(
            http.post("/update_weights", json={"update_info": update_info})
        )
    )
    receiving.start()
    try:
        # trainer_send_weights(iterator, {"group": ..., "packed": True}), swapped.
        packed_nccl_broadcast_producer(iter(pairs), group, 0, lambda item: item[1].detach())
    finally:
        receiving.join(WAIT_S)
        group.group.store = None  # close_communicator's teardown, as TRL's
        group.group.socket = None
    assert updated and updated[0].status_code == 200, updated[0].text
    assert http.post("/wake_up", params={"tags": ["kv_cache"]}).status_code == 200
    return pairs


@pytest.mark.parametrize(
    "update_extra",
    [pytest.param({"packed": True}, id="as-skyrl-sends-it"),
     pytest.param({}, id="without-packed")],
)  # fmt: skip
def test_skyrl_colocated_weight_sync(http, model_dir, update_extra):
    before = http.get("/weight_info").json()["weight_version"]
    pairs = _colocated_sync(http, model_dir, update_extra)
    assert http.get("/weight_info").json()["weight_version"] != before
    baseline = weight_checksums(pairs)
    checked = _ok(http.post("/weight_checker", json={"action": "compare", "baseline": baseline}))
    assert checked == {"match": True, "mismatches": []}


def test_skyrl_generates_after_its_two_wake_ups(http, model_dir):
    try:
        _colocated_sync(http, model_dir, {})
        assert http.get("/is_sleeping").json() == {"is_sleeping": False}
        assert len(_generate(http, str(model_dir), [1, 2, 3])["response_ids"]) == 4
    finally:
        http.post("/wake_up")
