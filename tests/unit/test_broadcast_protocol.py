"""The broadcast protocol's steps, run on one rank against a scripted stand-in for its peers."""

import pytest
import torch

from weightsync.errors import WeightTransferError, WeightTransferTimeout, WeightValidationError
from weightsync.transfer._broadcast import (
    abort,
    handshake,
    metadata_digest,
    peer_reasons,
    plan,
    transfer_failed,
)
from weightsync.transfer.base import TensorSpec
from weightsync.transfer.wire import WireParams

SPECS = [
    TensorSpec("a", torch.float32, (3,)),
    TensorSpec("b", torch.int8, (300,)),
    TensorSpec("c", torch.float16, ()),
]


class _Done:
    def wait(self) -> None:
        pass


class ScriptedGroup:
    """One rank of a group whose peers are scripted: what the trainer broadcasts, who rejects."""

    def __init__(self, rank, world_size=3, header=None, peer_flags=None, store=None):
        self.rank, self.world_size = rank, world_size
        self.device = torch.device("cpu")
        self._header = header
        self._peer_flags = peer_flags or {}
        self.store = dict(store or {})
        self.closed = False

    def broadcast(self, tensor, what):
        if self.rank != 0 and self._header is not None:
            tensor.copy_(torch.tensor(self._header))
        return _Done()

    def all_reduce(self, tensor):
        for rank, flag in self._peer_flags.items():
            tensor[rank] += flag

    def set(self, key, value):
        self.store[key] = value

    def get(self, key):
        return self.store[key]

    def try_get(self, key):
        return self.store.get(key)

    def close(self):
        self.closed = True


def test_plan_packs_or_gives_each_tensor_a_bucket():
    packed = plan(SPECS, WireParams(bucket_size_bytes=600))
    assert [[s.spec.name for s in b.slots] for b in packed] == [["a", "b"], ["c"]]
    unpacked = plan(SPECS, WireParams(packed=False))
    assert [(len(b.slots), b.nbytes) for b in unpacked] == [(1, 12), (1, 300), (1, 2)]


def test_metadata_digest_is_stable_and_sees_every_field():
    digest = metadata_digest(SPECS)
    assert digest == metadata_digest(list(SPECS)) and 0 <= digest < 2**63
    changed = [TensorSpec("a", torch.float32, (4,)), *SPECS[1:]]
    renamed = [TensorSpec("z", torch.float32, (3,)), *SPECS[1:]]
    retyped = [TensorSpec("a", torch.float64, (3,)), *SPECS[1:]]
    assert len({digest, *map(metadata_digest, (changed, renamed, retyped))}) == 4


def test_handshake_passes_when_every_rank_agrees():
    header = [1, len(SPECS), metadata_digest(SPECS)]
    handshake(ScriptedGroup(rank=1, header=header), 1, SPECS, None)
    handshake(ScriptedGroup(rank=0), 1, SPECS, None)


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (
            [2, 3, 0],
            "update sequence mismatch: the trainer sends update #2, this worker expects #1",
        ),
        ([1, 2, 0], r"the update info this worker got \(3 tensors\) differs from what the trainer"),
    ],
)
def test_a_worker_rejects_what_differs_from_the_trainers_header(header, message):
    group = ScriptedGroup(rank=1, header=header)
    with pytest.raises(WeightValidationError, match=message):
        handshake(group, 1, SPECS, None)
    assert "update sequence" in group.store["reject/1/1"] or "differs" in group.store["reject/1/1"]


def test_a_rejection_on_another_rank_stops_this_one_with_its_reason():
    group = ScriptedGroup(rank=0, peer_flags={2: 1}, store={"reject/1/2": "unknown name 'x'"})
    with pytest.raises(WeightValidationError, match=r"before any byte moved by rank 2: unknown"):
        handshake(group, 1, SPECS, None)


def test_a_trainer_that_rejects_its_own_update_says_why_to_everyone():
    group = ScriptedGroup(rank=0)
    problem = WeightValidationError("the iterator is empty")
    with pytest.raises(WeightValidationError, match="the iterator is empty"):
        handshake(group, 1, None, problem)
    assert group.store["reject/1/0"] == "the iterator is empty"


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
        def set(self, key, value):
            raise WeightTransferError("the store is gone")

    group = StorelessGroup(rank=2)
    abort(group, RuntimeError("x"))
    assert group.closed and peer_reasons(group) == ""
