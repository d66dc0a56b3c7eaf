import pytest
import torch

from process_rigs import allocate_tensors, fill_tensors
from weightsync.errors import WeightValidationError
from weightsync.transfer.base import _WIRE_DTYPES as WIRE_DTYPES
from weightsync.transfer.base import TensorSpec
from weightsync.transfer.buckets import (
    ALIGN_BYTES,
    _direct_region,
    flat_tensors,
    pack_bucket,
    plan_buckets,
    unpack_bucket,
)

SHAPES = {"0-d": (), "empty": (0, 3), "vector": (7,), "matrix": (5, 3)}


def as_bytes(tensor):
    return tensor.reshape(-1).view(torch.uint8)


def specs_of(tensors):
    return [TensorSpec.of(name, t) for name, t in tensors.items()]


@pytest.mark.parametrize("dtype_name", sorted(WIRE_DTYPES))
@pytest.mark.parametrize("shape_kind", sorted(SHAPES))
def test_round_trip_every_dtype_and_shape_kind(dtype_name, shape_kind):
    dtype = WIRE_DTYPES[dtype_name]
    tensors = allocate_tensors(
        [TensorSpec("x", dtype, SHAPES[shape_kind]), TensorSpec("y", dtype, (3,))], flat=False
    )
    fill_tensors(tensors, seed=1)
    (bucket,) = plan_buckets(specs_of(tensors), bucket_size_bytes=1 << 20)
    buffer = torch.empty(bucket.nbytes, dtype=torch.uint8)
    pack_bucket(bucket, list(tensors.values()), buffer)
    for (name, view), original in zip(unpack_bucket(bucket, buffer), tensors.values(), strict=True):
        assert view.dtype == original.dtype and view.shape == original.shape
        assert torch.equal(as_bytes(view), as_bytes(original)), name


def test_non_contiguous_sources_pack_by_value():
    source = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    transposed = source.t()
    (bucket,) = plan_buckets([TensorSpec.of("t", transposed)], 1 << 20)
    buffer = torch.empty(bucket.nbytes, dtype=torch.uint8)
    pack_bucket(bucket, [transposed], buffer)
    assert torch.equal(unpack_bucket(bucket, buffer)[0][1], transposed)


def test_bucket_boundaries_and_alignment():
    specs = [TensorSpec(f"w{i}", torch.float32, (10,)) for i in range(5)]  # 40 bytes each
    buckets = plan_buckets(specs, bucket_size_bytes=2 * ALIGN_BYTES)
    assert [len(b.slots) for b in buckets] == [2, 2, 1]
    assert [s.offset for s in buckets[0].slots] == [0, ALIGN_BYTES]
    assert buckets[0].nbytes == ALIGN_BYTES + 40
    # An exact fit stays in one bucket.
    exact = [
        TensorSpec("a", torch.uint8, (ALIGN_BYTES,)),
        TensorSpec("b", torch.uint8, (ALIGN_BYTES,)),
    ]
    assert len(plan_buckets(exact, 2 * ALIGN_BYTES)) == 1


def test_oversize_tensor_gets_its_own_bucket():
    specs = [
        TensorSpec("small", torch.float32, (4,)),
        TensorSpec("big", torch.float32, (1000,)),
        TensorSpec("tail", torch.float32, (4,)),
    ]
    buckets = plan_buckets(specs, bucket_size_bytes=1024)
    assert [[s.spec.name for s in b.slots] for b in buckets] == [["small"], ["big"], ["tail"]]
    assert buckets[1].nbytes == 4000


def test_empty_iterator_gives_empty_plan():
    assert plan_buckets([], 1024) == []


def test_plan_is_deterministic_and_covers_every_tensor_once():
    specs = [TensorSpec(f"w{i}", torch.bfloat16, (i * 37 % 101, 3)) for i in range(200)]
    first, second = plan_buckets(specs, 4096), plan_buckets(list(specs), 4096)
    assert first == second
    assert [s.spec for b in first for s in b.slots] == specs
    assert all(b.nbytes <= 4096 for b in first)


@pytest.mark.parametrize("bad", [0, -1, 1.5, None])
def test_bucket_size_must_be_positive_int(bad):
    with pytest.raises(WeightValidationError, match="bucket_size_bytes"):
        plan_buckets([], bad)


def test_direct_region_found_for_flat_layout_only():
    specs = [
        TensorSpec("a", torch.float32, (3,)),
        TensorSpec("b", torch.bfloat16, (2, 2)),
        TensorSpec("c", torch.int8, ()),
    ]
    (bucket,) = plan_buckets(specs, 1 << 20)
    _, flat = flat_tensors(specs)
    region = _direct_region(bucket, list(flat.values()))
    assert region is not None
    assert region.data.data_ptr() == flat["a"].data_ptr() and region.data.numel() == bucket.nbytes
    assert region.gaps == [(12, ALIGN_BYTES), (ALIGN_BYTES + 8, 2 * ALIGN_BYTES)]
    separate = allocate_tensors(specs, flat=False)
    assert _direct_region(bucket, list(separate.values())) is None
    # Same storage but in another order: offsets differ, so no region.
    assert (
        _direct_region(
            bucket, [flat["a"], flat["c"].new_zeros((2, 2), dtype=torch.bfloat16), flat["c"]]
        )
        is None
    )


def test_direct_region_gaps_are_restored():
    specs = [TensorSpec("a", torch.uint8, (10,)), TensorSpec("b", torch.uint8, (10,))]
    (bucket,) = plan_buckets(specs, 1 << 20)
    buffer, flat = flat_tensors(specs)
    buffer[10:ALIGN_BYTES] = 7  # bytes that belong to someone else
    region = _direct_region(bucket, list(flat.values()))
    saved = region.save_gaps()
    region.data.fill_(1)
    region.restore_gaps(saved)
    assert torch.all(buffer[10:ALIGN_BYTES] == 7) and torch.all(flat["b"] == 1)
