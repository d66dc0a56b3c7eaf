"""`weightsync serve --data-parallel-size 2`: spread, a keep pause on every replica, gloo updates.

One server (a front and two replica processes) for the module; the last test stops it.
"""

import json
import signal
import threading

import httpx
import pytest
from replica_support import (
    WAIT_S,
    broadcast_update,
    connect_gloo,
    get,
    is_gone,
    one_per_replica,
    per_replica,
    post,
    replica_pids,
    stream_lines,
    wait_for,
)
from serve_support import Server, run_cli

from weightsync import EngineConfig, LlamaForCausalLM, LLMEngine, SamplingParams, weight_checksums

N = 2
MAX_TOKENS = 240
GREEDY = {"prompt": "hello", "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def server():
    server = Server("debug", "--port", "0", "--data-parallel-size", str(N),
                    "--weight-transfer-config.backend", "gloo")  # fmt: skip
    yield server
    server.kill()


@pytest.fixture(scope="module")
def group(server):
    group = connect_gloo(server.base_url)
    yield group
    group.close()


def greedy_reference(seed: int) -> str:
    engine = LLMEngine(LlamaForCausalLM.from_preset("debug", seed=seed),
                       engine_config=EngineConfig(num_kv_blocks=64))  # fmt: skip
    return (
        engine.generate(["hello"], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text
    )


def test_world_size_counts_replicas_and_health_lists_them(server):
    assert get(server.base_url, "/get_world_size") == {"world_size": N}
    assert get(server.base_url, "/get_world_size", params={"include_dp": "false"}) == {
        "world_size": 1
    }
    health = get(server.base_url, "/health")
    assert health["status"] == "ok"
    assert [r["alive"] for r in health["replicas"]] == [True] * N


def test_requests_spread_and_a_keep_pause_freezes_every_replica_mid_request(server):
    body = {"max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 1.0}
    events = [[] for _ in range(2 * N)]
    done = [threading.Event() for _ in range(2 * N)]
    post(server.base_url, "/pause", params={"mode": "keep"})  # queued while paused: all at once
    for i in range(2 * N):
        threading.Thread(
            target=stream_lines,
            args=(server.base_url, {**body, "prompt": f"p{i}", "seed": i}, events[i], done[i]),
        ).start()
    wait_for(lambda: sum(per_replica(server.base_url, "num_unfinished")) == 2 * N)
    assert per_replica(server.base_url, "num_unfinished") == [2] * N  # least loaded: 2 each
    post(server.base_url, "/resume")
    wait_for(lambda: all(len(e) >= 3 for e in events))  # every request is generating
    post(server.base_url, "/pause", params={"mode": "keep"})
    stats = get(server.base_url, "/engine_stats")
    assert stats["is_paused"]
    for replica in stats["replicas"]:
        assert replica["num_unfinished"] == 2  # frozen, not finished
        pause = replica["last_pause"]
        assert pause["landed_at_step"] - pause["requested_at_step"] <= 1
    steps = per_replica(server.base_url, "num_steps")
    assert per_replica(server.base_url, "num_steps") == steps  # nothing steps while paused
    post(server.base_url, "/resume")
    for event in done:
        assert event.wait(WAIT_S)
    for stream in events:
        assert stream[-1] == {"done": True}
        tokens = [t for chunk in stream[:-1] for c in chunk["choices"] for t in c["token_ids"]]
        assert len(tokens) == MAX_TOKENS
        assert stream[-2]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_vllm_fields_and_ignored_fields_pass_through_the_front(server, chat):
    route = "/v1/chat/completions" if chat else "/v1/completions"
    ask = {"messages": [{"role": "user", "content": "hello"}]} if chat else {"prompt": "hello"}
    logprobs = {"logprobs": True, "top_logprobs": 1} if chat else {"logprobs": 1}
    body = {**ask, **logprobs, "max_tokens": 4, "temperature": 0, "return_tokens_as_token_ids": True,
            "truncate_prompt_tokens": 3, "cache_salt": "v1", "frobnicate": 1}  # fmt: skip
    whole = httpx.post(server.base_url + route, json={**body, "prompt_logprobs": 1}, timeout=WAIT_S)
    assert whole.status_code == 200, whole.text
    assert whole.headers["X-Ignored-Fields"] == "frobnicate"
    answer, choice = whole.json(), whole.json()["choices"][0]
    scored = answer["prompt_logprobs"] if chat else choice["prompt_logprobs"]
    assert len(choice["prompt_token_ids"]) == len(scored) == 3 and scored[0] is None
    named = choice["logprobs"]
    tokens = [e["token"] for e in named["content"]] if chat else named["tokens"]
    assert tokens == [f"token_id:{t}" for t in choice["token_ids"]]
    with httpx.stream("POST", server.base_url + route, json={**body, "stream": True},
                      timeout=WAIT_S) as response:  # fmt: skip
        assert response.headers["X-Ignored-Fields"] == "frobnicate"
        chunks = [
            json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")
        ]
    streamed = [t for chunk in chunks for c in chunk["choices"] for t in c["token_ids"]]
    assert streamed == choice["token_ids"]
    refused = httpx.post(server.base_url + route, json={**body, "priority": 5}, timeout=WAIT_S)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "priority"


def test_a_gloo_update_lands_on_every_replica(server, group):
    before = one_per_replica(server.base_url, N, GREEDY)
    policy = LlamaForCausalLM.from_preset("debug", seed=7)
    broadcast_update(server.base_url, group, policy, "step-1")
    assert get(server.base_url, "/weight_info") == {"weight_version": "step-1",
                                                     "replicas": ["step-1"] * N}  # fmt: skip
    checked = post(server.base_url, "/weight_checker",
                   json={"action": "compare", "baseline": weight_checksums(policy.named_weights())})  # fmt: skip
    assert checked["match"], checked
    assert [r["mismatches"] for r in checked["replicas"]] == [[]] * N
    after = one_per_replica(server.base_url, N, GREEDY)
    expected = greedy_reference(7)
    assert [a["choices"][0]["text"] for a in after] == [expected] * N
    assert before[0]["choices"][0]["text"] != expected
    assert {v for a in after for v in a["choices"][0]["weight_versions"]} == {"step-1"}


def test_five_updates_under_load_lose_or_repeat_no_token(server, group):
    num_streams, max_tokens, first = 6, 120, 10
    events = [[] for _ in range(num_streams)]
    done = [threading.Event() for _ in range(num_streams)]
    body = {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 1.0}
    for i in range(num_streams):
        threading.Thread(
            target=stream_lines,
            args=(server.base_url, {**body, "prompt": f"r{i}", "seed": i}, events[i], done[i]),
        ).start()
    for version in range(first, first + 5):
        seen = [len(e) for e in events]  # each stream moves on between updates
        wait_for(lambda s=seen: all(len(e) > n or d.is_set()
                                    for e, n, d in zip(events, s, done, strict=True)))  # fmt: skip
        broadcast_update(
            server.base_url, group, LlamaForCausalLM.from_preset("debug", seed=version), version
        )
    for event in done:
        assert event.wait(WAIT_S)
    for stream in events:
        assert stream[-1] == {"done": True}
        choices = [c for chunk in stream[:-1] for c in chunk["choices"]]
        tokens = [t for c in choices for t in c["token_ids"]]
        versions = [v for c in choices for v in c["weight_versions"]]
        assert len(tokens) == len(versions) == max_tokens
        assert versions == sorted(versions, key=lambda v: -1 if isinstance(v, str) else v)
        assert choices[-1]["finish_reason"] == "length"
    assert get(server.base_url, "/weight_info")["replicas"] == [first + 4] * N


def test_sigterm_stops_the_front_and_every_replica(server):
    pids = replica_pids(server.base_url)
    assert server.stop(signal.SIGTERM) in (0, -signal.SIGTERM)  # uvicorn re-raises it
    assert all(is_gone(pid) for pid in pids)
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{server.base_url}/health", timeout=5)


def test_a_replica_that_cannot_start_fails_the_server_with_its_reason(tmp_path):
    done = run_cli("serve", str(tmp_path / "missing"), "--data-parallel-size", "2", "--port", "0")
    assert done.returncode == 2
    assert "replica 0 did not start" in done.stderr
    assert "has no config.json" in done.stderr
