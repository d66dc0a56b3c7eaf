"""RL through a LoRA adapter: the trainer moves only the adapter, and rollouts never stop.

What it shows: the adapter-only live sync. The trainer keeps the base model frozen and trains a
LoRA adapter (an `A` and a `B` matrix on each of the seven linears of every layer, plain torch);
each step it pushes only those tensors, under PEFT's names, into the engine's adapter `policy`,
while the engine goes on generating. A rollout keeps the adapter version it started with to its
end, and every token it produced names that version (`weight_versions`); requests added after
the update get the new one. The base weights never move.

The task is `async_rl`'s: a character scores when it is a lowercase letter that does not repeat
the class (vowel or consonant) of the letter before it. The random byte-level model scores about
0.1; through its adapter alone it learns to speak in syllables.

Flow:

1. Build an [`LLMEngine`][weightsync.engine.llm_engine.LLMEngine] with `enable_lora`, and the
   same random model in the trainer, frozen. Create the adapter in the engine with its first
   push ([`sync_weights`][weightsync.trainer.senders.sync_weights] with `lora_name` and
   `lora_config`, version 0: `B` is zero, so the adapter answers as the base model does).
2. Each step `k`:
    1. queue batch `k` under the adapter (version `k - 1`) and run half its tokens;
    2. train `A` and `B` on batch `k - 1`: GRPO-style advantages (each rollout's reward minus
       its prompt group's mean, over the group's spread) and a clipped policy-gradient loss,
       each token weighed by the ratio of the current policy to the version that drew it;
    3. push the adapter as version `k` through an
       [`IPCWeightSender`][weightsync.trainer.senders.IPCWeightSender] (shared memory on a CPU):
       the engine does not pause, batch `k` is still in flight;
    4. finish batch `k` and check that each of its tokens names version `k - 1`.
3. Check that the mean reward of the last 5 steps beats that of the first 5 by at least
   `--min-gain`, and that the engine's greedy answers under the adapter are the trainer's merged
   model's (`W + lora_alpha / r * B @ A`), token for token.

Everything random is seeded (`--seed`), and the engine steps in this thread, so a run is
reproducible.

Run it: `python examples/rlhf/rlhf_lora.py` (about 10 seconds on 2 CPU cores).

Hardware: CPUs only, through shared memory. With a GPU the trainer and the engine compute on
`cuda:0` and the same code sends CUDA IPC handles.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings

# torch does not depend on numpy, yet without it `import torch` warns that it failed to initialize
# numpy. Nothing here needs numpy; this filter hides only that warning.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)

import torch  # noqa: E402
from torch.func import functional_call, vmap  # noqa: E402

from weightsync import (  # noqa: E402
    EngineConfig,
    LlamaForCausalLM,
    LLMEngine,
    RequestOutput,
    SamplingParams,
)
from weightsync.trainer import IPCWeightSender, sync_weights  # noqa: E402

DEVICE = "cuda:0" if torch.cuda.is_available() else "cpu"
ADAPTER = "policy"
RANK, ALPHA = 8, 16
SCALING = ALPHA / RANK
# The seven linears of a decoder layer, as PEFT names them (its `target_modules`).
MODULES = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}
# The engine's model fuses q/k/v and gate/up into one linear each, as vLLM's does; the trainer,
# which reuses that model class, adds each part's B @ A to its rows of the fused weight.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
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


class LoRA(torch.nn.Module):
    """A LoRA adapter over a frozen `LlamaForCausalLM`: an `A` and a `B` per targeted linear.

    `A` (rank x in) starts random and `B` (out x rank) at zero, as PEFT starts them, so the
    adapted model starts as the base model.
    """

    def __init__(self, base: LlamaForCausalLM, seed: int) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        specs = base.weight_specs()
        generator = torch.Generator().manual_seed(seed)
        self.a = torch.nn.ParameterDict()
        self.b = torch.nn.ParameterDict()
        self.peft_names: dict[str, tuple[str, str]] = {}  # key -> (A's PEFT name, B's)
        for layer in range(base.config.num_hidden_layers):
            for parent, modules in MODULES.items():
                for module in modules:
                    path = f"model.layers.{layer}.{parent}.{module}"
                    out_features, in_features = specs[f"{path}.weight"].shape
                    key = path.replace(".", "_")
                    a = torch.randn(RANK, in_features, generator=generator) / in_features**0.5
                    self.a[key] = torch.nn.Parameter(a.to(DEVICE))
                    self.b[key] = torch.nn.Parameter(torch.zeros(out_features, RANK, device=DEVICE))
                    peft = f"base_model.model.{path}"
                    self.peft_names[key] = (f"{peft}.lora_A.weight", f"{peft}.lora_B.weight")

    def peft_state_dict(self) -> list[tuple[str, torch.Tensor]]:
        """The adapter's tensors under PEFT's names, as `get_peft_model_state_dict` gives them."""
        pairs = []
        for key, (a_name, b_name) in self.peft_names.items():
            pairs += [(a_name, self.a[key].detach()), (b_name, self.b[key].detach())]
        return pairs

    def merged(self) -> dict[str, torch.Tensor]:
        """The base model's parameters with `SCALING * B @ A` added to each targeted weight."""
        params = dict(self.base.named_parameters())
        for name in list(params):
            module_path, _, leaf = name.rpartition(".")
            prefix, _, module = module_path.rpartition(".")
            parts = FUSED.get(module, (module,))
            keys = [f"{prefix}.{part}".replace(".", "_") for part in parts]
            if leaf != "weight" or keys[0] not in self.a:
                continue
            delta = torch.cat([self.b[k] @ self.a[k] for k in keys])  # (out, in) of the fused
            params[name] = params[name] + SCALING * delta
        return params


