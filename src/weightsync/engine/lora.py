"""LoRA adapters: read from PEFT directories, checked against the model, applied per row group.

One concept: LoRA adapters. An adapter adds `scaling * B @ A` to some of the model's linears
(`A`: rank x in_features, `B`: out_features x rank, `scaling = lora_alpha / r`, or
`lora_alpha / sqrt(r)` with rsLoRA) without touching the base weights, so many adapters can serve
in one batch: the rows of each adapter get its low-rank product added to the base output, the
rows with none get nothing.

- `build_lora_adapter` makes an adapter from a name -> tensor mapping and its PEFT config; it is
  the one validation path (module names, layers, shapes, rank, unsupported options), used by
  `read_lora_directory` for an `adapter_config.json` + `adapter_model.safetensors` directory and
  open to tensors already in memory.
- `LoRAAdapter` is immutable once built. `LoRARegistry` maps a name to its current adapter;
  loading a new version under a name replaces the mapping, never the object, so a request that
  holds the old object finishes on it.
- `LoRABatch` is what the forward pass sees: the step's rows grouped by adapter. The model's
  projections are fused (`qkv_proj`, `gate_up_proj`): an adapter on `q_proj` adds to the q slice
  of `qkv_proj`'s output.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from weightsync.engine._finite import non_finite_names
from weightsync.engine.model_config import LlamaConfig
from weightsync.engine.outputs import WeightVersion
from weightsync.errors import LoRAAdapterError, LoRAAdapterNotFoundError, WeightValidationError
from weightsync.transfer._safetensors import open_regular, read_header, read_tensor, read_text
from weightsync.transfer.base import TensorSpec, _is_int

__all__ = [
    "ADAPTER_CONFIG_FILE",
    "ADAPTER_WEIGHTS_FILE",
    "MAX_LORA_NAME_LENGTH",
    "SUPPORTED_LORA_MODULES",
    "LoRABatch",
    "LoRAAdapter",
    "LoRARegistry",
    "build_lora_adapter",
    "read_lora_directory",
]

ADAPTER_CONFIG_FILE = "adapter_config.json"
"""A PEFT adapter directory's config: `r`, `lora_alpha`, `target_modules`, ..."""
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
"""A PEFT adapter directory's tensors (a pickled `adapter_model.bin` is never read)."""
MAX_LORA_NAME_LENGTH = 256
"""The longest adapter name: one a live update (`/start_weight_update`'s `lora_name`) can name."""

# Hugging Face module -> (the engine's fused module, its parent) for the supported families.
_MODULES = {
    "q_proj": ("qkv_proj", "self_attn"),
    "k_proj": ("qkv_proj", "self_attn"),
    "v_proj": ("qkv_proj", "self_attn"),
    "o_proj": ("o_proj", "self_attn"),
    "gate_proj": ("gate_up_proj", "mlp"),
    "up_proj": ("gate_up_proj", "mlp"),
    "down_proj": ("down_proj", "mlp"),
}
SUPPORTED_LORA_MODULES = tuple(_MODULES)
"""The linears an adapter may target (PEFT's `target_modules`), in every supported family."""

# PEFT names its tensors `base_model.model.<module path>.lora_A.weight`.
_PEFT_PREFIX = "base_model.model."

# The config's options that are JSON booleans in PEFT's `adapter_config.json`.
_FLAGS = ("use_rslora", "use_dora", "fan_in_fan_out")


@dataclass(frozen=True)
class _ModuleShape:
    """Where one Hugging Face linear lies: its fused module, offset in its output, and sizes."""

    fused: str
    offset: int
    in_features: int
    out_features: int


