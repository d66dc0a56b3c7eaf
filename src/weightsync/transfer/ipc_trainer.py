"""Trainer side of the `ipc` backend: export memory, deliver handle records, reuse buffers safely.

An [`IPCTrainerSession`][weightsync.transfer.ipc_trainer.IPCTrainerSession] (from
[`ipc_trainer_init`][weightsync.transfer.ipc_trainer.ipc_trainer_init]) owns everything the trainer
exports: the packed bucket buffers and the shared-memory tensors it hands out. It unlinks them on
`close`, after a failed transfer (bucket buffers), and, through its janitor process, when the
trainer dies. [`ipc_trainer_send_weights`][weightsync.transfer.ipc_trainer.ipc_trainer_send_weights]
sends one update through a `deliver` callable; see [`weightsync.transfer.ipc`][weightsync.transfer.ipc]
for the protocol.
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

from weightsync.errors import WeightTransferError, WeightValidationError
from weightsync.transfer import _courier
from weightsync.transfer import _shm as shm
from weightsync.transfer._bucket_io import round_up, unpack_bucket
from weightsync.transfer._checks import parse_info
from weightsync.transfer._courier import Courier
from weightsync.transfer._ipc_send import Sending, send_packed, send_unpacked
from weightsync.transfer._pipeline import BufferPool
from weightsync.transfer._sender import AnnouncedTensors
from weightsync.transfer.base import (
    TensorSpec,
    TransferStats,
    WeightTransferUpdateInfo,
)
from weightsync.transfer.packing import ALIGN_BYTES, flat_layout
from weightsync.transfer.wire import WireKeywords, WireParams

if TYPE_CHECKING:  # typing.Unpack for **kwargs is Python 3.12+
    from typing_extensions import Unpack

__all__ = [
    "DeliverFn",
    "IPCTrainerSendWeightsArgs",
    "IPCTrainerSession",
    "ipc_trainer_init",
    "ipc_trainer_send_weights",
]

logger = logging.getLogger(__name__)

# A bucket buffer: its bytes, and on the CPU the shared-memory segment they live in.
_BucketBuffer = tuple[torch.Tensor, "shm.SharedSegment | None"]

DeliverFn = _courier.DeliverFn
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
        wire: The wire parameters ([`WireParams`][weightsync.transfer.wire.WireParams]): `packed`
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
        segment = self._new_segment(round_up(layout.nbytes, ALIGN_BYTES))
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
                    created = self._new_segment(round_up(nbytes, mmap.PAGESIZE))
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
    *, wire: WireParams | None = None, **wire_fields: Unpack[WireKeywords]
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
    deliver: DeliverFn
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
        "weight_version": announced.weight_version if version is None else version,
        "update_id": secrets.token_hex(8),  # an IPC update is known by it, not by a send_id
    }
    header.pop("send_id", None)
    stats = TransferStats(num_tensors=len(specs), num_bytes=sum(s.nbytes for s in specs))
    courier = Courier(trainer_args.deliver, session.wire.timeout_s)
    sending = Sending(session, specs, source, header, courier, stats)
    try:
        (send_packed if session.wire.packed else send_unpacked)(sending)
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
