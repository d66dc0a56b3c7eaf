"""`sync_weights`: pause every engine, send, resume; in flight requests continue on new weights."""

import pytest
import torch

from weightsync.engine.config import EngineConfig
from weightsync.engine.llm_engine import LLMEngine
from weightsync.engine.model import LlamaForCausalLM
from weightsync.engine.sampling import SamplingParams
from weightsync.errors import WeightTransferError
from weightsync.trainer.senders import IPCWeightSender, WeightSender, sync_weights
from weightsync.transfer.base import TransferStats, WeightValidationError

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def engine():
    return LLMEngine("debug", seed=0, engine_config=EngineConfig(num_kv_blocks=64))


@pytest.fixture(scope="module")
def policy():
    return LlamaForCausalLM.from_preset("debug", seed=1)


def run_to_end(engine):
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output.outputs[0]
    return finals


class Recorder:
    """An engine client that records the calls it gets."""

    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def pause_generation(self, *, mode="abort", clear_cache=True):
        self.calls.append((self.name, "pause", mode, clear_cache))

    def resume_generation(self):
        self.calls.append((self.name, "resume"))

    def start_weight_update(self):
        self.calls.append((self.name, "start"))

    def finish_weight_update(self, weight_version=None):
        self.calls.append((self.name, "finish", weight_version))

    def abort_weight_update(self):
        self.calls.append((self.name, "abort"))
        return False


class RecordingSender(WeightSender):
    def __init__(self, engines, calls):
        super().__init__(engines)
        self.calls = calls

    def connect(self):
        self._connected = True

    def _transfer(self, weights, weight_version):
        self.calls.append(("sender", "send", weight_version, [name for name, _ in weights]))
        return TransferStats(num_tensors=1)

    def close(self):
        self._connected = False


def test_every_engine_pauses_before_the_send_and_resumes_after_it():
    calls = []
    sender = RecordingSender([Recorder("e0", calls), Recorder("e1", calls)], calls)
    sender.connect()
    stats = sync_weights(
        sender, [("w", torch.ones(1))], weight_version=3, mode="wait", clear_cache=False
    )
    assert stats.num_tensors == 1
    assert sorted(calls[:2]) == [("e0", "pause", "wait", False), ("e1", "pause", "wait", False)]
    assert sorted(calls[2:4]) == [("e0", "start"), ("e1", "start")]
    assert calls[4] == ("sender", "send", 3, ["w"])
    assert sorted(calls[5:7]) == [("e0", "finish", 3), ("e1", "finish", 3)]
    assert sorted(calls[7:]) == [("e0", "resume"), ("e1", "resume")]


def test_keep_mode_requests_continue_on_the_new_weights(policy):
    target = engine()
    target.add_request("a", "in flight", GREEDY)
    for _ in range(3):
        target.step()
    with IPCWeightSender([target]) as sender:
        sync_weights(sender, policy.named_weights(), weight_version="v1")
    assert not target.is_paused()
    versions = run_to_end(target)["a"].weight_versions
    assert versions == [0] * 3 + ["v1"] * 5


def test_abort_mode_ends_requests_in_flight(policy):
    target = engine()
    target.add_request("a", "in flight", GREEDY)
    target.step()
    with IPCWeightSender([target]) as sender:
        sync_weights(sender, policy.named_weights(), weight_version=1, mode="abort")
    final = run_to_end(target)["a"]
    assert final.finish_reason == "abort" and final.weight_versions == [0]


def test_a_rejected_update_resumes_the_engine_on_its_weights(policy):
    target = engine()
    before = {n: t.clone() for n, t in target.model.named_weights()}
    target.add_request("a", "in flight", GREEDY)
    target.step()
    wrong = [(n, t.double()) for n, t in policy.named_weights()]
    with IPCWeightSender([target]) as sender, pytest.raises(WeightValidationError):
        sync_weights(sender, wrong, weight_version=1)
    assert not target.is_paused() and target.weight_update is None
    for name, tensor in target.model.named_weights():
        assert torch.equal(tensor, before[name]), name
    assert run_to_end(target)["a"].weight_versions == [0] * 8


def test_an_engine_that_cannot_pause_leaves_the_others_running():
    class Unreachable(Recorder):
        def pause_generation(self, *, mode="abort", clear_cache=True):
            raise WeightTransferError("engine e1 did not answer")

    calls = []
    sender = RecordingSender([Recorder("e0", calls), Unreachable("e1", calls)], calls)
    sender.connect()
    with pytest.raises(WeightTransferError, match=r"did not answer"):
        sync_weights(sender, [("w", torch.ones(1))], weight_version=3)
    assert calls[0] == ("e0", "pause", "keep", True)
    assert calls[1:] == [("e0", "resume"), ("e1", "resume")]  # nothing sent; serving again