def readable(text: str) -> str:
    """`text` with every character that is not printable ASCII shown as `·` (bytes decode raw)."""
    return "".join(c if c.isascii() and c.isprintable() else "·" for c in text)


def rollout_requests(step: int, args: argparse.Namespace) -> tuple[list[str], list[SamplingParams]]:
    """Batch `step`: each prompt `--samples` times, each rollout with a seed of its own."""
    prompts = [f"Say it {i}: " for i in range(args.prompts) for _ in range(args.samples)]
    params = [
        SamplingParams(
            temperature=1.0,
            max_tokens=args.max_tokens,
            ignore_eos=True,  # equal lengths: the batch stays rectangular
            seed=args.seed * 1_000_003 + step * 1_000 + index,
        )
        for index in range(len(prompts))
    ]
    return prompts, params


def token_logprobs(
    model: LoRA, params: dict[str, torch.Tensor], tokens: torch.Tensor, prompt_len: int
) -> torch.Tensor:
    """(rollouts, output) log-probability of each output token under the weights `params`."""
    base = model.base
    buffers = dict(base.named_buffers())
    # The model reads one sequence at a time; vmap runs it over the batch in one pass.
    hidden = vmap(lambda ids: functional_call(base, (params, buffers), (ids,)))(tokens)
    logits = base.compute_logits(hidden[:, prompt_len - 1 : -1])  # (rollouts, output, vocab)
    targets = tokens[:, prompt_len:, None]
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets).squeeze(-1)


def train_step(
    model: LoRA,
    optimizer: torch.optim.Optimizer,
    outputs: list[RequestOutput],
    behaviour_params: dict[str, torch.Tensor],
    args: argparse.Namespace,
) -> float:
    """One clipped policy-gradient step on A and B; returns the batch's mean reward.

    `behaviour_params` are the merged weights of the version that drew the batch: each token's
    gradient is weighed by the current policy's probability over that one's, clipped.
    """
    completions = [o.outputs[0] for o in outputs]
    rewards = torch.tensor([syllable_reward(c.text, args.max_tokens) for c in completions])
    rewards = rewards.view(args.prompts, args.samples)
    advantages = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)
    advantages = advantages.view(-1, 1).to(DEVICE)  # (rollouts, 1)
    tokens = torch.tensor(
        [o.prompt_token_ids + c.token_ids for o, c in zip(outputs, completions, strict=True)],
        device=DEVICE,
    )
    prompt_len = len(outputs[0].prompt_token_ids)
    logprobs = token_logprobs(model, model.merged(), tokens, prompt_len)  # with grad
    with torch.no_grad():
        behaviour = token_logprobs(model, behaviour_params, tokens, prompt_len)
    ratio = torch.exp(logprobs - behaviour)
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(1 - CLIP, 1 + CLIP) * advantages)
    loss = -surrogate.mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return rewards.mean().item()


