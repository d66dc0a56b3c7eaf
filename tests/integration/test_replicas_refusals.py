"""A data-parallel front refuses what one engine refuses, and keeps what one engine keeps.

Each case is a sequence a single `weightsync serve` already survives (a retried part, an update
its sender gave up on, a late announcement, a refused finish, a busy engine under a broadcast,
bad input), run through `--data-parallel-size 2`: the front must end the same way, on every
replica, without tearing weights that one engine would have kept.
"""

import threading

import httpx
import pytest
import torch
from replica_support import WAIT_S, connect_gloo, get, per_replica, post, wait_for
from serve_support import Server

from weightsync import (
    LlamaForCausalLM,
    NCCLTrainerSendWeightsArgs,
    WeightTransferUpdateInfo,
    trainer_send_weights,
    weight_checksums,
)
from weightsync.errors import WeightSyncError
from weightsync.transfer.ipc import (
    IPCTrainerSendWeightsArgs,
    ipc_trainer_init,
    ipc_trainer_send_weights,
)

N = 2
BUCKET = 64 * 1024  # the debug model's weights then travel in ten or so parts


class Refused(Exception):
    """An `/update_weights` answer other than 200, as the trainer's delivery saw it."""


@pytest.fixture(scope="module")
def server():
    server = Server("debug", "--port", "0", "--data-parallel-size", str(N),
                    "--weight-transfer-config.backend", "ipc", "--num-kv-blocks", "64",
                    "--weight-update-staging", "--refuse-non-finite-weights")  # fmt: skip
    yield server
    server.kill()


@pytest.fixture(scope="module")
def session(server):
    session = ipc_trainer_init(bucket_size_bytes=BUCKET)
    post(server.base_url, "/init_weight_transfer_engine", json={"init_info": session.init_info})
    yield session
    session.close()


def deliver_to(url: str, sent: list[dict], *, on_delivered=None, stop_before: int | None = None):
    """A trainer's delivery callable: POSTs each message bare; `stop_before` gives up there."""

    def deliver(info: dict) -> None:
        if stop_before is not None and len(sent) == stop_before:
            raise Refused("the trainer gave up")
        answer = httpx.post(f"{url}/update_weights", json={"update_info": info}, timeout=WAIT_S)
        if answer.status_code != 200:
            raise Refused(answer.text)
        sent.append(info)
        if on_delivered is not None:
            on_delivered(info)

    return deliver


def send(url: str, session, policy, version, **kwargs) -> list[dict]:
    sent: list[dict] = []
    ipc_trainer_send_weights(
        policy.named_weights(),
        IPCTrainerSendWeightsArgs(session, deliver_to(url, sent, **kwargs), weight_version=version),
    )
    return sent


def versions(url: str) -> list:
    return get(url, "/weight_info")["replicas"]


def assert_every_replica_holds(url: str, policy) -> None:
    baseline = weight_checksums(policy.named_weights())
    checked = post(url, "/weight_checker", json={"action": "compare", "baseline": baseline})
    assert [r["mismatches"] for r in checked["replicas"]] == [[]] * N


def assert_landed_then_resume(url: str, policy, version) -> None:
    """Every replica took `policy`'s weights under `version`; generation resumes."""
    assert versions(url) == [version] * N
    assert_every_replica_holds(url, policy)
    post(url, "/resume")


def test_a_retried_part_of_a_bare_update_is_refused_and_the_update_lands(server, session):
    url = server.base_url
    post(url, "/pause", params={"mode": "keep"})
    refusals: list[httpx.Response] = []

    def retry_the_first_part(info: dict) -> None:
        if info["ipc_handles"] is not None and not refusals:
            refusals.append(httpx.post(f"{url}/update_weights", json={"update_info": info}))

    policy = LlamaForCausalLM.from_preset("debug", seed=11)
    sent = send(url, session, policy, "retried", on_delivered=retry_the_first_part)
    assert len(sent) > 3
    assert refusals[0].status_code == 400  # every replica refused it: nothing moved anywhere
    assert_landed_then_resume(url, policy, "retried")


