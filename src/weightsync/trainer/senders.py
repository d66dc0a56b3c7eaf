"""The trainer's end of an update into N engines: the engines' calls, the senders, the sync.

Read top to bottom: what the trainer needs of an engine
([`EngineClient`][weightsync.trainer.senders.EngineClient]), one call on every engine at once
([`call_each`][weightsync.trainer.senders.call_each]), the senders that join the engines once
(`connect`) and push named tensors into all of them per update (`send`): a broadcast group
([`BroadcastWeightSender`][weightsync.trainer.senders.BroadcastWeightSender]) or memory handles
([`IPCWeightSender`][weightsync.trainer.senders.IPCWeightSender]), picked by backend name with
[`create_weight_sender`][weightsync.trainer.senders.create_weight_sender], and
[`sync_weights`][weightsync.trainer.senders.sync_weights]: pause, send, resume.

One concept: the trainer pushing one update into its engines, each round of calls bounded and
the transaction aborted on every engine it opened if a later step fails.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, wait
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch
from torch import nn

from weightsync.engine.errors import TornWeightsError
from weightsync.engine.outputs import WeightVersion
from weightsync.engine.pause import PauseMode
from weightsync.errors import WeightTransferError, WeightTransferTimeout, WeightValidationError
from weightsync.transfer.base import (
    CLIENT_MARGIN_S,
    DEFAULT_TIMEOUT_S,
    TransferStats,
    WeightTransferUpdateInfo,
    WireParams,
    _WireKeywords,
)
from weightsync.transfer.ipc import (
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

if TYPE_CHECKING:  # typing.Unpack for **kwargs is Python 3.12+
    from typing_extensions import Unpack

__all__ = [
    "BroadcastWeightSender",
    "EngineClient",
    "IPCWeightSender",
    "WeightSender",
    "call_each",
    "create_weight_sender",
    "sync_weights",
]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_SenderT = TypeVar("_SenderT", bound="WeightSender")


class EngineClient(Protocol):
    """What the trainer side needs from an inference engine: weight transfer and pause control.

    An engine in the trainer's own process ([`LLMEngine`][weightsync.engine.llm_engine.LLMEngine]),
    one in a process of its own
    ([`EngineProcess`][weightsync.trainer.engine_process.EngineProcess]) and a server behind an
    [`HTTPEngineClient`][weightsync.trainer.http_client.HTTPEngineClient] answer the same blocking
    calls, named as in vLLM's `LLM`: `init_weight_transfer_engine`, the update transaction
    (`start_weight_update`, `update_weights`, `finish_weight_update`, and weightsync's
    `abort_weight_update`), `shutdown_weight_transfer_engine`, `pause_generation` and
    `resume_generation`. The senders and `sync_weights` are written against this protocol only,
    so one sync flow serves them all. Every call blocks until the engine has done it.
    """

    def init_weight_transfer_engine(self, request: Mapping[str, Any]) -> None:
        """Joins the trainer's transfer (`{"init_info": {...}}`); may block until it forms."""

    def start_weight_update(
        self, *, lora_name: str | None = None, lora_config: Mapping[str, Any] | None = None
    ) -> None:
        """Opens a weight-update transaction; no forward pass runs until it ends.

        With `lora_name`, the transaction is that LoRA adapter's, and generation goes on.
        """

    def update_weights(self, request: Mapping[str, Any]) -> TransferStats:
        """Receives one update message (`{"update_info": {...}}`); while paused or idle."""
        ...

    def finish_weight_update(self, weight_version: WeightVersion | None = None) -> None:
        """Ends the transaction; the version moves if every announced weight landed."""

    def abort_weight_update(self) -> bool:
        """Ends the transaction on purpose: as before if nothing moved, else torn or restored."""
        ...

    def shutdown_weight_transfer_engine(self) -> None:
        """Leaves the trainer's transfer and frees what it held; the trainer closes."""

    def pause_generation(self, *, mode: PauseMode = ..., clear_cache: bool = ...) -> None:
        """Pauses generation at a step boundary (`abort`, `wait` or `keep`)."""

    def resume_generation(self) -> None:
        """Resumes generation."""

    def get_world_size(self) -> int:
        """Transfer workers behind this engine: 1, or one per replica of a data-parallel server."""
        ...


