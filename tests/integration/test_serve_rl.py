"""vLLM's RL routes on a real `weightsync serve`: auth, malformed requests, start-up refusals,
client timeouts, and a clean shutdown with a stream open."""

import signal
import socket
import threading
import time

import httpx
import pytest
from serve_support import Server, run_cli

from weightsync import EngineTimeoutError, LlamaForCausalLM
from weightsync.trainer import BroadcastWeightSender, HTTPEngineClient, sync_weights

ADMIN_KEY = "admin-secret"
RL_ROUTES = [
    ("POST", "/pause"), ("POST", "/resume"), ("GET", "/is_paused"), ("POST", "/abort_requests"),
    ("POST", "/init_weight_transfer_engine"), ("POST", "/start_weight_update"),
    ("POST", "/update_weights"), ("POST", "/finish_weight_update"),
    ("POST", "/abort_weight_update"), ("POST", "/shutdown_weight_transfer_engine"),
    ("POST", "/update_weight_version"),
    ("GET", "/weight_info"), ("POST", "/weight_checker"), ("GET", "/get_world_size"),
    ("POST", "/arm_pause"), ("POST", "/unfinished_requests"), ("GET", "/engine_stats"),
]  # fmt: skip


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    server = Server("debug", "--port", "0", "--num-kv-blocks", "256", "--max-request-bytes", "4096")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def admin_server():
    server = Server("debug", "--port", "0", "--num-kv-blocks", "256",
                    env={"WEIGHTSYNC_ADMIN_API_KEY": ADMIN_KEY})  # fmt: skip
    yield server
    server.stop()


@pytest.mark.parametrize(("method", "path"), RL_ROUTES)
def test_every_rl_route_needs_the_admin_key(admin_server, method, path):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": ADMIN_KEY}):
        answer = httpx.request(method, admin_server.base_url + path, headers=headers, json={})
        assert answer.status_code == 401, (headers, answer.text)
        error = answer.json()["error"]
        assert error["param"] == "Authorization"
        assert "--admin-api-key" in error["message"]
    # /health and the /v1 routes (no --api-key) stay open.
    assert httpx.get(admin_server.base_url + "/health").status_code == 200


def test_the_admin_key_opens_every_rl_route(admin_server):
    engine = HTTPEngineClient(admin_server.base_url, admin_api_key=ADMIN_KEY, timeout_s=60)
    assert engine.get_world_size() == 1
    assert engine.abort_requests() == 0
    assert not engine.is_paused()
    policy = LlamaForCausalLM.from_preset("debug", seed=5)
    with BroadcastWeightSender([engine], backend="gloo", timeout_s=30) as sender:
        # pause, start, update, finish, resume: each through its route, with the key.
        sync_weights(sender, policy.named_weights(), weight_version="v1")
    assert engine.weight_version == "v1"
    assert engine.compare_weights(engine.weight_checksums()) == []
    engine.update_weight_version("v1-relabelled")
    assert engine.weight_version == "v1-relabelled"
    assert engine.abort_weight_update() is False
    engine.close()


@pytest.mark.reliability("bad-input")
def test_an_admin_key_outside_ascii_works_from_the_command_to_the_client():
    """`--admin-api-key` outside ASCII: the client's calls pass, a wrong key is still a 401."""
    key = "clé-🔑-ключ"
    server = Server("debug", "--port", "0", "--admin-api-key", key)
    engine = HTTPEngineClient(server.base_url, admin_api_key=key, timeout_s=60)
    try:
        assert not engine.is_paused() and engine.get_world_size() == 1
        wrong = httpx.get(server.base_url + "/is_paused",
                          headers={"Authorization": "Bearer clé".encode()})  # fmt: skip
        assert wrong.status_code == 401
    finally:
        engine.close()
        server.stop()


