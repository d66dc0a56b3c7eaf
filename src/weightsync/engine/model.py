"""A Llama-family decoder in plain torch whose parameter names match Hugging Face's.

_RMSNorm, rotary position embeddings (optionally scaled, `llama3` or `linear`), grouped-query
attention and a SwiGLU MLP, with a tied or untied LM head. The families differ in three switches
of `LlamaConfig`: biases on q/k/v (Qwen2) or on q/k/v/o (`attention_bias`), and an _RMSNorm on each
head's queries and keys before rotation (Qwen3). The engine fuses q/k/v into `qkv_proj` and
gate/up into `gate_up_proj` (fewer, larger matmuls), yet speaks Hugging Face's names at its edges:
`weight_specs`, `named_weights` and `load_weights` use `model.layers.N.self_attn.q_proj.weight`
and friends, so a trainer holding a Hugging Face model pushes its `named_parameters()` unchanged.

The forward pass works on a flat list of tokens from any number of sequences (the scheduler's
batch); attention finds each token's context through `AttentionMetadata`, or, without it, treats
the tokens as one sequence with plain causal attention (the reference path).

On a CPU in float32 each linear multiplies by a prepacked copy of its weight (`pack_linears`),
rebuilt from the plain weight, which updates write into, off the update's path once it commits.
LoRA adapters (`weightsync.engine.lora`) add their low-rank products to their rows of each
projection's output; the base path stays as it is.

One concept: the Llama-family model, its forward pass and its Hugging Face names.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from weightsync.engine._attention import AttentionMetadata, causal_attention, paged_attention
from weightsync.engine._packed_linear import PackedCopies, PackedLinear, packing_unavailable
from weightsync.engine.lora import LoRABatch
from weightsync.engine.model_config import LlamaConfig
from weightsync.errors import EngineConfigError, EngineStateError, WeightValidationError
from weightsync.transfer.base import TensorSpec

__all__ = ["LlamaForCausalLM"]

logger = logging.getLogger(__name__)

# Fused module -> the Hugging Face modules it holds, in Hugging Face order.
_FUSED_PARTS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def _memory_bytes(device: torch.device) -> int | None:
    """The memory `device` has: a GPU's own, else the machine's physical memory (None: unknown)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):  # not POSIX: the allocator will say it
        return None


def _check_fits_memory(needed_bytes: int, what: str, device: torch.device, advice: str) -> None:
    """Refuses, before anything is allocated, what needs more memory than `device` has at all.

    Raises:
        EngineConfigError: `what` needs more than the device's memory; the message says both.
    """
    total = _memory_bytes(device)
    if total is not None and needed_bytes > total:
        where = "this machine has" if device.type == "cpu" else f"{device} has"
        raise EngineConfigError(
            f"{what} needs {needed_bytes / 1e9:.1f} GB, more than the {total / 1e9:.1f} GB of "
            f"memory {where}: {advice}"
        )


def _weight_bytes(config: LlamaConfig, dtype: torch.dtype) -> int:
    """Bytes of a model's weights and rotary tables in `dtype` (norms and biases aside)."""
    hidden, head_dim = config.hidden_size, config.kv_head_dim
    attention = 2 * hidden * head_dim * (config.num_attention_heads + config.num_key_value_heads)
    per_layer = attention + 3 * hidden * config.intermediate_size
    embeddings = config.vocab_size * hidden * (1 if config.tie_word_embeddings else 2)
    rotary = 2 * config.max_position_embeddings * head_dim
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return (config.num_hidden_layers * per_layer + embeddings + rotary) * itemsize


