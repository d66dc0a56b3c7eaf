"""Faults of the ipc backend on real processes: each ends in a weightsync error, nothing left over."""

from __future__ import annotations

import os
import select
import signal
import time
from multiprocessing import resource_tracker

import pytest
import torch

from ipc_rigs import IPCTrainerProcess
from weightsync.transfer.base import TensorSpec, WeightTransferUpdateInfo

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
