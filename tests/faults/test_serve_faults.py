"""Faults through `weightsync serve`: a server or a trainer killed mid-update, a late message.

Each case drives a real server over HTTP and ends with the `no_leftovers` check: no process,
thread, port, fd or shared-memory segment of the case stays behind.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from leftovers import listening_ports, mapped_segment_bytes
from serve_support import SRC, Server

from weightsync import (
    LlamaForCausalLM,
    NCCLTrainerSendWeightsArgs,
    WeightSyncError,
    WeightTransferUpdateInfo,
    trainer_init,
    trainer_send_weights,
)
from weightsync.trainer import (
    BroadcastWeightSender,
    HTTPEngineClient,
    IPCWeightSender,
    sync_weights,
)
from weightsync.transfer.ipc import (
    IPCTrainerSendWeightsArgs,
    ipc_trainer_init,
    ipc_trainer_send_weights,
)

pytestmark = pytest.mark.reliability("fault")

TIMEOUT_S = 8.0
"""The transfer timeout of every case: each failure must be reported within it (plus slack)."""
SLACK_S = 10.0  # process start-up and a loaded machine
KILL_AT_TENSOR = 10  # of the debug model's 21: several buckets are on the wire by then
BUCKET_BYTES = 32 << 10
TRAINER = Path(__file__).with_name("serve_fault_trainer.py")


@pytest.fixture
def server(no_leftovers):  # after no_leftovers: stopped before it looks
    server = Server("debug", "--port", "0", "--weight-update-staging")
    yield server
    server.stop()
    server.kill()


@pytest.fixture
def control(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client


def state(control: httpx.Client) -> tuple[dict[str, str], Any]:
    """The server's weight checksums and version."""
    checksums = control.post("/weight_checker", json={"action": "checksum"}).json()["checksums"]
    return checksums, control.get("/weight_info").json()["weight_version"]


