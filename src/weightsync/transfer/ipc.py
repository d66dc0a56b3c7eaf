"""Memory-handle transfer (backend `ipc`): a colocated trainer lends its memory to the workers.

The mechanism follows the tensors' device: CUDA tensors travel as CUDA IPC handles, CPU tensors
as POSIX shared-memory segments. Either way the trainer sends only JSON-safe
handle records and each worker copies the bytes
straight out of the trainer's memory into its model.

This module holds the worker side and the payloads; the trainer side is
[`weightsync.transfer.ipc_trainer`][weightsync.transfer.ipc_trainer].

**Hand-off.** The trainer owns an
[`IPCTrainerSession`][weightsync.transfer.ipc_trainer.IPCTrainerSession]
and passes `session.init_info` to every worker's `init_transfer_engine`. An update is a series of
[`IPCWeightTransferUpdateInfo`][weightsync.transfer.ipc.IPCWeightTransferUpdateInfo] dicts, each
given to every worker's `receive_weights` by the `deliver` callable of
[`IPCTrainerSendWeightsArgs`][weightsync.transfer.ipc_trainer.IPCTrainerSendWeightsArgs] (a pipe, an HTTP
post, a Ray call), which returns once every worker acknowledged:

1. an *announcement* (`ipc_handles` null): every worker validates the whole update against its
   model, so a rejection anywhere stops the update before any byte moves on any worker;
2. one *part* per bucket (packed) or a single part (unpacked), each with the metadata and
   records of the tensors `first_index ..` of the update. Each delivery is one `update_weights`
   call inside the engine's update transaction, which
   counts the parts' `loaded_names` against the announcement. A late, stray, duplicated or
   out-of-order delivery is refused and leaves the update in progress untouched;
   [`update_in_progress`][weightsync.transfer.ipc.IPCWeightTransferEngine.update_in_progress]
   says whether an announced update still waits for parts.

**Packed** mode copies the tensors into `num_buffers` reusable bucket buffers exported once, and
refills a buffer only after the workers acknowledged its part; while workers copy bucket k, the
trainer packs bucket k+1. **Unpacked** mode exports the tensors where they are: on CPUs they must
live in the session's shared memory
([`shared_tensors`][weightsync.transfer.ipc_trainer.IPCTrainerSession.shared_tensors] or
[`share_module`][weightsync.transfer.ipc_trainer.IPCTrainerSession.share_module]), and then the
worker's single copy is the whole cost.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from weightsync.errors import WeightTransferError, WeightValidationError
from weightsync.transfer import _shm as shm
from weightsync.transfer._cuda_ipc import synchronize
from weightsync.transfer._ipc_records import IPCHandle
from weightsync.transfer._ipc_regions import RegionCache
from weightsync.transfer.base import (
    LoadWeightsFn,
    TensorSpec,
    TransferStats,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from weightsync.transfer.nccl import _Watch as Watch
from weightsync.transfer.wire import DEFAULT_TIMEOUT_S

__all__ = [
    "IPCWeightTransferEngine",
    "IPCWeightTransferInitInfo",
    "IPCWeightTransferUpdateInfo",
]

logger = logging.getLogger(__name__)

_ANNOUNCED_IDS_KEPT = 64


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
        if not shm.is_session_name(self.session):
            raise WeightValidationError(
                f"session must look like 'weightsync-' + 12 hex digits, got {self.session!r}: "
                "pass the trainer's IPCTrainerSession.init_info unchanged"
            )


@dataclass(kw_only=True)
class IPCWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """One delivery of an IPC update: an announcement, or a part with its tensors' handles.

    The announcement (`ipc_handles` null) lists the whole update in `names`, `dtype_names` and
    `shapes`. A part lists only its own tensors, which are the announced tensors from
    `first_index` on, with one handle record per tensor. `update_id` and `weight_version` are the
    same in every delivery of an update. Every field is JSON-safe and
    [`to_dict`][weightsync.transfer.ipc.IPCWeightTransferUpdateInfo.to_dict] round-trips.

    Attributes:
        update_id: Identifies the update all its deliveries belong to.
        ipc_handles: One record per tensor of this part (see
            `IPCHandle`), or None for the
            announcement, which moves nothing.
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
        first = self.first_index
        if not isinstance(first, int) or isinstance(first, bool) or first < 0:
            raise WeightValidationError(f"first_index must be an int >= 0, got {first!r}")
        self._handles = []
        if self.ipc_handles is None:
            if first:
                raise WeightValidationError(
                    f"an announcement (ipc_handles null) has first_index 0, got {first}"
                )
            return
        if not isinstance(self.ipc_handles, list) or len(self.ipc_handles) != len(self.names):
            count = len(self.ipc_handles) if isinstance(self.ipc_handles, list) else "no"
            raise WeightValidationError(
                f"ipc_handles must be a list with one record per name: got {count} records "
                f"for {len(self.names)} names"
            )
        for index, (record, spec) in enumerate(zip(self.ipc_handles, self.specs(), strict=True)):
            where = f"ipc_handles[{index}] ({spec.name!r})"
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
        """Returns the JSON-safe dict form, the inverse of `parse_info`."""
        handles = None if self.ipc_handles is None else [h.to_dict() for h in self._handles]
        return {
            **super().to_dict(),
            "update_id": self.update_id,
            "ipc_handles": handles,
            "first_index": self.first_index,
        }


