"""Property tests: whatever a peer sends, parsing gives something consistent or a weightsync error.

Update infos and handle records cross process boundaries; the bucket plan is what both ends of a
transfer must derive alike. No input may end in any exception but a `WeightSyncError`.
"""

from __future__ import annotations

import json
import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightsync.errors import WeightSyncError
from weightsync.transfer.base import _WIRE_DTYPES as WIRE_DTYPES
from weightsync.transfer.base import TensorSpec, WeightTransferUpdateInfo
from weightsync.transfer.base import _parse_info as parse_info
from weightsync.transfer.buckets import ALIGN_BYTES, plan_buckets
from weightsync.transfer.ipc import IPCWeightTransferUpdateInfo
from weightsync.transfer.memory import CUDAStorageHandle, IPCHandle

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Any JSON value: what a hostile or broken peer can put on the wire.
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True)
    | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
dtype_names = st.sampled_from(sorted(WIRE_DTYPES)) | st.text(max_size=8)
dims = st.integers(0, 6) | st.integers(-3, 2**40) | st.booleans() | st.floats()
shapes = st.lists(dims, max_size=4) | json_values
# Mostly well-formed metadata with mutations, so that the checks past the first are reached too.
info_dicts = st.fixed_dictionaries(
    {
        "names": st.lists(st.text(max_size=6), max_size=5) | json_values,
        "dtype_names": st.lists(dtype_names, max_size=5) | json_values,
        "shapes": st.lists(shapes, max_size=5) | json_values,
    },
    optional={"weight_version": json_values, "checksums": json_values, "bogus": json_values},
)


def _check_specs(info: WeightTransferUpdateInfo) -> None:
    specs = info.specs()
    assert [s.name for s in specs] == info.names
    assert len({s.name for s in specs}) == len(specs)
    for spec in specs:
        assert spec.nbytes == math.prod(spec.shape) * spec.dtype.itemsize >= 0
    assert json.loads(json.dumps(info.to_dict())) == info.to_dict()


@SETTINGS
@given(data=info_dicts | json_values)
def test_update_info_parses_consistently_or_raises_a_weightsync_error(data):
    try:
        info = parse_info(WeightTransferUpdateInfo, data, what="update_info")
    except WeightSyncError:
        return
    _check_specs(info)
    assert parse_info(WeightTransferUpdateInfo, info.to_dict(), what="update_info") == info


records = st.fixed_dictionaries(
    {
        "offset": st.integers(-4, 2**20) | json_values,
        "nbytes": st.integers(-4, 2**20) | json_values,
        "dtype": dtype_names | json_values,
        "shape": shapes,
    },
    optional={
        "segment": st.just("weightsync-0123456789ab-0") | json_values,
        "cuda": json_values,
        "extra": json_values,
    },
)


@SETTINGS
@given(record=records | json_values)
def test_handle_record_parses_consistently_or_raises_a_weightsync_error(record):
    try:
        handle = IPCHandle.from_dict(record, where="ipc_handles[0]")
    except WeightSyncError:
        return
    dtype = WIRE_DTYPES[handle.dtype]
    assert handle.nbytes == math.prod(handle.shape) * dtype.itemsize
    assert handle.offset >= 0 and handle.offset % dtype.itemsize == 0
    assert handle.segment is None or handle.cuda is None
    assert IPCHandle.from_dict(handle.to_dict(), where="again") == handle


cuda_records = st.fixed_dictionaries(
    {
        key: json_values | st.integers(0, 2**40) | st.just("AAAA")
        for key in CUDAStorageHandle.__dataclass_fields__
    }
)


@SETTINGS
@given(record=cuda_records | json_values)
def test_cuda_handle_parses_consistently_or_raises_a_weightsync_error(record):
    try:
        handle = CUDAStorageHandle.from_dict(record, where="ipc_handles[0]")
    except WeightSyncError:
        return
    for key in ("storage_nbytes", "storage_offset", "ref_counter_offset"):
        value = getattr(handle, key)
        assert isinstance(value, int) and not isinstance(value, bool) and value >= 0
    assert CUDAStorageHandle.from_dict(handle.to_dict(), where="again") == handle


@SETTINGS
@given(
    data=info_dicts,
    handles=st.none() | st.lists(records, max_size=5) | json_values,
    update_id=st.text(max_size=6) | json_values,
    first_index=st.integers(-2, 6) | json_values,
)
def test_ipc_delivery_parses_consistently_or_raises_a_weightsync_error(
    data, handles, update_id, first_index
):
    message = {**data, "ipc_handles": handles, "update_id": update_id, "first_index": first_index}
    try:
        info = parse_info(IPCWeightTransferUpdateInfo, message, what="update_info")
    except WeightSyncError:
        return
    _check_specs(info)
    assert len(info.handles()) == (0 if info.is_announcement else len(info.names))
    for handle, spec in zip(info.handles(), info.specs(), strict=False):
        assert handle.nbytes == spec.nbytes and handle.shape == spec.shape


spec_lists = st.lists(
    st.builds(
        TensorSpec,
        name=st.just("t"),
        dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int8, torch.float64]),
        shape=st.lists(st.integers(0, 40), max_size=3).map(tuple),
    ),
    max_size=12,
).map(lambda specs: [TensorSpec(f"t{i}", s.dtype, s.shape) for i, s in enumerate(specs)])


@SETTINGS
@given(specs=spec_lists, bucket_size=st.integers(-2, 4096) | json_values)
def test_the_bucket_plan_places_every_tensor_once_in_order_inside_its_bucket(specs, bucket_size):
    try:
        buckets = plan_buckets(specs, bucket_size)
    except WeightSyncError:
        is_int = isinstance(bucket_size, int) and not isinstance(bucket_size, bool)
        assert not is_int or bucket_size < 1  # refused only what is not a size
        return
    placed = [slot.spec for bucket in buckets for slot in bucket.slots]
    assert placed == specs
    for bucket in buckets:
        assert bucket.slots and bucket.nbytes == bucket.slots[-1].end
        for before, after in zip(bucket.slots, bucket.slots[1:], strict=False):
            assert after.offset >= before.end  # no overlap
        assert all(slot.offset % ALIGN_BYTES == 0 for slot in bucket.slots)
        # Full means the next tensor did not fit; only a lone tensor may exceed the size.
        assert bucket.nbytes <= bucket_size or len(bucket.slots) == 1
    assert plan_buckets(specs, bucket_size) == buckets  # both ends derive the same plan