def _module_shapes(config: LlamaConfig) -> dict[str, _ModuleShape]:
    """Each supported module's place in the fused model and its (in, out) features."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_size = config.num_attention_heads * config.kv_head_dim
    kv_size = config.num_key_value_heads * config.kv_head_dim
    return {
        "q_proj": _ModuleShape("qkv_proj", 0, hidden, q_size),
        "k_proj": _ModuleShape("qkv_proj", q_size, hidden, kv_size),
        "v_proj": _ModuleShape("qkv_proj", q_size + kv_size, hidden, kv_size),
        "o_proj": _ModuleShape("o_proj", 0, q_size, hidden),
        "gate_proj": _ModuleShape("gate_up_proj", 0, hidden, inter),
        "up_proj": _ModuleShape("gate_up_proj", inter, hidden, inter),
        "down_proj": _ModuleShape("down_proj", 0, inter, hidden),
    }


@dataclass(frozen=True)
class _FusedLoRA:
    """An adapter's parts on one fused module, stacked so that two matmuls apply them all.

    The parts' A matrices are stacked along the rank, and their B matrices laid on a block
    diagonal over the rows `start:stop` of the fused output that the parts cover (zero between
    parts an adapter does not target): `(x @ a.T) @ b.T` is then every part's `(x @ A.T) @ B.T`
    side by side. A step pays two matmuls and one scatter per fused module and adapter instead
    of two matmuls and a scatter per part: on a CPU, with a few rows per adapter, the number of
    operations is the cost.

    Attributes:
        start: First row of the fused output the parts cover.
        stop: One past the last.
        a: (parts * rank, in_features) the parts' A, stacked.
        b: (stop - start, parts * rank) the parts' B, on a block diagonal.
    """

    start: int
    stop: int
    a: torch.Tensor
    b: torch.Tensor

    @classmethod
    def of_parts(cls, parts: list[tuple[int, torch.Tensor, torch.Tensor]]) -> _FusedLoRA:
        """Stacks `(offset in the fused output, A, B)` parts of one fused module."""
        parts = sorted(parts, key=lambda part: part[0])
        start = parts[0][0]
        stop = max(offset + b.shape[0] for offset, _, b in parts)
        rank = parts[0][1].shape[0]
        a = torch.cat([part_a for _, part_a, _ in parts])  # (parts * rank, in)
        b = parts[0][2].new_zeros(stop - start, rank * len(parts))
        for index, (offset, _, part_b) in enumerate(parts):
            b[
                offset - start : offset - start + part_b.shape[0], index * rank : (index + 1) * rank
            ] = part_b
        return cls(start, stop, a, b)


@dataclass(frozen=True, eq=False)  # one version is one object: compared by identity
class LoRAAdapter:
    """One loaded version of a LoRA adapter: immutable, shared by every request that uses it.

    Attributes:
        name: The name requests use (vLLM's `lora_name`).
        lora_int_id: The engine's id for the name (vLLM's `lora_int_id`), kept across versions.
        version: 1 when first loaded under its name, + 1 at each in-place load.
        rank: `r`.
        scaling: What `B @ A` is multiplied by: `lora_alpha / r`, or `lora_alpha / sqrt(r)`.
        path: The directory it was read from (None: built from tensors in memory).
        base_model_name_or_path: The base model the adapter's config names (None: none).
        weights: (layer index, Hugging Face module) -> (A (rank, in), B (out, rank)), in the
            model's dtype and on its device.
        label: The label a live update gave this version (its `finish_weight_update`'s
            `weight_version`); None: none, the version number stands.
    """

    name: str
    lora_int_id: int
    version: int
    rank: int
    scaling: float
    path: str | None
    base_model_name_or_path: str | None
    weights: Mapping[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    # (layer, fused module) -> what the forward pass reads: see `_FusedLoRA`.
    _fused: Mapping[tuple[int, str], _FusedLoRA] = field(repr=False, compare=False)
    label: WeightVersion | None = None

    @property
    def weight_version(self) -> WeightVersion:
        """The version its requests' tokens carry: `label`, else `version`."""
        return self.label if self.label is not None else self.version

    @property
    def cache_key(self) -> bytes:
        """Identifies this version in the prefix cache: no other adapter or version shares it."""
        return f"lora:{self.lora_int_id}:{self.version}".encode()


def _fail(where: str, what: str) -> LoRAAdapterError:
    return LoRAAdapterError(f"LoRA adapter {where}: {what}")


