"""Update transactions across real transports: refusals reach the trainer and leave engines whole."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from weightsync.config import WeightTransferConfig
from weightsync.engine.config import EngineConfig
from weightsync.engine.llm_engine import LLMEngine
from weightsync.engine.model import LlamaForCausalLM
from weightsync.engine.sampling import SamplingParams
from weightsync.errors import (
    DuplicateMessageError,
    EngineBusyError,
    WeightTransferTimeout,
    WeightValidationError,
)
from weightsync.trainer.engine_process import EngineProcess
from weightsync.trainer.senders import IPCWeightSender, sync_weights
from weightsync.transfer.base import WeightTransferUpdateInfo
from weightsync.transfer.nccl import _LATEST as LATEST
from weightsync.transfer.nccl import NCCLTrainerSendWeightsArgs, trainer_init, trainer_send_weights

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def policy():
    return LlamaForCausalLM.from_preset("debug", seed=1)


def test_a_rejection_by_one_engine_process_leaves_every_engine_serving(policy):
    config = EngineConfig(num_kv_blocks=64)
    engines = [
        EngineProcess("debug", dtype="float32", engine_config=config, timeout_s=TIMEOUT_S),
        EngineProcess("debug", dtype="float64", engine_config=config, timeout_s=TIMEOUT_S),
    ]
    try:
        before = [engine.weight_digests() for engine in engines]
        with (
            IPCWeightSender(engines) as sender,
            pytest.raises(WeightValidationError, match=r"float64"),
        ):
            sync_weights(sender, policy.named_weights(), weight_version=1)
        for engine, digests in zip(engines, before, strict=True):
            assert engine.weight_digests() == digests
            assert engine.weight_version == 0 and not engine.is_paused()
            output = engine.generate(["still serving"], GREEDY)[0]
            assert output.outputs[0].weight_versions == [0] * 4
    finally:
        for engine in engines:
            engine.close()


@pytest.fixture
def gloo_engine(policy):
    """An in-process engine joined to a trainer's gloo group: (engine, send args, update info)."""
    engine = LLMEngine(
        "debug",
        engine_config=EngineConfig(num_kv_blocks=64),
        weight_transfer_config=WeightTransferConfig(backend="gloo"),
    )
    group = trainer_init(world_size=2, backend="gloo", timeout_s=TIMEOUT_S)
    joining = threading.Thread(
        target=engine.init_weight_transfer_engine, args=({"init_info": group.init_info},)
    )
    joining.start()
    group.connect()
    joining.join(TIMEOUT_S)
    assert not joining.is_alive(), "the engine did not join the group in time"
    update_info = WeightTransferUpdateInfo.from_named_tensors(
        policy.named_weights(), weight_version=1
    ).to_dict()
    try:
        yield engine, NCCLTrainerSendWeightsArgs(group, update_info), update_info
    finally:
        group.close()
        engine.shutdown()


