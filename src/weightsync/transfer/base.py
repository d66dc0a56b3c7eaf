"""The transfer contract: the data exchanged, the engine, the wire parameters, the registry.

One concept: the contract between a trainer and an inference worker, read top to bottom. A
worker owns a [`WeightTransferEngine`][weightsync.transfer.base.WeightTransferEngine]; the trainer
talks to it through two plain-dict payloads that travel over any control channel: the *init
info*, given once, and the *update info*
([`WeightTransferUpdateInfo`][weightsync.transfer.base.WeightTransferUpdateInfo]) of every update.
How tensors travel is one [`WireParams`][weightsync.transfer.base.WireParams], validated where it
is built. A backend is found by name ([`create_engine`][weightsync.transfer.base.create_engine]).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import importlib
import inspect
import logging
import math
import secrets
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypedDict, TypeGuard, TypeVar

import torch

from weightsync.errors import WeightSyncError, WeightValidationError

logger = logging.getLogger(__name__)

__all__ = [
    "CLIENT_MARGIN_S",
    "DEFAULT_TIMEOUT_S",
    "LoadWeightsFn",
    "TensorSpec",
    "TransferStats",
    "WeightTransferEngine",
    "WeightTransferInitInfo",
    "WeightTransferUpdateInfo",
    "WireParams",
    "create_engine",
    "dtype_from_name",
    "dtype_name",
    "register_engine",
]

_InfoT = TypeVar("_InfoT")
# No tensor has more dims; a shape of thousands, read from another process or a file, would make
# its size a product taking seconds to minutes.
_MAX_DIMS = 64


def _is_int(value: object) -> TypeGuard[int]:
    """Whether `value` is an int and not a bool (JSON's `true` must not pass for 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_info(cls: type[_InfoT], data: Any, *, what: str) -> _InfoT:
    """Builds dataclass `cls` from a payload dict, naming every unknown, missing or bad key."""
    if isinstance(data, cls):
        return data
    if not isinstance(data, Mapping):
        raise WeightValidationError(
            f"{what} must be a JSON object (dict) or {cls.__name__}, got {type(data).__name__}"
        )
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(fields))
    required = [
        n for n, f in fields.items() if f.default is f.default_factory is dataclasses.MISSING
    ]
    missing = sorted(set(required) - set(data))
    problems = [
        f"{kind} keys {keys}" for kind, keys in (("unknown", unknown), ("missing", missing)) if keys
    ]
    if problems:
        raise WeightValidationError(
            f"invalid {what} for {cls.__name__}: {'; '.join(problems)}; "
            f"expected keys: {sorted(fields)}"
        )
    try:
        return cls(**data)
    except WeightValidationError as exc:
        raise WeightValidationError(f"invalid {what}: {exc}") from None
    except (TypeError, ValueError) as exc:
        raise WeightValidationError(f"invalid {what} for {cls.__name__}: {exc}") from None


# --- the data a backend exchanges ----------------------------------------------------------------

LoadWeightsFn = Callable[[list[tuple[str, torch.Tensor]]], None]
"""Receives a batch of `(name, tensor)` pairs and copies them into the model.

The tensors may be views of a reusable transfer buffer: copy them before returning.
"""

