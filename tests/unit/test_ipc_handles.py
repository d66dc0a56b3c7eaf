"""IPC handle records in one process: JSON round trips, and every corrupted record rejected cleanly."""

import base64
import copy
import json
import os
import threading

import pytest
import torch

from process_rigs import fill_tensors
from weightsync import weight_checksums
from weightsync.errors import WeightTransferError, WeightTransferTimeout, WeightValidationError
from weightsync.transfer.base import TensorSpec, WeightTransferUpdateInfo, create_engine
from weightsync.transfer.base import _parse_info as parse_info
from weightsync.transfer.ipc import (
    IPCTrainerSendWeightsArgs,
    IPCWeightTransferEngine,
    IPCWeightTransferUpdateInfo,
    ipc_trainer_init,
    ipc_trainer_send_weights,
)
from weightsync.transfer.memory import IPCHandle

SPECS = [
    TensorSpec("w", torch.float32, (4, 8)),
    TensorSpec("b", torch.bfloat16, (8,)),
    TensorSpec("step", torch.int64, ()),
    TensorSpec("none", torch.float16, (0, 3)),
    TensorSpec("mask", torch.bool, (5,)),
    TensorSpec("scale", torch.float8_e4m3fn, (16,)),
]


def shm_names(session):
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(session))


class Rig:
    """A trainer session and a receiver engine in this process, joined by a recording deliver."""

    def __init__(self, **session_kwargs):
        self.session = ipc_trainer_init(**{"packed": False, "timeout_s": 5.0, **session_kwargs})
        self.source = self.session.shared_tensors(SPECS)
        fill_tensors(self.source, seed=1)
        self.params = {s.name: torch.zeros(s.shape, dtype=s.dtype) for s in SPECS}
        fill_tensors(self.params, seed=2)
        self.engine = IPCWeightTransferEngine(params=self.params)
        self.engine.init_transfer_engine(self.session.init_info)
        self.delivered = []

    def load(self, pairs):
        for name, tensor in pairs:
            self.params[name].copy_(tensor)

    def receive(self, info):
        return self.engine.receive_weights(json.loads(json.dumps(info)), self.load)

    def deliver(self, info):
        self.delivered.append(copy.deepcopy(info))
        self.receive(info)

    def send(self, *, deliver=None):
        args = IPCTrainerSendWeightsArgs(self.session, deliver or self.deliver)
        return ipc_trainer_send_weights(self.source.items(), args)

    def close(self):
        self.engine.shutdown()
        self.session.close()


@pytest.fixture
def rig():
    rig = Rig()
    yield rig
    rig.close()
    assert shm_names(rig.session.session) == []


@pytest.fixture
def data_info(rig):
    """A valid data delivery that was recorded but never received."""
    rig.send(deliver=rig.delivered.append)
    announcement, data = rig.delivered
    assert announcement["ipc_handles"] is None
    rig.receive(announcement)
    return data


def test_backend_is_registered():
    assert isinstance(create_engine("ipc"), IPCWeightTransferEngine)


def test_update_info_survives_json_unchanged(data_info):
    wire = json.loads(json.dumps(data_info))
    assert wire == data_info
    parsed = parse_info(IPCWeightTransferUpdateInfo, wire, what="update_info")
    assert parsed.to_dict() == data_info
    assert [h.to_dict() for h in parsed.handles()] == data_info["ipc_handles"]
    assert all(isinstance(h["segment"], str) for h in data_info["ipc_handles"] if h["nbytes"])


def test_shared_tensors_go_bitwise_equal_without_copies(rig):
    stats = rig.send()
    assert weight_checksums(rig.params) == weight_checksums(rig.source)
    assert (stats.num_buckets, stats.direct_buckets) == (1, 1)
    segments = {h.get("segment") for h in rig.delivered[1]["ipc_handles"] if h["nbytes"]}
    assert segments == set(rig.session.segment_names())  # records point into the tensors' memory
    assert not rig.engine.update_in_progress


def corrupt(info, index, **changes):
    info = copy.deepcopy(info)
    record = info["ipc_handles"][index]
    for key, value in changes.items():
        if value is None:
            record.pop(key, None)
        else:
            record[key] = value
    return info


