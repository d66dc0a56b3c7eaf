"""Weight senders: the trainer's end of a transfer into one or more engines.

A sender joins its engines to a transfer once (`connect`) and then pushes a set of named tensors
into all of them per update (`send`). The engines are
[`EngineClient`][weightsync.trainer.client.EngineClient]s: in this process or in their own.

- [`BroadcastWeightSender`][weightsync.trainer.senders.BroadcastWeightSender]: a trainer-rooted
  broadcast group, `nccl` for CUDA tensors (one GPU per rank) or `gloo` for CPU tensors.
- [`IPCWeightSender`][weightsync.trainer.senders.IPCWeightSender]: memory handles for colocated
  engines, CUDA IPC for CUDA tensors or POSIX shared memory for CPU tensors.

[`create_weight_sender`][weightsync.trainer.senders.create_weight_sender] picks one by backend
name, so a script chooses its backend once, at the top, and runs the same code on CPUs and GPUs.
"""

from __future__ import annotations

import contextlib
import logging
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

from weightsync.engine.outputs import WeightVersion
from weightsync.errors import WeightTransferError, WeightValidationError
from weightsync.trainer._calls import collect, in_threads, release_transfers
from weightsync.trainer.client import EngineClient, call_each
from weightsync.transfer.base import TransferStats, WeightTransferUpdateInfo
from weightsync.transfer.ipc_trainer import (
    IPCTrainerSendWeightsArgs,
    IPCTrainerSession,
    ipc_trainer_init,
    ipc_trainer_send_weights,
)
from weightsync.transfer.nccl import (
    NCCLTrainerSendWeightsArgs,
    TrainerGroup,
    trainer_init,
    trainer_send_weights,
)
from weightsync.transfer.wire import WireParams, _WireKeywords

if TYPE_CHECKING:  # typing.Unpack for **kwargs is Python 3.12+
    from typing_extensions import Unpack

__all__ = [
    "BroadcastWeightSender",
    "IPCWeightSender",
    "WeightSender",
    "create_weight_sender",
]

logger = logging.getLogger(__name__)

_SenderT = TypeVar("_SenderT", bound="WeightSender")


