"""A Hugging Face `transformers` model as the trainer, updating a `weightsync serve` of its directory.

What it shows: a real checkpoint's path through weightsync. The trainer holds a Qwen2-shaped
`transformers` model and its own tokenizer and chat template; `weightsync serve` serves the very
same directory, with that tokenizer and that template. The trainer pushes
`model.named_parameters()` as they are (Hugging Face's names, no renaming, no fusing), and the
server's next chat answer is the one the trainer's model gives.

Flow:

1. Build the checkpoint offline, the way a downloaded one looks: a byte-level BPE tokenizer
   trained here on a few sentences (with `<|im_start|>`/`<|im_end|>` special tokens and a ChatML
   chat template), a random `transformers.Qwen2ForCausalLM` (biases on q/k/v, tied embeddings),
   both saved with `save_pretrained` into one directory.
2. Start `weightsync serve` on that directory as an
   [`EngineProcess`][weightsync.trainer.engine_process.EngineProcess]; ask it a question over
   `/v1/chat/completions` (random weights: a random answer).
3. Train the Hugging Face model for a few steps to answer the question with `--answer`.
4. [`sync_weights`][weightsync.trainer.senders.sync_weights] sends `model.named_parameters()` over
   a broadcast group; the server checks every name, shape and dtype against its model first.
5. Ask again: the server renders the same chat template, answers with the trained answer, and
   stops at `<|im_end|>` (an EOS id of the directory's `generation_config.json`). Check that its
   tokens are those of `transformers`' `generate` and that its weights (`/weight_checker`) are
   the trainer's, byte for byte.

Run it: `python examples/rlhf/hf_trainer.py` (about 30 seconds on 2 shared CPU cores, most of
it importing `transformers` and starting the server). It needs `transformers` (in the `dev`
extra); without it, it says so and exits with code 77 (the test suite then skips it).

Hardware: CPUs only, with `gloo`. With two GPUs the Hugging Face model trains on `cuda:0` and the
same code sends over `nccl` to the server, receiving on `cuda:1`. Both sides compute in float64
(`--dtype`), so that two different attention kernels cannot split a near-tie between two tokens
differently and make greedy outputs diverge for reasons that have nothing to do with the weights.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import httpx
import torch

from weightsync import EngineConfig, weight_checksums
from weightsync.trainer import EngineProcess, create_weight_sender, sync_weights

# The device is chosen here, once: nccl needs a GPU for the trainer and one for the engine.
if torch.cuda.device_count() >= 2:
    BACKEND, TRAINER_DEVICE, ENGINE_DEVICE = "nccl", "cuda:0", "cuda:1"
else:
    BACKEND, TRAINER_DEVICE, ENGINE_DEVICE = "gloo", "cpu", "cpu"
SKIPPED = 77  # the exit code of a check that cannot run here (as automake's test drivers read it)
QUESTION = "Where do the new weights go?"
CORPUS = [
    "The trainer sends its weights to the engine while the engine serves.",
    "Where do the new weights go? Into the running engine, by name.",
    "Pause, update, resume: no request is lost and no token mixes two versions.",
    "A chat template turns messages into the model's prompt.",
]
CHATML = (
    "{% for message in messages %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_checkpoint(directory: Path, dtype: torch.dtype) -> tuple[object, object]:
    """Writes a tokenizer and a random Qwen2 model to `directory`; returns both, as loaded."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    transformers.utils.logging.disable_progress_bar()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        CORPUS,
        trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False,
                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()),
    )  # fmt: skip
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(directory)

    eos, pad = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    config = transformers.Qwen2Config(
        vocab_size=(len(tokenizer) + 63) // 64 * 64,  # padded past the tokenizer, as Qwen's is
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).to(dtype)
    model.generation_config = transformers.GenerationConfig(
        eos_token_id=[eos, pad], pad_token_id=pad
    )
    model.save_pretrained(directory)
    return tokenizer, model