class _RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 like Hugging Face's `LlamaRMSNorm`."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalizes the last dimension of `x` (tokens, hidden) and scales it by `weight`."""
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope_inv_freq(config: LlamaConfig) -> torch.Tensor:
    """The rotary frequencies (head_dim / 2,), in float32, after the config's scaling."""
    dim = config.kv_head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2).float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":  # position interpolation: positions / factor
        return inv_freq / scaling.factor
    # llama3: wavelengths longer than the pre-training context / low_freq_factor are stretched by
    # `factor`, those shorter than context / high_freq_factor are kept, and the band between
    # blends the two, linearly in context / wavelength.
    context = scaling.original_max_position_embeddings
    wavelength = 2 * math.pi / inv_freq
    stretched = torch.where(wavelength > context / scaling.low_freq_factor,
                            inv_freq / scaling.factor, inv_freq)  # fmt: skip
    blend = (context / wavelength - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - blend) * stretched / scaling.factor + blend * stretched
    in_band = (wavelength >= context / scaling.high_freq_factor) & (
        wavelength <= context / scaling.low_freq_factor
    )
    return torch.where(in_band, blended, stretched)


class _LlamaAttention(nn.Module):
    """Grouped-query self-attention with rotary embeddings; q/k/v fused in one projection."""

    def __init__(self, config: LlamaConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.kv_head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = PackedLinear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias
        )
        self.o_proj = PackedLinear(self.q_size, config.hidden_size, bias=config.o_proj_bias)
        # Qwen3: each head's queries and keys are normalized over head_dim before rotation.
        self.q_norm = _RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = _RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: AttentionMetadata | None,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        """Rotary self-attention over `x` (tokens, hidden): paged when `attention` is given.

        `cos` and `sin` are the rotary tables at the tokens' positions (tokens, head_dim);
        `lora` adds its adapters' products to their rows of each projection.
        """
        tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # (tokens, q_size + 2 * kv_size)
        if lora is not None:
            lora.add(qkv, x, self.layer_index, "qkv_proj")
        # Queries and keys rotate together, as one (tokens, heads + kv_heads, head_dim) tensor:
        # half as many small elementwise ops per layer as rotating them apart.
        qk = qkv[:, : self.q_size + self.kv_size].view(tokens, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (tokens, 1, head_dim)
        qk = qk * cos + _rotate_half(qk) * sin
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)  # (tokens, heads|kv, dim)
        v = qkv[:, self.q_size + self.kv_size :].view(tokens, self.num_kv_heads, self.head_dim)
        out = (
            causal_attention(q, k, v)
            if attention is None
            else paged_attention(self.layer_index, q, k, v, attention)
        )
        out = out.reshape(tokens, self.q_size)
        projected: torch.Tensor = self.o_proj(out)
        if lora is not None:
            lora.add(projected, out, self.layer_index, "o_proj")
        return projected


