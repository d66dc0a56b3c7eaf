"""Trainer-rooted broadcast, trainer side: rank 0 of an `nccl` or `gloo` weight-transfer group.

[`trainer_init`][weightsync.transfer.nccl_trainer.trainer_init] creates the group and decides the
wire parameters; [`trainer_send_weights`][weightsync.transfer.nccl_trainer.trainer_send_weights]
sends one update to every worker's
[`NCCLWeightTransferEngine`][weightsync.transfer.nccl.NCCLWeightTransferEngine] (or
[`GlooWeightTransferEngine`][weightsync.transfer.nccl.GlooWeightTransferEngine]).
"""

from __future__ import annotations

import logging
import time
import traceback
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from weightsync.errors import WeightTransferError, WeightTransferTimeout, WeightValidationError
from weightsync.transfer import _broadcast as broadcast
from weightsync.transfer._broadcast import InFlight
from weightsync.transfer._group import INIT_ERRORS, BroadcastGroup
from weightsync.transfer._handshake import open_update
from weightsync.transfer._identity import send_identity
from weightsync.transfer.base import (
    TensorSpec,
    TransferStats,
    WeightTransferUpdateInfo,
    WireParams,
    _WireKeywords,
)
from weightsync.transfer.base import _parse_info as parse_info
from weightsync.transfer.buckets import Bucket, _direct_region, pack_bucket
from weightsync.transfer.buckets import _announced_buckets as announced_buckets
from weightsync.transfer.buckets import _AnnouncedTensors as AnnouncedTensors
from weightsync.transfer.buckets import _BufferPool as BufferPool
from weightsync.transfer.buckets import _byte_buffers as byte_buffers
from weightsync.transfer.buckets import _Window as Window
from weightsync.transfer.nccl import NCCLWeightTransferInitInfo

if TYPE_CHECKING:  # typing.Unpack for **kwargs is Python 3.12+
    from typing_extensions import Unpack

__all__ = [
    "NCCLTrainerSendWeightsArgs",
    "TrainerGroup",
    "trainer_init",
    "trainer_send_weights",
]

logger = logging.getLogger(__name__)

_ERRORS_SHOWN = 5
_REPORT_READ_S = 1.0  # the reasons are in this process's own store: a read is instant


