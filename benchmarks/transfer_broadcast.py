"""gloo broadcast: weightsync against a single raw broadcast and a per-tensor loop, in one run.

Every figure is timed the same way: from the moment the trainer starts sending until the last
receiver reports that its tensors hold the new bytes. Each is the best of `repeats` runs after a
warm-up run (first-touch page faults and connection set-up are not what is compared).

- `raw`: one broadcast of one preallocated buffer holding all the bytes (the wire ceiling).
- `naive`: one blocking broadcast per tensor into preallocated tensors.
- `weightsync`: `trainer_send_weights` from separate parameter tensors into the receivers'
  separate parameters (pack, pipeline, unpack).
- `weightsync_flat`: the same between modules laid out by `flatten_module` on both sides (no pack
  or unpack copy).
"""

from __future__ import annotations

import os
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

import torch

from model_specs import llama_like_specs
from weightsync.transfer.base import TensorSpec, WeightTransferUpdateInfo
from weightsync.transfer.group import BroadcastGroup
from weightsync.transfer.nccl import (
    GlooWeightTransferEngine,
    NCCLTrainerSendWeightsArgs,
    trainer_init,
    trainer_send_weights,
)
from weightsync.transfer.worker import (
    CommandProcess,
    allocate_tensors,
    fill_tensors,
    serve_commands,
    tensor_digests,
)

BUCKET_SIZE_BYTES = 256 << 20
NUM_BUFFERS = 2
TIMEOUT_S = 120.0


def _receiver_main(
    conn: Connection, update_info: dict[str, Any], rank: int, world_size: int
) -> None:
    specs = WeightTransferUpdateInfo(**update_info).specs()
    separate = allocate_tensors(specs, flat=False)
    flat = allocate_tensors(specs, flat=True)
    flat_buffer = _flat_buffer(flat, specs)
    state: dict[str, Any] = {}

    def join_raw(port: int) -> None:
        group = BroadcastGroup(
            backend="gloo",
            master_address="127.0.0.1",
            master_port=port,
            rank=rank,
            world_size=world_size,
            timeout_s=TIMEOUT_S,
        )
        group.connect()
        state["raw"] = group

    def raw() -> None:
        state["raw"].broadcast(flat_buffer, "raw").wait()

    def naive() -> None:
        for tensor in separate.values():
            if tensor.numel():
                state["raw"].broadcast(tensor.view(-1).view(torch.uint8), "naive").wait()

    def init(init_info: dict[str, Any], use_flat: bool) -> None:
        params = flat if use_flat else separate
        engine = GlooWeightTransferEngine(worker_index=rank - 1, params=params)
        engine.init_transfer_engine(init_info)
        state["engine"], state["params"] = engine, params

    def update(update_info: dict[str, Any]) -> dict[str, Any]:
        params = state["params"]

        def load_weights(pairs: list[tuple[str, torch.Tensor]]) -> None:
            for name, tensor in pairs:
                params[name].copy_(tensor)

        stats = state["engine"].receive_weights(update_info, load_weights)
        return {"direct_buckets": stats.direct_buckets, "num_buckets": stats.num_buckets}

    def digests(use_flat: bool) -> dict[str, Any]:
        return {"digests": tensor_digests(flat if use_flat else separate)}

    def peak() -> dict[str, int]:
        with open("/proc/self/status") as status:
            fields = dict(line.split(":", 1) for line in status)
        return {"peak_rss": int(fields["VmHWM"].split()[0]) * 1024}

    def reset_peak() -> dict[str, int]:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return peak()

    serve_commands(
        conn,
        {
            "join_raw": join_raw,
            "raw": raw,
            "naive": naive,
            "init": init,
            "update": update,
            "digests": digests,
            "reset_peak": reset_peak,
            "peak": peak,
        },
    )


def _flat_buffer(flat: dict[str, torch.Tensor], specs: list[TensorSpec]) -> torch.Tensor:
    """The whole flat buffer behind `flat` (all the bytes, as one uint8 tensor)."""
    first = flat[specs[0].name]
    last = flat[specs[-1].name]
    end = last.data_ptr() + last.numel() * last.element_size() - first.data_ptr()
    buffer = torch.empty(0, dtype=torch.uint8)
    buffer.set_(first.untyped_storage(), 0, (end,), (1,))
    return buffer


def _timed(
    receivers: list[CommandProcess], op: str, send: Any, **fields: Any
) -> tuple[float, list[dict[str, Any]]]:
    for receiver in receivers:
        receiver.start(op, **fields)
    start = time.perf_counter()
    send()
    replies = [receiver.reply() for receiver in receivers]
    return time.perf_counter() - start, replies


def _best(
    receivers: list[CommandProcess], op: str, send: Any, repeats: int, **fields: Any
) -> tuple[float, list[dict[str, Any]]]:
    """Best of `repeats` timed runs after a warm-up; also returns the last run's replies."""
    _timed(receivers, op, send, **fields)
    runs = [_timed(receivers, op, send, **fields) for _ in range(repeats)]
    return min(seconds for seconds, _ in runs), runs[-1][1]