def test_an_update_given_up_is_replaced_by_the_next_one_on_every_replica(server, session):
    url = server.base_url
    post(url, "/pause", params={"mode": "keep"})
    given_up = LlamaForCausalLM.from_preset("debug", seed=12)
    with pytest.raises(WeightSyncError, match="gave up"):
        send(url, session, given_up, "given-up", stop_before=3)
    policy = LlamaForCausalLM.from_preset("debug", seed=13)
    send(url, session, policy, "next")  # was: refused, and the first one aborted (torn)
    assert_landed_then_resume(url, policy, "next")


def test_a_late_announcement_leaves_the_bare_update_in_progress_going_on(server, session):
    url = server.base_url
    post(url, "/pause", params={"mode": "keep"})
    first = send(url, session, LlamaForCausalLM.from_preset("debug", seed=14), "first")
    late: list[httpx.Response] = []

    def announce_the_old_update_again(info: dict) -> None:
        if info["ipc_handles"] is not None and not late:
            late.append(httpx.post(f"{url}/update_weights", json={"update_info": first[0]}))

    policy = LlamaForCausalLM.from_preset("debug", seed=15)
    send(url, session, policy, "second", on_delivered=announce_the_old_update_again)
    assert late[0].status_code == 400
    assert_landed_then_resume(url, policy, "second")


def test_stray_announcements_leave_the_bare_update_in_progress_going_on(server, session):
    # Two strays arrive while a bare update runs: the announcement of an earlier explicit
    # update, and a fresh one naming a weight the model lacks. One engine refuses both and goes
    # on; the front used to take either for a new update and drop the one in progress (torn).
    url = server.base_url
    post(url, "/pause", params={"mode": "keep"})
    post(url, "/start_weight_update")
    earlier = send(url, session, LlamaForCausalLM.from_preset("debug", seed=18), None)
    post(url, "/finish_weight_update", json={"weight_version": "explicit"})
    fresh = {**earlier[0], "update_id": "fresh-stray", "names": ["no.such.weight"]}
    strays: list[httpx.Response] = []

    def announce_strays(info: dict) -> None:
        if info["ipc_handles"] is not None and not strays:
            for stray in (earlier[0], fresh):
                strays.append(httpx.post(f"{url}/update_weights", json={"update_info": stray}))

    policy = LlamaForCausalLM.from_preset("debug", seed=19)
    send(url, session, policy, "bare", on_delivered=announce_strays)
    assert [r.status_code for r in strays] == [400, 400]
    assert_landed_then_resume(url, policy, "bare")


def test_a_finish_refused_for_nans_ends_the_transaction_on_every_replica(server, session):
    url = server.base_url
    before = versions(url)
    kept = post(url, "/weight_checker", json={"action": "checksum"})["checksums"]
    poisoned = LlamaForCausalLM.from_preset("debug", seed=16)
    with torch.no_grad():
        poisoned.model.norm.weight[0] = float("nan")
    post(url, "/pause", params={"mode": "keep"})
    post(url, "/start_weight_update")
    send(url, session, poisoned, None)
    refused = httpx.post(f"{url}/finish_weight_update", json={"weight_version": "nan"})
    assert refused.status_code == 400
    assert refused.json()["error"]["type"] == "NonFiniteWeightsError"
    # As on one engine: the transaction is over (a new one starts) and staging restored.
    post(url, "/start_weight_update")
    assert post(url, "/abort_weight_update")["aborted"]
    assert versions(url) == before
    assert post(url, "/weight_checker", json={"action": "compare", "baseline": kept})["match"]
    post(url, "/resume")


def test_bad_input_is_a_400_naming_the_parameter_and_changes_nothing(server):
    url = server.base_url
    nested = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    for path in ("/v1/completions", "/update_weights"):  # was: 500 RecursionError on the front
        refused = httpx.post(f"{url}{path}", content=nested, timeout=WAIT_S,
                             headers={"content-type": "application/json"})  # fmt: skip
        assert refused.status_code == 400, refused.text
    # ["x"] was a 500 (unhashable type); "", 0 and [] the front replaced with an id of its own
    # and answered 200, where one engine refuses them.
    for request_id in (["x"], {"a": 1}, "", 0, []):
        body = {"prompt": "hi", "max_tokens": 2, "request_id": request_id}
        refused = httpx.post(f"{url}/v1/completions", json=body, timeout=WAIT_S)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "request_id"
    for timeout_s in ("nan", "-1", "0", "inf"):
        refused = httpx.post(f"{url}/pause", params={"timeout_s": timeout_s}, timeout=WAIT_S)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "timeout_s"
    assert get(url, "/is_paused")["replicas"] == [False] * N
    # A replica's own refusal keeps the parameter it named.
    conflict = {"mode": "keep", "wait_for_inflight_requests": "true"}
    refused = httpx.post(f"{url}/pause", params=conflict, timeout=WAIT_S)
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "wait_for_inflight_requests"


