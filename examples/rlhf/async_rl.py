"""Asynchronous RL at toy scale: a policy learns to speak in syllables while it keeps generating.

What it shows: the whole loop of one-step off-policy RL. An inference server generates the next
batch of rollouts in its own process while the trainer learns from the previous batch; each new
policy lands in the engine *in the middle of* the rollouts in flight, through a `keep`-mode
pause; and the per-token weight versions the engine records tell the trainer which policy drew
each token, so it can correct for the ones drawn by the previous policy.

The task is a reward computed from the generated text: a character scores when it is a lowercase
letter and does not repeat the class (vowel or consonant) of the letter before it, so
`"tamolibu"` scores fully. The random byte-level policy it starts from scores about 0.1; within
thirty steps it speaks in syllables (`"usususus..."`) and scores above 0.9.

Flow:

1. Start an [`EngineProcess`][weightsync.trainer.engine_process.EngineProcess]: a
   `weightsync serve` child holding a tiny random Llama, reached over HTTP (rollouts stream from
   its `/v1/completions`, control and updates go through its RL routes). Connect a weight
   sender to it; push the trainer's initial policy as version 0 and generate the first batch:
   8 prompts, 8 rollouts each.
2. Each step `k`:
    1. queue batch `k` in the engine, and ask it to pause in `keep` mode once every rollout of
       it has `--land-at` tokens;
    2. meanwhile, train on batch `k - 1`: GRPO-style advantages (each rollout's reward minus
       its prompt group's mean, over the group's spread) and a clipped policy-gradient loss;
    3. [`sync_weights`][weightsync.trainer.senders.sync_weights] pushes the new policy as version
       `k` into the paused engine, whose frozen rollouts then continue with it;
    4. collect batch `k`: each rollout's first tokens carry version `k - 1`, the rest `k`.
3. Off-policy correction: for every token the trainer computes its probability under the
   policy that drew it (it keeps the previous version's weights), weighs the token's gradient
   by the ratio of the current policy's probability to that one, clipped to `[0.8, 1.2]` as in
   PPO, and drops tokens more than `--max-staleness` versions old.
4. Check that the mean reward of the last 5 steps beats that of the first 5 by at least
   `--min-gain`, and that the engine ends with the trainer's exact weights. A random policy
   scores 0.07 to 0.11 (depending on the seed) and the mean over one batch of a fixed policy
   varies by less than 0.01 from batch to batch, so a rise of 0.3 is learning, not noise.

Everything random is seeded (`--seed`), and every pause lands at token `--land-at` whatever the
speed of either process, so a run is reproducible. `--land-at 0` pauses whenever the trainer is
ready instead, as a production loop would: the split then depends on timing.

Run it: `python examples/rlhf/async_rl.py` (15 to 30 seconds on 2 CPU cores, by CPU).

Hardware: CPUs only, with `gloo`. With two or more GPUs the trainer computes on `cuda:0` and
sends over `nccl` to an engine that computes on `cuda:1`, where its updates land.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

# torch does not depend on numpy, yet without it `import torch` warns that it failed to initialize
# numpy. Nothing here needs numpy, so on an install with torch alone that warning is noise; this
# filter hides only it, and must come before torch is first imported.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)

import torch  # noqa: E402
from torch.func import functional_call, vmap  # noqa: E402

from weightsync import (  # noqa: E402
    EngineConfig,
    LlamaForCausalLM,
    RequestOutput,
    SamplingParams,
    weight_checksums,
)
from weightsync.trainer import EngineProcess, create_weight_sender, sync_weights  # noqa: E402

# The device is chosen here, once: nccl needs a GPU for the trainer and one for the engine.
if torch.cuda.device_count() >= 2:
    BACKEND, TRAINER_DEVICE, ENGINE_DEVICE = "nccl", "cuda:0", "cuda:1"
else:
    BACKEND, TRAINER_DEVICE, ENGINE_DEVICE = "gloo", "cpu", "cpu"

VOWELS = frozenset("aeiou")
CLIP = 0.2  # PPO's clip range for the importance ratio


def syllable_reward(text: str, max_tokens: int) -> float:
    """Share of the output's characters that are lowercase letters alternating vowel/consonant."""
    score, previous_is_vowel = 0, None
    for char in text:
        if "a" <= char <= "z":
            is_vowel = char in VOWELS
            score += previous_is_vowel is None or is_vowel != previous_is_vowel
            previous_is_vowel = is_vowel
        else:
            previous_is_vowel = None
    return score / max_tokens


@dataclass
class Batch:
    """One step's rollouts, as the trainer needs them."""

    token_ids: torch.Tensor  # (rollouts, prompt + output) token ids
    prompt_len: int
    versions: torch.Tensor  # (rollouts, output) weight version of each output token
    rewards: torch.Tensor  # (prompts, rollouts per prompt)
    texts: list[str]


