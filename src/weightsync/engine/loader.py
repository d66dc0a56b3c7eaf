"""Loading and saving Hugging Face-format model directories: `config.json` + safetensors.

`load_model` resolves what `LLMEngine` is given by name: a preset, or a directory with its model
and its tokenizer.

Safetensors files are read and written by `weightsync.transfer._safetensors` (the reader the
`disk` transfer backend shares), so loading a checkpoint needs no extra package and never
unpickles anything.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from weightsync.engine.hf_tokenizer import _read_json, load_tokenizer
from weightsync.engine.model import LlamaForCausalLM
from weightsync.engine.model_config import _PRESETS, LlamaConfig
from weightsync.engine.tokenizer import ByteTokenizer, Tokenizer
from weightsync.errors import EngineConfigError, WeightValidationError
from weightsync.transfer._safetensors import (
    open_regular,
    read_header,
    read_index,
    read_tensor,
    write_safetensors,
)

__all__ = [
    "load_hf_directory",
    "load_model",
    "save_hf_directory",
]

logger = logging.getLogger(__name__)


def _read_safetensors(path: str | os.PathLike[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """A safetensors file's `(name, tensor)` pairs, read one at a time once its header passed."""
    # A file that is not valid safetensors raises EngineConfigError, one line naming it.
    try:
        entries = read_header(path)
        with open_regular(path) as f:
            for entry in entries:
                yield entry.spec.name, read_tensor(f.fileno(), entry)
    except WeightValidationError as exc:
        raise EngineConfigError(str(exc)) from None


def save_hf_directory(model: LlamaForCausalLM, path: str | os.PathLike[str]) -> None:
    """Writes `model` as a Hugging Face directory: `config.json` and `model.safetensors`."""
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    config = {**model.config.to_hf_dict(), "torch_dtype": str(model.dtype).removeprefix("torch.")}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    write_safetensors(dict(model.named_weights()), directory / "model.safetensors")


def load_hf_directory(
    path: str | os.PathLike[str], *, dtype: torch.dtype = torch.float32
) -> LlamaForCausalLM:
    """Builds a model from a local Hugging Face directory (Llama, Qwen2, Qwen3); never downloads.

    Reads `config.json` and `model.safetensors` (or the shards listed in
    `model.safetensors.index.json`). A tied model's `lm_head.weight` and an older checkpoint's
    rotary frequencies, if present, are skipped.

    Args:
        path: The directory.
        dtype: Parameter dtype of the built model (weights are cast).

    Raises:
        EngineConfigError: Missing or malformed files, an unsupported architecture, or weights
            that do not cover the model; the message names the file and what is wrong.
    """
    directory = Path(path)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise EngineConfigError(
            f"{directory} has no config.json: pass a Hugging Face model directory or a preset name"
        )
    config = LlamaConfig.from_hf_dict(_read_json(config_path), source=str(config_path))
    try:
        index = read_index(directory)
    except WeightValidationError as exc:
        raise EngineConfigError(str(exc)) from None
    if index is not None:
        files = sorted(set(index.values()))
    elif (directory / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise EngineConfigError(
            f"{directory} has no model.safetensors or model.safetensors.index.json; convert "
            "other checkpoint formats to safetensors first"
        )
    try:
        model = LlamaForCausalLM(config, dtype=dtype)
    except EngineConfigError as exc:  # a shape that cannot fit this machine
        raise EngineConfigError(f"{config_path}: {exc}") from None
    expected = set(model.weight_specs())
    loaded: set[str] = set()
    for file in files:
        pairs = _read_safetensors(directory / file)
        kept = (
            _floating(directory / file, n, t)
            for n, t in pairs
            if not (n == "lm_head.weight" and config.tie_word_embeddings)
            # Older Llama checkpoints saved the rotary frequencies, which the model computes.
            and not n.endswith("rotary_emb.inv_freq")
        )
        try:
            names = model.load_weights(kept)
        except WeightValidationError as exc:
            raise EngineConfigError(f"{directory / file} does not fit config.json: {exc}") from None
        # A tensor in two files would load whichever file sorts last: which one is meant?
        twice = sorted(loaded.intersection(names))
        if twice:
            raise EngineConfigError(
                f"{directory / file}: tensor {twice[0]!r} is also in another file of the "
                "checkpoint; each tensor must be in one file (the disk transfer backend's rule)"
            )
        loaded.update(names)
    missing = sorted(expected - loaded)
    if missing:
        raise EngineConfigError(
            f"{directory}: the checkpoint lacks {len(missing)} weights, e.g. {missing[:5]}"
        )
    logger.info("loaded %s (%d weights, %d files)", directory, len(loaded), len(files))
    return model


def _floating(path: Path, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
    """`(name, tensor)`, refused when its dtype is not a float: every weight of the model is.

    Casting integers (or booleans) into a float weight would load numbers that were never a
    model's: the file is damaged or not this model's checkpoint.
    """
    if not tensor.dtype.is_floating_point:
        raise EngineConfigError(
            f"{path}: tensor {name!r} has dtype {str(tensor.dtype).removeprefix('torch.')}, but the model's weights "
            "are floating point (F16, BF16, F32, F64): the file is not this model's checkpoint"
        )
    return name, tensor


def load_model(
    name: str, *, seed: int = 0, dtype: torch.dtype = torch.float32
) -> tuple[LlamaForCausalLM, Tokenizer]:
    """A model and its tokenizer, by name: a preset, or a local Hugging Face directory.

    A preset (`"debug"`, `"tiny"`, `"small"`) has random weights from `seed` and the byte
    tokenizer. A directory of a supported family (Llama 1 to 3.x, Qwen2 and Qwen2.5, Qwen3:
    `SUPPORTED_MODEL_TYPES`) brings its weights (`load_hf_directory`) and its tokenizer,
    `tokenizer.json` with its special tokens, EOS ids and chat template (`HFTokenizer`); without
    a `tokenizer.json` text goes through the byte tokenizer.

    Raises:
        EngineConfigError: Not a preset and not a loadable directory; the message names the
            file and the key at fault.
    """
    if name in _PRESETS:
        return LlamaForCausalLM.from_preset(name, seed=seed, dtype=dtype), ByteTokenizer()
    model = load_hf_directory(name, dtype=dtype)
    return model, load_tokenizer(name, vocab_size=model.config.vocab_size)
