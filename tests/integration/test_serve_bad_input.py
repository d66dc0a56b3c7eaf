"""Bad input over HTTP, table-driven, against one `weightsync serve` shared by every case.

Each case runs while a greedy stream of four long choices is in flight. It asserts the status,
the error type and the message, then that nothing moved: the stream is still running after the
case (aborting it then ends it with `finish_reason="abort"`), every token it delivered is the
token a run without the case gives at that position, and `/weight_checker` and `/weight_info`
give the checksums and version of before. (tests/integration/test_serve_rl.py has more malformed-request
cases; this table adds the ones that reach the engine's own validation.)
"""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any

import httpx
import pytest
from serve_support import Server, run_cli

from weightsync import (
    LlamaForCausalLM,
    NCCLTrainerSendWeightsArgs,
    WeightSyncError,
    WeightTransferUpdateInfo,
    trainer_init,
    trainer_send_weights,
)
from weightsync.serve._server import HEADER_TIMEOUT_S
from weightsync.transfer.nccl import _LATEST as LATEST

pytestmark = pytest.mark.reliability("bad-input")

# Long enough that no case, however slow, outlives it: the test aborts it once the case is done.
STREAM = {"prompt": "a", "max_tokens": 480, "n": 4, "ignore_eos": True, "temperature": 0,
          "stream": True}  # fmt: skip
OK = {"prompt": "hi", "max_tokens": 2, "temperature": 0}
GLOO = {"backend": "gloo", "master_address": "127.0.0.1", "master_port": 1, "world_size": 2}

