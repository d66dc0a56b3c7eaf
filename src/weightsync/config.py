"""Configuration dataclasses and the helpers that read them from command-line arguments."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from weightsync.errors import WeightValidationError
from weightsync.transfer.base import WeightTransferEngine, _default_registry, _parse_info

__all__ = ["WeightTransferConfig", "parse_weight_transfer_config"]

_ConfigT = TypeVar("_ConfigT")


@dataclass
class WeightTransferConfig:
    """Selects the weight transfer backend of an inference engine.

    Only a selector: wire parameters (bucket size, timeouts) are decided by the trainer and travel
    in the init info.

    Attributes:
        backend: A registered backend name: `"nccl"` (CUDA broadcast), `"gloo"` (CPU broadcast),
            `"ipc"`, `"disk"` (a checkpoint directory), or one registered with
            [`register_engine`][weightsync.transfer.base.register_engine].

    Raises:
        WeightValidationError: Unknown backend; the message lists the known ones.

    >>> WeightTransferConfig(backend="gloo").backend
    'gloo'
    """

    backend: str = "nccl"

    def __post_init__(self) -> None:
        _default_registry.get(self.backend)

    @property
    def engine_class(self) -> type[WeightTransferEngine]:
        """The backend's receiver engine class."""
        return _default_registry.get(self.backend)

    def create_engine(self, **kwargs: Any) -> WeightTransferEngine:
        """Builds this backend's receiver engine; `kwargs` go to its constructor."""
        return _default_registry.create(self.backend, **kwargs)


def _coerce(text: str) -> Any:
    """Reads a dotted-key value: JSON when it parses (numbers, booleans, objects), else a string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _parse_dataclass_arg(
    argv: Sequence[str], flag: str, cls: type[_ConfigT]
) -> tuple[_ConfigT | None, list[str]]:
    """Takes `flag` out of `argv` as a `cls`: a JSON object and/or dotted keys, which override it."""
    values: dict[str, Any] = {}
    dotted: dict[str, Any] = {}
    rest: list[str] = []
    found = False
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        name, eq, inline = arg.partition("=")
        if name != flag and not name.startswith(flag + "."):
            rest.append(arg)
            i += 1
            continue
        found = True
        if eq:
            value = inline
        elif i + 1 < len(args):
            value = args[i + 1]
            i += 1
        else:
            raise WeightValidationError(f"{name} needs a value")
        i += 1
        if name == flag:
            try:
                parsed = json.loads(value)
            except json.JSONDecodeError as exc:
                raise WeightValidationError(
                    f'{flag} must be a JSON object like \'{{"backend": "gloo"}}\': {exc.msg} at '
                    f"column {exc.colno} of {value!r}"
                ) from None
            if not isinstance(parsed, dict):
                raise WeightValidationError(f"{flag} must be a JSON object, got {value!r}")
            values.update(parsed)
        else:
            dotted[name[len(flag) + 1 :]] = _coerce(value)
    if not found:
        return None, rest
    keys = [f.name for f in dataclasses.fields(cls) if f.init]  # type: ignore[arg-type]
    unknown = sorted((set(values) | set(dotted)) - set(keys))
    if unknown:
        raise WeightValidationError(f"{flag}: unknown keys {unknown}; valid keys: {keys}")
    values.update(dotted)
    return _parse_info(cls, values, what=flag), rest


def parse_weight_transfer_config(
    argv: Sequence[str],
) -> tuple[WeightTransferConfig | None, list[str]]:
    """Reads `--weight-transfer-config` (JSON or dotted keys) out of `argv`.

    >>> parse_weight_transfer_config(['--weight-transfer-config', '{"backend": "gloo"}'])[0]
    WeightTransferConfig(backend='gloo')
    """
    return _parse_dataclass_arg(argv, "--weight-transfer-config", WeightTransferConfig)