CUDA_RECORD = {
    "device_uuid": "GPU-00000000-0000-0000-0000-000000000000",
    "handle": base64.b64encode(b"\x01" * 64).decode(),
    "storage_nbytes": 4096,
    "storage_offset": 0,
    "ref_counter_handle": base64.b64encode(b"/torch_0_0_0").decode(),
    "ref_counter_offset": 0,
    "event_handle": None,
    "event_sync_required": False,
}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"dtype": "float33"}, r"ipc_handles\[0\] \('w'\): unknown dtype name 'float33'"),
        ({"dtype": "int32"}, r"describes int32\[4, 8\] but the update announces float32\[4, 8\]"),
        ({"nbytes": 64}, r"nbytes is 64 but shape \[4, 8\] of float32 holds 128 bytes"),
        ({"shape": [8, 4]}, r"describes float32\[8, 4\] but the update announces float32\[4, 8\]"),
        ({"shape": [2] * 100_000}, r"shape has 100000 dims, more than the 64 a tensor may have"),
        ({"offset": 1 << 40}, r"offset 1099511627776 \+ nbytes 128 reaches past the end of"),
        ({"offset": 2}, r"offset 2 is not a multiple of the float32 size \(4 bytes\)"),
        ({"offset": -4}, r"offset must be an int >= 0, got -4"),
        ({"offset": True}, r"offset must be an int >= 0, got True"),
        ({"segment": None}, r"has 128 bytes but neither 'segment' nor 'cuda' says where"),
        ({"segment": 7}, r"segment must be a string, got int"),
        (
            {"segment": "../../etc/passwd"},
            r"segment '../../etc/passwd' is not a segment of session",
        ),
        ({"segment": "weightsync-0123456789ab-0"}, r"is not a segment of session"),
        ({"extra": "x"}, r"has unknown keys \['extra'\]"),
        ({"cuda": CUDA_RECORD}, r"has both 'segment' and 'cuda'"),
        (
            {"segment": None, "cuda": {"handle": "!!"}},
            r"\.cuda has unknown keys \[\] and lacks keys",
        ),
        (
            {"segment": None, "cuda": {**CUDA_RECORD, "handle": "not base64!"}},
            r"cuda.handle is not valid base64",
        ),
    ],
)
def test_corrupted_record_is_rejected_and_weights_stay(rig, data_info, changes, message):
    before = weight_checksums(rig.params)
    with pytest.raises(WeightValidationError, match=message):
        rig.receive(corrupt(data_info, 0, **changes))
    assert weight_checksums(rig.params) == before
    assert rig.engine.is_initialized


def test_missing_segment_is_rejected_and_weights_stay(rig, data_info):
    before = weight_checksums(rig.params)
    name = data_info["ipc_handles"][0]["segment"]
    missing = corrupt(data_info, 0, segment=name.rsplit("-", 1)[0] + "-999")
    with pytest.raises(WeightValidationError, match=r"segment '.*-999' does not exist"):
        rig.receive(missing)
    assert weight_checksums(rig.params) == before


def test_unknown_cuda_device_is_rejected_listing_what_the_receiver_has(rig, data_info):
    before = weight_checksums(rig.params)
    info = corrupt(data_info, 0, segment=None, cuda=CUDA_RECORD, offset=0)
    with pytest.raises(WeightValidationError) as raised:
        rig.receive(info)
    assert "device_uuid 'GPU-00000000-0000-0000-0000-000000000000' is not a GPU" in str(
        raised.value
    )
    assert "available UUIDs: " in str(raised.value)
    assert weight_checksums(rig.params) == before


def test_bad_record_after_a_good_one_touches_nothing(rig, data_info):
    # The bad record is the last one: the good ones before it must not be loaded either.
    before = weight_checksums(rig.params)
    with pytest.raises(WeightValidationError, match=r"ipc_handles\[5\] \('scale'\)"):
        rig.receive(corrupt(data_info, 5, offset=1 << 30))
    assert weight_checksums(rig.params) == before


