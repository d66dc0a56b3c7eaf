"""Hostile IPC records and abandoned updates, in one process: every peer value is checked first."""

import base64
import copy
import os
import threading

import pytest
import torch
from test_ipc_handles import CUDA_RECORD, Rig, corrupt, shm_names

from weightsync import weight_checksums
from weightsync.errors import WeightTransferTimeout, WeightValidationError
from weightsync.transfer import memory as _cuda_ipc


@pytest.fixture
def rig():
    rig = Rig(packed=True, bucket_size_bytes=256)
    yield rig
    rig.close()
    assert shm_names(rig.session.session) == []


@pytest.fixture
def parts(rig):
    """The announcement and the parts of one recorded, undelivered update."""
    rig.send(deliver=rig.delivered.append)
    assert len(rig.delivered) > 3
    return rig.delivered


def test_a_record_naming_torchs_own_segment_is_refused(rig, parts):
    victim = torch.ones(64).untyped_storage()
    name = victim._share_filename_cpu_()[1].decode().lstrip("/")  # a real torch_* segment
    assert os.path.exists(f"/dev/shm/{name}")
    before = weight_checksums(rig.params)
    rig.receive(parts[0])
    with pytest.raises(WeightValidationError, match=rf"segment '{name}' is not a segment of"):
        rig.receive(corrupt(parts[1], 0, segment=name))
    assert weight_checksums(rig.params) == before
    assert rig.engine._mappings.open_segments == []


def test_an_aborted_update_leaves_no_mapping_and_its_late_parts_are_refused(rig, parts):
    rig.receive(parts[0])
    rig.receive(parts[1])
    assert rig.engine._mappings.open_segments != []
    rig.engine.abort_update()
    assert rig.engine._mappings.open_segments == []
    with pytest.raises(WeightValidationError, match="was not announced to this worker"):
        rig.receive(parts[2])  # a late part of the update no longer waited for
    assert rig.engine._mappings.open_segments == []


def test_an_abandoned_update_is_unmapped_when_the_next_one_is_announced(rig, parts):
    rig.receive(parts[0])
    rig.receive(parts[1])
    abandoned = rig.engine._mappings.open_segments
    mapped_after_announcement = []

    def deliver(info):
        rig.receive(info)
        if info["ipc_handles"] is None:
            mapped_after_announcement.append(rig.engine._mappings.open_segments)

    rig.send(deliver=deliver)  # a live send: every part is read while its buffer holds it
    assert abandoned and mapped_after_announcement == [[]]
    assert weight_checksums(rig.params) == weight_checksums(rig.source)


def test_a_segment_truncated_since_it_was_mapped_is_refused_before_anything_is_read(rig, parts):
    # The mapping of the first update is kept for the next one; its owner then truncates the
    # segment, and a later record names it again: reading the old mapping would be a SIGBUS.
    for info in parts:
        rig.receive(info)
    part = copy.deepcopy(parts[1])
    name = part["ipc_handles"][0]["segment"]
    assert name in rig.engine._mappings.open_segments
    os.truncate(f"/dev/shm/{name}", 8)
    again = [{**info, "update_id": "a-later-update"} for info in (parts[0], part)]
    rig.receive(again[0])
    read = []
    with pytest.raises(WeightValidationError, match=rf"reaches past the end of {name} \(8 bytes\)"):
        rig.engine.receive_weights(again[1], read.append)
    assert read == []  # refused before load_weights saw a byte


@pytest.fixture
def gpu(monkeypatch):
    """Makes the record's GPU visible, and fails the test if torch is asked to open a handle."""
    monkeypatch.setattr(_cuda_ipc, "cuda_device_uuids", lambda: {CUDA_RECORD["device_uuid"]: 0})

    def never(*args):
        raise AssertionError("the handle was opened although the record should be refused")

    monkeypatch.setattr(_cuda_ipc, "_rebuild", never)
    return monkeypatch


@pytest.fixture
def ref_counter_file():
    """A file shaped like torch's reference counts (10000 int64 slots), named as torch does."""
    name = f"/torch_{os.getpid()}_4242_0"
    with open(f"/dev/shm{name}", "wb") as f:
        f.truncate(8 * _cuda_ipc.REF_COUNTER_SLOTS)
    yield name
    os.unlink(f"/dev/shm{name}")


def _b64(text):
    return base64.b64encode(text.encode()).decode()