def call_each(
    engines: Sequence[_T],
    call: Callable[[_T], Any],
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S + CLIENT_MARGIN_S,
    what: str = "the call",
) -> list[Any]:
    """Runs `call(engine)` for every engine at once and waits for all of them, `timeout_s` at most.

    Engines are independent (data-parallel replicas, say), so one slow engine does not hold up
    the others' calls; a broadcast receive needs exactly this, since every rank must be inside
    the collective before any of them can leave it. Each call runs on a daemon thread: one that
    never returns cannot keep the trainer from exiting.

    Args:
        engines: The engines (any objects `call` accepts).
        call: What to do with each one.
        timeout_s: Limit for all of them together, in seconds; keep it above the limit of what
            the calls wait for (see `CLIENT_MARGIN_S`).
        what: How the timeout's message names the call.

    Returns:
        The results, in the order of `engines`.

    Raises:
        WeightTransferTimeout: Some call did not return within `timeout_s`; the message lists
            the engines (by index) still inside it.
        Exception: When any call failed, after all of them ended: a `WeightValidationError` if
            every failure was one (the update was rejected and nothing moved), else the first
            other failure.

    >>> call_each([1, 2, 3], lambda n: n * 10)
    [10, 20, 30]
    """
    return _collect(_in_threads(engines, call), timeout_s=timeout_s, what=what)


def _in_threads(engines: Sequence[_T], call: Callable[[_T], Any]) -> list[Future[Any]]:
    """Starts `call(engine)` on a daemon thread per engine; returns their futures."""
    futures: list[Future[Any]] = [Future() for _ in engines]

    def run(engine: _T, future: Future[Any]) -> None:
        future.set_running_or_notify_cancel()
        try:
            future.set_result(call(engine))
        except BaseException as exc:  # handed to the waiting thread, which re-raises it
            future.set_exception(exc)

    for engine, future in zip(engines, futures, strict=True):
        name = "weightsync-call"
        threading.Thread(target=run, args=(engine, future), name=name, daemon=True).start()
    return futures


def _collect(futures: Sequence[Future[Any]], *, timeout_s: float, what: str) -> list[Any]:
    """Waits `timeout_s` at most for `_in_threads`' futures; results, or raises as `call_each`."""
    _, pending = wait(futures, timeout=timeout_s)
    if pending:
        stuck = [i for i, f in enumerate(futures) if f in pending]
        raise WeightTransferTimeout(
            f"{what} did not return within {timeout_s:g} s (timeout_s) on engines {stuck}: "
            "they are stuck or unreachable; the calls are abandoned, not stopped"
        )
    errors = [f.exception() for f in futures]
    failures = [e for e in errors if e is not None]
    if failures:
        other = [e for e in failures if not isinstance(e, WeightValidationError)]
        raise (other or failures)[0]
    return [f.result() for f in futures]


