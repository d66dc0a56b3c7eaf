"""gloo broadcast: weightsync against a single raw broadcast and a per-tensor loop, in one run.

Every figure is timed the same way: from the moment the trainer starts sending until the last
receiver reports that its tensors hold the new bytes. After one warm-up run of each (first-touch
page faults and connection set-up are not what is compared), the modes take turns, one run each
per round, so that a busy moment of the machine hits all of them alike; each figure is the median
over the rounds (the best run is reported beside it).

- `raw`: one broadcast of one preallocated buffer holding all the bytes (the one-call baseline).
- `naive`: one blocking broadcast per tensor into preallocated tensors.
- `weightsync`: `trainer_send_weights` from an ordinary module (separate parameter tensors)
  into the receivers' parameters, which the receiving engine laid out once in the bucket layout
  (`flat_tensors`), so buckets land in place: one pack copy on the trainer, none on receivers.
- `weightsync_flat`: the same from a trainer module laid out by `flatten_module`: no copy at all.
- `weightsync_separate`: both sides ordinary (separate tensors): pack, pipeline, unpack. Its
  receivers hold the bucket buffers, so `receiver_peak_extra_bytes` is measured there.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

import torch

from _rigs import (
    CommandProcess,
    allocate_tensors,
    fill_tensors,
    serve_commands,
)
from model_specs import llama_like_specs
from weightsync import weight_checksums
from weightsync.transfer.base import TensorSpec, WeightTransferUpdateInfo
from weightsync.transfer.group import BroadcastGroup
from weightsync.transfer.nccl import (
    GlooWeightTransferEngine,
    NCCLTrainerSendWeightsArgs,
    trainer_init,
    trainer_send_weights,
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

    def init(init_info: dict[str, Any], mode: str, use_flat: bool) -> None:
        params = flat if use_flat else separate
        engine = GlooWeightTransferEngine(worker_index=rank - 1, params=params)
        engine.init_transfer_engine(init_info)
        state[mode] = engine

    def update(update_info: dict[str, Any], mode: str, use_flat: bool) -> dict[str, Any]:
        params = flat if use_flat else separate

        def load_weights(pairs: list[tuple[str, torch.Tensor]]) -> None:
            for name, tensor in pairs:
                params[name].copy_(tensor)

        stats = state[mode].receive_weights(update_info, load_weights)
        return {"direct_buckets": stats.direct_buckets, "num_buckets": stats.num_buckets}

    def digests(use_flat: bool) -> dict[str, Any]:
        return {"digests": weight_checksums(flat if use_flat else separate)}

    def zero(use_flat: bool) -> None:
        for tensor in (flat if use_flat else separate).values():
            tensor.zero_()

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
            "zero": zero,
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

        def naive_send() -> None:
            for tensor in separate.values():
                if tensor.numel():
                    raw_group.broadcast(tensor.view(-1).view(torch.uint8), "naive").wait()

        modes: dict[str, tuple[str, Any, dict[str, Any]]] = {
            "raw": ("raw", lambda: raw_group.broadcast(flat_buffer, "raw").wait(), {}),
            "naive": ("naive", naive_send, {}),
        }
        groups = []
        for name, use_flat, tensors in (
            ("weightsync", True, separate),
            ("weightsync_flat", True, flat),
            ("weightsync_separate", False, separate),
        ):
            group = trainer_init(
                world_size=world_size,
                backend="gloo",
                bucket_size_bytes=BUCKET_SIZE_BYTES,
                num_buffers=NUM_BUFFERS,
                timeout_s=TIMEOUT_S,
            )
            groups.append(group)
            for receiver in receivers:
                receiver.start("init", init_info=group.init_info, mode=name, use_flat=use_flat)
            group.connect()
            for receiver in receivers:
                receiver.reply()
            args = NCCLTrainerSendWeightsArgs(group, update_info)
            send = lambda tensors=tensors, args=args: trainer_send_weights(tensors.items(), args)  # noqa: E731
            fields = {"update_info": update_info, "mode": name, "use_flat": use_flat}
            modes[name] = ("update", send, fields)

        # Warm-up, which also checks each update mode on its own: the receivers' tensors are
        # zeroed first and must hold the trainer's bytes after it. Receiver peak memory is read
        # around each engine's first update, buffer allocation included.
        want = weight_checksums(separate)  # flat holds the same values
        peak_extra = 0
        for name, (op, send, fields) in modes.items():
            if op == "update":
                for receiver in receivers:
                    receiver.call("zero", use_flat=fields["use_flat"])
            baselines = [receiver.call("reset_peak")["peak_rss"] for receiver in receivers]
            _timed(receivers, op, send, **fields)
            peaks = [receiver.call("peak")["peak_rss"] for receiver in receivers]
            if name == "weightsync_separate":
                peak_extra = max(p - b for p, b in zip(peaks, baselines, strict=True))
            if op == "update":
                for receiver in receivers:
                    got = receiver.call("digests", use_flat=fields["use_flat"])["digests"]
                    if got != want:
                        raise AssertionError(
                            f"{name}: a receiver's tensors differ from the trainer's"
                        )
        runs: dict[str, list[float]] = {name: [] for name in modes}
        direct: dict[str, int] = {}
        num_buckets = 0
        for _ in range(repeats):
            for name, (op, send, fields) in modes.items():
                seconds, replies = _timed(receivers, op, send, **fields)
                runs[name].append(seconds)
                if op == "update":
                    direct[name] = min(reply["direct_buckets"] for reply in replies)
                    num_buckets = replies[0]["num_buckets"]
        for group in groups:
            group.close()
        raw_group.close()
    finally:
        for receiver in receivers:
            receiver.close()
    median = {name: total / statistics.median(r) / 1e9 for name, r in runs.items()}
    best = {name: total / min(r) / 1e9 for name, r in runs.items()}
    for name in modes:
        log(
            f"[{num_receivers} receivers] {name}: median {median[name]:.2f} GB/s, best {best[name]:.2f}"
        )
    log(f"[{num_receivers} receivers] receiver peak extra (separate) {peak_extra / 2**20:.0f} MiB")
    return {
        "raw_gbps": median["raw"],
        "naive_gbps": median["naive"],
        "weightsync_gbps": median["weightsync"],
        "weightsync_flat_gbps": median["weightsync_flat"],
        "ratio_vs_raw": median["weightsync"] / median["raw"],
        "ratio_vs_naive": median["weightsync"] / median["naive"],
        "flat_ratio_vs_raw": median["weightsync_flat"] / median["raw"],
        "weightsync_separate_gbps": median["weightsync_separate"],
        "separate_ratio_vs_naive": median["weightsync_separate"] / median["naive"],
        "receiver_peak_extra_bytes": peak_extra,
        "num_buckets": num_buckets,
        "flat_direct_buckets": direct["weightsync_flat"],
        "best_gbps": best,
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