# (id, method, path, body (bytes: sent raw as JSON), status, error type, message part)
CASES: list[tuple[str, str, str, Any, int, str, str]] = [
    # /v1/completions: sampling values the engine refuses.
    ("completion-seed-too-large", "POST", "/v1/completions", {**OK, "seed": 2**64}, 400,
     "InvalidRequestError", "seed must be an int in [-2**63, 2**64)"),
    ("completion-seed-bool", "POST", "/v1/completions", {**OK, "seed": True}, 400,
     "InvalidRequestError", "seed"),
    ("completion-temperature-negative", "POST", "/v1/completions", {**OK, "temperature": -1}, 400,
     "InvalidRequestError", "temperature"),
    ("completion-top-p-above-one", "POST", "/v1/completions", {**OK, "top_p": 1.5}, 400,
     "InvalidRequestError", "top_p"),
    ("completion-logprobs-21", "POST", "/v1/completions", {**OK, "logprobs": 21}, 400,
     "InvalidRequestError", "logprobs"),
    ("completion-n-zero", "POST", "/v1/completions", {**OK, "n": 0}, 400,
     "InvalidRequestError", "'n'"),
    ("completion-n-65", "POST", "/v1/completions", {**OK, "n": 65}, 400,
     "InvalidRequestError", "'n'"),
    ("completion-stop-empty", "POST", "/v1/completions", {**OK, "stop": [""]}, 400,
     "InvalidRequestError", "stop"),
    ("completion-stop-200000-strings", "POST", "/v1/completions",
     {**OK, "stop": ["x"] * 200_000}, 400, "InvalidRequestError",
     "stop holds 200000 strings; at most 64 are accepted"),
    ("completion-stop-token-ids-1000000", "POST", "/v1/completions",
     {**OK, "stop_token_ids": [7] * 1_000_000}, 400, "InvalidRequestError",
     "stop_token_ids holds 1000000 ids; at most 128 are accepted"),
    ("chat-stop-string-513-chars", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "stop": "x" * 513}, 400,
     "InvalidRequestError", "stop holds a string of 513 characters; each may have at most 512"),
    ("completion-stop-token-negative", "POST", "/v1/completions", {**OK, "stop_token_ids": [-1]},
     400, "InvalidRequestError", "stop_token_ids"),
    ("completion-stop-token-bool", "POST", "/v1/completions", {**OK, "stop_token_ids": [True]},
     400, "InvalidRequestError", "stop_token_ids"),
    ("completion-prompt-empty", "POST", "/v1/completions", {**OK, "prompt": []}, 400,
     "InvalidRequestError", "prompt"),
    ("completion-prompt-empty-text", "POST", "/v1/completions", {**OK, "prompt": ""}, 400,
     "InvalidRequestError", "prompt is empty"),
    ("completion-prompt-empty-text-in-list", "POST", "/v1/completions",
     {**OK, "prompt": ["hi", ""]}, 400, "InvalidRequestError", "prompt is empty"),
    ("completion-prompt-bool-ids", "POST", "/v1/completions", {**OK, "prompt": [True, 1]}, 400,
     "InvalidRequestError", "prompt"),
    ("completion-prompt-too-long", "POST", "/v1/completions", {**OK, "prompt": "x" * 600}, 400,
     "InvalidRequestError", "max_model_len"),
    ("completion-max-tokens-text", "POST", "/v1/completions", {**OK, "max_tokens": "many"}, 400,
     "InvalidRequestError", "max_tokens"),
    ("completion-body-a-list", "POST", "/v1/completions", [OK], 400,
     "InvalidRequestError", "body"),
    ("completion-body-truncated", "POST", "/v1/completions", b'{"prompt": "hi"', 400,
     "InvalidRequestError", "not valid JSON"),
    ("completion-prompt-lone-surrogate", "POST", "/v1/completions", {**OK, "prompt": "a\ud800"},
     400, "InvalidRequestError", "prompt is not valid Unicode text"),
    ("chat-content-lone-surrogate", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "\udfff"}]}, 400, "InvalidRequestError",
     "prompt is not valid Unicode text"),
    ("chat-max-tokens-zero", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400,
     "InvalidRequestError", "max_tokens"),
    ("chat-content-part-type", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image", "text": "x"}]}]}, 400,
     "InvalidRequestError", "type"),
    ("chat-top-logprobs-30", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 30}, 400,
     "InvalidRequestError", "top_logprobs"),
    # The RL routes: bad values, and calls the engine's state refuses.
    ("pause-clear-cache-not-bool", "POST", "/pause?mode=keep&clear_cache=2", None, 400,
     "InvalidRequestError", "clear_cache"),
    ("arm-pause-negative", "POST", "/arm_pause?after_tokens=-1", None, 400,
     "InvalidRequestError", "after_tokens"),
    ("arm-pause-mode", "POST", "/arm_pause?after_tokens=3&mode=later", None, 400,
     "InvalidRequestError", "'mode' must be one of"),
    ("arm-pause-missing", "POST", "/arm_pause", None, 400,
     "InvalidRequestError", "after_tokens"),
    ("abort-requests-ids-not-strings", "POST", "/abort_requests", {"request_ids": [1, 2]}, 400,
     "InvalidRequestError", "request_ids"),
    ("world-size-include-dp", "GET", "/get_world_size?include_dp=maybe", None, 400,
     "InvalidRequestError", "include_dp"),
    ("update-while-streaming", "POST", "/update_weights",
     {"update_info": {"names": ["model.norm.weight"], "dtype_names": ["float32"],
                      "shapes": [[64]]}}, 409, "EngineBusyError", "needs a paused or idle engine"),
    ("start-update-while-streaming", "POST", "/start_weight_update", None, 409,
     "EngineBusyError", "needs a paused or idle engine"),
    ("update-info-not-object", "POST", "/update_weights", {"update_info": "names"}, 400,
     "InvalidRequestError", "update_info"),
    ("abort-update-none-open", "POST", "/finish_weight_update", {"weight_version": "v9"}, 409,
     "WeightUpdateStateError", "no weight update is in progress"),
    ("finish-version-bool", "POST", "/finish_weight_update", {"weight_version": True}, 400,
     "InvalidRequestError", "weight_version"),
    ("finish-version-float", "POST", "/finish_weight_update", {"weight_version": 1.5}, 400,
     "InvalidRequestError", "weight_version"),
    ("relabel-version-bool", "POST", "/update_weight_version", {"new_version": True}, 400,
     "InvalidRequestError", "new_version"),
    ("relabel-version-too-long", "POST", "/update_weight_version", {"new_version": "v" * 257},
     400, "InvalidRequestError", "at most 256 characters"),
    ("finish-version-too-long", "POST", "/finish_weight_update", {"weight_version": "v" * 257},
     400, "InvalidRequestError", "at most 256 characters"),
    ("relabel-version-null", "POST", "/update_weight_version", {"new_version": None}, 400,
     "InvalidRequestError", "new_version"),
    # Every token carries the label: a 4000-digit int used to be taken, bloating every answer.
    ("relabel-version-huge-int", "POST", "/update_weight_version",
     b'{"new_version": ' + b"9" * 4000 + b"}", 400, "InvalidRequestError", "new_version"),
    ("finish-version-huge-int", "POST", "/finish_weight_update",
     b'{"weight_version": ' + b"9" * 4000 + b"}", 400, "InvalidRequestError", "weight_version"),
    ("start-not-checkpoint-format", "POST", "/start_weight_update",
     {"is_checkpoint_format": False}, 400, "InvalidRequestError", "is_checkpoint_format"),
    ("init-info-port-text", "POST", "/init_weight_transfer_engine",
     {"init_info": {**GLOO, "master_port": "eighty"}}, 400, "WeightValidationError", "master_port"),
    ("init-info-world-size-zero", "POST", "/init_weight_transfer_engine",
     {"init_info": {**GLOO, "world_size": 0}}, 400, "WeightValidationError", "world_size"),
    ("init-info-missing-fields", "POST", "/init_weight_transfer_engine",
     {"init_info": {"backend": "gloo"}}, 400, "WeightValidationError", "master_address"),
    ("init-info-ipc-bad", "POST", "/init_weight_transfer_engine",
     {"init_info": {"backend": "ipc", "packed": "yes"}}, 400, "WeightValidationError", "packed"),
    ("checker-baseline-not-strings", "POST", "/weight_checker",
     {"action": "compare", "baseline": {"w": 1}}, 400, "InvalidRequestError", "baseline"),
    ("health-wrong-method", "POST", "/health", None, 405, "MethodNotAllowed", "Method Not Allowed"),
    ("completions-wrong-method", "GET", "/v1/completions", None, 405, "MethodNotAllowed",
     "Method Not Allowed"),
]  # fmt: skip