def _check_config(config: Any, where: str, max_rank: int) -> tuple[int, float]:
    """Checks a PEFT `adapter_config.json` object; returns (rank, scaling).

    Raises:
        LoRAAdapterError: An option the engine cannot apply, or `r` above `max_rank`.
    """
    if not isinstance(config, Mapping):
        raise _fail(where, f"the config must be a JSON object, got {type(config).__name__}")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise _fail(where, f"peft_type is {peft_type!r}; only 'LORA' adapters are served")
    rank = config.get("r")
    if not _is_int(rank) or rank < 1:
        raise _fail(where, f"'r' must be an int >= 1, got {rank!r}")
    if rank > max_rank:
        raise _fail(
            where,
            f"rank r={rank} exceeds the maximum LoRA rank {max_rank}: raise max_lora_rank "
            "(--max-lora-rank) or use an adapter of lower rank",
        )
    alpha = config.get("lora_alpha", 8)  # PEFT's default
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not _fits_float(alpha):
        raise _fail(where, f"'lora_alpha' must be a finite number, got {alpha!r:.80}")
    for flag in _FLAGS:  # a truthy string ("false") must not switch an option on or off
        if not isinstance(config.get(flag, False), bool):
            raise _fail(where, f"{flag!r} must be true or false, got {config[flag]!r:.80}")
    refused = {
        "use_dora": (config.get("use_dora", False), "DoRA adapters (use_dora) are not served"),
        "bias": (config.get("bias", "none") != "none", "only bias='none' is served"),
        "modules_to_save": (bool(config.get("modules_to_save")), "modules_to_save is not served"),
        "fan_in_fan_out": (config.get("fan_in_fan_out", False), "fan_in_fan_out is not served"),
        "rank_pattern": (bool(config.get("rank_pattern")), "per-module ranks are not served"),
        "alpha_pattern": (bool(config.get("alpha_pattern")), "per-module alphas are not served"),
    }
    for key, (is_set, reason) in refused.items():
        if is_set:
            raise _fail(where, f"{key}={config.get(key)!r}: {reason}; merge it or retrain without")
    targets = config.get("target_modules")
    if not (
        targets is None
        or isinstance(targets, str)
        or (isinstance(targets, list) and all(isinstance(t, str) for t in targets))
    ):
        raise _fail(
            where,
            f"target_modules must be a list of module names or one pattern string, got "
            f"{targets!r:.80}",
        )
    names = [targets] if isinstance(targets, str) else targets
    if isinstance(targets, str) and targets not in _MODULES:
        names = []  # a regular expression: the tensors' names say what it targets
    for module in names or []:
        if module not in _MODULES:
            raise _fail(
                where,
                f"target module {module!r} is not supported; an adapter may target "
                f"{list(SUPPORTED_LORA_MODULES)} (not embeddings or lm_head)",
            )
    use_rslora = config.get("use_rslora", False)
    scaling = alpha / math.sqrt(rank) if use_rslora else alpha / rank
    return rank, float(scaling)


