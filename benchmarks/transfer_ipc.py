"""IPC (shared memory on CPUs): weightsync against a plain memcpy and a pickle pipe, in one run.

This process is the trainer; receivers are separate processes. Every transfer figure is timed
from the moment the trainer starts sending until the last receiver reports that its tensors
hold the new bytes, and is the best of `repeats` runs after a warm-up run (first-touch page
faults and mapping set-up are not what is compared; the warm-up times are reported apart).

- `memcpy`: one process copies every tensor into a preallocated twin (one thread): the ceiling,
  measured first and last (the best is kept).
- `weightsync_packed`: `ipc_trainer_send_weights` from ordinary tensors with the default bucket
  size; the trainer copies them into reusable bucket buffers, each receiver copies out of them
  (two copies; on a host where two copies share one memory bus, about half of memcpy at best).
- `weightsync_zero_copy`: the trainer's tensors already live in shared memory
  (`IPCTrainerSession.shared_tensors`); each receiver's copy into its tensors is the only one.
- `pickle_pipe`: the naive way: `pickle.dumps` of the named tensors through a
  `multiprocessing` pipe, `pickle.loads` and a copy into the receiver's tensors.
"""

from __future__ import annotations

import os
import pickle
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch

from _rigs import (
    CommandProcess,
    IPCReceiverProcess,
    allocate_tensors,
    deliver_to_processes,
    fill_tensors,
    serve_commands,
)
from model_specs import llama_like_specs
from weightsync import weight_checksums
from weightsync.transfer.base import TensorSpec, WeightTransferUpdateInfo, WireParams
from weightsync.transfer.ipc import (
    IPCTrainerSendWeightsArgs,
    ipc_trainer_init,
    ipc_trainer_send_weights,
)

BUCKET_SIZE_BYTES = WireParams().bucket_size_bytes
NUM_BUFFERS = 2
TIMEOUT_S = 300.0


def _pickle_receiver_main(conn: Connection, data: Connection, update_info: dict[str, Any]) -> None:
    specs = WeightTransferUpdateInfo(**update_info).specs()
    params = allocate_tensors(specs, flat=False)

    def receive() -> None:
        # The baseline being measured: unpickling bytes from a trusted peer (never do this in
        # the library, which takes JSON only).
        pairs = pickle.loads(data.recv_bytes())
        for name, tensor in pairs:
            params[name].copy_(tensor)

    serve_commands(
        conn,
        {"receive": receive, "digests": lambda: {"digests": weight_checksums(params)}},
    )


