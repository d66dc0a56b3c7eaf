"""The broadcast protocol's steps, run on one rank against a scripted stand-in for its peers.

The handshake that opens every update has its own tests (test_handshake.py)."""

import torch

from weightsync.errors import WeightTransferError, WeightTransferTimeout
from weightsync.transfer.base import TensorSpec, WireParams
from weightsync.transfer.nccl import _abort as abort
from weightsync.transfer.nccl import _peer_reasons as peer_reasons
from weightsync.transfer.nccl import _plan as plan
from weightsync.transfer.nccl import _transfer_failed as transfer_failed

SPECS = [
    TensorSpec("a", torch.float32, (3,)),
    TensorSpec("b", torch.int8, (300,)),
    TensorSpec("c", torch.float16, ()),
]


class ScriptedGroup:
    """One rank of a group whose peers are scripted through what the store holds."""

    def __init__(self, rank, world_size=3, store=None):
        self.rank, self.world_size, self.timeout_s = rank, world_size, 5.0
        self.store = dict(store or {})
        self.closed = False

    def set(self, key, value, limit_s=None):
        self.store[key] = value

    def get(self, key):
        return self.store[key]

    def try_get(self, key, limit_s=None):
        return self.store.get(key)

    def close(self):
        self.closed = True


def test_plan_packs_or_gives_each_tensor_a_bucket():
    packed = plan(SPECS, WireParams(bucket_size_bytes=600))
    assert [[s.spec.name for s in b.slots] for b in packed] == [["a", "b"], ["c"]]
    unpacked = plan(SPECS, WireParams(packed=False))
    assert [(len(b.slots), b.nbytes) for b in unpacked] == [(1, 12), (1, 300), (1, 2)]


def test_transfer_failed_publishes_closes_and_keeps_the_error_class():
    group = ScriptedGroup(rank=1, store={"abort/0": "WeightTransferError: trainer gone"})
    error = transfer_failed(
        group, WeightTransferTimeout("bucket 3 timed out"), partially_applied=True
    )
    assert group.closed
    assert group.store["abort/1"] == "WeightTransferTimeout: bucket 3 timed out"
    assert isinstance(error, WeightTransferTimeout) and error.partially_applied
    assert "on the worker rank 1: bucket 3 timed out (rank 0 aborted: " in str(error)
    plain = transfer_failed(ScriptedGroup(rank=0), RuntimeError("boom"), partially_applied=False)
    assert type(plain) is WeightTransferError and "on the trainer: boom" in str(plain)


def test_abort_closes_even_when_the_store_is_gone():
    class StorelessGroup(ScriptedGroup):
        def set(self, key, value, limit_s=None):
            raise WeightTransferError("the store is gone")

    group = StorelessGroup(rank=2)
    abort(group, RuntimeError("x"))
    assert group.closed and peer_reasons(group) == ""
