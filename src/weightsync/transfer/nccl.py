"""Trainer-rooted broadcast transfer: backend `nccl` (CUDA tensors) and `gloo` (CPU tensors).

Both backends speak the protocol of [`weightsync.transfer.broadcast`][weightsync.transfer.broadcast]
over a group of their own (rank 0 the trainer, workers from `rank_offset`); only the communicator
differs. The trainer side is [`trainer_init`][weightsync.transfer.nccl.trainer_init] and
[`trainer_send_weights`][weightsync.transfer.nccl.trainer_send_weights]; the worker side is
[`NCCLWeightTransferEngine`][weightsync.transfer.nccl.NCCLWeightTransferEngine] (or
[`GlooWeightTransferEngine`][weightsync.transfer.nccl.GlooWeightTransferEngine]).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from weightsync.errors import WeightTransferError, WeightValidationError
from weightsync.transfer import broadcast
from weightsync.transfer.base import (
    AnnouncedTensors,
    LoadWeightsFn,
    TensorSpec,
    TransferStats,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
    parse_info,
)
from weightsync.transfer.broadcast import BufferPool, InFlight, NCCLWeightTransferInitInfo
from weightsync.transfer.group import BroadcastGroup, check_backend
from weightsync.transfer.packing import (
    Bucket,
    direct_region,
    pack_bucket,
    unpack_bucket,
)
from weightsync.transfer.wire import WireKeywords, WireParams

if TYPE_CHECKING:  # typing.Unpack for **kwargs is Python 3.12+
    from typing_extensions import Unpack

__all__ = [
    "GlooWeightTransferEngine",
    "NCCLTrainerSendWeightsArgs",
    "NCCLWeightTransferEngine",
    "NCCLWeightTransferInitInfo",
    "TrainerGroup",
    "trainer_init",
    "trainer_send_weights",
]

logger = logging.getLogger(__name__)


class NCCLWeightTransferEngine(WeightTransferEngine):
    """Worker side of the broadcast transfer over NCCL (CUDA tensors).

    Arguments as for [`WeightTransferEngine`][weightsync.transfer.base.WeightTransferEngine]; its
    rank is `rank_offset + worker_index`. When a bucket's tensors lie in `params` at the plan's
    offsets (a module laid out by [`flatten_module`][weightsync.transfer.flat.flatten_module], or
    tensors from [`flat_tensors`][weightsync.transfer.flat.flat_tensors]), the bucket is received
    straight into parameter memory.

    Raises:
        WeightValidationError: The backend cannot run in this process (`nccl` without CUDA).

    Receiver memory beyond the model is at most `num_buffers` x the largest bucket, and nothing
    for buckets received in place.
    """

    backend: ClassVar[str] = "nccl"
    init_info_cls: ClassVar[type[WeightTransferInitInfo]] = NCCLWeightTransferInitInfo

    def __init__(
        self,
        *,
        worker_index: int = 0,
        expected_specs: Mapping[str, TensorSpec] | None = None,
        params: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        super().__init__(worker_index=worker_index, expected_specs=expected_specs, params=params)
        self.device = check_backend(self.backend)
        self._group: BroadcastGroup | None = None
        self._info: NCCLWeightTransferInitInfo | None = None
        self._pool: BufferPool | None = None
        self._seq = 0

    @property
    def is_initialized(self) -> bool:
        """Whether this worker is in a live group."""
        return self._group is not None and self._group.is_connected

    def init_transfer_engine(self, init_info: Mapping[str, Any] | WeightTransferInitInfo) -> None:
        """Joins the trainer's group; blocks until every rank joined or `timeout_s` passed.

        Re-initializing replaces the current group (after a failure, or for a new trainer).

        Raises:
            WeightValidationError: Malformed init info, a backend other than this engine's, a rank
                outside the world, or wire parameters that differ from the trainer's.
            WeightTransferTimeout: The trainer or another worker did not join in time.
        """
        info: NCCLWeightTransferInitInfo = self.parse_init_info(init_info)
        if info.backend != self.backend:
            raise WeightValidationError(
                f"init_info.backend is {info.backend!r} but this engine speaks {self.backend!r}: "
                f"create the worker's engine with backend {info.backend!r}"
            )
        self.shutdown()
        rank = info.rank_offset + self.worker_index
        if rank >= info.world_size:
            raise WeightValidationError(
                f"rank_offset ({info.rank_offset}) + worker_index ({self.worker_index}) = {rank} "
                f"is outside world_size {info.world_size}: world_size must be 1 + the number of workers"
            )
        group = BroadcastGroup(
            backend=info.backend,
            master_address=info.master_address,
            master_port=info.master_port,
            rank=rank,
            world_size=info.world_size,
            timeout_s=info.timeout_s,
        )
        try:
            trainer_wire = group.get("wire")
            mismatched = {
                k: (v, trainer_wire.get(k))
                for k, v in info.wire_params().items()
                if trainer_wire.get(k) != v
            }
            if mismatched:
                details = ", ".join(
                    f"{k}: worker {w!r} vs trainer {t!r}" for k, (w, t) in mismatched.items()
                )
                raise WeightValidationError(
                    f"init_info disagrees with the trainer's group ({details}): pass the worker "
                    "the trainer's TrainerGroup.init_info unchanged"
                )
            group.claim_rank()
            group.connect()
        except Exception as exc:
            group.set(f"init_error/{rank}", f"{type(exc).__name__}: {exc}")
            group.close()
            raise
        self._group, self._info, self._seq = group, info, 0
        logger.info("worker rank %d joined a %s group of %d", rank, info.backend, info.world_size)

    def receive_weights(
        self,
        update_info: Mapping[str, Any] | WeightTransferUpdateInfo,
        load_weights: LoadWeightsFn,
    ) -> TransferStats:
        """Receives one update (see the base class); validation happens before any byte moves.

        After a failure the group is closed: call `init_transfer_engine` again for the next update.
        """
        group, info = self._group, self._info
        if group is None or info is None or not group.is_connected:
            raise WeightTransferError(
                "the transfer engine is not initialized (or its group closed after a failure): "
                "call init_transfer_engine(init_info) first"
            )
        start = time.perf_counter()
        self._seq += 1
        specs: list[TensorSpec] | None = None
        problem: WeightValidationError | None = None
        try:
            specs = self.check_update(self.parse_update_info(update_info))
        except WeightValidationError as exc:
            problem = exc
        try:
            broadcast.handshake(group, self._seq, specs, problem)
        except WeightValidationError:
            raise
        except WeightTransferError as exc:
            raise broadcast.transfer_failed(group, exc, partially_applied=False) from exc
        assert specs is not None
        stats = TransferStats(num_tensors=len(specs), num_bytes=sum(s.nbytes for s in specs))
        if self._pool is None:
            self._pool = BufferPool(info.num_buffers, group.device)
        self._pool.reset()
        buckets = broadcast.plan(specs, info)
        window: deque[InFlight] = deque()
        touched = False  # whether any byte of the model may have been overwritten
        try:
            for bucket in buckets:
                if len(window) >= info.num_buffers:
                    touched = True
                    self._land(window.popleft(), load_weights, stats)
                window.append(self._post(group, bucket))
                touched |= window[-1].region is not None
            while window:
                touched = True
                self._land(window.popleft(), load_weights, stats)
        except Exception as exc:
            window.clear()  # in-flight work pins the group's connections open
            raise broadcast.transfer_failed(group, exc, partially_applied=touched) from exc
        stats.num_buckets = len(buckets)
        stats.seconds = time.perf_counter() - start
        logger.info(
            "received %d tensors, %.1f MB in %.3f s (%.2f GB/s)",
            stats.num_tensors,
            stats.num_bytes / 1e6,
            stats.seconds,
            stats.gbps,
        )
        return stats

    def _post(self, group: BroadcastGroup, bucket: Bucket) -> InFlight:
        """Starts receiving `bucket`, in place when the params allow it."""
        if bucket.nbytes == 0:
            return InFlight(None, bucket)
        region = None
        if self.params is not None:
            targets = [self.params.get(slot.spec.name) for slot in bucket.slots]
            if all(t is not None and t.device == group.device for t in targets):
                region = direct_region(bucket, targets)  # type: ignore[arg-type]
        what = f"receiving bucket of {len(bucket.slots)} tensors from {bucket.slots[0].spec.name!r}"
        if region is not None:
            saved = region.save_gaps()
            return InFlight(
                group.broadcast(region.data, what), bucket, region.data, None, region, saved
            )
        assert self._pool is not None
        index, data = self._pool.take(bucket.nbytes)
        return InFlight(group.broadcast(data, what), bucket, data, index)

    def _land(self, item: InFlight, load_weights: LoadWeightsFn, stats: TransferStats) -> None:
        """Waits for a posted bucket, then loads it (unless it landed in place)."""
        if item.work is not None:  # None: a bucket of empty tensors, nothing on the wire
            item.work.wait()
        if item.region is not None:
            assert item.saved_gaps is not None
            item.region.restore_gaps(item.saved_gaps)
            stats.direct_buckets += 1
            return
        data = item.data if item.data is not None else torch.empty(0, dtype=torch.uint8)
        with torch.no_grad():  # loaders copy into parameters that may require grad
            load_weights(unpack_bucket(item.bucket, data.to(self.device)))
        if item.buffer_index is not None:
            assert self._pool is not None
            self._pool.give_back(item.buffer_index)

    def shutdown(self) -> None:
        """Leaves the group and frees the bucket buffers. Safe to call twice."""
        if self._group is not None:
            self._group.close()
        self._group, self._info, self._pool = None, None, None


class GlooWeightTransferEngine(NCCLWeightTransferEngine):
    """Worker side of the broadcast transfer over gloo: the same protocol on CPU tensors."""

    backend: ClassVar[str] = "gloo"


class TrainerGroup:
    """The trainer's end of a broadcast group, returned by [`trainer_init`][weightsync.transfer.nccl.trainer_init].

    The store is bound at creation; the group itself forms on
    [`connect`][weightsync.transfer.nccl.TrainerGroup.connect] (or the first send), once every
    worker was given [`init_info`][weightsync.transfer.nccl.TrainerGroup.init_info].
    """

    def __init__(self, group: BroadcastGroup, info: NCCLWeightTransferInitInfo) -> None:
        self._group = group
        self._info = info
        self._pool = BufferPool(info.num_buffers, group.device)
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

    def connect(self) -> None:
        """Blocks until every worker joined (idempotent).

        Raises:
            WeightTransferTimeout: Some worker did not join within `timeout_s`; the message
                includes the errors workers reported while joining.
            WeightTransferError: The group was closed after a failure.
        """
        if self._closed:
            raise WeightTransferError(
                "this trainer group was closed after a failure: call trainer_init again"
            )
        try:
            self._group.connect()
        except WeightTransferError as exc:
            errors = [
                f"rank {r}: {e}"
                for r in range(1, self._info.world_size)
                if (e := self._group.try_get(f"init_error/{r}")) is not None
            ]
            if errors:
                raise type(exc)(f"{exc}; workers reported: {'; '.join(errors)}") from exc
            raise

    def close(self) -> None:
        """Closes the group; workers blocked on it fail at once. Safe to call twice."""
        self._closed = True
        self._group.close()

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
    **wire_fields: Unpack[WireKeywords],
) -> TrainerGroup:
    """Creates the trainer's end (rank 0) of a weight-transfer group and decides the wire parameters.

    Binds the group's store and returns at once; pass `group.init_info` to every worker's
    `init_transfer_engine`, then send. It never touches torch.distributed's default group.

    Args:
        world_size: 1 (this trainer) + the number of workers.
        backend: `"nccl"` for CUDA tensors, `"gloo"` for CPU tensors.
        master_address: Address workers reach this process at (loopback by default).
        master_port: Port for the store; 0 picks a free one.
        wire: The wire parameters ([`WireParams`][weightsync.transfer.wire.WireParams]:
            packed or not, bucket size, buffers, timeout); the defaults when None.
        **wire_fields: The same, as keywords (`bucket_size_bytes=256 << 20`), instead of `wire`.

    Raises:
        WeightValidationError: A bad argument, or `nccl` without CUDA.

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
    group.claim_rank()
    return TrainerGroup(group, info)