def _best(run: Callable[[], None], repeats: int) -> tuple[float, float]:
    """`(warm-up seconds, best seconds of repeats)` of `run`."""
    times = []
    for _ in range(1 + repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return times[0], min(times[1:])


def _check(receivers: list[CommandProcess], tensors: dict[str, torch.Tensor], what: str) -> None:
    want = weight_checksums(tensors)
    for receiver in receivers:
        if receiver.call("digests")["digests"] != want:
            raise AssertionError(f"{what}: a receiver's tensors differ from the trainer's")


def _memcpy(specs: list[TensorSpec], tensors: dict[str, torch.Tensor], repeats: int) -> float:
    twin = allocate_tensors(specs, flat=False)

    def copy_all() -> None:
        for name, tensor in tensors.items():
            twin[name].copy_(tensor)

    return _best(copy_all, repeats)[1]


def _weightsync(
    receivers: list[IPCReceiverProcess],
    specs: list[TensorSpec],
    tensors: dict[str, torch.Tensor],
    repeats: int,
    *,
    zero_copy: bool,
) -> dict[str, float]:
    session = ipc_trainer_init(
        packed=not zero_copy,
        bucket_size_bytes=BUCKET_SIZE_BYTES,
        num_buffers=NUM_BUFFERS,
        timeout_s=TIMEOUT_S,
    )
    try:
        if zero_copy:
            shared = session.shared_tensors(specs)
            for name, tensor in tensors.items():
                shared[name].copy_(tensor)
            tensors = shared
        for receiver in receivers:
            receiver.call("init", init_info=session.init_info)
        args = IPCTrainerSendWeightsArgs(session, deliver_to_processes(receivers))
        first, best = _best(lambda: ipc_trainer_send_weights(tensors.items(), args), repeats)
        _check(list(receivers), tensors, "zero_copy" if zero_copy else "packed")
    finally:
        session.close()
    return {"first_s": first, "best_s": best}


def _pickle_pipe(
    update_info: dict[str, Any], tensors: dict[str, torch.Tensor], repeats: int
) -> float:
    context = torch.multiprocessing.get_context("spawn")
    data_receiver_end, data_sender_end = context.Pipe(duplex=False)
    receiver = CommandProcess(_pickle_receiver_main, (data_receiver_end, update_info), TIMEOUT_S)
    data_receiver_end.close()
    try:

        def send() -> None:
            receiver.start("receive")
            data_sender_end.send_bytes(pickle.dumps(list(tensors.items()), pickle.HIGHEST_PROTOCOL))
            receiver.reply()

        best = _best(send, repeats)[1]
        _check([receiver], tensors, "pickle_pipe")
    finally:
        receiver.close()
        data_sender_end.close()
    return best


def run(size_mb: int, repeats: int, verbose: bool) -> dict[str, Any]:
    """Runs every figure on the ~`size_mb` MiB model-like set; returns the JSON-ready result."""

    def log(message: str) -> None:
        if verbose:
            print(message, file=sys.stderr, flush=True)

    torch.set_num_threads(1)  # like every worker process: the receivers take the other cores
    specs = llama_like_specs(size_mb << 20)
    total = sum(s.nbytes for s in specs)
    update_info = WeightTransferUpdateInfo.from_specs(specs).to_dict()
    tensors = allocate_tensors(specs, flat=False)
    fill_tensors(tensors, 1)
    gbps: dict[str, float] = {}
    gbps["memcpy"] = total / _memcpy(specs, tensors, repeats) / 1e9
    log(f"memcpy: {gbps['memcpy']:.2f} GB/s")
    receivers = [
        IPCReceiverProcess(update_info=update_info, worker_index=i, timeout_s=TIMEOUT_S)
        for i in range(2)
    ]
    first: dict[str, float] = {}
    two: dict[str, float] = {}
    try:
        for name, zero_copy in (("weightsync_packed", False), ("weightsync_zero_copy", True)):
            timing = _weightsync(receivers[:1], specs, tensors, repeats, zero_copy=zero_copy)
            gbps[name], first[name] = total / timing["best_s"] / 1e9, timing["first_s"]
            log(f"{name}: {gbps[name]:.2f} GB/s (first update {first[name]:.2f} s)")
            timing = _weightsync(receivers, specs, tensors, repeats, zero_copy=zero_copy)
            two[f"{name}_gbps"] = total / timing["best_s"] / 1e9
            log(f"{name}, 2 receivers: {two[f'{name}_gbps']:.2f} GB/s per receiver")
    finally:
        for receiver in receivers:
            receiver.close()
    gbps["pickle_pipe"] = total / _pickle_pipe(update_info, tensors, repeats) / 1e9
    log(f"pickle_pipe: {gbps['pickle_pipe']:.2f} GB/s")
    # The ceiling is measured again at the end and the best kept: a host busy at one moment
    # must not lower it and flatter the ratios.
    gbps["memcpy"] = max(gbps["memcpy"], total / _memcpy(specs, tensors, repeats) / 1e9)
    log(f"memcpy (best of start and end): {gbps['memcpy']:.2f} GB/s")
    return {
        "backend": "ipc",
        "total_bytes": total,
        "num_tensors": len(specs),
        "bucket_size_bytes": BUCKET_SIZE_BYTES,
        "num_buffers": NUM_BUFFERS,
        "repeats": repeats,
        "num_receivers": 1,
        **{f"{name}_gbps": value for name, value in gbps.items()},
        "packed_ratio_vs_memcpy": gbps["weightsync_packed"] / gbps["memcpy"],
        "zero_copy_ratio_vs_memcpy": gbps["weightsync_zero_copy"] / gbps["memcpy"],
        "pickle_pipe_ratio_vs_memcpy": gbps["pickle_pipe"] / gbps["memcpy"],
        "packed_vs_pickle_pipe": gbps["weightsync_packed"] / gbps["pickle_pipe"],
        "zero_copy_vs_pickle_pipe": gbps["weightsync_zero_copy"] / gbps["pickle_pipe"],
        "first_update_s": first,
        "two_receivers": two,
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
    }
