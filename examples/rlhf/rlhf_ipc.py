"""Colocated trainer and engine: weights move through memory handles, packed and zero-copy.

What it shows: the `ipc` flow, for a trainer and an inference engine on the same host (the same
GPU, on GPUs). The trainer never streams bytes through a socket: it hands the engine JSON
records naming its memory (POSIX shared-memory segments for CPU tensors, CUDA IPC handles for
CUDA tensors), and the engine copies the weights straight out of the trainer's memory. Two
variants, one after the other on the same engine:

- **packed**: tensors are copied into a few reusable bucket buffers, and the trainer packs
  bucket k+1 while the engine copies bucket k;
- **zero-copy**: the trainer's parameters are exported where they are, so the engine's single
  copy is the whole cost (on CPUs the parameters first move into shared memory, once).

Flow:

1. Start an [`EngineProcess`][weightsync.trainer.engine_process.EngineProcess] holding the same
   random model as the trainer; generate greedily from it.
2. Packed: the trainer learns a first phrase;
   [`sync_weights`][weightsync.trainer.senders.sync_weights] through an
   [`IPCWeightSender`][weightsync.trainer.senders.IPCWeightSender] with `--bucket-kb` buckets
   pauses the engine, delivers the buckets and resumes it (version 1).
3. Zero-copy: [`share_module`][weightsync.trainer.senders.IPCWeightSender.share_module] moves the
   parameters into shared memory (CPU), the trainer learns a second phrase, and an unpacked
   sender exports the parameters in place (version 2).
4. After each sync, check that the engine holds the trainer's exact bytes and answers the
   prompt with the phrase just learned.

Run it: `python examples/rlhf/rlhf_ipc.py` (about 7 seconds on 2 CPU cores).

Hardware: CPUs only, through shared memory. With a GPU the trainer computes on `cuda:0` and the
same code sends CUDA IPC handles; the engine computes on the same GPU and copies the weights
device to device.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F  # noqa: N812

from weightsync import (
    ByteTokenizer,
    EngineConfig,
    LlamaForCausalLM,
    SamplingParams,
    weight_checksums,
)
from weightsync.trainer import EngineProcess, IPCWeightSender, sync_weights

# The device is chosen here, once: the ipc backend follows the tensors' device, and the
# colocated engine computes on the trainer's device.
DEVICE = "cuda:0" if torch.cuda.is_available() else "cpu"


def teach(
    policy: LlamaForCausalLM, optimizer: torch.optim.Optimizer, prompt: str, phrase: str, steps: int
) -> float:
    """Trains `policy` to answer `prompt` with `phrase`; returns the last loss."""
    tokenizer = ByteTokenizer()
    prompt_ids = tokenizer.encode(prompt)
    ids = torch.tensor(
        prompt_ids + tokenizer.encode(phrase, add_special_tokens=False), device=DEVICE
    )
    for _ in range(steps):
        logits = policy.compute_logits(policy(ids[:-1]))  # (tokens - 1, vocab)
        loss = F.cross_entropy(logits[len(prompt_ids) - 1 :], ids[len(prompt_ids) :])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return loss.item()


def main() -> int:
    """Runs the demo; returns the exit code (non-zero unless both syncs landed exactly)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt", default="Colocated:", help="prompt asked after each sync")
    parser.add_argument("--packed-phrase", default=" packed buckets", help="learned first")
    parser.add_argument("--zero-copy-phrase", default=" zero copies!", help="learned second")
    parser.add_argument("--bucket-kb", type=int, default=128, help="bucket size in KiB (packed)")
    parser.add_argument("--train-steps", type=int, default=60, help="Adam steps per phrase")
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial random model")
    args = parser.parse_args()

    policy = LlamaForCausalLM.from_preset("debug", seed=args.seed).to(DEVICE)
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-2)
    engine = EngineProcess(
        "debug",
        seed=args.seed,
        engine_config=EngineConfig(num_kv_blocks=64),
        backend="ipc",
        device=DEVICE,
    )
    print(f"trainer on {DEVICE}; engine in its own process; backend ipc")
    failures = []
    try:
        before = engine.generate([args.prompt], SamplingParams(temperature=0, max_tokens=12))
        print(f"before:    {before[0].outputs[0].text!r}")
        variants = [
            (
                "packed",
                args.packed_phrase,
                {"packed": True, "bucket_size_bytes": args.bucket_kb << 10},
            ),
            ("zero-copy", args.zero_copy_phrase, {"packed": False}),
        ]
        for version, (name, phrase, sender_args) in enumerate(variants, start=1):
            with IPCWeightSender([engine], **sender_args) as sender:
                if name == "zero-copy" and DEVICE == "cpu":
                    sender.share_module(policy)  # once: later steps update shared memory in place
                loss = teach(policy, optimizer, args.prompt, phrase, args.train_steps)
                stats = sync_weights(sender, policy.named_weights(), weight_version=version)
            greedy = SamplingParams(temperature=0, max_tokens=len(phrase.encode()))
            out = engine.generate([args.prompt], greedy)[0].outputs[0]
            same = engine.weight_digests() == weight_checksums(policy.named_weights())
            print(
                f"{name + ':':10} learned {phrase!r} (loss {loss:.4f}); sent {stats.num_bytes / 1e6:.2f} MB "
                f"in {stats.num_buckets} deliveries ({stats.direct_buckets} in place) in "
                f"{stats.seconds * 1e3:.1f} ms; engine says {out.text!r} with version "
                f"{sorted(set(out.weight_versions))}; weights equal: {same}"
            )
            if not same:
                failures.append(f"{name}: the engine's weights differ from the trainer's")
            if out.text != phrase or set(out.weight_versions) != {version}:
                failures.append(f"{name}: the engine answered {out.text!r}, {out.weight_versions}")
            if (stats.direct_buckets > 0) != (name == "zero-copy"):
                failures.append(f"{name}: {stats.direct_buckets} deliveries were in place")
    finally:
        engine.close()
    for failure in failures:
        print(f"error: {failure}", file=sys.stderr)
    if failures:
        return 1
    print("ok: packed and zero-copy syncs both left the engine with the trainer's exact weights")
    return 0


if __name__ == "__main__":
    sys.exit(main())
