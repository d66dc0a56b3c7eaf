"""Trainer side of the `ipc` backend: export memory, deliver handle records, reuse buffers safely.

An [`IPCTrainerSession`][weightsync.transfer.ipc_trainer.IPCTrainerSession] (from
[`ipc_trainer_init`][weightsync.transfer.ipc_trainer.ipc_trainer_init]) owns everything the trainer
exports: the packed bucket buffers and the shared-memory tensors it hands out. It unlinks them on
`close`, after a failed transfer (bucket buffers), and, through its janitor process, when the
trainer dies. [`ipc_trainer_send_weights`][weightsync.transfer.ipc_trainer.ipc_trainer_send_weights]
sends one update through a `deliver` callable; see [`weightsync.transfer.ipc`][weightsync.transfer.ipc]
for the protocol.

One concept: the IPC sender. The session's buffers and the steps that fill and export them
(announce, then packed buckets or one in-place part) work on the same memory under the same
rules, so they are read together.
"""

from __future__ import annotations

import itertools
import logging
import mmap
import secrets
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from weightsync.errors import WeightTransferError, WeightTransferTimeout, WeightValidationError
from weightsync.transfer import _courier
from weightsync.transfer import _shm as shm
from weightsync.transfer._courier import Courier
from weightsync.transfer._cuda_ipc import export_cuda_storage, synchronize
from weightsync.transfer._ipc_records import CUDAStorageHandle, IPCHandle
from weightsync.transfer.base import (
    TensorSpec,
    TransferStats,
    WeightTransferUpdateInfo,
    WireParams,
    _WireKeywords,
)
from weightsync.transfer.base import _parse_info as parse_info
from weightsync.transfer.buckets import (
    Bucket,
    flat_layout,
    pack_bucket,
    plan_buckets,
    unpack_bucket,
)
from weightsync.transfer.buckets import _announced_buckets as announced_buckets
from weightsync.transfer.buckets import _AnnouncedTensors as AnnouncedTensors
from weightsync.transfer.buckets import _BufferPool as BufferPool
from weightsync.transfer.buckets import _Window as Window

if TYPE_CHECKING:  # typing.Unpack for **kwargs is Python 3.12+
    from typing_extensions import Unpack

__all__ = [
    "IPCTrainerSendWeightsArgs",
    "IPCTrainerSession",
    "ipc_trainer_init",
    "ipc_trainer_send_weights",
]

logger = logging.getLogger(__name__)

# A bucket buffer: its bytes, and on the CPU the shared-memory segment they live in.
_BucketBuffer = tuple[torch.Tensor, "shm.SharedSegment | None"]

_DeliverFn = _courier._DeliverFn
"""Hands one JSON-safe update info dict to every worker's `receive_weights`.

Returns once every worker returned; raises if any failed (a `WeightValidationError` for a
rejection). Called from one helper thread, one delivery at a time, in order.
"""


def _release(owned: dict[str, shm.SharedSegment], janitor: shm.SegmentJanitor) -> None:
    for segment in owned.values():
        segment.unlink()
    owned.clear()
    janitor.close()


