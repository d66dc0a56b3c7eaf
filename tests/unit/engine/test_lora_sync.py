"""Adapter-only live sync: a LoRA adapter's tensors pushed through shared memory (the `ipc`
backend) in the four-call transaction, landed in a new version beside the one requests use."""

from __future__ import annotations

import asyncio

import pytest
import torch
from engine_helpers import DTYPE, debug_model, greedy, small_config

from lora_adapters import adapter_tensors, peft_config, write_adapter
from weightsync.engine import AsyncEngine, LLMEngine
from weightsync.engine.outputs import RequestOutput
from weightsync.errors import (
    IncompleteWeightUpdateError,
    LoRAAdapterError,
    LoRAAdapterNotFoundError,
    WeightUpdateStateError,
    WeightValidationError,
)
from weightsync.trainer import IPCWeightSender, sync_weights
from weightsync.transfer.ipc import (
    IPCTrainerSendWeightsArgs,
    ipc_trainer_init,
    ipc_trainer_send_weights,
)

PROMPT = "LoRA adapters ride on the base weights"
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def base_model():
    return debug_model()


def lora_engine(base_model, **config: object) -> LLMEngine:
    settings = {"enable_lora": True, "max_loras": 4, "max_lora_rank": 8, **config}
    model = debug_model()
    model.load_weights(base_model.named_weights())
    return LLMEngine(model, engine_config=small_config(**settings))


def tokens(engine: LLMEngine, lora_name: str | None = None) -> list[int]:
    return (
        engine.generate([PROMPT], greedy(MAX_TOKENS), lora_name=lora_name)[0].outputs[0].token_ids
    )