# The dtypes that may cross the wire, by wire name (`str(dtype)` minus "torch."). A payload's name
# is looked up in this table only, never resolved as an arbitrary attribute of torch.
_WIRE_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (  # noqa: SIM905 (one name a line would fill a screen)
        "float64 float32 float16 bfloat16 float8_e4m3fn float8_e4m3fnuz float8_e5m2 "
        "float8_e5m2fnuz float8_e8m0fnu complex64 complex128 int64 int32 int16 int8 "
        "uint64 uint32 uint16 uint8 bool"
    ).split()
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
        lists = {k: getattr(self, k) for k in ("names", "dtype_names", "shapes")}
        for key, value in lists.items():
            if not isinstance(value, list | tuple):
                raise WeightValidationError(f"{key} must be a list, got {type(value).__name__}")
        if len({len(v) for v in lists.values()}) != 1:
            sizes = ", ".join(f"{k}={len(v)}" for k, v in lists.items())
            raise WeightValidationError(
                f"names, dtype_names and shapes must have equal lengths, got {sizes}"
            )
        self._specs = []
        seen: set[str] = set()
        for name, dtype, shape in zip(self.names, self.dtype_names, self.shapes, strict=True):
            if not isinstance(name, str) or not name:
                raise WeightValidationError(f"tensor names must be non-empty strings, got {name!r}")
            if name in seen:
                raise WeightValidationError(f"tensor name {name!r} appears twice in names")
            seen.add(name)
            if isinstance(shape, list | tuple) and len(shape) > _MAX_DIMS:
                raise WeightValidationError(
                    f"shape of {name!r} has {len(shape)} dims, more than the {_MAX_DIMS} a tensor "
                    "may have"
                )
            if not isinstance(shape, list | tuple) or not all(_is_int(d) and d >= 0 for d in shape):
                raise WeightValidationError(
                    f"shape of {name!r} must be a list of non-negative ints, got {shape!r}"
                )
            self._specs.append(TensorSpec(name, dtype_from_name(dtype), tuple(shape)))
        version = self.weight_version
        if version is not None and not (isinstance(version, str) or _is_int(version)):
            raise WeightValidationError(
                f"weight_version must be a string, an int or null, got {type(version).__name__}"
            )
        send_id = self.send_id
        if send_id is not None and (not isinstance(send_id, str) or not 0 < len(send_id) <= 64):
            raise WeightValidationError(
                f"send_id must be a string of 1 to 64 characters or null, got {send_id!r:.80}"
            )

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
        specs = (TensorSpec.of(name, t) for name, t in named_tensors)
        return cls.from_specs(specs, weight_version=weight_version)

    @property
    def opens_update(self) -> bool:
        """Whether this message starts an update, announcing every tensor the update brings.

        A broadcast update info always does; an `ipc` part continues the announced update.
        """
        return True

    def specs(self) -> list[TensorSpec]:
        """Returns one [`TensorSpec`][weightsync.transfer.base.TensorSpec] per tensor, in order."""
        return list(self._specs)

    def to_dict(self) -> dict[str, Any]:
        """Returns the JSON-safe dict form, the inverse of parsing it.

        Fields that are None are left out (vLLM's update info refuses a null `weight_version`).
        """
        data: dict[str, Any] = {
            "names": list(self.names),
            "dtype_names": list(self.dtype_names),
            "shapes": [list(s) for s in self.shapes],
            "weight_version": self.weight_version,
            "send_id": self.send_id,
        }
        return {key: value for key, value in data.items() if value is not None}


def _validate_specs(incoming: Sequence[TensorSpec], expected: Mapping[str, TensorSpec]) -> None:
    """Refuses every announced tensor the model lacks or holds with another dtype or shape."""
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
        more = [f"... and {len(problems) - 50} more"] if len(problems) > 50 else []
        raise WeightValidationError(
            f"update rejected before any byte moved: {len(problems)} of {len(incoming)} tensors "
            "do not match the model:\n  " + "\n  ".join(problems[:50] + more)
        )


# --- what a receiver holds between updates -------------------------------------------------------

# A trainer may go away between two calls, leaving what its receiver still holds (the group's
# connections and port, shared-memory mappings): a watch releases them within about this long.
_RELEASE_PERIOD_S = 1.0
_STOP_WAIT_S = 5.0