COMPLETION = {"prompt": "hi", "max_tokens": 2, "temperature": 0}
MALFORMED = [
    ("POST", "/pause?mode=sideways", None, 400, "'mode' must be one of"),
    ("POST", "/pause?mode=keep&wait_for_inflight_requests=true", None, 400, "conflict"),
    ("POST", "/pause?wait_for_inflight_requests=true&mode=abort", None, 400, "'mode=abort' and"),
    ("POST", "/pause?clear_cache=maybe", None, 400, "clear_cache"),
    ("POST", "/init_weight_transfer_engine", {}, 400, "'init_info' is required"),
    ("POST", "/init_weight_transfer_engine", b"{not json", 400, "not valid JSON"),
    ("POST", "/init_weight_transfer_engine", {"init_info": {"backend": "pigeon"}}, 400, "pigeon"),
    ("POST", "/update_weights", {"update_infos": {}}, 400, "'update_info' is required"),
    ("POST", "/update_weights", {"update_info": {"names": []}}, 409, "init_weight_transfer_engine"),
    ("POST", "/finish_weight_update", None, 409, "no weight update is in progress"),
    ("POST", "/finish_weight_update", {"weight_version": [1]}, 400, "weight_version"),
    ("POST", "/update_weight_version", {}, 400, "'new_version' is required"),
    ("POST", "/weight_checker", {"action": "explode"}, 400, "action"),
    ("POST", "/weight_checker", {"action": "compare"}, 400, "'baseline' is required"),
    ("POST", "/abort_requests", {"request_ids": "all"}, 400, "request_ids"),
    ("POST", "/v1/completions", {**COMPLETION, "max_tokens": 0}, 400, "max_tokens"),
    ("POST", "/v1/completions", {**COMPLETION, "prompt": [1, 99999]}, 400, "token ids"),
    ("POST", "/v1/completions", {**COMPLETION, "model": "gpt-4"}, 404, "not served here"),
    ("POST", "/v1/completions", {**COMPLETION, "max_tokens": 100000}, 400, "max_model_len"),
    ("POST", "/v1/completions", {**COMPLETION, "top_p": 0}, 400, "top_p"),
    ("POST", "/v1/completions", {**COMPLETION, "prompt": "x" * 5000}, 413, "--max-request-bytes"),
    ("POST", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "bot", "content": "x"}]}, 400, "role"),
    ("GET", "/no/such/route", None, 404, "Not Found"),
]  # fmt: skip


@pytest.mark.parametrize(("method", "path", "body", "status", "message"), MALFORMED)
def test_a_malformed_request_is_refused_and_the_server_keeps_serving(
    server, method, path, body, status, message
):
    if isinstance(body, bytes):
        kwargs = {"content": body, "headers": {"content-type": "application/json"}}
    else:
        kwargs = {} if body is None else {"json": body}
    answer = httpx.request(method, server.base_url + path, timeout=30, **kwargs)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert message in error["message"]
    assert error["type"]  # the weightsync error type (or the HTTP one, for a 404)
    after = httpx.post(server.base_url + "/v1/completions", json=COMPLETION, timeout=30)
    assert after.status_code == 200
    assert len(after.json()["choices"][0]["token_ids"]) == 2


def test_a_transfer_timeout_is_a_504(server):
    info = {"backend": "gloo", "master_address": "127.0.0.1", "master_port": closed_port(),
            "world_size": 2, "rank_offset": 1, "timeout_s": 1.0}  # fmt: skip
    answer = httpx.post(server.base_url + "/init_weight_transfer_engine",
                        json={"init_info": info}, timeout=60)  # fmt: skip
    assert answer.status_code == 504, answer.text
    assert answer.json()["error"]["type"] == "WeightTransferTimeout"


def test_a_client_timeout_does_not_desynchronize_later_calls(server):
    # The server waits 8 s for a trainer that never comes; the client gives up after 2 s (a
    # bound a loaded machine still answers the later calls within).
    client = HTTPEngineClient(server.base_url, timeout_s=2.0)
    info = {"backend": "gloo", "master_address": "127.0.0.1", "master_port": closed_port(),
            "world_size": 2, "rank_offset": 1, "timeout_s": 8.0}  # fmt: skip
    with pytest.raises(EngineTimeoutError, match="did not answer within"):
        client.init_weight_transfer_engine({"init_info": info})
    # Each later call reads its own answer, not the late one of the call that timed out.
    assert client.is_paused() is False
    assert client.get_world_size() == 1
    out = client.generate(["hi"], None)[0]
    assert out.finished
    client.close()