def in_thread(call: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """Runs `call()` in a thread; the dict gets its `result` or `error`."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = call()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def recorded_delivery(
    control: httpx.Client,
) -> tuple[list[dict[str, Any]], Callable[[dict[str, Any]], None]]:
    """A delivery that posts each update info to the server (each answered 200) and keeps it."""
    messages: list[dict[str, Any]] = []

    def deliver(update_info: dict[str, Any]) -> None:
        messages.append(update_info)
        answer = control.post("/update_weights", json={"update_info": update_info})
        assert answer.status_code == 200, answer.text

    return messages, deliver


def policy_pairs(seed: int) -> list[tuple[str, Any]]:
    return list(LlamaForCausalLM.from_preset("debug", seed=seed).named_weights())


def test_a_server_killed_mid_update_fails_the_trainer_within_its_timeout(
    server, control, record_property
):
    """A server SIGKILLed while buckets are on the wire: the trainer gets a weightsync error."""
    group = trainer_init(
        world_size=2, backend="gloo", timeout_s=TIMEOUT_S, bucket_size_bytes=BUCKET_BYTES
    )
    init = {"init_info": group.init_info}
    joining, _ = in_thread(lambda: control.post("/init_weight_transfer_engine", json=init))
    try:
        group.connect()
        joining.join(TIMEOUT_S)
        pairs = policy_pairs(seed=7)
        update_info = WeightTransferUpdateInfo.from_named_tensors(pairs).to_dict()
        assert control.post("/pause", params={"mode": "keep"}).status_code == 200
        assert control.post("/start_weight_update").status_code == 200
        # The server's side of the broadcast; its answer never comes: the server dies.
        with httpx.Client(base_url=server.base_url, timeout=60) as receiver:
            body = {"update_info": update_info}
            receiving, _ = in_thread(lambda: receiver.post("/update_weights", json=body))
            taken = 0

            def take(pair: tuple[str, Any]) -> Any:
                nonlocal taken
                if taken == KILL_AT_TENSOR:
                    server.proc.kill()
                    server.proc.wait(30)
                taken += 1
                return pair[1]

            start = time.monotonic()
            with pytest.raises(WeightSyncError) as caught:
                trainer_send_weights(pairs, NCCLTrainerSendWeightsArgs(group, update_info, take))
            elapsed = time.monotonic() - start
            receiving.join(TIMEOUT_S)
        assert taken > KILL_AT_TENSOR
        assert elapsed < TIMEOUT_S + SLACK_S, elapsed
    finally:
        group.close()
    record_property("error", type(caught.value).__name__)
    record_property("seconds_to_error", round(elapsed, 2))


def start_trainer() -> tuple[subprocess.Popen[str], dict[str, Any]]:
    """The trainer child, and its init info once it printed it."""
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    trainer = subprocess.Popen(
        [sys.executable, str(TRAINER), str(KILL_AT_TENSOR), str(TIMEOUT_S)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert trainer.stdout is not None
    return trainer, json.loads(trainer.stdout.readline())["init_info"]


def test_a_trainer_killed_mid_update_fails_the_servers_update_and_the_next_one_lands(
    server, control, record_property
):
    """A trainer SIGKILLed mid-broadcast: the server answers 502/504 in time, nothing changed."""
    before = state(control)
    trainer, init_info = start_trainer()
    try:
        joined = control.post("/init_weight_transfer_engine", json={"init_info": init_info})
        assert joined.status_code == 200, joined.text
        assert trainer.stdout is not None and trainer.stdin is not None
        update_info = json.loads(trainer.stdout.readline())["update_info"]
        assert control.post("/pause", params={"mode": "keep"}).status_code == 200
        assert control.post("/start_weight_update").status_code == 200
        body = {"update_info": update_info}
        receiving, box = in_thread(lambda: control.post("/update_weights", json=body))
        start = time.monotonic()
        trainer.stdin.write("go\n")
        trainer.stdin.flush()
        assert trainer.wait(TIMEOUT_S + SLACK_S) == -9  # it killed itself mid-transfer
        receiving.join(TIMEOUT_S + SLACK_S)
        elapsed = time.monotonic() - start
    finally:
        trainer.kill()
        trainer.wait(30)
        for pipe in (trainer.stdin, trainer.stdout):
            if pipe is not None:
                pipe.close()
    answer = box["result"]
    assert answer.status_code in (502, 504), answer.text
    error = answer.json()["error"]
    assert error["type"] in ("WeightTransferError", "WeightTransferTimeout"), error
    assert elapsed < TIMEOUT_S + SLACK_S, elapsed
    # The transaction is over, and staging restored the weights: checksums and version as before.
    assert control.post("/abort_weight_update").json()["aborted"] is False
    assert state(control) == before
    assert control.post("/resume").status_code == 200
    # The next full update over HTTP, from a new trainer, lands.
    engine = HTTPEngineClient(control.base_url.__str__().rstrip("/"), timeout_s=60)
    try:
        with BroadcastWeightSender([engine], backend="gloo", timeout_s=TIMEOUT_S) as sender:
            sync_weights(sender, policy_pairs(seed=8), weight_version="v-next")
        assert engine.weight_version == "v-next"
        assert engine.compare_weights(engine.weight_checksums()) == []
        assert state(control)[0] != before[0]
    finally:
        engine.close()
    record_property("status", answer.status_code)
    record_property("error", error["type"])
    record_property("seconds_to_error", round(elapsed, 2))


def test_a_late_message_of_a_finished_update_is_refused_and_changes_nothing(
    server, control, record_property
):
    """A part of an update that already landed, delivered again: refused, nothing changes."""
    session = ipc_trainer_init(packed=True, bucket_size_bytes=BUCKET_BYTES * 4, num_buffers=16)
    try:
        assert (
            control.post(
                "/init_weight_transfer_engine", json={"init_info": session.init_info}
            ).status_code
            == 200
        )
        messages, deliver = recorded_delivery(control)

        assert control.post("/pause", params={"mode": "keep"}).status_code == 200
        args = IPCTrainerSendWeightsArgs(session, deliver, weight_version="v1")
        ipc_trainer_send_weights(policy_pairs(seed=9), args)
        landed = state(control)
        assert landed[1] == "v1" and len(messages) > 2
        for late in (messages[1], messages[-1], messages[0]):  # parts, then the announcement
            answer = control.post("/update_weights", json={"update_info": late})
            assert answer.status_code == 400, answer.text
            assert answer.json()["error"]["type"] == "WeightValidationError"
            assert state(control) == landed
        assert control.post("/resume").status_code == 200
        out = control.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
        assert out.json()["choices"][0]["weight_versions"] == ["v1"] * 3
    finally:
        session.close()
    record_property("status", 400)
    record_property("message", answer.json()["error"]["message"][:160])


def test_a_finish_after_a_refused_update_ends_it_unapplied_and_the_version_stays(
    server, control, record_property
):
    """A finish whose transaction's only update was refused: unapplied, the version stays."""
    # It used to move the version to the new label, with no weight of the update landed; then
    # it was a 409 that only /abort_weight_update, which vLLM's clients never call, got past.
    session = ipc_trainer_init()
    try:
        control.post("/init_weight_transfer_engine", json={"init_info": session.init_info})
        before = state(control)
        assert control.post("/start_weight_update").status_code == 200
        bad = WeightTransferUpdateInfo(names=["no.such.weight"], dtype_names=["float32"],
                                       shapes=[[2]]).to_dict()  # fmt: skip
        refused = control.post("/update_weights", json={"update_info": bad})
        assert refused.status_code == 400, refused.text
        finish = control.post("/finish_weight_update", json={"weight_version": "v-never"})
        assert finish.status_code == 200, finish.text
        assert finish.json()["applied"] is False
        assert control.post("/abort_weight_update").json()["aborted"] is False  # it ended
        assert state(control) == before  # weights and version as before the update
        # Sent again and accepted, the update finishes: the refusal is behind it.
        assert control.post("/start_weight_update").status_code == 200
        sent: list[dict[str, Any]] = []

        def deliver(update_info: dict[str, Any]) -> None:
            sent.append(update_info)
            if len(sent) == 1:  # a refused message first; then the update, whole
                assert control.post("/update_weights", json={"update_info": bad}).status_code == 400
            answer = control.post("/update_weights", json={"update_info": update_info})
            assert answer.status_code == 200, answer.text

        ipc_trainer_send_weights(policy_pairs(seed=5), IPCTrainerSendWeightsArgs(session, deliver))
        assert (
            control.post("/finish_weight_update", json={"weight_version": "v2"}).status_code == 200
        )
        assert state(control)[1] == "v2"
        assert control.post("/resume").status_code == 200
    finally:
        session.close()
    record_property("status", finish.status_code)
    record_property("message", f"finish after the refusal: {finish.json()}")


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_client_that_leaves_a_non_streamed_completion_stops_its_compute(
    no_leftovers, replicas, record_property
):
    """A non-streamed completion (3 choices) whose client leaves: every choice is aborted."""
    # It used to run on to max_tokens (hundreds of steps after the client was gone).
    server = Server("debug", "--port", "0", "--data-parallel-size", str(replicas))
    try:
        body = json.dumps({"prompt": "go", "max_tokens": 400, "n": 3, "ignore_eos": True})
        host, port = server.base_url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=60) as client:
            client.sendall(
                f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: "
                f"application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode()
            )
            wait_until(lambda: stats(server)["num_unfinished"] == 3)
        # The client is gone. Its choices end long before 400 steps could have run.
        wait_until(lambda: stats(server)["num_unfinished"] == 0)
        steps = stats(server)["num_steps"]
        assert steps < 400, steps
        record_property("message", f"aborted after {steps} engine steps of 400")
    finally:
        server.stop()
        server.kill()


