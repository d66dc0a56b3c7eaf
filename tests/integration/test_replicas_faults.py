"""`weightsync serve --data-parallel-size 3`: ipc updates, pause races, a stuck and a dead replica.

One server for the module; its tests run in order, the last ones stop a replica, kill another,
then kill the front.
"""

import os
import random
import signal
import threading

import httpx
import pytest
from replica_support import (
    WAIT_S,
    get,
    is_gone,
    one_per_replica,
    per_replica,
    post,
    replica_pids,
    stream_lines,
    wait_for,
)
from serve_support import Server

from weightsync import EngineConfig, LlamaForCausalLM, LLMEngine, SamplingParams, weight_checksums
from weightsync.trainer import HTTPEngineClient, IPCWeightSender, sync_weights
from weightsync.transfer.ipc import ipc_trainer_init

N = 3
GREEDY = {"prompt": "hello", "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def server():
    server = Server("debug", "--port", "0", "--data-parallel-size", str(N),
                    "--weight-transfer-config.backend", "ipc")  # fmt: skip
    yield server
    for pid in replica_pids_or_none(server):
        if not is_gone(pid):
            os.kill(pid, signal.SIGCONT)
    server.kill()


def replica_pids_or_none(server: Server) -> list[int]:
    try:
        return replica_pids(server.base_url)
    except httpx.HTTPError:
        return []


def test_an_ipc_update_lands_on_every_replica(server):
    policy = LlamaForCausalLM.from_preset("debug", seed=9)
    with (
        HTTPEngineClient(server.base_url, timeout_s=WAIT_S) as client,
        IPCWeightSender([client]) as sender,
    ):
        sync_weights(sender, policy.named_weights(), weight_version=1, mode="keep")
    baseline = weight_checksums(policy.named_weights())
    checked = post(
        server.base_url, "/weight_checker", json={"action": "compare", "baseline": baseline}
    )
    assert [r["mismatches"] for r in checked["replicas"]] == [[]] * N
    reference = LLMEngine(policy, engine_config=EngineConfig(num_kv_blocks=64))
    expected = reference.generate(["hello"], SamplingParams(temperature=0, max_tokens=8))
    answers = one_per_replica(server.base_url, N, GREEDY)
    assert [a["choices"][0]["text"] for a in answers] == [expected[0].outputs[0].text] * N


def test_pauses_racing_requests_and_resumes_in_random_order_never_deadlock(server):
    rng = random.Random(1234)
    answers: list[dict] = []
    threads: list[threading.Thread] = []

    def complete(seed: int) -> None:
        body = {"prompt": f"q{seed}", "max_tokens": 24, "ignore_eos": True, "seed": seed}
        answers.append(post(server.base_url, "/v1/completions", json=body))

    for step in range(40):
        action = rng.choice(["request", "request", "keep", "abort", "wait", "resume"])
        if action == "request":
            threads.append(threading.Thread(target=complete, args=(step,)))
            threads[-1].start()
        elif action == "resume":
            post(server.base_url, "/resume")
        else:  # every call is bounded: a deadlock fails here instead of hanging
            post(server.base_url, "/pause", params={"mode": action, "timeout_s": 60})
    post(server.base_url, "/resume")
    for thread in threads:
        thread.join(WAIT_S)
    assert len(answers) == len(threads)
    assert {a["choices"][0]["finish_reason"] for a in answers} <= {"length", "abort"}
    assert not get(server.base_url, "/is_paused")["is_paused"]


def test_a_stuck_replica_fails_the_pause_naming_it_while_the_others_stay_paused(server):
    stuck = replica_pids(server.base_url)[2]
    os.kill(stuck, signal.SIGSTOP)
    try:
        answer = httpx.post(f"{server.base_url}/pause", params={"mode": "keep", "timeout_s": 2},
                            timeout=WAIT_S)  # fmt: skip
    finally:
        os.kill(stuck, signal.SIGCONT)
    assert answer.status_code == 409, answer.text
    error = answer.json()["error"]
    assert error["type"] == "EngineTimeoutError"
    assert "replica 2" in error["message"]
    assert per_replica(server.base_url, "is_paused")[:2] == [True, True]
    post(server.base_url, "/resume")
    assert per_replica(server.base_url, "is_paused") == [False] * N


def test_a_killed_replica_ends_its_requests_with_an_error_and_refuses_rl_calls(server):
    events = [[] for _ in range(N)]
    done = [threading.Event() for _ in range(N)]
    body = {"max_tokens": 400, "ignore_eos": True, "temperature": 1.0}
    unstreamed: list[dict] = []
    post(server.base_url, "/pause", params={"mode": "keep"})  # queued while paused: placed
    threading.Thread(  # least loaded: this one on replica 0, the streams on 1, 2, then 0
        target=lambda: unstreamed.append(
            post(server.base_url, "/v1/completions", json={**body, "prompt": "u"})
        )
    ).start()
    wait_for(lambda: sum(per_replica(server.base_url, "num_unfinished")) == 1)
    for i in range(N):
        threading.Thread(
            target=stream_lines,
            args=(server.base_url, {**body, "prompt": f"k{i}", "seed": i}, events[i], done[i]),
        ).start()
        wait_for(lambda n=i + 2: sum(per_replica(server.base_url, "num_unfinished")) == n)
    assert per_replica(server.base_url, "num_unfinished") == [2, 1, 1]
    post(server.base_url, "/resume")
    wait_for(lambda: all(len(e) >= 2 for e in events))
    os.kill(replica_pids(server.base_url)[0], signal.SIGKILL)
    for event in done:
        assert event.wait(WAIT_S)
    finishes = [[c["finish_reason"] for c in e[-2]["choices"]] for e in events]
    assert finishes == [["length"], ["length"], ["error"]]
    assert all(e[-1] == {"done": True} for e in events)
    wait_for(lambda: len(unstreamed) == 1)
    assert unstreamed[0]["choices"][0]["finish_reason"] == "error"
    health = get(server.base_url, "/health")  # degraded, and it says why: it still serves
    assert health["status"] == "degraded"
    assert "replica 0" in health["message"] and "killed by signal 9" in health["message"]
    assert [r["alive"] for r in health["replicas"]] == [False, True, True]
    for path in ("/pause", "/start_weight_update", "/resume"):
        refused = httpx.post(f"{server.base_url}{path}", timeout=WAIT_S)
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["type"] == "ReplicaUnavailableError"
        assert "replica 0" in refused.json()["error"]["message"]
    served = post(server.base_url, "/v1/completions", json=GREEDY)  # the others keep serving
    assert served["choices"][0]["finish_reason"] == "length"


def test_a_replica_killed_mid_update_leaves_the_survivors_whole_and_serving():
    # It used to leave the survivor inside the update for good: every RL route, the abort
    # included, answered 503, and completions on the survivor never answered.
    server = Server("debug", "--port", "0", "--data-parallel-size", "2",
                    "--weight-transfer-config.backend", "ipc")  # fmt: skip
    session = ipc_trainer_init()
    try:
        url = server.base_url
        post(url, "/init_weight_transfer_engine", json={"init_info": session.init_info})
        answers: list[dict] = [{}, {}]

        def run(index: int) -> None:
            answers[index] = post(url, "/v1/completions", json={**GREEDY, "prompt": f"r{index}"})

        post(url, "/start_weight_update")  # every replica is inside the update: none generates
        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for started, thread in enumerate(threads, start=1):
            thread.start()  # one on each replica: they wait for the update to end
            wait_for(lambda n=started: sum(per_replica(url, "num_unfinished")) == n)
        doomed, survivor = replica_pids(url)
        os.kill(doomed, signal.SIGKILL)
        for thread in threads:
            thread.join(WAIT_S)
        finishes = sorted(a["choices"][0]["finish_reason"] for a in answers)
        assert finishes == ["error", "length"]  # the dead replica's ended, the survivor served
        served = next(a for a in answers if a["choices"][0]["finish_reason"] == "length")
        assert served["choices"][0]["weight_versions"] == [0] * GREEDY["max_tokens"]
        assert post(url, "/abort_weight_update")["message"] == "Weight update aborted"
        assert get(url, "/health")["status"] == "degraded"
        refused = httpx.post(f"{url}/finish_weight_update", timeout=WAIT_S)
        assert refused.status_code == 503 and "replica 0" in refused.json()["error"]["message"]
        again = post(url, "/v1/completions", json=GREEDY)
        assert again["choices"][0]["finish_reason"] == "length"
        assert not is_gone(survivor)
    finally:
        session.close()
        server.kill()


def test_a_killed_front_leaves_no_replica_behind(server):
    pids = [p for p in replica_pids_or_none(server) if not is_gone(p)]
    assert pids
    server.proc.kill()
    server.proc.wait(WAIT_S)
    wait_for(lambda: all(is_gone(pid) for pid in pids))