class IPCTrainerSession:
    """The trainer's end of an IPC transfer: its exported memory and its wire parameters.

    Prefer [`ipc_trainer_init`][weightsync.transfer.ipc_trainer.ipc_trainer_init]; the arguments
    are the same.

    Args:
        wire: The wire parameters ([`WireParams`][weightsync.transfer.base.WireParams]): `packed`
            copies tensors into `num_buffers` reusable bucket buffers of `bucket_size_bytes`
            (trainer memory beyond the model: their sum), unpacked exports them in place;
            `timeout_s` bounds each delivery's acknowledgement. The defaults when None.

    Attributes:
        wire: The wire parameters.
        session: The session's name, `weightsync-` and 12 random hex digits; every segment it
            creates is named after it.

    Raises:
        WeightValidationError: A bad argument.
    """

    def __init__(self, wire: WireParams | None = None) -> None:
        self.wire = WireParams.build(wire)
        self.session = shm.new_session_name()
        self._janitor = shm.SegmentJanitor(self.session)
        self._counter = itertools.count()
        self._owned: dict[str, shm.SharedSegment] = {}
        self._shared: list[shm.SharedSegment] = []
        # Per device, `num_buffers` bucket buffers and their segments (CPU), allocated on use.
        self._pools: dict[torch.device, BufferPool[_BucketBuffer]] = {}
        self._closed = False
        self._finalizer = weakref.finalize(self, _release, self._owned, self._janitor)

    @property
    def init_info(self) -> dict[str, Any]:
        """The JSON-safe init info every worker passes to `init_transfer_engine`."""
        return {"session": self.session, "backend": "ipc"}

    @property
    def janitor_pid(self) -> int | None:
        """Process id of the helper that unlinks this session's segments if the trainer dies."""
        return self._janitor.pid

    def segment_names(self) -> list[str]:
        """Names of the shared-memory segments this session holds now."""
        return sorted(self._owned)

    def _check_open(self) -> None:
        if self._closed:
            raise WeightTransferError(
                "this IPC trainer session is closed: call ipc_trainer_init again"
            )
        self._janitor.check()  # its death is the user's to see, before more memory is exported

    def _new_segment(self, nbytes: int) -> shm.SharedSegment:
        name = f"{self.session}-{next(self._counter)}"
        self._janitor.track(name)  # before it exists: a crash right after still gets cleaned up
        try:
            segment = shm.SharedSegment(name, max(nbytes, 1))
        except Exception:
            self._janitor.forget(name)
            raise
        self._owned[name] = segment
        return segment

    def _drop_segment(self, segment: shm.SharedSegment) -> None:
        segment.unlink()
        self._janitor.forget(segment.name)
        self._owned.pop(segment.name, None)

    def shared_tensors(self, specs: Sequence[TensorSpec]) -> dict[str, torch.Tensor]:
        """Allocates zeroed CPU tensors for `specs` in one shared-memory segment of this session.

        Unpacked sends export such tensors in place, without a copy. The tensors stay valid
        after `close` (which only stops further exports).

        Returns:
            The tensors by name, views of one segment in the bucket layout.

        >>> from weightsync.transfer.base import TensorSpec
        >>> session = ipc_trainer_init(packed=False)
        >>> session.shared_tensors([TensorSpec("w", torch.float32, (2, 3))])["w"].shape
        torch.Size([2, 3])
        >>> session.close()
        """
        self._check_open()
        layout = flat_layout(specs)
        segment = self._new_segment(layout.aligned_nbytes)
        self._shared.append(segment)
        return dict(unpack_bucket(layout, segment.tensor))

    def share_module(self, module: nn.Module) -> None:
        """Moves the CPU parameters of `module` into shared memory of this session, in place.

        Each `nn.Parameter` object is kept (only its `.data` changes), so create optimizers
        afterwards. Unpacked sends then export the parameters without copying them.

        Raises:
            WeightValidationError: A parameter is not on the CPU (CUDA memory is exported as is).
        """
        params = list(module.named_parameters())
        off_cpu = [name for name, p in params if p.device.type != "cpu"]
        if off_cpu:
            raise WeightValidationError(
                f"share_module moves CPU parameters only; not on the CPU: {off_cpu[:5]} "
                "(CUDA parameters are exported by CUDA IPC without sharing)"
            )
        shared = self.shared_tensors([TensorSpec.of(name, p) for name, p in params])
        with torch.no_grad():
            for name, param in params:
                shared[name].copy_(param.data)
                param.data = shared[name]

    def _locate(self, tensor: torch.Tensor, nbytes: int) -> tuple[str, int] | None:
        """The segment of this session holding `tensor`, and the tensor's offset in it."""
        address = int(tensor.data_ptr())
        for segment in self._shared:
            if segment.contains(address, nbytes):
                return segment.name, address - segment.address
        return None

    def _pool(self, device: torch.device) -> BufferPool[_BucketBuffer]:
        """The bucket buffers on `device`: shared-memory segments (CPU) or CUDA memory."""
        pool = self._pools.get(device)
        if pool is None:

            def allocate(nbytes: int) -> _BucketBuffer:
                if device.type == "cpu":
                    created = self._new_segment(-(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
                    return created.tensor, created
                return torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device), None

            def release(entry: _BucketBuffer) -> None:
                if entry[1] is not None:
                    self._drop_segment(entry[1])

            pool = self._pools[device] = BufferPool(
                self.wire.num_buffers, allocate, lambda entry: entry[0].numel(), release
            )
        return pool

    def drop_buffers(self) -> None:
        """Frees (and unlinks) the bucket buffers; the next packed send allocates new ones."""
        for pool in self._pools.values():
            pool.clear()
        self._pools.clear()

    def close(self) -> None:
        """Unlinks every segment of this session and stops its janitor. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._pools.clear()
        self._shared.clear()
        self._finalizer()
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()  # type: ignore[no-untyped-call]

    def __enter__(self) -> IPCTrainerSession:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def ipc_trainer_init(
    *, wire: WireParams | None = None, **wire_fields: Unpack[_WireKeywords]
) -> IPCTrainerSession:
    """Starts the trainer's end of an IPC transfer; pass `session.init_info` to every worker.

    Nothing is allocated until the first send (or `shared_tensors`).

    Args:
        wire: The wire parameters (see
            [`IPCTrainerSession`][weightsync.transfer.ipc_trainer.IPCTrainerSession]).
        **wire_fields: The same, as keywords (`packed=False`), instead of `wire`.

    Raises:
        WeightValidationError: A bad wire parameter.

    >>> session = ipc_trainer_init()
    >>> session.init_info["backend"]
    'ipc'
    >>> session.close()
    """
    return IPCTrainerSession(WireParams.build(wire, **wire_fields))


# --- the sending steps ----------------------------------------------------------------------------


@dataclass
class _Sending:
    """One update on its way: the session, what was announced, the tensors, the courier, stats."""

    session: IPCTrainerSession
    specs: list[TensorSpec]
    source: AnnouncedTensors
    header: dict[str, Any]
    courier: Courier
    stats: TransferStats


def _in_place_record(
    session: IPCTrainerSession,
    spec: TensorSpec,
    tensor: torch.Tensor,
    exports: dict[int, CUDAStorageHandle],
) -> IPCHandle:
    """The record exporting `tensor` where it lies (unpacked mode).

    `exports` caches the CUDA export of each storage: one export per storage and delivery.
    """
    if spec.nbytes == 0:
        return IPCHandle.for_tensor(spec, 0)
    if not tensor.is_contiguous():
        raise WeightValidationError(
            f"tensor {spec.name!r} is not contiguous: unpacked IPC exports memory as it is; make it "
            "contiguous or use packed=True"
        )
    storage = tensor.untyped_storage()
    key = storage.data_ptr()
    if tensor.is_cuda:
        if key not in exports:
            exports[key] = export_cuda_storage(storage)
        return IPCHandle.for_tensor(spec, tensor.data_ptr() - key, cuda=exports[key])
    found = session._locate(tensor, spec.nbytes)
    if found is not None:
        return IPCHandle.for_tensor(spec, found[1], segment=found[0])
    raise WeightValidationError(
        f"tensor {spec.name!r} is not in this session's shared memory: unpacked IPC exports "
        "tensors in place; allocate them with session.shared_tensors(), move the model with "
        "session.share_module(model), or use packed=True"
    )


def _device_of(
    tensors: Sequence[torch.Tensor], specs: Sequence[TensorSpec], device: torch.device | None
) -> torch.device:
    for spec, tensor in zip(specs, tensors, strict=True):
        device = device or tensor.device
        if tensor.device != device:
            raise WeightValidationError(
                f"tensor {spec.name!r} is on {tensor.device} but the update started on {device}: "
                "IPC follows the tensors' device; send one device per update"
            )
    return device or torch.device("cpu")


def _part(header: dict[str, Any], first: int, records: list[dict[str, Any]]) -> dict[str, Any]:
    """The delivery of tensors `first ..` of the update: their metadata slice and records."""
    end = first + len(records)
    return {
        **header,
        "names": header["names"][first:end],
        "dtype_names": header["dtype_names"][first:end],
        "shapes": header["shapes"][first:end],
        "ipc_handles": records,
        "first_index": first,
    }


def _announce(courier: Courier, header: dict[str, Any]) -> None:
    courier.submit({**header, "ipc_handles": None, "first_index": 0}, "the update's announcement")
    try:
        courier.wait_oldest()
    except WeightValidationError as exc:
        raise WeightValidationError(f"a worker rejected the update; nothing moved: {exc}") from exc
    except WeightTransferError:
        raise
    except Exception as exc:
        raise WeightTransferError(
            f"announcing the update failed: {type(exc).__name__}: {exc}"
        ) from exc


def _data_failed(exc: Exception, *, delivered: bool, cleanup: str = "") -> Exception:
    """The error to raise for a failure after the announcement was accepted."""
    if isinstance(exc, WeightValidationError) and not delivered:
        return exc
    error_cls = (
        WeightTransferTimeout if isinstance(exc, WeightTransferTimeout) else WeightTransferError
    )
    return error_cls(
        f"IPC weight transfer failed: {type(exc).__name__}: {exc}{cleanup}"
        + ("; workers may hold _part of the update: send a complete one" if delivered else ""),
        partially_applied=delivered,
    )


def _send_packed(send: _Sending) -> None:
    """Announces, then packs bucket after bucket into the session's buffers and delivers each."""
    session, specs, source = send.session, send.specs, send.source
    header, courier, stats = send.header, send.courier, send.stats
    buckets = plan_buckets(specs, session.wire.bucket_size_bytes)
    nbytes = max((b.nbytes for b in buckets), default=1)
    _announce(courier, header)
    device: torch.device | None = None
    pool: BufferPool[_BucketBuffer] | None = None

    def land(buffer_index: int) -> None:
        courier.wait_oldest()  # the workers copied out of this buffer: it may be refilled
        assert pool is not None
        pool.give_back(buffer_index)

    window: Window[int] = Window(session.wire.num_buffers, land)
    timeout = session.wire.timeout_s
    try:
        for first, bucket, tensors in announced_buckets(buckets, source, len(specs)):
            device = _device_of(tensors, [s.spec for s in bucket.slots], device)
            if pool is None:
                pool = session._pool(device)
                pool.reset()
            window.make_room()
            courier.raise_if_failed()
            buffer_index, (buffer, segment) = pool.take(nbytes)
            window.push(buffer_index)
            what = f"_part {stats.num_buckets + 1} of {len(buckets)}"
            courier.submit(
                _part(header, first, _pack_records(bucket, tensors, buffer, segment, timeout)), what
            )
            stats.num_buckets += 1
        window.drain()
    except Exception as exc:
        window.clear()
        session.drop_buffers()
        cleanup = "; the bucket buffers were unlinked"
        raise _data_failed(exc, delivered=stats.num_buckets > 0, cleanup=cleanup) from exc


def _pack_records(
    bucket: Bucket,
    tensors: list[torch.Tensor],
    buffer: torch.Tensor,
    segment: shm.SharedSegment | None,
    timeout_s: float,
) -> list[dict[str, Any]]:
    """Packs `tensors` into `buffer` and returns the records that locate them there."""
    with torch.no_grad():  # parameters that require grad are copied as plain bytes
        pack_bucket(bucket, tensors, buffer)
    cuda = None
    if buffer.is_cuda:
        # Workers read on their own streams: the packed bytes must be in memory first.
        synchronize(buffer.device, timeout_s=timeout_s, what="packing a bucket")
        cuda = export_cuda_storage(buffer.untyped_storage())
    name = segment.name if segment is not None else None
    return [
        IPCHandle.for_tensor(s.spec, s.offset, segment=name, cuda=cuda).to_dict()
        for s in bucket.slots
    ]


def _send_unpacked(send: _Sending) -> None:
    """Exports every tensor where it lies and delivers them in one _part, after the announcement."""
    session, specs, source = send.session, send.specs, send.source
    header, courier, stats = send.header, send.courier, send.stats
    tensors = [source.take(spec, i) for i, spec in enumerate(specs)]
    source.check_exhausted(len(specs))
    _device_of(tensors, specs, None)
    exports: dict[int, CUDAStorageHandle] = {}
    records = [
        _in_place_record(session, s, t, exports).to_dict()
        for s, t in zip(specs, tensors, strict=True)
    ]
    if exports:
        for device in {t.device for t in tensors if t.is_cuda}:
            synchronize(device, timeout_s=session.wire.timeout_s, what="exporting the tensors")
    _announce(courier, header)
    if not specs:
        return
    try:
        # `tensors` stays referenced until the workers acknowledged: they read its memory.
        courier.submit(_part(header, 0, records), "the update")
        stats.num_buckets = stats.direct_buckets = 1
        courier.drain()
    except Exception as exc:
        raise _data_failed(exc, delivered=True) from exc
    del tensors


@dataclass
class IPCTrainerSendWeightsArgs:
    """Arguments of [`ipc_trainer_send_weights`][weightsync.transfer.ipc_trainer.ipc_trainer_send_weights].

    Attributes:
        session: The trainer's session from `ipc_trainer_init`.
        deliver: Gives one JSON-safe update info dict to every worker's `receive_weights` and
            returns once all of them returned; raises if any failed (a `WeightValidationError`
            for a rejection). It runs on a helper thread, one delivery at a time, in order.
        update_info: What the iterator will yield (dict or dataclass), checked tensor by tensor.
            When None, the iterator is consumed up front and announced as it is.
        weight_version: Label of the weights being sent (the trainer's step, say).
        post_iter_func: Optional map from each yielded `(name, tensor)` pair to the tensor to
            send (e.g. to gather a sharded parameter).
    """

    session: IPCTrainerSession
    deliver: _DeliverFn
    update_info: Mapping[str, Any] | WeightTransferUpdateInfo | None = None
    weight_version: str | int | None = None
    post_iter_func: Callable[[tuple[str, torch.Tensor]], torch.Tensor] | None = None


def ipc_trainer_send_weights(
    iterator: Iterable[tuple[str, torch.Tensor]], trainer_args: IPCTrainerSendWeightsArgs
) -> TransferStats:
    """Sends one update to every worker through memory handles.

    First an announcement lets every worker validate the whole update, so a rejection anywhere
    stops it before any byte moves. Then packed mode copies bucket after bucket into the session's
    reusable buffers (packing bucket k+1 while workers copy bucket k) and unpacked mode exports
    every tensor in place in one delivery.

    Args:
        iterator: `(name, tensor)` pairs, e.g. `model.named_parameters()`.
        trainer_args: The session, the `deliver` callable and what to announce.

    Returns:
        What was sent and how fast; `direct_buckets` counts deliveries exported without a copy.

    Raises:
        WeightValidationError: A worker rejected the update or a tensor cannot be sent as
            announced; nothing moved.
        WeightTransferError: A delivery failed after data moved (`partially_applied`); the bucket
            buffers are unlinked.
        WeightTransferTimeout: The workers did not acknowledge a delivery within `timeout_s`.
    """
    session = trainer_args.session
    session._check_open()
    start = time.perf_counter()
    version = trainer_args.weight_version
    if trainer_args.update_info is None:
        post = trainer_args.post_iter_func
        pairs = [(name, post((name, t)) if post else t) for name, t in iterator]
        announced = WeightTransferUpdateInfo.from_named_tensors(pairs, weight_version=version)
        source = AnnouncedTensors(iter(pairs), None)
    else:
        announced = parse_info(
            WeightTransferUpdateInfo, trainer_args.update_info, what="update_info"
        )
        if version is not None and announced.weight_version not in (None, version):
            raise WeightValidationError(
                f"weight_version is {version!r} but update_info says {announced.weight_version!r}"
            )
        source = AnnouncedTensors(iter(iterator), trainer_args.post_iter_func)
    specs = announced.specs()
    header = {
        **announced.to_dict(),
        "update_id": secrets.token_hex(8),  # an IPC update is known by it, not by a send_id
    }
    header.pop("send_id", None)
    if version is not None:
        header["weight_version"] = version
    stats = TransferStats(num_tensors=len(specs), num_bytes=sum(s.nbytes for s in specs))
    courier = Courier(trainer_args.deliver, session.wire.timeout_s)
    sending = _Sending(session, specs, source, header, courier, stats)
    try:
        (_send_packed if session.wire.packed else _send_unpacked)(sending)
    finally:
        courier.close()
    stats.seconds = time.perf_counter() - start
    logger.info(
        "sent %d tensors, %.1f MB in %.3f s (%.2f GB/s, %d parts, %d in place)",
        stats.num_tensors,
        stats.num_bytes / 1e6,
        stats.seconds,
        stats.gbps,
        stats.num_buckets,
        stats.direct_buckets,
    )
    return stats
