"""IPC handle records: where a tensor's bytes are, as JSON-safe data, and how to reach them.

A record locates one tensor inside a memory region the trainer exported:

```json
{"segment": "weightsync-0123456789ab-0", "offset": 512, "nbytes": 24,
 "dtype": "float32", "shape": [2, 3]}
```

On CPUs the region is a POSIX shared-memory segment, named by `segment`. On GPUs it is a CUDA
allocation, described by a `cuda` object instead: the CUDA IPC handle bytes in base64, the
allocation's size and the physical GPU's UUID (see
`CUDAStorageHandle`). A tensor without
bytes has neither. Records hold strings, ints, bools and lists only: they survive
`json.dumps`/`json.loads` unchanged, and reading one never unpickles, evaluates or imports
anything. Everything a record claims is checked before memory is touched.
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from weightsync.errors import WeightValidationError
from weightsync.transfer.base import TensorSpec, dtype_from_name, dtype_name
from weightsync.transfer.base import _is_int as is_int

__all__ = ["CUDAStorageHandle", "IPCHandle", "decode_b64", "encode_b64"]

_RECORD_KEYS = frozenset({"segment", "cuda", "offset", "nbytes", "dtype", "shape"})


def decode_b64(value: object, *, what: str) -> bytes:
    """Decodes a base64 string from a record, naming the field `what` when it is not one."""
    if not isinstance(value, str):
        raise WeightValidationError(f"{what} must be a base64 string, got {type(value).__name__}")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise WeightValidationError(f"{what} is not valid base64") from None


def encode_b64(data: bytes) -> str:
    """Encodes bytes as base64 text for a record."""
    return base64.b64encode(data).decode("ascii")


@dataclass(frozen=True)
class CUDAStorageHandle:
    """A CUDA allocation exported with CUDA IPC, as JSON-safe fields.

    Mirrors what torch's CUDA IPC export of a storage returns, minus the device index: a device
    index means nothing in another process (`CUDA_VISIBLE_DEVICES` may differ), so the physical
    GPU is named by its UUID.

    Attributes:
        device_uuid: UUID of the GPU holding the memory (`torch.cuda.get_device_properties().uuid`).
        handle: The CUDA IPC memory handle, base64.
        storage_nbytes: Size of the exported storage in bytes.
        storage_offset: Byte offset of the storage inside the CUDA allocation.
        ref_counter_handle: Name of the producer's reference-count file, base64.
        ref_counter_offset: Slot of this export in that file.
        event_handle: CUDA IPC event handle the consumer waits on before reading, base64, or None.
        event_sync_required: Whether the consumer must wait on that event.
    """

    device_uuid: str
    handle: str
    storage_nbytes: int
    storage_offset: int
    ref_counter_handle: str
    ref_counter_offset: int
    event_handle: str | None
    event_sync_required: bool

    @classmethod
    def from_dict(cls, data: object, *, where: str) -> CUDAStorageHandle:
        """Builds the handle from its dict form, checking every field's type.

        Raises:
            WeightValidationError: Naming `where` and the offending field.
        """
        if not isinstance(data, Mapping):
            raise WeightValidationError(
                f"{where}.cuda must be an object, got {type(data).__name__}"
            )
        expected = {f: None for f in cls.__dataclass_fields__}
        unknown, missing = sorted(set(data) - set(expected)), sorted(set(expected) - set(data))
        if unknown or missing:
            raise WeightValidationError(
                f"{where}.cuda has unknown keys {unknown} and lacks keys {missing}; "
                f"expected keys: {sorted(expected)}"
            )
        if not isinstance(data["device_uuid"], str) or not data["device_uuid"]:
            raise WeightValidationError(f"{where}.cuda.device_uuid must be a non-empty string")
        for key in ("handle", "ref_counter_handle"):
            decode_b64(data[key], what=f"{where}.cuda.{key}")
        if data["event_handle"] is not None:
            decode_b64(data["event_handle"], what=f"{where}.cuda.event_handle")
        for key in ("storage_nbytes", "storage_offset", "ref_counter_offset"):
            if not is_int(data[key]) or data[key] < 0:
                raise WeightValidationError(
                    f"{where}.cuda.{key} must be an int >= 0, got {data[key]!r}"
                )
        if not isinstance(data["event_sync_required"], bool):
            raise WeightValidationError(f"{where}.cuda.event_sync_required must be a bool")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        """Returns the JSON-safe dict form."""
        return dict(vars(self))

    @property
    def cache_key(self) -> tuple[str, int]:
        """Identifies the exported storage: the same key means the same memory."""
        return self.handle, self.storage_offset


@dataclass(frozen=True)
class IPCHandle:
    """Where one tensor's bytes are: a region, a byte offset in it, and what the bytes are.

    Build it with `from_dict`, which
    checks everything that can be checked without touching memory.

    Attributes:
        offset: Byte offset of the tensor's first byte inside the region; a multiple of the
            dtype's size.
        nbytes: Size of the tensor's data in bytes: the product of `shape` times the dtype size.
        dtype: Wire dtype name, e.g. `"bfloat16"`.
        shape: The tensor's shape.
        segment: Shared-memory segment name (CPU tensors).
        cuda: The exported CUDA storage (CUDA tensors).
    """

    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    segment: str | None = None
    cuda: CUDAStorageHandle | None = None

    @classmethod
    def from_dict(cls, data: object, *, where: str, spec: TensorSpec | None = None) -> IPCHandle:
        """Checks a record's form and consistency, touching no memory.

        Args:
            data: The record, as parsed from JSON.
            where: How error messages name the record, e.g. `"ipc_handles[3] ('w')"`.
            spec: The tensor the update announced at this position; the record must match it.

        Raises:
            WeightValidationError: Unknown or missing keys, a bad type, an unknown dtype, an
                `nbytes` that differs from shape x dtype size, a misaligned offset, a region
                missing although there are bytes, or a mismatch with `spec`.
        """
        if not isinstance(data, Mapping):
            raise WeightValidationError(f"{where} must be an object, got {type(data).__name__}")
        unknown = sorted(set(data) - _RECORD_KEYS)
        missing = sorted({"offset", "nbytes", "dtype", "shape"} - set(data))
        if unknown or missing:
            raise WeightValidationError(
                f"{where} has unknown keys {unknown} and lacks keys {missing}; "
                f"expected keys: {sorted(_RECORD_KEYS)}"
            )
        try:
            dtype = dtype_from_name(data["dtype"])
        except WeightValidationError as exc:
            raise WeightValidationError(f"{where}: {exc}") from None
        shape = data["shape"]
        if not isinstance(shape, list | tuple) or not all(is_int(d) and d >= 0 for d in shape):
            raise WeightValidationError(f"{where}.shape must be a list of ints >= 0, got {shape!r}")
        offset, nbytes = data["offset"], data["nbytes"]
        for key, value in (("offset", offset), ("nbytes", nbytes)):
            if not is_int(value) or value < 0:
                raise WeightValidationError(f"{where}.{key} must be an int >= 0, got {value!r}")
        expected_nbytes = math.prod(shape) * dtype.itemsize
        if nbytes != expected_nbytes:
            raise WeightValidationError(
                f"{where}.nbytes is {nbytes} but shape {list(shape)} of {data['dtype']} holds "
                f"{expected_nbytes} bytes"
            )
        if offset % dtype.itemsize:
            raise WeightValidationError(
                f"{where}.offset {offset} is not a multiple of the {data['dtype']} size "
                f"({dtype.itemsize} bytes)"
            )
        if spec is not None and (spec.dtype != dtype or spec.shape != tuple(shape)):
            raise WeightValidationError(
                f"{where} describes {data['dtype']}{list(shape)} but the update announces "
                f"{spec.describe()} for {spec.name!r}"
            )
        segment, cuda = data.get("segment"), data.get("cuda")
        if segment is not None and cuda is not None:
            raise WeightValidationError(f"{where} has both 'segment' and 'cuda'; give exactly one")
        if segment is not None and not isinstance(segment, str):
            raise WeightValidationError(
                f"{where}.segment must be a string, got {type(segment).__name__}"
            )
        if segment is None and cuda is None and nbytes:
            raise WeightValidationError(
                f"{where} has {nbytes} bytes but neither 'segment' nor 'cuda' says where they are"
            )
        return cls(
            offset=offset,
            nbytes=nbytes,
            dtype=data["dtype"],
            shape=tuple(shape),
            segment=segment,
            cuda=CUDAStorageHandle.from_dict(cuda, where=where) if cuda is not None else None,
        )

    @classmethod
    def for_tensor(
        cls,
        spec: TensorSpec,
        offset: int,
        *,
        segment: str | None = None,
        cuda: CUDAStorageHandle | None = None,
    ) -> IPCHandle:
        """The record of tensor `spec` at byte `offset` of a segment or CUDA storage.

        A tensor without bytes gets no region: it needs no memory to be rebuilt.
        """
        if spec.nbytes == 0:
            segment, cuda, offset = None, None, 0
        return cls(offset, spec.nbytes, dtype_name(spec.dtype), spec.shape, segment, cuda)

    def to_dict(self) -> dict[str, Any]:
        """Returns the JSON-safe dict form (the inverse of `from_dict`)."""
        record: dict[str, Any] = {
            "offset": self.offset,
            "nbytes": self.nbytes,
            "dtype": self.dtype,
            "shape": list(self.shape),
        }
        if self.segment is not None:
            record["segment"] = self.segment
        if self.cuda is not None:
            record["cuda"] = self.cuda.to_dict()
        return record

    def view(self, region: torch.Tensor) -> torch.Tensor:
        """Views the record's bytes inside a uint8 `region` as the typed tensor (no copy).

        Raises:
            WeightValidationError: The bytes reach past the end of the region.
        """
        if self.offset + self.nbytes > region.numel():
            where = self.segment if self.segment is not None else "the CUDA storage"
            raise WeightValidationError(
                f"offset {self.offset} + nbytes {self.nbytes} reaches past the end of {where} "
                f"({region.numel()} bytes)"
            )
        dtype = dtype_from_name(self.dtype)
        return region[self.offset : self.offset + self.nbytes].view(dtype).view(self.shape)
