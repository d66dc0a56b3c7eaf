"""The model-like tensor set every transfer benchmark moves: a Llama-shaped bf16 checkpoint."""

from __future__ import annotations

import torch

from weightsync.transfer.base import TensorSpec

NUM_LAYERS = 32
VOCAB_SIZE = 32000


def llama_like_specs(total_bytes: int, *, dtype: torch.dtype = torch.bfloat16) -> list[TensorSpec]:
    """About `total_bytes` of Llama-shaped tensors (32 layers: q/k/v/o, gate/up/down, 2 norms).

    The hidden size is the largest multiple of 64 that keeps the total at or under `total_bytes`
    (at least 64); 32 layers give 291 tensors.
    """

    def specs_for(hidden: int) -> list[TensorSpec]:
        kv = hidden // 4
        inter = max(64, round(hidden * 2.6875 / 64) * 64)
        specs = [TensorSpec("model.embed_tokens.weight", dtype, (VOCAB_SIZE, hidden))]
        for i in range(NUM_LAYERS):
            p = f"model.layers.{i}."
            specs += [
                TensorSpec(p + "input_layernorm.weight", dtype, (hidden,)),
                TensorSpec(p + "self_attn.q_proj.weight", dtype, (hidden, hidden)),
                TensorSpec(p + "self_attn.k_proj.weight", dtype, (kv, hidden)),
                TensorSpec(p + "self_attn.v_proj.weight", dtype, (kv, hidden)),
                TensorSpec(p + "self_attn.o_proj.weight", dtype, (hidden, hidden)),
                TensorSpec(p + "post_attention_layernorm.weight", dtype, (hidden,)),
                TensorSpec(p + "mlp.gate_proj.weight", dtype, (inter, hidden)),
                TensorSpec(p + "mlp.up_proj.weight", dtype, (inter, hidden)),
                TensorSpec(p + "mlp.down_proj.weight", dtype, (hidden, inter)),
            ]
        specs += [
            TensorSpec("model.norm.weight", dtype, (hidden,)),
            TensorSpec("lm_head.weight", dtype, (VOCAB_SIZE, hidden)),
        ]
        return specs

    hidden = 64
    while sum(s.nbytes for s in specs_for(hidden + 64)) <= total_bytes:
        hidden += 64
    return specs_for(hidden)