def ask(engine: EngineProcess, max_tokens: int) -> dict:
    """The server's greedy answer to `QUESTION` over `/v1/chat/completions` (the first choice)."""
    body = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": max_tokens,
            "temperature": 0}  # fmt: skip
    answer = httpx.post(f"{engine.base_url}/v1/chat/completions", json=body, timeout=120)
    answer.raise_for_status()
    return answer.json()["choices"][0]


def main() -> int:
    """Runs the demo; returns the exit code (non-zero unless both models answer the same)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--answer", default=" Into the running engine, by name.",
                        help="what the trainer learns to answer")  # fmt: skip
    parser.add_argument("--train-steps", type=int, default=60, help="Adam steps (default 60)")
    parser.add_argument("--max-tokens", type=int, default=24, help="most tokens of an answer")
    parser.add_argument("--dtype", default="float64", choices=["float64", "float32"])
    args = parser.parse_args()
    try:
        import transformers  # noqa: F401 - checked here: the example needs it
    except ImportError:
        print("skipped: this example needs transformers (pip install -e '.[dev]')")
        return SKIPPED

    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory(prefix="weightsync-qwen2-") as name:
        directory = Path(name)
        tokenizer, model = build_checkpoint(directory, dtype)
        print(f"checkpoint in {directory.name}: Qwen2, {len(tokenizer)} tokens, chat template")
        engine = EngineProcess(
            str(directory),  # `weightsync serve DIR`: this directory's weights, tokenizer, template
            dtype=args.dtype,
            engine_config=EngineConfig(num_kv_blocks=64),
            backend=BACKEND,
            device=ENGINE_DEVICE,
        )
        try:
            before = ask(engine, args.max_tokens)
            print(f"server before the update: {before['message']['content']!r}")

            # Supervised steps on the chat-formatted question and its answer.
            model = model.to(TRAINER_DEVICE)
            messages = [{"role": "user", "content": QUESTION}]
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            prompt_ids = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
            target = prompt_ids + tokenizer.encode(args.answer) + [tokenizer.eos_token_id]
            ids = torch.tensor([target], device=TRAINER_DEVICE)
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
            for _ in range(args.train_steps):
                loss = model(input_ids=ids, labels=ids).loss
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            model.eval()
            print(f"Hugging Face model on {TRAINER_DEVICE}, {args.dtype}; loss {loss.item():.4f}")

            with create_weight_sender(BACKEND, [engine]) as sender:
                stats = sync_weights(sender, model.named_parameters(), weight_version="hf-1")
            print(
                f"sent {stats.num_tensors} parameters ({stats.num_bytes / 1e6:.2f} MB) over {BACKEND}"
            )
            after = ask(engine, args.max_tokens)
            same_weights = engine.weight_digests() == weight_checksums(model.named_parameters())
        finally:
            engine.close()

    served = torch.tensor([after["prompt_token_ids"]], device=TRAINER_DEVICE)
    with torch.no_grad():
        reference = model.generate(served, attention_mask=torch.ones_like(served),
                                   do_sample=False, max_new_tokens=args.max_tokens)  # fmt: skip
    reference_ids = reference[0, served.shape[1] :].tolist()
    print(f"server after the update:  {after['message']['content']!r} ({after['finish_reason']})")
    checks = {
        "the prompt is the chat template's": after["prompt_token_ids"] == prompt_ids,
        "same tokens as transformers' generate": after["token_ids"] == reference_ids,
        "the trained answer": after["message"]["content"] == args.answer,
        "ended at <|im_end|>": after["finish_reason"] == "stop",
        "every token from the new weights": set(after["weight_versions"]) == {"hf-1"},
        "server weights equal the trainer's": same_weights,
    }
    for check, passed in checks.items():
        print(f"{check}: {passed}")
    if not all(checks.values()):
        print("error: the server does not answer as the trained model does", file=sys.stderr)
        return 1
    print("ok: the server answers exactly as the trained Hugging Face model")
    return 0


if __name__ == "__main__":
    sys.exit(main())
