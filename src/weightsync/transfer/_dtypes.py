"""The dtypes that may cross the wire, by name: one table, read by the update infos' parser."""

from __future__ import annotations

import torch

# The dtypes that may cross the wire, by the name used in update infos (`str(dtype)` minus "torch.").
# Names are looked up in this table only: a payload never makes us resolve an arbitrary attribute.
WIRE_DTYPE_NAMES = (
    "float64",
    "float32",
    "float16",
    "bfloat16",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "complex64",
    "complex128",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint64",
    "uint32",
    "uint16",
    "uint8",
    "bool",
)
WIRE_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in WIRE_DTYPE_NAMES
    if isinstance(getattr(torch, name, None), torch.dtype)
}
