"""POSIX shared-memory segments for the `ipc` backend on CPUs: create, attach, unlink, never leak.

A trainer's segments are named `<session>-<n>`, the session being `weightsync-` and 48 random
bits, so a receiver attaches only to segments of the session it was initialized with and a name
cannot be guessed. Names stay under 31 characters, the limit some systems put on them.

Leaks are ruled out in two ways. The owner unlinks its segments when it closes them, and every
session also starts a `SegmentJanitor`: a tiny process
told each segment name *before* the segment exists, which unlinks whatever is left once the
owning process is gone, even after SIGKILL.

Segments are mapped with `mmap` and viewed as uint8 tensors (`torch.frombuffer`): the tensor
keeps the mapping alive, so memory goes away with the last view, never under one.
"""

from __future__ import annotations

import _posixshmem  # type: ignore[import-not-found]  # stdlib shm_open/shm_unlink, no tracker
import contextlib
import errno
import logging
import mmap
import os
import re
import secrets
import subprocess
import sys
import warnings
from dataclasses import dataclass

import torch

from weightsync.errors import WeightTransferError, WeightValidationError

__all__ = [
    "SESSION_PREFIX",
    "SHM_LIMIT_ENV",
    "AttachedSegment",
    "SegmentJanitor",
    "SharedSegment",
    "attach_segment",
    "is_session_name",
    "new_session_name",
    "segment_belongs_to",
    "segment_identity",
    "unlink_segment",
]

logger = logging.getLogger(__name__)

SESSION_PREFIX = "weightsync-"
"""Every segment weightsync creates has a name starting with this prefix."""

SHM_LIMIT_ENV = "WEIGHTSYNC_SHM_LIMIT_BYTES"
"""Test hook: a segment larger than this many bytes fails as on a full `/dev/shm` (ENOSPC).

Fault tests set it in a trainer's environment to exercise the real failure path (the segment is
created, its reservation fails, it is unlinked, the error says what is free) without filling the
machine's `/dev/shm`. Unset, it does nothing.
"""

_SESSION_RE = re.compile(r"weightsync-[0-9a-f]{12}")
_SEGMENT_RE = re.compile(r"weightsync-[0-9a-f]{12}-[0-9]{1,6}")
# The janitor runs in a fresh interpreter (`-I`: no site packages, no environment), so it starts
# in milliseconds and shares nothing with the trainer but this pipe. It watches the trainer's pid
# as well as the pipe: a child the trainer forked (a DataLoader worker) inherits the pipe's write
# end and would keep it open long after the trainer died.
_JANITOR_SOURCE = """
import os, select, signal, sys, _posixshmem
signal.signal(signal.SIGINT, signal.SIG_IGN)
prefix, owner, names = sys.argv[1] + "-", int(sys.argv[2]), set()
fd, rest = sys.stdin.fileno(), b""
try:
    watch, tick = [fd, os.pidfd_open(owner)], None
except (AttributeError, OSError):
    watch, tick = [fd], 0.5
def take(chunk):
    global rest
    *lines, rest = (rest + chunk).split(b"\\n")
    for line in lines:
        name = line[1:].strip().decode("ascii", "replace")
        if name.startswith(prefix):
            (names.add if line[:1] == b"+" else names.discard)(name)
while os.getppid() == owner:
    ready = select.select(watch, [], [], tick)[0]
    if fd in ready:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        take(chunk)
    elif ready:
        break
while select.select([fd], [], [], 0)[0]:
    chunk = os.read(fd, 65536)
    if not chunk:
        break
    take(chunk)
for name in names:
    try:
        _posixshmem.shm_unlink("/" + name)
    except OSError:
        pass
"""


def new_session_name() -> str:
    """Returns a fresh, unguessable session name (`weightsync-` + 12 hex digits)."""
    return SESSION_PREFIX + secrets.token_hex(6)


def is_session_name(name: object) -> bool:
    """Whether `name` has the form of a session name."""
    return isinstance(name, str) and _SESSION_RE.fullmatch(name) is not None


def segment_belongs_to(name: str, session: str) -> bool:
    """Whether a receiver of `session` may attach segment `name`: only the session's own."""
    return _SEGMENT_RE.fullmatch(name) is not None and name.startswith(session + "-")


def unlink_segment(name: str) -> bool:
    """Removes segment `name` from the namespace; returns False if it was already gone.

    Mappings stay valid until unmapped: unlinking only stops new attachments.
    """
    try:
        _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        return False
    return True


def _readonly_view(mapping: mmap.mmap) -> torch.Tensor:
    with warnings.catch_warnings():
        # torch warns that the buffer is not writable; read-only is the point (see attach).
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mapping, dtype=torch.uint8)


