"""`LiveWeights`: a model's weights as a trainer updates them, one transaction at a time.

This is the one rulebook of weight updates: one engine runs it, and so does every replica behind
a data-parallel front, which only asks its replicas (`check_finish`, `status`) and fans their
answers in. It owns the receiver side of a transfer backend (see `weightsync.transfer`), the
update transaction (vLLM's four calls as one state machine) and what guards it against the
scheduler (who may update, who may generate, what pause follows):

```
idle --start()--> open --update()*--> open --finish(version)--> idle   (version moves)
                   |                    |
                   +------abort()-------+--> idle: nothing moved -> as before;
                                              bytes moved -> torn, or restored (staging)
```

A bare `update()` opens an implicit transaction that finishes itself once every weight it
announced landed (or, with `finish_bare_updates=False`, waits for `finish()`, so that a front can
commit every replica at once). The version moves only at finish, when every announced weight
landed, no message of the transaction was refused, and no weight is torn; a finish (or a new
start) after a refused message ends the transaction unapplied, as an abort would, so that a client
that knows only vLLM's four calls gets back to serving. Weights a failed transaction may have
half-written are *torn* (no generation) until a transaction covers them; with staging, a failure
or abort copies back the touched weights.

An update is refused on a busy, unpaused engine (and a broadcast's trainer learns why); while a
transaction is open or weights are torn the scheduler stays paused, and an engine that an update
paused resumes once the update ends.

A transaction may instead be addressed to a LoRA adapter (`start(lora_name=...)`): the same
calls, the same refusals, checked against the adapter's specs, landed in fresh tensors of its next
version that the engine's adapters (an `AdapterSink`) make current at finish. The model's weights
and version stay, nothing pauses, and a failure only drops the fresh tensors. One transaction is
open at a time, of the model or of an adapter.

One concept: the update transaction and what guards it. Its record, its refusals, the ends of an
update (finished, refused at finish, failed, aborted, replaced) and the pause it holds are one
state machine, read in one place; cut in two, each half would need the other's rules.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from weightsync.config import WeightTransferConfig
from weightsync.engine._finite import non_finite_names
from weightsync.engine._scheduler import Scheduler
from weightsync.engine.model import LlamaForCausalLM
from weightsync.engine.outputs import WeightVersion
from weightsync.engine.pause import PauseState
from weightsync.errors import (
    DuplicateMessageError,
    EngineBusyError,
    EngineStateError,
    IncompleteWeightUpdateError,
    InvalidRequestError,
    NonFiniteWeightsError,
    TornWeightsError,
    WeightSyncError,
    WeightTransferError,
    WeightUpdateStateError,
    WeightValidationError,
)
from weightsync.transfer.base import (
    TensorSpec,
    TransferStats,
    WeightTransferEngine,
    WeightTransferUpdateInfo,
    _is_int,
)
from weightsync.transfer.disk import (
    DiskWeightTransferEngine,
    DiskWeightTransferUpdateInfo,
    WeightDir,
)

__all__ = [
    "AdapterCommit",
    "AdapterSink",
    "LiveWeights",
    "WeightUpdateStatus",
    "unwrap_request",
    "update_info_of",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WeightUpdateStatus:
    """The weight update in progress, as a caller may see it.

    Attributes:
        explicit: Opened by `start_weight_update` (else by a bare `update_weights`).
        num_announced: Weights its messages announced.
        num_landed: Weights delivered completely.
        complete: Every announced weight landed and no message of it was refused: the update
            may finish now.
        lora_name: The LoRA adapter the update is addressed to; None: the model's weights.
    """

    explicit: bool
    num_announced: int
    num_landed: int
    complete: bool
    lora_name: str | None = None


@dataclass(frozen=True)
class AdapterCommit:
    """What the finish of a LoRA adapter's update did.

    Attributes:
        lora_name: The adapter.
        weight_version: The version the adapter took (the label given at finish, else the
            adapter's own count of versions).
        dropped_versions: Older versions of the adapter that requests still used and that the
            engine let go to stay within its limit of versions per adapter (oldest first);
            their requests ended as an abort ends them.
    """

    lora_name: str
    weight_version: WeightVersion
    dropped_versions: list[WeightVersion]


class AdapterSink(Protocol):
    """Where an adapter's update lands: the engine's LoRA adapters, as `LiveWeights` sees them."""

    def adapter_specs(
        self, lora_name: str, lora_config: Mapping[str, Any] | None
    ) -> dict[str, TensorSpec]:
        """The tensors an update of `lora_name` must bring, by PEFT name.

        Without `lora_config`, those of the adapter's current version; with it, those of the
        adapter it describes (a new one, or a new shape of a loaded one).

        Raises:
            LoRAAdapterNotFoundError: No config, and no adapter of that name is loaded.
            LoRAAdapterError: The config is refused (a rank above the maximum, say).
        """
        ...

    def commit_adapter(
        self,
        lora_name: str,
        tensors: dict[str, torch.Tensor],
        lora_config: Mapping[str, Any] | None,
        weight_version: WeightVersion | None,
    ) -> AdapterCommit:
        """Builds the adapter's new version from `tensors` and makes it current.

        Raises:
            LoRAAdapterError: The builder refused the tensors; nothing changed.
        """
        ...


@dataclass
class _AdapterTarget:
    """Where an adapter transaction lands: fresh tensors of the adapter's next version."""

    lora_name: str
    lora_config: Mapping[str, Any] | None
    specs: dict[str, TensorSpec]
    tensors: dict[str, torch.Tensor]


@dataclass
class _Transaction:
    """One weight update in progress: what it announced, what landed, what it may have written.

    `touched` holds names whose bytes may have been written (completely or not); `refused` says
    why a message meant for this update was refused, until one is accepted again; `update_id` is
    the transfer's own id of the update, from its first message that has one.
    """

    explicit: bool
    update_id: str | None = None
    announced: set[str] = field(default_factory=set)
    landed: set[str] = field(default_factory=set)
    touched: set[str] = field(default_factory=set)
    refused: str | None = None
    label: WeightVersion | None = None
    staged: dict[str, torch.Tensor] | None = None
    adapter: _AdapterTarget | None = None  # an adapter's update: the model's weights stay

    @property
    def complete(self) -> bool:
        return self.refused is None and self.announced <= self.landed


# Every generated token carries its version label: bounded, so one call cannot bloat each stream.
_MAX_LABEL_CHARS = 256
_MAX_LABEL_INT = 2**63  # an int label fits in a signed 64-bit integer, as a count of updates does


def _repeats_landed(exc: WeightSyncError, txn: _Transaction, names: list[str]) -> bool:
    """Whether `exc` refused a repeat of a message whose weights `txn` landed already."""
    # A repeat of an earlier update's message (a client that keeps one send_id) is refused too,
    # and is then the open update's message that did not come: the finish must not apply it.
    return isinstance(exc, DuplicateMessageError) and set(names) <= txn.landed


def _check_label(value: object, *, param: str) -> None:
    """Refuses a version label that is not a short string or a 64-bit int."""
    if isinstance(value, str) and len(value) <= _MAX_LABEL_CHARS:
        return
    if _is_int(value) and abs(value) < _MAX_LABEL_INT:
        return
    shown = repr(value) if isinstance(value, str | int) else type(value).__name__
    shown = shown if len(shown) <= 60 else f"{shown[:60]}... ({len(shown)} characters)"
    raise WeightValidationError(
        f"{param} must be a string of at most {_MAX_LABEL_CHARS} characters or a 64-bit int, "
        f"got {shown}"
    )


def unwrap_request(request: Any, key: str, method: str) -> Any:
    """Takes `key` out of a vLLM-style request envelope (`{"update_info": {...}}`)."""
    if isinstance(request, Mapping) and key in request:
        return request[key]
    if not isinstance(request, Mapping) and hasattr(request, key):
        return getattr(request, key)
    got = sorted(request) if isinstance(request, Mapping) else type(request).__name__
    raise InvalidRequestError(
        f"{method} expects {{'{key}': {{...}}}} as in vLLM's LLM.{method}; got {got}"
    )


def update_info_of(request: Mapping[str, Any]) -> Any:
    """The update info of an `update_weights` request: vLLM's envelope, or prime-rl's `weight_dir`."""
    if isinstance(request, Mapping) and "weight_dir" in request and "update_info" not in request:
        return WeightDir(path=request["weight_dir"])
    return unwrap_request(request, "update_info", "update_weights")


def _info_field(info: Any, key: str) -> Any:
    """Reads `key` from an info given as a dict or a dataclass; None when absent."""
    if isinstance(info, Mapping):
        return info.get(key)
    return getattr(info, key, None)


def _copier(
    tensors: Mapping[str, torch.Tensor],
) -> Callable[[list[tuple[str, torch.Tensor]]], None]:
    """A `load_weights` that copies each received tensor into `tensors[name]`."""

    def load(pairs: list[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            for name, tensor in pairs:
                target = tensors[name]
                if tensor.data_ptr() != target.data_ptr():  # else it landed in place
                    target.copy_(tensor)

    return load


class LiveWeights:
    """Receives weight updates into a model as transactions and tracks their version.

    Args:
        model: The model whose weights are updated in place.
        transfer_config: Selects the transfer backend; None takes the backend named in the
            init info.
        weight_version: Version of the initial weights.
        worker_index: This worker's index among the transfer group's workers.
        staging: Copy the weights a transaction touches before it touches them, so a failed or
            aborted transaction restores them. Costs one copy of the updated weights in memory,
            kept between updates so that each copy lands in memory already mapped, and a copy per
            update.
        refuse_non_finite: Refuse, at finish, an update that wrote a NaN or an infinity.
        finish_bare_updates: A bare update finishes itself once every weight it announced landed
            (False: it waits for `finish()`, as a replica behind a data-parallel front does).
        on_write: Called whenever weight bytes change (a message landed, a failed update was
            restored): what was computed with the old weights, cached KV say, is stale.
        scheduler: The scheduler these weights guard: an update needs it paused or idle, and
            it stays paused while an update is open or weights are torn. None: no scheduler
            (the weights alone, as a test drives them).
        adapters: The engine's LoRA adapters, which an update addressed to one of them
            (`start(lora_name=...)`) lands in; None: no adapter takes updates.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        *,
        transfer_config: WeightTransferConfig | None = None,
        weight_version: WeightVersion = 0,
        worker_index: int = 0,
        staging: bool = False,
        refuse_non_finite: bool = False,
        finish_bare_updates: bool = True,
        on_write: Callable[[], None] | None = None,
        scheduler: Scheduler | None = None,
        adapters: AdapterSink | None = None,
    ) -> None:
        self.model = model
        self.scheduler = scheduler
        self.adapters = adapters
        self.last_adapter_commit: AdapterCommit | None = None  # what the last finish of one did
        self._resume_when_done = False  # an update paused the running engine
        self.transfer_config = transfer_config
        self.worker_index = worker_index
        self.staging = staging
        self.refuse_non_finite = refuse_non_finite
        self.finish_bare_updates = finish_bare_updates
        self.weight_version: WeightVersion = weight_version
        self.num_updates = 0
        self.torn_names: set[str] = set()
        # The torn weights a level-2 sleep emptied (not a failed update): errors name the cause.
        self._torn_by_sleep: set[str] = set()
        self._transaction: _Transaction | None = None
        self._on_write = on_write or (lambda: None)
        self._staging_buffers: dict[str, torch.Tensor] = {}  # reused by every staged transaction
        self._transfer: WeightTransferEngine | None = None
        self._disk: WeightTransferEngine | None = None  # loads weight_dir beside _transfer
        # While asleep, the weights take no update; discarded ones hold no memory until woken.
        self._asleep = False
        self._discarded: list[tuple[torch.UntypedStorage, int]] = []

    @property
    def is_torn(self) -> bool:
        """Whether some weights may be half-written by a failed update."""
        return bool(self.torn_names)

    def torn_cause(self) -> str:
        """What tore the torn weights, for an error message: a failed update, a level-2 sleep.

        For example: `"a level-2 sleep discarded 12 weights (e.g. ['lm_head.weight']), and
        since wake_up they hold nothing valid"`.
        """
        by_sleep = sorted(self._torn_by_sleep & self.torn_names)
        by_update = sorted(self.torn_names - self._torn_by_sleep)
        causes = []
        if by_update:
            causes.append(
                f"a failed weight update left {len(by_update)} weights torn (e.g. {by_update[:3]})"
            )
        if by_sleep:
            causes.append(
                f"a level-2 sleep discarded {len(by_sleep)} weights (e.g. {by_sleep[:3]}), and "
                "since wake_up they hold nothing valid"
            )
        return "; and ".join(causes)

    @property
    def in_update(self) -> bool:
        """Whether a weight update (a transaction) is in progress."""
        return self._transaction is not None

    @property
    def holds_generation(self) -> bool:
        """Whether the engine must not run a forward pass: model weights in update, or torn.

        An adapter's update holds nothing: it lands beside the version requests use.
        """
        return self._holds_model() or self.is_torn

    def _holds_model(self) -> bool:
        """Whether an update of the model's weights (not an adapter's) is open."""
        # Read once: an adapter's message may end its transaction on the transfer thread while
        # the step thread asks.
        txn = self._transaction
        return txn is not None and txn.adapter is None

    def status(self) -> WeightUpdateStatus | None:
        """The update in progress, or None."""
        txn = self._transaction
        if txn is None:
            return None
        lora_name = txn.adapter.lora_name if txn.adapter is not None else None
        return WeightUpdateStatus(
            txn.explicit, len(txn.announced), len(txn.landed), txn.complete, lora_name
        )

    # --- the transfer engine ------------------------------------------------------------------

    def init_transfer_engine(self, init_info: Mapping[str, Any]) -> None:
        """Creates the receiver engine (once) and joins the trainer's transfer group.

        Blocks until the group forms or the backend's timeout passes.

        Raises:
            WeightValidationError: No backend is known, or the init info is malformed.
            WeightTransferTimeout: The trainer did not show up in time.
            WeightUpdateStateError: A weight update is in progress: finish or abort it first.
        """
        self._refuse_during_update("init_weight_transfer_engine")
        if self._transfer is None:
            config = self.transfer_config
            if config is None:
                backend = _info_field(init_info, "backend")
                if not isinstance(backend, str):
                    raise WeightValidationError(
                        "init_info names no backend and the engine has no weight_transfer_config: "
                        "pass weight_transfer_config=WeightTransferConfig(backend=...) to the engine"
                    )
                config = WeightTransferConfig(backend=backend)
            self._transfer = self._create_transfer(config)
        self._transfer.init_transfer_engine(init_info)

    def _create_transfer(self, config: WeightTransferConfig) -> WeightTransferEngine:
        engine_class = config.engine_class
        if issubclass(engine_class, DiskWeightTransferEngine):
            return self._create_disk_reader(engine_class)
        return config.create_engine(
            worker_index=self.worker_index,
            expected_specs=self.model.weight_specs(),
            params=self.model.unfused_parameters(),
        )

    def _create_disk_reader(
        self, engine_class: type[DiskWeightTransferEngine]
    ) -> WeightTransferEngine:
        # A directory's tensors are read in place, the fused weights' row blocks included.
        return engine_class(
            worker_index=self.worker_index,
            expected_specs=self.model.weight_specs(),
            params=dict(self.model.named_weights()),
        )

    def _refuse_during_update(self, call: str) -> None:
        """Raises `WeightUpdateStateError` while an update is in progress: `call` must wait."""
        if self._transaction is not None:
            raise WeightUpdateStateError(
                f"{call}: a weight update is in progress: finish it with "
                "finish_weight_update(...) or end it with abort_weight_update() first"
            )

    def _require_transfer(self, call: str) -> WeightTransferEngine:
        config = self.transfer_config
        if self._transfer is None and config is not None and not config.engine_class.needs_init:
            self._transfer = self._create_transfer(config)  # a backend that joins nothing
        if (
            self._transfer is None or not self._transfer.is_initialized
        ):  # a refused init joined nothing
            raise EngineStateError(
                f"{call} needs a transfer engine: call "
                "init_weight_transfer_engine({'init_info': ...}) first"
            )
        return self._transfer

    # --- the transaction ----------------------------------------------------------------------

    def start(
        self, *, lora_name: str | None = None, lora_config: Mapping[str, Any] | None = None
    ) -> None:
        """Opens a transaction (`start_weight_update`).

        Needs no transfer engine, as vLLM's: a transaction with no message is a relabel (its
        finish moves the version, no byte changes).

        A transaction left open by a refused message (see `finish`) is ended first, unapplied,
        as `abort` would end it: a client that knows only vLLM's calls starts again after a
        refusal, and vLLM's own start begins afresh.

        An idle, unpaused engine pauses for the transaction and resumes after it.

        With `lora_name`, the transaction updates that LoRA adapter instead of the model: its
        messages carry the adapter's tensors under PEFT's names and are checked against the
        adapter's specs (the loaded version's; or, with `lora_config`, those of the adapter the
        config describes, created at finish). They land in fresh tensors of a new version, so
        nothing pauses: requests go on with the version they were admitted with, and those
        admitted after the finish get the new one. One transaction is open at a time, of the
        model or of an adapter.

        Args:
            lora_name: The adapter to update; None: the model's weights.
            lora_config: PEFT's adapter config (`r`, `lora_alpha`, `target_modules`,
                `use_rslora`) of the adapter to build; None: the loaded adapter's shapes.

        Raises:
            EngineBusyError: Requests are in flight and the engine is not paused (an update of
                the model's weights only).
            EngineStateError: The weights are asleep, or an adapter is named and the engine
                serves none.
            LoRAAdapterNotFoundError: `lora_name` is not loaded and no `lora_config` is given.
            LoRAAdapterError: `lora_config` is refused (a rank above the maximum, say).
            WeightUpdateStateError: A transaction is already open (and no message of it was
                refused); it is left as it was.
        """
        self._require_awake("start_weight_update")
        if lora_name is None:
            if lora_config is not None:
                raise WeightValidationError(
                    "start_weight_update: lora_config is given without lora_name: name the "
                    "adapter the config describes"
                )
            self.check_idle("start_weight_update")
        running = self._running()
        txn = self._transaction
        if txn is not None and txn.refused is None:
            whose = (
                f" (LoRA adapter {txn.adapter.lora_name!r}'s; one update at a time, of the "
                "model or of an adapter)"
                if txn.adapter is not None
                else ""
            )
            raise WeightUpdateStateError(
                f"start_weight_update: a weight update is already in progress{whose}: finish it "
                "with finish_weight_update(...) or end it with abort_weight_update()"
            )
        adapter = None if lora_name is None else self._adapter_target(lora_name, lora_config)
        if txn is not None:
            self._end_refused(txn, "start_weight_update")
        self._open(explicit=True, adapter=adapter)
        self._settle(running)

    def _adapter_target(
        self, lora_name: str, lora_config: Mapping[str, Any] | None
    ) -> _AdapterTarget:
        """Fresh tensors for the next version of adapter `lora_name`; refused before any opens."""
        if self.adapters is None:
            raise EngineStateError(
                f"start_weight_update: lora_name={lora_name!r}, but this engine serves no LoRA "
                "adapters: start it with enable_lora=True (weightsync serve --enable-lora)"
            )
        if not isinstance(lora_name, str) or not lora_name:
            raise WeightValidationError(
                f"start_weight_update: lora_name must be a non-empty string, got {lora_name!r:.80}"
            )
        if lora_config is not None and not isinstance(lora_config, Mapping):
            raise WeightValidationError(
                "start_weight_update: lora_config must be a JSON object (PEFT's adapter config), "
                f"got {type(lora_config).__name__}"
            )
        specs = self.adapters.adapter_specs(lora_name, lora_config)
        device = next(iter(self.model.parameters())).device
        tensors = {
            name: torch.empty(spec.shape, dtype=spec.dtype, device=device)
            for name, spec in specs.items()
        }
        config = dict(lora_config) if lora_config is not None else None
        return _AdapterTarget(lora_name, config, specs, tensors)

    def update(
        self, update_info: Mapping[str, Any] | WeightTransferUpdateInfo | WeightDir | list[Any]
    ) -> TransferStats:
        """Receives one message of the open transaction; opens an implicit one if none is open.

        In an adapter's transaction (see `start`), the message lands in the adapter's next
        version, checked against the adapter's specs, and the engine need not be paused.

        A list (vLLM's data-parallel form, one update info per worker rank) gives this worker
        its own entry, `update_info[worker_index]`. A `WeightDir` (prime-rl's `weight_dir`)
        loads a checkpoint directory whatever the engine's backend is.

        The message is validated against the model before any byte moves. A message of another
        update (a late part, a stray or duplicated one) is refused and changes nothing; a
        message refused for what it holds keeps the transaction from finishing until one is
        accepted again.

        Raises:
            EngineBusyError: Requests are in flight and the engine is not paused; the trainer
                learns it too (a broadcast's handshake fails with this reason on every rank).
            EngineStateError: No transfer engine was initialized.
            WeightValidationError: The message was refused; nothing moved.
            WeightTransferError: The transfer failed after bytes moved; the transaction is
                over, its weights torn (or restored, with staging).
        """
        txn = self._transaction
        if txn is not None and txn.adapter is not None:
            return self._update_adapter(txn.adapter, update_info)
        try:
            self.check_idle("update_weights")
        except EngineBusyError as exc:
            if self._transfer is not None:  # a broadcast's trainer waits for our answer
                self._transfer.refuse_update(update_info, exc)  # type: ignore[arg-type]
            raise
        running = self._running()
        try:
            return self._update_message(update_info)
        finally:
            self._settle(running)

    def _update_message(
        self, update_info: Mapping[str, Any] | WeightTransferUpdateInfo | WeightDir | list[Any]
    ) -> TransferStats:
        """`update`, on an engine that may take it."""
        self._require_awake("update_weights")
        if isinstance(update_info, WeightDir):  # the disk backend's update info, as a dict
            return self._update(self._directory_reader(), dataclasses.asdict(update_info))
        if isinstance(update_info, DiskWeightTransferUpdateInfo):
            return self._update(self._directory_reader(), update_info)
        try:
            transfer = self._require_transfer("update_weights")
            own = self._own_entry(update_info) if isinstance(update_info, list) else update_info
        except WeightSyncError as exc:
            self._note_refusal(exc)  # the transaction must not finish as if nothing was sent
            raise
        return self._update(transfer, own)

    def _update_adapter(
        self,
        target: _AdapterTarget,
        update_info: Mapping[str, Any] | WeightTransferUpdateInfo | WeightDir | list[Any],
    ) -> TransferStats:
        """`update` in an adapter's transaction: checked against the adapter, into its tensors."""
        try:
            self._require_awake("update_weights")
            if isinstance(update_info, WeightDir | DiskWeightTransferUpdateInfo):
                raise WeightValidationError(
                    f"update_weights: the update in progress is LoRA adapter "
                    f"{target.lora_name!r}'s, and weight_dir loads the model's weights: send the "
                    "adapter's tensors with update_info (or load an adapter directory with "
                    "load_lora_adapter)"
                )
            transfer = self._require_transfer("update_weights")
            own = self._own_entry(update_info) if isinstance(update_info, list) else update_info
        except WeightSyncError as exc:
            self._note_refusal(exc)
            raise
        # Unknown names (the model's own weights among them), shapes and dtypes are refused
        # against the adapter's specs before any byte moves; bytes land in the new version's
        # tensors, in place where the backend can.
        with transfer.receiving_into(target.specs, target.tensors):
            return self._update(transfer, own)

    def _directory_reader(self) -> WeightTransferEngine:
        """The configured `disk` engine, else one of its own beside a broadcast or IPC backend."""
        if isinstance(self._transfer, DiskWeightTransferEngine):
            return self._transfer
        if self._disk is None:
            self._disk = self._create_disk_reader(DiskWeightTransferEngine)
        return self._disk

    def _update(
        self,
        transfer: WeightTransferEngine,
        update_info: Mapping[str, Any] | WeightTransferUpdateInfo,
    ) -> TransferStats:
        """`update` of this worker's own update info."""
        try:
            info = transfer.parse_update_info(update_info)
            if info.weight_version is not None:
                _check_label(info.weight_version, param="update_info.weight_version")
        except WeightValidationError as exc:
            self._note_refusal(exc)
            transfer.refuse_update(update_info, exc)  # a broadcast's trainer waits for our answer
            raise
        txn, stats = self._transaction_for(transfer, info)
        names = list(info.names)
        if self.staging and txn.adapter is None:  # an adapter's update lands in fresh tensors
            self._stage_or_refuse(transfer, txn, names, update_info)
        if stats is None:
            stats = self._receive(transfer, txn, info, names)
        loaded = names if stats.loaded_names is None else stats.loaded_names
        if loaded and txn.adapter is None:  # the model's weights changed: their KV is stale
            self._on_write()
        if txn.update_id is None:
            txn.update_id = getattr(info, "update_id", None)
        if info.opens_update:
            txn.refused = None  # sent again, and accepted
        txn.announced.update(names)
        txn.landed.update(loaded)
        txn.touched.update(loaded)
        if info.weight_version is not None:
            txn.label = info.weight_version
        if not txn.explicit and txn.complete and self.finish_bare_updates:
            self._finish(None)
        return stats

    def _own_entry(self, update_infos: list[Any]) -> Any:
        """This worker's entry of vLLM's data-parallel form: one update info per worker rank."""
        if len(update_infos) <= self.worker_index:
            raise WeightValidationError(
                f"update_info is a list of {len(update_infos)} entries, one per worker rank, but "
                f"this engine is worker {self.worker_index}: send an entry for every worker, or "
                "one object for all of them"
            )
        return update_infos[self.worker_index]

    def _transaction_for(
        self, transfer: WeightTransferEngine, info: WeightTransferUpdateInfo
    ) -> tuple[_Transaction, TransferStats | None]:
        """The message's transaction (opened if none is); its stats if replacing received it."""
        update_id = getattr(info, "update_id", None)
        txn = self._transaction
        if txn is not None and txn.update_id is not None and update_id != txn.update_id:
            if txn.explicit or not info.opens_update:
                raise WeightValidationError(
                    f"update_weights refused: the message belongs to update {update_id!r}, but "
                    f"the transaction in progress is for update {txn.update_id!r}; it is left "
                    "untouched (finish or abort it before sending another update)"
                )
            # A bare multi-part update was abandoned by its sender, and a new one is announced.
            # An announcement moves no byte, so the receiver checks it first: a refused one
            # leaves the update in progress going on.
            stats = transfer.receive_weights(info, self._load)
            logger.warning("update %s was abandoned before it completed", txn.update_id)
            self._end_failed(txn, forget_transfer=False)  # the receiver follows the new one
            return self._open(explicit=False), stats
        if txn is None:
            txn = self._open(explicit=False)
        return txn, None

    def _open(self, *, explicit: bool, adapter: _AdapterTarget | None = None) -> _Transaction:
        """Opens a transaction, before any of its bytes move."""
        # A rebuild of the packed copies in flight may read what this transaction writes: it
        # is discarded, never installed (its linears read their plain weights meanwhile). An
        # adapter's transaction writes only fresh tensors of its own: the rebuild goes on.
        if adapter is None:
            self.model.cancel_repack()
        self._transaction = _Transaction(explicit=explicit, adapter=adapter)
        return self._transaction

    def _close(self, landed: Iterable[str] = ()) -> None:
        """Closes the transaction after its last write; the copies of `landed` are rebuilt."""
        self._transaction = None
        # The linears holding `landed` drop their copies now and read their new plain weights;
        # a thread rebuilds every missing copy, those of a rebuild this transaction discarded
        # too. A failed one (`_end_failed`) lands nothing: restored weights still match their
        # copies, and torn ones are never generated from until an update covering them commits.
        self.model.repack_linears(landed, wait=False)

    def _note_refusal(self, exc: WeightSyncError) -> None:
        """Marks the open transaction when a message meant to fill it was refused (see `finish`)."""
        # Only while it has no update id: after an accepted announcement, a refused message is a
        # stray, late or repeated one, which changes nothing.
        txn = self._transaction
        if txn is not None and txn.update_id is None:
            txn.refused = str(exc).splitlines()[0][:500]

    def _stage_or_refuse(
        self,
        transfer: WeightTransferEngine,
        txn: _Transaction,
        names: list[str],
        update_info: Mapping[str, Any] | WeightTransferUpdateInfo,
    ) -> None:
        """Stages `names`; a failure (out of memory, say) refuses the message before any byte moved."""
        try:
            self._stage(txn, names)
        except Exception as exc:
            if not txn.explicit and not txn.announced:
                self._close()  # an implicit transaction that never began
            error = WeightTransferError(
                f"staging a copy of {len(names)} weights failed ({type(exc).__name__}: "
                f"{exc}); nothing moved: free memory, or turn weight_update_staging off"
            )
            transfer.refuse_update(update_info, error)
            raise error from exc

    def _receive(
        self,
        transfer: WeightTransferEngine,
        txn: _Transaction,
        info: WeightTransferUpdateInfo,
        names: list[str],
    ) -> TransferStats:
        """Receives one message into `txn`; a failure after bytes moved ends it."""
        load = self._load if txn.adapter is None else _copier(txn.adapter.tensors)
        try:
            return transfer.receive_weights(info, load)
        except WeightValidationError as exc:
            if not txn.explicit and not txn.announced:
                self._close()  # an implicit transaction that never began
            elif info.opens_update and not _repeats_landed(exc, txn, names):
                self._note_refusal(exc)
            raise
        except WeightTransferError as exc:
            if exc.partially_applied:
                txn.touched.update(names)
            self._end_failed(txn)
            raise
        except BaseException:
            txn.touched.update(names)  # an unexpected failure: assume the worst
            self._end_failed(txn)
            raise

    def check_finish(self, weight_version: WeightVersion | None = None) -> None:
        """Raises what `finish(weight_version)` would raise now, changing nothing.

        A data-parallel front asks every replica before any of them moves its version.
        """
        txn = self._finishable(weight_version)
        if txn.refused is not None:
            torn = sorted(txn.touched) if txn.staged is None and txn.adapter is None else []
            if torn:
                raise self._refused_torn_error(txn, torn)
            return
        if txn.adapter is not None:
            bad = self._non_finite_adapter(txn.adapter)
            if bad:
                raise self._non_finite_adapter_error(txn.adapter, bad)
            return
        bad = self._non_finite(txn)
        if bad:
            raise self._non_finite_error(bad, ends="")
        torn = sorted(self.torn_names - txn.landed)
        if torn:
            raise self._torn_error(torn)

    def finish(self, weight_version: WeightVersion | None = None) -> bool:
        """Ends the open transaction; the version moves (`finish_weight_update`).

        The new version is `weight_version`, else the label the messages carried, else the
        count of finished updates.

        If a message of the transaction was refused and not sent again since, the transaction
        ends unapplied instead, as `abort` would end it: nothing it landed stays (restored with
        staging; with nothing landed, nothing changed) and the version stays. This is how a
        client that knows only vLLM's calls, which has no abort, gets back to serving.

        Returns:
            Whether the update was applied (False: it ended unapplied after a refusal).

        Raises:
            WeightUpdateStateError: No transaction is open.
            IncompleteWeightUpdateError: Announced weights have not landed; the transaction
                stays open.
            TornWeightsError: The transaction landed, but weights torn by an earlier failure
                remain; the transaction ends (what it landed is no longer torn), the version
                stays. Or a message was refused after others of the transaction had landed,
                without staging: the transaction ends and those weights are torn.
            WeightValidationError: `weight_version` is not a valid label (a string of at most
                256 characters, or an int).
            NonFiniteWeightsError: `refuse_non_finite` is on and a landed weight holds a NaN or
                an infinity; the transaction ends as a failed one (restored with staging, else
                torn) and the version stays.
        """
        try:
            return self._finish(weight_version)
        finally:
            self._settle(running=False)  # back to the pause state the engine had before

    def _finish(self, weight_version: WeightVersion | None) -> bool:
        txn = self._finishable(weight_version)
        if txn.refused is not None:
            torn = self._end_refused(txn, "finish_weight_update")
            if torn:
                raise self._refused_torn_error(txn, torn)
            return False
        if txn.adapter is not None:
            self._commit_adapter(txn, txn.adapter, weight_version)
            return True
        bad = self._non_finite(txn)
        if bad:
            self._end_failed(txn)
            outcome = "restored" if txn.staged is not None else "torn until a finite update lands"
            raise self._non_finite_error(bad, ends=f" and the update's weights are {outcome}")
        self._close(txn.landed)  # before any step: none multiplies by a copy of the old weights
        self.torn_names -= txn.landed
        self._torn_by_sleep -= txn.landed
        if self.torn_names:
            raise self._torn_error(sorted(self.torn_names))
        self.num_updates += 1
        label = weight_version if weight_version is not None else txn.label
        self.weight_version = label if label is not None else self.num_updates
        logger.info(
            "weights updated to version %r: %d tensors", self.weight_version, len(txn.landed)
        )
        return True

    def _commit_adapter(
        self, txn: _Transaction, target: _AdapterTarget, weight_version: WeightVersion | None
    ) -> None:
        """Finishes an adapter's transaction: its tensors become the adapter's new version."""
        bad = self._non_finite_adapter(target)
        if bad:
            self._end_failed(txn)
            raise self._non_finite_adapter_error(target, bad)
        assert self.adapters is not None  # an adapter's transaction opened only with them
        self._transaction = None  # whatever the builder says, this transaction is over
        label = weight_version if weight_version is not None else txn.label
        commit = self.adapters.commit_adapter(
            target.lora_name, target.tensors, target.lora_config, label
        )
        self.last_adapter_commit = commit
        logger.info(
            "LoRA adapter %r updated to version %r: %d tensors%s", commit.lora_name,
            commit.weight_version, len(target.tensors),
            f"; versions dropped: {commit.dropped_versions}" if commit.dropped_versions else "",
        )  # fmt: skip

    def _non_finite_adapter(self, target: _AdapterTarget) -> list[str]:
        if not self.refuse_non_finite:
            return []
        return non_finite_names(target.tensors.items(), set(target.tensors))

    def _non_finite_adapter_error(
        self, target: _AdapterTarget, bad: list[str]
    ) -> NonFiniteWeightsError:
        return NonFiniteWeightsError(
            f"finish_weight_update refused: {len(bad)} tensors of LoRA adapter "
            f"{target.lora_name!r} hold a NaN or an infinity (e.g. {bad[:3]}); the adapter "
            "keeps its current version: check the trainer's weights, then send a finite update"
        )

    def _end_refused(self, txn: _Transaction, call: str) -> list[str]:
        """Ends, unapplied, a transaction a refused message left open; returns what it tears."""
        torn = sorted(txn.touched) if txn.staged is None and txn.adapter is None else []
        self._end_failed(txn)
        logger.warning(
            "%s: an update_weights of the update in progress was refused (%s): the update ends "
            "unapplied and the version stays %r", call, txn.refused, self.weight_version,
        )  # fmt: skip
        return torn

    def _refused_torn_error(self, txn: _Transaction, torn: list[str]) -> TornWeightsError:
        return TornWeightsError(
            f"finish_weight_update: an update_weights of this update was refused ({txn.refused}) "
            f"after {len(torn)} of its weights had landed (e.g. {torn[:3]}); without staging "
            f"they are torn, and the version stays {self.weight_version!r}: send an update that "
            "covers them (start_weight_update, update_weights, finish_weight_update)"
        )

    def _finishable(self, weight_version: WeightVersion | None) -> _Transaction:
        """The open transaction, if a finish may take it; else the finish's refusal."""
        if weight_version is not None:
            _check_label(weight_version, param="weight_version")
        txn = self._transaction
        if txn is None:
            raise WeightUpdateStateError(
                "finish_weight_update: no weight update is in progress: call "
                "start_weight_update() and update_weights(...) first"
            )
        if txn.refused is not None:
            return txn  # it ends unapplied (see `finish`)
        if txn.adapter is not None:
            # The new version is built from these tensors alone: each one must have landed.
            unsent = sorted(txn.adapter.specs.keys() - txn.landed)
            if unsent:
                raise IncompleteWeightUpdateError(
                    f"finish_weight_update: LoRA adapter {txn.adapter.lora_name!r}'s update "
                    f"must bring all {len(txn.adapter.specs)} of its tensors, but {len(unsent)} "
                    f"have not landed (e.g. {unsent[:3]}): send them with update_weights(...) "
                    "or end the update with abort_weight_update()"
                )
        missing = sorted(txn.announced - txn.landed)
        if missing:
            raise IncompleteWeightUpdateError(
                f"finish_weight_update: {len(missing)} announced weights have not landed "
                f"(e.g. {missing[:3]}): deliver them with update_weights(...) or end the update "
                "with abort_weight_update()"
            )
        return txn

    def _non_finite(self, txn: _Transaction) -> list[str]:
        # A pass over every landed weight: only an engine that refuses non-finite weights pays it.
        if not self.refuse_non_finite:
            return []
        return non_finite_names(self.model.named_weights(), txn.landed)

    def _non_finite_error(self, bad: list[str], *, ends: str) -> NonFiniteWeightsError:
        return NonFiniteWeightsError(
            f"finish_weight_update refused: {len(bad)} weights hold a NaN or an infinity "
            f"(e.g. {bad[:3]}); the version stays {self.weight_version!r}{ends}: check the "
            "trainer's weights (a diverged step, a bad cast), then send a finite update"
        )

    def _torn_error(self, torn: list[str]) -> TornWeightsError:
        # The cause counts every torn weight; `torn` leaves out those this update is landing.
        return TornWeightsError(
            f"finish_weight_update: the update landed, but {len(torn)} weights are still torn "
            f"({self.torn_cause()}); the version stays {self.weight_version!r}: send an update "
            "that covers them"
        )

    def abort(self) -> bool:
        """Ends the open transaction on purpose (`abort_weight_update`).

        Nothing moved: the weights and version are as before. Bytes moved: the touched weights
        are torn, or restored with staging.

        Returns:
            Whether a transaction was open.
        """
        txn = self._transaction
        try:
            if txn is not None:
                self._end_failed(txn)
        finally:
            self._settle(running=False)
        return txn is not None

    def relabel(self, new_version: WeightVersion) -> None:
        """Gives the current weights a new version label; no byte changes.

        Raises:
            WeightUpdateStateError: A weight update is in progress (its finish sets the version).
            WeightValidationError: `new_version` is not a valid label.
        """
        _check_label(new_version, param="new_version")
        if self._holds_model():
            raise WeightUpdateStateError(
                "update_weight_version: a weight update is in progress; its "
                "finish_weight_update(weight_version) sets the version"
            )
        self.weight_version = new_version

    def _stage(self, txn: _Transaction, names: list[str]) -> None:
        """Copies the weights of `names` not copied yet in this transaction."""
        if txn.staged is None:
            txn.staged = {}
        wanted = set(names) - txn.staged.keys()
        if wanted:
            for name, tensor in self.model.named_weights():
                if name in wanted:
                    # Copies land in buffers kept from the last transaction: a copy into memory
                    # already mapped runs several times faster than into fresh pages.
                    buffer = self._staging_buffers.get(name)
                    if buffer is None:
                        buffer = self._staging_buffers[name] = torch.empty_like(tensor)
                    txn.staged[name] = buffer.copy_(tensor)

    def _end_failed(self, txn: _Transaction, *, forget_transfer: bool = True) -> None:
        """Closes a transaction that will not finish: restores or marks what it touched."""
        # forget_transfer=False: the transfer engine already follows another update.
        self._transaction = None
        if forget_transfer and self._transfer is not None:
            self._transfer.abort_update()
        if txn.adapter is not None:  # its tensors were fresh ones: they go, nothing else moved
            logger.warning(
                "update of LoRA adapter %r ended unapplied: the adapter keeps its version",
                txn.adapter.lora_name,
            )
            return
        self._restore_or_tear(txn)
        # Only now, after the last write: a rebuild this transaction discarded starts again
        # from the weights as they stay (see `_close`).
        self.model.repack_linears((), wait=False)

    def _restore_or_tear(self, txn: _Transaction) -> None:
        """Restores what a failed transaction touched (staging), else marks it torn."""
        if not txn.touched:
            return
        self._on_write()
        if txn.staged is not None:
            self.model.load_weights([(n, t) for n, t in txn.staged.items() if n in txn.touched])
            logger.warning(
                "weight update failed or aborted: %d weights restored; version stays %r",
                len(txn.touched), self.weight_version,
            )  # fmt: skip
            return
        self.torn_names |= txn.touched
        self._torn_by_sleep -= txn.touched  # whatever they held before, this failure tore them
        logger.error(
            "weight update failed or aborted after writing part of the weights: %d weights torn",
            len(txn.touched),
        )

    def _load(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        self.model.load_weights(pairs)

    def shutdown(self) -> None:
        """Shuts the transfer engine down. Safe to call twice."""
        if self._transfer is not None:
            self._transfer.shutdown()

    def release_transfer_engine(self) -> None:
        """Shuts the transfer engine down and forgets it: the next init creates a fresh one.

        Raises:
            WeightUpdateStateError: A weight update is in progress: finish or abort it first.
        """
        self._refuse_during_update("shutdown_weight_transfer_engine")
        self.shutdown()
        self._transfer = None

    def reset(self) -> None:
        """Writes zeros over every weight (vLLM's weight-checker `reset`); the version stays.

        A check of an update's coverage: compare the digests after an update against the
        trainer's, and every weight the update missed shows (zero). The weights are whole
        afterwards (each one known), so none stays torn; the engine generates from zeros until
        an update lands.

        Raises:
            EngineStateError: The weights are asleep.
            WeightUpdateStateError: A weight update is in progress.
        """
        self._require_awake("weight_checker reset")
        self._refuse_during_update("weight_checker reset")
        self.model.cancel_repack()
        with torch.no_grad():
            for parameter in self.model.parameters():
                parameter.zero_()
        self.model.repack_linears()
        self.torn_names = set()
        self._torn_by_sleep = set()
        self._on_write()
        logger.warning("every weight was reset to zero; version stays %r", self.weight_version)

    # --- what guards it: the scheduler -------------------------------------------------------

    def _running(self) -> bool:
        return self.scheduler is not None and self.scheduler.state is PauseState.UNPAUSED

    def caller_paused(self) -> None:
        """The caller paused the engine: the pause is theirs, and no update's end resumes it."""
        self._resume_when_done = False

    def _settle(self, running: bool) -> None:
        """Pauses while an update is open or weights are torn; resumes what an update paused."""
        scheduler = self.scheduler
        if scheduler is None:
            return
        in_update, torn = self._holds_model(), self.is_torn
        if in_update or torn:
            if scheduler.state is not PauseState.PAUSED:
                scheduler.pause("keep")  # queued and frozen requests wait for the update
                self._resume_when_done = running and in_update
            if torn:
                self._resume_when_done = False  # a torn engine resumes only when asked to
                logger.error("weights are torn: the engine stays paused")
        elif self._resume_when_done:
            self._resume_when_done = False
            scheduler.resume()

    def check_idle(self, call: str) -> None:
        """Raises `EngineBusyError` when requests run on an engine that is not paused."""
        scheduler = self.scheduler
        if scheduler is None:
            return
        # Requests still in the inbox have not started: they will simply run on the new weights.
        # While the weights hold generation (an open update, torn weights) nothing computes.
        state = scheduler.state
        busy = state is not PauseState.PAUSED and not self.holds_generation
        if busy and scheduler.num_unfinished:
            what = (
                "a wait-mode pause is still draining"
                if state is PauseState.DRAINING
                else "it is not paused"
            )
            raise EngineBusyError(
                f"{call} needs a paused or idle engine, but {scheduler.num_unfinished} "
                f"requests are in flight and {what}: call pause_generation(mode='keep', 'wait' or "
                f"'abort') first, then {call}, then resume_generation()"
            )

    def check_can_generate(self, call: str) -> None:
        """Raises when `call` (`generate()` or `resume_generation()`) could not generate."""
        if self.is_torn:
            raise TornWeightsError(
                f"{call}: {self.torn_cause()}, so the engine does not generate: land an "
                "update that covers them with update_weights(...) first"
            )
        if self._holds_model():
            raise WeightUpdateStateError(
                f"{call}: a weight update is in progress: finish_weight_update(...) or "
                "abort_weight_update() first"
            )
        if (
            call == "generate()"
            and self.scheduler is not None
            and self.scheduler.state is PauseState.PAUSED
        ):
            raise EngineStateError(
                "the engine is paused, so generate() would wait forever: call "
                "resume_generation() first"
            )

    # --- sleep --------------------------------------------------------------------------------

    @property
    def asleep(self) -> bool:
        """Whether the weights sleep: they take no update until `wake`."""
        return self._asleep

    def sleep(self, *, discard: bool) -> None:
        """Puts the weights to sleep (vLLM's `sleep`): no update lands until `wake`.

        Args:
            discard: Free the weights' memory (sleep level 2). They are allocated again at
                `wake`, holding nothing valid: torn until an update covering them lands.

        Raises:
            WeightUpdateStateError: A weight update is in progress: finish or abort it first.
        """
        self.check_can_sleep()
        if discard and not self._discarded:
            # First: no rebuild of the packed copies may read the memory freed below.
            self.model.release_packed_linears()  # the update that covers them repacks them
        self._asleep = True
        if discard and not self._discarded:
            storages = {
                p.untyped_storage().data_ptr(): p.untyped_storage() for p in self.model.parameters()
            }
            for storage in storages.values():
                self._discarded.append((storage, storage.nbytes()))
                storage.resize_(0)  # every parameter and view keeps its storage: its memory goes
            self._on_write()
            logger.info("weights discarded: %d bytes freed", sum(n for _, n in self._discarded))

    def check_can_sleep(self) -> None:
        """Raises what `sleep` would refuse now; changes nothing.

        Raises:
            WeightUpdateStateError: A weight update is in progress: finish or abort it first.
        """
        self._refuse_during_update("sleep")

    def wake(self) -> None:
        """Wakes the weights; discarded ones come back as memory to fill, torn until then."""
        for storage, nbytes in self._discarded:
            storage.resize_(nbytes)
        if self._discarded:
            emptied = {name for name, _ in self.model.named_weights()}
            self.torn_names |= emptied
            self._torn_by_sleep |= emptied
            logger.warning("weights woken after being discarded: torn until an update lands")
        self._discarded = []
        self._asleep = False

    def _require_awake(self, call: str) -> None:
        if self._asleep:
            raise EngineStateError(
                f"{call}: the weights are asleep; wake them first: wake_up() (over HTTP, "
                "POST /wake_up, or /wake_up?tags=weights to wake the weights alone)"
            )
