"""A broadcast group made only for weight transfer, its store folded in; every operation bounded.

Rank 0 (the trainer) hosts the group's own `TCPStore`, and gloo or NCCL is built on it directly,
never on torch.distributed's default group (a trainer's FSDP or DDP keeps its own). Ranks exchange
small JSON messages through the store; every store call returns within `timeout_s`, and every
value read is checked before use, since any process that reaches the port can write there.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import json
import os
import resource
import socket
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from weightsync.errors import WeightTransferError, WeightTransferTimeout, WeightValidationError
from weightsync.transfer.base import WireParams, _is_int

__all__ = [
    "INIT_ERRORS",
    "BroadcastGroup",
    "BroadcastWork",
    "check_backend",
    "check_port",
    "translate",
]

INIT_ERRORS = "init_errors"
"""Store key a worker appends the reason its join failed to, as `"rank R: Error: message"`."""

_BACKENDS = ["gloo", "nccl"]
_LINKS_PER_PEER = 2  # connections a rank keeps per other rank: the store and the transfer link
_FILES_KEPT_FREE = 64  # open files a process keeps for everything else
_STORE_GRACE_S = 1.0  # on top of a store call's own limit, so that torch's timeout comes first
_MAX_VALUE_BYTES = 1 << 20  # the largest value a rank takes; a rank writes a few refusals at most
_MAX_LIST_BYTES = 4 << 20  # of an appended list (`read_list`): what lies beyond is not read


def translate(what: str, exc: Exception, timeout_s: float) -> WeightTransferError:
    """Maps a torch.distributed failure onto weightsync's error classes (one line, no C++ frames)."""
    # torch's timeouts are RuntimeErrors saying so; a TypeError about a `timeout` argument is not.
    text = str(exc).lower()
    cause = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
    if isinstance(exc, TimeoutError) or (
        isinstance(exc, RuntimeError) and ("timed out" in text or "timeout" in text)
    ):
        return WeightTransferTimeout(
            f"{what} timed out after {timeout_s:g} s (timeout_s): a peer is missing, stuck or "
            f"was never told to take part; {cause}"
        )
    return WeightTransferError(
        f"{what} failed, most likely because a peer process died or closed the group; {cause}"
    )


