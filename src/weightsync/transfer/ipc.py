"""Memory-handle transfer (backend `ipc`): a colocated trainer lends its memory to the workers.

One concept: both ends of one protocol. The trainer's session exports its memory (CUDA IPC, or
POSIX shared memory for CPU tensors) as JSON-safe records
([`weightsync.transfer.memory`][weightsync.transfer.memory]). A send delivers to every worker an
*announcement* (`ipc_handles` null: a rejection anywhere stops the update before any byte moves),
then one *part* per bucket (packed: `num_buffers` buffers, each refilled once acknowledged) or one
part exporting the tensors in place (unpacked). The worker's engine checks, maps and copies each
part, refusing late, stray, duplicated or out-of-order ones.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import mmap
import queue
import secrets
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from weightsync.errors import WeightTransferError, WeightTransferTimeout, WeightValidationError
from weightsync.transfer import memory
from weightsync.transfer.base import (
    DEFAULT_TIMEOUT_S,
    LoadWeightsFn,
    TensorSpec,
    TransferStats,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
    WireParams,
    _is_int,
    _parse_info,
    _Watch,
    _WireKeywords,
)
from weightsync.transfer.buckets import (
    _announced_buckets,
    _AnnouncedTensors,
    _BufferPool,
    flat_layout,
    pack_bucket,
    plan_buckets,
    unpack_bucket,
)
from weightsync.transfer.memory import CUDAStorageHandle, IPCHandle, RegionCache, synchronize

if TYPE_CHECKING:  # typing.Unpack for **kwargs is Python 3.12+
    from typing_extensions import Unpack

__all__ = [
    "IPCTrainerSendWeightsArgs",
    "IPCTrainerSession",
    "IPCWeightTransferEngine",
    "IPCWeightTransferInitInfo",
    "IPCWeightTransferUpdateInfo",
    "ipc_trainer_init",
    "ipc_trainer_send_weights",
]

logger = logging.getLogger(__name__)

_ANNOUNCED_IDS_KEPT = 64
_DeliverFn = Callable[[dict[str, Any]], None]
_BucketBuffer = tuple[torch.Tensor, "memory.SharedSegment | None"]  # bytes, and CPU segment


# --- the payloads ---------------------------------------------------------------------------------


@dataclass
class IPCWeightTransferInitInfo(WeightTransferInitInfo):
    """How a worker joins a trainer's IPC session; take it from `IPCTrainerSession.init_info`.

    Attributes:
        session: The trainer's session name; the worker attaches only to its segments.
        backend: Always `"ipc"`.
    """

    session: str
    backend: str = "ipc"

    def __post_init__(self) -> None:
        if self.backend != "ipc":
            raise WeightValidationError(
                f"backend is {self.backend!r} but this init info is for 'ipc': create the "
                f"worker's engine with backend {self.backend!r}"
            )
        if not memory.is_session_name(self.session):
            raise WeightValidationError(
                f"session must look like 'weightsync-' + 12 hex digits, got {self.session!r}: "
                "pass the trainer's IPCTrainerSession.init_info unchanged"
            )


@dataclass(kw_only=True)
class IPCWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """One delivery of an IPC update: an announcement, or a part with its tensors' handles.

    The announcement (`ipc_handles` null) lists the whole update in `names`, `dtype_names` and
    `shapes`; a part lists only its own tensors, the announced ones from `first_index` on, with one
    handle record each. `update_id` and `weight_version` are the same in every delivery of an
    update. Every field is JSON-safe and `to_dict` round-trips.

    Attributes:
        update_id: Identifies the update all its deliveries belong to.
        ipc_handles: One record per tensor of this part (see
            [`IPCHandle`][weightsync.transfer.memory.IPCHandle]), or None for the announcement.
        first_index: Position of this part's first tensor in the announced update (0 for the
            announcement).

    Raises:
        WeightValidationError: Malformed metadata or records; the message names the record.
    """

    update_id: str
    ipc_handles: list[dict[str, Any]] | None = None
    first_index: int = 0
    _handles: list[IPCHandle] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.update_id, str) or not self.update_id:
            raise WeightValidationError(
                f"update_id must be a non-empty string, got {self.update_id!r}"
            )
        first, records = self.first_index, self.ipc_handles
        if not _is_int(first) or first < 0:
            raise WeightValidationError(f"first_index must be an int >= 0, got {first!r}")
        self._handles = []
        if records is None:
            if first:
                raise WeightValidationError(
                    f"an announcement (ipc_handles null) has first_index 0, got {first}"
                )
            return
        if not isinstance(records, list) or len(records) != len(self.names):
            count = len(records) if isinstance(records, list) else "no"
            raise WeightValidationError(
                f"ipc_handles must be a list with one record per name: got {count} records "
                f"for {len(self.names)} names"
            )
        for i, (record, spec) in enumerate(zip(records, self.specs(), strict=True)):
            where = f"ipc_handles[{i}] ({spec.name!r})"
            self._handles.append(IPCHandle.from_dict(record, where=where, spec=spec))

    @property
    def is_announcement(self) -> bool:
        """Whether this delivery only announces the update (no handles)."""
        return self.ipc_handles is None

    @property
    def opens_update(self) -> bool:
        """Whether this delivery starts an update: the announcement does, a part does not."""
        return self.is_announcement

    def handles(self) -> list[IPCHandle]:
        """The checked records of this delivery, in order."""
        return list(self._handles)

    def to_dict(self) -> dict[str, Any]:
        """Returns the JSON-safe dict form, the inverse of `_parse_info`."""
        handles = None if self.ipc_handles is None else [h.to_dict() for h in self._handles]
        data = {**super().to_dict(), "update_id": self.update_id}
        return data | {"ipc_handles": handles, "first_index": self.first_index}


# --- the trainer's end: the session and its exported memory ---------------------------------------


def _release(owned: dict[str, memory.SharedSegment], janitor: memory.SegmentJanitor) -> None:
    for segment in owned.values():
        segment.unlink()
    owned.clear()
    janitor.close()


class IPCTrainerSession:
    """The trainer's end of an IPC transfer: its exported memory and its wire parameters.

    Prefer [`ipc_trainer_init`][weightsync.transfer.ipc.ipc_trainer_init] (same arguments). The
    session unlinks its segments on `close`, after a failed transfer (bucket buffers), and, through
    its janitor process, when the trainer dies.

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
        self.session = memory.new_session_name()
        self._janitor = memory.SegmentJanitor(self.session)
        self._counter = itertools.count()
        self._owned: dict[str, memory.SharedSegment] = {}
        self._shared: list[memory.SharedSegment] = []  # where unpacked sends find CPU tensors
        self._pools: dict[torch.device, _BufferPool[_BucketBuffer]] = {}  # bucket buffers
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
        if not self._finalizer.alive:
            raise WeightTransferError(
                "this IPC trainer session is closed: call ipc_trainer_init again"
            )
        self._janitor.check()  # its death is the user's to see, before more memory is exported

    def _new_segment(self, nbytes: int) -> memory.SharedSegment:
        name = f"{self.session}-{next(self._counter)}"
        self._janitor.track(name)  # before it exists: a crash right after still gets cleaned up
        try:
            segment = memory.SharedSegment(name, max(nbytes, 1))
        except Exception:
            self._janitor.forget(name)
            raise
        self._owned[name] = segment
        return segment

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

    def _pool(self, device: torch.device) -> _BufferPool[_BucketBuffer]:
        """The bucket buffers on `device`: shared-memory segments (CPU) or CUDA memory."""

        def allocate(nbytes: int) -> _BucketBuffer:
            if device.type != "cpu":
                return torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device), None
            created = self._new_segment(-(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
            return created.tensor, created

        def release(entry: _BucketBuffer) -> None:
            if (segment := entry[1]) is not None:
                segment.unlink()
                self._janitor.forget(segment.name)
                self._owned.pop(segment.name, None)

        if device not in self._pools:
            self._pools[device] = _BufferPool(
                self.wire.num_buffers, allocate, lambda entry: entry[0].numel(), release
            )
        return self._pools[device]

    def _export_in_place(
        self, spec: TensorSpec, tensor: torch.Tensor, exports: dict[int, CUDAStorageHandle]
    ) -> IPCHandle:
        """The record exporting `tensor` where it lies; `exports`: one CUDA export per storage."""
        if spec.nbytes == 0:
            return IPCHandle.for_tensor(spec, 0)
        if not tensor.is_contiguous():
            raise WeightValidationError(
                f"tensor {spec.name!r} is not contiguous: unpacked IPC exports memory as it is; "
                "make it contiguous or use packed=True"
            )
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if tensor.is_cuda:
            if key not in exports:
                exports[key] = memory.export_cuda_storage(storage)
            return IPCHandle.for_tensor(spec, tensor.data_ptr() - key, cuda=exports[key])
        address = int(tensor.data_ptr())
        for segment in self._shared:
            if segment.contains(address, spec.nbytes):
                return IPCHandle.for_tensor(spec, address - segment.address, segment=segment.name)
        raise WeightValidationError(
            f"tensor {spec.name!r} is not in this session's shared memory: unpacked IPC exports "
            "tensors in place; allocate them with session.shared_tensors(), move the model with "
            "session.share_module(model), or use packed=True"
        )

    def drop_buffers(self) -> None:
        """Frees (and unlinks) the bucket buffers; the next packed send allocates new ones."""
        for pool in self._pools.values():
            pool.clear()
        self._pools.clear()

    def close(self) -> None:
        """Unlinks every segment of this session and stops its janitor. Safe to call twice."""
        if not self._finalizer.alive:
            return
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
        wire: The wire parameters (see [`IPCTrainerSession`][weightsync.transfer.ipc.IPCTrainerSession]).
        **wire_fields: The same, as keywords (`packed=False`), instead of `wire`.

    Raises:
        WeightValidationError: A bad wire parameter.

    >>> session = ipc_trainer_init()
    >>> session.init_info["backend"]
    'ipc'
    >>> session.close()
    """
    return IPCTrainerSession(WireParams.build(wire, **wire_fields))


# --- the trainer's end: one update, delivered in order on a helper thread ------------------------


class _Courier:
    """Delivers one update's messages in order on a daemon thread; after a failure, none more.

    A `deliver` still running when its bounded wait timed out is abandoned, but nothing queued
    behind it reaches the workers (who refuse late parts of an update they no longer wait for).
    """

    def __init__(self, deliver: _DeliverFn, header: dict[str, Any], timeout_s: float) -> None:
        self._deliver, self._header, self._timeout_s = deliver, header, timeout_s
        self._jobs: queue.SimpleQueue[tuple[dict[str, Any], concurrent.futures.Future[None]] | None]
        self._jobs = queue.SimpleQueue()
        # Deliveries not yet acknowledged, with what they carry and the bucket buffer they pin.
        self.pending: deque[tuple[concurrent.futures.Future[None], str, int]] = deque()
        self._cancelled = threading.Event()  # on a failure, a timeout and close
        threading.Thread(target=self._run, name="weightsync-ipc", daemon=True).start()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            info, future = job
            if self._cancelled.is_set() or not future.set_running_or_notify_cancel():
                future.cancel()
                continue
            try:
                self._deliver(info)
            except BaseException as exc:  # handed to the trainer's thread, which re-raises it
                self._cancelled.set()
                future.set_exception(exc)
            else:
                future.set_result(None)

    def submit(
        self, first: int, records: list[dict[str, Any]] | None, what: str, buffer: int = -1
    ) -> None:
        """Queues the part of tensors `first ..` with their records, or (None) the announcement."""
        info = {**self._header, "ipc_handles": records, "first_index": first}
        if records is not None:
            end = first + len(records)
            info |= {key: info[key][first:end] for key in ("names", "dtype_names", "shapes")}
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._jobs.put((info, future))
        self.pending.append((future, what, buffer))

    def wait_oldest(self) -> int:
        """Waits for the oldest delivery's acknowledgement; returns the buffer it pinned."""
        future, what, buffer = self.pending.popleft()
        try:
            future.result(self._timeout_s)
        except concurrent.futures.TimeoutError:
            if future.done():  # the deliver callable raised a timeout of its own
                raise
            self._cancelled.set()  # what is queued behind it must never reach the workers
            raise WeightTransferTimeout(
                f"delivering {what}: the workers did not acknowledge within timeout_s="
                f"{self._timeout_s:g} s"
            ) from None
        return buffer

    def raise_if_failed(self) -> None:
        """Raises a failed delivery early, in delivery order; pending successes stay pending."""
        if any(f.done() and not f.cancelled() and f.exception() for f, _, _ in self.pending):
            self.drain()

    def drain(self) -> None:
        while self.pending:
            self.wait_oldest()

    def announce(self) -> None:
        """Delivers the announcement and waits: a rejection anywhere stops the update here."""
        self.submit(0, None, "the update's announcement")
        try:
            self.wait_oldest()
        except WeightValidationError as exc:
            raise WeightValidationError(
                f"a worker rejected the update; nothing moved: {exc}"
            ) from exc
        except WeightTransferError:
            raise
        except Exception as exc:
            raise WeightTransferError(
                f"announcing the update failed: {type(exc).__name__}: {exc}"
            ) from exc

    def close(self) -> None:
        """Drops what is still queued; a delivery already running is left to end on its own."""
        self._cancelled.set()
        for future, _, _ in self.pending:
            future.cancel()
        self._jobs.put(None)


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


def _data_failed(exc: Exception, *, delivered: bool, cleanup: str = "") -> Exception:
    """The error for a failure after the announcement was accepted."""
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


def _send_packed(
    session: IPCTrainerSession,
    courier: _Courier,
    specs: list[TensorSpec],
    source: _AnnouncedTensors,
) -> int:
    """Announces, then packs bucket after bucket into the session's buffers; returns the parts."""
    wire = session.wire
    buckets = plan_buckets(specs, wire.bucket_size_bytes)
    nbytes = max((b.nbytes for b in buckets), default=1)
    courier.announce()
    device: torch.device | None = None
    sent = 0
    try:
        for first, bucket, tensors in _announced_buckets(buckets, source, len(specs)):
            device = _device_of(tensors, [s.spec for s in bucket.slots], device)
            pool = session._pool(device)
            if not sent:
                pool.reset()
            if len(courier.pending) >= wire.num_buffers:
                pool.give_back(courier.wait_oldest())  # the workers copied out: refill it
            courier.raise_if_failed()
            index, (buffer, segment) = pool.take(nbytes)
            with torch.no_grad():  # parameters that require grad are copied as plain bytes
                pack_bucket(bucket, tensors, buffer)
            cuda = None
            if buffer.is_cuda:
                # Workers read on their own streams: the packed bytes must be in memory first.
                synchronize(buffer.device, timeout_s=wire.timeout_s, what="packing a bucket")
                cuda = memory.export_cuda_storage(buffer.untyped_storage())
            name = segment.name if segment is not None else None
            records = [
                IPCHandle.for_tensor(s.spec, s.offset, segment=name, cuda=cuda).to_dict()
                for s in bucket.slots
            ]
            sent += 1
            courier.submit(first, records, f"part {sent} of {len(buckets)}", index)
        courier.drain()
    except Exception as exc:
        session.drop_buffers()
        cleanup = "; the bucket buffers were unlinked"
        raise _data_failed(exc, delivered=sent > 0, cleanup=cleanup) from exc
    return sent


def _send_unpacked(
    session: IPCTrainerSession,
    courier: _Courier,
    specs: list[TensorSpec],
    source: _AnnouncedTensors,
) -> int:
    """Exports every tensor where it lies and delivers them in one part, after the announcement."""
    tensors = [source.take(spec, i) for i, spec in enumerate(specs)]
    source.check_exhausted(len(specs))
    device = _device_of(tensors, specs, None)
    exports: dict[int, CUDAStorageHandle] = {}
    records = [
        session._export_in_place(s, t, exports).to_dict()
        for s, t in zip(specs, tensors, strict=True)
    ]
    if device.type == "cuda":
        synchronize(device, timeout_s=session.wire.timeout_s, what="exporting the tensors")
    courier.announce()
    if not specs:
        return 0
    try:
        courier.submit(0, records, "the update")
        courier.drain()
    except Exception as exc:
        raise _data_failed(exc, delivered=True) from exc
    return 1


@dataclass
class IPCTrainerSendWeightsArgs:
    """Arguments of [`ipc_trainer_send_weights`][weightsync.transfer.ipc.ipc_trainer_send_weights].

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

    An announcement first lets every worker validate the whole update: a rejection anywhere stops
    it before any byte moves. Then packed mode copies bucket after bucket into the session's
    buffers (packing bucket k+1 while workers copy bucket k); unpacked mode exports every tensor in
    place in one delivery.

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
    session, version = trainer_args.session, trainer_args.weight_version
    session._check_open()
    start = time.perf_counter()
    if trainer_args.update_info is None:
        post = trainer_args.post_iter_func
        pairs = [(name, post((name, t)) if post else t) for name, t in iterator]
        announced = WeightTransferUpdateInfo.from_named_tensors(pairs, weight_version=version)
        source = _AnnouncedTensors(iter(pairs), None)
    else:
        announced = _parse_info(
            WeightTransferUpdateInfo, trainer_args.update_info, what="update_info"
        )
        if version is not None and announced.weight_version not in (None, version):
            raise WeightValidationError(
                f"weight_version is {version!r} but update_info says {announced.weight_version!r}"
            )
        source = _AnnouncedTensors(iter(iterator), trainer_args.post_iter_func)
    specs = announced.specs()
    # An IPC update is known by its update_id, not by a send_id.
    header = {**announced.to_dict(), "update_id": secrets.token_hex(8)}
    header.pop("send_id", None)
    if version is not None:
        header["weight_version"] = version
    stats = TransferStats(num_tensors=len(specs), num_bytes=sum(s.nbytes for s in specs))
    courier = _Courier(trainer_args.deliver, header, session.wire.timeout_s)
    try:
        if session.wire.packed:
            stats.num_buckets = _send_packed(session, courier, specs, source)
        else:
            stats.num_buckets = stats.direct_buckets = _send_unpacked(
                session, courier, specs, source
            )
    finally:
        courier.close()
    stats.seconds = time.perf_counter() - start
    logger.info(
        "sent %d tensors, %.1f MB in %.3f s (%.2f GB/s, %d parts, %d in place)",
        stats.num_tensors, stats.num_bytes / 1e6, stats.seconds, stats.gbps,
        stats.num_buckets, stats.direct_buckets,
    )  # fmt: skip
    return stats


# --- the worker's end: check, map, copy ---------------------------------------------------------


@dataclass
class _Progress:
    """The update a worker is receiving: what was announced and how far it got."""

    update_id: str
    specs: list[TensorSpec]
    weight_version: str | int | None
    next_index: int = 0  # > 0: parts were loaded, so the weights are torn until it completes


def _refusal(message: str) -> WeightValidationError:
    """A refused delivery moved no byte: the update in progress goes on as if it never came."""
    return WeightValidationError(f"delivery refused, no byte moved: {message}")


class IPCWeightTransferEngine(WeightTransferEngine):
    """Worker side of the `ipc` backend: reads tensors out of the trainer's exported memory.

    Args:
        worker_index: This worker's index among the trainer's workers (for logs).
        expected_specs: See [`WeightTransferEngine`][weightsync.transfer.base.WeightTransferEngine].
        params: See [`WeightTransferEngine`][weightsync.transfer.base.WeightTransferEngine]; only
            their specs are used (the bytes always arrive through `load_weights`).

    `load_weights` gets views of the trainer's memory, to copy before returning; shared-memory
    views are read-only, so a worker cannot corrupt the trainer's weights. Mappings are kept
    between updates (a packed buffer is mapped once) and dropped once unused.
    """

    backend: ClassVar[str] = "ipc"
    init_info_cls: ClassVar[type[WeightTransferInitInfo]] = IPCWeightTransferInitInfo
    update_info_cls: ClassVar[type[WeightTransferUpdateInfo]] = IPCWeightTransferUpdateInfo

    def __init__(
        self,
        *,
        worker_index: int = 0,
        expected_specs: Mapping[str, TensorSpec] | None = None,
        params: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        super().__init__(worker_index=worker_index, expected_specs=expected_specs, params=params)
        self._session: str | None = None
        self._mappings = RegionCache()
        self._progress: _Progress | None = None
        # Every send has a new update_id: one seen recently is a late or repeated announcement.
        self._announced: deque[str] = deque(maxlen=_ANNOUNCED_IDS_KEPT)
        self._watch: _Watch | None = None  # frees what a trainer left, between updates

    @property
    def is_initialized(self) -> bool:
        """Whether `init_transfer_engine` succeeded and no failure or shutdown happened since."""
        return self._session is not None

    @property
    def update_in_progress(self) -> bool:
        """True from an update's announcement until its last part landed (then it is complete).

        A control plane advances its weight version only once this is False after a delivery.
        """
        return self._progress is not None

    def init_transfer_engine(self, init_info: Mapping[str, Any] | WeightTransferInitInfo) -> None:
        """Joins the trainer's session (instant: nothing is mapped until an update arrives).

        Raises:
            WeightValidationError: Malformed init info or another backend's.
        """
        info: IPCWeightTransferInitInfo = self.parse_init_info(init_info)
        self.shutdown()
        self._session = info.session
        self._mappings = RegionCache(info.session)
        self._watch = _Watch(self._release_gone, name="weightsync-ipc-watch")
        logger.info("worker %d joined IPC session %s", self.worker_index, info.session)

    def _release_gone(self) -> bool:  # the watch's sweep: unmap what the trainer released
        self._mappings.drop_gone()
        return True  # watched until shutdown stops it

    def receive_weights(
        self, update_info: Mapping[str, Any] | WeightTransferUpdateInfo, load_weights: LoadWeightsFn
    ) -> TransferStats:
        """Handles one delivery: validates it, then hands its tensors to `load_weights`.

        Every record is checked (known dtype, nbytes = shape x dtype size, offset + nbytes inside
        the region, segment of this session and existing, CUDA device UUID visible) before any
        tensor is loaded. The announcement is checked against the model (`expected_specs`); each
        part must continue it in order. A refused announcement or first part changes no weight.

        Raises:
            WeightValidationError: The delivery was refused (invalid, late, stray, duplicated
                or out of order); nothing was loaded by this call and the update in progress,
                if any, goes on.
            WeightTransferError: `load_weights` failed after bytes moved (`partially_applied`);
                the update in progress is dropped.
        """
        if self._session is None:
            raise WeightTransferError(
                "the transfer engine is not initialized (or was shut down after a failure): "
                "call init_transfer_engine(init_info) first"
            )
        start = time.perf_counter()
        info: IPCWeightTransferUpdateInfo = self.parse_update_info(update_info)
        stats = TransferStats(loaded_names=[])
        if info.is_announcement:
            self._announce(info)
        else:
            part = self._receive_part(info, load_weights)
            stats.num_tensors, stats.num_bytes = len(part), sum(s.nbytes for s in part)
            stats.num_buckets, stats.loaded_names = 1, [spec.name for spec in part]
        stats.seconds = time.perf_counter() - start
        return stats

    def _announce(self, info: IPCWeightTransferUpdateInfo) -> None:
        """Validates an announced update against the model and starts tracking it."""
        if info.update_id in self._announced:
            raise _refusal(
                f"update {info.update_id} was already announced to this worker: deliver each "
                "announcement once (a new send has a new update_id)"
            )
        specs = self.check_update(info)
        self._announced.append(info.update_id)
        if (progress := self._progress) is not None:
            self._mappings.clear()  # the abandoned update's memory: never read again
        if progress is not None and progress.next_index:
            logger.warning(
                "worker %d: update %s was left incomplete; its weights stay torn until "
                "update %s completes",
                self.worker_index, progress.update_id, info.update_id,
            )  # fmt: skip
        self._progress = _Progress(info.update_id, specs, info.weight_version) if specs else None

    def _receive_part(
        self, info: IPCWeightTransferUpdateInfo, load_weights: LoadWeightsFn
    ) -> list[TensorSpec]:
        """Checks that a part continues the announced update in order, maps it, loads it."""
        progress, part = self._progress, info.specs()
        if progress is None or progress.update_id != info.update_id:
            raise _refusal(
                f"update {info.update_id} was not announced to this worker: deliver the "
                "announcement (ipc_handles null) to every worker before the parts"
            )
        end = info.first_index + len(part)
        if info.first_index != progress.next_index:
            raise _refusal(
                f"update {info.update_id}: this part starts at tensor {info.first_index} but the "
                f"worker expects tensor {progress.next_index}: deliver parts once each, in order"
            )
        if part != progress.specs[info.first_index : end] or (
            info.weight_version != progress.weight_version
        ):
            raise _refusal(
                f"update {info.update_id}: the part's tensors {info.first_index}..{end - 1} or "
                "weight_version differ from what was announced"
            )
        regions: dict[object, torch.Tensor] = {}
        resolve = self._mappings.resolve
        try:
            tensors = [
                (spec.name, resolve(handle, spec, regions, f"ipc_handles[{i}] ({spec.name!r})"))
                for i, (handle, spec) in enumerate(zip(info.handles(), part, strict=True))
            ]
        except WeightValidationError as exc:
            raise _refusal(str(exc)) from None
        try:
            with torch.no_grad():  # loaders copy into parameters that may require grad
                load_weights(tensors)
            for device in {t.device for _, t in tensors if t.is_cuda}:
                # The trainer refills its buffer once we return: our copies must be done.
                synchronize(device, timeout_s=DEFAULT_TIMEOUT_S, what="load_weights' copies")
        except Exception as exc:
            self.abort_update()  # its weights may have been written in part
            raise WeightTransferError(
                f"worker {self.worker_index}: IPC weight transfer failed: load_weights failed: "
                f"{type(exc).__name__}: {exc}; the weights may be torn: send a complete update",
                partially_applied=True,
            ) from exc
        finally:
            del tensors  # a traceback would keep the trainer's memory mapped
        progress.next_index = end
        if end == len(progress.specs):
            self._progress = None
            self._mappings.drop_unused()
        return part

    def abort_update(self) -> None:
        """Forgets the update in progress and unmaps every region; its late parts are refused."""
        self._progress = None
        self._mappings.clear()

    def shutdown(self) -> None:
        """Drops every mapping and the session, and stops the watch. Safe to call twice."""
        _Watch.stop_if_any(self._watch)
        self._session, self._progress, self._watch = None, None, None
        self._announced.clear()
        self._mappings = RegionCache()