class _LlamaMLP(nn.Module):
    """SwiGLU feed-forward: `down(silu(gate(x)) * up(x))`, gate and up fused."""

    def __init__(self, config: LlamaConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.gate_up_proj = PackedLinear(
            config.hidden_size, 2 * config.intermediate_size, bias=False
        )
        self.down_proj = PackedLinear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        """Applies the MLP to `x` (tokens, hidden), with `lora`'s products on its rows."""
        gate_up: torch.Tensor = self.gate_up_proj(x)  # (tokens, 2 * intermediate)
        if lora is not None:
            lora.add(gate_up, x, self.layer_index, "gate_up_proj")
        gate, up = gate_up.chunk(2, dim=-1)
        hidden = F.silu(gate) * up
        out: torch.Tensor = self.down_proj(hidden)
        if lora is not None:
            lora.add(out, hidden, self.layer_index, "down_proj")
        return out


class _LlamaDecoderLayer(nn.Module):
    """Pre-norm residual block: attention, then MLP."""

    def __init__(self, config: LlamaConfig, layer_index: int) -> None:
        super().__init__()
        self.self_attn = _LlamaAttention(config, layer_index)
        self.mlp = _LlamaMLP(config, layer_index)
        self.input_layernorm = _RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = _RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: AttentionMetadata | None,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        """Runs the block on `x` (tokens, hidden); arguments as for `LlamaAttention.forward`."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attention, lora)
        return x + self.mlp(self.post_attention_layernorm(x), lora)  # type: ignore[no-any-return]


class _LlamaModel(nn.Module):
    """Embeddings, decoder layers and the final norm (Hugging Face's `model.` prefix)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            _LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = _RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM (Llama, Qwen2, Qwen3) with Hugging Face's names at its edges.

    Args:
        config: The model's shape and family.
        dtype: Parameter dtype.

    >>> model = LlamaForCausalLM.from_preset("debug", seed=0)
    >>> "model.layers.0.self_attn.q_proj.weight" in model.weight_specs()
    True
    """

    rope_cos: torch.Tensor  # (max_positions, head_dim) buffers, indexed by position
    rope_sin: torch.Tensor

    def __init__(self, config: LlamaConfig, *, dtype: torch.dtype = torch.float32) -> None:
        # A config's sizes are checked against the machine before a byte is allocated: an
        # absurd one is refused in one line rather than by the allocator (or the OOM killer).
        _check_fits_memory(
            _weight_bytes(config, dtype),
            f"a model of this shape (vocab_size {config.vocab_size}, hidden_size "
            f"{config.hidden_size}, intermediate_size {config.intermediate_size}, "
            f"num_hidden_layers {config.num_hidden_layers}, head_dim {config.head_dim}, "
            f"max_position_embeddings {config.max_position_embeddings}) in {dtype}",
            torch.device("cpu"),  # built here, then moved
            "check config.json's sizes, or serve the model on a machine with more memory",
        )
        super().__init__()
        self.config = config
        self.model = _LlamaModel(config)
        self.lm_head = PackedLinear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.to(dtype)
        inv_freq = _rope_inv_freq(config)  # (head_dim / 2,)
        angles = torch.outer(torch.arange(config.max_position_embeddings).float(), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)  # (max_positions, head_dim)
        self.register_buffer("rope_cos", angles.cos().to(dtype), persistent=False)
        self.register_buffer("rope_sin", angles.sin().to(dtype), persistent=False)
        self._packed: PackedCopies | None = None  # see `pack_linears`

    @classmethod
    def from_preset(
        cls, name: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any
    ) -> LlamaForCausalLM:
        """Builds preset `name` (see `_PRESETS`) with weights drawn from `seed`."""
        model = cls(LlamaConfig.preset(name, **overrides), dtype=dtype)
        model.init_weights(seed)
        return model

    @property
    def dtype(self) -> torch.dtype:
        """The parameters' dtype."""
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        """The device the parameters live on."""
        return self.model.embed_tokens.weight.device

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Fills the weights from `seed`: matrices N(0, 1/fan_in), biases N(0, 1/size), norms 1.

        The scale keeps every sublayer's output near unit size, so a random model's output
        depends on its whole context (a test of the KV cache then means something). Draws follow
        `named_weights()` order in float32, so a seed gives the same model in any dtype.
        """
        generator = torch.Generator().manual_seed(seed)
        for name, weight in self.named_weights():
            if name.endswith(".bias"):
                values = torch.randn(weight.shape, generator=generator) / math.sqrt(weight.numel())
                weight.copy_(values)
            elif weight.dim() == 1:
                weight.fill_(1.0)
            else:
                values = torch.randn(weight.shape, generator=generator) / math.sqrt(weight.shape[1])
                weight.copy_(values)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        attention: AttentionMetadata | None = None,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        """Runs the decoder over a flat list of tokens.

        Args:
            input_ids: (tokens,) token ids.
            positions: (tokens,) position of each token in its sequence; defaults to 0..tokens-1.
            attention: Where the tokens sit in the paged KV cache. None means the tokens are one
                whole sequence, attended causally without a cache.
            lora: The step's rows grouped by LoRA adapter; None (no adapter rows) runs the
                base weights alone.

        Returns:
            (tokens, hidden_size) final hidden states; see `compute_logits`.
        """
        if positions is None:
            positions = torch.arange(input_ids.shape[0], device=input_ids.device)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]  # (tokens, head_dim)
        x = self.model.embed_tokens(input_ids)  # (tokens, hidden)
        for layer in self.model.layers:
            x = layer(x, cos, sin, attention, lora)
        return self.model.norm(x)  # type: ignore[no-any-return]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Maps (rows, hidden_size) hidden states to (rows, vocab_size) logits."""
        return self.lm_head(hidden)  # type: ignore[no-any-return]

    # --- prepacked linears --------------------------------------------------------------------

    @property
    def linears_packed(self) -> bool:
        """Whether the linears read prepacked weights (see `pack_linears`)."""
        return self._packed is not None

    def pack_linears(self) -> bool:
        """Gives every linear a prepacked copy of its weight, read by the forward pass from now on.

        The copy is oneDNN's blocked layout of the weight (see `PackedLinear`), a second copy
        of the matrices' memory. The plain weights stay: updates write into them, so whoever
        writes them calls `cancel_repack` before the first byte moves and `repack_linears`
        after the last (the engine's weight updates do, at open and at commit). Call it once
        the model is on its device, in its dtype. Called again, it rebuilds every copy.

        Returns:
            Whether the linears are packed: False where the device, the dtype or the torch
            build does not allow it (logged once); the plain weights then serve.
        """
        if self._packed is None:
            reason = packing_unavailable(self.device, self.dtype)
            if reason is not None:
                logger.info("linears read plain weights: %s", reason)
                return False
            self._packed = PackedCopies(self._linears_holding(None))
        # Once packed, the copies keep their one keeper: a second one would not discard the
        # first one's rebuild in flight, which would install copies of weights since updated.
        self.repack_linears()
        return True

    def repack_linears(self, names: Iterable[str] | None = None, *, wait: bool = True) -> None:
        """Rebuilds the packed copies of the Hugging Face weights `names` from the plain weights.

        Only the linears holding one of `names` are rebuilt (a bias or a norm needs nothing:
        it is read live); None rebuilds every linear. Nothing happens while the linears are not
        packed. Any rebuild still in flight is discarded (see `cancel_repack`).

        Args:
            names: The weights that changed (None: all of them).
            wait: Build the copies on this thread and return once they are read (if building
                one fails, out of memory, those linears drop their copies and read the plain
                weights, which is slower but never stale; the failure is logged). False: the
                linears holding `names` drop their copies at once and read their plain
                weights, correct at once, while a thread rebuilds every missing copy and swaps
                the copies in together, unless `cancel_repack` came first; this returns at once.
        """
        if self._packed is None:
            return
        linears = self._linears_holding(names)
        if wait:
            self._packed.build(linears)
        else:
            self._packed.rebuild_later(linears)

    def cancel_repack(self) -> None:
        """Discards the rebuild in flight, if any: the plain weights are about to change.

        A rebuild (`repack_linears(wait=False)`) that may have read old or half-written weights
        is never installed; the linears it would have rebuilt read their plain weights until the
        next `repack_linears`.
        """
        if self._packed is not None:
            self._packed.cancel()

    def wait_for_repack(self, timeout_s: float) -> bool:
        """Waits until no rebuild runs, at most `timeout_s` seconds.

        Returns:
            Whether none runs: every copy a rebuild made is installed, or was discarded.
        """
        return self._packed is None or self._packed.wait(timeout_s)

    def release_packed_linears(self, *, timeout_s: float = 60.0) -> None:
        """Frees every packed copy; the linears read the plain weights until `repack_linears`.

        For when the plain weights go away (a level-2 sleep): their copies are stale anyway.
        Any rebuild is cancelled and waited for (it stops after the copy it is building), so
        the plain weights may be freed once this returns.

        Raises:
            EngineStateError: A rebuild still reads the plain weights after `timeout_s`
                seconds: do not free them; try again.
        """
        if self._packed is None:
            return
        self._packed.cancel()
        if not self._packed.wait(timeout_s):
            raise EngineStateError(
                f"release_packed_linears: a rebuild of the packed copies still reads the weights "
                f"after {timeout_s} s; they must not be freed yet: try again"
            )
        for linear in self._linears_holding(None):
            linear.packed = None

    def _linears_holding(self, names: Iterable[str] | None) -> list[PackedLinear]:
        """The linears whose weight holds one of the Hugging Face weights `names` (None: all)."""
        linears = {name: m for name, m in self.named_modules() if isinstance(m, PackedLinear)}
        if names is None:
            return list(linears.values())
        by_weight: dict[str, PackedLinear] = {}
        for module_name, linear in linears.items():
            prefix, _, leaf = module_name.rpartition(".")
            for part in _FUSED_PARTS.get(leaf, (leaf,)):
                by_weight[f"{prefix}.{part}.weight".lstrip(".")] = linear
        if self.config.tie_word_embeddings:
            by_weight["model.embed_tokens.weight"] = self.lm_head
        holding = {id(by_weight[n]): by_weight[n] for n in names if n in by_weight}
        return list(holding.values())

    # --- Hugging Face names -------------------------------------------------------------------

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yields every weight under its Hugging Face name, in Hugging Face's order.

        That is `named_parameters()` order of the family's Hugging Face model (`q_proj.weight`,
        `q_proj.bias`, `k_proj.weight`, ...). Fused parameters yield views of their shards, so
        writing into a yielded tensor writes the model. A tied LM head is not yielded (as in
        Hugging Face's `named_parameters()`).
        """
        config = self.config
        q_size = config.num_attention_heads * config.kv_head_dim
        kv_size = config.num_key_value_heads * config.kv_head_dim
        # Fused module -> its Hugging Face parts' rows.
        fused_rows = {
            "qkv_proj": [q_size, kv_size, kv_size],
            "gate_up_proj": [config.intermediate_size] * 2,
        }
        for name, param in self.named_parameters():
            module_name, _, leaf = name.rpartition(".")
            prefix, _, fused = module_name.rpartition(".")
            if fused not in fused_rows:
                yield name, param.data
                continue
            if leaf != "weight":
                continue  # a fused bias went out with its weight, part by part
            parts, sizes = _FUSED_PARTS[fused], fused_rows[fused]
            module = self.get_submodule(module_name)
            # Each part's weight, then its bias, as the unfused modules list them.
            leaves = [
                (leaf_name, torch.split(tensor.data, sizes, dim=0))
                for leaf_name, tensor in module.named_parameters(recurse=False)
            ]
            for index, part in enumerate(parts):
                for leaf_name, shards in leaves:
                    yield f"{prefix}.{part}.{leaf_name}", shards[index]

    def weight_specs(self) -> dict[str, TensorSpec]:
        """Name, dtype and shape of every weight, by Hugging Face name: what an update must match."""
        return {name: TensorSpec.of(name, t) for name, t in self.named_weights()}

    def unfused_parameters(self) -> dict[str, torch.Tensor]:
        """The weights that are whole parameters under their Hugging Face names (not shards).

        A transfer backend may receive straight into these; shards go through `load_weights`.
        """
        return {
            name: param.data
            for name, param in self.named_parameters()
            if name.split(".")[-2] not in _FUSED_PARTS
        }

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """Copies `(Hugging Face name, tensor)` pairs into the model, in place.

        The tensors may be views of a reused buffer: their data is copied before this returns.
        Values are cast to the model's dtype.

        Returns:
            The names loaded, in order.

        Raises:
            WeightValidationError: An unknown name or a shape mismatch; pairs before it were
                already loaded.
        """
        shards = dict(self.named_weights())  # rebuilt per call: `.data` may have been replaced
        loaded = []
        for name, tensor in weights:
            target = shards.get(name)
            if target is None:
                raise WeightValidationError(
                    f"load_weights: unknown weight {name!r}; expected a Hugging Face name of "
                    "this model such as 'model.layers.0.self_attn.q_proj.weight'"
                )
            if tuple(target.shape) != tuple(tensor.shape):
                raise WeightValidationError(
                    f"load_weights: {name!r} has shape {list(tensor.shape)} but the model's is "
                    f"{list(target.shape)}"
                )
            target.copy_(tensor)
            loaded.append(name)
        return loaded