def test_a_busy_replica_refuses_a_bare_broadcast_at_once_and_the_group_stays_usable():
    server = Server("debug", "--port", "0", "--data-parallel-size", str(N),
                    "--weight-transfer-config.backend", "gloo")  # fmt: skip
    url = server.base_url
    group = connect_gloo(url)
    policy = LlamaForCausalLM.from_preset("debug", seed=17)
    pairs = list(policy.named_weights())
    info = WeightTransferUpdateInfo.from_named_tensors(pairs).to_dict()
    answers: list[httpx.Response] = []

    def update() -> None:
        answers.append(
            httpx.post(f"{url}/update_weights", json={"update_info": info}, timeout=WAIT_S)
        )

    try:
        # Requests long enough (seconds of steps) to keep the unpaused replicas busy.
        body = {"prompt": "busy", "max_tokens": 480, "ignore_eos": True}
        for _ in range(8):
            threading.Thread(target=httpx.post, args=(f"{url}/v1/completions",),
                             kwargs={"json": body, "timeout": WAIT_S}, daemon=True).start()  # fmt: skip
        wait_for(lambda: sum(per_replica(url, "num_unfinished")) == 8)
        receiving = threading.Thread(target=update)
        receiving.start()
        # Refused through the handshake at once: a refusal that only came with the group's
        # timeout would be a WeightTransferTimeout, without the engine's reason.
        with pytest.raises(WeightSyncError, match="paused or idle"):
            trainer_send_weights(pairs, NCCLTrainerSendWeightsArgs(group, info))
        receiving.join(WAIT_S)
        assert answers[0].status_code == 409, answers[0].text
        post(url, "/pause", params={"mode": "abort"})
        receiving = threading.Thread(target=update)
        receiving.start()
        trainer_send_weights(pairs, NCCLTrainerSendWeightsArgs(group, info))  # the same group
        receiving.join(WAIT_S)
        assert answers[1].status_code == 200, answers[1].text
        assert_every_replica_holds(url, policy)
    finally:
        group.close()
        server.kill()


def test_a_finish_refused_for_torn_weights_keeps_what_landed_as_one_engine_does():
    # Without staging: an aborted update leaves weights torn; an update covering part of them
    # is refused at finish (the rest is still torn) but, as on one engine, what it landed is no
    # longer torn, so an update covering the rest completes the repair. The front used to abort
    # the refused one everywhere, tearing its weights again.
    server = Server("debug", "--port", "0", "--data-parallel-size", str(N),
                    "--weight-transfer-config.backend", "ipc", "--num-kv-blocks", "64")  # fmt: skip
    url = server.base_url
    session = ipc_trainer_init(bucket_size_bytes=BUCKET)
    try:
        post(url, "/init_weight_transfer_engine", json={"init_info": session.init_info})
        policy = LlamaForCausalLM.from_preset("debug", seed=20)
        post(url, "/start_weight_update")
        with pytest.raises(WeightSyncError, match="gave up"):
            send(url, session, policy, None, stop_before=4)  # the announcement and 3 parts
        assert post(url, "/abort_weight_update")["aborted"]
        held = dict(policy.named_weights())
        torn = sorted(held)[:1], sorted(held)[1:]  # then covered in two updates
        for covered, expected in zip(torn, (409, 200), strict=True):
            post(url, "/start_weight_update")
            sent: list[dict] = []
            ipc_trainer_send_weights(
                [(name, held[name]) for name in covered],
                IPCTrainerSendWeightsArgs(session, deliver_to(url, sent)),
            )
            finish = httpx.post(f"{url}/finish_weight_update", json={"weight_version": "v"})
            assert finish.status_code == expected, finish.text
        assert versions(url) == ["v"] * N
        assert_every_replica_holds(url, policy)
    finally:
        session.close()
        server.kill()
