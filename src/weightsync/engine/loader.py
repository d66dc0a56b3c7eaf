"""Loading and saving Hugging Face-format model directories: `config.json` + safetensors.

`load_model` resolves what `LLMEngine` is given by name: a preset, or a directory with its model
and its tokenizer.

The safetensors format is small enough to read and write here directly (an 8-byte little-endian
header length, a JSON header of names, dtypes, shapes and byte offsets, then raw little-endian
data), so loading a checkpoint needs no extra package and never unpickles anything.
"""

from __future__ import annotations

import json
import logging
import math
import os
import struct
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import torch

from weightsync.engine.hf_tokenizer import load_tokenizer
from weightsync.engine.model import LlamaForCausalLM
from weightsync.engine.model_config import _PRESETS, LlamaConfig
from weightsync.engine.tokenizer import ByteTokenizer, Tokenizer
from weightsync.errors import EngineConfigError, WeightValidationError
from weightsync.transfer.checksums import _byte_view

__all__ = [
    "load_hf_directory",
    "load_model",
    "save_hf_directory",
]

logger = logging.getLogger(__name__)

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


def _read_safetensors(path: str | os.PathLike[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields the `(name, tensor)` pairs of a safetensors file, one tensor read at a time.

    The whole header is checked before any tensor is read (`_read_header`).

    Raises:
        EngineConfigError: The file is not valid safetensors (bad header, offsets or dtype);
            one line naming the file, the tensor and what is wrong.
    """
    if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
        raise EngineConfigError("reading safetensors needs a little-endian machine")
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(0)
        entries, base = _read_header(path, f, size)
        for name, (dtype, shape, begin, end) in entries.items():
            if begin == end:
                yield name, torch.empty(shape, dtype=dtype)
                continue
            f.seek(base + begin)
            data = bytearray(f.read(end - begin))
            yield name, torch.frombuffer(data, dtype=dtype).reshape(shape)


_Entry = tuple[torch.dtype, list[int], int, int]  # dtype, shape, first and past-last data byte


def _read_header(
    path: str | os.PathLike[str], f: BinaryIO, size: int
) -> tuple[dict[str, _Entry], int]:
    """A safetensors file's header, every value checked: its tensors and where their data starts.

    Raises:
        EngineConfigError: A file shorter than its header, a header that is not a JSON object,
            an entry that is not an object or lacks `dtype`, `shape` or `data_offsets`, a
            shape that is not a list of ints >= 0, or offsets that do not match the shape or
            fall outside the file.
    """
    if size < 8:
        raise EngineConfigError(
            f"{path}: the file has {size} bytes, fewer than the 8 of a safetensors header length"
        )
    (header_len,) = struct.unpack("<Q", f.read(8))
    if header_len > size - 8:
        raise EngineConfigError(f"{path}: safetensors header length {header_len} exceeds the file")
    try:
        header = json.loads(f.read(header_len).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise EngineConfigError(f"{path}: the safetensors header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise EngineConfigError(
            f"{path}: the safetensors header must be a JSON object of tensors, got "
            f"{type(header).__name__}"
        )
    base, data_size = 8 + header_len, size - 8 - header_len
    entries: dict[str, _Entry] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        where = f"{path}: tensor {name!r}"
        if not isinstance(entry, dict):
            raise EngineConfigError(
                f"{where} must be an object with dtype, shape and data_offsets, got "
                f"{type(entry).__name__}"
            )
        missing = [key for key in ("dtype", "shape", "data_offsets") if key not in entry]
        if missing:
            raise EngineConfigError(f"{where} has no {missing[0]!r}")
        dtype = _DTYPES.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
        if dtype is None:
            raise EngineConfigError(
                f"{where} has dtype {entry['dtype']!r}; supported: {sorted(_DTYPES)}"
            )
        shape, offsets = entry["shape"], entry["data_offsets"]
        if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
            raise EngineConfigError(f"{where}: shape must be a list of ints >= 0, got {shape!r}")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(_is_count(o) for o in offsets)
        ):
            raise EngineConfigError(f"{where}: data_offsets must be two ints >= 0, got {offsets!r}")
        begin, end = offsets
        if not begin <= end <= data_size or end - begin != math.prod(shape) * dtype.itemsize:
            raise EngineConfigError(
                f"{where} has data_offsets {offsets} that do not hold its shape {shape} of "
                f"{entry['dtype']} within the file's {data_size} data bytes"
            )
        entries[name] = (dtype, shape, begin, end)
    return entries, base


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _write_safetensors(tensors: Mapping[str, torch.Tensor], path: str | os.PathLike[str]) -> None:
    """Writes `tensors` to a safetensors file (readable by the `safetensors` package too)."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    payloads = []
    for name, tensor in tensors.items():
        data = _byte_view(tensor)  # zero-copy; keeps its tensor alive until written
        header[name] = {
            "dtype": _NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        offset += len(data)
        payloads.append(data)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the format aligns the data section to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for data in payloads:
            f.write(data)


def save_hf_directory(model: LlamaForCausalLM, path: str | os.PathLike[str]) -> None:
    """Writes `model` as a Hugging Face directory: `config.json` and `model.safetensors`."""
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    config = {**model.config.to_hf_dict(), "torch_dtype": str(model.dtype).removeprefix("torch.")}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    _write_safetensors(dict(model.named_weights()), directory / "model.safetensors")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise EngineConfigError(f"{path} is not valid JSON: {exc}") from None


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
    index_path = directory / "model.safetensors.index.json"
    if index_path.is_file():
        index = _read_json(index_path)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise EngineConfigError(f"{index_path}: weight_map must map names to file names")
        files = sorted(set(map(str, weight_map.values())))
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
            loaded.update(model.load_weights(kept))
        except WeightValidationError as exc:
            raise EngineConfigError(f"{directory / file} does not fit config.json: {exc}") from None
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
            f"{path}: tensor {name!r} has dtype {_NAMES[tensor.dtype]}, but the model's weights "
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
