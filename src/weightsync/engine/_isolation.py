"""A step in which one request fails: that request ends with `finish_reason="error"`, alone.

A batch runs through the model and the sampler as one. When that raises (NaN logits of one
request, a sampler that refuses its probabilities, any error one request's data provokes), the
step runs each sequence of the batch on its own: the ones that succeed get their token as they
would have in the batch (a sequence's KV, logits and draw do not depend on its neighbours, and
the KV the failed run may have written is rewritten with the same values), and each one that
fails again ends with `finish_reason="error"`. A failure that is no one request's fault (every
sequence fails alone) ends them all, each with its own error logged.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from weightsync.engine._model_runner import ModelRunner
    from weightsync.engine._processing import OutputProcessor
    from weightsync.engine._scheduler import ScheduledSequence
    from weightsync.engine._sequence import Sequence
    from weightsync.engine.outputs import WeightVersion

logger = logging.getLogger(__name__)


def run_batch(
    runner: ModelRunner,
    output_processor: OutputProcessor,
    batch: list[ScheduledSequence],
    weight_version: WeightVersion,
) -> list[Sequence]:
    """Runs one step's batch and applies its tokens; a request that fails ends alone.

    Returns:
        The sequences the step changed (a new token, or an end), in batch order.
    """
    try:
        tokens, logprobs = runner.execute(batch)
    except Exception as exc:  # one request's data, most likely: find which
        logger.warning(
            "a step of %d requests failed (%s: %s); running each on its own",
            len(batch), type(exc).__name__, exc,
        )  # fmt: skip
        return [
            seq
            for item in batch
            for seq in _run_alone(runner, output_processor, item, weight_version)
        ]
    return output_processor.process(batch, tokens, weight_version, logprobs)


def _run_alone(
    runner: ModelRunner,
    output_processor: OutputProcessor,
    item: ScheduledSequence,
    weight_version: WeightVersion,
) -> list[Sequence]:
    try:
        tokens, logprobs = runner.execute([item])
    except Exception as exc:
        item.seq.fail(exc)
        return [item.seq]
    return output_processor.process([item], tokens, weight_version, logprobs)