@pytest.mark.parametrize(
    ("cuda", "message"),
    [
        (
            {"ref_counter_handle": _b64("/weightsync-0123456789ab-0")},
            r"ref_counter_handle '/weightsync-0123456789ab-0' is not a torch reference-count",
        ),
        ({"ref_counter_handle": _b64("/torch_1_2_3/../x")}, "is not a torch reference-count"),
        ({"ref_counter_offset": 10000}, r"ref_counter_offset must be below 10000.*got 10000"),
        ({"ref_counter_handle": _b64("/torch_1_2_999")}, r"'/torch_1_2_999' cannot be checked"),
        ({"storage_nbytes": 64}, r"offset 0 \+ nbytes 128 reaches past the end of the CUDA"),
    ],
)
def test_a_hostile_cuda_record_is_refused_before_the_handle_is_opened(
    rig, parts, gpu, ref_counter_file, cuda, message
):
    before = weight_checksums(rig.params)
    rig.receive(parts[0])
    record = {**CUDA_RECORD, "ref_counter_handle": _b64(ref_counter_file), **cuda}
    with pytest.raises(WeightValidationError, match=message):
        rig.receive(corrupt(parts[1], 0, segment=None, cuda=record, offset=0))
    assert weight_checksums(rig.params) == before


def test_a_reference_count_file_too_small_is_refused(rig, parts, gpu):
    name = f"/torch_{os.getpid()}_4243_0"
    with open(f"/dev/shm{name}", "wb") as f:
        f.truncate(16)  # a counter in slot 2 or beyond would be written past its end
    try:
        rig.receive(parts[0])
        record = {**CUDA_RECORD, "ref_counter_handle": _b64(name)}
        with pytest.raises(WeightValidationError, match=r"with 10000 slots \(owner uid"):
            rig.receive(corrupt(parts[1], 0, segment=None, cuda=record, offset=0))
    finally:
        os.unlink(f"/dev/shm{name}")


def test_a_storage_larger_than_its_cuda_allocation_is_refused(rig, parts, gpu, ref_counter_file):
    gpu.setattr(_cuda_ipc, "_rebuild", lambda handle, index: torch.zeros(handle.storage_nbytes))
    gpu.setattr(_cuda_ipc, "_allocation_extent", lambda tensor: 1024)
    before = weight_checksums(rig.params)
    rig.receive(parts[0])
    record = {**CUDA_RECORD, "ref_counter_handle": _b64(ref_counter_file)}
    with pytest.raises(
        WeightValidationError, match=r"storage_nbytes is 4096 but the CUDA allocation holds 1024"
    ):
        rig.receive(corrupt(parts[1], 0, segment=None, cuda=record, offset=0))
    assert weight_checksums(rig.params) == before


def test_a_handle_the_driver_refuses_is_a_validation_error(rig, parts, gpu, ref_counter_file):
    def refuse(handle, index):
        raise RuntimeError("CUDA error: invalid resource handle")

    gpu.setattr(_cuda_ipc, "_rebuild", refuse)
    rig.receive(parts[0])
    record = {**CUDA_RECORD, "ref_counter_handle": _b64(ref_counter_file)}
    with pytest.raises(WeightValidationError, match=r"the CUDA driver refused the handle"):
        rig.receive(corrupt(parts[1], 0, segment=None, cuda=record, offset=0))


def test_a_timed_out_delivery_is_stopped_not_followed_by_the_queued_parts():
    rig = Rig(packed=True, bucket_size_bytes=256, num_buffers=2, timeout_s=0.3)
    calls, release = [], threading.Event()

    def deliver(info):
        calls.append(info)
        if len(calls) == 2:  # the first part hangs past the timeout; the second is queued
            release.wait(10)
        else:
            rig.receive(info)

    try:
        with pytest.raises(WeightTransferTimeout, match="did not acknowledge within timeout_s"):
            rig.send(deliver=deliver)
        release.set()
        for thread in threading.enumerate():
            if thread.name == "weightsync-ipc":
                thread.join(5)
                assert not thread.is_alive()
        assert len(calls) == 2  # nothing after the timed-out part reached the workers
    finally:
        release.set()
        rig.close()


class _Event:
    """Stands in for a CUDA event: done after `ready_after` queries (never when None)."""

    def __init__(self, ready_after):
        self.ready_after, self.queries = ready_after, 0

    def record(self, stream):
        pass

    def query(self):
        self.queries += 1
        return self.ready_after is not None and self.queries > self.ready_after


@pytest.mark.parametrize("ready_after", [0, 5])
def test_a_gpu_wait_returns_once_the_device_is_done(monkeypatch, ready_after):
    event = _Event(ready_after)
    monkeypatch.setattr(_cuda_ipc, "_new_event", lambda: event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: None)
    _cuda_ipc.synchronize(torch.device("cuda", 0), timeout_s=5.0, what="packing a bucket")
    assert event.queries == ready_after + 1


def test_a_gpu_that_never_finishes_is_a_timeout_not_a_hang(monkeypatch):
    monkeypatch.setattr(_cuda_ipc, "_new_event", lambda: _Event(None))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: None)
    with pytest.raises(
        WeightTransferTimeout, match=r"packing a bucket: the GPU cuda:0 did not finish .* 0.1 s"
    ):
        _cuda_ipc.synchronize(torch.device("cuda", 0), timeout_s=0.1, what="packing a bucket")