def readable(text: str) -> str:
    """`text` with every character that is not printable ASCII shown as `·` (bytes decode raw)."""
    return "".join(c if c.isascii() and c.isprintable() else "·" for c in text)


def rollout_requests(step: int, args: argparse.Namespace) -> tuple[list[str], list[SamplingParams]]:
    """Batch `step`: each prompt `--samples` times, each rollout with a seed of its own."""
    prompts = [f"Say it {i}: " for i in range(args.prompts)]
    prompts = [p for p in prompts for _ in range(args.samples)]
    params = [
        SamplingParams(
            temperature=1.0,
            max_tokens=args.max_tokens,
            ignore_eos=True,  # equal lengths: rollouts stay in step, the batch stays rectangular
            seed=args.seed * 1_000_003 + step * 1_000 + index,
        )
        for index in range(len(prompts))
    ]
    return prompts, params


def to_batch(outputs: list[RequestOutput], args: argparse.Namespace) -> Batch:
    """Stacks the engine's outputs and scores them."""
    completions = [o.outputs[0] for o in outputs]
    texts = [c.text for c in completions]
    rewards = torch.tensor([syllable_reward(t, args.max_tokens) for t in texts])
    return Batch(
        token_ids=torch.tensor(
            [o.prompt_token_ids + c.token_ids for o, c in zip(outputs, completions, strict=True)]
        ),
        prompt_len=len(outputs[0].prompt_token_ids),
        versions=torch.tensor([c.weight_versions for c in completions]),
        rewards=rewards.view(args.prompts, args.samples),
        texts=texts,
    )


def token_logprobs(
    policy: LlamaForCausalLM, params: dict[str, torch.Tensor], batch: Batch
) -> torch.Tensor:
    """(rollouts, output) log-probability of each output token under `params`."""
    buffers = dict(policy.named_buffers())
    tokens = batch.token_ids.to(TRAINER_DEVICE)
    # The model reads one sequence at a time; vmap runs it over the batch in one pass.
    hidden = vmap(lambda ids: functional_call(policy, (params, buffers), (ids,)))(tokens)
    logits = policy.compute_logits(hidden[:, batch.prompt_len - 1 : -1])  # (rollouts, out, vocab)
    targets = tokens[:, batch.prompt_len :, None]
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets).squeeze(-1)


def train_step(
    policy: LlamaForCausalLM,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    version: int,
    previous: dict[int, dict[str, torch.Tensor]],
    max_staleness: int,
) -> dict[str, float]:
    """One clipped policy-gradient step on `batch`, correcting tokens of older policies."""
    rewards = batch.rewards
    advantages = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)
    advantages = advantages.view(-1, 1).to(TRAINER_DEVICE)  # (rollouts, 1)

    current = dict(policy.named_parameters())
    logprobs = token_logprobs(policy, current, batch)  # (rollouts, output), with grad
    versions = batch.versions.to(TRAINER_DEVICE)
    behaviour = logprobs.detach().clone()  # tokens of the current version: ratio 1
    with torch.no_grad():
        for old_version, weights in previous.items():
            drawn = versions == old_version
            if drawn.any():
                behaviour[drawn] = token_logprobs(policy, weights, batch)[drawn]
    keep = (version - versions) <= max_staleness  # the staleness filter
    ratio = torch.exp(logprobs - behaviour)
    surrogate = torch.minimum(
        ratio * advantages, ratio.clamp(1 - CLIP, 1 + CLIP) * advantages
    )  # (rollouts, output)
    loss = -(surrogate * keep).sum() / keep.sum().clamp(min=1)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()

    stale = (versions < version) & keep
    stale_ratio = ratio.detach()[stale]
    return {
        "stale_tokens": float(stale.sum()),
        "dropped_tokens": float((~keep).sum()),
        "clipped": float(((stale_ratio - 1).abs() > CLIP).float().mean()) if stale.any() else 0.0,
    }


def write_log(
    path: str, args: argparse.Namespace, rewards: list[float], step: int, batch: Batch
) -> None:
    """The run as JSON: mean reward per batch, and one batch's tokens with their weight versions.

    The docs build plots it (`docs/gen/example_plots.py`) from `benchmarks/results/examples/`.
    """
    from weightsync import ByteTokenizer  # the engine's tokenizer; only --log needs it here

    tokenizer = ByteTokenizer()
    outputs = batch.token_ids[:, batch.prompt_len :].tolist()
    log = {
        "example": "async_rl",
        "args": {k: v for k, v in vars(args).items() if k != "log"},
        "mean_reward": rewards,  # index i: batch i, drawn by policies i - 1 and i
        "batch": {
            "step": step,
            "rollouts": [
                {
                    "tokens": [tokenizer.decode([t]) for t in token_ids],
                    "weight_versions": versions,
                    "reward": reward,
                }
                for token_ids, versions, reward in zip(
                    outputs, batch.versions.tolist(), batch.rewards.view(-1).tolist(), strict=True
                )
            ],
        },
    }
    with open(path, "w", encoding="utf-8") as out:
        out.write(json.dumps(log, indent=1) + "\n")


