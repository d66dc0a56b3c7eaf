"""End to end: a trainer process pushes new weights over gloo into a paused AsyncEngine."""

import asyncio

import torch

from process_rigs import TrainerProcess, fill_tensors
from weightsync.engine.async_engine import AsyncEngine
from weightsync.engine.config import EngineConfig
from weightsync.engine.model import LlamaForCausalLM
from weightsync.engine.sampling import SamplingParams
from weightsync.transfer.base import WeightTransferUpdateInfo

N = 16
MAX_TOKENS = 16
SEED = 7
LABEL = "trainer-step-1"


@torch.inference_mode()
def reference_greedy(model, prompt_ids, max_tokens):
    ids = list(prompt_ids)
    for _ in range(max_tokens):
        ids.append(int(model.compute_logits(model(torch.tensor(ids))[-1:]).argmax()))
    return ids[len(prompt_ids) :]


def trainer_weights(specs, seed):
    """What the trainer process sends: its tensors, in announced order, filled from `seed`."""
    tensors = {s.name: torch.zeros(s.shape, dtype=s.dtype) for s in specs}
    fill_tensors(tensors, seed)
    return tensors


async def consume(engine, prompt, params, three_tokens):
    async for output in engine.generate(prompt, params):
        if len(output.outputs[0].token_ids) >= 3:
            three_tokens.set()
    return output


def test_trainer_process_pushes_weights_into_an_engine_paused_in_keep_mode():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = AsyncEngine("debug", seed=0, engine_config=EngineConfig(num_kv_blocks=128))
    specs = list(engine.engine.model.weight_specs().values())
    update_info = WeightTransferUpdateInfo.from_specs(specs, weight_version=LABEL).to_dict()
    trainer = TrainerProcess(update_info=update_info, timeout_s=60)
    prompts = [f"request {i}: the trainer sends" for i in range(N)]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)

    async def main():
        async with engine:
            return await generate_through_an_update()

    async def generate_through_an_update():
        ready = [asyncio.Event() for _ in prompts]
        tasks = [
            asyncio.create_task(consume(engine, p, params, r))
            for p, r in zip(prompts, ready, strict=True)
        ]
        await asyncio.gather(*(r.wait() for r in ready))
        await engine.pause_generation(mode="keep", clear_cache=True)
        init_info = trainer.call("init", world_size=2, backend="gloo", timeout_s=60)["init_info"]
        trainer.start("connect")
        await engine.init_weight_transfer_engine({"init_info": init_info})
        trainer.reply()
        trainer.start("send", seed=SEED)
        stats = await engine.update_weights({"update_info": update_info})
        assert trainer.reply()["stats"]["num_bytes"] == stats.num_bytes > 0
        assert engine.weight_version == LABEL and await engine.is_paused()
        await engine.resume_generation()
        return await asyncio.gather(*tasks)

    try:
        finals = asyncio.run(main())
        new_model = LlamaForCausalLM(engine.engine.model.config)
        new_model.load_weights(trainer_weights(specs, SEED).items())
        for prompt, final in zip(prompts, finals, strict=True):
            out = final.outputs[0]
            before = out.weight_versions.count(0)
            assert 3 <= before < MAX_TOKENS
            assert out.weight_versions == [0] * before + [LABEL] * (MAX_TOKENS - before)
            prefix = engine.engine.tokenizer.encode(prompt) + out.token_ids[:before]
            assert out.token_ids[before:] == reference_greedy(
                new_model, prefix, MAX_TOKENS - before
            )
    finally:
        trainer.close()
        torch.set_num_threads(threads)