@pytest.fixture(scope="module")
def server():
    server = Server("debug", "--port", "0", "--num-kv-blocks", "256", "--max-model-len", "512")
    yield server
    server.stop()
    server.kill()


@pytest.fixture(scope="module")
def baseline(server):
    """The stream's tokens on an otherwise idle server, the checksums and the version."""
    url = server.base_url
    full = httpx.post(url + "/v1/completions", json={**STREAM, "stream": False}, timeout=120)
    tokens = {choice["index"]: choice["token_ids"] for choice in full.json()["choices"]}
    checksums = httpx.post(url + "/weight_checker", json={"action": "checksum"}, timeout=60)
    version = httpx.get(url + "/weight_info", timeout=60).json()["weight_version"]
    return tokens, checksums.json()["checksums"], version


def _send(url: str, method: str, path: str, body: Any) -> httpx.Response:
    if body is None:
        return httpx.request(method, url + path, timeout=60)
    # Encoded here with ASCII escapes, so that a lone surrogate travels as JSON sends it.
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    return httpx.request(method, url + path, content=content, headers=headers, timeout=60)


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "error_type", "message"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_bad_http_input_is_refused_and_changes_nothing(
    server, baseline, method, path, body, status, error_type, message, record_property
):
    """A bad request over HTTP: its status, error type and message; a stream in flight is untouched."""
    url = server.base_url
    expected_tokens, checksums, version = baseline
    request_id = f"in-flight-{abs(hash((method, path, json.dumps(body, default=str))))}"
    with httpx.stream(
        "POST", url + "/v1/completions", json={**STREAM, "request_id": request_id}, timeout=60
    ) as stream:
        lines = (line for line in stream.iter_lines() if line)
        assert next(lines) == ": accepted"
        first = json.loads(next(lines).removeprefix("data: "))
        answer = _send(url, method, path, body)
        aborted = httpx.post(url + "/abort_requests", json={"request_ids": [request_id]})
        rest = [json.loads(line.removeprefix("data: ")) for line in lines if line != "data: [DONE]"]
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert error["type"] == error_type, error
    assert message in error["message"], error
    record_property("status", status)
    record_property("message", error["message"][:160])
    # Still running once the case was answered, and every token it gave is the undisturbed one.
    assert aborted.json()["aborted"] == 1
    received: dict[int, list[int]] = {index: [] for index in expected_tokens}
    finish = {}
    for chunk in [first, *rest]:
        for choice in chunk.get("choices", []):
            received[choice["index"]] += choice["token_ids"]
            finish[choice["index"]] = choice["finish_reason"]
    assert set(finish.values()) == {"abort"}
    for index, tokens in received.items():
        assert tokens == expected_tokens[index][: len(tokens)], index
    after = httpx.post(url + "/weight_checker", json={"action": "checksum"}, timeout=60)
    assert after.json()["checksums"] == checksums
    assert httpx.get(url + "/weight_info").json()["weight_version"] == version


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--port", "70000"], "expected a port in [0, 65535]"),
        (["--seed", str(2**70)], "expected a seed in [-2**63, 2**64)"),
    ],
    ids=["port-too-large", "seed-too-large"],
)
def test_the_real_command_exits_with_one_line_and_no_traceback(flags, message, record_property):
    """A bad flag through the real `weightsync serve` process: exit 2, one error line."""
    done = run_cli("serve", "debug", *flags)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    error_lines = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(error_lines) == 1, done.stderr
    assert error_lines[0].startswith(f"weightsync serve: error: argument {flags[0]}: {message}")
    record_property("exit_status", 2)


