"""Writes a random Qwen2-shaped checkpoint directory, for `bench_engine.py --model DIR`.

    python benchmarks/model_dir.py DIR

Qwen2.5-0.5B's width and vocabulary with 4 of its 24 layers (`--layers 24`: all of them):
hidden size 896, 14 query heads and 2 key/value heads of 64, an MLP of 4,864, biases on q/k/v,
tied embeddings, and the real vocabulary size, 151,936, so that the LM head costs what it costs
(about 136M of the ~200M parameters of 4 layers). The tokenizer is trained offline and grown to
nearly that size, so that every id the model samples decodes to text, as with the real
tokenizer. The weights are random (seeded): the figures are about speed, and `bench_engine.py`
checks the outputs against `transformers`.
Nothing is downloaded.
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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("directory", type=Path, help="where to write the checkpoint")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights")
    parser.add_argument(
        "--layers", type=int, default=4, help="decoder layers (24: Qwen2.5-0.5B's whole depth)"
    )
    args = parser.parse_args()
    shape = {**QWEN2_SHAPE, "num_hidden_layers": args.layers}
    write_model_dir(args.directory, "qwen2", seed=args.seed, shape=shape, vocab_size=VOCAB_SIZE)
    print(f"wrote {args.directory}")


if __name__ == "__main__":
    main()
