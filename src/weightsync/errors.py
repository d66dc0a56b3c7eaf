"""Every error weightsync raises on purpose, under one root: [`WeightSyncError`][weightsync.errors.WeightSyncError].

Each class also derives from the builtin a caller would expect (`ValueError` for a bad value,
`RuntimeError` for a failure, `TimeoutError` for a timeout), so `except ValueError` keeps working.
A leaf module: it imports nothing from weightsync, so every layer can raise these.
"""

from __future__ import annotations

__all__ = [
    "DuplicateMessageError",
    "EngineBusyError",
    "EngineConfigError",
    "EngineStateError",
    "EngineTimeoutError",
    "IncompleteWeightUpdateError",
    "InvalidRequestError",
    "LoRAAdapterError",
    "LoRAAdapterNotFoundError",
    "NonFiniteWeightsError",
    "ReplicaUnavailableError",
    "TornWeightsError",
    "WeightSyncError",
    "WeightTransferError",
    "WeightTransferTimeout",
    "WeightUpdateStateError",
    "WeightValidationError",
]


class WeightSyncError(Exception):
    """Base class of every error weightsync raises on purpose.

    Attributes:
        param: The request field or query parameter at fault, when a server's error answer
            named one (`HTTPEngineClient` keeps it); else None.
    """

    param: str | None = None


class WeightValidationError(WeightSyncError, ValueError):
    """Metadata, a payload or a tensor does not match what was expected; nothing was moved."""


class DuplicateMessageError(WeightValidationError):
    """A message the worker had received already (a client's retry, say): nothing moved.

    It belongs to an update that landed before, not to the update in progress, which it leaves
    as it was: a finish after it still applies that update.
    """


class LoRAAdapterError(WeightValidationError):
    """A LoRA adapter was refused before it was loaded: its files, config or tensors are wrong.

    The message names the file and the tensor or key at fault, the expected and the actual
    value; the adapters loaded before stay as they were.
    """


class NonFiniteWeightsError(WeightValidationError):
    """An update carried a NaN or an infinity, and the engine refuses non-finite weights.

    Raised by `finish_weight_update` when `EngineConfig.refuse_non_finite_weights` is on; the
    message names the tensors. The version stays; with `weight_update_staging` the previous
    weights are restored, else the update's weights are torn until a finite update lands.
    """


class WeightTransferError(WeightSyncError, RuntimeError):
    """A transfer failed while bytes were moving (a peer died, a collective failed).

    Attributes:
        partially_applied: True when some tensors of the update may already have been written into
            the receiver's weights, which are then torn until a complete update lands.
    """

    def __init__(self, message: str, *, partially_applied: bool = False) -> None:
        super().__init__(message)
        self.partially_applied = partially_applied


class WeightTransferTimeout(WeightTransferError, TimeoutError):
    """A blocking step of a transfer (rendezvous, broadcast, hand-off) ran past its timeout."""


class EngineConfigError(WeightSyncError, ValueError):
    """A model or engine configuration value is invalid (the message names the field)."""


class InvalidRequestError(WeightSyncError, ValueError):
    """A request or its sampling parameters are invalid; the engine is unaffected."""


class LoRAAdapterNotFoundError(InvalidRequestError):
    """A request or a call names a LoRA adapter that is not loaded (vLLM answers 404)."""


class EngineStateError(WeightSyncError, RuntimeError):
    """The call is not allowed in the engine's current state (paused, draining, closed)."""


class EngineBusyError(EngineStateError):
    """A weight update was requested while requests are running and the engine is not paused.

    Call `pause_generation(...)` first, update, then `resume_generation()`.
    """


class EngineTimeoutError(EngineStateError, TimeoutError):
    """An engine in another process did not answer within its `timeout_s`.

    It is stuck or overloaded; raise the timeout, or close it and start a new one.
    """


class TornWeightsError(EngineStateError):
    """The weights are torn: a failed update wrote part of them, so the engine will not generate.

    Land a complete update with `update_weights(...)` before calling `resume_generation()`.
    """


class WeightUpdateStateError(EngineStateError):
    """A weight-update call came out of order; the message says which call comes next.

    For example `start_weight_update` while a transaction is open, `finish_weight_update`
    without one, or `resume_generation` while an update is in progress.
    """


class IncompleteWeightUpdateError(WeightUpdateStateError):
    """`finish_weight_update` was called before every announced weight landed.

    The transaction stays open: deliver the missing weights (the message names them), or end it
    with `abort_weight_update()`.
    """


class ReplicaUnavailableError(EngineStateError):
    """A replica of a data-parallel server (`--data-parallel-size`) exited or cannot be reached.

    The other replicas keep serving completions, but the RL routes refuse (503) until the server
    is restarted: pausing or updating only some replicas would serve mixed weights.
    """
