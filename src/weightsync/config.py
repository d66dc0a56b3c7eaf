"""The worker's choice of transfer backend, and how a command line gives it."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from weightsync.errors import WeightValidationError
from weightsync.transfer.base import WeightTransferEngine, _default_registry, _parse_info

__all__ = ["WeightTransferConfig", "parse_weight_transfer_config"]


@dataclass
class WeightTransferConfig:
    """Selects the weight transfer backend of an inference engine.

    Only a selector: the trainer decides the wire parameters, which travel in the init info.

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


def parse_weight_transfer_config(
    argv: Sequence[str],
) -> tuple[WeightTransferConfig | None, list[str]]:
    """Takes `--weight-transfer-config` (a JSON object and/or dotted keys) out of `argv`.

    Dotted keys (`--weight-transfer-config.backend gloo`, read as JSON if they parse, else as
    strings) override the object's; each form takes `=value` or the next argument. Returns the
    config (None when the flag is absent) and the other arguments, in order.

    Raises:
        WeightValidationError: A value is missing, not a JSON object, or has an unknown key.

    >>> parse_weight_transfer_config(['--weight-transfer-config', '{"backend": "gloo"}'])[0]
    WeightTransferConfig(backend='gloo')
    """
    flag = "--weight-transfer-config"
    values: dict[str, Any] = {}
    dotted: dict[str, Any] = {}
    rest: list[str] = []
    args = iter(argv)
    for arg in args:
        name, eq, inline = arg.partition("=")
        if name != flag and not name.startswith(flag + "."):
            rest.append(arg)
            continue
        value = inline if eq else next(args, None)
        if value is None:
            raise WeightValidationError(f"{name} needs a value")
        if name != flag:
            with contextlib.suppress(json.JSONDecodeError):  # not JSON: a plain string
                value = json.loads(value)
            dotted[name[len(flag) + 1 :]] = value
            continue
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
    if len(rest) == len(argv):  # the flag is absent
        return None, rest
    keys = [f.name for f in dataclasses.fields(WeightTransferConfig)]
    unknown = sorted((set(values) | set(dotted)) - set(keys))
    if unknown:
        raise WeightValidationError(f"{flag}: unknown keys {unknown}; valid keys: {keys}")
    return _parse_info(WeightTransferConfig, {**values, **dotted}, what=flag), rest
