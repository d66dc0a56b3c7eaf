"""A whole weight sync through a live `weightsync serve`, against the bare transfer, in one run.

- `http`: `sync_weights` through an `HTTPEngineClient`: `/pause` (keep), `/start_weight_update`,
  `/update_weights` while the trainer broadcasts, `/finish_weight_update`, `/resume`; timed by
  the trainer from the first call to the last answer.
- `bare`: the same bytes broadcast by `trainer_send_weights` into a receiver process holding the
  same model, with the same wire parameters and no server; timed from the start of the send
  until the receiver reports the weights loaded.

Both receivers load into a Llama of about `--size-mb` (bf16) through the gloo backend. The modes
take turns, one run each per round (in alternating order) after a warm-up of each; each figure
is the median over the rounds. `http_overhead_ratio` = (http - bare) / bare.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from machine import describe_machine  # benchmarks/machine.py, beside this script
from weightsync import (
    LlamaConfig,
    LlamaForCausalLM,
    NCCLTrainerSendWeightsArgs,
    WeightTransferUpdateInfo,
    trainer_init,
    trainer_send_weights,
)
from weightsync.trainer import BroadcastWeightSender, HTTPEngineClient, sync_weights

BUCKET_SIZE_BYTES = 256 << 20
TIMEOUT_S = 300.0
SRC = Path(__file__).resolve().parents[1] / "src"

# The bare receiver: the engine's model and the gloo receiver, fed update infos on stdin.
_RECEIVER = """
import json, os, sys
import torch
from weightsync import LlamaConfig, LlamaForCausalLM, WeightTransferConfig
torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))  # as weightsync serve, before its first step
config = LlamaConfig.from_hf_dict(json.loads(sys.argv[1]))
model = LlamaForCausalLM(config, dtype=torch.bfloat16)
engine = WeightTransferConfig(backend="gloo").create_engine(
    worker_index=0, expected_specs=model.weight_specs(), params=model.unfused_parameters())
engine.init_transfer_engine(json.loads(sys.argv[2]))
print("joined", flush=True)
for line in sys.stdin:
    engine.receive_weights(json.loads(line), model.load_weights)
    print("done", flush=True)
engine.shutdown()
"""


def model_config(size_mb: int) -> LlamaConfig:
    """A Llama of about `size_mb` MiB of bf16 weights (hidden 2048, as many layers as fit)."""
    hidden, inter = 2048, 5632
    per_layer = 2 * (4 * hidden * hidden + 3 * hidden * inter)
    layers = max(1, round((size_mb << 20) / per_layer))
    return LlamaConfig(
        hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=128,
    )  # fmt: skip


def start_server(model_dir: str) -> tuple[subprocess.Popen[str], str]:
    command = [sys.executable, "-m", "weightsync.serve.cli", "serve", model_dir,
               "--load-format", "dummy", "--dtype", "bfloat16", "--port", "0",
               "--num-kv-blocks", "8", "--max-num-seqs", "4", "--max-num-batched-tokens", "128",
               "--weight-transfer-config.backend", "gloo", "--log-level", "warning"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
    assert server.stderr is not None
    for line in server.stderr:
        if match := re.search(r"listening on (http://\S+)", line):
            return server, match.group(1)
    raise RuntimeError("weightsync serve did not start")


def run(*, size_mb: int, repeats: int, verbose: bool) -> dict[str, Any]:
    config = model_config(size_mb)
    torch.manual_seed(0)
    policy = LlamaForCausalLM(config, dtype=torch.bfloat16)
    pairs = list(policy.named_weights())
    num_bytes = sum(t.numel() * t.element_size() for _, t in pairs)
    with tempfile.TemporaryDirectory() as model_dir:
        (Path(model_dir) / "config.json").write_text(json.dumps(config.to_hf_dict()))
        server, url = start_server(model_dir)
        group = trainer_init(world_size=2, backend="gloo", bucket_size_bytes=BUCKET_SIZE_BYTES,
                             timeout_s=TIMEOUT_S)  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(SRC)}
        receiver = subprocess.Popen(
            [sys.executable, "-c", _RECEIVER, json.dumps(config.to_hf_dict()),
             json.dumps(group.init_info)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        assert receiver.stdin is not None and receiver.stdout is not None
        group.connect()
        assert receiver.stdout.readline().strip() == "joined"
        update_info = WeightTransferUpdateInfo.from_named_tensors(pairs).to_dict()

        def bare() -> float:
            assert receiver.stdin is not None and receiver.stdout is not None
            start = time.perf_counter()
            receiver.stdin.write(json.dumps(update_info) + "\n")
            receiver.stdin.flush()
            trainer_send_weights(pairs, NCCLTrainerSendWeightsArgs(group, update_info))
            assert receiver.stdout.readline().strip() == "done"
            return time.perf_counter() - start

        client = HTTPEngineClient(url, timeout_s=TIMEOUT_S)
        sender = BroadcastWeightSender([client], backend="gloo", timeout_s=TIMEOUT_S,
                                       bucket_size_bytes=BUCKET_SIZE_BYTES)  # fmt: skip
        version = 0

        def http() -> float:
            nonlocal version
            version += 1
            start = time.perf_counter()
            sync_weights(sender, pairs, weight_version=version, mode="keep")
            return time.perf_counter() - start

        try:
            sender.connect()
            times: dict[str, list[float]] = {"http": [], "bare": []}
            bare(), http()  # warm-up: first touches and connections are not what is compared
            modes = [("http", http), ("bare", bare)]
            for round_index in range(repeats):
                # Each round the other goes first, so that what one run leaves behind (freed
                # buffers, a busy moment) does not always fall on the same mode.
                for name, fn in modes if round_index % 2 == 0 else modes[::-1]:
                    times[name].append(fn())
                if verbose:
                    print(f"round {round_index}: http {times['http'][-1]:.3f} s, "
                          f"bare {times['bare'][-1]:.3f} s", file=sys.stderr)  # fmt: skip
            assert client.weight_version == version
        finally:
            sender.close()
            client.close()
            group.close()
            receiver.stdin.close()
            receiver.wait(60)
            server.terminate()
            server.wait(60)
    medians = {name: statistics.median(values) for name, values in times.items()}
    return {
        "benchmark": "transfer_http",
        "backend": "gloo",
        "num_bytes": num_bytes,
        "num_tensors": len(pairs),
        "repeats": repeats,
        "http_s": medians["http"],
        "bare_s": medians["bare"],
        "http_best_s": min(times["http"]),
        "bare_best_s": min(times["bare"]),
        "http_gbps": num_bytes / medians["http"] / 1e9,
        "bare_gbps": num_bytes / medians["bare"] / 1e9,
        "http_overhead_ratio": (medians["http"] - medians["bare"]) / medians["bare"],
        "machine": describe_machine(),
    }