class _Watch:
    """Runs `sweep()` every `period_s` on a daemon thread until stopped or it returns False."""

    def __init__(
        self, sweep: Callable[[], bool], *, name: str, period_s: float = _RELEASE_PERIOD_S
    ) -> None:
        # Held weakly: a receiver dropped without `shutdown` is collected, and its watch then ends.
        self._sweep: Callable[[], Callable[[], bool] | None]
        self._sweep = weakref.WeakMethod(sweep) if inspect.ismethod(sweep) else lambda: sweep
        self._period_s = period_s
        self._stopped = threading.Event()
        self.swept = threading.Event()  # set after each sweep: a test waits on it, not a sleep
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        _LIVE_WATCHES.add(self)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(self._period_s):
            if not self._sweep_once():
                return

    def _sweep_once(self) -> bool:
        """One sweep; returns whether to go on. Its owner is referenced only while it runs."""
        sweep = self._sweep()
        if sweep is None:  # the receiver was collected: nothing is left to watch
            return False
        try:
            going_on = sweep()
        except Exception:  # a sweep must never take the receiver down with it
            logger.exception("releasing what the trainer left behind failed")
            going_on = True
        self.swept.set()
        return going_on

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout_s: float = _STOP_WAIT_S) -> None:
        """Stops the thread and waits up to `timeout_s` for a sweep in progress. Safe twice."""
        self._stopped.set()
        if self._thread is not threading.current_thread():
            self._thread.join(max(0.0, timeout_s))

    @staticmethod
    def stop_if_any(watch: _Watch | None) -> None:
        if watch is not None:
            watch.stop()


_LIVE_WATCHES: weakref.WeakSet[_Watch] = weakref.WeakSet()


@atexit.register
def _stop_all_watches() -> None:
    """Stops and joins every watch still running, all within one `_STOP_WAIT_S`."""
    # Before finalization: a sweep freeing a shared-memory tensor then would take the GIL inside
    # torch's noexcept destructor, CPython would end the daemon thread with `pthread_exit`, and
    # that unwind aborts the process (`std::terminate`).
    watches = list(_LIVE_WATCHES)
    for watch in watches:
        watch._stopped.set()  # all at once: the joins below then overlap
    deadline = time.monotonic() + _STOP_WAIT_S
    for watch in watches:
        watch.stop(deadline - time.monotonic())


# --- what a backend implements -------------------------------------------------------------------
class WeightTransferEngine(ABC):
    """Receiver side of a transfer backend, owned by one inference worker.

    Lifecycle: `init_transfer_engine` once, then any number of `receive_weights`, then `shutdown`.
    After a failed transfer the engine is shut down and must be initialized again. Every backend
    takes the same keyword arguments (a control plane creates engines through the registry
    without knowing the backend) and may ignore those it does not need.

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
        if not _is_int(worker_index) or worker_index < 0:
            raise WeightValidationError(f"worker_index must be an int >= 0, got {worker_index!r}")
        self.worker_index = worker_index
        if expected_specs is None and params is not None:
            expected_specs = {name: TensorSpec.of(name, t) for name, t in params.items()}
        self.expected_specs = dict(expected_specs) if expected_specs is not None else None
        self.params = dict(params) if params is not None else None

    @contextlib.contextmanager
    def receiving_into(
        self,
        expected_specs: Mapping[str, TensorSpec],
        params: Mapping[str, torch.Tensor] | None = None,
    ) -> Iterator[None]:
        """Points the calls made inside at other tensors than the model's, then back.

        For an engine receiving into something else than its weights (a LoRA adapter's fresh
        tensors, say): each message is checked against `expected_specs` before any byte moves,
        and the backend writes in place only into `params`. Tensors still reach the caller
        through `load_weights`, unless received in place.

        Args:
            expected_specs: What the messages inside may announce, by name.
            params: Tensors the backend may write straight into; None: none.
        """
        saved = self.expected_specs, self.params
        self.expected_specs = dict(expected_specs)
        self.params = dict(params) if params is not None else None
        try:
            yield
        finally:
            self.expected_specs, self.params = saved

    def parse_init_info(self, init_info: Mapping[str, Any] | WeightTransferInitInfo) -> Any:
        """Parses a plain dict into this backend's init info dataclass."""
        return _parse_info(self.init_info_cls, init_info, what="init_info")

    def parse_update_info(self, update_info: Mapping[str, Any] | WeightTransferUpdateInfo) -> Any:
        """Parses a plain dict into this backend's update info dataclass."""
        return _parse_info(self.update_info_cls, update_info, what="update_info")

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
        self, update_info: Mapping[str, Any] | WeightTransferUpdateInfo, load_weights: LoadWeightsFn
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
        self, update_info: Mapping[str, Any] | WeightTransferUpdateInfo, reason: WeightSyncError
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