def _call_each_quietly(
    engines: Sequence[_T], call: Callable[[_T], Any], *, timeout_s: float, what: str
) -> None:
    """`call_each` for a clean-up (an abort, a close): bounded, logs one line, never raises."""
    try:
        call_each(engines, call, timeout_s=timeout_s, what=what)
    except Exception as exc:  # the caller's own error, or its close, is what must come through
        logger.warning("%s failed on some engine: %s: %s", what, type(exc).__name__, exc)
        logger.debug("%s failure", what, exc_info=True)


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
        for index, engine in enumerate(engines):
            # Called from threads, a coroutine function returns a coroutine nobody awaits: the
            # update would never run while send() returned as if it had.
            if inspect.iscoroutinefunction(getattr(engine, "finish_weight_update", None)):
                raise WeightValidationError(
                    f"engines[{index}] ({type(engine).__name__}) answers with coroutines, which "
                    "a weight sender cannot await: await its weight-update calls yourself, or "
                    "serve it and pass an HTTPEngineClient"
                )
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
        lora_name: str | None = None,
        lora_config: Mapping[str, Any] | None = None,
    ) -> TransferStats:
        """Pushes `(name, tensor)` pairs into every engine as one update transaction.

        Every engine opens the transaction (`start_weight_update`) before any byte moves, and
        finishes it (`finish_weight_update`) once the transfer is done; if anything fails, every
        engine aborts it (`abort_weight_update`). The engines must be paused or idle (see
        [`sync_weights`][weightsync.trainer.senders.sync_weights], which pauses them). Each one
        validates the update against its model before any byte moves.

        Args:
            weights: `(name, tensor)` pairs under the engine's (Hugging Face) names, e.g.
                `model.named_parameters()`.
            weight_version: The label the engines' weight version takes (the trainer's step);
                None counts updates. With `lora_name`, the label of the adapter's new version.
            lora_name: Update this LoRA adapter instead of the model: `weights` are its A and B
                tensors under PEFT's names (`peft.get_peft_model_state_dict(model).items()`),
                and the engines need not be paused.
            lora_config: PEFT's adapter config (`r`, `lora_alpha`, `target_modules`,
                `use_rslora`), to create the adapter where it is not loaded yet.

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
            if lora_name is None and lora_config is None:
                self.engines[index].start_weight_update()  # vLLM's call, exactly
            else:
                self.engines[index].start_weight_update(
                    lora_name=lora_name, lora_config=lora_config
                )
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
            _call_each_quietly(  # only what this send opened: never another caller's update
                [self.engines[index] for index in started],
                lambda engine: engine.abort_weight_update(),
                timeout_s=limit,
                what="abort_weight_update",
            )
            raise
        return stats

    @abstractmethod
    def _transfer(
        self, weights: Iterable[tuple[str, torch.Tensor]], weight_version: WeightVersion | None
    ) -> TransferStats:
        """Moves the tensors into every engine inside their open transactions."""

    @abstractmethod
    def close(self) -> None:
        """Releases the transfer's resources. Safe to call twice."""

    def _leave_transfer(self) -> None:
        """Has every engine free what it held for this transfer; bounded, never raises."""
        _call_each_quietly(
            self.engines,
            lambda engine: engine.shutdown_weight_transfer_engine(),
            timeout_s=self.wire.client_timeout_s,
            what="shutdown_weight_transfer_engine",
        )

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
        wire: The wire parameters ([`WireParams`][weightsync.transfer.base.WireParams]); the
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
        joins = _in_threads(self.engines, lambda e: e.init_weight_transfer_engine(request))
        try:
            group.connect(joining=joins)  # a join that fails ends the wait with its error
        except Exception:
            group.close()  # engines still joining fail at once instead of at their timeout
            with contextlib.suppress(Exception):  # the group's error is the one to raise
                _collect(
                    joins, timeout_s=self.wire.client_timeout_s, what="init_weight_transfer_engine"
                )
            raise
        try:
            _collect(
                joins, timeout_s=self.wire.client_timeout_s, what="init_weight_transfer_engine"
            )
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
        receives = _in_threads(self.engines, lambda e: e.update_weights(request))
        try:
            # One call per rank: a data-parallel server's one call holds all of its ranks.
            per_rank = [
                c for c, n in zip(receives, self._world_sizes, strict=True) for _ in range(n)
            ]
            args = NCCLTrainerSendWeightsArgs(self.group, update_info, receiving=per_rank)
            stats = trainer_send_weights(pairs, args)
        except Exception as exc:
            # Rejected in the handshake, nothing moved and the group stays usable; any other
            # failure closed the group.
            self._connected = isinstance(exc, WeightValidationError)
            with contextlib.suppress(Exception):  # the trainer's error is the one to raise
                _collect(receives, timeout_s=self.wire.client_timeout_s, what="update_weights")
            raise
        _collect(receives, timeout_s=self.wire.client_timeout_s, what="update_weights")
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
            self._leave_transfer()