def _check_world_size(world_size: object) -> None:
    """Refuses a world size that is no int >= 2 or beyond what this process's open files allow."""
    if not _is_int(world_size) or world_size < 2:
        raise WeightValidationError(
            f"world_size must be an int >= 2 (the trainer plus at least one worker), got {world_size!r}"
        )
    files, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if files == resource.RLIM_INFINITY:
        files = 1 << 20  # the kernel's own ceiling on open files (fs.nr_open) by default
    limit = 1 + max(0, (files - _FILES_KEPT_FREE) // _LINKS_PER_PEER)
    if world_size > limit:
        raise WeightValidationError(
            f"world_size {world_size} is more than any group this process can be a rank of: a "
            f"rank keeps up to {_LINKS_PER_PEER} connections per other rank (the group's store "
            f"and its transfer link) and this process may open {files} files (RLIMIT_NOFILE), "
            f"so world_size can be at most {limit}: use fewer workers, or raise the limit "
            "(ulimit -n) on every host"
        )


def check_backend(backend: str) -> torch.device:
    """Returns the device a backend's tensors live on; `nccl` without CUDA is refused, never replaced."""
    if backend not in _BACKENDS:
        raise WeightValidationError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if backend == "gloo":
        return torch.device("cpu")
    if not torch.cuda.is_available() or not hasattr(dist, "ProcessGroupNCCL"):
        raise WeightValidationError(
            "backend 'nccl' needs CUDA and a torch build with NCCL, and this process has "
            "neither; use backend 'gloo' for CPU tensors"
        )
    return torch.device("cuda", torch.cuda.current_device())


def check_port(port: object, *, allow_zero: bool = True) -> int:
    """Returns `port` after checking it is a TCP port (0, a free one, only when allowed)."""
    low = 0 if allow_zero else 1
    if not _is_int(port) or not low <= port <= 65535:
        raise WeightValidationError(f"master_port must be an int in {low}-65535, got {port!r}")
    return port


def _listen(address: str, port: int) -> socket.socket:
    """A TCP socket listening on `address`:`port` only (port 0: a free one)."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(address, port, flags=socket.AI_PASSIVE)[0]
        # create_server sets SO_REUSEADDR: TIME_WAIT connections never block binding the port again;
        # an IPv6 wildcard keeps taking IPv4 peers too, as a plain socket does.
        return socket.create_server(
            sockaddr,
            family=family,
            backlog=socket.SOMAXCONN,
            dualstack_ipv6=family == socket.AF_INET6 and socket.has_dualstack_ipv6(),
        )
    except (socket.gaierror, UnicodeError) as exc:
        raise WeightTransferError(
            f"master_address {address!r} does not resolve on this host: {exc}; give an address "
            "of this machine that the workers can reach"
        ) from exc
    except OSError as exc:
        raise WeightTransferError(
            f"cannot listen on master_address {address!r}, master_port {port}: {exc}; pick a "
            "free port (master_port=0 picks one) or an address of this machine"
        ) from exc


class BroadcastWork:
    """A pending collective; `wait()` blocks at most the group's timeout and raises clearly."""

    def __init__(self, work: Any, what: str, timeout_s: float) -> None:
        self._work, self._what, self._timeout_s = work, what, timeout_s

    def wait(self) -> None:
        """Blocks until done; raises WeightTransferTimeout / WeightTransferError (a peer died)."""
        try:
            self._work.wait(datetime.timedelta(seconds=self._timeout_s))
        except Exception as exc:
            raise translate(self._what, exc, self._timeout_s) from exc


class BroadcastGroup:
    """One end of a trainer-rooted group: rank 0, the trainer, hosts the store; 1..N workers."""

    def __init__(
        self,
        *,
        backend: str,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        timeout_s: float,
    ) -> None:
        _check_world_size(world_size)
        if not _is_int(rank) or not 0 <= rank < world_size:
            raise WeightValidationError(
                f"rank must be in [0, world_size={world_size}), got {rank!r}: world_size counts "
                "the trainer (rank 0) plus every worker (rank_offset + worker index)"
            )
        check_port(master_port)
        WireParams(timeout_s=timeout_s)  # the one check of a timeout
        self.backend, self.device = backend, check_backend(backend)
        self.rank, self.world_size, self.timeout_s = rank, world_size, float(timeout_s)
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._pg: Any = None
        self._store_stuck = False
        what = f"connecting to the transfer store at {master_address}:{master_port}"
        options: dict[str, Any] = {"timeout": self._timeout}
        if rank == 0:  # the trainer's store listens on `master_address` only (torch: everywhere)
            listener = _listen(master_address, master_port)
            master_port = listener.getsockname()[1]
            what = f"starting the transfer store on {master_address}:{master_port}"
            # The store owns the socket from here and closes it (libuv's server would ignore it).
            options.update(
                master_listen_fd=listener.detach(), wait_for_workers=False, use_libuv=False
            )
        try:
            self._store: Any = dist.TCPStore(  # type: ignore[attr-defined]
                master_address, master_port, world_size, rank == 0, **options
            )
        except Exception as exc:
            if rank == 0:
                with contextlib.suppress(OSError):
                    os.close(options["master_listen_fd"])
            raise translate(what, exc, self.timeout_s) from exc
        self.port: int = self._store.port
        self.where = f"the transfer store at {master_address}:{self.port}"

    def _bounded(self, doing: str, fn: Callable[[], Any], limit_s: float | None = None) -> Any:
        """Runs store call `fn` (`doing` what) on a daemon thread, for `limit_s` at most."""
        # torch's client waits for a stopped host (its socket open) forever, and each call for the
        # one before it; after a timeout the client is mid-conversation: it is used never again.
        limit_s = self.timeout_s if limit_s is None else limit_s
        what = f"{doing} {self.where}"
        if self._store_stuck:
            raise WeightTransferTimeout(
                f"{what}: {self.where} stopped answering earlier (timeout_s): its host (the "
                "trainer) is stopped or stuck"
            )
        result: list[Any] = []
        failure: list[BaseException] = []
        done = threading.Event()

        def run() -> None:
            try:
                result.append(fn())
            except Exception as exc:  # a fresh error: torch's frames would keep the group alive
                failure.append(translate(what, exc, self.timeout_s))
            except BaseException as exc:  # the caller's, at once: never a timeout that poisons
                failure.append(exc.with_traceback(None))
            done.set()

        threading.Thread(target=run, name="weightsync-store", daemon=True).start()
        if not done.wait(limit_s + _STORE_GRACE_S):
            self._store_stuck = True
            raise WeightTransferTimeout(
                f"{what} timed out after {limit_s:g} s (timeout_s): the store's host (the "
                "trainer) does not answer: stopped, stuck or unreachable"
            )
        if failure:
            raise failure.pop()  # popped, so this frame (in its traceback) does not hold it
        return result[0]

    def _value(self, key: str, raw: bytes) -> Any:
        """The JSON value stored under `key`, its size and form checked before use."""
        if len(raw) > _MAX_VALUE_BYTES:
            raise self.malformed(key, f"{len(raw)} bytes, more than {_MAX_VALUE_BYTES}")
        try:
            return json.loads(raw)
        except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
            raise self.malformed(key, f"not JSON: {type(exc).__name__}: {str(exc)[:100]}") from None

    def malformed(self, key: str, detail: str) -> WeightTransferError:
        """The error for a value under `key` that no weightsync rank wrote."""
        return WeightTransferError(
            f"{self.where} holds a malformed value under {key!r} ({detail}): it was not written "
            "by a weightsync rank of this group; another process writes into the store, so "
            "keep its port reachable by the group's ranks only"
        )

    def set(self, key: str, value: Any, limit_s: float | None = None) -> None:
        """Publishes a JSON-safe value under `key`, within `limit_s` (default: the group's)."""
        text = json.dumps(value)
        self._bounded(f"writing {key!r} to", lambda: self._store.set(key, text), limit_s)

    def _read(self, key: str, limit_s: float, *, wait: bool = False) -> Any:
        """The bytes under `key`: None when there are none, unless `wait`ing `limit_s` for them."""

        def read() -> Any:
            if wait:
                self._store.wait([key], datetime.timedelta(seconds=limit_s))
            elif not self._store.check([key]):
                return None
            return self._store.get(key)

        return self._bounded(f"reading {key!r} from", read, limit_s)

    def get(self, key: str, timeout_s: float | None = None) -> Any:
        """Reads the value under `key`, waiting up to `timeout_s` (default: the group's)."""
        limit_s = self.timeout_s if timeout_s is None else timeout_s
        return self._value(key, self._read(key, limit_s, wait=True))

    def lookup(self, key: str, limit_s: float | None = None) -> Any:
        """The value under `key`, or None when there is none yet; never waits for one.

        `limit_s` bounds the store's answer (default: the group's timeout).
        """
        raw = self._read(key, self.timeout_s if limit_s is None else limit_s)
        return None if raw is None else self._value(key, raw)

    def try_get(self, key: str, limit_s: float | None = None) -> Any:
        """`lookup`, or None when the store is gone or stopped (the trainer took it along)."""
        try:
            return self.lookup(key, limit_s)
        except Exception:
            return None

    def set_once(self, key: str, value: Any) -> Any:
        """Stores `value` under `key` unless one is there; returns the one stored (ranks agree)."""
        text = json.dumps(value)
        raw = self._bounded(f"writing {key!r} to", lambda: self._store.compare_set(key, "", text))
        return self._value(key, raw)

    def delete(self, key: str) -> None:
        """Removes `key` (nothing happens when it is not there)."""
        self._bounded(f"deleting {key!r} from", lambda: self._store.delete_key(key))

    def has(self, keys: list[str]) -> bool:
        """Whether every key is in the store."""
        return bool(self._bounded("checking", lambda: self._store.check(keys)))

    def claim_rank(self, claimant: str) -> None:
        """Claims this rank for `claimant` (again, for the same one); another claimant is refused."""
        key = f"rank/{self.rank}"
        owner = self._bounded(
            f"claiming {key!r} in", lambda: self._store.compare_set(key, "", claimant)
        )
        if owner != claimant.encode():  # the owner's id, or whatever else is there
            raise WeightValidationError(
                f"rank {self.rank} was claimed by another process already ({key!r} in "
                f"{self.where}): each worker needs a distinct worker_index (rank = rank_offset + "
                "worker_index)"
            )

    def append(self, key: str, value: Any) -> None:
        """Appends a JSON-safe value to the list under `key`."""
        line = json.dumps(value) + "\n"
        self._bounded(f"appending to {key!r} in", lambda: self._store.append(key, line))

    def read_list(self, key: str, limit_s: float) -> list[Any]:
        """The values appended under `key` (none if there are none or the store does not answer)."""
        try:
            raw = self._read(key, limit_s) or b""
        except WeightTransferError:  # a dead or stopped store: nothing to read
            return []
        values = []
        for line in raw[:_MAX_LIST_BYTES].decode("utf-8", "replace").splitlines():
            with contextlib.suppress(ValueError, RecursionError):
                values.append(json.loads(line))
        return values

    def connect(self, timeout_s: float | None = None) -> None:
        """Forms the process group, within `timeout_s` (default: the group's); idempotent."""
        if self._pg is not None:
            return
        limit_s = self.timeout_s if timeout_s is None else max(timeout_s, 0.001)
        limit = datetime.timedelta(seconds=limit_s)
        prefix = dist.PrefixStore("weightsync", self._store)  # type: ignore[attr-defined]
        what = f"forming the {self.backend} group (rank {self.rank} of {self.world_size})"
        try:
            # gloo bounds its rendezvous by `limit`; its collectives pass their own.
            if self.backend == "gloo":
                self._pg = dist.ProcessGroupGloo(prefix, self.rank, self.world_size, limit)
                return
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self._timeout
            self._pg = dist.ProcessGroupNCCL(prefix, self.rank, self.world_size, options)
            # NCCL connects lazily: a tiny all-reduce makes the rendezvous happen (and time out).
            what, probe = "all-reduce", dist.AllreduceOptions()
            probe.timeout = limit
            work = self._pg.allreduce([torch.zeros(1, device=self.device)], probe)
        except Exception as exc:
            raise translate(what, exc, self.timeout_s) from exc
        BroadcastWork(work, what, limit_s).wait()

    @property
    def is_connected(self) -> bool:
        """Whether the process group is formed and not closed."""
        return self._pg is not None

    def broadcast(self, tensor: torch.Tensor, what: str) -> BroadcastWork:
        """Starts broadcasting `tensor` from rank 0 into the same-sized tensor on every rank."""
        if (pg := self._pg) is None:
            raise WeightTransferError(
                "the transfer group is not connected (never formed, or closed after a failure)"
            )
        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor, options.timeout = 0, 0, self._timeout
        try:
            return BroadcastWork(pg.broadcast([tensor], options), what, self.timeout_s)
        except Exception as exc:
            raise translate(what, exc, self.timeout_s) from exc

    def close(self, *, release_store: bool = False) -> None:
        """Drops the process group (peers then fail fast); `release_store` drops the store too."""
        if self._pg is not None:
            # NCCL needs an abort to unblock peers; gloo's shutdown closes its sockets now, even
            # while a failed collective's traceback holds the group. A broken one may refuse.
            with contextlib.suppress(Exception):
                self._pg.abort() if self.backend == "nccl" else self._pg.shutdown()
            self._pg = None
            gc.collect(1)  # a failed collective's young reference cycle holds the group's sockets
        if release_store:  # the last reference: the store's thread stops, its port is free now
            self._store = None