class WeightSender(ABC):
    """The trainer's end of a weight transfer into `engines`.

    Use it as a context manager, or call `connect` first and `close` last.

    Args:
        engines: The engines to update; engine `i` is the transfer's worker `i`.

    Raises:
        WeightValidationError: No engines.
    """

    def __init__(self, engines: Sequence[EngineClient]) -> None:
        if not engines:
            raise WeightValidationError("a weight sender needs at least one engine, got none")
        self.engines = list(engines)
        self._connected = False
        # Each round of calls into the engines waits wire.client_timeout_s at most: longer than
        # the transfer steps those calls wait for, whose more precise errors then come first.
        self.wire = WireParams()

    @property
    def is_connected(self) -> bool:
        """Whether `connect` succeeded and `close` was not called."""
        return self._connected

    @abstractmethod
    def connect(self) -> None:
        """Joins every engine to this transfer; blocks until all of them are in."""

    def send(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        *,
        weight_version: WeightVersion | None = None,
    ) -> TransferStats:
        """Pushes `(name, tensor)` pairs into every engine as one update transaction.

        Every engine opens the transaction (`start_weight_update`) before any byte moves, and
        finishes it (`finish_weight_update`) once the transfer is done; if anything fails, every
        engine aborts it (`abort_weight_update`). The engines must be paused or idle (see
        [`sync_weights`][weightsync.trainer.sync.sync_weights], which pauses them). Each one
        validates the update against its model before any byte moves.

        Args:
            weights: `(name, tensor)` pairs under the engine's (Hugging Face) names, e.g.
                `model.named_parameters()`.
            weight_version: The label the engines' weight version takes (the trainer's step);
                None counts updates.

        Raises:
            EngineBusyError: An engine is running requests and is not paused; nothing moved.
            WeightUpdateStateError: An engine has a transaction of its own open; nothing moved.
            WeightValidationError: An engine rejected the update; nothing moved, and every
                engine is as it was.
            WeightTransferError: The transfer failed; see `partially_applied`.
            TornWeightsError: An engine's finish found weights torn by an earlier failure that
                this update did not cover: that engine keeps its version while engines that
                finished move to the new one (send an update covering every weight).
        """
        self._check_connected()
        started: list[int] = []  # list.append is atomic: call_each's threads may share it

        def start(index: int) -> None:
            self.engines[index].start_weight_update()
            started.append(index)

        limit = self.wire.client_timeout_s
        try:
            call_each(range(len(self.engines)), start, timeout_s=limit, what="start_weight_update")
            stats = self._transfer(weights, weight_version)
            call_each(
                self.engines,
                lambda engine: engine.finish_weight_update(weight_version),
                timeout_s=limit,
                what="finish_weight_update",
            )
        except BaseException:
            self._abort(started)  # only what this send opened: never another caller's update
            raise
        return stats

    def _abort(self, indices: Sequence[int]) -> None:
        """Ends the transaction on these engines where it is still open; never raises.

        Bounded like every other round of calls: an engine that does not answer is logged and
        left, since the error that brought us here is what the caller must see.
        """
        engines = [self.engines[index] for index in indices]
        futures = in_threads(engines, lambda engine: engine.abort_weight_update())
        try:
            collect(futures, timeout_s=self.wire.client_timeout_s, what="abort_weight_update")
        except Exception:
            logger.exception("engines %s: abort_weight_update failed", list(indices))

    @abstractmethod
    def _transfer(
        self, weights: Iterable[tuple[str, torch.Tensor]], weight_version: WeightVersion | None
    ) -> TransferStats:
        """Moves the tensors into every engine inside their open transactions."""

    @abstractmethod
    def close(self) -> None:
        """Releases the transfer's resources. Safe to call twice."""

    def _check_connected(self) -> None:
        if not self._connected:
            raise WeightTransferError(
                f"this {type(self).__name__} is not connected: call connect() (or use it as a "
                "context manager) before send()"
            )

    def __enter__(self: _SenderT) -> _SenderT:
        if not self._connected:
            self.connect()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class BroadcastWeightSender(WeightSender):
    """Sends over a trainer-rooted broadcast group: `nccl` (CUDA tensors) or `gloo` (CPU).

    The trainer is rank 0 and the engines' workers follow in order: an engine is one worker,
    a data-parallel server as many as its `get_world_size()` says (one per replica). So the
    engines before one hold its first worker index: an engine after two single engines was
    created with `worker_index=2`. Arguments after `engines` are those of
    [`trainer_init`][weightsync.transfer.nccl.trainer_init].

    Args:
        engines: The engines to update.
        backend: `"nccl"` or `"gloo"`.
        master_address: Address the engines reach this process at.
        master_port: Port of the group's store; 0 picks a free one.
        wire: The wire parameters ([`WireParams`][weightsync.transfer.wire.WireParams]); the
            defaults when None.
        **wire_fields: The same, as keywords (`bucket_size_bytes=...`), instead of `wire`.

    Raises:
        WeightValidationError: A bad argument.
    """

    def __init__(
        self,
        engines: Sequence[EngineClient],
        *,
        backend: str = "nccl",
        master_address: str = "127.0.0.1",
        master_port: int = 0,
        wire: WireParams | None = None,
        **wire_fields: Unpack[_WireKeywords],
    ) -> None:
        super().__init__(engines)
        self.wire = WireParams.build(wire, **wire_fields)
        self.backend = backend
        self._group_kwargs: dict[str, Any] = {
            "backend": backend,
            "master_address": master_address,
            "master_port": master_port,
        }
        self.group: TrainerGroup | None = None
        self._world_sizes: list[int] = []  # each engine's transfer workers, from connect()

    def connect(self) -> None:
        """Creates the group, as large as the engines' workers, and joins every engine to it.

        Raises:
            WeightValidationError: An engine's `worker_index` is not the number of workers
                of the engines before it.
            WeightTransferTimeout: Some engine did not join within `timeout_s`.
        """
        sizes = call_each(
            self.engines,
            lambda engine: engine.get_world_size(),
            timeout_s=self.wire.client_timeout_s,
            what="get_world_size",
        )
        self._world_sizes = sizes
        first = 0
        for index, (engine, size) in enumerate(zip(self.engines, sizes, strict=True)):
            declared = getattr(engine, "worker_index", None)
            if isinstance(declared, int) and declared != first:
                raise WeightValidationError(
                    f"engines[{index}] has worker_index {declared}, but the engines before it "
                    f"hold {first} workers, so its first rank is 1 + {first}: create it with "
                    f"worker_index={first}"
                )
            first += size
        group = trainer_init(world_size=1 + first, wire=self.wire, **self._group_kwargs)
        request = {"init_info": group.init_info}
        # Engines join on threads of their own while the trainer forms the group on this one.
        joins = in_threads(self.engines, lambda e: e.init_weight_transfer_engine(request))
        try:
            group.connect(joining=joins)  # a join that fails ends the wait with its error
        except Exception:
            group.close()  # engines still joining fail at once instead of at their timeout
            with contextlib.suppress(Exception):  # the group's error is the one to raise
                collect(
                    joins, timeout_s=self.wire.client_timeout_s, what="init_weight_transfer_engine"
                )
            raise
        try:
            collect(joins, timeout_s=self.wire.client_timeout_s, what="init_weight_transfer_engine")
        except Exception:
            group.close()
            raise
        self.group, self._connected = group, True
        logger.info("%s group formed with %d engines", self.backend, len(self.engines))

    def _transfer(
        self, weights: Iterable[tuple[str, torch.Tensor]], weight_version: WeightVersion | None
    ) -> TransferStats:
        """Broadcasts the tensors to every engine (see `WeightSender.send`)."""
        assert self.group is not None
        pairs = list(weights)  # announced first, then sent: the iterator is read twice
        update_info = WeightTransferUpdateInfo.from_named_tensors(
            pairs, weight_version=weight_version
        ).to_dict()
        request = {"update_info": update_info}
        # Engines receive on threads of their own while the trainer sends on this one.
        receives = in_threads(self.engines, lambda e: e.update_weights(request))
        try:
            # One call per rank: a data-parallel server's one call holds all of its ranks.
            per_rank = [
                c for c, n in zip(receives, self._world_sizes, strict=True) for _ in range(n)
            ]
            args = NCCLTrainerSendWeightsArgs(self.group, update_info, receiving=per_rank)
            stats = trainer_send_weights(pairs, args)
        except WeightValidationError:
            # Rejected in the handshake: nothing moved and the group stays usable.
            with contextlib.suppress(Exception):
                collect(receives, timeout_s=self.wire.client_timeout_s, what="update_weights")
            raise
        except Exception:
            self._connected = False  # the group is closed after a failed send
            with contextlib.suppress(Exception):  # the trainer's error is the one to raise
                collect(receives, timeout_s=self.wire.client_timeout_s, what="update_weights")
            raise
        collect(receives, timeout_s=self.wire.client_timeout_s, what="update_weights")
        return stats

    def close(self) -> None:
        """Closes the group and has every engine leave it. Safe to call twice.

        Engines blocked on the group fail at once, its port is free when this returns, and each
        engine's `shutdown_weight_transfer_engine` frees what it held (bounded, never raising).
        """
        self._connected = False
        group, self.group = self.group, None
        if group is not None:
            group.close()
            release_transfers(self.engines, timeout_s=self.wire.client_timeout_s)


