"""Faults of the ipc backend on real processes: each ends in a weightsync error, nothing left over."""

from __future__ import annotations

import os
import select
import signal
import time
from multiprocessing import resource_tracker

import pytest
import torch

from ipc_rigs import IPCReceiverProcess, IPCTrainerProcess, deliver_to_processes
from process_rigs import WorkerProcessError
from weightsync.errors import WeightValidationError
from weightsync.transfer.base import TensorSpec, WeightTransferUpdateInfo
from weightsync.transfer.memory import SHM_LIMIT_ENV

TIMEOUT_S = 5.0
SPECS = [
    TensorSpec("embed.weight", torch.float32, (64, 32)),
    TensorSpec("layer.0.q", torch.float32, (32, 32)),
    TensorSpec("head.weight", torch.bfloat16, (64, 32)),
]
INFO = WeightTransferUpdateInfo.from_specs(SPECS).to_dict()
SMALL_BUCKET = 4096  # several parts per update


def shm_names(session):
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(session))


def wait_for_exit(pid, timeout_s):
    """Waits for a process that is not our child to exit (its pidfd becomes readable)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        ready, _, _ = select.select([fd], [], [], timeout_s)
        assert ready, f"process {pid} still runs after {timeout_s} s"
    finally:
        os.close(fd)


def wait_until(predicate, timeout_s, what):
    """Polls `predicate` until it holds; fails naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what} within {timeout_s} s"
        time.sleep(0.05)


@pytest.fixture(scope="module", autouse=True)
def _helpers_first():
    """multiprocessing's resource tracker starts with the first spawned process and stays for the
    session; it is no case's leftover."""
    resource_tracker.ensure_running()


def test_a_killed_trainer_with_a_forked_child_leaves_no_segment(no_leftovers):
    trainer = IPCTrainerProcess(update_info=INFO, timeout_s=TIMEOUT_S)
    child = None
    try:
        reply = trainer.call("init", layout="shared", packed=False)
        session = reply["init_info"]["session"]
        assert len(shm_names(session)) == 1
        child = trainer.call("fork_child")["child_pid"]
        trainer.kill()
        # The child still holds the janitor's pipe: the janitor must go by the trainer's death.
        wait_for_exit(reply["janitor_pid"], TIMEOUT_S)
        assert shm_names(session) == []
        os.kill(child, 0)  # the child lived on all along
    finally:
        if child is not None:
            os.kill(child, signal.SIGKILL)
            wait_for_exit(child, TIMEOUT_S)
        trainer.close()


@pytest.fixture(scope="module")
def receivers():
    """Two receivers shared by the cases; trainers are per case."""
    resource_tracker.ensure_running()
    started = [
        IPCReceiverProcess(update_info=INFO, worker_index=i, timeout_s=REPLY_S) for i in range(2)
    ]
    yield started
    for receiver in started:
        receiver.close()


REPLY_S = 30.0


def start(receivers, **session_kwargs):
    """A trainer process with a new session its receivers joined; returns it and its reply."""
    trainer = IPCTrainerProcess(update_info=INFO, timeout_s=TIMEOUT_S)
    kwargs = {"layout": "plain", "packed": True, "bucket_size_bytes": SMALL_BUCKET}
    reply = trainer.call("init", **{**kwargs, **session_kwargs})
    for receiver in receivers:
        receiver.call("init", init_info=reply["init_info"])
    return trainer, reply


def digests(receivers):
    return [receiver.call("digests")["digests"] for receiver in receivers]


def assert_next_update_lands(receivers):
    """After the fault: receivers drop what is left, and a new trainer's update lands whole."""
    for receiver in receivers:
        receiver.call("abort")
    trainer, reply = start(receivers)
    try:
        trainer.send(receivers, seed=99)
        want = trainer.call("digests")["digests"]
        assert digests(receivers) == [want] * len(receivers)
        trainer.call("close")
        assert shm_names(reply["init_info"]["session"]) == []
    finally:
        trainer.close()
    for receiver in receivers:
        receiver.call("shutdown")  # its mappings go before the case ends


def test_trainer_killed_before_a_transfer(receivers, no_leftovers):
    before = digests(receivers)
    trainer, reply = start(receivers, layout="shared")
    try:
        trainer.kill()
        wait_for_exit(reply["janitor_pid"], TIMEOUT_S)
        assert shm_names(reply["init_info"]["session"]) == []
        assert digests(receivers) == before
    finally:
        trainer.close()
    assert_next_update_lands(receivers)


def test_trainer_killed_during_a_transfer(receivers, no_leftovers):
    trainer, reply = start(receivers)
    deliver = deliver_to_processes(receivers)
    try:
        trainer.start("send", seed=3)
        for _ in range(2):  # the announcement and the first part land
            deliver(trainer.next_message()["deliver"])
            trainer.acknowledge()
        pending = trainer.next_message()["deliver"]
        trainer.kill()
        wait_for_exit(reply["janitor_pid"], TIMEOUT_S)
        assert shm_names(reply["init_info"]["session"]) == []
        with pytest.raises(WeightValidationError, match=r"no byte moved.*does not exist"):
            deliver(pending)
        for receiver in receivers:  # torn, and it says so: an engine would not serve it
            assert receiver.call("state")["update_in_progress"] is True
    finally:
        trainer.close()
    assert_next_update_lands(receivers)


