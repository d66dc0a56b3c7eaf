"""Naming memory across processes: shared-memory segments, handle records, CUDA IPC, open regions.

One concept: how one process names memory another maps, from creation to release. A trainer
exports a region (a POSIX shared-memory segment on CPUs, a CUDA allocation on GPUs) and names each
tensor in it with a JSON-safe [`IPCHandle`][weightsync.transfer.memory.IPCHandle] record; a
receiver checks the record, opens the region once and views the tensor in place. Segments are
named `<session>-<n>`: a receiver attaches only to its own session's, and none leaks (the owner
unlinks them; a `SegmentJanitor` process, told each name before the segment exists, unlinks the
rest once the owner is gone, even after SIGKILL). Every private torch call is here.
"""

from __future__ import annotations

import _posixshmem  # type: ignore[import-not-found]  # stdlib shm_open/shm_unlink, no tracker
import base64
import contextlib
import ctypes
import errno
import logging
import math
import mmap
import os
import re
import secrets
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing import reductions

from weightsync.errors import WeightTransferError, WeightTransferTimeout, WeightValidationError
from weightsync.transfer.base import _MAX_DIMS, TensorSpec, _is_int, dtype_from_name, dtype_name

__all__ = [
    "REF_COUNTER_SLOTS",
    "SESSION_PREFIX",
    "SHM_LIMIT_ENV",
    "CUDAStorageHandle",
    "IPCHandle",
    "RegionCache",
    "SegmentJanitor",
    "SharedSegment",
    "attach_segment",
    "cuda_device_uuids",
    "export_cuda_storage",
    "is_session_name",
    "new_session_name",
    "synchronize",
]

logger = logging.getLogger(__name__)

# --- POSIX shared memory ------------------------------------------------------------------------

SESSION_PREFIX = "weightsync-"
"""Every segment weightsync creates has a name starting with this prefix."""
SHM_LIMIT_ENV = "WEIGHTSYNC_SHM_LIMIT_BYTES"
"""Test hook: a segment larger than this many bytes fails as on a full `/dev/shm` (ENOSPC)."""

_SESSION_RE = re.compile(r"weightsync-[0-9a-f]{12}")
_SEGMENT_RE = re.compile(r"weightsync-[0-9a-f]{12}-[0-9]{1,6}")
# Populating maps every page up front, several times cheaper than first-touch faults.
_MAP_FLAGS = mmap.MAP_SHARED | mmap.MAP_POPULATE
# The janitor runs in a fresh interpreter (`-I`), sharing nothing with the trainer but this pipe.
# It watches the trainer's pid as well as the pipe: a child the trainer forked (a DataLoader
# worker) inherits the pipe's write end and would keep it open long after the trainer died.
_JANITOR_SOURCE = """
import os, select, signal, sys, _posixshmem
signal.signal(signal.SIGINT, signal.SIG_IGN)
prefix, owner, names = sys.argv[1] + "-", int(sys.argv[2]), set()
fd, rest = sys.stdin.fileno(), b""
try:
    watch, tick = [fd, os.pidfd_open(owner)], None
except (AttributeError, OSError):
    watch, tick = [fd], 0.5
def take():
    global rest
    chunk = os.read(fd, 65536)
    *lines, rest = (rest + chunk).split(b"\\n")
    for line in lines:
        name = line[1:].strip().decode("ascii", "replace")
        if name.startswith(prefix):
            (names.add if line[:1] == b"+" else names.discard)(name)
    return bool(chunk)
while os.getppid() == owner:
    ready = select.select(watch, [], [], tick)[0]
    if ready and not (fd in ready and take()):
        break  # the pipe reached its end, or the owner exited
while select.select([fd], [], [], 0)[0] and take():
    pass
for name in names:
    try:
        _posixshmem.shm_unlink("/" + name)
    except OSError:
        pass
"""


def new_session_name() -> str:
    """A fresh, unguessable session name (`weightsync-` + 12 hex digits)."""
    return SESSION_PREFIX + secrets.token_hex(6)


def is_session_name(name: object) -> bool:
    """Whether `name` has the form of a session name."""
    return isinstance(name, str) and _SESSION_RE.fullmatch(name) is not None