class IPCWeightSender(WeightSender):
    """Sends through memory handles to engines on the same host (the `ipc` backend).

    CUDA tensors travel as CUDA IPC handles, CPU tensors as POSIX shared-memory segments; each
    engine copies the bytes straight out of the trainer's memory. Arguments after `engines` are
    those of [`ipc_trainer_init`][weightsync.transfer.ipc.ipc_trainer_init].

    Args:
        engines: The engines to update.
        wire: The wire parameters ([`WireParams`][weightsync.transfer.base.WireParams]);
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
            self._leave_transfer()


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


def sync_weights(
    sender: WeightSender,
    weights: Iterable[tuple[str, torch.Tensor]],
    *,
    weight_version: WeightVersion | None = None,
    mode: PauseMode = "keep",
    clear_cache: bool = True,
    lora_name: str | None = None,
    lora_config: Mapping[str, Any] | None = None,
) -> TransferStats:
    """Pauses the sender's engines, pushes `weights` into them, and resumes them.

    With `lora_name`, only that LoRA adapter's tensors travel, and nothing pauses: each engine
    builds a new version of the adapter beside the one in use; requests running keep the
    version they were admitted with, and requests admitted after the update get the new one.

    Every engine pauses (all at once, and all at a step boundary) before any byte moves, and
    resumes only after every engine holds the complete update. With `mode="keep"` (the default)
    requests in flight freeze at a step boundary, take the new weights, and continue: the tokens
    they generate afterwards carry the new weight version. With `clear_cache=True` (the default)
    their KV is recomputed with the new weights on resume, so each token comes from exactly one
    version of the weights.

    Args:
        sender: A connected sender; its engines are the ones paused and updated.
        weights: `(name, tensor)` pairs, e.g. `model.named_parameters()`.
        weight_version: The label of the new weights (the trainer's step); None counts updates.
        mode: Pause mode: `keep` (requests continue with the new weights), `wait` (they finish
            with the old ones first) or `abort` (they end now).
        clear_cache: Drop the KV cache at the pause, so kept requests recompute it with the new
            weights (False: they continue on KV of the old weights; faster, slightly stale).
        lora_name: Update this LoRA adapter instead of the model: `weights` are its tensors
            under PEFT's names, e.g. `peft.get_peft_model_state_dict(model).items()`.
        lora_config: PEFT's adapter config, to create the adapter where it is not loaded yet.

    Returns:
        The trainer side's transfer stats.

    Raises:
        EngineBusyError: An engine could not pause in a way that stops its requests (a `wait`
            pause still draining); nothing moved.
        WeightSyncError: An engine failed to pause (unreachable, say); nothing moved, and every
            engine is resumed.
        WeightValidationError: An engine rejected the update; nothing moved. Every engine is
            resumed on its unchanged weights and version, as before the call.
        WeightTransferError: The transfer failed after bytes moved; every engine whose weights
            are whole (untouched, or restored by staging) is resumed, and an engine with torn
            weights stays paused until an update covering them lands.

    >>> from weightsync.engine.llm_engine import LLMEngine
    >>> from weightsync.engine.model import LlamaForCausalLM
    >>> engine = LLMEngine("debug", seed=0)
    >>> policy = LlamaForCausalLM.from_preset("debug", seed=1)
    >>> with IPCWeightSender([engine]) as sender:
    ...     stats = sync_weights(sender, policy.named_weights(), weight_version="step-1")
    >>> engine.weight_version
    'step-1'
    """
    if lora_name is not None:  # an adapter's update lands beside the version in use
        return sender.send(
            weights, weight_version=weight_version, lora_name=lora_name, lora_config=lora_config
        )
    start = time.perf_counter()
    try:  # an engine that fails to pause must not leave the others paused for nothing
        call_each(sender.engines, lambda e: e.pause_generation(mode=mode, clear_cache=clear_cache))
        paused = time.perf_counter()
        stats = sender.send(weights, weight_version=weight_version)
    except BaseException:
        _resume_whole(sender.engines)
        raise
    sent = time.perf_counter()
    call_each(sender.engines, lambda e: e.resume_generation())
    logger.info(
        "synced %d engines to version %r: pause %.1f ms, %.1f MB in %.1f ms, resume %.1f ms",
        len(sender.engines), weight_version, (paused - start) * 1e3, stats.num_bytes / 1e6,
        (sent - paused) * 1e3, (time.perf_counter() - sent) * 1e3,
    )  # fmt: skip
    return stats


def _resume_whole(engines: Sequence[EngineClient]) -> None:
    """Resumes every engine whose weights are whole after a failed update; never raises."""
    for index, engine in enumerate(engines):
        try:
            engine.resume_generation()
        except TornWeightsError:
            logger.error("engine %d keeps torn weights and stays paused", index)
        except Exception:
            logger.exception("engine %d could not resume after the failed update", index)