@dataclass
class NCCLTrainerSendWeightsArgs:
    """Arguments of [`trainer_send_weights`][weightsync.transfer.nccl.trainer_send_weights].

    Attributes:
        group: The trainer's group from `trainer_init`.
        update_info: The update info the workers were given (a dict or the dataclass); every
            tensor the iterator yields is checked against it, in order.
        post_iter_func: Optional map from each yielded `(name, tensor)` pair to the tensor to send
            (e.g. to gather a sharded parameter); by default the pair's tensor.
    """

    group: TrainerGroup
    update_info: Mapping[str, Any] | WeightTransferUpdateInfo
    post_iter_func: Callable[[tuple[str, torch.Tensor]], torch.Tensor] | None = None


def trainer_send_weights(
    iterator: Iterable[tuple[str, torch.Tensor]], trainer_args: NCCLTrainerSendWeightsArgs
) -> TransferStats:
    """Broadcasts one update to every worker of the group.

    The workers must be inside `receive_weights` with the same update info. Packed mode packs
    bucket k+1 while bucket k is on the wire; a bucket whose tensors already sit in one storage at
    the plan's offsets (see [`flatten_module`][weightsync.transfer.flat.flatten_module]) is sent
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
    specs: list[TensorSpec] | None = None
    problem: WeightValidationError | None = None
    try:
        specs = parse_info(
            WeightTransferUpdateInfo, trainer_args.update_info, what="update_info"
        ).specs()
    except WeightValidationError as exc:
        problem = exc
    trainer._seq += 1
    try:
        broadcast.handshake(group, trainer._seq, specs, problem)
    except WeightValidationError:
        raise
    except WeightTransferError as exc:
        trainer._closed = True
        raise broadcast.transfer_failed(group, exc, partially_applied=False) from exc
    assert specs is not None
    buckets = broadcast.plan(specs, info)
    tensors = AnnouncedTensors(iter(iterator), trainer_args.post_iter_func)
    stats = TransferStats(
        num_tensors=len(specs), num_bytes=sum(s.nbytes for s in specs), num_buckets=len(buckets)
    )
    pool = trainer._pool
    pool.reset()
    window: deque[InFlight] = deque()
    index = 0
    try:
        for number, bucket in enumerate(buckets):
            bucket_tensors = []
            for slot in bucket.slots:
                bucket_tensors.append(tensors.take(slot.spec, index))
                index += 1
            if number == len(buckets) - 1:
                tensors.check_exhausted(len(specs))
            if bucket.nbytes == 0:
                continue
            if len(window) >= info.num_buffers:
                _drain_one(window, pool)
            window.append(_post_send(group, pool, bucket, bucket_tensors, stats))
        if not buckets:
            tensors.check_exhausted(0)
        while window:
            _drain_one(window, pool)
    except Exception as exc:
        window.clear()  # in-flight work pins the group's connections open
        trainer._closed = True
        error = broadcast.transfer_failed(group, exc, partially_applied=index > 0)
        if isinstance(exc, WeightValidationError):
            raise WeightValidationError(str(error)) from exc
        raise error from exc
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


def _post_send(
    group: BroadcastGroup,
    pool: BufferPool,
    bucket: Bucket,
    tensors: list[torch.Tensor],
    stats: TransferStats,
) -> InFlight:
    what = f"sending bucket of {len(bucket.slots)} tensors from {bucket.slots[0].spec.name!r}"
    region = direct_region(bucket, tensors) if tensors[0].device == group.device else None
    if region is not None:
        stats.direct_buckets += 1
        return InFlight(group.broadcast(region.data, what), bucket, region.data, keepalive=tensors)
    index, buffer = pool.take(bucket.nbytes)
    with torch.no_grad():  # parameters that require grad are copied as plain bytes
        data = pack_bucket(bucket, tensors, buffer)
    return InFlight(group.broadcast(data, what), bucket, data, index)


def _drain_one(window: deque[InFlight], pool: BufferPool) -> None:
    item = window.popleft()
    assert item.work is not None
    item.work.wait()
    if item.buffer_index is not None:
        pool.give_back(item.buffer_index)