def _segment_belongs_to(name: str, session: str) -> bool:
    """Whether a receiver of `session` may attach segment `name`: only the session's own."""
    return _SEGMENT_RE.fullmatch(name) is not None and name.startswith(session + "-")


def _unlink_segment(name: str) -> bool:
    """Removes `name` (mappings stay valid); False if it was already gone."""
    try:
        _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        return False
    return True


def _free_space_hint() -> str:
    try:
        stat = os.statvfs("/dev/shm")
    except OSError:
        return ""
    return (
        f" (/dev/shm has {stat.f_bavail * stat.f_frsize / 2**20:.0f} MiB free: enlarge it, e.g. "
        "`docker run --shm-size`, or lower bucket_size_bytes)"
    )


class SharedSegment:
    """A segment this process created and owns; `tensor` is its bytes, valid after `unlink`."""

    def __init__(self, name: str, nbytes: int) -> None:
        if nbytes < 1:
            raise WeightValidationError(f"a segment needs nbytes >= 1, got {nbytes}")
        limit = os.environ.get(SHM_LIMIT_ENV)
        if limit is not None and not limit.isdigit():
            raise WeightValidationError(f"{SHM_LIMIT_ENV} must be a number of bytes, got {limit!r}")
        self.name, self.nbytes = name, nbytes
        try:
            if limit is not None and nbytes > int(limit):
                raise OSError(errno.ENOSPC, f"No space left on device ({SHM_LIMIT_ENV}={limit})")
            fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
            try:  # pages reserved now: a full /dev/shm fails here (ENOSPC), not by SIGBUS later
                os.posix_fallocate(fd, 0, nbytes)
                mapping = mmap.mmap(fd, nbytes, _MAP_FLAGS, mmap.PROT_READ | mmap.PROT_WRITE)
            except OSError:
                _unlink_segment(name)
                raise
            finally:
                os.close(fd)
        except OSError as exc:  # the name is taken, or /dev/shm is missing, not writable or full
            raise WeightTransferError(
                f"cannot create shared-memory segment {name!r} of {nbytes} bytes: {exc}"
                f"{_free_space_hint()}"
            ) from exc
        self.tensor = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping alive

    @property
    def address(self) -> int:
        """Address of the first byte in this process."""
        return int(self.tensor.data_ptr())

    def contains(self, address: int, nbytes: int) -> bool:
        """Whether `nbytes` bytes from `address` lie inside this segment."""
        return self.address <= address and address + nbytes <= self.address + self.nbytes

    def unlink(self) -> None:
        """Removes the name; this process's views stay valid. Safe to call twice."""
        _unlink_segment(self.name)


@dataclass(frozen=True)
class _AttachedSegment:
    """A read-only mapping of another process's segment; `identity` is `(dev, inode, size)`."""

    identity: tuple[int, int, int]
    tensor: torch.Tensor  # read-only memory: a receiver can never corrupt the trainer's weights

    @property
    def nbytes(self) -> int:
        return int(self.tensor.numel())


def _open_existing(name: str) -> tuple[int, tuple[int, int, int]]:
    """A read-only descriptor of segment `name`, and its `(device, inode, size)`."""
    try:
        fd: int = _posixshmem.shm_open("/" + name, os.O_RDONLY, mode=0)
    except FileNotFoundError:
        raise WeightValidationError(
            f"shared-memory segment {name!r} does not exist: the trainer unlinked it (after a "
            "failure or on shutdown) or its process exited; send the update again"
        ) from None
    except OSError as exc:
        raise WeightValidationError(f"cannot open shared-memory segment {name!r}: {exc}") from exc
    stat = os.fstat(fd)
    return fd, (stat.st_dev, stat.st_ino, stat.st_size)


def _segment_identity(name: str) -> tuple[int, int, int]:
    """`(device, inode, size)` of an existing segment: a mapping is current while it is unchanged."""
    fd, identity = _open_existing(name)
    os.close(fd)
    return identity


