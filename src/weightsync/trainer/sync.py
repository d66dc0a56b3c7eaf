"""`sync_weights`: the trainer's update flow, pause -> send -> resume, on every engine at once.

With `mode="keep"` (the default) requests in flight freeze at a step boundary, take the new
weights, and continue: the tokens they generate afterwards carry the new weight version. With
`clear_cache=True` (the default) their KV is recomputed with the new weights on resume, so each
token comes from exactly one version of the weights.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import torch

from weightsync.engine.outputs import WeightVersion
from weightsync.engine.scheduler import PauseMode
from weightsync.trainer.client import call_each
from weightsync.trainer.senders import WeightSender
from weightsync.transfer.base import TransferStats

__all__ = ["sync_weights"]

logger = logging.getLogger(__name__)


def sync_weights(
    sender: WeightSender,
    weights: Iterable[tuple[str, torch.Tensor]],
    *,
    weight_version: WeightVersion | None = None,
    mode: PauseMode = "keep",
    clear_cache: bool = True,
) -> TransferStats:
    """Pauses the sender's engines, pushes `weights` into them, and resumes them.

    Every engine pauses (all at once, and all at a step boundary) before any byte moves, and
    resumes only after every engine holds the complete update.

    Args:
        sender: A connected sender; its engines are the ones paused and updated.
        weights: `(name, tensor)` pairs, e.g. `model.named_parameters()`.
        weight_version: The label of the new weights (the trainer's step); None counts updates.
        mode: Pause mode: `keep` (requests continue with the new weights), `wait` (they finish
            with the old ones first) or `abort` (they end now).
        clear_cache: Drop the KV cache at the pause, so kept requests recompute it with the new
            weights (False: they continue on KV of the old weights; faster, slightly stale).

    Returns:
        The trainer side's transfer stats.

    Raises:
        WeightValidationError: An engine rejected the update; nothing moved. The engines stay
            paused: resume them (their weights are unchanged) or send a matching update.
        WeightTransferError: The transfer failed; the engines stay paused, and an engine with
            torn weights refuses to resume until a complete update lands.

    >>> from weightsync.engine.llm_engine import LLMEngine
    >>> from weightsync.engine.model import LlamaForCausalLM
    >>> from weightsync.trainer.senders import IPCWeightSender
    >>> engine = LLMEngine("debug", seed=0)
    >>> policy = LlamaForCausalLM.from_preset("debug", seed=1)
    >>> with IPCWeightSender([engine]) as sender:
    ...     stats = sync_weights(sender, policy.named_weights(), weight_version="step-1")
    >>> engine.weight_version
    'step-1'
    """
    start = time.perf_counter()
    call_each(sender.engines, lambda e: e.pause_generation(mode=mode, clear_cache=clear_cache))
    paused = time.perf_counter()
    stats = sender.send(weights, weight_version=weight_version)
    sent = time.perf_counter()
    call_each(sender.engines, lambda e: e.resume_generation())
    logger.info(
        "synced %d engines to version %r: pause %.1f ms, %.1f MB in %.1f ms, resume %.1f ms",
        len(sender.engines), weight_version, (paused - start) * 1e3, stats.num_bytes / 1e6,
        (sent - paused) * 1e3, (time.perf_counter() - sent) * 1e3,
    )  # fmt: skip
    return stats
