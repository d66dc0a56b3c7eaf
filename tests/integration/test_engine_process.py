"""`EngineProcess`: a `weightsync serve` child driven over HTTP; errors keep their class."""

import os
import select
import subprocess
import sys

import pytest
import torch

from weightsync import weight_checksums
from weightsync.engine.config import EngineConfig
from weightsync.engine.model import LlamaForCausalLM
from weightsync.engine.outputs import RequestOutput
from weightsync.engine.sampling import SamplingParams
from weightsync.errors import (
    EngineBusyError,
    EngineConfigError,
    EngineStateError,
    InvalidRequestError,
)
from weightsync.trainer.engine_process import EngineProcess
from weightsync.trainer.senders import IPCWeightSender
from weightsync.transfer.base import WeightTransferUpdateInfo

MAX_TOKENS = 12


def greedy(max_tokens=MAX_TOKENS):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    process = EngineProcess(
        "debug", seed=0, engine_config=EngineConfig(num_kv_blocks=128), backend="ipc", timeout_s=60
    )
    yield process
    process.close()


@pytest.fixture
def sender(engine):
    with IPCWeightSender([engine]) as ipc:
        yield ipc
    engine.resume_generation()  # leave the shared engine running for the next test


@pytest.fixture(scope="module")
def policy():
    return LlamaForCausalLM.from_preset("debug", seed=1)


def test_generate_returns_request_outputs_with_versions(engine):
    (out,) = engine.generate(["hello"], greedy(4))
    assert isinstance(out, RequestOutput) and out.finished
    assert out.prompt == "hello" and out.prompt_token_ids[0] == 256
    assert len(out.outputs[0].token_ids) == 4
    assert out.outputs[0].weight_versions == [engine.weight_version] * 4


def test_a_pause_after_tokens_lands_at_that_token_and_kept_requests_continue(
    engine, sender, policy
):
    ids = engine.add_requests(["a", "bb", "ccc"], greedy(), pause_after_tokens=5)
    engine.pause_generation(mode="keep")  # waits for the pause armed with the requests
    assert engine.is_paused()
    sender.send(policy.named_weights(), weight_version="v1")
    engine.resume_generation()
    for out in engine.collect(ids):
        assert out.outputs[0].weight_versions == [0] * 5 + ["v1"] * (MAX_TOKENS - 5)
    assert engine.weight_digests() == weight_checksums(policy.named_weights())


def test_a_finished_request_does_not_hold_up_a_pause_after_tokens(engine):
    ids = engine.add_requests(
        ["short", "long"], [greedy(2), greedy()], pause_after_tokens=4, pause_mode="abort"
    )
    engine.pause_generation(mode="abort")
    short, long = engine.collect(ids)
    assert (short.outputs[0].finish_reason, len(short.outputs[0].token_ids)) == ("length", 2)
    assert (long.outputs[0].finish_reason, len(long.outputs[0].token_ids)) == ("abort", 4)
    engine.resume_generation()


def test_a_wait_pause_returns_once_requests_finished(engine):
    # Armed at its first token: the request is running, so the wait pause lets it finish (a
    # request still queued when a wait pause starts would wait for resume instead).
    ids = engine.add_requests(["drain me"], greedy(), pause_after_tokens=1, pause_mode="wait")
    engine.pause_generation(mode="wait")
    assert engine.is_paused()
    (out,) = engine.collect(ids)
    assert out.outputs[0].finish_reason == "length"
    engine.resume_generation()


def test_abort_ends_a_request(engine):
    ids = engine.add_requests(["stop me"], greedy(400))
    engine.abort(ids)
    (out,) = engine.collect(ids)
    assert out.outputs[0].finish_reason == "abort"


def test_errors_keep_their_class_and_message(engine, policy):
    with pytest.raises(InvalidRequestError, match="unknown or already collected"):
        engine.collect(["nobody"])
    with pytest.raises(InvalidRequestError, match="request ids repeat"):
        engine.collect(["twice", "twice"])
    with pytest.raises(InvalidRequestError, match=r"token ids must be ints in \[0, 259\)"):
        engine.add_requests([[999]], greedy())
    # Running for sure (not just queued, which an update may overtake): pause at its first token,
    # then let it go on.
    ids = engine.add_requests(["busy"], greedy(400), pause_after_tokens=1)
    engine.pause_generation(mode="keep")
    engine.resume_generation()
    update_info = WeightTransferUpdateInfo.from_named_tensors(policy.named_weights()).to_dict()
    with pytest.raises(EngineBusyError, match="pause_generation"):
        engine.update_weights({"update_info": update_info})
    engine.pause_generation(mode="keep")
    with pytest.raises(EngineStateError, match="resume_generation"):
        engine.collect(ids)
    engine.resume_generation()
    engine.abort(ids)
    engine.collect(ids)


def test_a_failed_start_raises_the_servers_reason():
    with pytest.raises(EngineConfigError, match="no-such-preset"):
        EngineProcess("no-such-preset", timeout_s=60)


def test_a_hugging_face_config_gives_zero_weights_of_that_shape():
    config = LlamaForCausalLM.from_preset("debug").config.to_hf_dict()
    process = EngineProcess(config, dtype="float64", timeout_s=60)
    try:
        zeros = {
            n: torch.zeros(s.shape, dtype=torch.float64)
            for n, s in LlamaForCausalLM.from_preset("debug").weight_specs().items()
        }
        assert process.weight_digests() == weight_checksums(zeros)
    finally:
        process.close()


def test_a_killed_trainer_leaves_no_server_behind(tmp_path):
    # A trainer process holding an EngineProcess is killed outright (no close, no atexit): its
    # server, now nobody's child, must notice and exit on its own.
    script = tmp_path / "trainer.py"
    script.write_text(
        "import sys\n"
        "from weightsync.trainer.engine_process import EngineProcess\n"
        "engine = EngineProcess('debug', timeout_s=60)\n"
        "print(engine.pid, flush=True)\n"
        "sys.stdin.read()\n"  # holds the server until killed
    )
    trainer = subprocess.Popen(
        [sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        line = trainer.stdout.readline()  # bounded: EngineProcess gives up after 60 s
        assert line.strip().isdigit(), f"the trainer did not start its engine: {line!r}"
        server_pid = int(line)
        server = os.pidfd_open(server_pid)  # readable once the server has exited
    finally:
        trainer.kill()
        trainer.wait(60)
    try:
        readable, _, _ = select.select([server], [], [], 30)
        assert readable, f"the server (pid {server_pid}) outlived its killed trainer by 30 s"
    finally:
        os.close(server)


def test_a_closed_engine_says_so():
    process = EngineProcess("debug", engine_config=EngineConfig(num_kv_blocks=64), timeout_s=60)
    process.close()
    with pytest.raises(EngineStateError, match="closed"):
        process.generate(["hi"], greedy(2))
    with pytest.raises(EngineStateError, match="closed"):
        process.pause_generation(mode="keep")
    process.close()  # twice is harmless
