"""Adapter-only live sync on CUDA: a LoRA adapter pushed over NCCL and by CUDA IPC into an engine
on a GPU answers as the same adapter loaded from a directory there; a running request keeps its
version."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import pytest
import torch

from ipc_rigs import IPCTrainerProcess
from lora_adapters import adapter_tensors, peft_config, write_adapter
from process_rigs import TrainerProcess, fill_tensors
from weightsync.config import WeightTransferConfig
from weightsync.engine.config import EngineConfig
from weightsync.engine.llm_engine import LLMEngine
from weightsync.engine.sampling import SamplingParams
from weightsync.transfer.base import TensorSpec, WeightTransferUpdateInfo

pytestmark = pytest.mark.gpu

NEEDS_TWO = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
# The engine on cuda:0; an NCCL trainer needs a GPU of its own (cuda:1), CUDA IPC shares cuda:0.
BACKENDS = [pytest.param("nccl", marks=NEEDS_TWO), "ipc"]
ENGINE_DEVICE = "cuda:0"
CONFIG = peft_config()
PROMPT = "an adapter moves, the model stays"
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def lora_engine(backend: str | None = None, device: str = ENGINE_DEVICE) -> LLMEngine:
    # float64: a step's batch changes which kernels run; no rounding of theirs flips an argmax.
    config = EngineConfig(
        num_kv_blocks=128, block_size=8, enable_lora=True, max_lora_rank=8, device=device
    )
    transfer = WeightTransferConfig(backend=backend) if backend is not None else None
    return LLMEngine(
        "debug",
        seed=0,
        dtype=torch.float64,
        engine_config=config,
        weight_transfer_config=transfer,
    )


def tokens(engine: LLMEngine, lora_name: str | None) -> list[int]:
    return engine.generate([PROMPT], GREEDY, lora_name=lora_name)[0].outputs[0].token_ids


def from_directory(directory: Path, specs: dict[str, TensorSpec], seed: int) -> LLMEngine:
    """Another engine on the same device, with what a trainer sends from `seed` loaded from disk."""
    sent = {s.name: torch.zeros(s.shape, dtype=s.dtype) for s in specs.values()}
    fill_tensors(sent, seed)  # in the order of the update info: as the trainer process fills
    reference = lora_engine()
    reference.load_lora_adapter("a", str(write_adapter(directory, sent, CONFIG)))
    return reference


class Trainer(Protocol):
    def push(self, engine: LLMEngine, seed: int) -> None: ...


class _NCCLTrainer:
    """A trainer process on cuda:1 broadcasting to the engine's rank on cuda:0."""

    def __init__(self, engine: LLMEngine, update_info: dict[str, Any]) -> None:
        self.update_info = update_info
        self.process = TrainerProcess(update_info=update_info, device="cuda:1", timeout_s=120)
        init_info = self.process.call("init", world_size=2, backend="nccl", timeout_s=60)
        self.process.start("connect")
        engine.init_weight_transfer_engine({"init_info": init_info["init_info"]})
        self.process.reply()

    def push(self, engine: LLMEngine, seed: int) -> None:
        self.process.start("send", seed=seed)
        stats = engine.update_weights({"update_info": self.update_info})
        assert self.process.reply()["stats"]["num_bytes"] == stats.num_bytes > 0


class _IPCTrainer:
    """A trainer process on the engine's GPU handing it CUDA IPC handles."""

    def __init__(self, engine: LLMEngine, update_info: dict[str, Any]) -> None:
        self.process = IPCTrainerProcess(
            update_info=update_info, device=ENGINE_DEVICE, timeout_s=120
        )
        init_info = self.process.call("init", packed=True, bucket_size_bytes=1 << 16)
        engine.init_weight_transfer_engine({"init_info": init_info["init_info"]})

    def push(self, engine: LLMEngine, seed: int) -> None:
        self.process.start("send", seed=seed)
        while "deliver" in (message := self.process.next_message()):
            engine.update_weights({"update_info": message["deliver"]})
            self.process.acknowledge()
        assert message["ok"], message


