"""Backend name -> transfer engine class, with registration for third-party backends.

Built in: `nccl`, `gloo`, `ipc` and `disk`. A backend can be registered as a class or lazily as
`"package.module:ClassName"`, imported on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from weightsync.errors import WeightValidationError
from weightsync.transfer.base import WeightTransferEngine

__all__ = ["create_engine", "register_engine"]


class _EngineRegistry:
    """Maps backend names to [`WeightTransferEngine`][weightsync.transfer.base.WeightTransferEngine] subclasses.

    >>> registry = _EngineRegistry()
    >>> registry.register("mine", "weightsync.transfer.nccl:GlooWeightTransferEngine")
    >>> registry.get("mine").__name__
    'GlooWeightTransferEngine'
    """

    def __init__(self) -> None:
        self._engines: dict[str, type[WeightTransferEngine] | str] = {}

    def register(
        self, name: str, engine: type[WeightTransferEngine] | str, *, replace: bool = False
    ) -> None:
        """Registers `engine` (a class, or `"module:Class"` imported lazily) under `name`.

        Raises:
            WeightValidationError: `name` is taken (pass `replace=True` to override) or malformed.
        """
        if not isinstance(name, str) or not name:
            raise WeightValidationError(f"backend name must be a non-empty string, got {name!r}")
        if isinstance(engine, str) and engine.count(":") != 1:
            raise WeightValidationError(
                f"lazy engine must look like 'package.module:ClassName', got {engine!r}"
            )
        if name in self._engines and not replace:
            raise WeightValidationError(
                f"backend {name!r} is already registered; pass replace=True to override it"
            )
        self._engines[name] = engine

    def names(self) -> list[str]:
        """Returns the registered backend names, sorted."""
        return sorted(self._engines)

    def get(self, name: str) -> type[WeightTransferEngine]:
        """Returns the engine class of backend `name`, importing it if registered lazily.

        Raises:
            WeightValidationError: Unknown backend; the message lists the known ones.
        """
        if not isinstance(name, str):
            raise WeightValidationError(
                f"backend must be a string naming a weight transfer backend, got "
                f"{type(name).__name__} {name!r:.80}; known backends: {', '.join(self.names())}"
            )
        entry = self._engines.get(name)
        if entry is None:
            raise WeightValidationError(
                f"unknown weight transfer backend {name!r}; known backends: {', '.join(self.names())}"
            )
        if isinstance(entry, str):
            module_name, _, class_name = entry.partition(":")
            engine = getattr(importlib.import_module(module_name), class_name)
            if not (isinstance(engine, type) and issubclass(engine, WeightTransferEngine)):
                raise WeightValidationError(f"{entry} is not a WeightTransferEngine subclass")
            self._engines[name] = entry = engine
        return entry

    def create(self, name: str, **kwargs: Any) -> WeightTransferEngine:
        """Builds the engine of backend `name` with `kwargs` (e.g. `params=`, `worker_index=`)."""
        return self.get(name)(**kwargs)


_default_registry = _EngineRegistry()
"""The registry [`WeightTransferConfig`][weightsync.config.WeightTransferConfig] resolves against."""
_default_registry.register("nccl", "weightsync.transfer.nccl:NCCLWeightTransferEngine")
_default_registry.register("gloo", "weightsync.transfer.nccl:GlooWeightTransferEngine")
_default_registry.register("ipc", "weightsync.transfer.ipc:IPCWeightTransferEngine")
_default_registry.register("disk", "weightsync.transfer.disk:DiskWeightTransferEngine")


def register_engine(
    name: str, engine: type[WeightTransferEngine] | str, *, replace: bool = False
) -> None:
    """Registers a backend in the default registry.

    See `_EngineRegistry.register`.
    """
    _default_registry.register(name, engine, replace=replace)


def create_engine(backend: str, **kwargs: Any) -> WeightTransferEngine:
    """Builds the engine of `backend` from the default registry."""
    return _default_registry.create(backend, **kwargs)
