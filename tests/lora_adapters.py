"""Helpers of the LoRA tests: PEFT adapter directories written from random A and B, and the
model whose weights are merged with an adapter (W + scaling * B @ A), the reference."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from weightsync.engine.model import LlamaForCausalLM
from weightsync.transfer._safetensors import write_safetensors

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def module_sizes(model: LlamaForCausalLM) -> dict[str, tuple[int, int]]:
    """Hugging Face module -> (in_features, out_features) for `model`."""
    weights = dict(model.named_weights())
    sizes = {}
    for module in MODULES:
        parent = "self_attn" if module in _ATTENTION else "mlp"
        out_features, in_features = weights[f"model.layers.0.{parent}.{module}.weight"].shape
        sizes[module] = (in_features, out_features)
    return sizes


def peft_name(layer: int, module: str, kind: str) -> str:
    parent = "self_attn" if module in _ATTENTION else "mlp"
    return f"base_model.model.model.layers.{layer}.{parent}.{module}.lora_{kind}.weight"


def adapter_tensors(
    model: LlamaForCausalLM, *, rank: int = 4, seed: int = 1, modules: Iterable[str] = MODULES
) -> dict[str, torch.Tensor]:
    """Random PEFT tensors for every layer's `modules`, in float32 as PEFT saves them."""
    generator = torch.Generator().manual_seed(seed)
    sizes = module_sizes(model)
    tensors = {}
    for layer in range(model.config.num_hidden_layers):
        for module in modules:
            in_features, out_features = sizes[module]
            a = torch.randn(rank, in_features, generator=generator) / math.sqrt(in_features)
            b = torch.randn(out_features, rank, generator=generator) / math.sqrt(rank)
            tensors[peft_name(layer, module, "A")] = a
            tensors[peft_name(layer, module, "B")] = b
    return tensors


def peft_config(rank: int = 4, alpha: float = 8, **options: Any) -> dict[str, Any]:
    return {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": list(MODULES),
        "bias": "none",
        "base_model_name_or_path": "debug",
        **options,
    }


def write_adapter(
    directory: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any]
) -> Path:
    """Writes a PEFT adapter directory; returns it."""
    directory.mkdir(parents=True, exist_ok=True)
    write_safetensors(tensors, directory / "adapter_model.safetensors")
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory


def merged_model(
    model: LlamaForCausalLM, tensors: dict[str, torch.Tensor], scaling: float
) -> LlamaForCausalLM:
    """A copy of `model` whose weights are W + scaling * B @ A for each adapted module."""
    merged = LlamaForCausalLM(model.config, dtype=model.dtype)
    merged.load_weights(model.named_weights())
    weights = dict(merged.named_weights())
    for name, a in tensors.items():
        if ".lora_A." in name:
            b = tensors[name.replace(".lora_A.", ".lora_B.")]
            target = name.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
            delta = scaling * (b.to(torch.float64) @ a.to(torch.float64))
            weights[target].add_(delta.to(merged.dtype))
    return merged