def _fits_float(value: int | float) -> bool:
    """Whether `value` is finite as a float (an int of hundreds of digits has no float)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _parse_name(name: str, where: str, num_layers: int) -> tuple[int, str, str]:
    """`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight` -> (3, "q_proj", "A")."""
    path = name.removeprefix(_PEFT_PREFIX).split(".")
    expected = (
        f"'{_PEFT_PREFIX}model.layers.<i>.<self_attn|mlp>.<module>.lora_<A|B>.weight' "
        f"with <module> one of {list(SUPPORTED_LORA_MODULES)}"
    )
    if (
        len(path) != 7
        or path[:2] != ["model", "layers"]
        or path[4] not in _MODULES
        or path[3] != _MODULES[path[4]][1]
        or path[5] not in ("lora_A", "lora_B")
        or path[6] != "weight"
        # ASCII digits only, no leading zero, as PEFT writes them: `int` also reads "٣" or "03"
        # (another name for the same tensor) and fails on "²" or thousands of digits.
        or not re.fullmatch(r"0|[1-9][0-9]{0,5}", path[2])
    ):
        raise _fail(f"{where}: tensor {name[:200]!r}", f"unexpected name; expected {expected}")
    layer = int(path[2])
    if layer >= num_layers:
        raise _fail(
            f"{where}: tensor {name[:200]!r}",
            f"layer {layer} does not exist: the model has {num_layers} layers (0 to "
            f"{num_layers - 1}); the adapter was made for another model",
        )
    return layer, path[4], path[5][-1]


def _check_tensors(
    specs: Iterable[TensorSpec], where: str, rank: int, model_config: LlamaConfig
) -> dict[tuple[int, str, str], str]:
    """Checks an adapter's tensor names, shapes and dtypes (no data needed).

    Returns:
        (layer, Hugging Face module, "A" or "B") -> the tensor's PEFT name, for each tensor.

    Raises:
        LoRAAdapterError: A name, layer, shape or dtype the model cannot take, a tensor named
            twice, a module without both lora_A and lora_B, or no tensor at all.
    """
    shapes = _module_shapes(model_config)
    names: dict[tuple[int, str, str], str] = {}
    for spec in specs:
        layer, module, kind = _parse_name(spec.name, where, model_config.num_hidden_layers)
        shape = shapes[module]
        expected = (rank, shape.in_features) if kind == "A" else (shape.out_features, rank)
        if tuple(spec.shape) != expected or not spec.dtype.is_floating_point:
            raise _fail(
                f"{where}: tensor {spec.name!r}",
                f"expected a floating tensor of shape {list(expected)} (lora_{kind} of "
                f"{module} for r={rank}), got {str(spec.dtype).removeprefix('torch.')} "
                f"{list(spec.shape)}",
            )
        if (layer, module, kind) in names:  # with and without PEFT's prefix: which one counts?
            raise _fail(
                f"{where}: tensor {spec.name!r}",
                f"lora_{kind} of {module} in layer {layer} is named twice (also "
                f"{names[layer, module, kind]!r}): keep one",
            )
        names[layer, module, kind] = spec.name
    if not names:
        raise _fail(where, "it holds no lora_A / lora_B tensors")
    for layer, module, kind in names:
        other = "B" if kind == "A" else "A"
        if (layer, module, other) not in names:
            raise _fail(
                f"{where}: tensor '{_PEFT_PREFIX}model.layers.{layer}.{_MODULES[module][1]}."
                f"{module}.lora_{other}.weight'",
                "missing: each module needs both lora_A and lora_B",
            )
    return names


def build_lora_adapter(
    name: str,
    tensors: Mapping[str, torch.Tensor],
    config: Mapping[str, Any],
    *,
    model_config: LlamaConfig,
    max_rank: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    lora_int_id: int = 0,
    version: int = 1,
    path: str | None = None,
    where: str | None = None,
    refuse_non_finite: bool = False,
) -> LoRAAdapter:
    """Builds an adapter from PEFT tensors and config, checked against the model first.

    Every check runs before a tensor is copied: module names, layers, both `lora_A` and
    `lora_B` of each module (each named once), shapes (A: r x in_features, B: out_features x r),
    floating dtypes, `r <= max_rank`, and options the engine cannot apply (DoRA, biases,
    `modules_to_save`). Only the check for NaN and infinity, when asked, reads the copies.

    Args:
        name: The adapter's name.
        tensors: PEFT tensor names (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`)
            -> tensors.
        config: PEFT's `adapter_config.json`, as a mapping.
        model_config: The base model's shape.
        max_rank: The largest `r` accepted.
        dtype: The model's dtype: A and B are cast to it.
        device: The model's device: A and B are copied there.
        lora_int_id: The engine's id for `name`.
        version: The version this build is.
        path: The directory read, if any (recorded).
        where: How errors name the source when there is no `path` (default: `name`);
            with a `path`, they name its `adapter_config.json` or `adapter_model.safetensors`.
        refuse_non_finite: Refuse a NaN or an infinity in A or B once cast to `dtype` (a
            large value can overflow a narrower dtype), as `EngineConfig.refuse_non_finite_weights`
            refuses them in the base weights.

    Raises:
        LoRAAdapterError: The first problem, naming the file and the tensor, expected and actual.
    """
    where = where or repr(name)
    config_where = str(Path(path) / ADAPTER_CONFIG_FILE) if path is not None else where
    if path is not None:
        where = str(Path(path) / ADAPTER_WEIGHTS_FILE)
    rank, scaling = _check_config(config, config_where, max_rank)
    specs = (
        TensorSpec(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in tensors.items()
    )
    names = _check_tensors(specs, where, rank, model_config)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for (layer, module, kind), tensor_name in names.items():
        pairs.setdefault((layer, module), {})[kind] = tensors[tensor_name]
    weights = {
        key: tuple(pair[k].to(device=device, dtype=dtype).contiguous() for k in "AB")
        for key, pair in sorted(pairs.items())
    }
    if refuse_non_finite:
        cast = [
            (names[layer, module, kind], tensor)
            for (layer, module), pair in weights.items()
            for kind, tensor in zip("AB", pair, strict=True)
        ]
        bad = non_finite_names(cast, set(names.values()))
        if bad:
            in_dtype = str(dtype).removeprefix("torch.")
            raise _fail(
                f"{where}: tensor {bad[0]!r}",
                f"{len(bad)} tensors hold a NaN or an infinity in {in_dtype} (e.g. {bad[:3]}), "
                "and this engine refuses non-finite weights (refuse_non_finite_weights): check "
                "the adapter's training, or its values against the model's dtype",
            )
    shapes = _module_shapes(model_config)
    fused: dict[tuple[int, str], list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    for (layer, module), (a, b) in weights.items():
        fused.setdefault((layer, shapes[module].fused), []).append((shapes[module].offset, a, b))
    base_model = config.get("base_model_name_or_path")
    return LoRAAdapter(
        name=name,
        lora_int_id=lora_int_id,
        version=version,
        rank=rank,
        scaling=scaling,
        path=path,
        base_model_name_or_path=base_model if isinstance(base_model, str) else None,
        weights=MappingProxyType(weights),  # type: ignore[arg-type]
        _fused=MappingProxyType({k: _FusedLoRA.of_parts(v) for k, v in fused.items()}),
    )


def read_lora_directory(
    path: str | os.PathLike[str],
    *,
    check: Callable[[Any, list[TensorSpec]], None] | None = None,
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Reads a PEFT adapter directory: its `adapter_config.json` and its safetensors tensors.

    Only safetensors are read (a pickled `adapter_model.bin` never is); the header is checked
    before any data is read.

    Args:
        path: The directory.
        check: Called with the config and the header's tensor specs before any tensor data is
            read; what it raises propagates (`LoRARegistry.load` refuses an adapter the model
            cannot take there, without reading megabytes it would drop).

    Returns:
        (the config, PEFT tensor name -> tensor on the CPU).

    Raises:
        LoRAAdapterNotFoundError: `path` is not a directory.
        LoRAAdapterError: `path` is empty or not a path, a missing file, JSON that does not
            parse, or a damaged safetensors file; the message names the file.
    """
    # An empty path would be the server's working directory.
    if not isinstance(path, str | os.PathLike) or not str(path):
        raise LoRAAdapterError(
            f"lora_path must name a PEFT adapter directory on this machine, got {path!r:.80}"
        )
    directory = Path(path)
    config_path = directory / ADAPTER_CONFIG_FILE
    weights_path = directory / ADAPTER_WEIGHTS_FILE
    if not directory.is_dir():  # vLLM answers this one 404: no adapter found there
        raise LoRAAdapterNotFoundError(
            f"LoRA adapter {directory}: no adapter found there (not a directory): give the path "
            "of a PEFT adapter directory on this machine"
        )
    for required in (config_path, weights_path):
        if not required.is_file():
            raise _fail(
                str(required),
                f"missing: a PEFT adapter directory holds {ADAPTER_CONFIG_FILE} and "
                f"{ADAPTER_WEIGHTS_FILE} (save it with save_pretrained(safe_serialization=True))",
            )
    try:
        config = json.loads(read_text(config_path))
    except WeightValidationError as exc:  # not a regular file, or too large
        raise LoRAAdapterError(f"LoRA adapter {exc}") from None
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise _fail(str(config_path), f"not valid JSON: {exc}") from None
    try:
        entries = read_header(weights_path)
    except WeightValidationError as exc:
        raise LoRAAdapterError(f"LoRA adapter {exc}") from None
    if check is not None:
        check(config, [e.spec for e in entries])
    try:
        with open_regular(weights_path) as f:
            tensors = {e.spec.name: read_tensor(f.fileno(), e) for e in entries}
    except WeightValidationError as exc:
        raise LoRAAdapterError(f"LoRA adapter {exc}") from None
    return config, tensors


class LoRARegistry:
    """The engine's adapters: name -> the current `LoRAAdapter`; thread-safe.

    A request takes the adapter object its name maps to when it is added, and keeps it: a later
    load under the same name (`load_inplace`) or an unload changes what new requests get, never
    what a running one computes with.

    Args:
        model_config: The base model's shape, which adapters are checked against.
        max_rank: The largest `r` accepted (`EngineConfig.max_lora_rank`).
        dtype: The model's dtype.
        device: The model's device.
        refuse_non_finite: Refuse adapters holding a NaN or an infinity
            (`EngineConfig.refuse_non_finite_weights`).
    """

    def __init__(
        self,
        model_config: LlamaConfig,
        *,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device | str,
        refuse_non_finite: bool = False,
    ) -> None:
        self.model_config = model_config
        self.max_rank = max_rank
        self.dtype = dtype
        self.device = device
        self.refuse_non_finite = refuse_non_finite
        self._adapters: dict[str, LoRAAdapter] = {}
        self._ids = itertools.count(1)  # never reused: a reloaded name gets a new id
        self._lock = threading.Lock()

    def get(self, name: str) -> LoRAAdapter:
        """The current adapter named `name`.

        Raises:
            LoRAAdapterNotFoundError: No adapter of that name is loaded.
        """
        with self._lock:
            adapter = self._adapters.get(name)
            loaded = sorted(self._adapters)
        if adapter is None:
            raise LoRAAdapterNotFoundError(f"LoRA adapter {name!r} is not loaded; loaded: {loaded}")
        return adapter

    def list(self) -> list[LoRAAdapter]:
        """The current adapters, in load order."""
        with self._lock:
            return list(self._adapters.values())

    def check_can_load(self, name: str, *, load_inplace: bool) -> None:
        """Refuses a second load of `name` unless `load_inplace` (before any file is read).

        Raises:
            LoRAAdapterError: `name` is empty or longer than `MAX_LORA_NAME_LENGTH`, or loaded
                and `load_inplace` is False.
        """
        if not isinstance(name, str) or not name:
            raise LoRAAdapterError(f"lora_name must be a non-empty string, got {name!r:.80}")
        if len(name) > MAX_LORA_NAME_LENGTH:
            raise LoRAAdapterError(
                f"lora_name must be at most {MAX_LORA_NAME_LENGTH} characters, got {len(name)} "
                f"({name[:40]!r}...): give the adapter a shorter name"
            )
        if not load_inplace and name in self._adapters:
            raise LoRAAdapterError(
                f"The lora adapter '{name}' has already been loaded. If you want to load the "
                "adapter in place, set 'load_inplace' to True."
            )

    def load(
        self, name: str, path: str | os.PathLike[str], *, load_inplace: bool = False
    ) -> LoRAAdapter:
        """Reads, checks and registers the PEFT adapter at `path` under `name`.

        Raises:
            LoRAAdapterError: The adapter was refused (see `build_lora_adapter`); nothing changed.
            LoRAAdapterNotFoundError: `path` is not a directory.
        """
        self.check_can_load(name, load_inplace=load_inplace)

        def check(config: Any, specs: list[TensorSpec]) -> None:  # the builder's checks, on specs
            rank, _ = _check_config(config, str(Path(path) / ADAPTER_CONFIG_FILE), self.max_rank)
            _check_tensors(specs, str(Path(path) / ADAPTER_WEIGHTS_FILE), rank, self.model_config)

        config, tensors = read_lora_directory(path, check=check)
        return self.add(name, tensors, config, load_inplace=load_inplace, path=str(path))

    def add(
        self,
        name: str,
        tensors: Mapping[str, torch.Tensor],
        config: Mapping[str, Any],
        *,
        load_inplace: bool = False,
        path: str | None = None,
        label: WeightVersion | None = None,
    ) -> LoRAAdapter:
        """Checks and registers an adapter built from `tensors` under `name`; returns it.

        A new name gets a new id and version 1; `load_inplace` over a loaded name keeps its id
        and takes the next version. Requests running on the previous version keep it. `label`
        names the version in its requests' outputs (see `LoRAAdapter.label`).

        Raises:
            LoRAAdapterError: The adapter was refused, or `name` is loaded and `load_inplace` is
                False; nothing changed.
        """
        self.check_can_load(name, load_inplace=load_inplace)
        adapter = build_lora_adapter(
            name, tensors, config, model_config=self.model_config, max_rank=self.max_rank,
            dtype=self.dtype, device=self.device, path=path,
            refuse_non_finite=self.refuse_non_finite,
        )  # fmt: skip
        with self._lock:
            self.check_can_load(name, load_inplace=load_inplace)  # another load may have won
            previous = self._adapters.get(name)
            adapter = _with_identity(
                adapter,
                lora_int_id=next(self._ids) if previous is None else previous.lora_int_id,
                version=1 if previous is None else previous.version + 1,
                label=label,
            )
            self._adapters[name] = adapter
        return adapter

    def remove(self, name: str) -> LoRAAdapter:
        """Unregisters `name`; requests that hold it finish on it. Returns the adapter removed.

        Raises:
            LoRAAdapterNotFoundError: No adapter of that name is loaded.
        """
        with self._lock:
            adapter = self._adapters.pop(name, None)
        if adapter is None:
            raise LoRAAdapterNotFoundError(f"The lora adapter '{name}' cannot be found.")
        return adapter


def _with_identity(
    adapter: LoRAAdapter, *, lora_int_id: int, version: int, label: WeightVersion | None
) -> LoRAAdapter:
    """`adapter` under another id and version: the same tensors, a new immutable object."""
    fields = {**adapter.__dict__, "lora_int_id": lora_int_id, "version": version, "label": label}
    return LoRAAdapter(**fields)


class LoRABatch:
    """A step's rows grouped by adapter: what `LlamaForCausalLM.forward` adds to its linears.

    Args:
        groups: (adapter, (rows,) indices among the step's tokens), one per adapter; rows of
            no adapter are in none.
    """

    def __init__(self, groups: Iterable[tuple[LoRAAdapter, torch.Tensor]]) -> None:
        self.groups = list(groups)

    @classmethod
    def of_rows(
        cls, spans: Iterable[tuple[LoRAAdapter | None, int, int]], device: torch.device
    ) -> LoRABatch | None:
        """Groups token spans `(adapter, first row, rows)` by adapter; None when none has one.

        None lets the forward pass run exactly the base path, with no extra work.
        """
        rows: dict[int, tuple[LoRAAdapter, list[int]]] = {}
        for adapter, first, count in spans:
            if adapter is not None:
                rows.setdefault(id(adapter), (adapter, []))[1].extend(range(first, first + count))
        if not rows:
            return None
        return cls(
            (adapter, torch.tensor(indices, dtype=torch.long, device=device))
            for adapter, indices in rows.values()
        )

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, fused: str) -> None:
        """Adds each group's `scaling * (x @ A.T) @ B.T` to its rows of `out`, in place.

        Args:
            out: (tokens, out_features) output of the fused module `fused` of layer `layer`.
            x: (tokens, in_features) the module's input.
            layer: The layer's index.
            fused: `qkv_proj`, `o_proj`, `gate_up_proj` or `down_proj`.
        """
        for adapter, rows in self.groups:
            stacked = adapter._fused.get((layer, fused))
            if stacked is None:
                continue
            x_rows = x.index_select(0, rows)  # (rows, in_features)
            delta = (x_rows @ stacked.a.T) @ stacked.b.T  # (rows, stop - start)
            delta.mul_(adapter.scaling)
            out[:, stacked.start : stacked.stop].index_add_(0, rows, delta)