def test_trainer_killed_after_a_transfer(receivers, no_leftovers):
    trainer, reply = start(receivers)
    try:
        trainer.send(receivers, seed=4)
        want = trainer.call("digests")["digests"]
        trainer.kill()
        wait_for_exit(reply["janitor_pid"], TIMEOUT_S)
        assert shm_names(reply["init_info"]["session"]) == []
        assert digests(receivers) == [want, want]  # what landed stays whole
    finally:
        trainer.close()
    assert_next_update_lands(receivers)


def test_trainer_stopped_mid_transfer(receivers, no_leftovers):
    trainer, reply = start(receivers, timeout_s=1.0)
    deliver = deliver_to_processes(receivers)
    try:
        trainer.start("send", seed=5)
        deliver(trainer.next_message()["deliver"])
        trainer.acknowledge()
        first_part = trainer.next_message()["deliver"]
        os.kill(trainer.pid, signal.SIGSTOP)
        deliver(first_part)  # the workers copy it; the trainer hears nothing while stopped
        time.sleep(1.5)  # the fault lasts longer than the trainer's timeout_s
        os.kill(trainer.pid, signal.SIGCONT)
        failed = trainer.reply(check=False)
        assert not failed["ok"] and failed["error_type"] == "WeightTransferTimeout", failed
        assert failed["partially_applied"] is True
        for receiver in receivers:
            assert receiver.call("state")["update_in_progress"] is True
        trainer.kill()  # its courier still waits for the abandoned acknowledgement
        wait_for_exit(reply["janitor_pid"], TIMEOUT_S)
    finally:
        trainer.close()
    assert_next_update_lands(receivers)


def test_a_hostile_handle_record_moves_nothing(receivers, no_leftovers):
    before = digests(receivers)
    torch_segment = f"torch_{os.getpid()}_77_0"  # named as torch names its segments
    with open(f"/dev/shm/{torch_segment}", "wb") as victim:
        victim.truncate(1 << 16)
    trainer, _ = start(receivers)
    deliver = deliver_to_processes(receivers)
    try:
        trainer.start("send", seed=6)
        deliver(trainer.next_message()["deliver"])
        trainer.acknowledge()
        part = trainer.next_message()["deliver"]
        for record in part["ipc_handles"]:
            record["segment"] = torch_segment
        with pytest.raises(WeightValidationError, match="is not a segment of session"):
            deliver(part)
        trainer.acknowledge(("WeightValidationError", "hostile record refused"))
        with pytest.raises(WorkerProcessError, match="hostile record refused"):
            trainer.reply()
        assert digests(receivers) == before
        trainer.call("close")
    finally:
        trainer.close()
        os.unlink(f"/dev/shm/{torch_segment}")
    assert_next_update_lands(receivers)


def test_dev_shm_too_small_for_a_bucket(receivers, no_leftovers, monkeypatch):
    before = digests(receivers)
    monkeypatch.setenv(SHM_LIMIT_ENV, str(SMALL_BUCKET // 2))  # the trainer inherits it
    trainer, reply = start(receivers)
    monkeypatch.delenv(SHM_LIMIT_ENV)
    try:
        with pytest.raises(WorkerProcessError, match="No space left on device") as raised:
            trainer.send(receivers, seed=7)
        assert raised.value.error_type == "WeightTransferError"
        assert raised.value.reply["partially_applied"] is False
        assert digests(receivers) == before
        assert shm_names(reply["init_info"]["session"]) == []
        trainer.call("close")
    finally:
        trainer.close()
    assert_next_update_lands(receivers)


def test_a_late_message_of_an_old_update_is_refused(receivers, no_leftovers):
    trainer, _ = start(receivers, packed=False, layout="shared")
    recorded = []
    deliver = deliver_to_processes(receivers)
    try:
        trainer.start("send", seed=8)
        while "deliver" in (message := trainer.next_message()):
            recorded.append(message["deliver"])
            deliver(message["deliver"])
            trainer.acknowledge()
        assert message["ok"]
        trainer.start("send", seed=9)
        deliver(trainer.next_message()["deliver"])  # the new update's announcement
        trainer.acknowledge()
        with pytest.raises(WeightValidationError, match="was not announced to this worker"):
            deliver(recorded[1])  # the old update's part, late
        deliver(trainer.next_message()["deliver"])
        trainer.acknowledge()
        assert trainer.next_message()["ok"]
        want = trainer.call("digests")["digests"]
        assert digests(receivers) == [want, want]
        trainer.call("close")
    finally:
        trainer.close()
    assert_next_update_lands(receivers)
