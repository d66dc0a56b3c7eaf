"""`EngineConfig`: the scheduling and KV-cache limits of one engine, validated on creation."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from weightsync.errors import EngineConfigError
from weightsync.transfer.base import _is_int

__all__ = ["EngineConfig"]


@dataclass
class EngineConfig:
    """Limits of the scheduler and the KV cache.

    Attributes:
        max_num_seqs: Most requests running (holding KV blocks) at once.
        max_num_batched_tokens: Token budget of one step: decode tokens plus prefill tokens. A
            prompt longer than what is left is prefilled in chunks over several steps.
        block_size: Tokens per KV-cache block.
        num_kv_blocks: Blocks in the KV cache; the cache holds `num_kv_blocks * block_size`
            tokens over all running requests. When it runs out, the most recently admitted
            request is preempted and later recomputed from its tokens.
        enable_prefix_caching: Share and reuse the blocks of identical prompt prefixes.
        max_model_len: Longest sequence (prompt + output) in tokens; defaults to the model's
            `max_position_embeddings`.
        seed: Seeds the sampling of requests that set no seed of their own.
        weight_update_staging: Before a weight update touches a weight, keep a copy of it, so
            that a failed or aborted update restores the previous weights and version instead
            of leaving them torn. Costs one copy of the updated weights in memory, kept between
            updates, and one copy per update (`python benchmarks/bench_transfer.py --staging`).
        refuse_non_finite_weights: `finish_weight_update` checks every weight the update wrote
            and refuses one holding a NaN or an infinity with `NonFiniteWeightsError`, before
            the version moves. The version stays; with `weight_update_staging` the previous
            weights are restored, else the written weights are torn (never generated from)
            until a finite update lands. Costs one pass over the updated weights per update;
            off by default.
        prepack_linears: Multiply by prepacked copies of the linears' weights (oneDNN's
            layout, `LlamaForCausalLM.pack_linears`) where that is measured to be faster: float32
            on a CPU; elsewhere, or where the torch build lacks the ops, the plain weights
            serve. Costs a second copy of the weight matrices in memory. A weight update does
            not wait for its repack: at commit the updated linears drop their copies and
            multiply by their new plain weights (correct at once, at the plain weights' speed)
            until a thread has rebuilt the copies, about 0.06 s for the `small` preset.
        enable_lora: Serve LoRA adapters (`LLMEngine.load_lora_adapter`, a request's
            `lora_name`). Off: no adapter loads and the forward pass is the base model's alone.
        max_loras: Most distinct LoRA adapters (versions count apart) among the running
            requests, vLLM's `max_loras`: a request whose adapter would exceed it waits.
        max_lora_rank: Largest adapter rank `r` accepted (vLLM's `max_lora_rank`).
        max_lora_versions: Most versions of one LoRA adapter kept at once, the current one
            and those requests still run with, when a live update of the adapter
            (`start_weight_update(lora_name=...)`) commits a new one. Beyond it the oldest are
            dropped, and their requests end as an abort ends them. The default, 4, lets a
            rollout finish on the version it started with while three newer ones land.
        device: Where the model, the KV cache and sampling live: `"cpu"`, `"cuda"`,
            `"cuda:1"`, any `torch.device` string. Weight updates land straight in that
            device's memory (the transfer backend receives into the model's parameters).

    Raises:
        EngineConfigError: A value is out of range; the message names the field.

    >>> EngineConfig(max_num_seqs=8).max_num_batched_tokens
    2048
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    num_kv_blocks: int = 1024
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    seed: int = 0
    weight_update_staging: bool = False
    refuse_non_finite_weights: bool = False
    prepack_linears: bool = True
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_lora_versions: int = 4
    device: str = "cpu"

    def __post_init__(self) -> None:
        for name in (
            "max_num_seqs", "max_num_batched_tokens", "block_size", "num_kv_blocks", "max_loras",
            "max_lora_rank", "max_lora_versions",
        ):  # fmt: skip
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise EngineConfigError(f"EngineConfig.{name} must be an int >= 1, got {value!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise EngineConfigError(
                f"EngineConfig.max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs}) so that every running request can decode "
                "each step; raise the budget or lower max_num_seqs"
            )
        if self.max_model_len is not None and (
            not isinstance(self.max_model_len, int) or self.max_model_len < 2
        ):
            raise EngineConfigError(
                f"EngineConfig.max_model_len must be an int >= 2 or None, got {self.max_model_len!r}"
            )
        if not _is_int(self.seed):
            raise EngineConfigError(f"EngineConfig.seed must be an int, got {self.seed!r}")
        for name in (
            "weight_update_staging", "refuse_non_finite_weights", "prepack_linears", "enable_lora",
        ):  # fmt: skip
            if not isinstance(getattr(self, name), bool):
                raise EngineConfigError(
                    f"EngineConfig.{name} must be a bool, got {getattr(self, name)!r}"
                )
        try:
            if not isinstance(self.device, str | torch.device):
                raise TypeError(type(self.device).__name__)
            self.device = str(torch.device(self.device))  # a torch.device is taken as its name
        except (RuntimeError, TypeError) as exc:
            raise EngineConfigError(
                f"EngineConfig.device must name a torch device such as 'cpu' or 'cuda:0', "
                f"got {self.device!r}"
            ) from exc

    def resolve_device(self) -> torch.device:
        """Returns `device` as a `torch.device`, checked against this machine.

        Raises:
            EngineConfigError: A device type other than CPU and CUDA, a CUDA device on a machine
                without CUDA, or a device index that does not exist.

        >>> EngineConfig().resolve_device()
        device(type='cpu')
        """
        device = torch.device(self.device)
        if device.type not in ("cpu", "cuda"):
            raise EngineConfigError(
                f"EngineConfig.device is {self.device!r}, but the engine computes on 'cpu' or "
                "'cuda' devices only: pick one of those"
            )
        if device.type == "cuda":
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if count == 0:
                raise EngineConfigError(
                    f"EngineConfig.device is {self.device!r} but torch sees no CUDA device here: "
                    "use device='cpu', or install a CUDA build of torch on a machine with a GPU"
                )
            if device.index is not None and device.index >= count:
                raise EngineConfigError(
                    f"EngineConfig.device is {self.device!r} but this machine has {count} CUDA "
                    f"device(s), cuda:0 to cuda:{count - 1}"
                )
        return device

    def resolve_max_model_len(self, max_position_embeddings: int) -> int:
        """Returns the longest sequence for a model with `max_position_embeddings` positions.

        Raises:
            EngineConfigError: `max_model_len` exceeds the model's positions, or the KV cache
                cannot hold one sequence of that length.
        """
        max_model_len = self.max_model_len or max_position_embeddings
        if max_model_len > max_position_embeddings:
            raise EngineConfigError(
                f"EngineConfig.max_model_len ({max_model_len}) exceeds the model's "
                f"max_position_embeddings ({max_position_embeddings})"
            )
        capacity = self.num_kv_blocks * self.block_size
        if capacity < max_model_len:
            raise EngineConfigError(
                f"the KV cache holds {capacity} tokens (num_kv_blocks x block_size) but one "
                f"sequence may reach max_model_len={max_model_len}: raise num_kv_blocks or lower "
                "max_model_len"
            )
        return max_model_len


def _check_optional(name: str, value: object, cls: type) -> None:
    """Refuses `value` unless it is None or a `cls` (a dict where a config belongs, say).

    Raises:
        EngineConfigError: Naming `name`, the class expected and the one given.
    """
    if value is not None and not isinstance(value, cls):
        raise EngineConfigError(
            f"LLMEngine: {name} must be None or an instance of {cls.__name__}, got "
            f"{type(value).__name__}: build one, e.g. {cls.__name__}(**settings)"
        )
