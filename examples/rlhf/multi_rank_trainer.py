"""Sync a sharded trainer (FSDP2 over two ranks) into an inference worker, on a CPU.

What it shows: how a multi-rank trainer sends its weights. Two trainer processes shard one
model with FSDP2 (`fully_shard`, each rank holds half of every parameter as a `DTensor`). Only
trainer rank 0 is in the weight-transfer group; every trainer rank gathers each parameter with
`full_tensor()`, in the same order, while rank 0 packs and broadcasts them bucket by bucket. So
no rank ever holds the whole model: rank 0 holds its shards, one gathered parameter at a time,
and the bucket buffers.

Flow:

1. This process is the inference worker: the model's architecture with zeroed weights and a
   receiver engine from `WeightTransferConfig(backend="gloo").create_engine(...)`.
2. Two trainer ranks start (`spawn`) and form their own gloo group; FSDP2 shards the model.
3. Trainer rank 0 creates the transfer group with `trainer_init` (rank 0 plus this worker) and
   sends its `init_info` here; the worker joins.
4. For each step: both ranks take the same optimizer step; rank 0 announces the update from
   the parameters' metadata (a `DTensor`'s shape is the full shape), then sends from a
   generator that gathers each parameter as the packer asks for it, while rank 1 runs the same
   gathers; the worker receives, and its SHA-256 digests are compared with the gathered ones.

Run it: `python examples/rlhf/multi_rank_trainer.py` (CPU only, a few seconds). On GPUs the
same code runs with `nccl` for both groups and the device mesh on `cuda`.
"""

from __future__ import annotations

import datetime
import json
import multiprocessing as mp
import socket
import sys
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from weightsync import (
    NCCLTrainerSendWeightsArgs,
    WeightTransferConfig,
    WeightTransferUpdateInfo,
    trainer_init,
    trainer_send_weights,
    weight_checksums,
)

STEPS = 3
TRAINER_RANKS = 2
REPLY_TIMEOUT_S = 120.0  # the longest a step may take on a loaded machine
JOIN_TIMEOUT_S = 30.0


def build_model() -> nn.Sequential:
    """A small stack of layers; every rank and the worker build the same one."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Embedding(512, 64), nn.Linear(64, 256), nn.Linear(256, 64), nn.Linear(64, 512)
    )


def send(conn: Connection, **message: Any) -> None:
    """Sends one JSON message over `conn`."""
    conn.send_bytes(json.dumps(message).encode())


def receive(conn: Connection) -> dict[str, Any]:
    """Waits at most REPLY_TIMEOUT_S for one JSON message on `conn`."""
    if not conn.poll(REPLY_TIMEOUT_S):
        raise TimeoutError(f"no message within {REPLY_TIMEOUT_S:.0f} s")
    message: dict[str, Any] = json.loads(conn.recv_bytes())
    if "error" in message:
        raise RuntimeError(message["error"])
    return message


def gathered(model: nn.Module, digests: dict[str, str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Each parameter, gathered from every rank's shard when the sender asks for it.

    `full_tensor()` is a collective: every trainer rank calls it for the same parameters in the
    same order. The full tensor lives until the sender has packed it into its bucket.
    """
    for name, param in model.named_parameters():
        full = param.full_tensor()  # type: ignore[operator]
        digests.update(weight_checksums([(name, full)]))
        yield name, full


def trainer_rank(rank: int, port: int, conn: Connection | None) -> None:
    """One trainer rank: FSDP2 over the trainers' group; rank 0 also sends the weights."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)  # the processes share the cores; more threads only contend
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=TRAINER_RANKS,
        timeout=datetime.timedelta(seconds=REPLY_TIMEOUT_S),
    )
    group = None
    try:
        mesh = init_device_mesh("cpu", (TRAINER_RANKS,))
        model = build_model()
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        if conn is not None:  # rank 0: the transfer group is rank 0 plus the workers
            group = trainer_init(world_size=2, backend="gloo", bucket_size_bytes=64 << 10)
            send(conn, op="init", init_info=group.init_info)
            group.connect()  # returns once the worker joined
            receive(conn)
        for step in range(1, STEPS + 1):
            optimizer.zero_grad()
            tokens = torch.arange(8 * step, 8 * step + 32) % 512
            model(tokens).logsumexp(-1).mean().backward()
            optimizer.step()
            digests: dict[str, str] = {}
            if conn is None:  # the other ranks: the same gathers, in the same order
                for _ in gathered(model, digests):
                    pass
                continue
            assert group is not None
            update = WeightTransferUpdateInfo.from_named_tensors(
                model.named_parameters(), weight_version=step
            ).to_dict()
            send(conn, op="update", update_info=update)
            sent = trainer_send_weights(
                gathered(model, digests), NCCLTrainerSendWeightsArgs(group, update)
            )
            send(conn, op="digests", digests=digests, buckets=sent.num_buckets)
            receive(conn)
    except Exception as exc:
        if conn is not None:
            send(conn, error=f"trainer rank {rank}: {type(exc).__name__}: {exc}")
        raise
    finally:
        if group is not None:
            group.close()
        dist.destroy_process_group()


def free_port() -> int:
    """A free TCP port on loopback, for the trainers' own group."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def main() -> int:
    """Runs the demo; returns the exit code (non-zero when the worker's bytes differ)."""
    with torch.device("meta"):  # the architecture only: its values arrive over the wire
        model = build_model()
    model.to_empty(device="cpu")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for param in params.values():
            param.zero_()
    engine = WeightTransferConfig(backend="gloo").create_engine(worker_index=0, params=params)

    @torch.no_grad()
    def load_weights(pairs: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in pairs:
            params[name].copy_(tensor)

    context = mp.get_context("spawn")
    conn, child = context.Pipe()
    port = free_port()
    ranks = [
        context.Process(target=trainer_rank, args=(rank, port, child if rank == 0 else None))
        for rank in range(TRAINER_RANKS)
    ]
    for process in ranks:
        process.start()
    child.close()
    same = True
    try:
        engine.init_transfer_engine(receive(conn)["init_info"])
        send(conn)
        for step in range(1, STEPS + 1):
            stats = engine.receive_weights(receive(conn)["update_info"], load_weights)
            sent = receive(conn)
            same = weight_checksums(params.items()) == sent["digests"]
            print(
                f"step {step}: {stats.num_tensors} tensors in {sent['buckets']} buckets, "
                f"gathered from {TRAINER_RANKS} ranks; bitwise equal: {same}"
            )
            send(conn)
            if not same:
                break
    finally:
        engine.shutdown()
        for process in ranks:
            process.join(JOIN_TIMEOUT_S)
            if process.is_alive():
                process.terminate()
                process.join(JOIN_TIMEOUT_S)
    if not same or any(process.exitcode != 0 for process in ranks):
        print("error: the worker's weights differ, or a trainer rank failed", file=sys.stderr)
        return 1
    print(f"ok: the worker holds the sharded trainer's weights after each of {STEPS} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
