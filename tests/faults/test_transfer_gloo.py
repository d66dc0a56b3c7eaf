"""Faults of the gloo backend on real processes: each ends in a weightsync error within its
timeout, no receiver is left with torn weights it does not know about, nothing is left over, and
the next update lands whole."""

from __future__ import annotations

import os
import signal
import socket
import threading
from multiprocessing import resource_tracker

import pytest
import torch

from process_rigs import ReceiverProcess, TrainerProcess, WorkerProcessError, fill_tensors
from weightsync import weight_checksums
from weightsync.errors import WeightTransferError, WeightTransferTimeout
from weightsync.transfer import nccl
from weightsync.transfer.base import TensorSpec, WeightTransferUpdateInfo
from weightsync.transfer.nccl import GlooWeightTransferEngine, trainer_init

TIMEOUT_S = 3.0  # the transfer's limit in every case
REPLY_S = 30.0  # the rigs' limit for a reply: well above it, to see the transfer's own error
SPECS = [TensorSpec(f"layer.{i}.weight", torch.float32, (32, 32)) for i in range(6)]
INFO = WeightTransferUpdateInfo.from_specs(SPECS).to_dict()
WIRE = {"backend": "gloo", "timeout_s": TIMEOUT_S, "bucket_size_bytes": 4096}  # a bucket each
TRANSFER_ERRORS = {"WeightTransferError", "WeightTransferTimeout"}


def digests_of(seed):
    tensors = {s.name: torch.zeros(s.shape, dtype=s.dtype) for s in SPECS}
    fill_tensors(tensors, seed)
    return weight_checksums(tensors)


@pytest.fixture(scope="module")
def rig():
    """Two receivers and a healthy trainer, shared by the cases; doomed trainers are per case."""
    resource_tracker.ensure_running()  # started with the first process, kept for the session
    started = {
        "receivers": [
            ReceiverProcess(backend="gloo", update_info=INFO, worker_index=i, timeout_s=REPLY_S)
            for i in range(2)
        ],
        "trainer": TrainerProcess(update_info=INFO, timeout_s=REPLY_S),
    }
    yield started
    for proc in [*started["receivers"], started["trainer"]]:
        proc.close()


def join(trainer, receivers, world_size=3):
    """A new group: the trainer binds it, every receiver joins, the trainer connects."""
    info = trainer.call("init", world_size=world_size, **WIRE)["init_info"]
    for receiver in receivers:
        receiver.start("init", init_info=info)
    trainer.call("connect")
    for receiver in receivers:
        receiver.reply()


def assert_next_update_lands(rig, seed):
    trainer, receivers = rig["trainer"], rig["receivers"]
    join(trainer, receivers)
    for receiver in receivers:
        receiver.start("update", update_info=INFO)
    trainer.call("send", seed=seed)
    for receiver in receivers:
        receiver.reply()
        assert receiver.call("digests")["digests"] == digests_of(seed)
    for receiver in receivers:  # groups hold ports: gone before the case ends
        receiver.call("shutdown")
    trainer.call("close")


def receiver_failures(receivers):
    """Each receiver's reply to its pending update: it must be a weightsync transfer error."""
    replies = [receiver.reply(check=False) for receiver in receivers]
    for reply in replies:
        assert not reply["ok"] and reply["error_type"] in TRANSFER_ERRORS, reply
    return replies


def test_trainer_killed_before_a_transfer(rig, no_leftovers):
    receivers = rig["receivers"]
    before = [r.call("digests")["digests"] for r in receivers]
    doomed = TrainerProcess(update_info=INFO, timeout_s=REPLY_S)
    try:
        join(doomed, receivers)
        doomed.kill()
        for receiver in receivers:
            receiver.start("update", update_info=INFO)
        for reply in receiver_failures(receivers):
            assert reply["partially_applied"] is False  # nothing moved
        assert [r.call("digests")["digests"] for r in receivers] == before
    finally:
        doomed.close()
    assert_next_update_lands(rig, seed=1)


def test_trainer_killed_during_a_transfer(rig, no_leftovers):
    receivers = rig["receivers"]
    doomed = TrainerProcess(update_info=INFO, timeout_s=REPLY_S)
    try:
        join(doomed, receivers)
        for receiver in receivers:
            receiver.start("update", update_info=INFO)
        doomed.start("send", seed=2, stall_at_tensor=3)  # three buckets out, then it hangs
        assert doomed.reply()["stalled"]
        doomed.kill()
        for reply in receiver_failures(receivers):
            assert reply["partially_applied"] is True  # torn, and the receiver says so
    finally:
        doomed.close()
    assert_next_update_lands(rig, seed=3)


def test_trainer_killed_after_a_transfer(rig, no_leftovers):
    receivers = rig["receivers"]
    doomed = TrainerProcess(update_info=INFO, timeout_s=REPLY_S)
    try:
        join(doomed, receivers)
        for receiver in receivers:
            receiver.start("update", update_info=INFO)
        doomed.call("send", seed=4)
        for receiver in receivers:
            receiver.reply()
        doomed.kill()
        for receiver in receivers:  # what landed stays whole
            assert receiver.call("digests")["digests"] == digests_of(4)
    finally:
        doomed.close()
    assert_next_update_lands(rig, seed=5)


