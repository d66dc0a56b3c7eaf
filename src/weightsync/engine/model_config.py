"""`LlamaConfig`: the shape of a Llama-family model, its presets, and its `config.json` form."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from weightsync.errors import EngineConfigError

__all__ = ["PRESETS", "LlamaConfig"]


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

    Raises:
        EngineConfigError: Inconsistent or out-of-range values; the message names the field.
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

    def __post_init__(self) -> None:
        for name in (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
        ):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise EngineConfigError(f"LlamaConfig.{name} must be an int >= 1, got {value!r}")
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
        if not isinstance(self.head_dim, int) or self.head_dim < 2 or self.head_dim % 2:
            raise EngineConfigError(
                f"LlamaConfig.head_dim must be an even int >= 2, got {self.head_dim!r}"
            )

    @property
    def kv_head_dim(self) -> int:
        """`head_dim`, typed as an int (it is always set after construction)."""
        assert self.head_dim is not None
        return self.head_dim

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> LlamaConfig:
        """Returns the preset `name` (see `PRESETS`), with `overrides` applied.

        Raises:
            EngineConfigError: Unknown preset; the message lists the known ones.

        >>> LlamaConfig.preset("tiny", tie_word_embeddings=True).tie_word_embeddings
        True
        """
        if name not in PRESETS:
            raise EngineConfigError(
                f"unknown model preset {name!r}; known presets: {sorted(PRESETS)}"
            )
        return replace(PRESETS[name], **overrides)

    @classmethod
    def from_hf_dict(cls, data: dict[str, Any]) -> LlamaConfig:
        """Reads a Hugging Face Llama `config.json` (older `rope_theta` or newer `rope_parameters`).

        Raises:
            EngineConfigError: Not a plain Llama: another `model_type`, biases, an activation
                other than SiLU, or rope scaling; the message names the key.
        """
        if data.get("model_type", "llama") != "llama":
            raise EngineConfigError(
                f"config.json model_type must be 'llama', got {data.get('model_type')!r}"
            )
        for key in ("attention_bias", "mlp_bias"):
            if data.get(key):
                raise EngineConfigError(
                    f"config.json {key}=true is not supported; only bias-free Llama"
                )
        if data.get("hidden_act", "silu") != "silu":
            raise EngineConfigError(
                f"config.json hidden_act must be 'silu', got {data.get('hidden_act')!r}"
            )
        rope = data.get("rope_parameters") or data.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise EngineConfigError(
                f"config.json rope type {rope.get('rope_type', rope.get('type'))!r} is not supported; "
                "only the default rotary embedding"
            )
        heads = data["num_attention_heads"]
        return cls(
            vocab_size=data["vocab_size"],
            hidden_size=data["hidden_size"],
            intermediate_size=data["intermediate_size"],
            num_hidden_layers=data["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=data.get("num_key_value_heads") or heads,
            head_dim=data.get("head_dim"),
            rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", data.get("rope_theta", 10000.0))),
            max_position_embeddings=data.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """Returns the Hugging Face `config.json` fields describing this model."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
        }


PRESETS: dict[str, LlamaConfig] = {
    "debug": LlamaConfig(hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512),
    "tiny": LlamaConfig(),
    "small": LlamaConfig(hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=4),
}  # fmt: skip
"""Model shapes by name: `debug` (~0.12M parameters), `tiny` (~3.0M), `small` (~23M)."""
