"""An engine taking a multi-part IPC update: the version moves once, at the last part."""

import torch

from weightsync.config import WeightTransferConfig
from weightsync.engine.llm_engine import LLMEngine
from weightsync.engine.model import LlamaForCausalLM
from weightsync.engine.sampling import SamplingParams
from weightsync.transfer.ipc_trainer import (
    IPCTrainerSendWeightsArgs,
    ipc_trainer_init,
    ipc_trainer_send_weights,
)

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def test_multi_part_ipc_update_holds_requests_until_complete():
    engine = LLMEngine("debug", seed=0, weight_transfer_config=WeightTransferConfig(backend="ipc"))
    trained = LlamaForCausalLM.from_preset("debug", seed=1)
    session = ipc_trainer_init(packed=True, bucket_size_bytes=64 << 10, timeout_s=30)
    seen = []

    def deliver(update_info):
        engine.update_weights({"update_info": update_info})
        seen.append((engine.weight_version, engine.is_paused(), engine.weights.is_torn))

    try:
        engine.init_weight_transfer_engine({"init_info": session.init_info})
        stats = ipc_trainer_send_weights(
            trained.named_weights(),
            IPCTrainerSendWeightsArgs(session, deliver, weight_version="v1"),
        )
    finally:
        session.close()
    assert len(seen) >= 3  # an announcement and at least two parts
    # Between deliveries the idle engine is held paused with its weights marked mid-update...
    assert all(state == (0, True, True) for state in seen[:-1])
    # ...and the last part lands the version, clears the torn mark and lets it run again.
    assert seen[-1] == ("v1", False, False)
    assert stats.num_tensors == len(trained.weight_specs())
    for name, tensor in trained.named_weights():
        assert torch.equal(dict(engine.model.named_weights())[name], tensor), name
    out = engine.generate(["weights"], GREEDY)[0].outputs[0]
    assert out.weight_versions == ["v1"] * 6