@pytest.fixture
def trainer_of() -> Iterator[Any]:
    """`trainer_of(backend, engine, specs)`: a trainer process for the adapter's tensors."""
    made: list[tuple[LLMEngine, _NCCLTrainer | _IPCTrainer]] = []

    def make(backend: str, engine: LLMEngine, specs: dict[str, TensorSpec]) -> Trainer:
        update_info = WeightTransferUpdateInfo.from_specs(specs.values()).to_dict()
        trainer_class = _NCCLTrainer if backend == "nccl" else _IPCTrainer
        made.append((engine, trainer_class(engine, update_info)))
        return made[-1][1]

    try:
        yield make
    finally:
        for engine, trainer in made:
            trainer.process.close()
            engine.shutdown()  # leaves the transfer group the trainer formed


def assert_on_the_models_device(engine: LLMEngine, name: str) -> None:
    assert engine.loras is not None
    pairs = engine.loras.get(name).weights.values()
    assert all(t.device == engine.model.device for pair in pairs for t in pair)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_adapter_pushed_to_a_gpu_answers_as_the_same_adapter_from_a_directory(
    backend, trainer_of, tmp_path
):
    engine = lora_engine(backend)
    assert engine.model.device == torch.device(ENGINE_DEVICE)
    specs = engine.weights.adapters.adapter_specs("a", CONFIG)
    trainer = trainer_of(backend, engine, specs)
    engine.start_weight_update(lora_name="a", lora_config=CONFIG)  # created by its config
    trainer.push(engine, seed=11)
    assert engine.finish_weight_update(f"{backend}-1") is True
    assert_on_the_models_device(engine, "a")
    output = engine.generate([PROMPT], GREEDY, lora_name="a")[0].outputs[0]
    reference = from_directory(tmp_path / "v1", specs, seed=11)
    assert_on_the_models_device(reference, "a")
    assert output.token_ids == tokens(reference, "a") != tokens(engine, None)
    assert output.weight_versions == [f"{backend}-1"] * MAX_TOKENS
    assert engine.weight_version == 0  # the model's weights did not move
    # Updated in place with its own shapes as the contract: the next push, the next version.
    engine.start_weight_update(lora_name="a")
    trainer.push(engine, seed=12)
    assert engine.finish_weight_update(f"{backend}-2") is True
    newer = from_directory(tmp_path / "v2", specs, seed=12)
    assert tokens(engine, "a") == tokens(newer, "a") != output.token_ids


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_running_request_keeps_its_version_while_an_adapter_is_pushed_to_a_gpu(
    backend, trainer_of, tmp_path
):
    engine = lora_engine(backend)
    first = adapter_tensors(engine.model, seed=23)
    engine.load_lora_adapter("a", str(write_adapter(tmp_path / "v1", first, CONFIG)))
    assert_on_the_models_device(engine, "a")
    old_answer = tokens(engine, "a")
    specs = engine.weights.adapters.adapter_specs("a", CONFIG)  # the loaded one's shapes
    trainer = trainer_of(backend, engine, specs)
    engine.add_request("running", PROMPT, GREEDY, lora_name="a")
    outputs = []
    while not outputs or len(outputs[-1].outputs[0].token_ids) < 3:  # mid-generation
        outputs += engine.step()
    engine.start_weight_update(lora_name="a")  # the engine runs a request and is not paused
    trainer.push(engine, seed=24)
    assert engine.finish_weight_update("v2") is True
    assert not engine.is_paused()
    engine.add_request("admitted after", PROMPT, GREEDY, lora_name="a")
    finals = {}
    while engine.has_unfinished_requests():
        finals |= {o.request_id: o for o in engine.step() if o.finished}
    running, after = finals["running"].outputs[0], finals["admitted after"].outputs[0]
    assert running.token_ids == old_answer and running.weight_versions == [1] * MAX_TOKENS
    assert after.weight_versions == ["v2"] * MAX_TOKENS
    assert after.token_ids == tokens(from_directory(tmp_path / "v2", specs, seed=24), "a")


@NEEDS_TWO
def test_an_adapter_lands_on_the_models_gpu_whichever_gpu_is_current_for_the_caller(tmp_path):
    # "cuda" names the current device, which CUDA keeps per thread: the engine built where
    # cuda:1 is current computes there, and a load from a thread where cuda:0 is must follow it.
    with torch.cuda.device(1):
        engine = lora_engine(device="cuda")
    assert engine.model.device == torch.device("cuda", 1)
    assert torch.cuda.current_device() == 0
    tensors = adapter_tensors(engine.model, seed=31)
    engine.load_lora_adapter("a", str(write_adapter(tmp_path, tensors, CONFIG)))
    assert_on_the_models_device(engine, "a")
    assert tokens(engine, "a") != tokens(engine, None)