class TrainerGroup:
    """The trainer's end of a broadcast group, from [`trainer_init`][weightsync.transfer.nccl_trainer.trainer_init].

    The store is bound at creation; the group itself forms on
    [`connect`][weightsync.transfer.nccl_trainer.TrainerGroup.connect] (or the first send), once every
    worker was given [`init_info`][weightsync.transfer.nccl_trainer.TrainerGroup.init_info].
    """

    def __init__(self, group: BroadcastGroup, info: NCCLWeightTransferInitInfo) -> None:
        self._group = group
        self._info = info
        self._pool = byte_buffers(info.num_buffers, group.device)
        self._seq = 0
        self._closed = False

    @property
    def init_info(self) -> dict[str, Any]:
        """The JSON-safe init info every worker passes to `init_transfer_engine`."""
        return dict(vars(self._info))

    @property
    def world_size(self) -> int:
        """1 + the number of workers."""
        return self._info.world_size

    def connect(self, *, joining: Sequence[Future[Any]] = ()) -> None:
        """Blocks until every worker joined, `timeout_s` at most in all (idempotent).

        Args:
            joining: The workers' join calls, when this process made them (on threads, as
                `BroadcastWeightSender` does): one that fails ends the wait at once, with its
                error (a server that refused the join, or that nothing listens for).

        Raises:
            WeightTransferTimeout: Some worker did not join within `timeout_s`; the message
                includes the errors workers reported while joining.
            WeightTransferError: The group was closed after a failure.
            Exception: A join call of `joining` failed; its error.
        """
        if self._closed:
            raise WeightTransferError(
                "this trainer group was closed after a failure: call trainer_init again"
            )
        if self._group.is_connected:
            return
        # One timeout_s for the whole call: waiting for the workers, then the rendezvous.
        deadline = time.monotonic() + self._group.timeout_s
        try:
            if joining:
                self._await_workers(joining, deadline)
            self._group.connect(timeout_s=deadline - time.monotonic())
        except WeightTransferError as exc:
            # One read of what the workers reported, however many they are.
            errors = [str(e) for e in self._group.read_list(INIT_ERRORS, _REPORT_READ_S)]
            if errors:
                shown = "; ".join(errors[:_ERRORS_SHOWN])
                more = (
                    f" (and {len(errors) - _ERRORS_SHOWN} more)"
                    if len(errors) > _ERRORS_SHOWN
                    else ""
                )
                raise type(exc)(f"{exc}; workers reported: {shown}{more}") from exc
            raise

    def _await_workers(self, joining: Sequence[Future[Any]], deadline: float) -> None:
        """Waits until every worker claimed its rank in the store, or one of `joining` failed.

        Forming the group blocks, uninterruptibly, until every rank is in or `timeout_s` passed:
        it starts only once every worker is at the rendezvous, so that a worker whose join
        failed before it got there fails this call at once rather than at the timeout.
        """
        keys = [f"rank/{rank}" for rank in range(1, self.world_size)]
        while not self._group.has(keys):
            for call in joining:
                if call.done() and (error := call.exception()) is not None:
                    raise error
            if time.monotonic() > deadline:  # the same bound as the group's: not twice it
                missing = [k for k in keys if not self._group.has([k])]
                raise WeightTransferTimeout(
                    f"forming the group timed out after {self._group.timeout_s:g} s (timeout_s): "
                    f"{', '.join(missing)} never joined; those workers are stuck or unreachable"
                )
            wait(joining, timeout=0.02, return_when=FIRST_EXCEPTION)  # or a store check again

    def close(self) -> None:
        """Closes the group and its store; workers blocked on it fail at once. Safe to call twice.

        The store's port is free again when this returns.
        """
        self._closed = True
        self._group.close(release_store=True)

    def __enter__(self) -> TrainerGroup:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def trainer_init(
    *,
    world_size: int,
    backend: str = "nccl",
    master_address: str = "127.0.0.1",
    master_port: int = 0,
    wire: WireParams | None = None,
    **wire_fields: Unpack[_WireKeywords],
) -> TrainerGroup:
    """Creates the trainer's end (rank 0) of a weight-transfer group and decides the wire parameters.

    Binds the group's store and returns at once; pass `group.init_info` to every worker's
    `init_transfer_engine`, then send. It never touches torch.distributed's default group.

    Args:
        world_size: 1 (this trainer) + the number of workers.
        backend: `"nccl"` for CUDA tensors, `"gloo"` for CPU tensors.
        master_address: Address workers reach this process at (loopback by default).
        master_port: Port for the store; 0 picks a free one.
        wire: The wire parameters ([`WireParams`][weightsync.transfer.base.WireParams]:
            packed or not, bucket size, buffers, timeout); the defaults when None.
        **wire_fields: The same, as keywords (`bucket_size_bytes=256 << 20`), instead of `wire`.

    Raises:
        WeightValidationError: A bad argument, `nccl` without CUDA, or a `world_size` larger
            than this process's open-file limit allows (every rank keeps up to two connections
            per other rank); the message gives the limit.

    >>> group = trainer_init(world_size=2, backend="gloo")
    >>> sorted(group.init_info)[:3]
    ['backend', 'bucket_size_bytes', 'master_address']
    >>> group.close()
    """
    params = WireParams.build(wire, **wire_fields)
    group = BroadcastGroup(
        backend=backend,
        master_address=master_address,
        master_port=master_port,
        rank=0,
        world_size=world_size,
        timeout_s=params.timeout_s,
    )
    info = NCCLWeightTransferInitInfo.create(
        master_address=master_address,
        master_port=group.port,
        world_size=world_size,
        backend=backend,
        wire=params,
    )
    group.set("wire", info.wire_params())
    group.claim_rank(uuid.uuid4().hex)  # the trainer's store is new: rank 0 is its own
    return TrainerGroup(group, info)


@dataclass
class NCCLTrainerSendWeightsArgs:
    """Arguments of [`trainer_send_weights`][weightsync.transfer.nccl_trainer.trainer_send_weights].

    Attributes:
        group: The trainer's group from `trainer_init`.
        update_info: The update info the workers were given (a dict or the dataclass); every
            tensor the iterator yields is checked against it, in order.
        post_iter_func: Optional map from each yielded `(name, tensor)` pair to the tensor to send
            (e.g. to gather a sharded parameter); by default the pair's tensor.
        receiving: The workers' calls that hand them `update_info` (their `update_weights`),
            in worker order, when this process made them on threads: one that fails before
            the worker answered the handshake is that worker's refusal, at once (a server that
            refused the request itself, or that nothing listens for). Optional: a worker's own
            refusal reaches the trainer through the group's store either way.
    """

    group: TrainerGroup
    update_info: Mapping[str, Any] | WeightTransferUpdateInfo
    post_iter_func: Callable[[tuple[str, torch.Tensor]], torch.Tensor] | None = None
    receiving: Sequence[Future[Any]] = ()


def _send_failure(
    group: BroadcastGroup, exc: Exception, *, partially_applied: bool
) -> WeightTransferError | WeightValidationError:
    """The weightsync error a failed send raises (a validation error stays one)."""
    error = broadcast.transfer_failed(group, exc, partially_applied=partially_applied)
    return WeightValidationError(str(error)) if isinstance(exc, WeightValidationError) else error