def in_model_dtype(tensors: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    return [(name, tensor.to(DTYPE)) for name, tensor in tensors.items()]


def loaded_from_directory(base_model, tmp_path, tensors, **config: object) -> LLMEngine:
    engine = lora_engine(base_model)
    engine.load_lora_adapter(
        "a", str(write_adapter(tmp_path / "dir", tensors, peft_config(**config)))
    )
    return engine


def test_an_adapter_pushed_through_shared_memory_answers_as_the_same_adapter_from_a_directory(
    base_model, tmp_path
):
    tensors = adapter_tensors(base_model, seed=21)
    engine = lora_engine(base_model)
    with IPCWeightSender([engine]) as sender:
        # Created by its config, then updated in place with its own shapes as the contract.
        sync_weights(sender, in_model_dtype(tensors), lora_name="a", lora_config=peft_config())
        assert tokens(engine, "a") == tokens(
            loaded_from_directory(base_model, tmp_path, tensors), "a"
        )
        newer = adapter_tensors(base_model, seed=22)
        sync_weights(sender, in_model_dtype(newer), lora_name="a", weight_version="step-2")
    from_directory = loaded_from_directory(base_model, tmp_path / "newer", newer)
    output = engine.generate([PROMPT], greedy(MAX_TOKENS), lora_name="a")[0].outputs[0]
    assert output.token_ids == tokens(from_directory, "a") != tokens(engine)
    assert output.weight_versions == ["step-2"] * MAX_TOKENS  # the adapter's version, by row
    assert engine.weight_version == 0  # the model's version did not move
    assert engine.last_adapter_commit is not None
    assert engine.last_adapter_commit.weight_version == "step-2"


def test_an_adapter_update_needs_no_pause_and_a_running_request_keeps_its_version(
    base_model, tmp_path
):
    old, new = adapter_tensors(base_model, seed=23), adapter_tensors(base_model, seed=24)
    engine = loaded_from_directory(base_model, tmp_path, old)
    old_answer = tokens(engine, "a")
    engine.add_request("running", PROMPT, greedy(MAX_TOKENS), lora_name="a")
    outputs = []
    while not outputs or len(outputs[-1].outputs[0].token_ids) < 3:  # mid-generation
        outputs += engine.step()
    with IPCWeightSender([engine]) as sender:  # the engine runs a request and is not paused
        sync_weights(sender, in_model_dtype(new), lora_name="a", weight_version="v2")
    assert not engine.is_paused()
    engine.add_request("admitted after", PROMPT, greedy(MAX_TOKENS), lora_name="a")
    finals = {}
    while engine.has_unfinished_requests():
        finals |= {o.request_id: o for o in engine.step() if o.finished}
    running, after = finals["running"].outputs[0], finals["admitted after"].outputs[0]
    assert running.token_ids == old_answer and running.weight_versions == [1] * MAX_TOKENS
    assert after.weight_versions == ["v2"] * MAX_TOKENS
    assert after.token_ids == tokens(loaded_from_directory(base_model, tmp_path / "new", new), "a")


def assert_serving_version_1(engine: LLMEngine, answer: list[int]) -> None:
    assert engine.weight_update is None  # no transaction left open
    assert engine.loras is not None and engine.loras.get("a").version == 1
    assert tokens(engine, "a") == answer


@pytest.mark.parametrize(
    "case",
    [
        "unknown adapter", "a base weight", "wrong shape", "wrong dtype", "missing tensor",
        "rank", "nested targets",
    ],
)  # fmt: skip
def test_a_refused_adapter_update_changes_nothing(base_model, tmp_path, case):
    tensors = adapter_tensors(base_model, seed=25)
    engine = loaded_from_directory(base_model, tmp_path, tensors)
    answer = tokens(engine, "a")
    sent = in_model_dtype(adapter_tensors(base_model, seed=26))
    expected: tuple[type[Exception], str]
    lora_name, lora_config = "a", None
    if case == "unknown adapter":
        lora_name, expected = "b", (LoRAAdapterNotFoundError, "'b' is not loaded")
    elif case == "a base weight":
        base_name, base_weight = next(iter(base_model.named_weights()))
        sent.append((base_name, base_weight.clone()))
        expected = (WeightValidationError, f"unknown name '{base_name}'")
    elif case == "wrong shape":
        sent[0] = (sent[0][0], torch.zeros(2, 2, dtype=DTYPE))
        expected = (WeightValidationError, "update has float64\\[2, 2\\]")
    elif case == "wrong dtype":
        sent[0] = (sent[0][0], sent[0][1].float())
        expected = (WeightValidationError, "update has float32")
    elif case == "missing tensor":
        sent = sent[1:]
        expected = (IncompleteWeightUpdateError, "must bring all")
    elif case == "nested targets":
        lora_name, lora_config = "b", peft_config(target_modules=[["q_proj"]])
        expected = (LoRAAdapterError, "target_modules")
    else:
        lora_name, lora_config = "b", peft_config(rank=16)
        expected = (LoRAAdapterError, "exceeds the maximum LoRA rank 8")
    with IPCWeightSender([engine]) as sender, pytest.raises(expected[0], match=expected[1]):
        sync_weights(sender, sent, lora_name=lora_name, lora_config=lora_config)
    assert_serving_version_1(engine, answer)


def test_an_adapter_update_aborted_midway_changes_nothing(base_model, tmp_path):
    tensors = adapter_tensors(base_model, seed=27)
    engine = loaded_from_directory(base_model, tmp_path, tensors)
    answer = tokens(engine, "a")
    sent = in_model_dtype(adapter_tensors(base_model, seed=28))
    with IPCWeightSender([engine], bucket_size_bytes=4096) as sender:  # several parts
        engine.start_weight_update(lora_name="a")
        delivered = []

        def deliver(update_info):  # the announcement and the first part land, then it stops
            if len(delivered) == 2:
                raise RuntimeError("the trainer stops midway")
            delivered.append(engine.update_weights({"update_info": update_info}))

        args = IPCTrainerSendWeightsArgs(sender.session, deliver)
        with pytest.raises(RuntimeError, match="midway"):
            ipc_trainer_send_weights(sent, args)
        assert engine.weight_update is not None and engine.weight_update.num_landed > 0
        assert engine.abort_weight_update() is True
    assert_serving_version_1(engine, answer)


@pytest.mark.parametrize("meanwhile", ["load_inplace", "unload and load"])
def test_an_adapter_loaded_anew_while_its_update_is_open_is_not_mixed_with_it(
    base_model, tmp_path, meanwhile
):
    # The update's tensors were shaped and scaled for version 1; version 2, loaded by the route
    # meanwhile, has another lora_alpha: a commit must not give its scaling to those tensors.
    engine = loaded_from_directory(base_model, tmp_path, adapter_tensors(base_model, seed=29))
    sent = in_model_dtype(adapter_tensors(base_model, seed=30))
    other = write_adapter(tmp_path / "other", adapter_tensors(base_model, seed=31),
                          peft_config(alpha=16))  # fmt: skip
    with IPCWeightSender([engine]) as sender:
        engine.start_weight_update(lora_name="a")
        args = IPCTrainerSendWeightsArgs(
            sender.session, lambda info: engine.update_weights({"update_info": info})
        )
        ipc_trainer_send_weights(sent, args)
        if meanwhile == "load_inplace":
            engine.load_lora_adapter("a", str(other), load_inplace=True)
        else:
            engine.unload_lora_adapter("a")
            engine.load_lora_adapter("a", str(other))
        loaded = engine.list_lora_adapters()
        answer = tokens(engine, "a")
        with pytest.raises(LoRAAdapterError, match="'a': loaded anew while its update was open"):
            engine.finish_weight_update()
    assert engine.weight_update is None and engine.list_lora_adapters() == loaded
    assert tokens(engine, "a") == answer


def test_a_commit_beyond_the_version_limit_drops_the_oldest_and_says_so(base_model, tmp_path):
    engine = lora_engine(base_model, max_lora_versions=2)
    engine.load_lora_adapter(
        "a",
        str(write_adapter(tmp_path / "v1", adapter_tensors(base_model, seed=29), peft_config())),
    )
    params = greedy(MAX_TOKENS)
    with IPCWeightSender([engine]) as sender:
        engine.add_request("on v1", PROMPT, params, lora_name="a")
        engine.step()
        sync_weights(sender, in_model_dtype(adapter_tensors(base_model, seed=30)), lora_name="a")
        assert engine.last_adapter_commit.dropped_versions == []  # v1 and v2: within 2
        engine.add_request("on v2", PROMPT, params, lora_name="a")
        engine.step()
        sync_weights(
            sender, in_model_dtype(adapter_tensors(base_model, seed=31)), lora_name="a",
            weight_version="v3",
        )  # fmt: skip
    assert engine.last_adapter_commit.dropped_versions == [1]  # the oldest still in use
    finals = {}
    while engine.has_unfinished_requests():
        finals |= {o.request_id: o for o in engine.step() if o.finished}
    assert finals["on v1"].outputs[0].finish_reason == "abort"
    assert finals["on v2"].outputs[0].finish_reason == "length"
    assert set(finals["on v2"].outputs[0].weight_versions) == {2}


def test_one_transaction_at_a_time_and_full_weight_updates_work_before_and_after(
    base_model, tmp_path
):
    engine = loaded_from_directory(base_model, tmp_path, adapter_tensors(base_model, seed=32))
    policy = debug_model(seed=5)
    with IPCWeightSender([engine]) as sender:
        sync_weights(sender, policy.named_weights(), weight_version="full-1")
        assert engine.weight_version == "full-1"
        engine.start_weight_update(lora_name="a")
        with pytest.raises(WeightUpdateStateError, match="LoRA adapter 'a'"):
            engine.start_weight_update()  # a full update waits for the adapter's to end
        engine.abort_weight_update()
        engine.start_weight_update()  # a full update: an adapter's waits for it to end
        with pytest.raises(WeightUpdateStateError, match="already in progress: finish it"):
            engine.start_weight_update(lora_name="a")
        engine.abort_weight_update()
        sync_weights(sender, debug_model(seed=6).named_weights(), weight_version="full-2")
    assert engine.weight_version == "full-2"


def test_an_engine_without_lora_refuses_an_adapter_update_and_stays_as_it_was(base_model):
    engine = LLMEngine(debug_model(), engine_config=small_config())
    with pytest.raises(Exception, match="serves no LoRA adapters"):
        engine.start_weight_update(lora_name="a", lora_config=peft_config())
    assert engine.weight_update is None


def test_the_engine_generates_while_an_adapter_update_is_open(base_model, tmp_path):
    engine = loaded_from_directory(base_model, tmp_path, adapter_tensors(base_model, seed=33))
    answer = tokens(engine, "a")
    engine.start_weight_update(lora_name="a")
    assert engine.weight_update is not None and engine.weight_update.lora_name == "a"
    assert tokens(engine, "a") == answer  # generate() would refuse during a full update
    assert engine.abort_weight_update() is True


def test_the_async_engine_streams_through_an_open_adapter_update(base_model, tmp_path):
    engine = AsyncEngine.from_engine(
        loaded_from_directory(base_model, tmp_path, adapter_tensors(base_model, seed=34))
    )
    sent = in_model_dtype(adapter_tensors(base_model, seed=35))
    session = ipc_trainer_init()

    async def main() -> tuple[RequestOutput, RequestOutput]:
        loop = asyncio.get_running_loop()

        def deliver(update_info):  # on the trainer's thread, as a trainer process would call
            request = {"update_info": update_info}
            asyncio.run_coroutine_threadsafe(engine.update_weights(request), loop).result(60)

        stream = engine.generate(PROMPT, greedy(64), lora_name="a")
        await anext(stream)
        await engine.pause_generation(mode="keep")  # holds the request mid-generation
        await engine.init_weight_transfer_engine({"init_info": session.init_info})
        await engine.start_weight_update(lora_name="a")
        await engine.resume_generation()  # an adapter's open update holds nothing
        during = await asyncio.wait_for(anext(stream), 60)
        args = IPCTrainerSendWeightsArgs(session, deliver)
        await asyncio.to_thread(ipc_trainer_send_weights, sent, args)
        assert await engine.finish_weight_update("v2") is True
        async for output in stream:
            during = output
        after = None
        async for output in engine.generate(PROMPT, greedy(4), lora_name="a"):
            after = output
        assert after is not None
        return during, after

    async def run() -> tuple[RequestOutput, RequestOutput]:
        try:
            return await main()
        finally:
            await engine.shutdown()
            session.close()

    during, after = asyncio.run(run())
    assert set(during.outputs[0].weight_versions) == {1} and during.finished
    assert len(during.outputs[0].token_ids) == 64
    assert after.outputs[0].weight_versions == ["v2"] * 4
