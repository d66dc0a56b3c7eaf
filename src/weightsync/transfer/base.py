"""The receiver-side contract every transfer backend implements, and the data it exchanges.

A backend moves a trainer's named tensors into an inference worker. The worker owns a
[`WeightTransferEngine`][weightsync.transfer.base.WeightTransferEngine]; the trainer talks to it
through two plain-dict payloads that can travel over any control channel (a pipe, HTTP):

- the *init info*, given once to
  [`init_transfer_engine`][weightsync.transfer.base.WeightTransferEngine.init_transfer_engine];
- the *update info* ([`WeightTransferUpdateInfo`][weightsync.transfer.base.WeightTransferUpdateInfo]),
  given to [`receive_weights`][weightsync.transfer.base.WeightTransferEngine.receive_weights] for
  every update: the names, dtypes and shapes that are about to arrive.
"""

from __future__ import annotations

import math
import secrets
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from weightsync.errors import WeightSyncError, WeightValidationError
from weightsync.transfer._checks import parse_info

__all__ = [
    "LoadWeightsFn",
    "TensorSpec",
    "TransferStats",
    "WeightTransferEngine",
    "WeightTransferInitInfo",
    "WeightTransferUpdateInfo",
    "dtype_from_name",
    "dtype_name",
]

LoadWeightsFn = Callable[[list[tuple[str, torch.Tensor]]], None]
"""Receives a batch of `(name, tensor)` pairs and copies them into the model.

The tensors may be views of a reusable transfer buffer: copy them before returning.
"""


# The dtypes that may cross the wire, by the name used in update infos (`str(dtype)` minus "torch.").
# Names are looked up in this table only: a payload never makes us resolve an arbitrary attribute.
_WIRE_DTYPE_NAMES = (
    "float64",
    "float32",
    "float16",
    "bfloat16",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "complex64",
    "complex128",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint64",
    "uint32",
    "uint16",
    "uint8",
    "bool",
)
_WIRE_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in _WIRE_DTYPE_NAMES
    if isinstance(getattr(torch, name, None), torch.dtype)
}


def dtype_name(dtype: torch.dtype) -> str:
    """Returns the wire name of `dtype` (`torch.bfloat16` -> `"bfloat16"`).

    Raises:
        WeightValidationError: `dtype` cannot be transferred.

    >>> dtype_name(torch.bfloat16)
    'bfloat16'
    """
    name = str(dtype).removeprefix("torch.")
    if _WIRE_DTYPES.get(name) is not dtype:
        raise WeightValidationError(
            f"dtype {dtype} cannot be transferred; supported: {', '.join(_WIRE_DTYPES)}"
        )
    return name


def dtype_from_name(name: str) -> torch.dtype:
    """Returns the torch dtype for a wire name (`"bfloat16"` -> `torch.bfloat16`).

    Raises:
        WeightValidationError: `name` is not a supported dtype name.
    """
    dtype = _WIRE_DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise WeightValidationError(
            f"unknown dtype name {name!r}; expected one of: {', '.join(_WIRE_DTYPES)}"
        )
    return dtype


@dataclass(frozen=True)
class TensorSpec:
    """Name, dtype and shape of one tensor: what a receiver must know before bytes arrive."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorSpec:
        """Returns the spec of `tensor` under `name` (`WeightValidationError` if no tensor)."""
        if not isinstance(tensor, torch.Tensor):
            raise WeightValidationError(
                f"{name!r} is a {type(tensor).__name__}, not a torch.Tensor"
            )
        return cls(name, tensor.dtype, tuple(tensor.shape))

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Size of the tensor's data in bytes."""
        return self.numel * self.dtype.itemsize

    def describe(self) -> str:
        """Returns `dtype[shape]`, the form error messages use."""
        return f"{dtype_name(self.dtype)}{list(self.shape)}"


@dataclass
class TransferStats:
    """What one update moved, as seen by one side.

    Attributes:
        num_tensors: Tensors moved.
        num_bytes: Payload bytes (tensor data, without alignment padding).
        num_buckets: Buckets (packed mode) or broadcasts (unpacked mode) used.
        direct_buckets: Buckets sent or received in place, without a pack or unpack copy.
        seconds: Wall time of the update on this side, handshake included.
        loaded_names: On a receiver, the names this call wrote completely, which the
            engine's update transaction counts against what was announced: None (the default)
            means every tensor the message named; an `ipc` announcement loads none (`[]`).
    """

    num_tensors: int = 0
    num_bytes: int = 0
    num_buckets: int = 0
    direct_buckets: int = 0
    seconds: float = 0.0
    loaded_names: list[str] | None = None

    @property
    def gbps(self) -> float:
        """Throughput in GB/s (10^9 bytes per second)."""
        return self.num_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass
class WeightTransferInitInfo:
    """Base class of the per-backend init infos: what a receiver needs to join a transfer."""


