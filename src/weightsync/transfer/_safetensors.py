"""The safetensors format, read and written directly: every header checked, no data unpickled.

A file is an 8-byte little-endian header length, a JSON header (each tensor's dtype, shape and data
offsets), then the raw data: the header alone says what a file holds, checked before data is read.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import stat
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from weightsync.errors import WeightValidationError
from weightsync.transfer.base import _MAX_DIMS, TensorSpec, _is_int
from weightsync.transfer.checksums import _byte_view

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
# Real headers are kilobytes to megabytes: a hostile length must not size the reader's allocation.
_MAX_HEADER_BYTES = 100 << 20
# NumPy's limit; a model's tensors have one to a few.
INDEX_FILE = "model.safetensors.index.json"
# A checkpoint's JSON and template files are kilobytes to tens of megabytes (the largest known
# tokenizer.json, about 35 MB): a larger one is damaged or hostile, and must not size a read.
MAX_TEXT_FILE_BYTES = 256 << 20


@dataclass(frozen=True)
class SafetensorsEntry:
    """Where one tensor of a safetensors file lies: its spec, and its data's offset in the file."""

    spec: TensorSpec
    offset: int


def open_regular(path: str | os.PathLike[str]) -> BinaryIO:
    """Opens a checkpoint file; anything but a regular file is refused before a byte is read."""
    try:  # opened without blocking: a FIFO would block `open` until some writer came
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise WeightValidationError(f"{path}: cannot read: {exc}") from None
    if stat.S_ISREG(os.fstat(fd).st_mode):
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    os.close(fd)
    raise WeightValidationError(
        f"{path}: not a regular file (a FIFO, a device or a socket); a checkpoint's files must be "
        "plain files"
    )


def read_text(path: str | os.PathLike[str]) -> str:
    """A checkpoint's JSON or template file as text, its newlines read as Python reads text.

    Opened as `open_regular` opens (a FIFO never blocks), and refused past `MAX_TEXT_FILE_BYTES`
    before it is read.

    Raises:
        WeightValidationError: Not a regular file, cannot be opened or read, or too large.
        UnicodeDecodeError: Not UTF-8.
    """
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        # The size may change after the stat: the read stops past the bound too.
        try:
            raw = b"" if size > MAX_TEXT_FILE_BYTES else f.read(MAX_TEXT_FILE_BYTES + 1)
        except OSError as exc:  # a link to a file that cannot be read (/proc/self/mem, say)
            raise WeightValidationError(f"{path}: cannot read: {exc}") from None
    if size > MAX_TEXT_FILE_BYTES or len(raw) > MAX_TEXT_FILE_BYTES:
        raise WeightValidationError(
            f"{path}: more than {MAX_TEXT_FILE_BYTES} bytes, far past any checkpoint's JSON or "
            "template file: the file is damaged, or not one of a checkpoint"
        )
    return raw.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")


def read_header(path: str | os.PathLike[str]) -> list[SafetensorsEntry]:
    """The checked header of a safetensors file, one entry per tensor in data order; no data read."""
    if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
        raise WeightValidationError("reading safetensors needs a little-endian machine")
    try:
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            if len(prefix) < 8:
                raise WeightValidationError(
                    f"{path}: {size} bytes is too short for a safetensors file (8-byte header "
                    "length first)"
                )
            header_len = int.from_bytes(prefix, "little")
            if header_len > min(size - 8, _MAX_HEADER_BYTES):
                raise WeightValidationError(
                    f"{path}: safetensors header length {header_len} exceeds the file "
                    f"({size} bytes) or the {_MAX_HEADER_BYTES} byte limit"
                )
            raw = f.read(header_len)
    except OSError as exc:
        raise WeightValidationError(f"{path}: cannot read: {exc}") from None
    try:
        header = json.loads(raw)
    except ValueError as exc:  # UnicodeDecodeError included
        raise WeightValidationError(f"{path}: safetensors header is not JSON: {exc}") from None
    except RecursionError:  # arrays or objects nested thousands deep
        raise WeightValidationError(
            f"{path}: safetensors header is not JSON: it nests too deeply"
        ) from None
    if not isinstance(header, dict):
        raise WeightValidationError(
            f"{path}: safetensors header must be a JSON object, got {type(header).__name__}"
        )
    header.pop("__metadata__", None)
    base = 8 + header_len
    entries = [_entry(path, name, value, base, size - base) for name, value in header.items()]
    return sorted(entries, key=lambda e: e.offset)