def stats(server: Server) -> dict[str, Any]:
    return httpx.get(f"{server.base_url}/engine_stats", timeout=60).json()


def wait_until(condition: Callable[[], bool], timeout_s: float = 60) -> None:
    """Polls a server-side count that has no event to await, until it holds."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the condition did not hold in time"
        time.sleep(0.02)


def test_a_segment_truncated_after_it_was_mapped_is_refused_and_the_server_lives(
    server, control, record_property
):
    """A mapped segment truncated by its owner, named again: refused with a 400, no SIGBUS."""
    session = ipc_trainer_init(packed=True, bucket_size_bytes=BUCKET_BYTES * 4, num_buffers=2)
    try:
        init = {"init_info": session.init_info}
        assert control.post("/init_weight_transfer_engine", json=init).status_code == 200
        messages, deliver = recorded_delivery(control)

        assert control.post("/pause", params={"mode": "keep"}).status_code == 200
        ipc_trainer_send_weights(policy_pairs(seed=9), IPCTrainerSendWeightsArgs(session, deliver))
        landed = state(control)
        # The server keeps the buffers mapped for the next update; their owner shrinks one,
        # and a later update's part names it again, past its new end.
        part = messages[1]
        name = part["ipc_handles"][-1]["segment"]
        assert part["ipc_handles"][-1]["offset"] >= 4096
        os.truncate(f"/dev/shm/{name}", 4096)
        later = [{**info, "update_id": "a-later-update"} for info in (messages[0], part)]
        assert control.post("/update_weights", json={"update_info": later[0]}).status_code == 200
        answer = control.post("/update_weights", json={"update_info": later[1]})
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["type"] == "WeightValidationError"
        assert f"reaches past the end of {name} (4096 bytes)" in error["message"]
        assert server.proc.poll() is None and control.get("/health").status_code == 200
        assert control.post("/abort_weight_update").json()["aborted"] is True
        assert state(control) == landed  # refused before any byte moved
    finally:
        session.close()
    record_property("status", answer.status_code)
    record_property("message", error["message"][:160])


RELEASE_S = 10.0  # what a server may take to notice by itself that its trainer is gone


def wait_for(condition: Callable[[], bool], what: str) -> None:
    """Polls what the kernel reports until `condition` holds; fails after `RELEASE_S`."""
    deadline = time.monotonic() + RELEASE_S
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {RELEASE_S} s"
        time.sleep(0.05)  # the server's watch looks every second: nothing to await from here


def test_a_closing_trainer_leaves_nothing_mapped_or_listening_in_the_server(
    server, control, record_property
):
    """A trainer's sender closes: the server unmaps its segments and frees its group's port."""
    pid, engine = server.proc.pid, HTTPEngineClient(server.base_url, timeout_s=60)
    ports = listening_ports(pid)
    try:
        with IPCWeightSender([engine], packed=True, bucket_size_bytes=BUCKET_BYTES) as ipc:
            sync_weights(ipc, policy_pairs(seed=11), weight_version="ipc")
            mapped = mapped_segment_bytes(pid)
        assert mapped > 0 and mapped_segment_bytes(pid) == 0  # unmapped before close returned
        with BroadcastWeightSender([engine], backend="gloo", timeout_s=TIMEOUT_S) as gloo:
            sync_weights(gloo, policy_pairs(seed=12), weight_version="gloo")
            group_ports = listening_ports(pid) - ports
        assert group_ports and listening_ports(pid) == ports  # freed before close returned
        assert engine.weight_version == "gloo"  # a later init of another backend worked
        out = control.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).json()
        assert out["choices"][0]["weight_versions"] == ["gloo"] * 2
    finally:
        engine.close()
    record_property("message", f"{mapped} bytes mapped, then 0; ports {sorted(group_ports)} freed")


def test_a_server_unmaps_by_itself_what_a_silent_ipc_trainer_left(server, control, record_property):
    """A trainer closes its IPC session telling no one: the server unmaps its segments anyway."""
    pid = server.proc.pid
    session = ipc_trainer_init(packed=True, bucket_size_bytes=BUCKET_BYTES)
    try:
        init = {"init_info": session.init_info}
        assert control.post("/init_weight_transfer_engine", json=init).status_code == 200
        deliver = lambda info: control.post("/update_weights", json={"update_info": info})  # noqa: E731
        ipc_trainer_send_weights(policy_pairs(seed=13), IPCTrainerSendWeightsArgs(session, deliver))
        mapped = mapped_segment_bytes(pid)
    finally:
        session.close()  # unlinks its segments; the server holds their last mappings
    assert mapped > 0
    wait_for(lambda: mapped_segment_bytes(pid) == 0, "the unlinked segments unmapped")
    out = control.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).json()
    assert len(out["choices"][0]["token_ids"]) == 2  # the landed weights serve on
    record_property("message", f"{mapped} bytes mapped, then 0")


def test_a_server_leaves_by_itself_the_group_of_a_silent_trainer(server, control, record_property):
    """A trainer closes its gloo group telling no one: the server frees the group's port anyway."""
    pid, url = server.proc.pid, server.base_url
    ports = listening_ports(pid)
    group = trainer_init(world_size=2, backend="gloo", timeout_s=TIMEOUT_S)
    try:
        init = {"init_info": group.init_info}
        joining, _ = in_thread(lambda: control.post("/init_weight_transfer_engine", json=init))
        group.connect()
        joining.join(TIMEOUT_S)
        pairs = policy_pairs(seed=14)
        info = WeightTransferUpdateInfo.from_named_tensors(pairs).to_dict()
        receiving, box = in_thread(lambda: httpx.post(
            f"{url}/update_weights", json={"update_info": info}, timeout=60))  # fmt: skip
        trainer_send_weights(pairs, NCCLTrainerSendWeightsArgs(group, info))
        receiving.join(TIMEOUT_S)
        assert box["result"].status_code == 200
        group_ports = listening_ports(pid) - ports
    finally:
        group.close()
    assert group_ports
    wait_for(lambda: listening_ports(pid) == ports, "the dead group's ports freed")
    # What the trainer does next still works: a new group, a new update.
    engine = HTTPEngineClient(url, timeout_s=60)
    try:
        with BroadcastWeightSender([engine], backend="gloo", timeout_s=TIMEOUT_S) as sender:
            sync_weights(sender, policy_pairs(seed=15), weight_version="again")
        assert engine.weight_version == "again"
    finally:
        engine.close()
    record_property("message", f"ports {sorted(group_ports)} freed")
