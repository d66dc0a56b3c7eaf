"""A trainer broadcasts its new weights to two inference engines running in their own processes.

What it shows: the broadcast flow of RL with separate trainer and inference devices. The trainer
(this process) and two engines (data-parallel replicas, one process each) start from the same
random model. The trainer then learns a phrase, and one
[`sync_weights`][weightsync.trainer.senders.sync_weights] call pauses both engines, broadcasts the
new weights to them, and resumes them. Asked the same prompt before and after, the engines now
answer with the trainer's phrase, and their weights equal the trainer's byte for byte.

Flow:

1. Start two [`EngineProcess`][weightsync.trainer.engine_process.EngineProcess]es (`worker_index`
   0 and 1) and connect a [`BroadcastWeightSender`][weightsync.trainer.senders.BroadcastWeightSender]:
   the trainer is rank 0 of a group created for weight transfer only, the engines ranks 1 and 2.
2. Generate greedily from both engines: random bytes.
3. Train: a few dozen Adam steps teach the trainer's model to answer `--prompt` with `--phrase`.
4. `sync_weights`: pause both engines (`keep` mode), broadcast the weights as version 1 (each
   engine checks every name, shape and dtype before a byte moves), resume.
5. Generate again, and check that every engine holds the trainer's exact bytes (SHA-256 of every
   tensor), answers with the phrase, and tags its tokens with version 1.

Run it: `python examples/rlhf/rlhf_nccl.py` (about 8 seconds on 2 CPU cores).

Hardware: CPUs only, with `gloo`. With a GPU for the trainer and one per engine (three for the
defaults) the same code sends over `nccl` from `cuda:0`; each engine computes on its own GPU,
where its updates land.
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
from weightsync.trainer import BroadcastWeightSender, EngineProcess, sync_weights


def pick_devices(num_engines: int) -> tuple[str, str, list[str]]:
    """Backend, trainer device and each engine's receiving device: nccl needs a GPU per rank."""
    if torch.cuda.device_count() >= 1 + num_engines:
        return "nccl", "cuda:0", [f"cuda:{1 + i}" for i in range(num_engines)]
    return "gloo", "cpu", ["cpu"] * num_engines


def teach(
    policy: LlamaForCausalLM, prompt: str, phrase: str, steps: int, lr: float, device: str
) -> float:
    """Trains `policy` to answer `prompt` with `phrase`; returns the last loss."""
    tokenizer = ByteTokenizer()
    prompt_ids = tokenizer.encode(prompt)
    ids = torch.tensor(
        prompt_ids + tokenizer.encode(phrase, add_special_tokens=False), device=device
    )
    optimizer = torch.optim.Adam(policy.parameters(), lr=lr)
    for _ in range(steps):
        logits = policy.compute_logits(policy(ids[:-1]))  # (tokens - 1, vocab)
        loss = F.cross_entropy(logits[len(prompt_ids) - 1 :], ids[len(prompt_ids) :])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return loss.item()


def main() -> int:
    """Runs the demo; returns the exit code (non-zero unless every engine took the update)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engines", type=int, default=2, help="engine processes (default 2)")
    parser.add_argument("--prompt", default="The trainer says:", help="prompt asked before/after")
    parser.add_argument("--phrase", default=" weights moved!", help="what the trainer learns")
    parser.add_argument("--train-steps", type=int, default=60, help="Adam steps (default 60)")
    parser.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial random model")
    args = parser.parse_args()
    backend, trainer_device, engine_devices = pick_devices(args.engines)

    policy = LlamaForCausalLM.from_preset("debug", seed=args.seed).to(trainer_device)
    engines = [
        EngineProcess(
            "debug",
            seed=args.seed,  # the same starting weights as the trainer's
            engine_config=EngineConfig(num_kv_blocks=64),
            backend=backend,
            worker_index=index,
            device=device,
        )
        for index, device in enumerate(engine_devices)
    ]
    greedy = SamplingParams(temperature=0, max_tokens=len(args.phrase.encode()))
    print(f"trainer on {trainer_device}; {args.engines} engine processes; backend {backend}")
    try:
        with BroadcastWeightSender(engines, backend=backend) as sender:
            before = [e.generate([args.prompt], greedy)[0].outputs[0] for e in engines]
            for index, out in enumerate(before):
                print(
                    f"engine {index} before: {out.text!r} (weight version {out.weight_versions[0]})"
                )

            loss = teach(
                policy, args.prompt, args.phrase, args.train_steps, args.lr, trainer_device
            )
            print(f"trainer: {args.train_steps} steps on {args.phrase!r}, loss {loss:.4f}")
            stats = sync_weights(sender, policy.named_weights(), weight_version=1)
            print(
                f"sync: {stats.num_tensors} tensors, {stats.num_bytes / 1e6:.2f} MB to "
                f"{args.engines} engines in {stats.seconds * 1e3:.1f} ms"
            )

            after = [e.generate([args.prompt], greedy)[0].outputs[0] for e in engines]
            want = weight_checksums(policy.named_weights())
            same = [e.weight_digests() == want for e in engines]
    finally:
        for engine in engines:
            engine.close()

    failures = []
    for index, out in enumerate(after):
        print(
            f"engine {index} after:  {out.text!r} (weight versions {sorted(set(out.weight_versions))}); "
            f"weights equal the trainer's: {same[index]}"
        )
        if not same[index]:
            failures.append(f"engine {index}'s weights differ from the trainer's")
        if out.text != args.phrase or set(out.weight_versions) != {1}:
            failures.append(
                f"engine {index} answered {out.text!r} with versions {out.weight_versions}"
            )
    for failure in failures:
        print(f"error: {failure}", file=sys.stderr)
    if failures:
        return 1
    print("ok: every engine holds the trainer's weights and says what the trainer learned")
    return 0


if __name__ == "__main__":
    sys.exit(main())