@dataclass
class WeightTransferUpdateInfo:
    """What the trainer is about to send: parallel lists, one entry per tensor, in send order.

    Attributes:
        names: Tensor names, unique, e.g. `"model.layers.0.self_attn.q_proj.weight"`.
        dtype_names: Wire dtype names (see [`dtype_name`][weightsync.transfer.base.dtype_name]).
        shapes: Shapes as lists of non-negative ints (`[]` for a 0-d tensor).
        weight_version: Optional label of the weights being sent (the trainer's step, say).
        send_id: The send this message belongs to (at most 64 characters), so that a broadcast
            worker's refusal of it fails that send and no other; `from_specs` and
            `from_named_tensors` set a fresh one. Without it, the content identifies a message.

    Raises:
        WeightValidationError: The lists differ in length, a name repeats, a dtype is unknown or
            a shape is malformed.

    >>> info = WeightTransferUpdateInfo(names=["w"], dtype_names=["float32"], shapes=[[2, 3]])
    >>> info.specs()[0].nbytes
    24
    """

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    weight_version: str | int | None = None
    send_id: str | None = None
    _specs: list[TensorSpec] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        lengths: dict[str, Sequence[Any]] = {
            "names": self.names,
            "dtype_names": self.dtype_names,
            "shapes": self.shapes,
        }
        for key, value in lengths.items():
            if not isinstance(value, list | tuple):
                raise WeightValidationError(f"{key} must be a list, got {type(value).__name__}")
        if len({len(v) for v in lengths.values()}) != 1:
            sizes = ", ".join(f"{k}={len(v)}" for k, v in lengths.items())
            raise WeightValidationError(
                f"names, dtype_names and shapes must have equal lengths, got {sizes}"
            )
        specs = []
        seen: set[str] = set()
        for name, dtype, shape in zip(self.names, self.dtype_names, self.shapes, strict=True):
            if not isinstance(name, str) or not name:
                raise WeightValidationError(f"tensor names must be non-empty strings, got {name!r}")
            if name in seen:
                raise WeightValidationError(f"tensor name {name!r} appears twice in names")
            seen.add(name)
            if not isinstance(shape, list | tuple) or not all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
            ):
                raise WeightValidationError(
                    f"shape of {name!r} must be a list of non-negative ints, got {shape!r}"
                )
            specs.append(TensorSpec(name, dtype_from_name(dtype), tuple(shape)))
        version = self.weight_version
        if version is not None and (
            not isinstance(version, str | int) or isinstance(version, bool)
        ):
            raise WeightValidationError(
                f"weight_version must be a string, an int or null, got {type(version).__name__}"
            )
        send_id = self.send_id
        if send_id is not None and (not isinstance(send_id, str) or not 0 < len(send_id) <= 64):
            raise WeightValidationError(
                f"send_id must be a string of 1 to 64 characters or null, got {send_id!r:.80}"
            )
        self._specs = specs

    @classmethod
    def from_specs(
        cls, specs: Iterable[TensorSpec], *, weight_version: str | int | None = None
    ) -> WeightTransferUpdateInfo:
        """Builds the update info announcing `specs`, in order, with a fresh `send_id`."""
        specs = list(specs)
        return cls(
            names=[s.name for s in specs],
            dtype_names=[dtype_name(s.dtype) for s in specs],
            shapes=[list(s.shape) for s in specs],
            weight_version=weight_version,
            send_id=secrets.token_hex(8),
        )

    @classmethod
    def from_named_tensors(
        cls,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        weight_version: str | int | None = None,
    ) -> WeightTransferUpdateInfo:
        """Builds the update info announcing these tensors, e.g. `model.named_parameters()`.

        Only metadata is read; no tensor data is touched.
        """
        return cls.from_specs(
            (TensorSpec.of(name, t) for name, t in named_tensors), weight_version=weight_version
        )

    @property
    def opens_update(self) -> bool:
        """Whether this message starts an update: it announces every tensor the update brings.

        A broadcast update info always does; an `ipc` part continues the announced update.
        """
        return True

    def specs(self) -> list[TensorSpec]:
        """Returns one [`TensorSpec`][weightsync.transfer.base.TensorSpec] per tensor, in order."""
        return list(self._specs)

    def to_dict(self) -> dict[str, Any]:
        """Returns the JSON-safe dict form, the inverse of parsing it.

        Optional fields that are None are left out (vLLM's update info refuses a null
        `weight_version`).
        """
        data: dict[str, Any] = {
            "names": list(self.names),
            "dtype_names": list(self.dtype_names),
            "shapes": [list(s) for s in self.shapes],
        }
        if self.weight_version is not None:
            data["weight_version"] = self.weight_version
        if self.send_id is not None:
            data["send_id"] = self.send_id
        return data


def _validate_specs(incoming: Sequence[TensorSpec], expected: Mapping[str, TensorSpec]) -> None:
    """Checks announced tensors against what the receiving model holds.

    Every announced name must be known, with the same shape and dtype. An update may cover a
    subset of the model.

    Raises:
        WeightValidationError: Listing every unknown name and every shape or dtype mismatch.
    """
    problems = []
    for spec in incoming:
        want = expected.get(spec.name)
        if want is None:
            problems.append(f"unknown name {spec.name!r}")
        elif want.shape != spec.shape or want.dtype != spec.dtype:
            problems.append(
                f"{spec.name!r}: model has {want.describe()}, update has {spec.describe()}"
            )
    if problems:
        shown = problems[:50] + (
            [f"... and {len(problems) - 50} more"] if len(problems) > 50 else []
        )
        raise WeightValidationError(
            f"update rejected before any byte moved: {len(problems)} of {len(incoming)} tensors "
            "do not match the model:\n  " + "\n  ".join(shown)
        )


