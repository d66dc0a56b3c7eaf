"""TRL 1.16's own HTTP clients, unmodified, against `weightsync serve`.

`VLLMClient` (`trl/generation/vllm_client.py`) refuses to start unless vLLM is installed; the
test forces that one availability check and nothing else. What needs vLLM's NCCL (its
`init_communicator` and the broadcast of `update_named_params`) needs CUDA and is not run
here: the update flow is driven over gloo by weightsync's trainer side, with TRL's HTTP calls.
The calls that depend on vLLM's request fields (`return_tokens_as_token_ids`,
`prompt_logprobs`) are expected to fail until the server honours them.
"""

from __future__ import annotations

import threading

import httpx
import pytest
import torch

trl_client = pytest.importorskip("trl.generation.vllm_client")
async_grpo_client = pytest.importorskip("trl.experimental.async_grpo.vllm_client")
transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

from weightsync import (  # noqa: E402
    NCCLTrainerSendWeightsArgs,
    WeightTransferUpdateInfo,
    trainer_init,
    trainer_send_weights,
    weight_checksums,
)

WAIT_S = 60


@pytest.fixture
def client(server, monkeypatch):
    """TRL's `VLLMClient`, its vLLM check forced (nothing else of vLLM is used)."""
    monkeypatch.setattr(trl_client, "is_vllm_available", lambda *args, **kwargs: True)
    return trl_client.VLLMClient(base_url=server.base_url, connection_timeout=WAIT_S)


def test_vllm_client_starts_and_reads_what_it_checks_before_a_sync(client, model_dir):
    assert client.model == str(model_dir)  # from /v1/models
    info = client.get_server_info()  # /server_info?config_format=json
    assert info["weight_transfer_config"] == {"backend": "gloo"}  # init_communicator's check
    assert client.get_world_size() == 1
    client.reset_prefix_cache()


def test_vllm_client_weight_update_context_opens_and_closes_a_transaction(client, server):
    before = httpx.get(server.base_url + "/weight_info").json()["weight_version"]
    with client.weight_update():  # /start_weight_update {} ... /finish_weight_update {}
        pass
    after = httpx.get(server.base_url + "/weight_info").json()["weight_version"]
    assert after != before


def test_vllm_client_generate(client):
    answer = client.generate(["The quick brown fox"], max_tokens=4, temperature=0)
    assert len(answer["completion_ids"][0]) == 4
    assert len(answer["logprob_token_ids"][0]) == 4


def test_vllm_client_chat(client):
    answer = client.chat([[{"role": "user", "content": "hi"}]], max_tokens=4, temperature=0)
    assert len(answer["completion_ids"][0]) == 4


def test_vllm_client_sequence_logprobs(client):
    answer = client.get_sequence_logprobs([[1, 2, 3, 4, 5]], prompt_lengths=[3], top_logprobs=2)
    assert len(answer["actual_logprobs"][0]) == 2


def test_async_grpo_client_reads_the_model_and_runs_a_whole_update(server, model_dir):
    # The trainer's process state, as TRL's trainer sets it up (the client logs through it).
    accelerate.PartialState(cpu=True)
    client = async_grpo_client.VLLMClient(server.base_url, server_timeout=WAIT_S)
    client.wait_for_server_ready(poll_interval_s=0.1)
    assert client.get_max_model_len() > 0  # /v1/models' max_model_len
    assert client.get_dtype() == "torch.float32"  # /server_info's model_config.dtype
    assert client.get_world_size() == 1

    # The trainer: the checkpoint in transformers, one step's change to every weight.
    trainer = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for param in trainer.parameters():
            param.add_(0.01)
    pairs = list(trainer.named_parameters())
    # Its group over gloo (weightsync's trainer side: vLLM's needs NCCL), TRL's HTTP calls.
    group = trainer_init(world_size=2, backend="gloo", timeout_s=WAIT_S)
    try:
        joining = threading.Thread(
            target=client.init_weight_transfer_engine, args=(group.init_info,)
        )
        joining.start()
        group.connect()
        joining.join(WAIT_S)
        update_info = WeightTransferUpdateInfo.from_named_tensors(pairs).to_dict()
        client.pause()  # mode=keep
        client.start_weight_update()  # {"is_checkpoint_format": true}
        receiving = threading.Thread(target=client.update_weights, args=(update_info,))
        receiving.start()
        trainer_send_weights(pairs, NCCLTrainerSendWeightsArgs(group, update_info))
        receiving.join(WAIT_S)
        client.finish_weight_update()  # no body
        client.resume()
    finally:
        group.close()
    checked = httpx.post(server.base_url + "/weight_checker",
                         json={"action": "compare", "baseline": weight_checksums(pairs)})  # fmt: skip
    assert checked.json() == {"match": True, "mismatches": []}
