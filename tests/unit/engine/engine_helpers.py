"""Helpers of the engine tests: a no-cache reference decoder, stream collectors, and an
in-process transfer backend that can fail on purpose."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping
from typing import Any

import torch

from weightsync.config import WeightTransferConfig
from weightsync.engine._sequence import Sequence
from weightsync.engine.async_engine import AsyncEngine
from weightsync.engine.config import EngineConfig
from weightsync.engine.llm_engine import LLMEngine
from weightsync.engine.model import LlamaForCausalLM
from weightsync.engine.outputs import RequestOutput
from weightsync.engine.pause import PauseState
from weightsync.engine.sampling import SamplingParams
from weightsync.errors import WeightTransferError
from weightsync.transfer.base import (
    TransferStats,
    WeightTransferEngine,
    WeightTransferUpdateInfo,
    register_engine,
)

# Engine behaviour tests run in float64: greedy decoding then compares token for token with a
# margin far above any kernel's rounding, on every machine. test_model checks float32 numerics.
DTYPE = torch.float64


def debug_model(seed: int = 0) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_preset("debug", seed=seed, dtype=DTYPE)


PROMPTS = [
    "The quick brown fox",
    "Hello, world",
    "weights move from the trainer",
    "pause, update, resume",
    "a",
    "Once upon a time in a land far away",
    "1 2 3 4 5",
    "continuous batching",
    "ünïcödé ✓",
    "The quick brown dog",
    "KV cache blocks",
    "x" * 40,
    "grouped-query attention",
    "RMSNorm then SwiGLU",
    "the end",
    "seventeen",
    "eighteen prompts",
    "nineteen",
]


def greedy(max_tokens: int, **kwargs: Any) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


@torch.inference_mode()
def reference_greedy(model: LlamaForCausalLM, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """The plainest decode loop: the whole sequence through the model every step, no KV cache."""
    ids = list(prompt_ids)
    for _ in range(max_tokens):
        hidden = model(torch.tensor(ids))
        ids.append(int(model.compute_logits(hidden[-1:]).argmax()))
    return ids[len(prompt_ids) :]


def small_config(**overrides: Any) -> EngineConfig:
    return EngineConfig(**{"num_kv_blocks": 256, "block_size": 8, **overrides})


def model_with(weights: Mapping[str, torch.Tensor]) -> LlamaForCausalLM:
    model = debug_model()
    model.load_weights(weights.items())
    return model


# --- an in-process transfer backend -----------------------------------------------------------


class LocalSource:
    """What the local backend 'receives': tensors by name, and an optional failure point."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.tensors: dict[str, torch.Tensor] = {}
        self.fail_after: int | None = None
        self.gate: threading.Event | None = None  # when set, receiving waits for it to open
        self.at_gate = threading.Event()  # set once receiving waits at the gate
        self.init_request = {"init_info": {"source": key}}

    def update_info(self, weight_version: str | int | None = None) -> dict[str, Any]:
        info = WeightTransferUpdateInfo.from_named_tensors(
            self.tensors.items(), weight_version=weight_version
        )
        return {"update_info": info.to_dict()}


SOURCES: dict[str, LocalSource] = {}


