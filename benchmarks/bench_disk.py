"""The `disk` backend against a raw read of the same files, paired, printed as JSON.

    python benchmarks/bench_disk.py --json
    python benchmarks/bench_disk.py --size-mb 512 --shards 4 --repeats 7 --json

A trainer's checkpoint directory (safetensors, a Llama-shaped bf16 model of about `size_mb`
MiB, in `shards` files) is written once. Each round then times, back to back:

- `raw_read`: every file read whole into a buffer allocated beforehand (`readinto`): the
  ceiling of getting those bytes from the page cache into memory;
- `disk_update`: an engine's whole update from the directory, prime-rl's `weight_dir` form
  (`LLMEngine.update_weights`): headers read and checked against the model, the files mapped
  and copied into the weights, the transaction finished, the version moved.

The files are in the page cache (the first round warms it up and is not counted): both sides
read from memory, so the figure is the backend's own cost, not the storage's. Each figure is the
median over `repeats` rounds; `disk_vs_raw_read` is `raw_read_s / disk_update_s` (1.0: as fast
as the raw read; the goal is at least 0.8). The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import describe_machine  # benchmarks/machine.py, beside this script
from transfer_staging import _config, _model
from weightsync import EngineConfig, LLMEngine
from weightsync.transfer._safetensors import write_safetensors


def _write_checkpoint(named: list[tuple[str, torch.Tensor]], directory: Path, shards: int) -> None:
    """Writes `named` as `shards` safetensors files with their index, as `save_pretrained` does."""
    per_shard = -(-len(named) // shards)
    weight_map = {}
    for index in range(shards):
        part = named[index * per_shard : (index + 1) * per_shard]
        file = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        write_safetensors(dict(part), directory / file)
        weight_map.update({name: file for name, _ in part})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def _raw_read(files: list[Path], buffers: list[torch.Tensor]) -> None:
    for path, buffer in zip(files, buffers, strict=True):
        with open(path, "rb", buffering=0) as f:
            view = memoryview(buffer.numpy())
            got = 0
            while got < len(view):
                n = f.readinto(view[got:])
                if not n:
                    raise OSError(f"{path} ended after {got} bytes")
                got += n


def run(size_mb: int = 512, shards: int = 4, repeats: int = 7, verbose: bool = True) -> dict:
    torch.set_num_threads(1)
    config = _config(size_mb)
    policy = _model(config, seed=1)
    engine = LLMEngine(
        _model(config, seed=0), engine_config=EngineConfig(num_kv_blocks=16, max_model_len=256)
    )
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        _write_checkpoint(list(policy.named_weights()), directory, shards)
        files = sorted(directory.glob("*.safetensors"))
        buffers = [torch.empty(p.stat().st_size, dtype=torch.uint8) for p in files]
        seconds: dict[str, list[float]] = {"raw_read": [], "disk_update": []}
        for round_index in range(repeats + 1):
            start = time.perf_counter()
            _raw_read(files, buffers)
            raw = time.perf_counter() - start
            start = time.perf_counter()
            engine.update_weights({"weight_dir": str(directory)})
            disk = time.perf_counter() - start
            if round_index:  # the first round warms up the page cache and the mappings
                seconds["raw_read"].append(raw)
                seconds["disk_update"].append(disk)
            if verbose:
                print(f"round {round_index}: raw read {raw:.3f} s, disk update {disk:.3f} s")
        file_bytes = sum(p.stat().st_size for p in files)
    assert all(
        torch.equal(a, b)
        for (_, a), (_, b) in zip(engine.model.named_weights(), policy.named_weights(), strict=True)
    ), "the update did not land"
    model_bytes = sum(t.numel() * t.element_size() for _, t in policy.named_weights())
    raw_s = statistics.median(seconds["raw_read"])
    disk_s = statistics.median(seconds["disk_update"])
    return {
        "benchmark": "disk",
        "model_bytes": model_bytes,
        "file_bytes": file_bytes,
        "files": shards,
        "num_tensors": len(list(policy.named_weights())),
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "raw_read_s": raw_s,
        "raw_read_gbps": file_bytes / raw_s / 1e9,
        "disk_update_s": disk_s,
        "disk_update_gbps": model_bytes / disk_s / 1e9,
        "disk_vs_raw_read": raw_s / disk_s,
        "rounds_s": seconds,
        "load_average_1min": os.getloadavg()[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size-mb", type=int, default=512, help="model size in MiB")
    parser.add_argument("--shards", type=int, default=4, help="safetensors files")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds (median)")
    parser.add_argument("--json", action="store_true", help="print only the JSON result line")
    args = parser.parse_args()
    result = run(args.size_mb, args.shards, args.repeats, verbose=not args.json)
    result["machine"] = describe_machine()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