def attach_segment(name: str) -> _AttachedSegment:
    """Maps segment `name` read-only."""
    fd, identity = _open_existing(name)
    tensor = torch.empty(0, dtype=torch.uint8)
    try:
        if identity[2]:
            mapping = mmap.mmap(fd, identity[2], _MAP_FLAGS, mmap.PROT_READ)
            with warnings.catch_warnings():  # torch warns the buffer is read-only: the point
                warnings.simplefilter("ignore", UserWarning)
                tensor = torch.frombuffer(mapping, dtype=torch.uint8)
    except OSError as exc:
        raise WeightValidationError(f"cannot map shared-memory segment {name!r}: {exc}") from exc
    finally:
        os.close(fd)
    return _AttachedSegment(identity, tensor)


class SegmentJanitor:
    """A process that unlinks a session's tracked segments once their owner is gone (Ctrl-C too)."""

    def __init__(self, session: str) -> None:
        self.session = session
        self._process: subprocess.Popen[bytes] | None = subprocess.Popen(
            [sys.executable, "-I", "-c", _JANITOR_SOURCE, session, str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        assert self._process.stdin is not None
        self._pipe = self._process.stdin.fileno()
        os.set_blocking(self._pipe, False)  # a janitor that stopped reading never blocks us

    @property
    def pid(self) -> int | None:
        """Process id of the janitor (None once closed)."""
        return self._process.pid if self._process is not None else None

    def _send(self, line: bytes) -> None:
        process = self._process
        if process is None:
            raise WeightTransferError(
                f"the segment janitor of session {self.session} is closed: segments created "
                "now would outlive a crashed trainer; start a new session (ipc_trainer_init)"
            )
        try:
            if process.poll() is not None:
                raise BrokenPipeError(f"it exited with code {process.returncode}")
            if os.write(self._pipe, line) != len(line):
                raise BlockingIOError("its pipe is full: it stopped reading")
        except OSError as exc:
            raise WeightTransferError(
                f"the segment janitor of session {self.session} is gone ({exc}): segments "
                "created now would outlive a crashed trainer; close this session and start a "
                "new one (ipc_trainer_init); unlink leftovers under /dev/shm by hand"
            ) from exc

    def track(self, name: str) -> None:
        """Announces segment `name`; call before creating it (raises if the janitor is gone)."""
        self._send(b"+" + name.encode() + b"\n")

    def forget(self, name: str) -> None:
        """Withdraws an unlinked segment; a gone janitor is only logged."""
        try:
            self._send(b"-" + name.encode() + b"\n")
        except WeightTransferError as exc:
            logger.warning("%s", exc)

    def check(self) -> None:
        """Raises if the janitor is gone, before the trainer exports memory that could leak."""
        self._send(b"\n")  # an empty line: the janitor skips it

    def close(self, timeout_s: float = 10.0) -> None:
        """Lets the janitor unlink what is still tracked and waits for it. Safe to call twice."""
        process, self._process = self._process, None
        if process is None:
            return
        if process.stdin is not None:
            with contextlib.suppress(OSError):
                process.stdin.close()
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("segment janitor %d did not exit within %g s", process.pid, timeout_s)


# --- handle records -----------------------------------------------------------------------------

_RECORD_KEYS = frozenset({"segment", "cuda", "offset", "nbytes", "dtype", "shape"})


def _fields(data: object, where: str, keys: Any, required: Any, counts: Any) -> Mapping[str, Any]:
    """`data` as a mapping with all `required` keys, no key outside `keys`, `counts` ints >= 0."""
    if not isinstance(data, Mapping):
        raise WeightValidationError(f"{where} must be an object, got {type(data).__name__}")
    unknown, missing = sorted(set(data) - set(keys)), sorted(set(required) - set(data))
    if unknown or missing:
        raise WeightValidationError(
            f"{where} has unknown keys {unknown} and lacks keys {missing}; "
            f"expected keys: {sorted(keys)}"
        )
    for key in counts:
        if not _is_int(data[key]) or data[key] < 0:
            raise WeightValidationError(f"{where}.{key} must be an int >= 0, got {data[key]!r}")
    return data


@dataclass(frozen=True)
class CUDAStorageHandle:
    """A CUDA allocation exported with CUDA IPC, as JSON-safe fields (the wire page's `cuda`).

    Mirrors what torch's CUDA IPC export of a storage returns, minus the device index: a device
    index means nothing in another process, so the physical GPU is named by its UUID.
    """

    device_uuid: str
    handle: str
    storage_nbytes: int
    storage_offset: int
    ref_counter_handle: str
    ref_counter_offset: int
    event_handle: str | None
    event_sync_required: bool

    @classmethod
    def from_dict(cls, data: object, *, where: str) -> CUDAStorageHandle:
        """Builds the handle from its dict form, checking every field's type."""
        fields, where = cls.__dataclass_fields__, f"{where}.cuda"
        counts = ("storage_nbytes", "storage_offset", "ref_counter_offset")
        data = _fields(data, where, fields, fields, counts)
        if not isinstance(data["device_uuid"], str) or not data["device_uuid"]:
            raise WeightValidationError(f"{where}.device_uuid must be a non-empty string")
        for key in ("handle", "ref_counter_handle", "event_handle"):
            value = data[key]
            if key != "event_handle" or value is not None:  # only the event may be absent
                if not isinstance(value, str):
                    raise WeightValidationError(
                        f"{where}.{key} must be a base64 string, got {type(value).__name__}"
                    )
                try:
                    base64.b64decode(value, validate=True)
                except ValueError:  # binascii.Error
                    raise WeightValidationError(f"{where}.{key} is not valid base64") from None
        if not isinstance(data["event_sync_required"], bool):
            raise WeightValidationError(f"{where}.event_sync_required must be a bool")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        """Returns the JSON-safe dict form."""
        return dict(vars(self))

    @property
    def cache_key(self) -> tuple[str, int]:
        """Identifies the exported storage: the same key means the same memory."""
        return self.handle, self.storage_offset


@dataclass(frozen=True)
class IPCHandle:
    """Where one tensor's bytes are: a region (`segment` or `cuda`), a byte offset, what they are.

    Records hold strings, ints, bools and lists only: they survive JSON unchanged, and reading
    one never unpickles, evaluates or imports anything.
    """

    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    segment: str | None = None
    cuda: CUDAStorageHandle | None = None

    @classmethod
    def from_dict(cls, data: object, *, where: str, spec: TensorSpec | None = None) -> IPCHandle:
        """Checks a record's form and consistency (and against `spec`), touching no memory."""
        required = ("offset", "nbytes", "dtype", "shape")
        data = _fields(data, where, _RECORD_KEYS, required, ("offset", "nbytes"))
        try:
            dtype = dtype_from_name(data["dtype"])
        except WeightValidationError as exc:
            raise WeightValidationError(f"{where}: {exc}") from None
        offset, nbytes, shape = data["offset"], data["nbytes"], data["shape"]
        if isinstance(shape, list | tuple) and len(shape) > _MAX_DIMS:
            raise WeightValidationError(
                f"{where}.shape has {len(shape)} dims, more than the {_MAX_DIMS} a tensor may have"
            )
        if not isinstance(shape, list | tuple) or not all(_is_int(d) and d >= 0 for d in shape):
            raise WeightValidationError(f"{where}.shape must be a list of ints >= 0, got {shape!r}")
        if nbytes != math.prod(shape) * dtype.itemsize:
            raise WeightValidationError(
                f"{where}.nbytes is {nbytes} but shape {list(shape)} of {data['dtype']} holds "
                f"{math.prod(shape) * dtype.itemsize} bytes"
            )
        if offset % dtype.itemsize:
            raise WeightValidationError(
                f"{where}.offset {offset} is not a multiple of the {data['dtype']} size "
                f"({dtype.itemsize} bytes)"
            )
        if spec is not None and (spec.dtype != dtype or spec.shape != tuple(shape)):
            raise WeightValidationError(
                f"{where} describes {data['dtype']}{list(shape)} but the update announces "
                f"{spec.describe()} for {spec.name!r}"
            )
        segment, cuda = data.get("segment"), data.get("cuda")
        if segment is not None and cuda is not None:
            raise WeightValidationError(f"{where} has both 'segment' and 'cuda'; give exactly one")
        if segment is not None and not isinstance(segment, str):
            raise WeightValidationError(
                f"{where}.segment must be a string, got {type(segment).__name__}"
            )
        if segment is None and cuda is None and nbytes:
            raise WeightValidationError(
                f"{where} has {nbytes} bytes but neither 'segment' nor 'cuda' says where they are"
            )
        if cuda is not None:
            cuda = CUDAStorageHandle.from_dict(cuda, where=where)
        return cls(offset, nbytes, data["dtype"], tuple(shape), segment, cuda)

    @classmethod
    def for_tensor(
        cls,
        spec: TensorSpec,
        offset: int,
        *,
        segment: str | None = None,
        cuda: CUDAStorageHandle | None = None,
    ) -> IPCHandle:
        """The record of `spec` at byte `offset` of a region (a tensor without bytes has none)."""
        if spec.nbytes == 0:
            segment, cuda, offset = None, None, 0
        return cls(offset, spec.nbytes, dtype_name(spec.dtype), spec.shape, segment, cuda)

    def to_dict(self) -> dict[str, Any]:
        """Returns the JSON-safe dict form (the inverse of `from_dict`)."""
        cuda = self.cuda.to_dict() if self.cuda is not None else None
        record = {"offset": self.offset, "nbytes": self.nbytes, "dtype": self.dtype}
        record |= {"shape": list(self.shape), "segment": self.segment, "cuda": cuda}
        return {key: value for key, value in record.items() if value is not None}

    def view(self, region: torch.Tensor) -> torch.Tensor:
        """Views the record's bytes inside a uint8 `region` as the typed tensor (no copy)."""
        if self.offset + self.nbytes > region.numel():
            where = self.segment if self.segment is not None else "the CUDA storage"
            raise WeightValidationError(
                f"offset {self.offset} + nbytes {self.nbytes} reaches past the end of {where} "
                f"({region.numel()} bytes)"
            )
        dtype = dtype_from_name(self.dtype)
        return region[self.offset : self.offset + self.nbytes].view(dtype).view(self.shape)


# --- CUDA IPC: torch's own reductions, their arguments carried as JSON-safe data ----------------

# torch's producer-side reference counts live in shared-memory files of this many int64 slots,
# named `/torch_<pid>_<random>_<n>`; the consumer decrements slot `ref_counter_offset` when it
# lets go. Anything else would have this process write into a file a peer chose.
REF_COUNTER_SLOTS = 10000
"""Slots of a torch reference-count file; a record's `ref_counter_offset` must be below."""
_REF_COUNTER_RE = re.compile(r"/torch_[0-9]{1,10}_[0-9]{1,20}_[0-9]{1,20}")


def cuda_device_uuids() -> dict[str, int]:
    """The CUDA devices this process sees, by physical UUID -> local device index."""
    return {
        str(torch.cuda.get_device_properties(i).uuid): i for i in range(torch.cuda.device_count())
    }


def export_cuda_storage(storage: torch.UntypedStorage) -> CUDAStorageHandle:
    """Exports a CUDA storage (one producer reference per export: once per delivery)."""
    whole = torch.empty(0, dtype=torch.uint8, device=storage.device)
    whole.set_(storage, 0, (storage.nbytes(),), (1,))
    # reduce_tensor's arguments for rebuild_cuda_tensor: (tensor class, size, stride, offset,
    # storage class, dtype, device, handle, storage bytes, storage offset, requires_grad,
    # ref counter handle, ref counter offset, event handle, event sync required).
    _, args = reductions.reduce_tensor(whole)  # type: ignore[no-untyped-call]
    device, handle, nbytes, offset, _, counter, counter_offset, event, event_sync = args[6:15]

    def b64(data: bytes) -> str:
        return base64.b64encode(data).decode("ascii")

    return CUDAStorageHandle(
        str(torch.cuda.get_device_properties(device).uuid), b64(handle), int(nbytes), int(offset),
        b64(counter), int(counter_offset), b64(event) if event is not None else None,
        bool(event_sync),
    )  # fmt: skip


def _check_ref_counter(handle: CUDAStorageHandle, *, where: str) -> None:
    """Refuses a reference-count file or slot that is not one torch made for this user."""
    name = base64.b64decode(handle.ref_counter_handle).decode("ascii", "replace")
    if not _REF_COUNTER_RE.fullmatch(name):
        raise WeightValidationError(
            f"{where}.cuda.ref_counter_handle {name!r} is not a torch reference-count file "
            "(/torch_<pid>_<n>_<n>); refused: the receiver would write into it"
        )
    if handle.ref_counter_offset >= REF_COUNTER_SLOTS:
        raise WeightValidationError(
            f"{where}.cuda.ref_counter_offset must be below {REF_COUNTER_SLOTS} (the slots of a "
            f"torch reference-count file), got {handle.ref_counter_offset}"
        )
    try:
        stat = os.stat("/dev/shm" + name)
    except OSError as exc:
        raise WeightValidationError(
            f"{where}.cuda.ref_counter_handle {name!r} cannot be checked: {exc.strerror}; the "
            "trainer exited or the record was not made by torch"
        ) from None
    if stat.st_uid != os.getuid() or stat.st_size < 8 * REF_COUNTER_SLOTS:
        raise WeightValidationError(
            f"{where}.cuda.ref_counter_handle {name!r} is not a reference-count file of this "
            f"user with {REF_COUNTER_SLOTS} slots (owner uid {stat.st_uid}, {stat.st_size} bytes)"
        )


def _allocation_extent(tensor: torch.Tensor) -> int:
    """Bytes from the tensor's first byte to the end of its CUDA allocation (torch does not say)."""
    try:
        address_range = ctypes.CDLL("libcuda.so.1").cuMemGetAddressRange_v2
    except (OSError, AttributeError) as exc:
        raise WeightValidationError(
            f"cannot check the size of CUDA IPC memory without the CUDA driver library: {exc}"
        ) from None
    base, size, address = ctypes.c_uint64(), ctypes.c_size_t(), ctypes.c_uint64(tensor.data_ptr())
    with torch.cuda.device(tensor.device):
        status = address_range(ctypes.byref(base), ctypes.byref(size), address)  # a CUresult
    if status != 0:
        raise WeightValidationError(
            f"cannot check the size of CUDA IPC memory: cuMemGetAddressRange returned {status}"
        )
    return int(base.value + size.value - address.value)


def _import_cuda_storage(handle: CUDAStorageHandle, *, where: str) -> torch.Tensor:
    """Opens an exported storage on the local device with the same UUID, as a uint8 tensor."""
    devices = cuda_device_uuids()
    index = devices.get(handle.device_uuid)
    if index is None:
        available = ", ".join(sorted(devices)) or "none: this process sees no CUDA device"
        raise WeightValidationError(
            f"{where}.cuda.device_uuid {handle.device_uuid!r} is not a GPU this receiver sees "
            f"(available UUIDs: {available}); CUDA IPC needs trainer and receiver on the same "
            "GPU: check CUDA_VISIBLE_DEVICES"
        )
    _check_ref_counter(handle, where=where)
    try:
        tensor = _rebuild(handle, index)
    except Exception as exc:  # a handle or event the driver refuses: garbage or revoked
        raise WeightValidationError(
            f"{where}.cuda: the CUDA driver refused the handle: {type(exc).__name__}: {exc}"
        ) from None
    # The handle maps the whole allocation: the storage it claims must lie inside it.
    extent = _allocation_extent(tensor) if handle.storage_nbytes else 0
    if handle.storage_nbytes > extent:
        raise WeightValidationError(
            f"{where}.cuda.storage_nbytes is {handle.storage_nbytes} but the CUDA allocation "
            f"holds {extent} bytes from storage_offset {handle.storage_offset}"
        )
    return tensor


def _rebuild(handle: CUDAStorageHandle, index: int) -> torch.Tensor:
    event = base64.b64decode(handle.event_handle) if handle.event_handle is not None else None
    # The classes and dtype passed here are ours, never taken from the payload.
    tensor: torch.Tensor = reductions.rebuild_cuda_tensor(  # type: ignore[no-untyped-call]
        torch.Tensor, (handle.storage_nbytes,), (1,), 0, torch.UntypedStorage, torch.uint8,
        index, base64.b64decode(handle.handle), handle.storage_nbytes, handle.storage_offset,
        False, base64.b64decode(handle.ref_counter_handle), handle.ref_counter_offset, event,
        handle.event_sync_required,
    )  # fmt: skip
    return tensor


def _new_event() -> torch.cuda.Event:
    return torch.cuda.Event()  # type: ignore[no-untyped-call]


def synchronize(device: torch.device, *, timeout_s: float, what: str) -> None:
    """Waits for `device`'s queued work, `timeout_s` at most (`torch.cuda.synchronize` has no bound)."""
    event = _new_event()
    event.record(torch.cuda.current_stream(device))
    deadline = time.monotonic() + timeout_s
    pause_s = 0.0
    while not event.query():  # type: ignore[no-untyped-call]
        if time.monotonic() > deadline:
            raise WeightTransferTimeout(
                f"{what}: the GPU {device} did not finish its queued work within {timeout_s:g} s "
                "(timeout_s); a kernel or copy is stuck"
            )
        time.sleep(pause_s)
        pause_s = min(2 * pause_s + 1e-5, 1e-3)  # short waits first: buckets take milliseconds


# --- the receiver's open regions ----------------------------------------------------------------


class RegionCache:
    """The memory a receiver of `session` opened, reused while current, dropped once unused."""

    def __init__(self, session: str | None = None) -> None:
        self._session = session
        self._segments: dict[str, _AttachedSegment] = {}
        self._cuda: dict[tuple[str, int], torch.Tensor] = {}
        self._used: set[object] = set()
        self._lock = threading.Lock()  # deliveries and the receiver's watch both change the maps

    def resolve(
        self, handle: IPCHandle, spec: TensorSpec, regions: dict[object, torch.Tensor], where: str
    ) -> torch.Tensor:
        """Checks a record against live memory and views its tensor; `regions`: this delivery's."""
        if handle.nbytes == 0:
            return torch.empty(spec.shape, dtype=spec.dtype)
        cuda = handle.cuda
        key: object = cuda.cache_key if cuda is not None else handle.segment
        if key not in regions and cuda is not None:
            if handle.offset + handle.nbytes > cuda.storage_nbytes:
                raise WeightValidationError(  # refused before the handle is even opened
                    f"{where}: offset {handle.offset} + nbytes {handle.nbytes} reaches past "
                    f"the end of the CUDA storage ({cuda.storage_nbytes} bytes)"
                )
            # Kept open across updates: importing a handle whose storage was freed would open it
            # anew, and the producer's reference count would be released twice.
            regions[key] = self._cuda[cuda.cache_key] = _import_cuda_storage(cuda, where=where)
            self._used.add(key)
        elif key not in regions:
            assert handle.segment is not None
            regions[key] = self._attach(handle.segment, where)
        try:
            return handle.view(regions[key])
        except WeightValidationError as exc:
            raise WeightValidationError(f"{where}: {exc}") from None

    def _attach(self, name: str, where: str) -> torch.Tensor:
        """The mapping of `name`, remapped if the segment changed (a truncated one would SIGBUS)."""
        if self._session is None or not _segment_belongs_to(name, self._session):
            raise WeightValidationError(
                f"{where}.segment {name!r} is not a segment of session {self._session}: "
                "initialize this worker with the trainer's current init_info"
            )
        try:
            identity = _segment_identity(name)
            with self._lock:
                cached = self._segments.get(name)
                if cached is None or cached.identity != identity:
                    cached = self._segments[name] = attach_segment(name)
                self._used.add(name)
        except WeightValidationError as exc:
            raise WeightValidationError(f"{where}: {exc}") from None
        return cached.tensor

    @property
    def open_segments(self) -> list[str]:
        """Names of the shared-memory segments mapped now."""
        return sorted(self._segments)

    def clear(self) -> None:
        """Unmaps everything (after an abandoned update its segments may be unlinked already)."""
        with self._lock:
            self._segments, self._cuda, self._used = {}, {}, set()

    def drop_unused(self) -> None:
        """Unmaps what the update that just completed did not use."""
        with self._lock:
            self._segments = {k: v for k, v in self._segments.items() if k in self._used}
            self._cuda = {k: v for k, v in self._cuda.items() if k in self._used}
            self._used = set()

    def drop_gone(self) -> list[str]:
        """Unmaps segments unlinked, replaced or resized by their owner; returns their names."""
        gone = []
        for name, attached in list(self._segments.items()):
            with contextlib.suppress(WeightValidationError):  # unlinked: the name no longer opens
                if _segment_identity(name) == attached.identity:
                    continue
            gone.append(name)
        if gone:
            with self._lock:
                for name in gone:
                    self._segments.pop(name, None)
            logger.info("unmapped %d segments their trainer released: %s", len(gone), gone)
        return gone
