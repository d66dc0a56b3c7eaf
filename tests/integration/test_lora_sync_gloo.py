"""End to end: a trainer process pushes a LoRA adapter alone over gloo into a running engine."""

import json

import torch

from process_rigs import TrainerProcess, fill_tensors
from weightsync.engine.config import EngineConfig
from weightsync.engine.llm_engine import LLMEngine
from weightsync.engine.sampling import SamplingParams
from weightsync.transfer._safetensors import write_safetensors
from weightsync.transfer.base import WeightTransferUpdateInfo

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CONFIG = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": MODULES}
SEED = 11
PROMPT = "an adapter moves, the model stays"
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def lora_engine() -> LLMEngine:
    config = EngineConfig(num_kv_blocks=128, enable_lora=True, max_lora_rank=8)
    return LLMEngine("debug", seed=0, engine_config=config)


def tokens(engine: LLMEngine, lora_name: str | None) -> list[int]:
    return engine.generate([PROMPT], GREEDY, lora_name=lora_name)[0].outputs[0].token_ids


def test_a_trainer_process_pushes_an_adapter_over_gloo_while_the_engine_runs(tmp_path):
    engine = lora_engine()
    specs = engine.weights.adapters.adapter_specs("a", CONFIG)
    update_info = WeightTransferUpdateInfo.from_specs(specs.values()).to_dict()
    trainer = TrainerProcess(update_info=update_info, timeout_s=60)
    try:
        init_info = trainer.call("init", world_size=2, backend="gloo", timeout_s=60)["init_info"]
        trainer.start("connect")
        engine.init_weight_transfer_engine({"init_info": init_info})
        trainer.reply()
        engine.add_request("base", PROMPT, GREEDY)
        outputs = []
        while not outputs:  # a request runs, and the engine is not paused
            outputs += engine.step()
        engine.start_weight_update(lora_name="a", lora_config=CONFIG)
        trainer.start("send", seed=SEED)
        stats = engine.update_weights({"update_info": update_info})
        assert trainer.reply()["stats"]["num_bytes"] == stats.num_bytes > 0
        assert engine.finish_weight_update("gloo-1") is True
        while engine.has_unfinished_requests():
            outputs += engine.step()
    finally:
        trainer.close()
    assert outputs[-1].finished and set(outputs[-1].outputs[0].weight_versions) == {0}
    # What the trainer sent, loaded from a PEFT directory into another engine: the same tokens.
    sent = {s.name: torch.zeros(s.shape, dtype=s.dtype) for s in specs.values()}
    fill_tensors(sent, SEED)
    write_safetensors(sent, tmp_path / "adapter_model.safetensors")
    (tmp_path / "adapter_config.json").write_text(json.dumps(CONFIG))
    reference = lora_engine()
    reference.load_lora_adapter("a", str(tmp_path))
    output = engine.generate([PROMPT], GREEDY, lora_name="a")[0].outputs[0]
    assert output.token_ids == tokens(reference, "a") != tokens(engine, None)
    assert set(output.weight_versions) == {"gloo-1"} and engine.weight_version == 0