GROUP_TIMEOUT_S = 60.0  # the group's limit: a refusal that waited it out fails the case
AT_ONCE_S = 10.0  # what an answer "at once" may take on a loaded machine
NORM = {"names": ["model.norm.weight"], "dtype_names": ["float32"], "shapes": [[64]]}
MALFORMED = [
    ("unknown-name", {**NORM, "names": ["model.nope"]}, "unknown name 'model.nope'"),
    ("shape-off-by-one", {**NORM, "shapes": [[65]]}, "model has float32[64], update has float32[65]"),
    ("float128", {**NORM, "dtype_names": ["float128"]}, "unknown dtype name 'float128'"),
    ("negative-shape", {**NORM, "shapes": [[-64]]}, "must be a list of non-negative ints"),
    ("huge-shape", {**NORM, "shapes": [[2**62, 2**62]]}, "update has float32[4611686018427387904"),
]  # fmt: skip


@pytest.fixture(scope="module")
def gloo_server():
    """A server in a trainer's gloo group, and the trainer's end of it (sending nothing)."""
    server = Server("debug", "--port", "0", "--weight-transfer-config.backend", "gloo")
    group = trainer_init(world_size=2, backend="gloo", timeout_s=GROUP_TIMEOUT_S)
    init = {"init_info": group.init_info}
    joining = threading.Thread(
        target=httpx.post,
        args=(server.base_url + "/init_weight_transfer_engine",),
        kwargs={"json": init, "timeout": GROUP_TIMEOUT_S},
    )
    joining.start()
    group.connect()
    joining.join(GROUP_TIMEOUT_S)
    yield server, group
    group.close()
    server.stop()
    server.kill()


