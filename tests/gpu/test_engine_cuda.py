"""The engine on one CUDA device: greedy equal to the CPU, IPC updates in place, a keep pause."""

import pytest
import torch

from ipc_rigs import IPCTrainerProcess
from weightsync import weight_checksums
from weightsync.config import WeightTransferConfig
from weightsync.engine.config import EngineConfig
from weightsync.engine.llm_engine import LLMEngine
from weightsync.engine.model import LlamaForCausalLM
from weightsync.engine.sampling import SamplingParams
from weightsync.transfer.base import WeightTransferUpdateInfo

pytestmark = pytest.mark.gpu

PROMPTS = ["The quick brown fox", "Hello, world", "pause, update, resume", "a", "1 2 3 4 5"]


def config(device: str) -> EngineConfig:
    return EngineConfig(num_kv_blocks=256, block_size=8, device=device)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_greedy_on_cuda_equals_the_cpu_in_float64():
    # float64 leaves no room for the two devices' different summation orders to flip an argmax.
    # Requests of different lengths finish at different steps: decode lanes move and are masked.
    params = [greedy(8 + 5 * index) for index in range(len(PROMPTS))]
    model = LlamaForCausalLM.from_preset("tiny", seed=0, dtype=torch.float64)
    cpu = LLMEngine(model, engine_config=config("cpu"))
    expected = token_ids(cpu.generate(PROMPTS, params))
    engine = LLMEngine("tiny", seed=0, dtype=torch.float64, engine_config=config("cuda:0"))
    assert engine.model.device == torch.device("cuda:0")
    assert all(cache.is_cuda for cache in engine.runner.kv_caches)
    assert token_ids(engine.generate(PROMPTS, params)) == expected
    assert all(lanes.is_cuda for lanes in engine.runner.lanes.storage)


def test_sampling_runs_on_the_device_and_is_seeded():
    engine = LLMEngine("debug", seed=0, engine_config=config("cuda:0"))
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, seed=7, ignore_eos=True)
    first = token_ids(engine.generate(PROMPTS[:2], [params, params]))
    again = token_ids(engine.generate(PROMPTS[:1], [params]))
    assert first[0] == again[0]  # a request's draws do not depend on its batch


def test_cuda_ipc_update_lands_in_the_engines_device_memory():
    engine = LLMEngine(
        "debug",
        seed=0,
        engine_config=config("cuda:0"),
        weight_transfer_config=WeightTransferConfig(backend="ipc"),
    )
    before = {name: t.data_ptr() for name, t in engine.model.named_weights()}
    info = WeightTransferUpdateInfo.from_specs(list(engine.model.weight_specs().values()))
    trainer = IPCTrainerProcess(update_info=info.to_dict(), device="cuda:0", timeout_s=120)
    try:
        init_info = trainer.call("init", packed=True, bucket_size_bytes=1 << 16)["init_info"]
        engine.init_weight_transfer_engine({"init_info": init_info})
        trainer.start("send", seed=3)
        while "deliver" in (message := trainer.next_message()):
            engine.update_weights({"update_info": message["deliver"]})
            trainer.acknowledge()
        assert message["ok"], message
        want = trainer.call("digests")["digests"]
    finally:
        trainer.close()
        engine.shutdown()
    weights = dict(engine.model.named_weights())
    assert weight_checksums(weights) == want
    # In place, on the device: the same CUDA memory holds the new bytes.
    assert all(t.is_cuda for t in weights.values())
    assert {name: t.data_ptr() for name, t in weights.items()} == before
    assert engine.weight_version == 1
    out = engine.generate(PROMPTS[:1], greedy(4))[0].outputs[0]
    assert out.weight_versions == [1] * 4


def test_keep_pause_on_cuda_resumes_to_the_same_tokens():
    # float64: the recompute after resume prefills what was decoded, in other kernels.
    engine = LLMEngine("tiny", seed=0, dtype=torch.float64, engine_config=config("cuda:0"))
    expected = token_ids(engine.generate(PROMPTS, greedy(16)))
    for index, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{index}", prompt, greedy(16))
    for _ in range(5):
        engine.step()
    engine.pause_generation(mode="keep", clear_cache=True)  # KV recomputed on resume
    assert engine.is_paused() and engine.scheduler.num_unfinished == len(PROMPTS)
    assert engine.step() == []
    engine.resume_generation()
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert [finals[f"r{i}"].outputs[0].token_ids for i in range(len(PROMPTS))] == expected
