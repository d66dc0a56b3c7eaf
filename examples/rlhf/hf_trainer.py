"""A Hugging Face `transformers` model as the trainer: its parameters go straight into the engine.

What it shows: the engine speaks Hugging Face's parameter names at its edges, so a trainer that
holds a `transformers.LlamaForCausalLM` pushes `model.named_parameters()` as they are: no
renaming, no fusing, no conversion on the trainer's side. The engine starts with zeroed weights
of the same shape (built from the model's `config.json` fields), takes one update, and then
generates exactly what the Hugging Face model generates.

Flow:

1. Build a small random `transformers.LlamaForCausalLM` (no download: a config and a seed) with
   the byte-level vocabulary of [`ByteTokenizer`][weightsync.engine.tokenizer.ByteTokenizer], and
   train it for a few steps to say `--phrase`.
2. Start an [`EngineProcess`][weightsync.trainer.engine_process.EngineProcess] from the same
   config (`model.config`'s JSON form); its weights are zero until the trainer sends some.
3. [`sync_weights`][weightsync.trainer.sync.sync_weights] sends `model.named_parameters()` over
   a broadcast group; the engine checks every name, shape and dtype against its own model first.
4. Generate greedily from both, for a few prompts, and check that the tokens are identical and
   that the engine's weights equal the Hugging Face model's byte for byte.

Run it: `python examples/rlhf/hf_trainer.py` (about 10 seconds on 2 CPU cores, most of it
importing `transformers`). It needs `transformers` (in the `dev` extra); without it, it says so
and exits with code 77 (the test suite then skips it).

Hardware: CPUs only, with `gloo`. With two GPUs the Hugging Face model trains on `cuda:0` and the
same code sends over `nccl` to the engine, receiving on `cuda:1`. Both sides compute in float64
(`--dtype`), so that two different attention kernels cannot split a near-tie between two tokens
differently and make greedy outputs diverge for reasons that have nothing to do with the weights.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from weightsync import ByteTokenizer, EngineConfig, SamplingParams, weight_checksums
from weightsync.trainer import EngineProcess, create_weight_sender, sync_weights

# The device is chosen here, once: nccl needs a GPU for the trainer and one for the engine.
if torch.cuda.device_count() >= 2:
    BACKEND, TRAINER_DEVICE, ENGINE_DEVICE = "nccl", "cuda:0", "cuda:1"
else:
    BACKEND, TRAINER_DEVICE, ENGINE_DEVICE = "gloo", "cpu", "cpu"
SKIPPED = 77  # the exit code of a check that cannot run here (as automake's test drivers read it)
PROMPTS = ["Hugging Face says:", "The engine says:", "Both say:"]


def main() -> int:
    """Runs the demo; returns the exit code (non-zero unless both models generate the same)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--phrase", default=" same tokens", help="what the trainer learns")
    parser.add_argument("--train-steps", type=int, default=40, help="Adam steps (default 40)")
    parser.add_argument("--max-tokens", type=int, default=16, help="greedy tokens per prompt")
    parser.add_argument("--dtype", default="float64", choices=["float64", "float32"])
    parser.add_argument("--seed", type=int, default=0, help="seed of the random initial model")
    args = parser.parse_args()
    try:
        import transformers
    except ImportError:
        print("skipped: this example needs transformers (pip install -e '.[dev]')")
        return SKIPPED

    dtype = getattr(torch, args.dtype)
    tokenizer = ByteTokenizer()
    config = transformers.LlamaConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(args.seed)
    model = transformers.LlamaForCausalLM(config).to(device=TRAINER_DEVICE, dtype=dtype)

    # A few steps of supervised training, so that the weights the engine gets are a trainer's.
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    ids = torch.tensor([tokenizer.encode(PROMPTS[0] + args.phrase)], device=TRAINER_DEVICE)
    for _ in range(args.train_steps):
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    print(
        f"Hugging Face model on {TRAINER_DEVICE}, {args.dtype}; trained to loss {loss.item():.4f}"
    )

    engine = EngineProcess(
        json.loads(config.to_json_string()),  # the engine's shape, from config.json's fields
        dtype=args.dtype,
        engine_config=EngineConfig(num_kv_blocks=64),
        backend=BACKEND,
        device=ENGINE_DEVICE,
    )
    try:
        with create_weight_sender(BACKEND, [engine]) as sender:
            stats = sync_weights(sender, model.named_parameters(), weight_version="hf-1")
        print(
            f"sent {stats.num_tensors} Hugging Face parameters ({stats.num_bytes / 1e6:.2f} MB) over {BACKEND}"
        )
        greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        outputs = engine.generate(PROMPTS, greedy)
        same_weights = engine.weight_digests() == weight_checksums(model.named_parameters())
    finally:
        engine.close()

    mismatches = 0
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        prompt_ids = torch.tensor([output.prompt_token_ids], device=TRAINER_DEVICE)
        with torch.no_grad():
            reference = model.generate(
                prompt_ids,
                attention_mask=torch.ones_like(prompt_ids),
                max_new_tokens=args.max_tokens,
                min_new_tokens=args.max_tokens,
                do_sample=False,
            )[0, prompt_ids.shape[1] :].tolist()
        engine_ids = output.outputs[0].token_ids
        mismatches += engine_ids != reference
        print(
            f"{prompt!r:22} engine {output.outputs[0].text!r:24} "
            f"Hugging Face {tokenizer.decode(reference)!r:24} same tokens: {engine_ids == reference}"
        )
    print(f"engine weights equal the Hugging Face model's: {same_weights}")
    if mismatches or not same_weights:
        print(f"error: {mismatches} prompts differ; weights equal: {same_weights}", file=sys.stderr)
        return 1
    print("ok: the engine generates exactly what the Hugging Face model generates")
    return 0


if __name__ == "__main__":
    sys.exit(main())