@pytest.mark.parametrize(
    ("update_info", "message"),
    [case[1:] for case in MALFORMED],
    ids=[case[0] for case in MALFORMED],
)
def test_a_malformed_update_with_no_trainer_broadcasting_is_refused_at_once(
    gloo_server, update_info, message, request, record_property
):
    """A malformed update while no trainer broadcasts: a 400 at once, generation and group go on."""
    server, group = gloo_server
    with httpx.Client(base_url=server.base_url, timeout=AT_ONCE_S) as client:
        start = time.monotonic()
        answer = client.post("/update_weights", json={"update_info": update_info})
        elapsed = time.monotonic() - start
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["type"] == "WeightValidationError" and message in error["message"], error
        # Generation is not held: a completion is served at once, on the weights of before.
        version = client.get("/weight_info").json()["weight_version"]
        served = client.post("/v1/completions", json={**OK, "max_tokens": 2})
        assert served.json()["choices"][0]["weight_versions"] == [version] * 2
        # The group is usable, and the stale refusal is not taken for the trainer's next
        # update, even when that update is on the line before its own message gets here.
        label = f"after-{request.node.callspec.id}"
        pairs = list(LlamaForCausalLM.from_preset("debug", seed=len(label)).named_weights())
        info = WeightTransferUpdateInfo.from_named_tensors(pairs, weight_version=label).to_dict()
        announced = (group._group.lookup(LATEST) or 0) + 1
        sent: dict[str, Any] = {}
        sending = threading.Thread(
            target=lambda: sent.update(
                stats=trainer_send_weights(pairs, NCCLTrainerSendWeightsArgs(group, info))
            )
        )
        sending.start()
        while group._group.lookup(LATEST) != announced and sending.is_alive():
            time.sleep(0.01)  # the trainer's announcement is local: it comes in milliseconds
        landed = client.post("/update_weights", json={"update_info": info})
        sending.join(AT_ONCE_S)
        assert landed.status_code == 200, landed.text
        assert "stats" in sent and client.get("/weight_info").json()["weight_version"] == label
    record_property("status", answer.status_code)
    record_property("message", error["message"][:160])
    record_property("seconds_to_error", round(elapsed, 2))


def test_a_refused_copy_of_the_trainers_next_message_does_not_refuse_that_update(
    gloo_server, record_property
):
    """A copy of the trainer's next update info with one shape changed (its send_id kept) is
    refused at once while no trainer broadcasts; the trainer's update of that send, on the line
    before its own message gets here, then lands in the same group."""
    server, group = gloo_server
    pairs = list(LlamaForCausalLM.from_preset("debug", seed=21).named_weights())
    label = "after-a-mangled-copy"
    info = WeightTransferUpdateInfo.from_named_tensors(pairs, weight_version=label).to_dict()
    shapes = [list(shape) for shape in info["shapes"]]
    shapes[0][0] += 1
    mangled = {**info, "shapes": shapes}
    with httpx.Client(base_url=server.base_url, timeout=AT_ONCE_S) as client:
        checksum = {"action": "checksum"}
        before = client.post("/weight_checker", json=checksum).json()["checksums"]
        refused = client.post("/update_weights", json={"update_info": mangled})
        assert refused.status_code == 400, refused.text
        assert "do not match the model" in refused.json()["error"]["message"]
        announced = (group._group.lookup(LATEST) or 0) + 1
        sent: dict[str, Any] = {}

        def send() -> None:
            try:
                sent["stats"] = trainer_send_weights(pairs, NCCLTrainerSendWeightsArgs(group, info))
            except WeightSyncError as exc:
                sent["error"] = f"{type(exc).__name__}: {exc}"

        sending = threading.Thread(target=send)
        sending.start()
        while group._group.lookup(LATEST) != announced and sending.is_alive():
            time.sleep(0.01)  # the trainer's announcement is local: it comes in milliseconds
        landed = client.post("/update_weights", json={"update_info": info})
        sending.join(AT_ONCE_S)
        assert landed.status_code == 200, landed.text
        assert "stats" in sent, sent
        assert client.get("/weight_info").json()["weight_version"] == label
        after = client.post("/weight_checker", json=checksum).json()["checksums"]
        assert after != before
    record_property("status", refused.status_code)
    record_property("message", "refused copy: 400; the update of its send: 200, weights changed")


def test_connections_that_never_finish_their_headers_are_closed_in_time(server, record_property):
    """Clients open connections and never finish their headers: each closed within the bound."""
    host, port = server.base_url.removeprefix("http://").rsplit(":", 1)
    conns = [socket.create_connection((host, int(port))) for _ in range(3)]
    start = time.monotonic()
    try:
        conns[1].sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and nothing more
        conns[2].sendall(b"GET /health HTTP/1.1\r\nHost: x")
        for conn in conns:  # each read ends when the server closes the connection
            conn.settimeout(HEADER_TIMEOUT_S + AT_ONCE_S)
            assert conn.recv(4096) == b""
        waited = time.monotonic() - start
    finally:
        for conn in conns:
            conn.close()
    assert waited < HEADER_TIMEOUT_S + AT_ONCE_S
    assert httpx.get(server.base_url + "/health").status_code == 200  # others still served
    record_property("seconds_to_error", round(waited, 2))
