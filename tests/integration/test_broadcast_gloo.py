"""The gloo broadcast backend across real processes: a trainer and two receiver processes."""

import time

import pytest
import torch

from process_rigs import (
    ReceiverProcess,
    TrainerProcess,
    WorkerProcessError,
    allocate_tensors,
    fill_tensors,
)
from weightsync import weight_checksums
from weightsync.errors import WeightTransferError, WeightTransferTimeout, WeightValidationError
from weightsync.transfer.base import TensorSpec, WeightTransferUpdateInfo
from weightsync.transfer.nccl import (
    GlooWeightTransferEngine,
    NCCLTrainerSendWeightsArgs,
    NCCLWeightTransferEngine,
    trainer_init,
    trainer_send_weights,
)

TIMEOUT_S = 10.0
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


def start_receivers(**kwargs):
    receivers = [
        ReceiverProcess(backend="gloo", update_info=INFO, worker_index=i, timeout_s=60, **kwargs)
        for i in range(2)
    ]
    yield receivers
    for receiver in receivers:
        receiver.close()


@pytest.fixture(scope="module")
def receivers():
    yield from start_receivers()


@pytest.fixture(scope="module")
def flat_receivers():
    yield from start_receivers(flat=True)


def connect(receivers, **trainer_kwargs):
    """Forms a group of this test process (trainer) and the receivers."""
    kwargs = {
        "world_size": 1 + len(receivers),
        "backend": "gloo",
        "timeout_s": TIMEOUT_S,
        **trainer_kwargs,
    }
    group = trainer_init(**kwargs)
    for receiver in receivers:
        receiver.start("init", init_info=group.init_info)
    group.connect()
    for receiver in receivers:
        receiver.reply()
    return group


def exchange(group, receivers, tensors, update_info=INFO, receiver_info=None, pairs=None):
    """One update: returns the trainer's stats (or the exception it raised) and the receivers' replies."""
    for receiver in receivers:
        receiver.start("update", update_info=receiver_info or update_info)
    try:
        outcome = trainer_send_weights(
            pairs or tensors.items(), NCCLTrainerSendWeightsArgs(group, update_info)
        )
    except Exception as exc:
        outcome = exc
    return outcome, [receiver.reply(check=False) for receiver in receivers]


def assert_received(receivers, tensors):
    want = weight_checksums(tensors)
    for receiver in receivers:
        assert receiver.call("digests")["digests"] == want


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
def test_bitwise_equal_after_repeated_updates(receivers, packed):
    tensors = allocate_tensors(SPECS, flat=False)
    group = connect(receivers, packed=packed, bucket_size_bytes=4096, num_buffers=2)
    for seed in range(3):  # the same group carries update after update
        fill_tensors(tensors, seed)
        stats, replies = exchange(group, receivers, tensors)
        assert all(reply["ok"] for reply in replies), replies
        assert_received(receivers, tensors)
    assert stats.num_tensors == len(SPECS) and stats.num_bytes == sum(s.nbytes for s in SPECS)
    group.close()


def test_flat_layouts_send_and_receive_in_place(flat_receivers):
    tensors = allocate_tensors(SPECS, flat=True)
    fill_tensors(tensors, 11)
    group = connect(flat_receivers, bucket_size_bytes=4096, num_buffers=1)
    stats, replies = exchange(group, flat_receivers, tensors)
    assert stats.num_buckets > 1 and stats.direct_buckets == stats.num_buckets
    assert all(reply["stats"]["direct_buckets"] == stats.num_buckets for reply in replies)
    assert_received(flat_receivers, tensors)
    group.close()


def test_receiver_rejects_mismatched_metadata_before_bytes_move(receivers):
    tensors = allocate_tensors(SPECS, flat=False)
    fill_tensors(tensors, 5)
    group = connect(receivers)
    before = receivers[0].call("digests")["digests"]
    bad_specs = [
        TensorSpec("embed.weight", torch.bfloat16, (65, 32)),
        TensorSpec("nope", torch.float32, (1,)),
        *SPECS[1:3],
    ]
    bad = {s.name: torch.ones(s.shape, dtype=s.dtype) for s in bad_specs}
    outcome, replies = exchange(
        group, receivers, bad, update_info=WeightTransferUpdateInfo.from_specs(bad_specs).to_dict()
    )
    assert isinstance(outcome, WeightValidationError)
    trainer_message = str(outcome)
    assert "rank 1:" in trainer_message and "rank 2:" in trainer_message
    for message in (trainer_message, *(reply["message"] for reply in replies)):
        assert "'embed.weight': model has bfloat16[64, 32], update has bfloat16[65, 32]" in message
        assert "unknown name 'nope'" in message
    assert [reply["error_type"] for reply in replies] == ["WeightValidationError"] * 2
    assert receivers[0].call("digests")["digests"] == before  # nothing moved
    # The group is intact: the next good update goes through.
    _, replies = exchange(group, receivers, tensors)
    assert all(reply["ok"] for reply in replies), replies
    assert_received(receivers, tensors)
    group.close()


