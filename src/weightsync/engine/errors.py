"""The errors the engine raises on purpose, each naming what was wrong and what to do."""

from __future__ import annotations

from weightsync.transfer.base import WeightSyncError

__all__ = [
    "EngineBusyError",
    "EngineConfigError",
    "EngineStateError",
    "IncompleteWeightUpdateError",
    "InvalidRequestError",
    "TornWeightsError",
    "WeightUpdateStateError",
]


class EngineConfigError(WeightSyncError, ValueError):
    """A model or engine configuration value is invalid (the message names the field)."""


class InvalidRequestError(WeightSyncError, ValueError):
    """A request or its sampling parameters are invalid; the engine is unaffected."""


class EngineStateError(WeightSyncError, RuntimeError):
    """The call is not allowed in the engine's current state (paused, draining, closed)."""


class EngineBusyError(EngineStateError):
    """A weight update was requested while requests are running and the engine is not paused.

    Call `pause_generation(...)` first, update, then `resume_generation()`.
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
