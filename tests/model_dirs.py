"""Hugging Face model directories built offline, one per supported family, for tests and benchmarks.

Nothing is downloaded: each directory holds a BPE tokenizer trained here on a small corpus (with
its special and added tokens, wrapped by `transformers` and saved as it saves any tokenizer), a
chat template written here in the style of the family's, and a random `transformers` model of the
family saved by `save_pretrained`. The families mirror what RL users train:

- `llama2`: SentencePiece-style tokenizer (a word's leading space is part of its token, rare
  characters fall back to byte tokens), `<s>` first, rope scaling `linear`, untied head;
- `llama3`: byte-level tokenizer, `<|begin_of_text|>` first, three EOS ids in
  `generation_config.json`, rope scaling `llama3`, tied embeddings (as Llama 3.2);
- `qwen2`: byte-level tokenizer without BOS, biases on q/k/v, tied embeddings, a model
  vocabulary padded past the tokenizer's (as Qwen2.5's 151,936 past 151,665);
- `qwen3`: like Qwen2 without biases, with q/k norms and a `head_dim` that is not
  `hidden_size / heads`, untied head, and `<think>` as added (not special) tokens.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tokenizers import (
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Weights move from the trainer to the engine while it serves.",
    "pause, update, resume: the engine never serves half an update.",
    "Héllo wörld, ça va? Größe, naïve café, façade, jalapeño.",
    "日本語のテキストも少し。東京は大きい。",
    "Emoji too: ✓ ✗ → ★ 🤖 🚀 🎉",
    "def main():\n    return 42  # code with indentation\n",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159",
    "The answer is: the answer is the answer.",
    "reinforcement learning from human feedback, rollouts and rewards",
] * 8

# How Qwen's tokenizers split text before byte-level BPE (letters, single digits, punctuation
# runs, newlines, spaces); `transformers` builds a Qwen tokenizer with this split whatever its
# tokenizer.json says, so the fixture's tokenizer.json says it too.
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CHATML = (
    "{% if messages[0].role != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHATML_THINK = CHATML.replace(
    "<|im_start|>assistant\n{% endif %}",
    "<|im_start|>assistant\n<think>\n\n</think>\n\n{% endif %}",
)
HEADERS = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message.role }}<|end_header_id|>\n\n{{ message.content | trim }}"
    "<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
INST = (
    "{% for message in messages %}"
    "{% if (message.role == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}"
    "{% endif %}"
    "{% if message.role == 'user' %}{{ bos_token + '[INST] ' + message.content | trim + ' [/INST]' }}"
    "{% else %}{{ ' ' + message.content | trim + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
)


@dataclass(frozen=True)
class Family:
    """How one family's directory is built."""

    config_class: str  # the transformers config class
    metaspace: bool  # SentencePiece-style tokenizer, else byte-level
    specials: tuple[str, ...]  # special tokens, ids 0.. in this order
    bos: str | None
    eos: str
    pad: str | None
    generation_eos: tuple[str, ...]  # generation_config.json's eos_token_id, by token
    template: str
    added: tuple[str, ...] = ()  # added tokens that are not special
    config: dict[str, Any] = field(default_factory=dict)
    vocab_multiple: int = 1  # the model's vocabulary is padded to a multiple of this


FAMILIES = {
    "llama2": Family(
        "LlamaConfig", True, ("<unk>", "<s>", "</s>"), "<s>", "</s>", None, ("</s>",), INST,
        config={"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    ),
    "llama3": Family(
        "LlamaConfig", False,
        ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
         "<|eom_id|>", "<|eot_id|>"),
        "<|begin_of_text|>", "<|eot_id|>", None,
        ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"), HEADERS,
        config={"rope_theta": 500000.0, "tie_word_embeddings": True,
                "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
        vocab_multiple=64,
    ),
    "qwen2": Family(
        "Qwen2Config", False, ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), None,
        "<|im_end|>", "<|endoftext|>", ("<|im_end|>", "<|endoftext|>"), CHATML,
        config={"tie_word_embeddings": True, "rope_theta": 1000000.0}, vocab_multiple=64,
    ),
    "qwen3": Family(
        "Qwen3Config", False, ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), None,
        "<|im_end|>", "<|endoftext|>", ("<|im_end|>", "<|endoftext|>"), CHATML_THINK,
        added=("<think>", "</think>"), config={"head_dim": 32, "tie_word_embeddings": False},
    ),
}  # fmt: skip
"""Every supported family, by name."""

SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512}  # fmt: skip
"""The test models' shape (about 0.1M parameters besides the embeddings)."""


