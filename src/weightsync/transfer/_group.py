"""A broadcast group made only for weight transfer, with timeouts and clear errors.

The group is built from its own `TCPStore` and a backend process group constructed directly
(gloo or NCCL), so it never touches torch.distributed's default group: a trainer already running
FSDP or DDP keeps its own. The trainer is rank 0 and hosts the store.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import resource
import socket
from typing import Any

import torch
import torch.distributed as dist

from weightsync.errors import WeightTransferError, WeightValidationError
from weightsync.transfer._group_store import GroupStore, translate
from weightsync.transfer.base import WireParams

__all__ = [
    "INIT_ERRORS",
    "BroadcastGroup",
    "BroadcastWork",
    "bind_listener",
    "check_backend",
    "check_port",
    "check_world_size",
]

_BACKEND_DEVICES = {"gloo": "cpu", "nccl": "cuda"}


INIT_ERRORS = "init_errors"
"""Store key a worker appends the reason its join failed to, as `"rank R: Error: message"`."""

# A rank keeps up to two connections per other rank: the group's store (the trainer hosts it and
# every worker connects to it) and the transfer link (gloo links every pair of ranks). A process
# keeps this many files free for everything else it opens.
_LINKS_PER_PEER = 2
_FILES_KEPT_FREE = 64


def _world_size_limit() -> tuple[int, int]:
    """The largest world size this process can be a rank of, and its open-file limit.

    Every connection is a file; a world larger than the limit allows fails, on some rank, only
    after everyone waited for it (and rank 0 would first allocate for every rank).
    """
    files, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if files == resource.RLIM_INFINITY:
        files = 1 << 20  # the kernel's own ceiling on open files (fs.nr_open) by default
    return 1 + max(0, (files - _FILES_KEPT_FREE) // _LINKS_PER_PEER), files


def check_world_size(world_size: object) -> int:
    """Returns `world_size` after checking that a group of that size can exist here.

    Raises:
        WeightValidationError: Not an int >= 2, or larger than this process's open-file limit
            allows (the message gives the limit and how to raise it).
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 2:
        raise WeightValidationError(
            f"world_size must be an int >= 2 (the trainer plus at least one worker), got {world_size!r}"
        )
    limit, files = _world_size_limit()
    if world_size > limit:
        raise WeightValidationError(
            f"world_size {world_size} is more than any group this process can be a rank of: a "
            f"rank keeps up to {_LINKS_PER_PEER} connections per other rank (the group's store "
            f"and its transfer link) and this process may open {files} files (RLIMIT_NOFILE), "
            f"so world_size can be at most {limit}: use fewer workers, or raise the limit "
            "(ulimit -n) on every host"
        )
    return world_size


def check_backend(backend: str) -> torch.device:
    """Returns the device a backend's tensors live on, or raises if it cannot run here.

    Raises:
        WeightValidationError: Unknown backend, or `nccl` without CUDA (nothing falls back).
    """
    if backend not in _BACKEND_DEVICES:
        raise WeightValidationError(
            f"backend must be one of {sorted(_BACKEND_DEVICES)}, got {backend!r}"
        )
    if backend == "nccl":
        if not torch.cuda.is_available() or not hasattr(dist, "ProcessGroupNCCL"):
            raise WeightValidationError(
                "backend 'nccl' needs CUDA and a torch build with NCCL, and this process has "
                "neither; use backend 'gloo' for CPU tensors"
            )
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_port(port: object, *, allow_zero: bool = True) -> int:
    """Returns `port` after checking it is a TCP port (0 lets the trainer pick a free one).

    Raises:
        WeightValidationError: Not an int (a bool is not), or outside 0-65535 (1-65535 when 0 is
            not allowed).
    """
    low = 0 if allow_zero else 1
    if not isinstance(port, int) or isinstance(port, bool) or not low <= port <= 65535:
        raise WeightValidationError(f"master_port must be an int in {low}-65535, got {port!r}")
    return port


