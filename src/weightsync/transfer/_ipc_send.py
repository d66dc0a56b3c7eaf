"""The IPC trainer's sending steps: announce, then packed buckets or one in-place part.

Each step works on an [`IPCTrainerSession`][weightsync.transfer.ipc_trainer.IPCTrainerSession]'s
buffers and exports; [`ipc_trainer_send_weights`][weightsync.transfer.ipc_trainer.ipc_trainer_send_weights]
runs them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from weightsync.errors import WeightTransferError, WeightTransferTimeout, WeightValidationError
from weightsync.transfer import _shm as shm
from weightsync.transfer._bucket_io import pack_bucket
from weightsync.transfer._courier import Courier
from weightsync.transfer._cuda_ipc import export_cuda_storage, synchronize
from weightsync.transfer._ipc_records import CUDAStorageHandle, IPCHandle
from weightsync.transfer._pipeline import BufferPool, Window, announced_buckets
from weightsync.transfer._sender import AnnouncedTensors
from weightsync.transfer.base import TensorSpec, TransferStats
from weightsync.transfer.packing import Bucket, plan_buckets

if TYPE_CHECKING:
    from weightsync.transfer.ipc_trainer import IPCTrainerSession, _BucketBuffer


@dataclass
class Sending:
    """One update on its way: the session, what was announced, the tensors, the courier, stats."""

    session: IPCTrainerSession
    specs: list[TensorSpec]
    source: AnnouncedTensors
    header: dict[str, Any]
    courier: Courier
    stats: TransferStats


def in_place_record(
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


def device_of(
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


def part(header: dict[str, Any], first: int, records: list[dict[str, Any]]) -> dict[str, Any]:
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


def announce(courier: Courier, header: dict[str, Any]) -> None:
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


def data_failed(exc: Exception, *, delivered: bool, cleanup: str = "") -> Exception:
    """The error to raise for a failure after the announcement was accepted."""
    if isinstance(exc, WeightValidationError) and not delivered:
        return exc
    error_cls = (
        WeightTransferTimeout if isinstance(exc, WeightTransferTimeout) else WeightTransferError
    )
    return error_cls(
        f"IPC weight transfer failed: {type(exc).__name__}: {exc}{cleanup}"
        + ("; workers may hold part of the update: send a complete one" if delivered else ""),
        partially_applied=delivered,
    )


def send_packed(send: Sending) -> None:
    """Announces, then packs bucket after bucket into the session's buffers and delivers each."""
    session, specs, source = send.session, send.specs, send.source
    header, courier, stats = send.header, send.courier, send.stats
    buckets = plan_buckets(specs, session.wire.bucket_size_bytes)
    nbytes = max((b.nbytes for b in buckets), default=1)
    announce(courier, header)
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
            device = device_of(tensors, [s.spec for s in bucket.slots], device)
            if pool is None:
                pool = session._pool(device)
                pool.reset()
            window.make_room()
            courier.raise_if_failed()
            buffer_index, (buffer, segment) = pool.take(nbytes)
            window.push(buffer_index)
            what = f"part {stats.num_buckets + 1} of {len(buckets)}"
            courier.submit(
                part(header, first, pack_records(bucket, tensors, buffer, segment, timeout)), what
            )
            stats.num_buckets += 1
        window.drain()
    except Exception as exc:
        window.clear()
        session.drop_buffers()
        cleanup = "; the bucket buffers were unlinked"
        raise data_failed(exc, delivered=stats.num_buckets > 0, cleanup=cleanup) from exc


def pack_records(
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


def send_unpacked(send: Sending) -> None:
    """Exports every tensor where it lies and delivers them in one part, after the announcement."""
    session, specs, source = send.session, send.specs, send.source
    header, courier, stats = send.header, send.courier, send.stats
    tensors = [source.take(spec, i) for i, spec in enumerate(specs)]
    source.check_exhausted(len(specs))
    device_of(tensors, specs, None)
    exports: dict[int, CUDAStorageHandle] = {}
    records = [
        in_place_record(session, s, t, exports).to_dict()
        for s, t in zip(specs, tensors, strict=True)
    ]
    if exports:
        for device in {t.device for t in tensors if t.is_cuda}:
            synchronize(device, timeout_s=session.wire.timeout_s, what="exporting the tensors")
    announce(courier, header)
    if not specs:
        return
    try:
        # `tensors` stays referenced until the workers acknowledged: they read its memory.
        courier.submit(part(header, 0, records), "the update")
        stats.num_buckets = stats.direct_buckets = 1
        courier.drain()
    except Exception as exc:
        raise data_failed(exc, delivered=True) from exc
    del tensors