def test_receiver_given_other_metadata_than_trainer_is_refused(receivers):
    tensors = allocate_tensors(SPECS, flat=False)
    group = connect(receivers)
    subset = WeightTransferUpdateInfo.from_specs(
        SPECS[:3]
    ).to_dict()  # valid for the model, but not what is sent
    outcome, replies = exchange(group, receivers, tensors, receiver_info=subset)
    assert isinstance(outcome, WeightValidationError)
    assert "differs from what the trainer sends (10 tensors)" in str(outcome)
    assert all("send both sides the same update_info" in reply["message"] for reply in replies)
    group.close()


def test_trainer_divergence_fails_every_side_fast(receivers):
    tensors = allocate_tensors(SPECS, flat=False)
    group = connect(receivers, bucket_size_bytes=4096, timeout_s=60)
    pairs = list(tensors.items())
    pairs[6] = ("layer.0.mask", torch.zeros(34, dtype=torch.bool))  # announced as [33]
    started = time.monotonic()
    outcome, replies = exchange(group, receivers, tensors, pairs=pairs)
    assert time.monotonic() - started < 30  # far less than the 60 s timeout: nobody waited it out
    assert isinstance(outcome, WeightValidationError)
    assert "tensor 'layer.0.mask' is bool[34] but the update announced bool[33]" in str(outcome)
    for reply in replies:
        assert reply["error_type"] == "WeightTransferError"
        assert "rank 0 aborted" in reply["message"] and "layer.0.mask" in reply["message"]
    group.close()


def test_iterator_shorter_or_longer_than_announced(receivers):
    tensors = allocate_tensors(SPECS, flat=False)
    for pairs, message in [
        (
            list(tensors.items())[:-1],
            "the iterator ended after 9 tensors but the update announced more, starting with 'head.weight'",
        ),
        (
            [*tensors.items(), ("extra", torch.zeros(1))],
            "yields more tensors than the 10 announced, starting with 'extra'",
        ),
    ]:
        group = connect(receivers)
        outcome, replies = exchange(group, receivers, tensors, pairs=pairs)
        assert isinstance(outcome, WeightValidationError) and message in str(outcome)
        assert all(not reply["ok"] for reply in replies)
        group.close()


def test_receive_times_out_when_trainer_never_sends(receivers):
    group = connect(receivers, timeout_s=1.5)
    for receiver in receivers:
        receiver.start("update", update_info=INFO)
    replies = [receiver.reply(timeout_s=30, check=False) for receiver in receivers]
    for reply in replies:
        assert reply["error_type"] == "WeightTransferTimeout"
        assert "timed out after 1.5 s (timeout_s)" in reply["message"]
    group.close()


def test_killed_trainer_fails_receivers_then_they_recover(receivers):
    trainer = TrainerProcess(update_info=INFO, timeout_s=60)
    try:
        init_info = trainer.call(
            "init",
            world_size=3,
            backend="gloo",
            bucket_size_bytes=2048,
            num_buffers=1,
            timeout_s=30,
        )["init_info"]
        for receiver in receivers:
            receiver.start("init", init_info=init_info)
        trainer.call("connect")
        for receiver in receivers:
            receiver.reply()
        for receiver in receivers:
            receiver.start("update", update_info=INFO)
        trainer.start("send", seed=3, stall_at_tensor=8)  # buckets before tensor 8 are on the wire
        assert trainer.reply().get("stalled")
        started = time.monotonic()
        trainer.kill()
        replies = [receiver.reply(check=False) for receiver in receivers]
        assert time.monotonic() - started < 30  # well inside the 30 s timeout
        for reply in replies:
            assert reply["error_type"] == "WeightTransferError", reply
            assert reply["partially_applied"] is True
            assert "initialize a new one before the next update" in reply["message"]
    finally:
        trainer.close()
    # The receiver processes are still usable: a new trainer, a new group, a full update.
    tensors = allocate_tensors(SPECS, flat=False)
    fill_tensors(tensors, 4)
    group = connect(receivers)
    _, replies = exchange(group, receivers, tensors)
    assert all(reply["ok"] for reply in replies), replies
    assert_received(receivers, tensors)
    group.close()


