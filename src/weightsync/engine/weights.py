"""`LiveWeights`: a model's weights as a trainer updates them, with a version and a torn flag.

It owns the receiver side of a transfer backend (see `weightsync.transfer`), validates every
update against the model's Hugging Face-named parameter specs before any byte moves, counts
complete updates into a weight version, and remembers which weights a failed update may have
half-written, so the engine can refuse to generate with torn weights.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from weightsync.config import WeightTransferConfig
from weightsync.engine.model import LlamaForCausalLM
from weightsync.engine.outputs import WeightVersion
from weightsync.errors import EngineStateError, WeightTransferError, WeightValidationError
from weightsync.transfer.base import TransferStats, WeightTransferEngine, WeightTransferUpdateInfo

__all__ = ["LiveWeights"]

logger = logging.getLogger(__name__)


def _field(info: Any, key: str) -> Any:
    """Reads `key` from an update info given as a dict or a dataclass; None when absent."""
    if isinstance(info, Mapping):
        return info.get(key)
    return getattr(info, key, None)


class LiveWeights:
    """Receives weight updates into a model and tracks their version.

    Args:
        model: The model whose weights are updated in place.
        transfer_config: Selects the transfer backend; None takes the backend named in the
            init info.
        weight_version: Version of the initial weights.
        worker_index: This worker's index among the transfer group's workers.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        *,
        transfer_config: WeightTransferConfig | None = None,
        weight_version: WeightVersion = 0,
        worker_index: int = 0,
    ) -> None:
        self.model = model
        self.transfer_config = transfer_config
        self.worker_index = worker_index
        self.weight_version: WeightVersion = weight_version
        self.num_updates = 0
        self.torn_names: set[str] = set()
        self._in_progress: set[str] = set()  # names of a multi-part update not yet complete
        self._transfer: WeightTransferEngine | None = None

    @property
    def is_torn(self) -> bool:
        """Whether some weights may be half-written by a failed update."""
        return bool(self.torn_names)

    def init_transfer_engine(self, init_info: Mapping[str, Any]) -> None:
        """Creates the receiver engine (once) and joins the trainer's transfer group.

        Blocks until the group forms or the backend's timeout passes.

        Raises:
            WeightValidationError: No backend is known, or the init info is malformed.
            WeightTransferTimeout: The trainer did not show up in time.
        """
        if self._transfer is None:
            config = self.transfer_config
            if config is None:
                backend = _field(init_info, "backend")
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

    def _load(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        self.model.load_weights(pairs)

    def update(self, update_info: Mapping[str, Any] | WeightTransferUpdateInfo) -> TransferStats:
        """Receives one update (or one delivery of a multi-part update) into the model.

        The version advances when the update completes.

        The new version is the update's `weight_version` label if it has one, else the number
        of complete updates so far.

        Raises:
            EngineStateError: No transfer engine was initialized.
            WeightValidationError: The update does not match the model; nothing was written.
            WeightTransferError: The transfer failed. When `partially_applied` is set, the
                announced weights count as torn until a complete update covers them.
        """
        if self._transfer is None:
            raise EngineStateError(
                "update_weights needs a transfer engine: call "
                "init_weight_transfer_engine({'init_info': ...}) first"
            )
        names = _field(update_info, "names")
        announced = (
            set(names) if isinstance(names, list | tuple) else set(self.model.weight_specs())
        )
        label = _field(update_info, "weight_version")
        try:
            stats = self._transfer.receive_weights(update_info, self._load)
        except WeightValidationError:
            # Rejected before this call moved a byte; a multi-part update's earlier parts, if
            # any, stay torn (they are in torn_names already).
            self._in_progress = set()
            raise
        except WeightTransferError as exc:
            if exc.partially_applied:
                self.torn_names |= announced
            self._in_progress = set()
            raise
        except BaseException:
            self.torn_names |= announced  # an unexpected failure: assume the worst
            self._in_progress = set()
            raise
        if not stats.update_complete:
            # A multi-part update (the ipc backend): the weights are mid-update, hence torn,
            # until its last part lands; the version stays until then.
            self._in_progress |= announced
            self.torn_names |= announced
            return stats
        self.torn_names -= announced | self._in_progress
        self._in_progress = set()
        self.num_updates += 1
        self.weight_version = label if isinstance(label, str | int) else self.num_updates
        logger.info(
            "weights updated to version %r: %d tensors, %.1f MB in %.3f s",
            self.weight_version, stats.num_tensors, stats.num_bytes / 1e6, stats.seconds,
        )  # fmt: skip
        if self.torn_names:
            logger.warning(
                "%d weights are still torn by an earlier failed update", len(self.torn_names)
            )
        return stats

    def shutdown(self) -> None:
        """Shuts the transfer engine down. Safe to call twice."""
        if self._transfer is not None:
            self._transfer.shutdown()
