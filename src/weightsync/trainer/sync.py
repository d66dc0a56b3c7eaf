"""`sync_weights`: the trainer's update flow, pause -> send -> resume, on every engine at once.

With `mode="keep"` (the default) requests in flight freeze at a step boundary, take the new
weights, and continue: the tokens they generate afterwards carry the new weight version. With
`clear_cache=True` (the default) their KV is recomputed with the new weights on resume, so each
token comes from exactly one version of the weights.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence

import torch

from weightsync.engine.errors import TornWeightsError
from weightsync.engine.outputs import WeightVersion
from weightsync.engine.pause import PauseMode
from weightsync.trainer.client import EngineClient, call_each
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
        EngineBusyError: An engine could not pause in a way that stops its requests (a `wait`
            pause still draining); nothing moved.
        WeightSyncError: An engine failed to pause (unreachable, say); nothing moved, and every
            engine is resumed.
        WeightValidationError: An engine rejected the update; nothing moved. Every engine is
            resumed on its unchanged weights and version, as before the call.
        WeightTransferError: The transfer failed after bytes moved; every engine whose weights
            are whole (untouched, or restored by staging) is resumed, and an engine with torn
            weights stays paused until an update covering them lands.

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
    try:  # an engine that fails to pause must not leave the others paused for nothing
        call_each(sender.engines, lambda e: e.pause_generation(mode=mode, clear_cache=clear_cache))
        paused = time.perf_counter()
        stats = sender.send(weights, weight_version=weight_version)
    except BaseException:
        _resume_whole(sender.engines)
        raise
    sent = time.perf_counter()
    call_each(sender.engines, lambda e: e.resume_generation())
    logger.info(
        "synced %d engines to version %r: pause %.1f ms, %.1f MB in %.1f ms, resume %.1f ms",
        len(sender.engines), weight_version, (paused - start) * 1e3, stats.num_bytes / 1e6,
        (sent - paused) * 1e3, (time.perf_counter() - sent) * 1e3,
    )  # fmt: skip
    return stats


def _resume_whole(engines: Sequence[EngineClient]) -> None:
    """Resumes every engine whose weights are whole after a failed update; never raises."""
    for index, engine in enumerate(engines):
        try:
            engine.resume_generation()
        except TornWeightsError:
            logger.error("engine %d keeps torn weights and stays paused", index)
        except Exception:
            logger.exception("engine %d could not resume after the failed update", index)