def test_record_count_and_part_order_are_checked(rig, data_info):
    later = {
        **data_info,
        **{key: data_info[key][1:] for key in ("names", "dtype_names", "shapes", "ipc_handles")},
        "first_index": 1,
    }
    cases = [
        ({**data_info, "ipc_handles": data_info["ipc_handles"][1:]}, r"one record per name: got 5"),
        (later, r"starts at tensor 1 but the worker expects tensor 0"),
        ({**data_info, "weight_version": 7}, r"differ from what was announced"),
        ({**data_info, "update_id": "u2"}, r"update u2 was not announced to this worker"),
        ({**data_info, "pickled": "gASV"}, r"unknown keys \['pickled'\]"),
    ]
    for info, message in cases:  # each is refused and leaves the announced update going on
        with pytest.raises(WeightValidationError, match=message):
            rig.receive(info)
    assert rig.engine.is_initialized


def test_announcement_is_checked_against_the_model(rig):
    other = WeightTransferUpdateInfo.from_specs([TensorSpec("w", torch.float32, (8, 4))]).to_dict()
    with pytest.raises(
        WeightValidationError, match=r"'w': model has float32\[4, 8\], update has float32\[8, 4\]"
    ):
        rig.receive({**other, "update_id": "u1"})


def test_a_rejected_announcement_stops_the_trainer_before_data_moves(rig):
    def reject(info):
        rig.delivered.append(info)
        raise WeightValidationError("worker 1: unknown name 'w'")

    with pytest.raises(
        WeightValidationError, match=r"rejected the update; nothing moved: worker 1"
    ):
        rig.send(deliver=reject)
    assert len(rig.delivered) == 1


def test_a_bad_later_part_is_refused_and_the_update_goes_on():
    rig = Rig(packed=True, bucket_size_bytes=256)
    try:
        rig.send(deliver=rig.delivered.append)
        parts = rig.delivered[1:]
        assert len(parts) > 2
        rig.receive(rig.delivered[0])
        rig.receive(parts[0])
        bad = corrupt(parts[1], 0, segment=rig.session.session + "-999")
        with pytest.raises(WeightValidationError, match=r"refused, no byte moved.*does not exist"):
            rig.receive(bad)
        with pytest.raises(WeightValidationError, match=r"expects tensor"):
            rig.receive(parts[0])  # a duplicate of a part that landed
        for part in parts[1:]:  # the update in progress was not touched by either
            rig.receive(part)
        assert not rig.engine.update_in_progress
    finally:
        rig.close()


@pytest.mark.parametrize("torch_shared", [False, True])
def test_unpacked_send_refuses_tensors_outside_the_sessions_shared_memory(rig, torch_shared):
    plain = {s.name: torch.ones(s.shape, dtype=s.dtype) for s in SPECS}
    if torch_shared:  # torch's own shared memory is not exported: share_module covers that use
        plain = {name: t.share_memory_() for name, t in plain.items()}
    args = IPCTrainerSendWeightsArgs(rig.session, rig.deliver)
    with pytest.raises(WeightValidationError, match=r"'w' is not in this session's shared memory"):
        ipc_trainer_send_weights(plain.items(), args)
    assert rig.delivered == []


def test_packed_send_reuses_its_buffers_and_unlinks_them_on_close():
    rig = Rig(packed=True, bucket_size_bytes=256, num_buffers=2)
    try:
        plain = {s.name: torch.zeros(s.shape, dtype=s.dtype) for s in SPECS}
        for seed in range(3):
            fill_tensors(plain, seed)
            stats = ipc_trainer_send_weights(
                plain.items(), IPCTrainerSendWeightsArgs(rig.session, rig.deliver)
            )
            assert weight_checksums(rig.params) == weight_checksums(plain)
        assert stats.num_buckets > 2 and stats.direct_buckets == 0
        used = {
            h["segment"]
            for info in rig.delivered
            if info["ipc_handles"]
            for h in info["ipc_handles"]
            if h["nbytes"]
        }
        assert (
            len(used - {rig.session.segment_names()[0]}) == 2
        )  # two buffers, whatever the bucket count
    finally:
        rig.close()
    assert shm_names(rig.session.session) == []


