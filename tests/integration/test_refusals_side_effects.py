"""A refused control call over HTTP leaves the requests and the pause as they were.

Completions queue behind an open weight update; every control route that refuses in that state
(a sleep in each mode, a second start, init, the transfer engine's shutdown, resume, relabel,
reset) is called, on one server and on a data-parallel front. Each answers its refusal and
changes nothing: the requests are still queued, the pause and the update as before; once the
update finishes, the server resumes by itself (it was running) and every completion ends with all
its tokens, none with `finish_reason: "abort"`.
"""

from __future__ import annotations

import threading

import httpx
import pytest
from replica_support import WAIT_S, get, post, wait_for
from serve_support import Server

pytestmark = pytest.mark.reliability("fault")

COMPLETIONS = 4
BODY = {"prompt": "queued", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
# (method, path, params, body, status) of each call that is refused while an update is open
REFUSED_DURING_AN_UPDATE = [
    ("POST", "/sleep", {}, None, 409),
    ("POST", "/sleep", {"level": 0, "mode": "keep"}, None, 409),
    ("POST", "/sleep", {"level": 2, "mode": "wait"}, None, 409),
    ("POST", "/sleep", {"level": 7}, None, 400),
    ("POST", "/sleep", {"mode": "bogus"}, None, 400),
    ("POST", "/pause", {"mode": "bogus"}, None, 400),
    ("POST", "/wake_up", {"tags": "bogus"}, None, 400),
    ("POST", "/start_weight_update", {}, None, 409),
    ("POST", "/init_weight_transfer_engine", {}, {"init_info": {"master_port": 1}}, 409),
    ("POST", "/shutdown_weight_transfer_engine", {}, None, 409),
    ("POST", "/resume", {}, None, 409),
    ("POST", "/update_weight_version", {}, {"new_version": "v9"}, 409),
    ("POST", "/weight_checker", {}, {"action": "reset"}, 409),
]


@pytest.fixture(scope="module", params=[1, 2], ids=["one-server", "replica-front"])
def server(request):
    server = Server("debug", "--port", "0", "--data-parallel-size", str(request.param),
                    "--weight-transfer-config.backend", "gloo", "--num-kv-blocks", "64")  # fmt: skip
    yield server
    server.stop()
    server.kill()


def state(url: str) -> dict:
    """What a refusal must not change, from `/engine_stats`."""
    stats = get(url, "/engine_stats")
    return {key: stats[key] for key in ("num_unfinished", "is_paused", "weight_version")} | {
        "is_sleeping": get(url, "/is_sleeping")["is_sleeping"],
        "weight_update": stats.get("weight_update"),
    }


def test_refused_calls_during_an_update_abort_nothing_and_the_server_resumes(
    server, record_property
):
    """Completions queued behind an update; 13 refused calls (sleep in each mode...): no abort."""
    # A refused /sleep used to abort them (0 tokens) and leave the server paused after finish.
    url = server.base_url
    assert get(url, "/is_paused")["is_paused"] is False
    post(url, "/start_weight_update")  # a running, idle server pauses for the update
    answers: list[dict] = []

    def complete() -> None:
        answers.append(post(url, "/v1/completions", json=BODY))

    threads = [threading.Thread(target=complete) for _ in range(COMPLETIONS)]
    for thread in threads:
        thread.start()
    wait_for(lambda: get(url, "/engine_stats")["num_unfinished"] == COMPLETIONS)
    before = state(url)
    for method, path, params, body, status in REFUSED_DURING_AN_UPDATE:
        answer = httpx.request(method, f"{url}{path}", params=params, json=body, timeout=WAIT_S)
        assert answer.status_code == status, (path, params, answer.text)
        assert state(url) == before, (path, params)
    finished = post(url, "/finish_weight_update")
    assert finished["applied"] is True
    for thread in threads:
        thread.join(WAIT_S)
    assert len(answers) == COMPLETIONS
    for answer in answers:
        choice = answer["choices"][0]
        assert choice["finish_reason"] == "length", choice
        assert len(choice["token_ids"]) == BODY["max_tokens"]
    assert get(url, "/is_paused")["is_paused"] is False  # it was running before the update
    record_property(
        "message",
        f"{len(REFUSED_DURING_AN_UPDATE)} refused calls changed nothing; {COMPLETIONS} "
        f"completions ended with {BODY['max_tokens']} tokens each; running after the finish",
    )


def test_refused_calls_while_paused_keep_the_pause_and_the_frozen_requests(server):
    """Completions frozen by a keep pause; bad sleep, pause, wake-up and finish calls: kept."""
    url = server.base_url
    post(url, "/pause", params={"mode": "keep"})
    answers: list[dict] = []
    threads = [
        threading.Thread(target=lambda: answers.append(post(url, "/v1/completions", json=BODY)))
        for _ in range(COMPLETIONS)
    ]
    for thread in threads:
        thread.start()
    wait_for(lambda: get(url, "/engine_stats")["num_unfinished"] == COMPLETIONS)
    before = state(url)
    for method, path, params, body, status in [
        ("POST", "/sleep", {"level": 7}, None, 400),
        ("POST", "/sleep", {"mode": "bogus"}, None, 400),
        ("POST", "/pause", {"mode": "bogus"}, None, 400),
        ("POST", "/wake_up", {"tags": "bogus"}, None, 400),
        ("POST", "/finish_weight_update", {}, None, 409),
        ("POST", "/finish_weight_update", {}, {"weight_version": [1]}, 400),
        ("POST", "/reset_prefix_cache", {}, None, 200),
    ]:
        answer = httpx.request(method, f"{url}{path}", params=params, json=body, timeout=WAIT_S)
        assert answer.status_code == status, (path, params, answer.text)
        assert state(url) == before, (path, params)
    post(url, "/resume")
    for thread in threads:
        thread.join(WAIT_S)
    assert [a["choices"][0]["finish_reason"] for a in answers] == ["length"] * COMPLETIONS
