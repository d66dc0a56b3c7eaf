"""What a server says about itself in vLLM's shapes: `/server_info`'s config tree, model cards.

vLLM's `GET /server_info?config_format=json` dumps its resolved `VllmConfig`; RL clients read a
few keys of it before they sync (TRL: `model_config.dtype`, `weight_transfer_config`,
`parallel_config.data_parallel_size`, `lora_config`). weightsync answers the same tree, with the
sections and keys that mean something here, at the same paths. `/v1/models` lists vLLM's model
card (`root`, `parent`, `max_model_len`, `permission`).
"""

from __future__ import annotations

import dataclasses
import platform
import uuid
from typing import Any

import torch

import weightsync
from weightsync.engine.async_engine import AsyncEngine
from weightsync.engine.lora import LoRAAdapter
from weightsync.serve.config import ServerConfig


def vllm_config(engine: AsyncEngine, config: ServerConfig) -> dict[str, Any]:
    """The `vllm_config` tree of one engine, as vLLM's `config_format=json` writes it.

    A dtype is written as vLLM writes a `torch.dtype` (`"torch.float32"`); `lora_config` is
    null unless LoRA is enabled, as vLLM's is.
    """
    llm = engine.engine
    engine_config = llm.config
    dtype = next(llm.model.parameters()).dtype
    transfer = llm.weights.transfer_config
    model = config.model_path or config.model_name
    return {
        "model_config": {
            "model": model,
            "tokenizer": model,
            "served_model_name": config.model_name,
            "dtype": str(dtype),
            "max_model_len": llm.max_model_len,
            "seed": engine_config.seed,
            "max_logprobs": 20,
            "vocab_size": llm.model.config.vocab_size,
        },
        "cache_config": {
            "block_size": engine_config.block_size,
            "num_gpu_blocks": engine_config.num_kv_blocks,
            "enable_prefix_caching": engine_config.enable_prefix_caching,
        },
        "parallel_config": {
            "tensor_parallel_size": 1,
            "pipeline_parallel_size": 1,
            "data_parallel_size": config.world_size,
            "world_size": 1,
        },
        "scheduler_config": {
            "max_num_seqs": engine_config.max_num_seqs,
            "max_num_batched_tokens": engine_config.max_num_batched_tokens,
            "max_model_len": llm.max_model_len,
        },
        "device_config": {"device": str(llm.device)},
        "lora_config": {
            "max_lora_rank": engine_config.max_lora_rank,
            "max_loras": engine_config.max_loras,
        }
        if engine_config.enable_lora
        else None,
        "weight_transfer_config": dataclasses.asdict(transfer) if transfer is not None else None,
    }


def server_info(tree: dict[str, Any], config_format: str) -> dict[str, Any]:
    """`/server_info`'s body: the config tree (or its text), vLLM's env sections, weightsync's."""
    return {
        "vllm_config": tree if config_format == "json" else _as_text(tree),
        "vllm_env": {},
        "system_env": {
            "python_version": platform.python_version(),
            "torch_version": torch.__version__,
            "os": platform.system(),
        },
        "weightsync_version": weightsync.__version__,
    }


def _as_text(tree: dict[str, Any]) -> str:
    """The tree as `config_format=text` gives it: one line of `section=value` pairs."""
    return ", ".join(f"{key}={value!r}" for key, value in tree.items())


def model_card(config: ServerConfig, max_model_len: int) -> dict[str, Any]:
    """The model card of the model served, as vLLM's `ModelCard` (`created`: 0, no date)."""
    return _card(config.model_name, config.model_path or config.model_name, None, max_model_len)


def lora_card(config: ServerConfig, adapter: LoRAAdapter) -> dict[str, Any]:
    """An adapter's card, as vLLM lists one: `root` its path, `parent` the served model."""
    return _card(adapter.name, adapter.path, config.model_name, None)


def _card(
    model_id: str, root: str | None, parent: str | None, max_model_len: int | None
) -> dict[str, Any]:
    return {
        "id": model_id,
        "object": "model",
        "created": 0,
        "owned_by": "weightsync",
        "root": root,
        "parent": parent,
        "max_model_len": max_model_len,
        "permission": [
            {
                "id": f"modelperm-{uuid.uuid4().hex}",
                "object": "model_permission",
                "created": 0,
                "allow_create_engine": False,
                "allow_sampling": True,
                "allow_logprobs": True,
                "allow_search_indices": False,
                "allow_view": True,
                "allow_fine_tuning": False,
                "organization": "*",
                "group": None,
                "is_blocking": False,
            }
        ],
    }