@torch.no_grad()
def merged_greedy(model: LoRA, prompt_token_ids: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens of the trainer's merged model, recomputing the whole sequence each token."""
    params, buffers = model.merged(), dict(model.base.named_buffers())
    tokens = list(prompt_token_ids)
    for _ in range(max_tokens):
        ids = torch.tensor(tokens, device=DEVICE)
        hidden = functional_call(model.base, (params, buffers), (ids,))
        tokens.append(int(model.base.compute_logits(hidden[-1:]).argmax(-1)))
    return tokens[len(prompt_token_ids) :]


def main() -> int:
    """Runs the loop; returns the exit code (non-zero unless the reward rose and tokens match)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="training steps (default 30)")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per batch (default 4)")
    parser.add_argument("--samples", type=int, default=8, help="rollouts per prompt (default 8)")
    parser.add_argument("--max-tokens", type=int, default=12, help="tokens per rollout")
    parser.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate")
    parser.add_argument("--min-gain", type=float, default=0.3, help="required reward rise")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model and the sampling")
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    base = LlamaForCausalLM.from_preset("debug", seed=args.seed).to(DEVICE)
    model = LoRA(base, seed=args.seed)
    optimizer = torch.optim.Adam([*model.a.values(), *model.b.values()], lr=args.lr)
    lora_config = {
        "peft_type": "LORA",
        "r": RANK,
        "lora_alpha": ALPHA,
        "target_modules": [m for modules in MODULES.values() for m in modules],
    }
    engine = LLMEngine(
        LlamaForCausalLM.from_preset("debug", seed=args.seed).to(DEVICE),  # the trainer's base
        engine_config=EngineConfig(
            max_num_seqs=args.prompts * args.samples,
            enable_lora=True,
            max_lora_rank=RANK,
            max_loras=1,
            max_lora_versions=2,  # the version in flight and the one just pushed
        ),
    )
    adapter_bytes = sum(t.numel() * t.element_size() for _, t in model.peft_state_dict())
    model_bytes = sum(t.numel() * t.element_size() for t in base.parameters())
    print(
        f"trainer and engine on {DEVICE}; the adapter is {adapter_bytes / 1e3:.0f} kB, "
        f"the model {model_bytes / 1e3:.0f} kB"
    )
    rewards: list[float] = []
    landed_in_flight = 0
    start = time.perf_counter()
    # --8<-- [start:loop]
    with IPCWeightSender([engine]) as sender:
        # Version 0 creates the adapter in the engine: B = 0, so it answers as the base model.
        sync_weights(
            sender,
            model.peft_state_dict(),
            lora_name=ADAPTER,
            lora_config=lora_config,
            weight_version=0,
        )
        outputs = engine.generate(*rollout_requests(0, args), lora_name=ADAPTER)
        drew_previous = {n: p.detach().clone() for n, p in model.merged().items()}
        for step in range(1, args.steps + 1):
            # 1. Batch `step` starts under the adapter's current version, `step - 1`.
            prompts, params = rollout_requests(step, args)
            request_ids = [f"{step}-{index}" for index in range(len(prompts))]
            for request_id, prompt, sampling in zip(request_ids, prompts, params, strict=True):
                engine.add_request(request_id, prompt, sampling, lora_name=ADAPTER)
            finals: dict[str, RequestOutput] = {}
            for _ in range(args.max_tokens // 2):  # half the rollout: the batch is in flight
                finals |= {o.request_id: o for o in engine.step() if o.finished}
            # 2. Train on batch `step - 1`, drawn by version `step - 2` (its merged weights).
            drew_current = {n: p.detach().clone() for n, p in model.merged().items()}
            rewards.append(train_step(model, optimizer, outputs, drew_previous, args))
            drew_previous = drew_current
            # 3. Version `step` lands while batch `step` runs: no pause, only A and B move.
            sync_weights(sender, model.peft_state_dict(), lora_name=ADAPTER, weight_version=step)
            # 4. Batch `step` finishes on the version it started with.
            in_flight = len(request_ids) - len(finals)
            landed_in_flight += in_flight > 0
            while engine.has_unfinished_requests():
                finals |= {o.request_id: o for o in engine.step() if o.finished}
            outputs = [finals[request_id] for request_id in request_ids]
            versions = {v for o in outputs for v in o.outputs[0].weight_versions}
            if versions != {step - 1}:
                print(f"error: batch {step} carries versions {versions}, not {step - 1}")
                return 1
            print(
                f"step {step:3d}  reward {rewards[-1]:.3f}  version {step} landed with "
                f"{in_flight} rollouts in flight; batch {step} drawn by version {step - 1}  "
                f"e.g. {readable(outputs[0].outputs[0].text)}"
            )
        rewards.append(train_step(model, optimizer, outputs, drew_previous, args))

        # The engine's adapter answers as the trainer's merged weights, token for token.
        sync_weights(sender, model.peft_state_dict(), lora_name=ADAPTER, weight_version="final")
    # --8<-- [end:loop]
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = [f"Say it {i}: " for i in range(args.prompts)]
    answers = engine.generate(prompts, greedy, lora_name=ADAPTER)
    same = all(
        a.outputs[0].token_ids == merged_greedy(model, a.prompt_token_ids, args.max_tokens)
        for a in answers
    )
    base_answer = engine.generate(prompts[:1], greedy)[0].outputs[0]
    k = 5
    first, last = statistics.mean(rewards[:k]), statistics.mean(rewards[-k:])
    print(
        f"mean reward: first {k} steps {first:.3f}, last {k} steps {last:.3f} "
        f"({time.perf_counter() - start:.1f} s); {landed_in_flight} updates landed mid-rollout; "
        f"greedy under the adapter {readable(answers[0].outputs[0].text)!r} (versions "
        f"{set(answers[0].outputs[0].weight_versions)}), the base model {readable(base_answer.text)!r} "
        f"(version {engine.weight_version}); the engine's tokens equal the merged model's: {same}"
    )
    if last - first < args.min_gain:
        print(f"error: the reward rose by {last - first:.3f} < {args.min_gain}", file=sys.stderr)
        return 1
    if not same:
        print(
            "error: the engine's adapter answers differ from the merged weights'", file=sys.stderr
        )
        return 1
    if landed_in_flight != args.steps:
        print("error: an update did not land while rollouts were in flight", file=sys.stderr)
        return 1
    print(f"ok: the reward rose by {last - first:.3f}, moving only the adapter, with no pause")
    return 0


if __name__ == "__main__":
    sys.exit(main())