def _run_for(num_receivers: int, specs: list[TensorSpec], repeats: int, log: Any) -> dict[str, Any]:
    update_info = WeightTransferUpdateInfo.from_specs(specs).to_dict()
    world_size = 1 + num_receivers
    total = sum(s.nbytes for s in specs)
    separate = allocate_tensors(specs, flat=False)
    flat = allocate_tensors(specs, flat=True)
    fill_tensors(separate, 1)
    fill_tensors(flat, 1)
    flat_buffer = _flat_buffer(flat, specs)
    receivers = [
        CommandProcess(_receiver_main, (update_info, rank, world_size), TIMEOUT_S)
        for rank in range(1, world_size)
    ]
    try:
        raw_group = BroadcastGroup(
            backend="gloo",
            master_address="127.0.0.1",
            master_port=0,
            rank=0,
            world_size=world_size,
            timeout_s=TIMEOUT_S,
        )
        for receiver in receivers:
            receiver.start("join_raw", port=raw_group.port)
        raw_group.connect()
        for receiver in receivers:
            receiver.reply()
        seconds: dict[str, float] = {}
        seconds["raw"], _ = _best(
            receivers,
            "raw",
            lambda: raw_group.broadcast(flat_buffer, "raw").wait(),
            repeats,
        )
        log(f"[{num_receivers} receivers] raw: {total / seconds['raw'] / 1e9:.2f} GB/s")

        def naive_send() -> None:
            for tensor in separate.values():
                if tensor.numel():
                    raw_group.broadcast(tensor.view(-1).view(torch.uint8), "naive").wait()

        seconds["naive"], _ = _best(receivers, "naive", naive_send, repeats)
        log(f"[{num_receivers} receivers] naive: {total / seconds['naive'] / 1e9:.2f} GB/s")
        raw_group.close()

        peak_extra = 0
        direct: dict[str, int] = {}
        for name, use_flat, tensors in (
            ("weightsync", False, separate),
            ("weightsync_flat", True, flat),
        ):
            group = trainer_init(
                world_size=world_size,
                backend="gloo",
                bucket_size_bytes=BUCKET_SIZE_BYTES,
                num_buffers=NUM_BUFFERS,
                timeout_s=TIMEOUT_S,
            )
            for receiver in receivers:
                receiver.start("init", init_info=group.init_info, use_flat=use_flat)
            group.connect()
            for receiver in receivers:
                receiver.reply()
            # Peak memory is read around the engine's first update, buffers allocation included.
            baselines = [receiver.call("reset_peak")["peak_rss"] for receiver in receivers]
            args = NCCLTrainerSendWeightsArgs(group, update_info)
            seconds[name], replies = _best(
                receivers,
                "update",
                lambda tensors=tensors, args=args: trainer_send_weights(tensors.items(), args),
                repeats,
                update_info=update_info,
            )
            peaks = [receiver.call("peak")["peak_rss"] for receiver in receivers]
            extra = max(p - b for p, b in zip(peaks, baselines, strict=True))
            if not use_flat:
                peak_extra = extra
            want = tensor_digests(tensors)
            for receiver in receivers:
                if receiver.call("digests", use_flat=use_flat)["digests"] != want:
                    raise AssertionError(f"{name}: a receiver's tensors differ from the trainer's")
            direct[name] = min(reply["direct_buckets"] for reply in replies)
            group.close()
            log(
                f"[{num_receivers} receivers] {name}: {total / seconds[name] / 1e9:.2f} GB/s, "
                f"peak extra {extra / 2**20:.0f} MiB"
            )
    finally:
        for receiver in receivers:
            receiver.close()
    gbps = {name: total / s / 1e9 for name, s in seconds.items()}
    return {
        "raw_gbps": gbps["raw"],
        "naive_gbps": gbps["naive"],
        "weightsync_gbps": gbps["weightsync"],
        "weightsync_flat_gbps": gbps["weightsync_flat"],
        "ratio_vs_raw": gbps["weightsync"] / gbps["raw"],
        "ratio_vs_naive": gbps["weightsync"] / gbps["naive"],
        "flat_ratio_vs_raw": gbps["weightsync_flat"] / gbps["raw"],
        "receiver_peak_extra_bytes": peak_extra,
        "flat_direct_buckets": direct["weightsync_flat"],
        "num_buckets": replies[0]["num_buckets"],
    }


def run(size_mb: int, repeats: int, verbose: bool) -> dict[str, Any]:
    """Runs the benchmark with 1 and 2 receivers; returns the JSON-ready figures."""

    def log(message: str) -> None:
        if verbose:
            print(message, file=sys.stderr, flush=True)

    torch.set_num_threads(1)  # the receivers take the other core's share
    specs = llama_like_specs(size_mb << 20)
    one = _run_for(1, specs, repeats, log)
    two = _run_for(2, specs, repeats, log)
    return {
        "backend": "gloo",
        "total_bytes": sum(s.nbytes for s in specs),
        "num_tensors": len(specs),
        "bucket_size_bytes": BUCKET_SIZE_BYTES,
        "num_buffers": NUM_BUFFERS,
        "repeats": repeats,
        **one,
        "two_receivers": two,
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
    }
