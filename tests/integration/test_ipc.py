"""The ipc backend across real processes: a trainer process and two receiver processes (CPU)."""

import os
import select
import subprocess
import sys

import pytest
import torch

from ipc_rigs import (
    IPCReceiverProcess,
    IPCTrainerProcess,
    deliver_to_processes,
)
from process_rigs import WorkerProcessError
from weightsync.errors import WeightValidationError
from weightsync.transfer.base import TensorSpec, WeightTransferUpdateInfo

TIMEOUT_S = 30.0
SPECS = [
    TensorSpec("embed.weight", torch.bfloat16, (64, 32)),
    TensorSpec("layer.0.norm", torch.float32, (32,)),
    TensorSpec("layer.0.q", torch.float16, (32, 32)),
    TensorSpec("layer.0.scale", torch.float8_e4m3fn, (32,)),
    TensorSpec("layer.0.step", torch.int64, ()),
    TensorSpec("layer.0.unused", torch.float32, (0, 4)),
    TensorSpec("layer.0.mask", torch.bool, (33,)),
    TensorSpec("layer.0.codes", torch.int8, (100,)),
    TensorSpec("layer.0.ids", torch.int32, (7, 3)),
    TensorSpec("head.weight", torch.bfloat16, (64, 32)),
]
INFO = WeightTransferUpdateInfo.from_specs(SPECS).to_dict()
# A model the trainer's update does not fit: one shape differs.
OTHER_INFO = WeightTransferUpdateInfo.from_specs(
    [*SPECS[:2], TensorSpec("layer.0.q", torch.float16, (16, 32)), *SPECS[3:]]
).to_dict()
SMALL_BUCKET = 4096  # several parts per update


def shm_names(session):
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(session))


@pytest.fixture(scope="module")
def procs():
    """Two receivers, one receiver of a different model, and two trainers, started together."""
    started = {
        "receivers": [
            IPCReceiverProcess(update_info=INFO, worker_index=i, timeout_s=TIMEOUT_S)
            for i in range(2)
        ],
        "other": IPCReceiverProcess(update_info=OTHER_INFO, timeout_s=TIMEOUT_S),
        "trainer": IPCTrainerProcess(update_info=INFO, timeout_s=TIMEOUT_S),
        "doomed": IPCTrainerProcess(update_info=INFO, timeout_s=TIMEOUT_S),
    }
    yield started
    everyone = [*started["receivers"], started["other"], started["trainer"], started["doomed"]]
    alive = [proc for proc in everyone if proc.process.is_alive()]
    for proc in alive:  # ask all at once: interpreters take a while to exit
        proc.start("exit")
    for proc in alive:
        proc.reply()
    for proc in everyone:
        proc.close()


def init(trainer, receivers, **session_kwargs):
    """Starts a new trainer session and joins the receivers to it."""
    reply = trainer.call("init", timeout_s=TIMEOUT_S, **session_kwargs)
    for receiver in receivers:
        receiver.call("init", init_info=reply["init_info"])
    return reply


def assert_same_weights(trainer, receivers):
    want = trainer.call("digests")["digests"]
    assert len(want) == len(SPECS)
    for receiver in receivers:
        assert receiver.call("digests")["digests"] == want


def close_session(trainer, session):
    trainer.call("close")
    assert shm_names(session) == []


@pytest.mark.parametrize("packed", [True, False])
def test_packed_and_unpacked_are_bitwise_equal(procs, packed):
    trainer, receivers = procs["trainer"], procs["receivers"]
    layout = "plain" if packed else "shared"
    reply = init(trainer, receivers, layout=layout, packed=packed, bucket_size_bytes=SMALL_BUCKET)
    sent = trainer.send(receivers, seed=11)
    assert_same_weights(trainer, receivers)
    stats = sent["stats"]
    assert stats["num_tensors"] == len(SPECS)
    assert stats["num_bytes"] == sum(s.nbytes for s in SPECS)
    if packed:
        assert stats["num_buckets"] > 2 and stats["direct_buckets"] == 0
    else:  # zero-copy: one delivery pointing into the trainer's own (shared) tensors
        assert stats["num_buckets"] == stats["direct_buckets"] == 1
    for receiver in receivers:
        assert receiver.call("state") == {
            "ok": True,
            "initialized": True,
            "update_in_progress": False,
        }
    close_session(trainer, reply["init_info"]["session"])


