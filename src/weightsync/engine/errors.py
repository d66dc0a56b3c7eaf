"""The engine's errors, also importable from here; defined in [`weightsync.errors`][weightsync.errors]."""

from __future__ import annotations

# `X as X` marks each as a re-export: the classes live in the one hierarchy of weightsync.errors.
from weightsync.errors import EngineBusyError as EngineBusyError
from weightsync.errors import EngineConfigError as EngineConfigError
from weightsync.errors import EngineStateError as EngineStateError
from weightsync.errors import InvalidRequestError as InvalidRequestError
from weightsync.errors import LoRAAdapterError as LoRAAdapterError
from weightsync.errors import LoRAAdapterNotFoundError as LoRAAdapterNotFoundError
from weightsync.errors import TornWeightsError as TornWeightsError

__all__: list[str] = []
