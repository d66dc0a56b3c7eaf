"""Staging's cost: an engine's weight update with and without `weight_update_staging`, one run.

Two engines of the same Llama-shaped model (bf16, about `size_mb`) live in this process, one
staged and one not, and take the same update from an in-process IPC sender (packed, default
buckets) in turns, round after round. Each figure is the median over `repeats` rounds after one
warm-up round:

- `unstaged_s` / `staged_s`: wall time of `sender.send` (start, update, finish) into that engine,
  and `unstaged_gbps` / `staged_gbps` the same as throughput (model bytes per second);
- `staged_bytes`: the bytes a staged update copies and holds until it finishes (every weight it
  touches, here all of them);
- `unstaged_cold_peak_extra_bytes` / `staged_cold_peak_extra_bytes`: the process's peak resident
  memory during the first (warm-up) update above its resident memory just before (Linux `VmHWM`
  after a reset). Only the first update is measured so: the C allocator keeps freed copies
  resident for reuse, so later updates reuse that memory and show no new peak.
"""

from __future__ import annotations

import statistics
import time

import torch

from weightsync import EngineConfig, LlamaConfig, LlamaForCausalLM, LLMEngine
from weightsync.trainer import IPCWeightSender


def _rss(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> int:
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")
    return _rss("VmRSS")


def _config(size_mb: int) -> LlamaConfig:
    """An 8-layer Llama shape whose bf16 weights come to about `size_mb` MiB."""

    def config(hidden: int) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=32000,
            hidden_size=hidden,
            intermediate_size=hidden * 11 // 4 // 64 * 64,
            num_hidden_layers=8,
            num_attention_heads=hidden // 64,
            num_key_value_heads=max(1, hidden // 256),
        )

    hidden = 256
    while _weight_bytes(config(hidden + 256)) <= size_mb << 20:
        hidden += 256
    return config(hidden)


def _weight_bytes(config: LlamaConfig) -> int:
    with torch.device("meta"):  # shapes only, no memory
        model = LlamaForCausalLM(config, dtype=torch.bfloat16)
    return sum(t.numel() * t.element_size() for _, t in model.named_weights())


def _model(config: LlamaConfig, seed: int) -> LlamaForCausalLM:
    model = LlamaForCausalLM(config, dtype=torch.bfloat16)
    model.init_weights(seed)
    return model


def run(size_mb: int = 512, repeats: int = 7, verbose: bool = True) -> dict[str, object]:
    torch.set_num_threads(1)
    config = _config(size_mb)
    policy = _model(config, seed=1)
    engines = {
        staged: LLMEngine(
            _model(config, seed=0),
            engine_config=EngineConfig(
                num_kv_blocks=16, max_model_len=256, weight_update_staging=staged
            ),
        )
        for staged in (False, True)
    }
    names = {False: "unstaged", True: "staged"}
    seconds: dict[bool, list[float]] = {False: [], True: []}
    cold_peaks: dict[bool, int] = {}
    senders = {staged: IPCWeightSender([engine]) for staged, engine in engines.items()}
    try:
        for sender in senders.values():
            sender.connect()
        for round_index in range(repeats + 1):
            for staged, sender in senders.items():
                before = _reset_peak()
                start = time.perf_counter()
                sender.send(policy.named_weights(), weight_version=round_index)
                elapsed = time.perf_counter() - start
                if round_index:  # the first round warms up mappings and allocations
                    seconds[staged].append(elapsed)
                else:
                    cold_peaks[staged] = _rss("VmHWM") - before
                if verbose:
                    print(f"round {round_index} {names[staged]}: {elapsed:.3f} s")
    finally:
        for sender in senders.values():
            sender.close()
    model_bytes = sum(t.numel() * t.element_size() for _, t in policy.named_weights())
    result: dict[str, object] = {
        "benchmark": "staging",
        "model_bytes": model_bytes,
        "repeats": repeats,
        "staged_bytes": model_bytes,
    }
    for staged in (False, True):
        result[f"{names[staged]}_s"] = statistics.median(seconds[staged])
        result[f"{names[staged]}_gbps"] = model_bytes / statistics.median(seconds[staged]) / 1e9
        result[f"{names[staged]}_cold_peak_extra_bytes"] = cold_peaks[staged]
    result["staging_time_ratio"] = result["staged_s"] / result["unstaged_s"]  # type: ignore[operator]
    return result
