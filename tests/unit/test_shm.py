"""Shared-memory segments: names, creation, read-only attachment and unlinking, in one process."""

import os

import pytest
import torch

from weightsync.errors import WeightTransferError, WeightValidationError
from weightsync.transfer import memory as shm


@pytest.fixture
def session():
    return shm.new_session_name()


def test_session_names_are_fresh_and_recognised():
    first, second = shm.new_session_name(), shm.new_session_name()
    assert first != second and shm.is_session_name(first)
    for bad in ("weightsync-xyz", "weightsync-0123456789ab-0", "torch_1_2_3", 7, None):
        assert not shm.is_session_name(bad)


def test_a_receiver_attaches_only_to_its_sessions_segments(session):
    assert shm._segment_belongs_to(f"{session}-0", session)
    other = shm.new_session_name()
    for name in (f"{other}-0", session, f"{session}-x", "torch_1_2_3", "/etc/passwd"):
        assert not shm._segment_belongs_to(name, session)


def test_a_segment_is_written_by_its_owner_and_read_by_an_attacher(session):
    segment = shm.SharedSegment(f"{session}-0", 64)
    try:
        segment.tensor[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
        assert segment.contains(segment.address + 60, 4)
        assert not segment.contains(segment.address + 61, 4)
        attached = shm.attach_segment(segment.name)
        assert attached.nbytes == 64 and attached.tensor[:4].tolist() == [1, 2, 3, 4]
        assert attached.identity == shm._segment_identity(segment.name)
    finally:
        segment.unlink()
    assert segment.tensor[:4].tolist() == [1, 2, 3, 4]  # views outlive the name
    assert shm._unlink_segment(segment.name) is False  # already gone, and says so


def test_a_missing_segment_is_a_validation_error_that_says_why(session):
    with pytest.raises(WeightValidationError, match="does not exist: the trainer unlinked it"):
        shm.attach_segment(f"{session}-9")
    with pytest.raises(WeightValidationError, match="does not exist"):
        shm._segment_identity(f"{session}-9")


def test_a_segment_needs_at_least_one_byte(session):
    with pytest.raises(WeightValidationError, match="a segment needs nbytes >= 1, got 0"):
        shm.SharedSegment(f"{session}-0", 0)


def test_a_taken_name_is_a_transfer_error_not_an_oserror(session):
    segment = shm.SharedSegment(f"{session}-0", 8)
    try:
        with pytest.raises(WeightTransferError, match="cannot create shared-memory segment"):
            shm.SharedSegment(f"{session}-0", 8)
    finally:
        segment.unlink()


def test_a_dead_janitor_is_an_error_the_trainer_sees_before_exporting_more():
    import os
    import signal

    from weightsync.transfer.base import TensorSpec
    from weightsync.transfer.ipc import ipc_trainer_init

    session = ipc_trainer_init(packed=False)
    try:
        os.kill(session.janitor_pid, signal.SIGKILL)
        os.waitpid(session.janitor_pid, 0)  # reaped here: the janitor is our child
        with pytest.raises(WeightTransferError, match=r"segment janitor of session .* is gone"):
            session.shared_tensors([TensorSpec("w", torch.float32, (2,))])
        assert session.segment_names() == []  # refused before any segment existed
    finally:
        session.close()


def test_the_size_limit_hook_fails_like_a_full_dev_shm_and_leaves_nothing(session, monkeypatch):
    monkeypatch.setenv(shm.SHM_LIMIT_ENV, "4096")
    shm.SharedSegment(f"{session}-0", 4096).unlink()  # at the limit: created
    with pytest.raises(WeightTransferError, match=r"of 4097 bytes: .*No space left on device"):
        shm.SharedSegment(f"{session}-1", 4097)
    assert not os.path.exists(f"/dev/shm/{session}-1")
    monkeypatch.setenv(shm.SHM_LIMIT_ENV, "lots")
    with pytest.raises(WeightValidationError, match="WEIGHTSYNC_SHM_LIMIT_BYTES must be a number"):
        shm.SharedSegment(f"{session}-2", 1)
    assert not os.path.exists(f"/dev/shm/{session}-2")