def test_hundred_consecutive_updates(procs):
    trainer, receivers = procs["trainer"], procs["receivers"]
    reply = init(trainer, receivers, layout="plain", packed=True, bucket_size_bytes=SMALL_BUCKET)
    session = reply["init_info"]["session"]
    for seed in range(100):
        sent = trainer.send(receivers, seed=1000 + seed)
        assert len(sent["segments"]) == 2  # the same two buffers, reused
        if seed % 33 == 0:
            assert_same_weights(trainer, receivers)
    assert_same_weights(trainer, receivers)
    assert len(shm_names(session)) == 2
    close_session(trainer, session)


def test_a_rejection_by_one_receiver_moves_nothing_anywhere(procs):
    trainer, receivers = procs["trainer"], [procs["receivers"][0], procs["other"]]
    reply = init(trainer, receivers, layout="plain", packed=True, bucket_size_bytes=SMALL_BUCKET)
    for receiver in receivers:
        receiver.call("fill", seed=5)
    before = [r.call("digests")["digests"] for r in receivers]
    with pytest.raises(
        WorkerProcessError, match=r"receiver 1: .*rejected before any byte"
    ) as raised:
        trainer.send(receivers, seed=6)
    assert raised.value.error_type == "WeightValidationError"
    assert "'layer.0.q': model has float16[16, 32], update has float16[32, 32]" in str(raised.value)
    assert [r.call("digests")["digests"] for r in receivers] == before
    close_session(trainer, reply["init_info"]["session"])


def test_a_failed_transfer_unlinks_the_buffers(procs):
    trainer, receivers = procs["trainer"], procs["receivers"]
    reply = init(trainer, receivers, layout="plain", packed=True, bucket_size_bytes=SMALL_BUCKET)
    session = reply["init_info"]["session"]
    with pytest.raises(WorkerProcessError, match=r"failure drill at part 1") as raised:
        trainer.send(receivers, seed=7, fail_at_part=1)
    assert raised.value.error_type == "WeightTransferError"
    assert raised.value.reply["partially_applied"] is True
    assert trainer.call("segments")["segments"] == []
    assert shm_names(session) == []
    # The session itself survives: the next update allocates fresh buffers and lands whole.
    for receiver in receivers:
        receiver.call("init", init_info=reply["init_info"])
    trainer.send(receivers, seed=8)
    assert_same_weights(trainer, receivers)
    close_session(trainer, session)


def wait_for_exit(pid, timeout_s):
    """Waits for a process that is not our child to exit (a pidfd becomes readable)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        ready, _, _ = select.select([fd], [], [], timeout_s)
        assert ready, f"process {pid} still runs after {timeout_s} s"
    finally:
        os.close(fd)


def test_a_trainer_killed_mid_transfer_leaves_no_segment(procs):
    trainer, receivers = procs["doomed"], procs["receivers"]
    reply = init(trainer, receivers, layout="shared", packed=True, bucket_size_bytes=SMALL_BUCKET)
    session = reply["init_info"]["session"]
    deliver = deliver_to_processes(receivers)
    trainer.start("send", seed=9)
    for _ in range(2):  # the announcement and the first part land
        deliver(trainer.next_message()["deliver"])
        trainer.acknowledge()
    pending = trainer.next_message()["deliver"]
    assert len(shm_names(session)) == 3  # the shared tensors and two bucket buffers
    trainer.kill()
    wait_for_exit(reply["janitor_pid"], TIMEOUT_S)
    assert shm_names(session) == []
    # The receivers refuse the next part, whose segment is gone, without loading a byte; the
    # update stays in progress (an engine's transaction then waits for an abort or a new update).
    with pytest.raises(WeightValidationError, match=r"no byte moved.*does not exist"):
        deliver(pending)
    for receiver in receivers:
        assert receiver.call("state") == {
            "ok": True,
            "initialized": True,
            "update_in_progress": True,
        }


def test_a_receiver_never_shut_down_leaves_no_watch_running_when_its_process_exits():
    # The report runs last (exit handlers run in reverse order): after the package's own.
    code = """
import atexit, threading
atexit.register(lambda: print(sorted(t.name for t in threading.enumerate() if t.daemon)))
import torch
from weightsync.transfer.ipc import IPCWeightTransferEngine, ipc_trainer_init
session = ipc_trainer_init(packed=True)
receiver = IPCWeightTransferEngine(params={"w": torch.zeros(4)})
receiver.init_transfer_engine(session.init_info)
assert receiver._watch.is_running
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "weightsync-ipc-watch" not in out.stdout  # stopped before the interpreter finalizes