# --- the wire parameters -------------------------------------------------------------------------

DEFAULT_TIMEOUT_S = 120.0
"""Default limit, in seconds, of every blocking transfer step (`WireParams.timeout_s`)."""

CLIENT_MARGIN_S = 30.0
"""What a call that waits for a transfer step adds to that step's limit, in seconds.

A caller's bound exceeds the bound of what it waits for, so the inner step times out first and
its error (which names the step) is what the caller sees: a trainer's call into an engine
defaults to `DEFAULT_TIMEOUT_S + CLIENT_MARGIN_S`
(see [`WireParams.client_timeout_s`][weightsync.transfer.base.WireParams.client_timeout_s]).
"""


@dataclass(frozen=True)
class WireParams:
    """How tensors travel: packed into buckets or not, bucket size, buffers, timeout.

    The trainer decides them once (`trainer_init`, `ipc_trainer_init`, a weight sender) and, for
    the broadcast backends, they travel in the init info so that both sides cannot disagree. They
    are validated here, where they are built, and nowhere else.

    Attributes:
        packed: Pack tensors into byte buckets (True), or move each tensor on its own.
        bucket_size_bytes: Bucket size in bytes (packed mode); a tensor larger than a bucket gets
            a bucket of its own. Extra memory per side is at most `num_buffers` x this (or the
            largest tensor, if bigger).
        num_buffers: Buckets in flight at once, and reusable bucket buffers per side; 2 packs
            bucket k+1 while bucket k moves.
        timeout_s: Limit, in seconds, for every blocking step (rendezvous, each collective, each
            IPC hand-off).

    Raises:
        WeightValidationError: A field has the wrong type (a bool is not an int) or is out of
            range (a size or count below 1; a timeout that is not a finite number > 0); the
            message names the field, what it must be and what it got.

    >>> WireParams(bucket_size_bytes=256 << 20).num_buffers
    2
    """

    packed: bool = True
    bucket_size_bytes: int = 1 << 30
    num_buffers: int = 2
    timeout_s: float = DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        if not isinstance(self.packed, bool):
            raise WeightValidationError(f"packed must be a bool, got {self.packed!r}")
        if not _is_int(self.bucket_size_bytes) or self.bucket_size_bytes < 1:
            raise WeightValidationError(
                f"bucket_size_bytes must be an int >= 1 (bytes), got {self.bucket_size_bytes!r}"
            )
        if not _is_int(self.num_buffers) or self.num_buffers < 1:
            raise WeightValidationError(
                f"num_buffers must be an int >= 1, got {self.num_buffers!r}"
            )
        timeout = self.timeout_s
        if not (_is_int(timeout) or isinstance(timeout, float)) or not 0 < timeout < math.inf:
            raise WeightValidationError(
                f"timeout_s must be a finite number of seconds > 0, got {timeout!r}"
            )
        object.__setattr__(self, "timeout_s", float(timeout))

    @property
    def client_timeout_s(self) -> float:
        """Limit, in seconds, of a call waiting for these steps: `timeout_s + CLIENT_MARGIN_S`."""
        return self.timeout_s + CLIENT_MARGIN_S

    @classmethod
    def build(cls, wire: WireParams | None = None, **fields: Any) -> WireParams:
        """Returns `wire`, or a `WireParams` built from keyword `fields` (not both).

        Every entry point that takes wire parameters calls this, so that they are given either
        as one object (`wire=WireParams(...)`) or as keywords (`bucket_size_bytes=...`).

        Raises:
            WeightValidationError: Both given, an unknown keyword, or a bad value.
        """
        if wire is not None:
            if fields:
                raise WeightValidationError(
                    f"pass the wire parameters either as wire=WireParams(...) or as keywords, "
                    f"not both: got wire and {sorted(fields)}"
                )
            if not isinstance(wire, WireParams):
                raise WeightValidationError(f"wire must be a WireParams, got {type(wire).__name__}")
            return wire
        unknown = sorted(set(fields) - set(cls.__dataclass_fields__))
        if unknown:
            raise WeightValidationError(
                f"unknown wire parameters {unknown}; expected some of "
                f"{sorted(cls.__dataclass_fields__)}"
            )
        return cls(**fields)

    def to_dict(self) -> dict[str, Any]:
        """Returns the JSON-safe dict form, with every field."""
        return dataclasses.asdict(self)