def test_trainer_with_default_process_group_still_works(receivers):
    trainer = TrainerProcess(update_info=INFO, init_default_group=True, timeout_s=60)
    try:
        init_info = trainer.call("init", world_size=3, backend="gloo", timeout_s=TIMEOUT_S)[
            "init_info"
        ]
        for receiver in receivers:
            receiver.start("init", init_info=init_info)
        trainer.call("connect")
        for receiver in receivers:
            receiver.reply()
        for receiver in receivers:
            receiver.start("update", update_info=INFO)
        reply = trainer.call("send", seed=9)
        assert reply["default_group_size"] == 1  # the trainer's own world is untouched
        assert all(receiver.reply()["ok"] for receiver in receivers)
        want = trainer.call("digests")["digests"]
        assert all(receiver.call("digests")["digests"] == want for receiver in receivers)
    finally:
        trainer.close()


def test_rank_and_world_size_errors(receivers):
    with pytest.raises(WeightValidationError, match="world_size must be an int >= 2"):
        trainer_init(world_size=1, backend="gloo")
    group = trainer_init(world_size=2, backend="gloo", timeout_s=TIMEOUT_S)
    engine = GlooWeightTransferEngine(worker_index=1)
    with pytest.raises(
        WeightValidationError,
        match=r"rank_offset \(1\) \+ worker_index \(1\) = 2 is outside world_size 2",
    ):
        engine.init_transfer_engine(group.init_info)
    with pytest.raises(WeightValidationError, match="this engine speaks 'gloo'"):
        engine.init_transfer_engine({**group.init_info, "backend": "nccl"})
    tampered = {**group.init_info, "bucket_size_bytes": 123}
    with pytest.raises(
        WeightValidationError, match="bucket_size_bytes: worker 123 vs trainer 1073741824"
    ):
        GlooWeightTransferEngine(worker_index=0).init_transfer_engine(tampered)
    group.close()
    # Two workers claiming the same rank: the second is refused by name, the first joins.
    group = trainer_init(world_size=2, backend="gloo", timeout_s=TIMEOUT_S)
    receivers[0].start("init", init_info=group.init_info)
    twin = ReceiverProcess(backend="gloo", update_info=INFO, worker_index=0, timeout_s=60)
    try:
        group.connect()
        receivers[0].reply()
        with pytest.raises(
            WorkerProcessError, match="rank 1 was claimed by another process already"
        ):
            twin.call("init", init_info=group.init_info)
    finally:
        twin.close()
        group.close()


def test_receive_before_init_is_a_clear_error():
    engine = GlooWeightTransferEngine()
    with pytest.raises(WeightTransferError, match="call init_transfer_engine"):
        engine.receive_weights(INFO, lambda pairs: None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_nccl_without_cuda_fails_clearly():
    with pytest.raises(WeightValidationError, match="backend 'nccl' needs CUDA"):
        NCCLWeightTransferEngine()
    with pytest.raises(WeightValidationError, match="use backend 'gloo' for CPU tensors"):
        trainer_init(world_size=2, backend="nccl")


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
def test_non_contiguous_sources_arrive_by_value(receivers, packed):
    tensors = allocate_tensors(SPECS, flat=False)
    fill_tensors(tensors, 21)
    transposed = tensors["embed.weight"].t().contiguous().t()  # same values, column-major
    assert not transposed.is_contiguous()
    pairs = [(n, transposed if n == "embed.weight" else t) for n, t in tensors.items()]
    group = connect(receivers, packed=packed)
    _, replies = exchange(group, receivers, tensors, pairs=pairs)
    assert all(reply["ok"] for reply in replies), replies
    assert_received(receivers, tensors)
    group.close()


def test_send_times_out_when_workers_never_receive(receivers):
    group = connect(receivers, timeout_s=1.5)
    tensors = allocate_tensors(SPECS, flat=False)
    started = time.monotonic()
    with pytest.raises(WeightTransferTimeout, match=r"timed out after 1.5 s \(timeout_s\)"):
        trainer_send_weights(tensors.items(), NCCLTrainerSendWeightsArgs(group, INFO))
    assert time.monotonic() - started < 20
    with pytest.raises(
        WeightTransferError, match="closed after a failure: call trainer_init again"
    ):
        trainer_send_weights(tensors.items(), NCCLTrainerSendWeightsArgs(group, INFO))