def trainer_send_weights(
    iterator: Iterable[tuple[str, torch.Tensor]], trainer_args: NCCLTrainerSendWeightsArgs
) -> TransferStats:
    """Broadcasts one update to every worker of the group.

    The workers must be inside `receive_weights` with the same update info. Packed mode packs
    bucket k+1 while bucket k is on the wire; a bucket whose tensors already sit in one storage at
    the plan's offsets (see [`flatten_module`][weightsync.transfer.buckets.flatten_module]) is sent
    from that memory without a copy.

    Args:
        iterator: `(name, tensor)` pairs in the announced order, e.g. `model.named_parameters()`.
        trainer_args: The group and the announced update info.

    Returns:
        What was sent and how fast.

    Raises:
        WeightValidationError: A worker rejected the update (nothing moved), or a yielded tensor
            differs from what was announced (the group is then closed and the workers fail too).
        WeightTransferError: The transfer failed; the group is closed.
    """
    trainer = trainer_args.group
    trainer.connect()
    group, info = trainer._group, trainer._info
    start = time.perf_counter()
    specs = _handshake(trainer, trainer_args.update_info, trainer_args.receiving)
    buckets = broadcast.plan(specs, info.wire)
    tensors = AnnouncedTensors(iter(iterator), trainer_args.post_iter_func)
    stats = TransferStats(
        num_tensors=len(specs), num_bytes=sum(s.nbytes for s in specs), num_buckets=len(buckets)
    )
    pool = trainer._pool
    pool.reset()

    def land(item: InFlight) -> None:
        assert item.work is not None
        item.work.wait()
        if item.buffer_index is not None:
            pool.give_back(item.buffer_index)

    window: Window[InFlight] = Window(info.num_buffers, land)
    sent = 0  # tensors taken from the iterator: after the first, workers may hold new bytes
    try:
        for first, bucket, bucket_tensors in announced_buckets(buckets, tensors, len(specs)):
            sent = first + len(bucket.slots)
            if bucket.nbytes == 0:
                continue
            window.make_room()
            window.push(_post_send(group, pool, bucket, bucket_tensors, stats))
        window.drain()
    except Exception as exc:
        window.clear()  # in-flight work pins the group's connections open
        # So do the finished frames of the failure's traceback (a pending wait holds its work):
        # drop their locals, so that a caller keeping the error does not keep the sockets.
        traceback.clear_frames(exc.__traceback__)
        trainer._closed = True
        # Raised without binding it to a local: a local would hold the exception in this frame,
        # which its traceback holds, a cycle that keeps the group's sockets until a full collection.
        raise _send_failure(group, exc, partially_applied=sent > 0) from exc
    stats.seconds = time.perf_counter() - start
    logger.info(
        "sent %d tensors, %.1f MB to %d workers in %.3f s (%.2f GB/s, %d of %d buckets in place)",
        stats.num_tensors,
        stats.num_bytes / 1e6,
        info.world_size - 1,
        stats.seconds,
        stats.gbps,
        stats.direct_buckets,
        stats.num_buckets,
    )
    return stats


def _handshake(
    trainer: TrainerGroup,
    update_info: Mapping[str, Any] | WeightTransferUpdateInfo,
    receiving: Sequence[Future[Any]],
) -> list[TensorSpec]:
    """Announces the update to every worker; returns its specs once all of them accepted it."""
    specs: list[TensorSpec] | None = None
    problem: WeightValidationError | None = None
    try:
        specs = parse_info(WeightTransferUpdateInfo, update_info, what="update_info").specs()
    except WeightValidationError as exc:
        problem = exc  # told to the workers in the handshake, then raised
    trainer._seq += 1
    try:
        open_update(
            trainer._group,
            trainer._seq,
            send_identity(update_info),
            specs,
            problem,
            receiving=receiving,
            rank_offset=trainer._info.rank_offset,
        )
    except WeightValidationError:
        raise
    except WeightTransferError as exc:
        trainer._closed = True
        raise broadcast.transfer_failed(trainer._group, exc, partially_applied=False) from exc
    assert specs is not None
    return specs


def _post_send(
    group: BroadcastGroup,
    pool: BufferPool[torch.Tensor],
    bucket: Bucket,
    tensors: list[torch.Tensor],
    stats: TransferStats,
) -> InFlight:
    what = f"sending bucket of {len(bucket.slots)} tensors from {bucket.slots[0].spec.name!r}"
    region = _direct_region(bucket, tensors) if tensors[0].device == group.device else None
    if region is not None:
        stats.direct_buckets += 1
        return InFlight(group.broadcast(region.data, what), bucket, region.data, keepalive=tensors)
    index, buffer = pool.take(bucket.nbytes)
    buffer = buffer[: bucket.nbytes]
    with torch.no_grad():  # parameters that require grad are copied as plain bytes
        data = pack_bucket(bucket, tensors, buffer)
    return InFlight(group.broadcast(data, what), bucket, data, index)