class WeightTransferEngine(ABC):
    """Receiver side of a transfer backend, owned by one inference worker.

    Lifecycle: `init_transfer_engine` once, then any number of `receive_weights`, then `shutdown`.
    After a failed transfer the engine is shut down and must be initialized again.

    Every backend is built with the same keyword arguments (a control plane creates engines through
    the registry without knowing the backend), and may ignore those it does not need.

    Args:
        worker_index: This worker's index among the transfer's workers (its rank in a broadcast
            group is `rank_offset + worker_index`).
        expected_specs: What the receiving model holds, by name. Every update is validated against
            it before any byte moves. Defaults to the specs of `params`, if given.
        params: The receiving model's tensors, by name. Backends may write straight into them when
            their memory layout allows; such tensors are then not passed to `load_weights`.

    Raises:
        WeightValidationError: `worker_index` is not an int >= 0.
    """

    init_info_cls: ClassVar[type[WeightTransferInitInfo]] = WeightTransferInitInfo
    update_info_cls: ClassVar[type[WeightTransferUpdateInfo]] = WeightTransferUpdateInfo
    needs_init: ClassVar[bool] = True
    """Whether updates need `init_transfer_engine` first; a backend that joins nothing
    (`disk`) is created on its first update without it."""

    def __init__(
        self,
        *,
        worker_index: int = 0,
        expected_specs: Mapping[str, TensorSpec] | None = None,
        params: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        if not isinstance(worker_index, int) or isinstance(worker_index, bool) or worker_index < 0:
            raise WeightValidationError(f"worker_index must be an int >= 0, got {worker_index!r}")
        self.worker_index = worker_index
        if expected_specs is None and params is not None:
            expected_specs = {name: TensorSpec.of(name, t) for name, t in params.items()}
        self.expected_specs = dict(expected_specs) if expected_specs is not None else None
        self.params = dict(params) if params is not None else None

    def parse_init_info(self, init_info: Mapping[str, Any] | WeightTransferInitInfo) -> Any:
        """Parses a plain dict into this backend's init info dataclass."""
        return parse_info(self.init_info_cls, init_info, what="init_info")

    def parse_update_info(self, update_info: Mapping[str, Any] | WeightTransferUpdateInfo) -> Any:
        """Parses a plain dict into this backend's update info dataclass."""
        return parse_info(self.update_info_cls, update_info, what="update_info")

    def check_update(self, update_info: WeightTransferUpdateInfo) -> list[TensorSpec]:
        """Returns the update's specs after checking them against `expected_specs`, if set.

        Raises:
            WeightValidationError: Some announced tensor does not match the model.
        """
        specs = update_info.specs()
        if self.expected_specs is not None:
            _validate_specs(specs, self.expected_specs)
        return specs

    @property
    @abstractmethod
    def is_initialized(self) -> bool:
        """Whether `init_transfer_engine` succeeded and no failure or shutdown happened since."""

    @abstractmethod
    def init_transfer_engine(self, init_info: Mapping[str, Any] | WeightTransferInitInfo) -> None:
        """Joins the transfer described by `init_info` (a dict or the backend's dataclass).

        Raises:
            WeightValidationError: `init_info` is malformed.
            WeightTransferTimeout: The trainer did not show up within the timeout.
        """

    @abstractmethod
    def receive_weights(
        self,
        update_info: Mapping[str, Any] | WeightTransferUpdateInfo,
        load_weights: LoadWeightsFn,
    ) -> TransferStats:
        """Receives one update, handing tensors to `load_weights` as they arrive.

        Returns:
            What was received and how fast.

        Raises:
            WeightValidationError: The update does not match the model (nothing was moved).
            WeightTransferError: The transfer failed; check `partially_applied`.
            WeightTransferTimeout: A step ran past the timeout.
        """

    def refuse_update(
        self,
        update_info: Mapping[str, Any] | WeightTransferUpdateInfo,
        reason: WeightSyncError,
    ) -> None:
        """Refuses an update on the engine's behalf (busy, say), so the trainer learns why.

        A broadcast backend answers the update's handshake with `reason` at once, never waiting:
        a trainer sending this message's update fails with it (now, or as soon as it starts),
        and the group stays usable. The default does nothing: the caller raises `reason` itself.
        """
        return None

    def abort_update(self) -> None:
        """Forgets a multi-message update in progress (the engine's transaction ended).

        The default does nothing: a backend whose update is one message keeps no such state.
        """
        return None

    @abstractmethod
    def shutdown(self) -> None:
        """Releases the backend's resources. Safe to call twice."""

    def __enter__(self) -> WeightTransferEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()
