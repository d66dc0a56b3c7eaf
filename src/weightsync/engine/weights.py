"""`LiveWeights`: a model's weights as a trainer updates them, one transaction at a time.

It owns the receiver side of a transfer backend (see `weightsync.transfer`) and the update
transaction, vLLM's four calls as one state machine:

```
idle --start()--> open --update()*--> open --finish(version)--> idle   (version moves)
                   |                    |
                   +------abort()-------+--> idle: nothing moved -> as before;
                                              bytes moved -> torn, or restored (staging)
```

A bare `update()` opens an implicit transaction that finishes itself once every weight it
announced landed. The version moves only at finish, when every announced weight landed and none
is torn. Weights a failed transaction may have half-written are *torn* (no generation) until a
transaction covers them; with staging, a failure or abort copies back the touched weights.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from weightsync.config import WeightTransferConfig
from weightsync.engine._transaction import Transaction, info_field, non_finite_names
from weightsync.engine.model import LlamaForCausalLM
from weightsync.engine.outputs import WeightVersion
from weightsync.errors import (
    EngineStateError,
    IncompleteWeightUpdateError,
    NonFiniteWeightsError,
    TornWeightsError,
    WeightSyncError,
    WeightTransferError,
    WeightUpdateStateError,
    WeightValidationError,
)
from weightsync.transfer.base import TransferStats, WeightTransferEngine, WeightTransferUpdateInfo

__all__ = ["LiveWeights"]

logger = logging.getLogger(__name__)


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
    ) -> None:
        self.model = model
        self.transfer_config = transfer_config
        self.worker_index = worker_index
        self.staging = staging
        self.refuse_non_finite = refuse_non_finite
        self.weight_version: WeightVersion = weight_version
        self.num_updates = 0
        self.torn_names: set[str] = set()
        self.transaction: Transaction | None = None
        self.num_writes = 0  # counts calls that changed weight bytes: cached KV is stale after
        self._staging_buffers: dict[str, torch.Tensor] = {}  # reused by every staged transaction

        self._transfer: WeightTransferEngine | None = None

    @property
    def is_torn(self) -> bool:
        """Whether some weights may be half-written by a failed update."""
        return bool(self.torn_names)

    @property
    def holds_generation(self) -> bool:
        """Whether the engine must not run a forward pass: an update is open or weights are torn."""
        return self.transaction is not None or self.is_torn

    # --- the transfer engine ------------------------------------------------------------------

    def init_transfer_engine(self, init_info: Mapping[str, Any]) -> None:
        """Creates the receiver engine (once) and joins the trainer's transfer group.

        Blocks until the group forms or the backend's timeout passes.

        Raises:
            WeightValidationError: No backend is known, or the init info is malformed.
            WeightTransferTimeout: The trainer did not show up in time.
            WeightUpdateStateError: A weight update is in progress: finish or abort it first.
        """
        if self.transaction is not None:
            raise WeightUpdateStateError(
                "init_weight_transfer_engine: a weight update is in progress: finish it with "
                "finish_weight_update(...) or end it with abort_weight_update() first"
            )
        if self._transfer is None:
            config = self.transfer_config
            if config is None:
                backend = info_field(init_info, "backend")
                if not isinstance(backend, str):
                    raise WeightValidationError(
                        "init_info names no backend and the engine has no weight_transfer_config: "
                        "pass weight_transfer_config=WeightTransferConfig(backend=...) to the engine"
                    )
                config = WeightTransferConfig(backend=backend)
            self._transfer = config.create_engine(
                worker_index=self.worker_index,
                expected_specs=self.model.weight_specs(),
                params=self.model.unfused_parameters(),
            )
        self._transfer.init_transfer_engine(init_info)

    def _require_transfer(self, call: str) -> WeightTransferEngine:
        if self._transfer is None:
            raise EngineStateError(
                f"{call} needs a transfer engine: call "
                "init_weight_transfer_engine({'init_info': ...}) first"
            )
        return self._transfer

    # --- the transaction ----------------------------------------------------------------------

    def start(self, *, resume_after: bool = False) -> None:
        """Opens a transaction (`start_weight_update`).

        Raises:
            EngineStateError: No transfer engine was initialized.
            WeightUpdateStateError: A transaction is already open.
        """
        self._require_transfer("start_weight_update")
        if self.transaction is not None:
            raise WeightUpdateStateError(
                "start_weight_update: a weight update is already in progress: finish it with "
                "finish_weight_update(...) or end it with abort_weight_update()"
            )
        self.transaction = Transaction(explicit=True, resume_after=resume_after)

    def check(self, update_info: Mapping[str, Any] | WeightTransferUpdateInfo) -> None:
        """Refuses, as `update` would, a malformed message or one not matching the model.

        Changes nothing: a data-parallel front asks every replica before it acts on the message.
        """
        transfer = self._require_transfer("update_weights")
        transfer.check_update(transfer.parse_update_info(update_info))

    def update(self, update_info: Mapping[str, Any] | WeightTransferUpdateInfo) -> TransferStats:
        """Receives one message of the open transaction; opens an implicit one if none is open.

        The message is validated against the model before any byte moves. A message of another
        update (a late part, a stray or duplicated one) is refused and changes nothing.

        Raises:
            EngineStateError: No transfer engine was initialized.
            WeightValidationError: The message was refused; nothing moved and the transaction
                is as it was.
            WeightTransferError: The transfer failed after bytes moved; the transaction is
                over, its weights torn (or restored, with staging).
        """
        transfer = self._require_transfer("update_weights")
        try:
            info = transfer.parse_update_info(update_info)
        except WeightValidationError as exc:
            transfer.refuse_update(update_info, exc)  # a broadcast's trainer waits for our answer
            raise
        update_id = getattr(info, "update_id", None)
        stats: TransferStats | None = None
        txn = self.transaction
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
            txn = self.transaction = Transaction(explicit=False, resume_after=txn.resume_after)
        if txn is None:
            txn = self.transaction = Transaction(explicit=False)
        names = list(info.names)
        if self.staging:
            try:
                self._stage(txn, names)
            except Exception as exc:  # out of memory, say: refused before any byte moved
                if not txn.explicit and not txn.announced:
                    self.transaction = None
                error = WeightTransferError(
                    f"staging a copy of {len(names)} weights failed ({type(exc).__name__}: "
                    f"{exc}); nothing moved: free memory, or turn weight_update_staging off"
                )
                transfer.refuse_update(update_info, error)
                raise error from exc
        if stats is None:
            stats = self._receive(transfer, txn, info, names)
        loaded = names if stats.loaded_names is None else stats.loaded_names
        if loaded:
            self.num_writes += 1
        if txn.update_id is None:
            txn.update_id = update_id
        txn.announced.update(names)
        txn.landed.update(loaded)
        txn.touched.update(loaded)
        if info.weight_version is not None:
            txn.label = info.weight_version
        if not txn.explicit and txn.announced <= txn.landed:
            self.finish(None)
        return stats

    def _receive(
        self,
        transfer: WeightTransferEngine,
        txn: Transaction,
        info: WeightTransferUpdateInfo,
        names: list[str],
    ) -> TransferStats:
        """Receives one message into `txn`; a failure after bytes moved ends it."""
        try:
            return transfer.receive_weights(info, self._load)
        except WeightValidationError:
            if not txn.explicit and not txn.announced:
                self.transaction = None  # an implicit transaction that never began
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

    def finish(self, weight_version: WeightVersion | None) -> None:
        """Ends the open transaction; the version moves (`finish_weight_update`).

        The new version is `weight_version`, else the label the messages carried, else the
        count of finished updates.

        Raises:
            WeightUpdateStateError: No transaction is open.
            IncompleteWeightUpdateError: Announced weights have not landed; the transaction
                stays open.
            TornWeightsError: The transaction landed, but weights torn by an earlier failure
                remain; the version stays.
            WeightValidationError: `weight_version` is not a string, an int or None.
            NonFiniteWeightsError: `refuse_non_finite` is on and a landed weight holds a NaN or
                an infinity; the transaction ends as a failed one (restored with staging, else
                torn) and the version stays.
        """
        if weight_version is not None and (
            not isinstance(weight_version, str | int) or isinstance(weight_version, bool)
        ):
            raise WeightValidationError(
                f"weight_version must be a string, an int or None, got {weight_version!r}"
            )
        txn = self.transaction
        if txn is None:
            raise WeightUpdateStateError(
                "finish_weight_update: no weight update is in progress: call "
                "start_weight_update() and update_weights(...) first"
            )
        missing = sorted(txn.announced - txn.landed)
        if missing:
            raise IncompleteWeightUpdateError(
                f"finish_weight_update: {len(missing)} announced weights have not landed "
                f"(e.g. {missing[:3]}): deliver them with update_weights(...) or end the update "
                "with abort_weight_update()"
            )
        self._check_finite(txn)
        self.transaction = None
        self.torn_names -= txn.landed
        if self.torn_names:
            names = sorted(self.torn_names)
            raise TornWeightsError(
                f"finish_weight_update: the update landed, but {len(names)} weights are still "
                f"torn by an earlier failed update (e.g. {names[:3]}); the version stays "
                f"{self.weight_version!r}: send an update that covers them"
            )
        self.num_updates += 1
        label = weight_version if weight_version is not None else txn.label
        self.weight_version = label if label is not None else self.num_updates
        logger.info(
            "weights updated to version %r: %d tensors", self.weight_version, len(txn.landed)
        )

    def _check_finite(self, txn: Transaction) -> None:
        """Refuses a transaction whose landed weights hold a NaN or an infinity (if asked to)."""
        if not self.refuse_non_finite:
            return
        bad = non_finite_names(self.model.named_weights(), txn.landed)
        if bad:
            self._end_failed(txn)
            outcome = "restored" if txn.staged is not None else "torn until a finite update lands"
            raise NonFiniteWeightsError(
                f"finish_weight_update refused: {len(bad)} weights hold a NaN or an infinity "
                f"(e.g. {bad[:3]}); the version stays {self.weight_version!r} and the update's "
                f"weights are {outcome}: check the trainer's weights (a diverged step, a bad "
                "cast), then send a finite update"
            )

    def abort(self) -> bool:
        """Ends the open transaction on purpose (`abort_weight_update`).

        Nothing moved: the weights and version are as before. Bytes moved: the touched weights
        are torn, or restored with staging.

        Returns:
            Whether a transaction was open.
        """
        txn = self.transaction
        if txn is None:
            return False
        self._end_failed(txn)
        return True

    def _stage(self, txn: Transaction, names: list[str]) -> None:
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

    def refuse(
        self, update_info: Mapping[str, Any] | WeightTransferUpdateInfo, reason: WeightSyncError
    ) -> None:
        """Tells the trainer that the engine refuses this update, before anything moves.

        The caller raises `reason` afterwards; see `WeightTransferEngine.refuse_update`.
        """
        if self._transfer is not None:
            self._transfer.refuse_update(update_info, reason)

    def _end_failed(self, txn: Transaction, *, forget_transfer: bool = True) -> None:
        """Closes a transaction that will not finish: restores or marks what it touched.

        Args:
            txn: The transaction.
            forget_transfer: Tell the transfer engine to forget its update in progress (False
                when it already follows another one).
        """
        self.transaction = None
        if forget_transfer and self._transfer is not None:
            self._transfer.abort_update()
        if not txn.touched:
            return
        self.num_writes += 1
        if txn.staged is not None:
            self.model.load_weights([(n, t) for n, t in txn.staged.items() if n in txn.touched])
            logger.warning(
                "weight update failed or aborted: %d weights restored; version stays %r",
                len(txn.touched), self.weight_version,
            )  # fmt: skip
            return
        self.torn_names |= txn.touched
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
        if self.transaction is not None:
            raise WeightUpdateStateError(
                "shutdown_weight_transfer_engine: a weight update is in progress: finish it with "
                "finish_weight_update(...) or end it with abort_weight_update() first"
            )
        self.shutdown()
        self._transfer = None