def bind_listener(address: str, port: int) -> socket.socket:
    """A TCP socket listening on `address`:`port` only (port 0: a free one).

    Raises:
        WeightTransferError: The address does not resolve, or the port is taken or not allowed;
            the message names `master_address` / `master_port`.
    """
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(
            address, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except (OSError, UnicodeError) as exc:
        raise WeightTransferError(
            f"master_address {address!r} does not resolve on this host: {exc}; give an address "
            "of this machine that the workers can reach"
        ) from exc
    listener = socket.socket(family, kind, proto)
    try:
        # Connections the store closed linger in TIME_WAIT; they must not keep the port from
        # being bound again right after close(). A live listener still refuses a second bind.
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(sockaddr)
        listener.listen(socket.SOMAXCONN)
    except OSError as exc:
        listener.close()
        raise WeightTransferError(
            f"cannot listen on master_address {address!r}, master_port {port}: {exc}; pick a "
            "free port (master_port=0 picks one) or an address of this machine"
        ) from exc
    return listener


class BroadcastWork:
    """A pending collective; `wait()` blocks at most the group's timeout and raises clearly."""

    def __init__(self, work: Any, what: str, timeout_s: float) -> None:
        self._work = work
        self._what = what
        self._timeout_s = timeout_s

    def wait(self) -> None:
        """Blocks until the collective is done on this rank.

        Raises:
            WeightTransferTimeout: It ran past the group's timeout.
            WeightTransferError: It failed (typically a peer died).
        """
        try:
            self._work.wait(datetime.timedelta(seconds=self._timeout_s))
        except Exception as exc:
            raise translate(self._what, exc, self._timeout_s) from exc


class BroadcastGroup(GroupStore):
    """One end of a trainer-rooted group: rank 0 is the trainer, ranks 1..N the workers.

    Args:
        backend: `"gloo"` (CPU tensors) or `"nccl"` (CUDA tensors).
        master_address: Host of the trainer's store.
        master_port: Port of the store; 0 lets the trainer pick a free one (see `port`).
        rank: This process's rank; 0 is the trainer, which hosts the store.
        world_size: 1 + the number of workers.
        timeout_s: Limit for the rendezvous and for every collective, in seconds.

    Raises:
        WeightValidationError: Bad rank, world size, timeout or backend.
        WeightTransferTimeout: The store cannot be reached within `timeout_s`.
    """

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
        check_world_size(world_size)
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise WeightValidationError(
                f"rank must be in [0, world_size={world_size}), got {rank!r}: world_size counts "
                "the trainer (rank 0) plus every worker (rank_offset + worker index)"
            )
        check_port(master_port)
        WireParams(timeout_s=timeout_s)  # the one check of a timeout
        self.backend = backend
        self.device = check_backend(backend)
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = float(timeout_s)
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._pg: Any = None
        self._store_stuck = False
        self.where = f"the transfer store at {master_address}:{master_port}"
        if rank == 0:
            self._store = self._host_store(master_address, master_port)
        else:
            self._store = self._call(
                f"connecting to the transfer store at {master_address}:{master_port}",
                lambda: dist.TCPStore(  # type: ignore[attr-defined]
                    master_address, master_port, world_size, False, timeout=self._timeout
                ),
            )
        self.port: int = self._store.port
        self.where = f"the transfer store at {master_address}:{self.port}"

    def _host_store(self, address: str, port: int) -> Any:
        """The trainer's store, listening on `address` only (torch alone takes every interface)."""
        listener = bind_listener(address, port)
        bound_port = listener.getsockname()[1]
        fd = listener.detach()  # the store owns the socket from here and closes it with itself
        try:
            return self._call(
                f"starting the transfer store on {address}:{bound_port}",
                lambda: dist.TCPStore(  # type: ignore[attr-defined]
                    address,
                    bound_port,
                    self.world_size,
                    True,
                    timeout=self._timeout,
                    wait_for_workers=False,
                    master_listen_fd=fd,
                    use_libuv=False,  # the libuv server ignores a given socket
                ),
            )
        except WeightTransferError:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise

    # --- collectives --------------------------------------------------------------------------

    def connect(self, timeout_s: float | None = None) -> None:
        """Forms the process group; blocks until every rank has joined or the timeout passes.

        Args:
            timeout_s: Limit of the rendezvous in seconds: what is left of the caller's own
                `timeout_s` (default: the group's). Collectives keep the group's timeout.
        """
        if self._pg is not None:
            return
        limit_s = self.timeout_s if timeout_s is None else max(timeout_s, 0.001)
        limit = datetime.timedelta(seconds=limit_s)
        prefix = dist.PrefixStore("weightsync", self._store)  # type: ignore[attr-defined]
        what = f"forming the {self.backend} group (rank {self.rank} of {self.world_size})"
        if self.backend == "gloo":
            # gloo bounds its rendezvous by this timeout; every collective passes its own.
            self._pg = self._call(
                what, lambda: dist.ProcessGroupGloo(prefix, self.rank, self.world_size, limit)
            )
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self._timeout
            self._pg = self._call(
                what, lambda: dist.ProcessGroupNCCL(prefix, self.rank, self.world_size, options)
            )
            # NCCL connects lazily; a tiny collective makes the rendezvous happen (and time out) here.
            probe = torch.zeros(1, device=self.device)
            self.all_reduce(probe, timeout_s=limit_s)

    @property
    def is_connected(self) -> bool:
        """Whether the process group is formed and not closed."""
        return self._pg is not None

    def _require_pg(self) -> Any:
        if self._pg is None:
            raise WeightTransferError(
                "the transfer group is not connected (never formed, or closed after a failure)"
            )
        return self._pg

    def broadcast(self, tensor: torch.Tensor, what: str) -> BroadcastWork:
        """Starts broadcasting `tensor` from rank 0 into the same-sized tensor on every rank."""
        pg = self._require_pg()
        options = dist.BroadcastOptions()
        options.rootRank = 0
        options.rootTensor = 0
        options.timeout = self._timeout
        work = self._call(what, lambda: pg.broadcast([tensor], options))
        return BroadcastWork(work, what, self.timeout_s)

    def all_reduce(self, tensor: torch.Tensor, *, timeout_s: float | None = None) -> None:
        """Sums `tensor` over all ranks, in place, and waits for it (`timeout_s`: the group's)."""
        pg = self._require_pg()
        limit_s = self.timeout_s if timeout_s is None else timeout_s
        options = dist.AllreduceOptions()
        options.timeout = datetime.timedelta(seconds=limit_s)
        work = self._call("all-reduce", lambda: pg.allreduce([tensor], options))
        BroadcastWork(work, "all-reduce", limit_s).wait()

    def close(self, *, release_store: bool = False) -> None:
        """Drops the process group; peers blocked on this rank then fail fast.

        Args:
            release_store: Also drop the store: on the trainer its port is free again when this
                returns. Without it the store stays up, so that peers can still read why the
                group closed (after a failure).
        """
        if self._pg is not None:
            # NCCL needs an explicit abort to unblock peers; gloo's shutdown closes its sockets
            # now, even while a failed collective's traceback still references the group. A
            # broken group may refuse either.
            with contextlib.suppress(Exception):
                self._pg.abort() if self.backend == "nccl" else self._pg.shutdown()
            self._pg = None
            # A failed collective's exception chain forms a reference cycle that keeps the group,
            # and its listening sockets, alive until the collector runs; the cycle is young.
            gc.collect(1)
        if release_store:
            # The last reference: the store's server thread stops and its socket closes now,
            # not whenever the garbage collector comes by.
            self._store = None
