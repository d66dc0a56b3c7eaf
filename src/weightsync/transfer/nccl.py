"""Trainer-rooted broadcast, worker side: backend `nccl` (CUDA tensors) and `gloo` (CPU tensors).

Both backends speak one protocol (a handshake, then the buckets) over a group of their own (rank
0 the trainer, workers from `rank_offset`); only the communicator differs, so
[`NCCLWeightTransferEngine`][weightsync.transfer.nccl.NCCLWeightTransferEngine] and
[`GlooWeightTransferEngine`][weightsync.transfer.nccl.GlooWeightTransferEngine] are siblings over
one private base. The trainer side is in
[`weightsync.transfer.nccl_trainer`][weightsync.transfer.nccl_trainer].
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from weightsync.errors import WeightSyncError, WeightTransferError, WeightValidationError
from weightsync.transfer import _broadcast as broadcast
from weightsync.transfer._broadcast import InFlight
from weightsync.transfer._group import INIT_ERRORS, BroadcastGroup, check_backend, check_port
from weightsync.transfer._handshake import WorkerHandshake
from weightsync.transfer._identity import metadata_digest, send_identity
from weightsync.transfer._watch import Watch, exclusive
from weightsync.transfer.base import (
    LoadWeightsFn,
    TensorSpec,
    TransferStats,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
    WireParams,
)
from weightsync.transfer.base import _is_int as is_int
from weightsync.transfer.buckets import Bucket, _direct_region, unpack_bucket
from weightsync.transfer.buckets import _BufferPool as BufferPool
from weightsync.transfer.buckets import _byte_buffers as byte_buffers
from weightsync.transfer.buckets import _Window as Window

__all__ = [
    "GlooWeightTransferEngine",
    "NCCLWeightTransferEngine",
    "NCCLWeightTransferInitInfo",
]

logger = logging.getLogger(__name__)

_DEFAULT_WIRE = WireParams()  # the one place the wire's defaults are set
_WIRE_KEYS = ("backend", "world_size", *_DEFAULT_WIRE.to_dict())


@dataclass
class NCCLWeightTransferInitInfo(WeightTransferInitInfo):
    """How a worker joins a trainer's broadcast group; built by the trainer, never by hand.

    Take it from [`TrainerGroup.init_info`][weightsync.transfer.nccl_trainer.TrainerGroup.init_info]:
    the wire parameters (`packed` to `timeout_s`) are decided by the trainer and checked again
    against the trainer's own copy when the worker joins.

    Attributes:
        master_address: Host of the trainer (it runs the group's store).
        master_port: Port of the trainer's store.
        world_size: 1 (the trainer) + the number of workers.
        rank_offset: Rank of the first worker; worker `i` is rank `rank_offset + i`.
        backend: `"nccl"` (CUDA tensors) or `"gloo"` (CPU tensors).
        packed: Whether tensors travel packed into buckets (True) or one broadcast each.
        bucket_size_bytes: Bucket size in bytes (packed mode).
        num_buffers: Buckets in flight at once; also the number of reusable bucket buffers.
        timeout_s: Limit for the rendezvous and each collective, in seconds.
    """

    master_address: str
    master_port: int
    world_size: int
    rank_offset: int = 1
    backend: str = "nccl"
    packed: bool = _DEFAULT_WIRE.packed
    bucket_size_bytes: int = _DEFAULT_WIRE.bucket_size_bytes
    num_buffers: int = _DEFAULT_WIRE.num_buffers
    timeout_s: float = _DEFAULT_WIRE.timeout_s

    def __post_init__(self) -> None:
        if not isinstance(self.master_address, str) or not self.master_address:
            raise WeightValidationError(
                f"master_address must be a non-empty host name, got {self.master_address!r}"
            )
        check_port(self.master_port, allow_zero=False)
        for key, low in (("world_size", 2), ("rank_offset", 1)):
            value = getattr(self, key)
            if not is_int(value) or value < low:
                raise WeightValidationError(f"{key} must be an int >= {low}, got {value!r}")
        self.timeout_s = self.wire.timeout_s  # validates the four, and keeps a float on the wire

    @classmethod
    def create(
        cls,
        *,
        master_address: str,
        master_port: int,
        world_size: int,
        backend: str,
        wire: WireParams,
    ) -> NCCLWeightTransferInitInfo:
        """The init info of a group with these wire parameters."""
        return cls(
            master_address=master_address,
            master_port=master_port,
            world_size=world_size,
            backend=backend,
            **wire.to_dict(),
        )

    @property
    def wire(self) -> WireParams:
        """The wire parameters, validated."""
        return WireParams(
            packed=self.packed,
            bucket_size_bytes=self.bucket_size_bytes,
            num_buffers=self.num_buffers,
            timeout_s=self.timeout_s,
        )

    def wire_params(self) -> dict[str, object]:
        """Returns the parameters both sides must agree on."""
        return {key: getattr(self, key) for key in _WIRE_KEYS}


# vLLM's worker init info names two wire parameters its own way, and names no backend (a
# vLLM server takes its backend from its own configuration, as a weightsync engine may).
_VLLM_INIT_KEYS = {
    "packed_buffer_size_bytes": "bucket_size_bytes",
    "packed_num_buffers": "num_buffers",
}


def _from_vllm_keys(init_info: Mapping[str, Any], backend: str) -> dict[str, Any]:
    """`init_info` with vLLM's key names translated, and this engine's backend if none is named.

    Raises:
        WeightValidationError: A vLLM key and its weightsync twin disagree, or vLLM's NCCL
            unique-id rendezvous is asked for (weightsync's rendezvous is the trainer's store).
    """
    data = dict(init_info)
    unique_id = "nccl_unique_id_b64"
    if unique_id in data:
        raise WeightValidationError(
            f"init_info.{unique_id}: vLLM's NCCL unique-id rendezvous is not weightsync's wire; a "
            "weightsync worker joins the trainer's store at master_address:master_port"
        )
    for vllm_key, key in _VLLM_INIT_KEYS.items():
        if vllm_key in data:
            value = data.pop(vllm_key)
            if key in data and data[key] != value:
                raise WeightValidationError(
                    f"init_info.{vllm_key} ({value!r}) and init_info.{key} ({data[key]!r}) name "
                    f"the same wire parameter with different values: send one of them"
                )
            data[key] = value
    data.setdefault("backend", backend)
    return data


# vLLM's update info of 0.16 to 0.25 carried three wire parameters, and TRL still sends them to
# servers older than 0.28. Here the trainer decides them at init: the update info may repeat them.
_VLLM_UPDATE_WIRE_KEYS = {
    "packed": "packed",
    "packed_buffer_size_bytes": "bucket_size_bytes",
    "packed_num_buffers": "num_buffers",
}


def _without_vllm_wire_keys(
    update_info: Mapping[str, Any], wire: WireParams | None
) -> dict[str, Any]:
    """`update_info` without vLLM's older wire keys, once each agrees with the group's `wire`.

    Raises:
        WeightValidationError: A key whose value differs from the group's (the two sides would
            cut different buckets); nothing moved.
    """
    data = dict(update_info)
    for vllm_key, key in _VLLM_UPDATE_WIRE_KEYS.items():
        if vllm_key not in data:
            continue
        value = data.pop(vllm_key)
        expected = getattr(wire if wire is not None else _DEFAULT_WIRE, key)
        if type(value) is not type(expected) or value != expected:
            raise WeightValidationError(
                f"update_info.{vllm_key} is {value!r}, but the group's wire parameters, decided "
                f"by the trainer at init, have {key}={expected!r}: leave {vllm_key} out of "
                "update_info (vLLM 0.28 moved it to the init info), or give it the group's value"
            )
    return data


class _BroadcastWeightTransferEngine(WeightTransferEngine):
    """Worker side of the broadcast transfer; subclasses name the backend.

    Arguments as for [`WeightTransferEngine`][weightsync.transfer.base.WeightTransferEngine]; its
    rank is `rank_offset + worker_index`. When a bucket's tensors lie in `params` at the plan's
    offsets (a module laid out by [`flatten_module`][weightsync.transfer.buckets.flatten_module], or
    tensors from [`flat_tensors`][weightsync.transfer.buckets.flat_tensors]), the bucket is received
    straight into parameter memory.

    Raises:
        WeightValidationError: The backend cannot run in this process (`nccl` without CUDA).

    Receiver memory beyond the model is at most `num_buffers` x the largest bucket, and nothing
    for buckets received in place.
    """

    backend: ClassVar[str]
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
        self._pool: BufferPool[torch.Tensor] | None = None
        self._handshake: WorkerHandshake | None = None
        self._watch: Watch | None = None  # frees what a trainer left, between updates
        # Held by every call that uses the group; the watch never waits for it.
        self._busy = threading.RLock()
        # Who claims this worker's rank: the same engine retrying its join may claim it again.
        self._claimant = uuid.uuid4().hex

    @property
    def is_initialized(self) -> bool:
        """Whether this worker is in a live group."""
        return self._group is not None and self._group.is_connected

    def parse_init_info(self, init_info: Mapping[str, Any] | WeightTransferInitInfo) -> Any:
        """Parses the init info: vLLM's key names too; the backend defaults to this engine's."""
        if isinstance(init_info, Mapping):
            init_info = _from_vllm_keys(init_info, self.backend)
        return super().parse_init_info(init_info)

    def parse_update_info(self, update_info: Mapping[str, Any] | WeightTransferUpdateInfo) -> Any:
        """Parses the update info; vLLM's older keys too, when they agree with the group.

        vLLM's update info before 0.28 repeated the wire parameters (`packed`,
        `packed_buffer_size_bytes`, `packed_num_buffers`); each is taken when it has the
        group's value, and refused by name otherwise.
        """
        if isinstance(update_info, Mapping):
            wire = self._info.wire if self._info is not None else None
            update_info = _without_vllm_wire_keys(update_info, wire)
        return super().parse_update_info(update_info)

    @exclusive
    def init_transfer_engine(self, init_info: Mapping[str, Any] | WeightTransferInitInfo) -> None:
        """Joins the trainer's group; blocks until every rank joined or `timeout_s` passed.

        Re-initializing replaces the current group (after a failure, or for a new trainer).
        vLLM's init info is taken as well (`packed_buffer_size_bytes`, `packed_num_buffers`; no
        `backend`): only its NCCL unique-id rendezvous is refused.

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
        deadline = time.monotonic() + info.timeout_s  # one timeout_s for the whole join
        group = BroadcastGroup(
            backend=info.backend,
            master_address=info.master_address,
            master_port=info.master_port,
            rank=rank,
            world_size=info.world_size,
            timeout_s=info.timeout_s,
        )
        try:
            trainer_wire = group.get("wire", timeout_s=max(deadline - time.monotonic(), 0.001))
            if not isinstance(trainer_wire, dict):  # a value from the network: check its type
                raise WeightValidationError(
                    f"the store at {info.master_address}:{info.master_port} holds no trainer's "
                    f"wire parameters (got {type(trainer_wire).__name__}): pass the worker the "
                    "init_info of a weightsync trainer group"
                )
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
            group.claim_rank(self._claimant)
            group.connect(timeout_s=deadline - time.monotonic())
        except Exception as exc:
            with contextlib.suppress(Exception):  # the store may be gone: the error matters
                group.append(INIT_ERRORS, f"rank {rank}: {type(exc).__name__}: {exc}"[:4000])
            group.close()
            raise
        self._group, self._info, self._handshake = group, info, WorkerHandshake(group)
        self._watch = Watch(self._release_gone, name="weightsync-group-watch")
        logger.info("worker rank %d joined a %s group of %d", rank, info.backend, info.world_size)

    @exclusive
    def receive_weights(
        self,
        update_info: Mapping[str, Any] | WeightTransferUpdateInfo,
        load_weights: LoadWeightsFn,
    ) -> TransferStats:
        """Receives one update (see the base class); validation happens before any byte moves.

        A message this worker refuses is answered at once, whether or not the trainer is
        broadcasting yet (see `refuse_update`); an accepted one waits, `timeout_s` at most, for
        the trainer's update. After a failure the group is closed: call `init_transfer_engine`
        again for the next update.
        """
        group, info, handshake = self._group, self._info, self._handshake
        if group is None or info is None or handshake is None or not group.is_connected:
            raise WeightTransferError(
                "the transfer engine is not initialized (or its group closed after a failure): "
                "call init_transfer_engine(init_info) first"
            )
        start = time.perf_counter()
        send = send_identity(update_info)
        try:
            specs = self.check_update(self.parse_update_info(update_info))
        except WeightValidationError as exc:
            self._refuse(update_info, str(exc))
            raise
        try:
            handshake.join(send, specs)
        except WeightValidationError:
            raise
        except WeightTransferError as exc:
            raise broadcast.transfer_failed(group, exc, partially_applied=False) from exc
        stats = TransferStats(
            num_tensors=len(specs),
            num_bytes=sum(s.nbytes for s in specs),
            loaded_names=[s.name for s in specs],
        )
        if self._pool is None:
            self._pool = byte_buffers(info.num_buffers, group.device)
        self._pool.reset()
        buckets = broadcast.plan(specs, info.wire)
        window: Window[InFlight] = Window(
            info.num_buffers, lambda item: self._land(item, load_weights, stats)
        )
        touched = False  # whether any byte of the model may have been overwritten
        try:
            for bucket in buckets:
                touched |= len(window) >= info.num_buffers  # a bucket lands in make_room
                window.make_room()
                item = self._post(group, bucket)
                window.push(item)
                touched |= item.region is not None  # received straight into the model
            touched |= len(window) > 0
            window.drain()
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

    @exclusive
    def refuse_update(
        self,
        update_info: Mapping[str, Any] | WeightTransferUpdateInfo,
        reason: WeightSyncError,
    ) -> None:
        """Answers the update's handshake with `reason` at once (see the base class)."""
        if self.is_initialized:  # else no trainer can be waiting on this rank
            self._refuse(update_info, f"{type(reason).__name__}: {reason}")

    def _refuse(
        self, update_info: Mapping[str, Any] | WeightTransferUpdateInfo, reason: str
    ) -> None:
        """Answers the handshake with a refusal of `update_info`'s message."""
        if self._handshake is None:
            return
        try:  # what the message lists, so that only an update announcing it takes the refusal
            digest: int | None = metadata_digest(self.parse_update_info(update_info).specs())
        except WeightValidationError:
            digest = None  # it lists nothing readable: no update announces it
        if not self._handshake.refuse(send_identity(update_info), reason, digest):
            self.shutdown()  # the trainer is gone: leave its group

    def _post(self, group: BroadcastGroup, bucket: Bucket) -> InFlight:
        """Starts receiving `bucket`, in place when the params allow it."""
        if bucket.nbytes == 0:
            return InFlight(None, bucket)
        region = None
        if self.params is not None:
            targets = [self.params.get(slot.spec.name) for slot in bucket.slots]
            if all(t is not None and t.device == group.device for t in targets):
                region = _direct_region(bucket, targets)  # type: ignore[arg-type]
        what = f"receiving bucket of {len(bucket.slots)} tensors from {bucket.slots[0].spec.name!r}"
        if region is not None:
            saved = region.save_gaps()
            return InFlight(
                group.broadcast(region.data, what), bucket, region.data, None, region, saved
            )
        assert self._pool is not None
        index, buffer = self._pool.take(bucket.nbytes)
        data = buffer[: bucket.nbytes]
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

    def _release_gone(self) -> bool:
        """The watch's: leaves the group if its trainer is gone, freeing its connections and port.

        A call in progress finds out for itself: this never waits for it. Returns whether the
        group is still joined.
        """
        if not self._busy.acquire(blocking=False):
            return True
        try:
            if self._handshake is not None and self._handshake.trainer_is_gone():
                self._leave()
            return self._group is not None
        finally:
            self._busy.release()

    @exclusive
    def shutdown(self) -> None:
        """Leaves the group, frees the bucket buffers and stops the watch. Safe to call twice."""
        Watch.stop_if_any(self._watch)
        self._watch = None
        self._leave()

    def _leave(self) -> None:
        if self._group is not None:
            self._group.close()
        self._group, self._info, self._pool, self._handshake = None, None, None, None


class NCCLWeightTransferEngine(_BroadcastWeightTransferEngine):
    """Worker side of the broadcast transfer over NCCL: CUDA tensors, one GPU per rank.

    Arguments, behaviour and errors as described in the module; see
    [`WeightTransferEngine`][weightsync.transfer.base.WeightTransferEngine] for the lifecycle.
    """

    backend: ClassVar[str] = "nccl"


class GlooWeightTransferEngine(_BroadcastWeightTransferEngine):
    """Worker side of the broadcast transfer over gloo: the same protocol on CPU tensors."""

    backend: ClassVar[str] = "gloo"