class _WireKeywords(TypedDict, total=False):
    """The fields of `WireParams` as keyword arguments (`**wire_fields`)."""

    packed: bool
    bucket_size_bytes: int
    num_buffers: int
    timeout_s: float


# --- how a backend is found by name --------------------------------------------------------------
class _EngineRegistry:
    """Backend names -> engine classes, or `"module:Class"` strings imported on first use."""

    def __init__(self) -> None:
        self._engines: dict[str, type[WeightTransferEngine] | str] = {}

    def register(
        self, name: str, engine: type[WeightTransferEngine] | str, *, replace: bool = False
    ) -> None:
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

    def get(self, name: str) -> type[WeightTransferEngine]:
        """Returns the engine class of backend `name`; an unknown name lists the known ones."""
        known = ", ".join(sorted(self._engines))
        if not isinstance(name, str):
            raise WeightValidationError(
                f"backend must be a string naming a weight transfer backend, got "
                f"{type(name).__name__} {name!r:.80}; known backends: {known}"
            )
        entry = self._engines.get(name)
        if entry is None:
            raise WeightValidationError(
                f"unknown weight transfer backend {name!r}; known backends: {known}"
            )
        if isinstance(entry, str):
            module_name, _, class_name = entry.partition(":")
            engine = getattr(importlib.import_module(module_name), class_name)
            if not (isinstance(engine, type) and issubclass(engine, WeightTransferEngine)):
                raise WeightValidationError(f"{entry} is not a WeightTransferEngine subclass")
            self._engines[name] = entry = engine
        return entry

    def create(self, name: str, **kwargs: Any) -> WeightTransferEngine:
        return self.get(name)(**kwargs)


_default_registry = _EngineRegistry()
_default_registry.register("nccl", "weightsync.transfer.nccl:NCCLWeightTransferEngine")
_default_registry.register("gloo", "weightsync.transfer.nccl:GlooWeightTransferEngine")
_default_registry.register("ipc", "weightsync.transfer.ipc:IPCWeightTransferEngine")
_default_registry.register("disk", "weightsync.transfer.disk:DiskWeightTransferEngine")


def register_engine(
    name: str, engine: type[WeightTransferEngine] | str, *, replace: bool = False
) -> None:
    """Registers a backend under `name`, so that configs and `create_engine` can select it.

    Built in: `nccl`, `gloo`, `ipc` and `disk`.

    Args:
        name: The backend name, e.g. `"mailbox"`.
        engine: A [`WeightTransferEngine`][weightsync.transfer.base.WeightTransferEngine]
            subclass, or `"package.module:ClassName"`, imported on first use.
        replace: Override a backend already registered under `name`.

    Raises:
        WeightValidationError: `name` is taken (pass `replace=True`) or malformed.
    """
    _default_registry.register(name, engine, replace=replace)


def create_engine(backend: str, **kwargs: Any) -> WeightTransferEngine:
    """Builds the receiver engine of `backend`; `kwargs` go to its constructor.

    Raises:
        WeightValidationError: Unknown backend; the message lists the known ones.
    """
    return _default_registry.create(backend, **kwargs)