def test_failed_packed_send_unlinks_its_buffers():
    rig = Rig(packed=True, bucket_size_bytes=256)
    shared = set(rig.session.segment_names())
    calls = []

    def fail_second_part(info):
        calls.append(info)
        if len(calls) == 3:
            raise RuntimeError("worker 0 died")
        rig.receive(info)

    plain = {s.name: torch.zeros(s.shape, dtype=s.dtype) for s in SPECS}
    try:
        with pytest.raises(
            WeightTransferError, match=r"worker 0 died.*buffers were unlinked"
        ) as raised:
            ipc_trainer_send_weights(
                plain.items(), IPCTrainerSendWeightsArgs(rig.session, fail_second_part)
            )
        assert raised.value.partially_applied
        assert set(shm_names(rig.session.session)) == shared
    finally:
        rig.close()


def test_delivery_timeout_is_reported():
    rig = Rig(timeout_s=0.2)
    release = threading.Event()
    try:
        with pytest.raises(
            WeightTransferTimeout, match=r"did not acknowledge within timeout_s=0.2 s"
        ):
            rig.send(deliver=lambda info: release.wait())
    finally:
        release.set()
        rig.close()


def test_handle_for_an_empty_tensor_needs_no_region():
    record = IPCHandle.for_tensor(
        TensorSpec("e", torch.float32, (0, 4)), 512, segment="weightsync-0123456789ab-0"
    )
    assert record.to_dict() == {"offset": 0, "nbytes": 0, "dtype": "float32", "shape": [0, 4]}
    assert IPCHandle.from_dict(record.to_dict(), where="r") == record


def test_engine_refuses_updates_before_init():
    engine = IPCWeightTransferEngine()
    with pytest.raises(WeightTransferError, match=r"call init_transfer_engine"):
        engine.receive_weights(
            {"names": [], "dtype_names": [], "shapes": [], "update_id": "u"}, print
        )
    with pytest.raises(WeightValidationError, match=r"session must look like"):
        engine.init_transfer_engine({"session": "/dev/shm/x"})


def test_a_failing_load_weights_is_partially_applied_and_drops_the_update(rig, data_info):
    def broken(pairs):
        raise RuntimeError("out of memory")

    with pytest.raises(
        WeightTransferError, match=r"load_weights failed: RuntimeError: out of memory"
    ) as raised:
        rig.engine.receive_weights(data_info, broken)
    assert raised.value.partially_applied
    assert rig.engine.is_initialized and not rig.engine.update_in_progress


def test_share_module_makes_parameters_exportable_in_place():
    session = ipc_trainer_init(packed=False)
    model = torch.nn.Linear(4, 3)
    weight = model.weight
    session.share_module(model)
    received = {name: torch.zeros_like(p) for name, p in model.named_parameters()}
    engine = IPCWeightTransferEngine(params=received)
    engine.init_transfer_engine(session.init_info)

    def load(pairs):
        for name, tensor in pairs:
            received[name].copy_(tensor)

    args = IPCTrainerSendWeightsArgs(
        session, lambda info: engine.receive_weights(json.loads(json.dumps(info)), load)
    )
    try:
        assert model.weight is weight  # the Parameter object is kept, only its memory moved
        for _ in range(2):  # an optimizer-like in-place step is seen by the next update
            stats = ipc_trainer_send_weights(model.named_parameters(), args)
            assert stats.direct_buckets == 1
            for name, param in model.named_parameters():
                assert torch.equal(received[name], param.detach())
            with torch.no_grad():
                model.weight.add_(1.0)
    finally:
        session.close()


def test_both_ends_of_the_protocol_are_one_module_and_the_naming_of_memory_another():
    import importlib
    import pkgutil

    import weightsync.transfer

    ipc = importlib.import_module("weightsync.transfer.ipc")
    ends = [ipc.IPCTrainerSession, ipc.ipc_trainer_send_weights, ipc.IPCWeightTransferEngine]
    assert {end.__module__ for end in ends} == {"weightsync.transfer.ipc"}
    memory = importlib.import_module("weightsync.transfer.memory")
    naming = [memory.IPCHandle, memory.SharedSegment, memory.RegionCache, memory.synchronize]
    assert {name.__module__ for name in naming} == {"weightsync.transfer.memory"}
    modules = {m.name for m in pkgutil.iter_modules(weightsync.transfer.__path__)}
    scattered = {"ipc_trainer", "_courier", "_shm", "_ipc_records", "_ipc_regions", "_cuda_ipc"}
    assert not modules & scattered