def train_tokenizer(
    family: Family, vocab_size: int = 600, *, grow_to: int | None = None
) -> Tokenizer:
    """A BPE tokenizer of the family's kind, trained on `CORPUS`, with its special tokens.

    `grow_to` (byte-level only) adds merges until the tokenizer knows that many ids: a
    benchmark's model has a real vocabulary size (Qwen2's 151,936), and with this every id it
    samples is a token with text, as with a real tokenizer.
    """
    if family.metaspace:
        tokenizer = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True))
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        tokenizer.decoder = decoders.Sequence([
            decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ])  # fmt: skip
        # Rare characters (the emoji, most of the Japanese) stay out of the alphabet: they are
        # written as byte tokens, several per character. The 80 kept are chosen here, ties by
        # character: the trainer breaks ties in its own hash order, which differs from process
        # to process (a run whose "x" became a byte token decoded differently).
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(family.specials),
                                      limit_alphabet=80, initial_alphabet=_alphabet(80),
                                      show_progress=False)  # fmt: skip
    else:
        tokenizer = Tokenizer(models.BPE())
        if family.config_class.startswith("Qwen"):  # Qwen's pipeline, as its tokenizer.json has it
            tokenizer.normalizer = normalizers.NFC()
            tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ])  # fmt: skip
        else:
            tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=list(family.specials), show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )  # fmt: skip
    tokenizer.train_from_iterator(CORPUS, trainer)
    if family.metaspace:
        tokenizer = _with_byte_fallback(tokenizer)
    elif grow_to is not None:
        tokenizer = _grow(tokenizer, grow_to - len(family.added), set(family.specials))
    if family.bos is not None:
        bos_id = tokenizer.token_to_id(family.bos)
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{family.bos} $A",
            pair=f"{family.bos} $A $B",
            special_tokens=[(family.bos, bos_id)],
        )
    elif not family.metaspace:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.add_tokens(list(family.added))
    return tokenizer


def _alphabet(size: int) -> list[str]:
    """The `size` most frequent characters of `CORPUS` as Metaspace sees them, ties by character."""
    counts = Counter("\u2581".join(CORPUS).replace(" ", "\u2581"))
    return sorted(counts, key=lambda char: (-counts[char], char))[:size]


def _with_byte_fallback(tokenizer: Tokenizer) -> Tokenizer:
    """The tokenizer with SentencePiece's 256 byte tokens `<0x00>`.. in its vocabulary."""
    spec = json.loads(tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    return Tokenizer.from_str(json.dumps(spec))


def _grow(tokenizer: Tokenizer, size: int, specials: set[str], seed: int = 0) -> Tokenizer:
    """The BPE tokenizer with random merges of its tokens added until its vocabulary has `size`."""
    spec = json.loads(tokenizer.to_str())
    vocab, merges = spec["model"]["vocab"], spec["model"]["merges"]
    tokens = [token for token in vocab if token not in specials]
    generator = random.Random(seed)
    while len(vocab) < size:
        left, right = generator.choice(tokens), generator.choice(tokens)
        if left + right not in vocab and len(left + right) <= 16:
            vocab[left + right] = len(vocab)
            merges.append(
                [left, right] if not merges or isinstance(merges[0], list) else f"{left} {right}"
            )
            tokens.append(left + right)
    return Tokenizer.from_str(json.dumps(spec))


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights with N(0, 1/fan_in) matrices, N(0, 0.01) biases and norms near 1.

    `transformers`' own initialization (std 0.02) gives nearly uniform next-token
    distributions; these give decisive ones, as a trained model's are.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float64)
            if param.dim() == 2:
                param.copy_(noise / param.shape[1] ** 0.5)
            elif name.endswith(".bias"):
                param.copy_(noise * 0.1)
            else:
                param.copy_(1 + noise * 0.1)


def write_model_dir(
    path: Path,
    family_name: str,
    *,
    seed: int = 0,
    shape: dict[str, int] | None = None,
    vocab_size: int | None = None,
    tokenizer_vocab: int = 600,
) -> Path:
    """Writes a random model of `family_name` and its tokenizer to `path`; returns `path`.

    Args:
        path: The directory (created).
        family_name: A key of `FAMILIES`.
        seed: Seed of the weights.
        shape: The model's shape (default `SHAPE`).
        vocab_size: The model's vocabulary (default: the tokenizer's, padded as the family pads
            it); a much larger one grows the tokenizer to nearly its size.
        tokenizer_vocab: Size the tokenizer is trained to.
    """
    import transformers

    transformers.utils.logging.disable_progress_bar()
    family = FAMILIES[family_name]
    # A vocabulary of a real size gets a tokenizer that knows nearly all of it (the model's
    # padding past the tokenizer stays, as in the real checkpoints).
    grow_to = vocab_size - 256 if vocab_size and vocab_size > 4 * tokenizer_vocab else None
    tokenizer = train_tokenizer(family, tokenizer_vocab, grow_to=grow_to)
    wrapped = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=family.bos,
        eos_token=family.eos,
        pad_token=family.pad,
        unk_token="<unk>" if family.metaspace else None,
    )
    wrapped.chat_template = family.template
    wrapped.save_pretrained(path)
    known = tokenizer.get_vocab_size()
    multiple = family.vocab_multiple
    size = vocab_size or (known + multiple - 1) // multiple * multiple
    ids = {token: tokenizer.token_to_id(token) for token in (*family.specials, *family.added)}
    config = getattr(transformers, family.config_class)(
        **{**SHAPE, **(shape or {})},
        **family.config,
        vocab_size=size,
        bos_token_id=ids.get(family.bos) if family.bos else None,
        eos_token_id=ids[family.eos],
        pad_token_id=ids.get(family.pad) if family.pad else None,
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    _randomize(model, seed)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=[ids[token] for token in family.generation_eos],
        pad_token_id=config.pad_token_id,
    )
    model.save_pretrained(path)
    return path