class IPCWeightSender(WeightSender):
    """Sends through memory handles to engines on the same host (the `ipc` backend).

    CUDA tensors travel as CUDA IPC handles, CPU tensors as POSIX shared-memory segments; each
    engine copies the bytes straight out of the trainer's memory. Arguments after `engines` are
    those of [`ipc_trainer_init`][weightsync.transfer.ipc_trainer.ipc_trainer_init].

    Args:
        engines: The engines to update.
        wire: The wire parameters ([`WireParams`][weightsync.transfer.wire.WireParams]);
            `packed=False` exports tensors where they are (zero-copy: CUDA tensors as they are,
            CPU tensors once in shared memory, see `share_module`). The defaults when None.
        **wire_fields: The same, as keywords (`packed=False`), instead of `wire`.
    """

    def __init__(
        self,
        engines: Sequence[EngineClient],
        *,
        wire: WireParams | None = None,
        **wire_fields: Unpack[_WireKeywords],
    ) -> None:
        super().__init__(engines)
        self.backend = "ipc"
        self.wire = WireParams.build(wire, **wire_fields)
        self.session: IPCTrainerSession = ipc_trainer_init(wire=self.wire)

    def share_module(self, module: nn.Module) -> None:
        """Moves a CPU module's parameters into this transfer's shared memory, in place.

        Unpacked sends then export them without a copy; the `nn.Parameter` objects stay, so an
        optimizer created before keeps working. CUDA parameters need nothing.

        Raises:
            WeightValidationError: A parameter is not on the CPU.
        """
        self.session.share_module(module)

    def connect(self) -> None:
        """Gives every engine the session's init info (nothing blocks: no group forms)."""
        request = {"init_info": self.session.init_info}
        call_each(
            self.engines,
            lambda engine: engine.init_weight_transfer_engine(request),
            timeout_s=self.wire.client_timeout_s,
            what="init_weight_transfer_engine",
        )
        self._connected = True

    def _transfer(
        self, weights: Iterable[tuple[str, torch.Tensor]], weight_version: WeightVersion | None
    ) -> TransferStats:
        """Hands the tensors to every engine through memory handles (see `WeightSender.send`)."""

        def deliver(update_info: dict[str, Any]) -> None:
            request = {"update_info": update_info}
            # The session bounds each delivery by timeout_s as well; whichever comes first.
            call_each(
                self.engines,
                lambda engine: engine.update_weights(request),
                timeout_s=self.wire.timeout_s,
                what="update_weights",
            )

        args = IPCTrainerSendWeightsArgs(self.session, deliver, weight_version=weight_version)
        return ipc_trainer_send_weights(weights, args)

    def close(self) -> None:
        """Unlinks every segment of the session and has every engine leave it. Safe to call twice.

        Each engine's `shutdown_weight_transfer_engine` unmaps the session's memory (bounded,
        never raising).
        """
        joined, self._connected = self._connected, False
        self.session.close()
        if joined:
            release_transfers(self.engines, timeout_s=self.wire.client_timeout_s)


def create_weight_sender(
    backend: str, engines: Sequence[EngineClient], **kwargs: Any
) -> WeightSender:
    """Returns the sender for `backend`: `"nccl"` or `"gloo"` (broadcast) or `"ipc"`.

    Args:
        backend: The transfer backend.
        engines: The engines to update.
        **kwargs: Further arguments of the sender's class (bucket size, timeout, ...).

    Raises:
        WeightValidationError: Unknown backend.

    >>> from weightsync.engine.llm_engine import LLMEngine
    >>> sender = create_weight_sender("ipc", [LLMEngine("debug")])
    >>> type(sender).__name__
    'IPCWeightSender'
    >>> sender.close()
    """
    if backend in ("nccl", "gloo"):
        return BroadcastWeightSender(engines, backend=backend, **kwargs)
    if backend == "ipc":
        return IPCWeightSender(engines, **kwargs)
    raise WeightValidationError(
        f"backend must be 'nccl', 'gloo' or 'ipc', got {backend!r}: broadcast to engines on "
        "other devices or hosts, ipc to engines on the same host"
    )