def test_a_client_that_leaves_a_stream_aborts_its_request(server):
    url = server.base_url

    def unfinished() -> list[str]:
        answer = httpx.post(url + "/unfinished_requests", json={"request_ids": ["leaver"]})
        return answer.json()["unfinished"]

    # The stream is frozen by a keep pause at its second token (armed while paused), so it
    # cannot end on its own: only an abort can end it while the server stays paused.
    httpx.post(url + "/pause?mode=keep")
    body = {"prompt": "a", "max_tokens": 480, "ignore_eos": True, "stream": True,
            "request_id": "leaver"}  # fmt: skip
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        lines = (line for line in r.iter_lines() if line)
        assert next(lines) == ": accepted"
        httpx.post(url + "/arm_pause", params={"after_tokens": 2})
        httpx.post(url + "/resume")
        assert "leaver" in next(lines)
        assert httpx.post(url + "/pause?mode=keep").json() == {"status": "paused"}
        assert unfinished() == ["leaver"]
    # The connection closed with the request frozen: the server notices and aborts it.
    deadline = time.monotonic() + 30
    while unfinished():
        assert time.monotonic() < deadline, "the request still runs after its client left"
        time.sleep(0.01)  # waiting for the abort to happen: the server offers no event for it
    httpx.post(url + "/resume")


def test_a_refused_arm_pause_leaves_the_armed_one_and_pause_still_lands_there(server):
    # A refused /arm_pause used to replace the event that /pause waits on, so that a /pause
    # after it waited for a pause that had already landed: forever.
    url = server.base_url
    httpx.post(url + "/pause?mode=keep")
    body = {"prompt": "a", "max_tokens": 40, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        lines = (line for line in r.iter_lines() if line)
        assert next(lines) == ": accepted"
        assert httpx.post(url + "/arm_pause", params={"after_tokens": 3}).status_code == 200
        refused = httpx.post(url + "/arm_pause", params={"after_tokens": -1})
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "after_tokens"
        httpx.post(url + "/resume")
        paused = httpx.post(url + "/pause?mode=keep", timeout=30)  # was: no answer, ever
        assert paused.json() == {"status": "paused"}
        last = httpx.get(url + "/engine_stats").json()["last_pause"]
        assert last["mode"] == "keep"
        httpx.post(url + "/resume")
        assert list(lines)[-1] == "data: [DONE]"


@pytest.fixture
def fresh_server():  # no transfer engine yet: a busy refusal has no trainer to tell
    server = Server("debug", "--port", "0")
    yield server
    server.stop()
    server.kill()


def test_a_busy_engine_refuses_an_update_and_abort_requests_ends_the_stream(fresh_server):
    server = fresh_server
    body = {"prompt": "a", "max_tokens": 480, "ignore_eos": True, "stream": True,
            "request_id": "rollout-7"}  # fmt: skip
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=60) as r:
        lines = (line for line in r.iter_lines() if line)
        assert next(lines) == ": accepted"
        assert "rollout-7" in next(lines)
        busy = httpx.post(server.base_url + "/update_weights", json={"update_info": {}})
        assert busy.status_code == 409
        assert busy.json()["error"]["type"] == "EngineBusyError"
        aborted = httpx.post(server.base_url + "/abort_requests",
                             json={"request_ids": ["rollout-7", "unknown"]})  # fmt: skip
        assert aborted.json() == {"status": "aborted", "aborted": 1}
        rest = list(lines)
    assert rest[-1] == "data: [DONE]"
    assert '"finish_reason": "abort"' in rest[-2]