def test_trainer_stopped_mid_transfer(rig, no_leftovers):
    receivers = rig["receivers"]
    doomed = TrainerProcess(update_info=INFO, timeout_s=REPLY_S)
    try:
        join(doomed, receivers)
        for receiver in receivers:
            receiver.start("update", update_info=INFO)
        doomed.start("send", seed=6, stall_at_tensor=2)
        assert doomed.reply()["stalled"]
        os.kill(doomed.pid, signal.SIGSTOP)  # alive, holding its sockets, saying nothing
        replies = receiver_failures(receivers)
        assert {r["error_type"] for r in replies} == {"WeightTransferTimeout"}
        assert all(f"timed out after {TIMEOUT_S:g} s" in r["message"] for r in replies)
        os.kill(doomed.pid, signal.SIGCONT)
        doomed.kill()
    finally:
        doomed.close()
    assert_next_update_lands(rig, seed=7)


def test_trainer_stopped_while_a_receiver_waits_for_its_decision(rig, no_leftovers, monkeypatch):
    """The trainer stops (SIGSTOP) right after a receiver answered the handshake: the receiver's
    wait for the decision, and every store call after it (the note of why it gives up), end
    within the timeout, although the stopped host keeps the store's socket open."""
    doomed = TrainerProcess(update_info=INFO, timeout_s=REPLY_S)
    engine = GlooWeightTransferEngine(expected_specs={s.name: s for s in SPECS})
    outcome: dict[
        str, object
    ] = {}  # what the receive raised: not the error, whose frames hold the group
    try:
        info = doomed.call("init", world_size=2, **WIRE)["init_info"]
        joining = threading.Thread(target=engine.init_transfer_engine, args=(info,))
        joining.start()
        doomed.call("connect")
        joining.join(REPLY_S)
        assert engine.is_initialized
        # Where the interleaving happens: the answer is in the store, the decision is not read.
        monkeypatch.setattr(nccl, "_answered_hook", lambda n: os.kill(doomed.pid, signal.SIGSTOP))
        doomed.start("send", seed=12)

        def receive() -> None:
            try:
                engine.receive_weights(INFO, lambda pairs: None)
            except WeightTransferError as exc:
                outcome.update(type=type(exc), message=str(exc), torn=exc.partially_applied)

        receiving = threading.Thread(target=receive, daemon=True)
        receiving.start()
        receiving.join(REPLY_S)  # the rigs' limit, far above the transfer's: a hang fails here
        assert not receiving.is_alive(), "the receiver still waits on the stopped trainer's store"
        assert outcome.get("type") is WeightTransferTimeout, outcome
        assert f"timed out after {TIMEOUT_S:g} s (timeout_s)" in str(outcome["message"])
        assert outcome["torn"] is False  # nothing moved
    finally:
        os.kill(doomed.pid, signal.SIGCONT)
        doomed.kill()
        doomed.close()
        engine.shutdown()
    assert_next_update_lands(rig, seed=13)


def test_a_receiver_killed_mid_update(rig, no_leftovers):
    survivor = rig["receivers"][0]
    doomed_receiver = ReceiverProcess(  # not in place: every bucket goes through load_weights
        backend="gloo", update_info=INFO, worker_index=1, in_place=False, timeout_s=REPLY_S
    )
    trainer = TrainerProcess(update_info=INFO, timeout_s=REPLY_S)
    try:
        join(trainer, [survivor, doomed_receiver])
        survivor.start("update", update_info=INFO)
        doomed_receiver.start("update", update_info=INFO, stall_after_loads=1)
        trainer.start("send", seed=8)
        assert doomed_receiver.reply()["stalled"]
        doomed_receiver.kill()
        sent = trainer.reply(check=False)
        assert not sent["ok"] and sent["error_type"] in TRANSFER_ERRORS, sent
        receiver_failures([survivor])
    finally:
        doomed_receiver.close()
        trainer.close()
    assert_next_update_lands(rig, seed=9)


def test_the_rendezvous_port_taken(rig, no_leftovers):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(WeightTransferError, match=f"master_port {port}: .*Address already"):
            trainer_init(world_size=3, master_port=port, **WIRE)
    assert_next_update_lands(rig, seed=10)


def test_a_peer_that_never_arrives(rig, no_leftovers):
    receivers, trainer = rig["receivers"], rig["trainer"]
    info = trainer.call("init", world_size=4, **WIRE)["init_info"]  # a third worker never comes
    for receiver in receivers:
        receiver.start("init", init_info=info)
    with pytest.raises(WorkerProcessError) as raised:
        trainer.call("connect")
    assert raised.value.error_type == "WeightTransferTimeout"
    assert f"timed out after {TIMEOUT_S:g} s" in str(raised.value)
    receiver_failures(receivers)
    assert_next_update_lands(rig, seed=11)
