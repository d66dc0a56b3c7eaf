"""Sync a trainer's model into two worker processes over a gloo broadcast group.

What it shows: the data plane on its own. A trainer (this process) holds a Llama-shaped model,
takes an optimizer step, and pushes the new weights into two receiver processes; each receiver
checks the update against its own tensors before any byte moves, and afterwards the script
checks that every worker holds exactly the trainer's bytes.

Flow:

1. Build the model and lay its parameters out in one flat buffer (`--flat`, the default), so
   buckets are sent straight from parameter memory.
2. Start two receiver processes holding zeroed tensors of the same names, shapes and dtypes.
3. `trainer_init` creates the group (trainer rank 0, workers ranks 1-2); the workers join with
   its `init_info`.
4. For each step: change the weights, announce them (`WeightTransferUpdateInfo`), send them with
   `trainer_send_weights`, and compare SHA-256 digests of every tensor on every worker.

Run it: `python examples/rlhf/broadcast_sync.py` (CPU only, about 10 seconds on 2 cores).
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import nn

from weightsync import (
    NCCLTrainerSendWeightsArgs,
    WeightTransferUpdateInfo,
    flatten_module,
    trainer_init,
    trainer_send_weights,
)
from weightsync.transfer.worker import ReceiverProcess, tensor_digests


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
    info = WeightTransferUpdateInfo.from_named_tensors(model.named_parameters()).to_dict()
    total_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6
    print(f"trainer: {len(info['names'])} tensors, {total_mb:.1f} MB, flat={args.flat}")

    workers = [
        ReceiverProcess(backend="gloo", update_info=info, worker_index=i)
        for i in range(args.workers)
    ]
    group = trainer_init(
        world_size=1 + args.workers, backend="gloo", bucket_size_bytes=args.bucket_mb << 20
    )
    try:
        for worker in workers:
            worker.start("init", init_info=group.init_info)
        group.connect()
        for worker in workers:
            worker.reply()
        for step in range(1, args.steps + 1):
            optimizer.zero_grad()
            loss = sum(p.float().square().mean() for p in model.parameters())
            loss.backward()  # type: ignore[union-attr]
            optimizer.step()
            update = WeightTransferUpdateInfo.from_named_tensors(
                model.named_parameters(), weight_version=step
            ).to_dict()
            for worker in workers:
                worker.start("update", update_info=update)
            sent = trainer_send_weights(
                model.named_parameters(), NCCLTrainerSendWeightsArgs(group, update)
            )
            received = [worker.reply()["stats"] for worker in workers]
            want = tensor_digests(dict(model.named_parameters()))
            same = all(worker.call("digests")["digests"] == want for worker in workers)
            rates = ", ".join(f"{stats['gbps']:.2f}" for stats in received)
            print(
                f"step {step}: sent {sent.num_tensors} tensors, {sent.num_bytes / 1e6:.1f} MB in "
                f"{sent.seconds * 1e3:.0f} ms ({sent.gbps:.2f} GB/s; {sent.direct_buckets} of "
                f"{sent.num_buckets} buckets sent in place); workers received at "
                f"{rates} GB/s; "
                f"bitwise equal: {same}"
            )
            if not same:
                print("error: a worker's weights differ from the trainer's", file=sys.stderr)
                return 1
    finally:
        group.close()
        for worker in workers:
            worker.close()
    print("ok: every worker holds the trainer's weights after every step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