@dataclass
class _Progress:
    """The update a worker is receiving: what was announced and how far it got."""

    update_id: str
    specs: list[TensorSpec]
    weight_version: str | int | None
    next_index: int = 0
    touched: bool = False


class IPCWeightTransferEngine(WeightTransferEngine):
    """Worker side of the `ipc` backend: reads tensors out of the trainer's exported memory.

    Args:
        worker_index: This worker's index among the trainer's workers (for logs).
        expected_specs: See [`WeightTransferEngine`][weightsync.transfer.base.WeightTransferEngine].
        params: See [`WeightTransferEngine`][weightsync.transfer.base.WeightTransferEngine]; only
            their specs are used (the bytes always arrive through `load_weights`).

    `load_weights` gets views of the trainer's memory; copy them before returning. Shared-memory
    views are mapped read-only, so a worker can never corrupt the trainer's weights. Mappings are
    kept between updates (a packed buffer is mapped once) and dropped once unused.
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
        # Every send has a new update_id, so an announcement of one seen before is late or
        # repeated; the most recent ones are enough to tell.
        self._announced: deque[str] = deque(maxlen=_ANNOUNCED_IDS_KEPT)
        self._watch: Watch | None = None  # frees what a trainer left, between updates

    @property
    def is_initialized(self) -> bool:
        """Whether `init_transfer_engine` succeeded and no failure or shutdown happened since."""
        return self._session is not None

    @property
    def update_in_progress(self) -> bool:
        """True from an update's announcement until its last part landed.

        A control plane advances its weight version only once this is False again after a
        delivery: the update is then complete.
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
        self._watch = Watch(self._release_gone, name="weightsync-ipc-watch")
        logger.info("worker %d joined IPC session %s", self.worker_index, info.session)

    def _release_gone(self) -> bool:  # the watch's sweep: unmap what the trainer released
        self._mappings.drop_gone()
        return True  # watched until shutdown stops it

    def receive_weights(
        self,
        update_info: Mapping[str, Any] | WeightTransferUpdateInfo,
        load_weights: LoadWeightsFn,
    ) -> TransferStats:
        """Handles one delivery: validates it, then hands its tensors to `load_weights`.

        Every record is checked (known dtype, nbytes = shape x dtype size, offset + nbytes inside
        the region, segment of this session and existing, CUDA device UUID visible) before any
        tensor is loaded. The announcement is validated against the model (`expected_specs`);
        each part must then continue the announced update in order. A rejected announcement or
        first part leaves the weights as they were.

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
        stats = TransferStats()
        if info.is_announcement:
            self._announce(info)
            stats.loaded_names = []
        else:
            progress = self._check_part(info)
            part = info.specs()
            self._load_part(info, part, load_weights)
            progress.touched = True
            progress.next_index = info.first_index + len(part)
            if progress.next_index == len(progress.specs):
                self._progress = None
                self._mappings.drop_unused()
            stats.num_tensors = len(part)
            stats.num_bytes = sum(s.nbytes for s in part)
            stats.num_buckets = 1
            stats.loaded_names = [spec.name for spec in part]
        stats.seconds = time.perf_counter() - start
        return stats

    def _announce(self, info: IPCWeightTransferUpdateInfo) -> None:
        """Validates an announced update against the model and starts tracking it."""
        if info.update_id in self._announced:
            raise self._reject(
                f"update {info.update_id} was already announced to this worker: deliver each "
                "announcement once (a new send has a new update_id)"
            )
        specs = self.check_update(info)
        self._announced.append(info.update_id)
        progress = self._progress
        if progress is not None:
            self._mappings.clear()  # the abandoned update's memory: never read again
        if progress is not None and progress.touched:
            logger.warning(
                "worker %d: update %s was left incomplete; its weights stay torn until "
                "update %s completes",
                self.worker_index,
                progress.update_id,
                info.update_id,
            )
        self._progress = _Progress(info.update_id, specs, info.weight_version) if specs else None

    def _check_part(self, info: IPCWeightTransferUpdateInfo) -> _Progress:
        """Checks that a part continues the announced update, in order; returns its progress."""
        progress = self._progress
        if progress is None or progress.update_id != info.update_id:
            raise self._reject(
                f"update {info.update_id} was not announced to this worker: deliver the "
                "announcement (ipc_handles null) to every worker before the parts"
            )
        part = info.specs()
        end = info.first_index + len(part)
        if info.first_index != progress.next_index:
            raise self._reject(
                f"update {info.update_id}: this part starts at tensor {info.first_index} but the "
                f"worker expects tensor {progress.next_index}: deliver parts once each, in order"
            )
        if part != progress.specs[info.first_index : end] or (
            info.weight_version != progress.weight_version
        ):
            raise self._reject(
                f"update {info.update_id}: the part's tensors {info.first_index}..{end - 1} or "
                "weight_version differ from what was announced"
            )
        return progress

    def _load_part(
        self,
        info: IPCWeightTransferUpdateInfo,
        part: list[TensorSpec],
        load_weights: LoadWeightsFn,
    ) -> None:
        """Resolves every record of a part, then hands the tensors to `load_weights`."""
        regions: dict[object, torch.Tensor] = {}
        resolve = self._mappings.resolve
        try:
            tensors = [
                (spec.name, resolve(handle, spec, regions, f"ipc_handles[{i}] ({spec.name!r})"))
                for i, (handle, spec) in enumerate(zip(info.handles(), part, strict=True))
            ]
        except WeightValidationError as exc:
            raise self._reject(str(exc)) from None
        try:
            with torch.no_grad():  # loaders copy into parameters that may require grad
                load_weights(tensors)
            for device in {t.device for _, t in tensors if t.is_cuda}:
                # The trainer refills its buffer once we return: our copies must be done.
                synchronize(device, timeout_s=DEFAULT_TIMEOUT_S, what="load_weights' copies")
        except Exception as exc:
            raise self._fail(f"load_weights failed: {type(exc).__name__}: {exc}") from exc
        finally:
            del tensors

    def _reject(self, message: str) -> WeightValidationError:
        """The error for a refused delivery; the update in progress, if any, is untouched.

        A late, stray, duplicated or malformed message moves no byte, so the update it does not
        belong to goes on as if it never came.
        """
        return WeightValidationError(f"delivery refused, no byte moved: {message}")

    def _fail(self, message: str) -> WeightTransferError:
        """Drops the update after its weights may have been written in part; returns the error."""
        self.abort_update()
        return WeightTransferError(
            f"worker {self.worker_index}: IPC weight transfer failed: {message}; the weights may "
            "be torn: send a complete update",
            partially_applied=True,
        )

    def abort_update(self) -> None:
        """Forgets the update in progress and unmaps every region; its late parts are refused."""
        self._progress = None
        self._mappings.clear()

    def shutdown(self) -> None:
        """Drops every mapping and the session, and stops the watch. Safe to call twice."""
        Watch.stop_if_any(self._watch)
        self._session, self._progress, self._watch = None, None, None
        self._announced.clear()
        self._mappings = RegionCache()