class SharedSegment:
    """A segment this process created and owns, viewed as a writable uint8 tensor.

    Args:
        name: Segment name (without the leading slash), e.g. `"weightsync-0123456789ab-0"`.
        nbytes: Size in bytes; at least 1.

    Raises:
        WeightTransferError: The segment cannot be created or its memory reserved (for instance
            when /dev/shm is too small; the message says how much is free).
    """

    def __init__(self, name: str, nbytes: int) -> None:
        if nbytes < 1:
            raise WeightValidationError(f"a segment needs nbytes >= 1, got {nbytes}")
        self.name = name
        self.nbytes = nbytes
        limit = _test_limit()
        try:
            fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
        except OSError as exc:  # the name is taken, or /dev/shm is missing or not writable
            raise WeightTransferError(
                f"cannot create shared-memory segment {name!r}: {exc}{_free_space_hint()}"
            ) from exc
        try:
            if limit is not None and nbytes > limit:
                raise OSError(errno.ENOSPC, f"No space left on device ({SHM_LIMIT_ENV}={limit})")
            if hasattr(os, "posix_fallocate"):
                # Reserve the pages now: a full /dev/shm then fails here with ENOSPC instead of
                # killing the process with SIGBUS on first write.
                os.posix_fallocate(fd, 0, nbytes)
            else:
                os.ftruncate(fd, nbytes)
            # Populating maps every page up front, several times cheaper than first-touch faults.
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            mapping = mmap.mmap(fd, nbytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            unlink_segment(name)
            raise WeightTransferError(
                f"cannot create shared-memory segment {name!r} of {nbytes} bytes: {exc}"
                f"{_free_space_hint()}"
            ) from exc
        finally:
            os.close(fd)
        self.tensor = torch.frombuffer(mapping, dtype=torch.uint8)
        """The segment's bytes; views of it stay valid after `unlink`."""

    @property
    def address(self) -> int:
        """Address of the first byte in this process."""
        return int(self.tensor.data_ptr())

    def contains(self, address: int, nbytes: int) -> bool:
        """Whether `nbytes` bytes from `address` lie inside this segment."""
        return self.address <= address and address + nbytes <= self.address + self.nbytes

    def unlink(self) -> None:
        """Removes the name; this process's views stay valid. Safe to call twice."""
        unlink_segment(self.name)


def _test_limit() -> int | None:
    """The size limit `SHM_LIMIT_ENV` sets, if any."""
    limit = os.environ.get(SHM_LIMIT_ENV)
    if limit is None:
        return None
    if not limit.isdigit():
        raise WeightValidationError(f"{SHM_LIMIT_ENV} must be a number of bytes, got {limit!r}")
    return int(limit)


def _free_space_hint() -> str:
    try:
        stat = os.statvfs("/dev/shm")
    except OSError:
        return ""
    free = stat.f_bavail * stat.f_frsize
    return (
        f" (/dev/shm has {free / 2**20:.0f} MiB free: enlarge it, e.g. `docker run --shm-size`, "
        "or lower bucket_size_bytes)"
    )


@dataclass(frozen=True)
class AttachedSegment:
    """A read-only mapping of another process's segment, as a receiver sees it.

    Attributes:
        name: Segment name.
        identity: `(device, inode, size)` of the segment when it was mapped: a new segment
            under an old name differs, and so does the same segment truncated or grown.
        tensor: The segment's bytes (uint8, read-only memory: writing to it kills the process,
            which is what keeps a receiver from ever corrupting the trainer's weights).
    """

    name: str
    identity: tuple[int, int, int]
    tensor: torch.Tensor

    @property
    def nbytes(self) -> int:
        """Size in bytes."""
        return int(self.tensor.numel())


def _open_existing(name: str) -> int:
    try:
        fd: int = _posixshmem.shm_open("/" + name, os.O_RDONLY, mode=0)
    except FileNotFoundError:
        raise WeightValidationError(
            f"shared-memory segment {name!r} does not exist: the trainer unlinked it (after a "
            "failure or on shutdown) or its process exited; send the update again"
        ) from None
    except OSError as exc:
        raise WeightValidationError(f"cannot open shared-memory segment {name!r}: {exc}") from exc
    return fd


def segment_identity(name: str) -> tuple[int, int, int]:
    """Returns `(device, inode, size)` of segment `name`, checking that it exists.

    A mapping is current only while this is unchanged: its owner may truncate a segment, and a
    read of a mapped page past the new end kills the reader (SIGBUS).

    Raises:
        WeightValidationError: The segment does not exist or cannot be opened.
    """
    fd = _open_existing(name)
    try:
        stat = os.fstat(fd)
    finally:
        os.close(fd)
    return stat.st_dev, stat.st_ino, stat.st_size


def attach_segment(name: str) -> AttachedSegment:
    """Maps segment `name` read-only.

    Raises:
        WeightValidationError: The segment does not exist or cannot be mapped.
    """
    fd = _open_existing(name)
    try:
        stat = os.fstat(fd)
        if stat.st_size == 0:
            tensor = torch.empty(0, dtype=torch.uint8)
        else:
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            tensor = _readonly_view(mmap.mmap(fd, stat.st_size, flags=flags, prot=mmap.PROT_READ))
    except OSError as exc:
        raise WeightValidationError(f"cannot map shared-memory segment {name!r}: {exc}") from exc
    finally:
        os.close(fd)
    return AttachedSegment(name, (stat.st_dev, stat.st_ino, stat.st_size), tensor)


class SegmentJanitor:
    """A helper process that unlinks a session's leftover segments once its owner is gone.

    The owner reports each name with `track` before creating the segment and with `forget` after
    unlinking it. When the owner exits, in any way (even while a child it forked lives on), the
    janitor unlinks every name still tracked, then exits. It ignores Ctrl-C (it runs in a session
    of its own) so that an interrupted trainer is still cleaned up.

    Args:
        session: The session name; the janitor only ever unlinks names under it.
    """

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
        # A janitor that stopped reading must not block the trainer: its pipe never waits.
        self._pipe = self._process.stdin.fileno()
        os.set_blocking(self._pipe, False)

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
        """Announces segment `name`; call before creating it.

        Raises:
            WeightTransferError: The janitor is gone (killed, say), so the segment could leak.
        """
        self._send(b"+" + name.encode() + b"\n")

    def forget(self, name: str) -> None:
        """Withdraws segment `name`; call after unlinking it.

        A gone janitor is only logged here: the segment is unlinked already.
        """
        try:
            self._send(b"-" + name.encode() + b"\n")
        except WeightTransferError as exc:
            logger.warning("%s", exc)

    def check(self) -> None:
        """Raises if the janitor is gone, so that a trainer never exports memory that could leak.

        Raises:
            WeightTransferError: The janitor exited or was closed.
        """
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