def _entry(path: object, name: str, value: Any, base: int, data_size: int) -> SafetensorsEntry:
    """Checks one header entry against the file's data section; returns where its tensor lies."""
    where = f"{path}: tensor {name[:200]!r}"
    if not isinstance(value, dict):
        raise WeightValidationError(f"{where}: entry must be a JSON object, got {value!r:.80}")
    missing = [key for key in ("dtype", "shape", "data_offsets") if key not in value]
    if missing:
        raise WeightValidationError(f"{where} has no {missing[0]!r} (an entry needs all three)")
    dtype_tag, shape, offsets = value["dtype"], value["shape"], value["data_offsets"]
    dtype = _DTYPES.get(dtype_tag) if isinstance(dtype_tag, str) else None
    if dtype is None:
        raise WeightValidationError(
            f"{where} has dtype {dtype_tag!r:.40}; supported: {sorted(_DTYPES)}"
        )
    if isinstance(shape, list) and len(shape) > _MAX_DIMS:
        raise WeightValidationError(
            f"{where}: shape has {len(shape)} dims, more than the {_MAX_DIMS} a tensor may have"
        )
    # A dim past int64 holds no data when another dim is 0, yet no tensor can have it.
    if not isinstance(shape, list) or not all(_is_int(d) and 0 <= d < 1 << 63 for d in shape):
        raise WeightValidationError(
            f"{where}: shape must be a list of ints >= 0 (each below 2**63), got {shape!r:.80}"
        )
    nbytes = math.prod(shape) * dtype.itemsize
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_int(o) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1] <= data_size
        or offsets[1] - offsets[0] != nbytes
    ):
        raise WeightValidationError(
            f"{where} has inconsistent data_offsets {offsets!r:.80} for {nbytes} bytes of data "
            f"in a data section of {data_size} bytes"
        )
    return SafetensorsEntry(TensorSpec(name, dtype, tuple(shape)), base + offsets[0])


def read_tensor(fd: int, entry: SafetensorsEntry, out: torch.Tensor | None = None) -> torch.Tensor:
    """Reads `entry`'s tensor from file `fd` into `out` (contiguous, CPU, its shape) or new memory."""
    spec = entry.spec
    if out is None:
        out = torch.empty(spec.shape, dtype=spec.dtype)
    # A writable ctypes array over the tensor's memory: the file's bytes land in place.
    view = memoryview((ctypes.c_ubyte * spec.nbytes).from_address(out.data_ptr())).cast("B")
    done = 0
    while done < spec.nbytes:  # a read returns at most about 2 GiB at once
        try:
            got = os.preadv(fd, [view[done:]], entry.offset + done)
        except OSError as exc:
            raise WeightValidationError(f"tensor {spec.name!r}: cannot read: {exc}") from None
        if got == 0:
            raise WeightValidationError(
                f"tensor {spec.name!r}: the file ended after {done} of {spec.nbytes} bytes "
                "(it changed after its header was read)"
            )
        done += got
    return out


def read_index(directory: Path) -> dict[str, str] | None:
    """A sharded checkpoint's `weight_map` (tensor name -> file of `directory`); None if unsharded."""
    path = directory / INDEX_FILE
    if not path.is_file():
        return None
    try:
        index = json.loads(read_text(path))
    except WeightValidationError:  # not a regular file, or too large: says so itself
        raise
    except (OSError, ValueError) as exc:
        raise WeightValidationError(f"{path}: not readable JSON: {exc}") from None
    except RecursionError:  # arrays or objects nested thousands deep
        raise WeightValidationError(f"{path}: not readable JSON: it nests too deeply") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    # A name with a NUL, a lone surrogate or another unprintable character names no file that
    # can be opened (`open` raises ValueError on it): refused with the rest.
    if not isinstance(weight_map, dict) or not all(
        isinstance(f, str) and f.endswith(".safetensors") and Path(f).name == f and f.isprintable()
        for f in weight_map.values()
    ):
        raise WeightValidationError(
            f"{path}: weight_map must map tensor names to safetensors file names of this directory"
        )
    return weight_map


def write_safetensors(tensors: Mapping[str, torch.Tensor], path: str | os.PathLike[str]) -> None:
    """Writes `tensors` to a safetensors file (readable by the `safetensors` package too)."""
    # Zero-copy views, each keeping its tensor alive until written.
    payloads = [_byte_view(tensor) for tensor in tensors.values()]
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for (name, tensor), data in zip(tensors.items(), payloads, strict=True):
        header[name] = {
            "dtype": _NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        offset += len(data)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the format aligns the data section to 8 bytes
    with open(path, "wb") as f:
        f.write(len(encoded).to_bytes(8, "little") + encoded)
        f.writelines(payloads)
