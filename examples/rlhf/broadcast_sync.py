"""Sync a trainer's model into two receiver processes over a gloo broadcast group.

What it shows: the data plane on its own, through its public API. A trainer (this process) holds
a Llama-shaped model, takes an optimizer step, and pushes the new weights into two receiver
processes written right here; each receiver checks the update against its own tensors before any
byte moves, and afterwards the script checks that every receiver holds exactly the trainer's
bytes.

Flow:

1. Build the model and lay its parameters out in one flat buffer (`--flat`, the default), so
   buckets are sent straight from parameter memory.
2. Start two receiver processes (`spawn`). Each builds the same architecture with zeroed weights
   and a receiver engine from `WeightTransferConfig(backend="gloo").create_engine(...)`.
3. `trainer_init` creates the group (trainer rank 0, receivers ranks 1-2); each receiver joins with
   its `init_info` through `init_transfer_engine`.
4. For each step: change the weights, announce them (`WeightTransferUpdateInfo`), send them with
   `trainer_send_weights` while every receiver runs `receive_weights`, and compare SHA-256 digests
   (`weight_checksums`) of every tensor on every receiver.

Messages between the processes are small JSON objects over a pipe; the weights travel only over
the broadcast group. Every wait has a limit, so a receiver that fails ends the demo with its error
instead of a hang.

Run it: `python examples/rlhf/broadcast_sync.py` (CPU only, about 10 seconds on 2 cores).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import sys
from multiprocessing.connection import Connection
from typing import Any

import torch
from torch import nn

from weightsync import (
    NCCLTrainerSendWeightsArgs,
    WeightTransferConfig,
    WeightTransferUpdateInfo,
    flatten_module,
    trainer_init,
    trainer_send_weights,
    weight_checksums,
)

REPLY_TIMEOUT_S = 120.0  # the longest a step may take on a loaded machine
JOIN_TIMEOUT_S = 10.0


class Block(nn.Module):
    """One Llama-like decoder block's weights (attention and MLP projections, two norms)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(hidden, bias=False)
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, hidden // 4, bias=False)
        self.v_proj = nn.Linear(hidden, hidden // 4, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.post_attention_layernorm = nn.LayerNorm(hidden, bias=False)
        self.gate_proj = nn.Linear(hidden, 3 * hidden, bias=False)
        self.up_proj = nn.Linear(hidden, 3 * hidden, bias=False)
        self.down_proj = nn.Linear(3 * hidden, hidden, bias=False)


def build_model(hidden: int, layers: int, vocab: int) -> nn.Module:
    """A stack of decoder-block weights between an embedding and a head, in bfloat16."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(vocab, hidden), *(Block(hidden) for _ in range(layers)))
    model.append(nn.Linear(hidden, vocab, bias=False))
    return model.to(torch.bfloat16)


def send(conn: Connection, **message: Any) -> None:
    """Sends one JSON message over `conn`."""
    conn.send_bytes(json.dumps(message).encode())


def receive(conn: Connection, timeout_s: float = REPLY_TIMEOUT_S) -> dict[str, Any]:
    """Waits at most `timeout_s` seconds for one JSON message on `conn`."""
    if not conn.poll(timeout_s):
        raise TimeoutError(f"no message within {timeout_s:.0f} s")
    message: dict[str, Any] = json.loads(conn.recv_bytes())
    if "error" in message:
        raise RuntimeError(f"a receiver failed: {message['error']}")
    return message


def receiver_main(conn: Connection, worker_index: int, shape: dict[str, Any]) -> None:
    """One receiver process: the model's tensors, a transfer engine, and a loop over commands."""
    torch.set_num_threads(1)  # the processes share the cores; more threads only contend
    with torch.device("meta"):  # the architecture only: its values arrive over the wire
        model = build_model(shape["hidden"], shape["layers"], shape["vocab"])
    model.to_empty(device="cpu")
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
    if shape["flat"]:
        flatten_module(model)  # buckets then land straight in parameter memory
    params = dict(model.named_parameters())
    engine = WeightTransferConfig(backend="gloo").create_engine(
        worker_index=worker_index, params=params
    )

    @torch.no_grad()
    def load_weights(pairs: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in pairs:  # tensors not received in place; copy before returning
            params[name].copy_(tensor)

    try:
        while (message := json.loads(conn.recv_bytes()))["op"] != "stop":
            try:
                if message["op"] == "init":
                    engine.init_transfer_engine(message["init_info"])
                    send(conn)
                else:
                    stats = engine.receive_weights(message["update_info"], load_weights)
                    send(conn, gbps=stats.gbps, digests=weight_checksums(params))
            except Exception as exc:
                send(conn, error=f"{type(exc).__name__}: {exc}")
    finally:
        engine.shutdown()


class Receivers:
    """The trainer's handles of the receiver processes: start, message, and stop them."""

    def __init__(self, count: int, shape: dict[str, Any]) -> None:
        context = mp.get_context("spawn")  # a fresh interpreter: no inherited threads or locks
        self.conns: list[Connection] = []
        self.processes = []
        for index in range(count):
            conn, child = context.Pipe()
            process = context.Process(target=receiver_main, args=(child, index, shape))
            process.start()
            child.close()
            self.conns.append(conn)
            self.processes.append(process)

    def send_all(self, **message: Any) -> None:
        """Sends `message` to every receiver."""
        for conn in self.conns:
            send(conn, **message)

    def replies(self) -> list[dict[str, Any]]:
        """Each receiver's reply to the last message, in order."""
        return [receive(conn) for conn in self.conns]

    def stop(self) -> None:
        """Asks every receiver to stop; one that does not within the limit is terminated."""
        for conn in self.conns:
            with contextlib.suppress(OSError):  # a receiver that already exited
                send(conn, op="stop")
        for process in self.processes:
            process.join(JOIN_TIMEOUT_S)
            if process.is_alive():
                process.terminate()
                process.join(JOIN_TIMEOUT_S)


def main() -> int:
    """Runs the demo; returns the process exit code (non-zero when a worker's bytes differ)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=512, help="hidden size (default 512)")
    parser.add_argument("--layers", type=int, default=8, help="decoder blocks (default 8)")
    parser.add_argument("--vocab", type=int, default=32000, help="vocabulary size")
    parser.add_argument("--steps", type=int, default=3, help="updates to push (default 3)")
    parser.add_argument("--workers", type=int, default=2, help="receiver processes (default 2)")
    parser.add_argument("--bucket-mb", type=int, default=32, help="bucket size in MiB")
    parser.add_argument(
        "--flat",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="lay trainer parameters out in one buffer (no pack copy)",
    )
    args = parser.parse_args()

    model = build_model(args.hidden, args.layers, args.vocab)
    if args.flat:
        flatten_module(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    total_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6
    num_tensors = len(list(model.parameters()))
    print(f"trainer: {num_tensors} tensors, {total_mb:.1f} MB, flat={args.flat}")

    shape = {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab, "flat": args.flat}
    receivers = Receivers(args.workers, shape)
    group = trainer_init(
        world_size=1 + args.workers, backend="gloo", bucket_size_bytes=args.bucket_mb << 20
    )
    try:
        receivers.send_all(op="init", init_info=group.init_info)
        group.connect()  # returns once every receiver joined (bounded by the group's timeout_s)
        receivers.replies()
        for step in range(1, args.steps + 1):
            optimizer.zero_grad()
            loss = sum(p.float().square().mean() for p in model.parameters())
            loss.backward()  # type: ignore[union-attr]
            optimizer.step()
            update = WeightTransferUpdateInfo.from_named_tensors(
                model.named_parameters(), weight_version=step
            ).to_dict()
            receivers.send_all(op="update", update_info=update)
            sent = trainer_send_weights(
                model.named_parameters(), NCCLTrainerSendWeightsArgs(group, update)
            )
            replies = receivers.replies()
            want = weight_checksums(model.named_parameters())
            same = all(reply["digests"] == want for reply in replies)
            rates = ", ".join(f"{reply['gbps']:.2f}" for reply in replies)
            print(
                f"step {step}: sent {sent.num_tensors} tensors, {sent.num_bytes / 1e6:.1f} MB in "
                f"{sent.seconds * 1e3:.0f} ms ({sent.gbps:.2f} GB/s; {sent.direct_buckets} of "
                f"{sent.num_buckets} buckets sent in place); receivers got them at {rates} GB/s; "
                f"bitwise equal: {same}"
            )
            if not same:
                print("error: a receiver's weights differ from the trainer's", file=sys.stderr)
                return 1
    finally:
        group.close()
        receivers.stop()
    print(f"ok: every receiver holds the trainer's weights after each of {args.steps} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
