"""Writes a random checkpoint directory, for `bench_engine.py --model DIR` and `bench_vs_vllm.py`.

    python benchmarks/model_dir.py DIR
    python benchmarks/model_dir.py DIR --kind llama-27m

Qwen2.5-0.5B's width and vocabulary with 4 of its 24 layers (`--layers 24`: all of them):
hidden size 896, 14 query heads and 2 key/value heads of 64, an MLP of 4,864, biases on q/k/v,
tied embeddings, and the real vocabulary size, 151,936, so that the LM head costs what it costs
(about 136M of the ~200M parameters of 4 layers). The tokenizer is trained offline and grown to
nearly that size, so that every id the model samples decodes to text, as with the real
tokenizer. The weights are random (seeded): the figures are about speed, and `bench_engine.py`
checks the outputs against `transformers`.
Nothing is downloaded.

`--kind llama-27m` writes the Llama that `bench_vs_vllm.py` serves on both sides: the `small`
preset's shape (hidden size 512, 8 layers, 8 query and 4 key/value heads of 64, an MLP of 1,376)
with a byte-level tokenizer grown to a vocabulary of 8,192 and tied embeddings, as Llama 3.2 has:
27.4M parameters, 4.2M of them the embeddings.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import _rigs  # noqa: F401 - puts tests/ (where model_dirs lives) on the import path
from model_dirs import write_model_dir

QWEN2_SHAPE = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 4,
               "num_attention_heads": 14, "num_key_value_heads": 2,
               "max_position_embeddings": 32768}  # fmt: skip
VOCAB_SIZE = 151_936

LLAMA_27M_SHAPE = {"hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 8,
                   "num_attention_heads": 8, "num_key_value_heads": 4,
                   "max_position_embeddings": 2048}  # fmt: skip
LLAMA_27M_VOCAB_SIZE = 8192


def write_llama_27m(directory: Path, *, seed: int = 0) -> Path:
    """Writes the 27M-parameter Llama of `bench_vs_vllm.py` to `directory`; returns it."""
    return write_model_dir(
        directory, "llama3", seed=seed, shape=LLAMA_27M_SHAPE, vocab_size=LLAMA_27M_VOCAB_SIZE
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("directory", type=Path, help="where to write the checkpoint")
    parser.add_argument("--kind", choices=("qwen2", "llama-27m"), default="qwen2",
                        help="which model (default qwen2)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights")
    parser.add_argument(
        "--layers", type=int, default=4, help="decoder layers (24: Qwen2.5-0.5B's whole depth)"
    )
    args = parser.parse_args()
    if args.kind == "llama-27m":
        write_llama_27m(args.directory, seed=args.seed)
    else:
        shape = {**QWEN2_SHAPE, "num_hidden_layers": args.layers}
        write_model_dir(args.directory, "qwen2", seed=args.seed, shape=shape, vocab_size=VOCAB_SIZE)
    print(f"wrote {args.directory}")


if __name__ == "__main__":
    main()
