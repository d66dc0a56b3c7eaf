"""Control plane: a tiny continuous-batching inference engine that takes live weight updates.

A request flows
[`LLMEngine.add_request`][weightsync.engine.llm_engine.LLMEngine.add_request] ->
`Scheduler.schedule` (continuous batching under a
token budget, KV blocks from the `BlockManager`) ->
`ModelRunner.execute` (one forward pass over
every scheduled token, then sampling) -> `OutputProcessor`
(stop checks, per-token weight versions) -> [`RequestOutput`][weightsync.engine.outputs.RequestOutput].
[`AsyncEngine`][weightsync.engine.async_engine.AsyncEngine] drives the same loop from asyncio and
streams outputs, while `pause_generation`, `resume_generation` and `update_weights` stay responsive
between steps.
"""

from weightsync.engine.async_engine import AsyncEngine
from weightsync.engine.config import EngineConfig
from weightsync.engine.llm_engine import LLMEngine
from weightsync.engine.model import LlamaForCausalLM
from weightsync.engine.model_config import LlamaConfig
from weightsync.engine.outputs import CompletionOutput, RequestOutput, WeightVersionSpan
from weightsync.engine.sampling import SamplingParams
from weightsync.engine.tokenizer import ByteTokenizer

__all__ = [
    "AsyncEngine",
    "ByteTokenizer",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "LlamaConfig",
    "LlamaForCausalLM",
    "RequestOutput",
    "SamplingParams",
    "WeightVersionSpan",
]
