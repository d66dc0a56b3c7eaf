"""The shared bucket pipeline: buffer reuse, the window's order and depth, announced buckets."""

import pytest
import torch

from weightsync.errors import WeightValidationError
from weightsync.transfer.base import TensorSpec
from weightsync.transfer.buckets import _announced_buckets as announced_buckets
from weightsync.transfer.buckets import _AnnouncedTensors as AnnouncedTensors
from weightsync.transfer.buckets import _BufferPool as BufferPool
from weightsync.transfer.buckets import _byte_buffers as byte_buffers
from weightsync.transfer.buckets import _Window as Window
from weightsync.transfer.buckets import plan_buckets


def test_buffers_are_reused_and_grown_only_when_too_small():
    made, released = [], []

    def allocate(nbytes):
        made.append(nbytes)
        return bytearray(nbytes)

    pool = BufferPool(2, allocate, len, released.append)
    first, buffer = pool.take(10)
    pool.give_back(first)
    again, same = pool.take(8)
    assert (again, same) == (first, buffer) and made == [10]
    pool.give_back(again)
    _, bigger = pool.take(20)
    assert made == [10, 20] and released == [buffer] and len(bigger) == 20
    pool.clear()
    assert released == [buffer, bigger] and sorted(pool.free) == [0, 1]


def test_byte_buffers_are_uint8_on_their_device():
    index, buffer = byte_buffers(1, torch.device("cpu")).take(5)
    assert index == 0 and buffer.dtype == torch.uint8 and buffer.numel() == 5


def test_the_window_lands_oldest_first_and_never_holds_more_than_its_depth():
    landed = []
    window = Window(2, landed.append)
    for item in range(5):
        window.make_room()
        window.push(item)
        assert len(window) <= 2
    assert landed == [0, 1, 2]
    window.drain()
    assert landed == [0, 1, 2, 3, 4] and len(window) == 0


SPECS = [TensorSpec(f"w{i}", torch.float32, (4,)) for i in range(3)]


def test_announced_buckets_yield_first_indices_and_tensors():
    tensors = [(s.name, torch.full(s.shape, float(i))) for i, s in enumerate(SPECS)]
    buckets = plan_buckets(SPECS, bucket_size_bytes=300)
    got = list(announced_buckets(buckets, AnnouncedTensors(iter(tensors), None), len(SPECS)))
    assert [(first, len(bucket.slots)) for first, bucket, _ in got] == [(0, 2), (2, 1)]
    assert got[1][2][0].tolist() == [2.0] * 4


def test_announced_buckets_refuse_an_extra_tensor_after_the_last_bucket():
    tensors = [(s.name, torch.zeros(s.shape)) for s in SPECS] + [("extra", torch.zeros(1))]
    buckets = plan_buckets(SPECS, bucket_size_bytes=300)
    with pytest.raises(WeightValidationError, match="starting with 'extra'"):
        list(announced_buckets(buckets, AnnouncedTensors(iter(tensors), None), len(SPECS)))
    with pytest.raises(WeightValidationError, match="more tensors than the 0 announced"):
        list(announced_buckets([], AnnouncedTensors(iter(tensors), None), 0))
