"""The receiver's open regions: shared-memory mappings and imported CUDA storages, kept across updates."""

from __future__ import annotations

import logging
import threading

import torch

from weightsync.errors import WeightValidationError
from weightsync.transfer import _shm as shm
from weightsync.transfer._cuda_ipc import import_cuda_storage
from weightsync.transfer._ipc_records import IPCHandle
from weightsync.transfer.base import TensorSpec

logger = logging.getLogger(__name__)


class RegionCache:
    """The memory a receiver of `session` has opened, reused while current, dropped once unused.

    A packed buffer is thus mapped (or imported) once and read by every later update.

    Args:
        session: The trainer's session; only its segments may be attached (None: none may).
    """

    def __init__(self, session: str | None = None) -> None:
        self._session = session
        self._segments: dict[str, shm.AttachedSegment] = {}
        self._cuda: dict[tuple[str, int], torch.Tensor] = {}
        self._used: set[object] = set()
        # Deliveries and the receiver's watch (`drop_gone`) change the maps from two threads.
        self._lock = threading.Lock()

    def resolve(
        self, handle: IPCHandle, spec: TensorSpec, regions: dict[object, torch.Tensor], where: str
    ) -> torch.Tensor:
        """Checks a record against the live memory and returns the tensor it locates.

        `regions` holds the regions already opened for this delivery: each is checked and, for
        CUDA, imported once per delivery, matching the trainer's one export per delivery.
        """
        if handle.nbytes == 0:
            return torch.empty(spec.shape, dtype=spec.dtype)
        key: object = handle.cuda.cache_key if handle.cuda is not None else handle.segment
        region = regions.get(key)
        if region is None:
            if handle.cuda is not None:
                if handle.offset + handle.nbytes > handle.cuda.storage_nbytes:
                    raise WeightValidationError(  # refused before the handle is even opened
                        f"{where}: offset {handle.offset} + nbytes {handle.nbytes} reaches past "
                        f"the end of the CUDA storage ({handle.cuda.storage_nbytes} bytes)"
                    )
                region = import_cuda_storage(handle.cuda, where=where)
                # Kept open across updates: importing a handle whose storage was freed would
                # open it anew, and the producer's reference count would be released twice.
                self._cuda[handle.cuda.cache_key] = region
                self._used.add(key)
            else:
                assert handle.segment is not None
                region = self._attach(handle.segment, where)
            regions[key] = region
        try:
            return handle.view(region)
        except WeightValidationError as exc:
            raise WeightValidationError(f"{where}: {exc}") from None

    def _attach(self, name: str, where: str) -> torch.Tensor:
        """Returns the mapping of segment `name`, reusing a cached one while it is still current.

        Current means the same segment at the same size: a segment its owner truncated since is
        mapped again at its new size, so that a record reaching past the new end is refused
        (`IPCHandle.view`) instead of read, which would kill this process with SIGBUS.
        """
        if self._session is None or not shm.segment_belongs_to(name, self._session):
            raise WeightValidationError(
                f"{where}.segment {name!r} is not a segment of session {self._session}: "
                "initialize this worker with the trainer's current init_info"
            )
        try:
            identity = shm.segment_identity(name)
            with self._lock:
                cached = self._segments.get(name)
                if cached is None or cached.identity != identity:
                    cached = self._segments[name] = shm.attach_segment(name)
                self._used.add(name)
        except WeightValidationError as exc:
            raise WeightValidationError(f"{where}: {exc}") from None
        return cached.tensor

    @property
    def open_segments(self) -> list[str]:
        """Names of the shared-memory segments mapped now."""
        return sorted(self._segments)

    def clear(self) -> None:
        """Unmaps everything: after an abandoned update nothing it mapped is worth keeping.

        Its segments may be unlinked already (the trainer drops its buffers after a failure);
        a mapping would keep their memory alive for as long as this receiver lives.
        """
        with self._lock:
            self._segments, self._cuda, self._used = {}, {}, set()

    def drop_unused(self) -> None:
        """Unmaps what the update that just completed did not use."""
        with self._lock:
            self._segments = {k: v for k, v in self._segments.items() if k in self._used}
            self._cuda = {k: v for k, v in self._cuda.items() if k in self._used}
            self._used = set()

    def drop_gone(self) -> list[str]:
        """Unmaps the segments that are gone: unlinked by their owner, or replaced or resized.

        A trainer unlinks its segments when it closes its session (or its janitor does, when
        it died): nothing will read their mappings again, which would keep their memory alive
        for as long as this receiver lives. Returns the names unmapped.
        """
        gone = []
        for name, attached in list(self._segments.items()):
            try:
                current = shm.segment_identity(name)
            except WeightValidationError:  # unlinked: the name no longer opens
                current = None
            if current != attached.identity:
                gone.append(name)
        if gone:
            with self._lock:
                for name in gone:
                    self._segments.pop(name, None)
            logger.info("unmapped %d segments their trainer released: %s", len(gone), gone)
        return gone