def test_engine_stats_records_where_each_pause_fell_in_engine_steps(fresh_server):
    url = fresh_server.base_url
    assert httpx.get(url + "/engine_stats").json()["last_pause"] is None
    httpx.post(url + "/pause?mode=keep")  # idle: nothing in flight, so it lands where asked
    idle = httpx.get(url + "/engine_stats").json()["last_pause"]
    assert idle["mode"] == "keep" and idle["landed_at_step"] == idle["requested_at_step"]
    httpx.post(url + "/resume")
    body = {"prompt": "a", "max_tokens": 500, "ignore_eos": True, "stream": True, "n": 8}
    records = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        lines = (line for line in r.iter_lines() if line)
        assert next(lines) == ": accepted"
        for _ in range(5):
            next(lines)  # read on between pauses, so the server never waits for this reader
            assert httpx.post(url + "/pause?mode=keep").json() == {"status": "paused"}
            records.append(httpx.get(url + "/engine_stats").json()["last_pause"])
            httpx.post(url + "/resume")
        httpx.post(url + "/abort_requests", json={})
        assert list(lines)[-1] == "data: [DONE]"
    for record in records:
        assert record["mode"] == "keep"
        # At most the step in flight when the server handled the pause runs before it lands.
        assert 0 <= record["landed_at_step"] - record["requested_at_step"] <= 1
    steps = [record["requested_at_step"] for record in records]
    assert steps == sorted(steps) and steps[0] >= idle["landed_at_step"]
    httpx.post(url + "/pause?mode=abort")
    assert httpx.get(url + "/engine_stats").json()["last_pause"]["mode"] == "abort"


def test_start_up_refusals_are_one_line():
    refused = run_cli("serve", "debug", "--host", "0.0.0.0")
    assert refused.returncode == 2
    assert "--admin-api-key" in refused.stderr and "127.0.0.1" in refused.stderr
    assert "Traceback" not in refused.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = run_cli("serve", "debug", "--port", str(taken.getsockname()[1]))
    assert busy.returncode == 1
    assert busy.stderr.strip().count("\n") == 0, busy.stderr
    assert "in use" in busy.stderr
    bad = run_cli("serve", "debug", "--weight-transfer-config", "{backend: gloo}")
    assert bad.returncode == 2 and "JSON object" in bad.stderr


@pytest.mark.parametrize(("config", "sig"), [
    (["--weight-transfer-config", '{"backend": "gloo"}'], signal.SIGTERM),
    (["--weight-transfer-config.backend", "gloo"], signal.SIGINT),
])  # fmt: skip
def test_weight_transfer_config_json_and_dotted_and_a_clean_stop_on_a_signal(config, sig):
    server = Server("debug", "--port", "0", *config)
    try:
        check_config_then_stop(server, sig)
    finally:
        server.kill()


def check_config_then_stop(server, sig):
    url = server.base_url
    # The configured backend (gloo) reads the init info, whatever backend the info names.
    other = httpx.post(url + "/init_weight_transfer_engine",
                       json={"init_info": {"backend": "ipc"}}, timeout=30)  # fmt: skip
    assert other.status_code == 400
    assert "master_address" in other.json()["error"]["message"]
    # A stream frozen by a keep pause at its second token is open when the signal comes. The
    # pause is armed while paused, so the stream cannot run to its end first, however slow the
    # machine is.
    chunks: list[str] = []
    accepted = threading.Event()

    def stream():
        body = {"prompt": "hi", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line:
                    chunks.append(line)
                if line == ": accepted":
                    accepted.set()

    assert httpx.post(url + "/pause?mode=keep").json() == {"status": "paused"}
    reader = threading.Thread(target=stream)
    reader.start()
    assert accepted.wait(30)
    assert httpx.post(url + "/arm_pause", params={"after_tokens": 2}).json() == {"status": "armed"}
    httpx.post(url + "/resume")
    assert httpx.post(url + "/pause?mode=keep").json() == {"status": "paused"}  # at token 2
    assert server.stop(sig) in (0, -sig)
    reader.join(30)
    assert chunks[-1] == "data: [DONE]"
    assert '"finish_reason": "abort"' in chunks[-2]
    port = int(server.base_url.rsplit(":", 1)[1])
    with socket.socket() as again:  # the port was released
        again.bind(("127.0.0.1", port))
