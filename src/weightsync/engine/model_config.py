"""`LlamaConfig`: the shape of a Llama-family model, its presets, and its `config.json` form.

The family covers the dense, full-attention checkpoints RL users train: Llama 1 to 3.x (rotary
scaling `llama3` or `linear`), Qwen2 and Qwen2.5 (biases on q, k and v) and Qwen3 (an RMSNorm on
each head's queries and keys, an explicit `head_dim`). Each is a few switches of one config, not
a model of its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Literal

from weightsync.errors import EngineConfigError
from weightsync.transfer.base import _is_int

__all__ = ["SUPPORTED_MODEL_TYPES", "LlamaConfig", "RopeScaling"]

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
"""The `config.json` model types the engine serves (dense, full attention)."""

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM"}  # fmt: skip
_ROPE_TYPES = ("default", "linear", "llama3")
# The largest value of each size that a model of the family has, with room to spare (Llama 3.1
# 405B: hidden 16384, MLP 53248, 126 layers, 128 heads; vocabularies up to 256K; 128K positions).
# A config.json past them is damaged or hostile; refused before anything is allocated.
_MAXIMA = {"vocab_size": 1 << 22, "hidden_size": 1 << 16, "intermediate_size": 1 << 20,
           "num_hidden_layers": 1 << 10, "num_attention_heads": 1 << 10,
           "num_key_value_heads": 1 << 10, "max_position_embeddings": 1 << 24,
           "head_dim": 1 << 12}  # fmt: skip
_FLAGS = ("tie_word_embeddings", "attention_bias")
# The keys of config.json without which the model's shape is unknown.
_REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads")  # fmt: skip


@dataclass(frozen=True)
class RopeScaling:
    """How the rotary embedding stretches to longer contexts (`config.json`'s `rope_scaling`).

    Attributes:
        rope_type: `"linear"` (every frequency divided by `factor`: position interpolation) or
            `"llama3"` (Llama 3.1's: long wavelengths divided by `factor`, short ones kept, the
            band between them blended).
        factor: How many times longer the context is than in pre-training.
        low_freq_factor: `llama3`: wavelengths above `original_max_position_embeddings /
            low_freq_factor` are scaled fully.
        high_freq_factor: `llama3`: wavelengths below `original_max_position_embeddings /
            high_freq_factor` are kept.
        original_max_position_embeddings: `llama3`: the context length of pre-training.

    Raises:
        EngineConfigError: An unknown type or a factor that is not a positive number.
    """

    rope_type: Literal["linear", "llama3"]
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in ("linear", "llama3"):
            raise EngineConfigError(
                f"RopeScaling.rope_type must be 'linear' or 'llama3', got {self.rope_type!r}"
            )
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            value = getattr(self, name)
            if not _is_positive_number(value):
                raise EngineConfigError(
                    f"RopeScaling.{name} must be a finite number > 0, got {value!r:.80}"
                )
        context = self.original_max_position_embeddings
        if not _is_int(context) or not 1 <= context <= _MAXIMA["max_position_embeddings"]:
            raise EngineConfigError(
                "RopeScaling.original_max_position_embeddings must be an int from 1 to "
                f"{_MAXIMA['max_position_embeddings']}, got {context!r:.80}"
            )
        if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise EngineConfigError(
                f"RopeScaling.high_freq_factor ({self.high_freq_factor}) must exceed "
                f"low_freq_factor ({self.low_freq_factor})"
            )


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of a Llama-family model (the fields of a Hugging Face `config.json` it needs).

    Attributes:
        vocab_size: Vocabulary size.
        hidden_size: Width of the residual stream.
        intermediate_size: Width of the MLP.
        num_hidden_layers: Decoder layers.
        num_attention_heads: Query heads.
        num_key_value_heads: Key/value heads (grouped-query attention); divides the query heads.
        head_dim: Width of a head; defaults to `hidden_size // num_attention_heads`.
        rms_norm_eps: Epsilon of RMSNorm.
        rope_theta: Base of the rotary embedding frequencies.
        max_position_embeddings: Longest sequence the model handles.
        tie_word_embeddings: Whether the LM head shares the embedding matrix.
        model_type: The family, one of `SUPPORTED_MODEL_TYPES`: `"llama"`, `"qwen2"` (biases
            on q, k and v) or `"qwen3"` (RMSNorm on each head's queries and keys).
        attention_bias: Biases on q, k, v and o (Llama's and Qwen3's switch; Qwen2 always has
            them on q, k and v only, and leaves this False).
        rope_scaling: How the rotary embedding is stretched; None for none.

    Raises:
        EngineConfigError: Inconsistent or out-of-range values (each size has a maximum no model
            of the family reaches, `_MAXIMA`); the message names the field.
    """

    vocab_size: int = 259
    hidden_size: int = 256
    intermediate_size: int = 688
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    model_type: str = "llama"
    attention_bias: bool = False
    rope_scaling: RopeScaling | None = None

    def __post_init__(self) -> None:
        for name in (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
        ):  # fmt: skip
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise EngineConfigError(f"LlamaConfig.{name} must be an int >= 1, got {value!r}")
            _check_maximum(name, value)
        if self.num_attention_heads % self.num_key_value_heads:
            raise EngineConfigError(
                f"LlamaConfig.num_key_value_heads ({self.num_key_value_heads}) must divide "
                f"num_attention_heads ({self.num_attention_heads})"
            )
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise EngineConfigError(
                    f"LlamaConfig.hidden_size ({self.hidden_size}) is not a multiple of "
                    f"num_attention_heads ({self.num_attention_heads}); set head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if not _is_int(self.head_dim) or self.head_dim < 2 or self.head_dim % 2:
            raise EngineConfigError(
                f"LlamaConfig.head_dim must be an even int >= 2, got {self.head_dim!r}"
            )
        _check_maximum("head_dim", self.head_dim)
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not _is_positive_number(value):
                raise EngineConfigError(
                    f"LlamaConfig.{name} must be a finite number > 0, got {value!r:.80}"
                )
            object.__setattr__(self, name, float(value))
        for name in _FLAGS:
            # A JSON string "false" must not switch a flag on.
            if not isinstance(getattr(self, name), bool):
                raise EngineConfigError(
                    f"LlamaConfig.{name} must be true or false, got {getattr(self, name)!r:.80}"
                )
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise EngineConfigError(
                f"LlamaConfig.model_type must be one of {list(SUPPORTED_MODEL_TYPES)}, got "
                f"{self.model_type!r}"
            )
        if self.attention_bias and self.model_type == "qwen2":
            raise EngineConfigError(
                "LlamaConfig.attention_bias must be False for model_type 'qwen2': Qwen2 has "
                "biases on q, k and v always, and none on o"
            )
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise EngineConfigError(
                f"LlamaConfig.rope_scaling must be a RopeScaling or None, got {self.rope_scaling!r}"
            )

    @property
    def kv_head_dim(self) -> int:
        """`head_dim`, typed as an int (it is always set after construction)."""
        assert self.head_dim is not None
        return self.head_dim

    @property
    def qkv_bias(self) -> bool:
        """Whether the q, k and v projections have biases (Qwen2 always; else `attention_bias`)."""
        return self.model_type == "qwen2" or self.attention_bias

    @property
    def o_proj_bias(self) -> bool:
        """Whether the attention's output projection has a bias."""
        return self.attention_bias

    @property
    def qk_norm(self) -> bool:
        """Whether each head's queries and keys go through an RMSNorm before rotation (Qwen3)."""
        return self.model_type == "qwen3"

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> LlamaConfig:
        """Returns the preset `name` (see `_PRESETS`), with `overrides` applied.

        Raises:
            EngineConfigError: Unknown preset; the message lists the known ones.

        >>> LlamaConfig.preset("tiny", tie_word_embeddings=True).tie_word_embeddings
        True
        """
        if name not in _PRESETS:
            raise EngineConfigError(
                f"unknown model preset {name!r}; known presets: {sorted(_PRESETS)}"
            )
        return replace(_PRESETS[name], **overrides)

    @classmethod
    def from_hf_dict(cls, data: dict[str, Any], *, source: str = "config.json") -> LlamaConfig:
        """Reads a Hugging Face `config.json` of a supported family.

        Both forms of the rotary settings are read: the older top-level `rope_theta` with
        `rope_scaling`, and the newer `rope_parameters`.

        Args:
            data: The parsed `config.json`.
            source: How error messages name the file.

        Raises:
            EngineConfigError: An architecture outside the family (another `model_type`, MoE,
                sliding-window attention, an activation other than SiLU, MLP biases, a rotary
                scaling other than `linear` and `llama3`), or a required key missing or out of
                range; one line naming the file and the key.

        >>> LlamaConfig.from_hf_dict({"model_type": "qwen2", "vocab_size": 64, "hidden_size": 32,
        ...     "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}).qkv_bias
        True
        """
        if not isinstance(data, dict):
            raise EngineConfigError(f"{source} must hold a JSON object, got {type(data).__name__}")
        model_type = data.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise EngineConfigError(
                f"{source}: model_type {model_type!r} is not supported; weightsync serves the "
                f"dense, full-attention families {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        layer_types = data.get("layer_types") or []
        if not isinstance(layer_types, list):
            raise EngineConfigError(
                f"{source}: layer_types must be a list of attention kinds, got {layer_types!r:.80}"
            )
        if data.get("use_sliding_window") or "sliding_attention" in layer_types:
            raise EngineConfigError(
                f"{source}: sliding-window attention (use_sliding_window / layer_types) is not "
                f"supported; weightsync serves the dense, full-attention families "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if data.get("mlp_bias"):
            raise EngineConfigError(
                f"{source}: mlp_bias=true is not supported; only bias-free MLPs"
            )
        if data.get("hidden_act", "silu") != "silu":
            raise EngineConfigError(
                f"{source}: hidden_act must be 'silu', got {data.get('hidden_act')!r}"
            )
        missing = [key for key in _REQUIRED_KEYS if key not in data]
        if missing:
            raise EngineConfigError(
                f"{source}: required key {missing[0]!r} is missing (a {model_type} config.json "
                f"has {', '.join(_REQUIRED_KEYS)})"
            )
        rope: dict[str, Any] = data.get("rope_parameters") or data.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise EngineConfigError(f"{source}: rope_scaling must be an object, got {rope!r}")
        heads = data["num_attention_heads"]
        kv_heads = data.get("num_key_value_heads")
        # A flag written as null is unset, as transformers reads it; any other non-boolean is
        # refused where the config is built.
        flags = {key: data.get(key) is not None and data[key] for key in _FLAGS}
        try:
            rope_scaling = _rope_scaling(rope, source)
            return cls(
                vocab_size=data["vocab_size"],
                hidden_size=data["hidden_size"],
                intermediate_size=data["intermediate_size"],
                num_hidden_layers=data["num_hidden_layers"],
                num_attention_heads=heads,
                num_key_value_heads=heads if kv_heads is None else kv_heads,
                head_dim=data.get("head_dim"),
                rms_norm_eps=data.get("rms_norm_eps", 1e-6),
                rope_theta=rope.get("rope_theta") or data.get("rope_theta") or 10000.0,
                max_position_embeddings=data.get("max_position_embeddings", 2048),
                tie_word_embeddings=flags["tie_word_embeddings"],
                model_type=model_type,
                # Qwen2's config has no switch: its biases are part of the architecture.
                attention_bias=model_type != "qwen2" and flags["attention_bias"],
                rope_scaling=rope_scaling,
            )
        except (EngineConfigError, TypeError, ValueError) as exc:
            raise EngineConfigError(f"{source}: {exc}") from None

    def to_hf_dict(self) -> dict[str, Any]:
        """Returns the Hugging Face `config.json` fields describing this model."""
        scaling = self.rope_scaling
        rope_scaling: dict[str, Any] | None = None
        if scaling is not None:
            rope_scaling = {"rope_type": scaling.rope_type, "factor": scaling.factor}
            if scaling.rope_type == "llama3":
                rope_scaling.update(
                    low_freq_factor=scaling.low_freq_factor,
                    high_freq_factor=scaling.high_freq_factor,
                    original_max_position_embeddings=scaling.original_max_position_embeddings,
                )
        data: dict[str, Any] = {
            "architectures": [_ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
        }
        if self.model_type == "llama":
            data["mlp_bias"] = False
        if self.model_type != "qwen2":
            data["attention_bias"] = self.attention_bias
        return data


def _is_positive_number(value: object) -> bool:
    """Whether `value` is a finite int or float > 0 (not a bool: JSON's `true` is no number)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:  # an int of hundreds of digits has no float
        return math.isfinite(value) and value > 0
    except OverflowError:
        return False


def _check_maximum(name: str, value: int) -> None:
    if value > _MAXIMA[name]:
        raise EngineConfigError(
            f"LlamaConfig.{name} is {value}, more than the {_MAXIMA[name]} that any model of the "
            "family has: the file is damaged, or not a model of a supported family"
        )


def _rope_scaling(rope: dict[str, Any], source: str) -> RopeScaling | None:
    """The rotary scaling of `config.json`'s `rope_scaling` or `rope_parameters` object."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in _ROPE_TYPES:
        raise EngineConfigError(
            f"{source}: rope type {rope_type!r} is not supported; supported: {', '.join(_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return None
    if "factor" not in rope:
        raise EngineConfigError(f"{source}: rope_scaling of type {rope_type!r} has no 'factor'")
    if rope_type == "linear":
        return RopeScaling("linear", rope["factor"])
    missing = [key for key in ("low_freq_factor", "high_freq_factor",
                               "original_max_position_embeddings") if key not in rope]  # fmt: skip
    if missing:
        raise EngineConfigError(f"{source}: rope_scaling of type 'llama3' has no {missing[0]!r}")
    return RopeScaling(
        "llama3",
        rope["factor"],
        low_freq_factor=rope["low_freq_factor"],
        high_freq_factor=rope["high_freq_factor"],
        original_max_position_embeddings=rope["original_max_position_embeddings"],
    )


_PRESETS: dict[str, LlamaConfig] = {
    "debug": LlamaConfig(hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512),
    "tiny": LlamaConfig(),
    "small": LlamaConfig(hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=4),
}  # fmt: skip
"""Model shapes by name: `debug` (~0.12M parameters), `tiny` (~3.0M), `small` (~23M)."""
