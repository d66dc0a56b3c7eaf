"""Weight updates over HTTP while completions stream: 32 streams, 5 keep-mode updates.

Each update is gated on an observable event, not on timing: the trainer arms each keep pause
(`/arm_pause`) to land when every stream has `TOKENS_PER_VERSION` more tokens, so the five
updates land inside the streams however slow the machine is, and each version's share of the
tokens is known.
"""

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
from serve_support import SRC, Server

from weightsync import EngineConfig, LlamaForCausalLM, LLMEngine, SamplingParams
from weightsync.trainer import BroadcastWeightSender, HTTPEngineClient

NUM_STREAMS = 32
NUM_UPDATES = 5
MAX_TOKENS = 480  # the debug model's positions (512) hold the prompt and this many
TOKENS_PER_VERSION = 80  # the pauses land at 80, 160, ..., 400 tokens: before each stream ends
WAIT_S = 120
GREEDY_HELLO = {"prompt": "hello", "max_tokens": 8, "temperature": 0}


class Streams:
    """32 streaming completions on threads, and a condition to wait for their progress on."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.changed = threading.Condition()
        self.token_ids: list[list[int]] = [[] for _ in range(NUM_STREAMS)]
        self.versions: list[list[int]] = [[] for _ in range(NUM_STREAMS)]
        self.finish: list[str | None] = [None] * NUM_STREAMS
        self.usage: list[int | None] = [None] * NUM_STREAMS
        self.accepted = [False] * NUM_STREAMS
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(NUM_STREAMS)]
        for thread in self.threads:
            thread.start()

    def _run(self, index: int) -> None:
        body = {"prompt": f"rollout {index}:", "max_tokens": MAX_TOKENS, "ignore_eos": True,
                "temperature": 1.0, "seed": index, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        try:
            with httpx.stream("POST", f"{self.base_url}/v1/completions", json=body,
                              timeout=WAIT_S) as response:  # fmt: skip
                for line in response.iter_lines():
                    if line == ": accepted":  # the server says the request is in the engine
                        with self.changed:
                            self.accepted[index] = True
                            self.changed.notify_all()
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[len("data: ") :])
                    with self.changed:
                        if chunk.get("usage"):
                            self.usage[index] = chunk["usage"]["completion_tokens"]
                        for choice in chunk["choices"]:
                            self.token_ids[index] += choice["token_ids"]
                            self.versions[index] += choice["weight_versions"]
                            self.finish[index] = choice["finish_reason"]
                        self.changed.notify_all()
        except BaseException as exc:
            self.errors.append(exc)
            with self.changed:
                self.changed.notify_all()

    def wait_until_accepted(self) -> None:
        with self.changed:
            assert self.changed.wait_for(lambda: self.errors or all(self.accepted), WAIT_S)
        assert not self.errors, self.errors

    def join(self) -> None:
        for thread in self.threads:
            thread.join(WAIT_S)
        assert not self.errors, self.errors


@pytest.fixture
def server():
    server = Server("debug", "--port", "0", "--weight-transfer-config.backend", "gloo")
    yield server
    server.stop()
    server.kill()


def test_streams_survive_keep_updates_with_every_token_once_and_versions_in_order(server):
    engine = HTTPEngineClient(server.base_url, timeout_s=WAIT_S)

    def arm_keep_pause(after_tokens: int) -> None:
        armed = httpx.post(f"{server.base_url}/arm_pause", params={"after_tokens": after_tokens},
                           timeout=WAIT_S)  # fmt: skip
        assert armed.json() == {"status": "armed"}

    with BroadcastWeightSender([engine], backend="gloo", timeout_s=60) as sender:
        # Queued while paused, the streams start together at resume: in step with each other.
        engine.pause_generation(mode="keep")
        streams = Streams(server.base_url)
        streams.wait_until_accepted()
        for version in range(1, NUM_UPDATES + 1):
            arm_keep_pause(version * TOKENS_PER_VERSION)  # while paused: nothing runs past it
            engine.resume_generation()
            policy = LlamaForCausalLM.from_preset("debug", seed=100 + version)
            # pause(keep) returns once the armed pause landed; update; resume at the next turn.
            engine.pause_generation(mode="keep")
            assert engine.is_paused()
            sender.send(policy.named_weights(), weight_version=version)
            assert engine.weight_version == version
        engine.resume_generation()
        streams.join()
    engine.close()
    for ids, versions, finish, usage in zip(
        streams.token_ids, streams.versions, streams.finish, streams.usage, strict=True
    ):
        assert finish == "length"
        # No token lost or duplicated: what arrived is what the engine generated, in full.
        assert len(ids) == len(versions) == usage == MAX_TOKENS
        assert versions == sorted(versions)
        assert sorted(set(versions)) == list(range(NUM_UPDATES + 1))
        assert versions[-1] == NUM_UPDATES
        # Started together, every stream had exactly its first 80 tokens from version 0; each
        # later pause landed once the slowest stream had its next 80 (streams recomputing their
        # KV after a pause do not all start generating at the same step).
        assert versions.count(0) == TOKENS_PER_VERSION
        for version in range(1, NUM_UPDATES + 1):
            assert versions.index(version) >= version * TOKENS_PER_VERSION


def test_a_vllm_style_http_trainer_script_runs_unchanged(server):
    before = httpx.post(f"{server.base_url}/v1/completions", json=GREEDY_HELLO).json()
    script = Path(__file__).with_name("vllm_style_trainer.py")
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    done = subprocess.run([sys.executable, str(script), server.base_url], capture_output=True,
                          text=True, timeout=WAIT_S, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["weight_version"] == "step-2"
    # The next completion comes from the trainer's weights.
    reference = LLMEngine(LlamaForCausalLM.from_preset("debug", seed=7),
                          engine_config=EngineConfig(num_kv_blocks=64))  # fmt: skip
    expected = reference.generate(["hello"], SamplingParams(temperature=0, max_tokens=8))
    assert result["text"] == expected[0].outputs[0].text != before["choices"][0]["text"]