def main() -> int:
    """Runs the loop; returns the exit code (non-zero unless the reward rose and weights match)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="training steps (default 30)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per batch (default 8)")
    parser.add_argument("--samples", type=int, default=8, help="rollouts per prompt (default 8)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per rollout")
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate")
    parser.add_argument(
        "--land-at",
        type=int,
        default=8,
        help="pause when rollouts have this many tokens; 0: whenever the trainer is ready",
    )
    parser.add_argument(
        "--max-staleness", type=int, default=1, help="drop tokens more versions old than this"
    )
    parser.add_argument("--min-gain", type=float, default=0.3, help="required reward rise")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model and the sampling")
    parser.add_argument("--log", help="write the run (rewards, one batch) as JSON here")
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    policy = LlamaForCausalLM.from_preset("debug", seed=args.seed).to(TRAINER_DEVICE)
    optimizer = torch.optim.Adam(policy.parameters(), lr=args.lr)
    engine = EngineProcess(
        "debug",
        seed=args.seed,
        engine_config=EngineConfig(max_num_seqs=args.prompts * args.samples),
        backend=BACKEND,
        device=ENGINE_DEVICE,
    )
    print(f"trainer on {TRAINER_DEVICE}, engine in its own process, weights over {BACKEND}")
    rewards: list[float] = []
    start = time.perf_counter()
    try:
        with create_weight_sender(BACKEND, [engine]) as sender, ThreadPoolExecutor(1) as background:
            # Version 0: whatever the engine loaded, it now holds the trainer's initial policy.
            sync_weights(sender, policy.named_weights(), weight_version=0)
            batch = to_batch(engine.generate(*rollout_requests(0, args)), args)
            previous: dict[int, dict[str, torch.Tensor]] = {}
            straddled = 0
            logged = (0, batch)
            for step in range(1, args.steps + 1):
                # 1. The engine generates batch `step` with the current policy, meanwhile...
                # ...and freezes it at token --land-at, whatever the timing (the pause is armed
                # with the requests, so the engine cannot run past it first).
                request_ids = engine.add_requests(
                    *rollout_requests(step, args),
                    pause_after_tokens=args.land_at if args.land_at > 0 else None,
                )
                landing = None
                if args.land_at > 0:
                    landing = background.submit(engine.pause_generation, mode="keep")
                # 2. ...the trainer learns from batch `step - 1` (policy version step - 1 -> step).
                rewards.append(batch.rewards.mean().item())
                weights = {n: p.detach().clone() for n, p in policy.named_parameters()}
                metrics = train_step(
                    policy, optimizer, batch, step - 1, previous, args.max_staleness
                )
                previous = {step - 1: weights}  # what drew the first tokens of batch `step`
                if landing is not None:
                    landing.result()
                # 3. Version `step` lands in the rollouts in flight; they continue with it.
                sync_weights(sender, policy.named_weights(), weight_version=step)
                # 4. Batch `step`: each rollout is part version step - 1, part version step.
                batch = to_batch(engine.collect(request_ids), args)
                mixed = sum(len(set(v)) > 1 for v in batch.versions.tolist())
                straddled += mixed
                if step == (args.steps + 1) // 2:
                    logged = (step, batch)  # mid-run: the policy is still changing
                print(
                    f"step {step:3d}  reward {rewards[-1]:.3f}  "
                    f"stale tokens {metrics['stale_tokens']:4.0f} "
                    f"({metrics['clipped']:.0%} clipped, {metrics['dropped_tokens']:.0f} dropped)  "
                    f"next batch: {mixed}/{len(batch.texts)} rollouts straddle an update  "
                    f"e.g. {readable(batch.texts[0])}"
                )
            rewards.append(batch.rewards.mean().item())  # the last policy's batch, not trained on
            same = engine.weight_digests() == weight_checksums(policy.named_weights())
    finally:
        engine.close()

    if args.log is not None:
        write_log(args.log, args, rewards, *logged)
    k = 5
    first, last = statistics.mean(rewards[:k]), statistics.mean(rewards[-k:])
    print(
        f"mean reward: first {k} steps {first:.3f}, last {k} steps {last:.3f} "
        f"({time.perf_counter() - start:.1f} s); {straddled} rollouts straddled an update; "
        f"engine weights equal the trainer's: {same}"
    )
    if last - first < args.min_gain:
        print(f"error: the reward rose by {last - first:.3f} < {args.min_gain}", file=sys.stderr)
        return 1
    if not same:
        print("error: the engine's weights differ from the trainer's", file=sys.stderr)
        return 1
    if args.land_at > 0 and straddled == 0:
        print("error: no update landed while rollouts were in flight", file=sys.stderr)
        return 1
    print(f"ok: the reward rose by {last - first:.3f} while updates landed mid-rollout")
    return 0


if __name__ == "__main__":
    sys.exit(main())