class LocalTransferEngine(WeightTransferEngine):
    """Copies tensors from a `LocalSource`; fails after `fail_after` tensors when asked."""

    def __init__(self, *, worker_index: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.source: LocalSource | None = None

    @property
    def is_initialized(self) -> bool:
        return self.source is not None

    def init_transfer_engine(self, init_info: Any) -> None:
        self.source = SOURCES[init_info["source"]]

    def receive_weights(self, update_info: Any, load_weights: Any) -> TransferStats:
        assert self.source is not None
        specs = self.check_update(self.parse_update_info(update_info))
        if self.source.gate is not None:
            self.source.at_gate.set()
            assert self.source.gate.wait(timeout=30), "the test never opened the gate"
        for index, spec in enumerate(specs):
            if self.source.fail_after is not None and index == self.source.fail_after:
                raise WeightTransferError("peer died (simulated)", partially_applied=index > 0)
            load_weights([(spec.name, self.source.tensors[spec.name])])
        return TransferStats(num_tensors=len(specs))

    def shutdown(self) -> None:
        self.source = None


register_engine("test-local", LocalTransferEngine, replace=True)


def make_engine(model: LlamaForCausalLM | None = None, **config: Any) -> LLMEngine:
    model = model if model is not None else debug_model()
    return LLMEngine(
        model,
        engine_config=small_config(**config),
        weight_transfer_config=WeightTransferConfig(backend="test-local"),
    )


def make_async_engine(**config: Any) -> AsyncEngine:
    return AsyncEngine.from_engine(make_engine(**config))


# --- streams ----------------------------------------------------------------------------------


class Stream:
    """Consumes one `generate` stream in a task, keeping every output it yields."""

    def __init__(self, engine: AsyncEngine, prompt: str, params: SamplingParams) -> None:
        self.prompt = prompt
        self.outputs: list[RequestOutput] = []
        self._changed = asyncio.Event()
        self.task = asyncio.create_task(self._consume(engine, params))

    async def _consume(self, engine: AsyncEngine, params: SamplingParams) -> None:
        async for output in engine.generate(self.prompt, params):
            self.outputs.append(output)
            self._changed.set()

    @property
    def request_id(self) -> str:
        return self.outputs[-1].request_id

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[-1].outputs[0].token_ids if self.outputs else []

    async def wait_tokens(self, count: int) -> None:
        while len(self.token_ids) < count and not self.task.done():
            self._changed.clear()
            await self._changed.wait()

    async def final(self) -> RequestOutput:
        await self.task
        return self.outputs[-1]

    def check_consistent(self) -> None:
        """Each output extends the previous one; exactly the last one is finished."""
        for before, after in zip(self.outputs[:-1], self.outputs[1:], strict=True):
            n = len(before.outputs[0].token_ids)
            assert after.outputs[0].token_ids[:n] == before.outputs[0].token_ids
            assert not before.finished
        assert self.outputs[-1].finished


def start_streams(engine: AsyncEngine, count: int, max_tokens: int) -> list[Stream]:
    return [
        Stream(engine, PROMPTS[i % len(PROMPTS)] + f" #{i}", greedy(max_tokens))
        for i in range(count)
    ]


def make_sequence(token_ids: list[int], request_id: str = "r", max_tokens: int = 16) -> Sequence:
    from weightsync.engine.tokenizer import ByteTokenizer

    return Sequence(
        request_id,
        token_ids,
        greedy(max_tokens),
        generator=torch.Generator(),
        decoder=ByteTokenizer().incremental_decoder(),
    )


async def catch_up(engine: AsyncEngine, streams: list[Stream]) -> list[int]:
    """Waits until each stream has consumed every token its request holds; returns the counts."""
    scheduler = engine.engine.scheduler
    counts = {s.request_id: s.num_output_tokens for s in (*scheduler.running, *scheduler.waiting)}
    for stream in streams:
        await stream.wait_tokens(counts.get(stream.request_id, 0))
    return [len(s.token_ids) for s in streams]


async def start_draining(engine, pause=None):
    """Starts `pause_generation(mode="wait")` (or the coroutine `pause`) in a task; returns it
    once the pause has begun.

    The pause begins after the step in flight, when it takes the engine's lock: observed here by
    wrapping `LLMEngine.start_pause`, which it calls (on the event loop) at that moment.
    """
    begun = asyncio.Event()
    start_pause = engine.engine.start_pause

    def observed(**kwargs):
        start_pause(**kwargs)
        begun.set()

    engine.engine.start_pause = observed
    pause = asyncio.create_task(pause or engine.pause_generation(mode="wait"))
    await asyncio.wait_for(begun.wait(), timeout=30)
    engine.engine.start_pause = start_pause
    assert engine.engine.pause_state is PauseState.DRAINING
    return pause