def refused_send(engine, args, policy, update_info, error, match):
    """Sends while the engine receives `update_info`; returns how long the refusal took."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        receive = pool.submit(engine.update_weights, {"update_info": update_info})
        start = time.monotonic()
        with pytest.raises(WeightValidationError, match=match):
            trainer_send_weights(policy.named_weights(), args)
        waited_s = time.monotonic() - start
        with pytest.raises(error):
            receive.result(timeout=TIMEOUT_S)
    return waited_s


def accepted_send(engine, args, policy, update_info):
    with ThreadPoolExecutor(max_workers=1) as pool:
        receive = pool.submit(engine.update_weights, {"update_info": update_info})
        trainer_send_weights(policy.named_weights(), args)
        receive.result(timeout=TIMEOUT_S)


def test_a_busy_engine_refuses_a_broadcast_at_once_and_the_group_stays_usable(gloo_engine, policy):
    engine, args, update_info = gloo_engine
    engine.add_request("r", "in flight", SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()  # running and not paused: busy
    waited_s = refused_send(
        engine, args, policy, update_info, EngineBusyError, r"rank 1: EngineBusyError"
    )
    assert waited_s < TIMEOUT_S / 2  # the refusal came in the handshake, not at the timeout
    engine.pause_generation(mode="keep")
    accepted_send(engine, args, policy, update_info)
    assert engine.weight_version == 1


def test_a_malformed_update_info_is_refused_in_the_handshake(gloo_engine, policy):
    engine, args, update_info = gloo_engine
    malformed = {**update_info, "shapes": update_info["shapes"][:-1]}  # mangled on its way
    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=1) as pool:
        sending = pool.submit(trainer_send_weights, policy.named_weights(), args)
        while args.group._group.lookup(LATEST) != 1 and not sending.done():
            time.sleep(0.01)  # the trainer's announcement is local: it comes in milliseconds
        with pytest.raises(WeightValidationError, match="equal lengths"):
            engine.update_weights({"update_info": malformed})  # the trainer is on the line
        with pytest.raises(WeightValidationError, match=r"rank 1: WeightValidationError"):
            sending.result(timeout=TIMEOUT_S)
    assert time.monotonic() - start < TIMEOUT_S / 2  # the engine's reason, not the timeout
    assert engine.weight_version == 0 and not engine.weights.holds_generation
    accepted_send(engine, args, policy, update_info)
    assert engine.weight_version == 1


def test_a_mangled_copy_refused_before_the_trainer_sends_does_not_refuse_that_send(
    gloo_engine, policy
):
    engine, args, update_info = gloo_engine
    malformed = {**update_info, "shapes": update_info["shapes"][:-1]}  # its send_id, kept
    start = time.monotonic()
    with pytest.raises(WeightValidationError, match="equal lengths"):
        engine.update_weights({"update_info": malformed})  # no trainer on the line yet
    assert time.monotonic() - start < TIMEOUT_S / 2  # the worker did not wait for a trainer
    assert engine.weight_version == 0 and not engine.weights.holds_generation
    accepted_send(engine, args, policy, update_info)
    assert engine.weight_version == 1


@pytest.mark.parametrize("staging", [False, True])
def test_a_repeat_of_a_message_that_landed_leaves_the_update_and_the_group_whole(policy, staging):
    """A client's retry of an `update_weights` that had landed (it timed out on its own side):
    refused once the trainer announced nothing, as a repeat; the update in progress still
    finishes, applied, and the group takes the next update. A message no update came for
    leaves the group usable too."""
    engine = LLMEngine(
        "debug",
        engine_config=EngineConfig(num_kv_blocks=64, weight_update_staging=staging),
        weight_transfer_config=WeightTransferConfig(backend="gloo"),
    )
    group = trainer_init(world_size=2, backend="gloo", timeout_s=1.0)  # the repeat waits it out
    try:
        joining = threading.Thread(
            target=engine.init_weight_transfer_engine, args=({"init_info": group.init_info},)
        )
        joining.start()
        group.connect()
        joining.join(TIMEOUT_S)
        first = WeightTransferUpdateInfo.from_named_tensors(policy.named_weights()).to_dict()
        engine.start_weight_update()
        accepted_send(engine, NCCLTrainerSendWeightsArgs(group, first), policy, first)
        with pytest.raises(DuplicateMessageError, match=r"repeat of update #1's"):
            engine.update_weights({"update_info": first})
        assert engine.weight_update.complete
        assert engine.finish_weight_update(weight_version=1) is True  # applied
        assert engine.weight_version == 1 and not engine.weights.holds_generation
        # The same send_id in the next update (a client that keeps one), the trainer silent:
        # refused as a repeat too, and then the update's message that never came.
        engine.start_weight_update()
        with pytest.raises(DuplicateMessageError):
            engine.update_weights({"update_info": first})
        assert engine.finish_weight_update(weight_version=9) is False  # ended unapplied
        assert engine.weight_version == 1
        second = WeightTransferUpdateInfo.from_named_tensors(
            policy.named_weights(), weight_version=2
        ).to_dict()  # over the same group: it stayed usable
        accepted_send(engine, NCCLTrainerSendWeightsArgs(group, second), policy, second)
        assert engine.weight_version == 2
        # A message the trainer never sends (another send): a timeout, with nothing on the wire.
        stray = WeightTransferUpdateInfo.from_named_tensors(policy.named_weights()).to_dict()
        with pytest.raises(WeightTransferTimeout, match="no update of the trainer's arrived"):
            engine.update_weights({"update_info": stray})
        third = {**stray, "weight_version": 3}
        accepted_send(engine, NCCLTrainerSendWeightsArgs(group, third), policy, third)
        assert engine.weight_version == 3
    finally:
        group.close()
        engine.shutdown()
