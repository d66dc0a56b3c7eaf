"""Every private torch call weightsync makes, in one place: CUDA IPC export and import.

Both go through `torch.multiprocessing.reductions`, the functions torch itself uses to move a CUDA
tensor between processes: `reduce_tensor` on the trainer's side, `rebuild_cuda_tensor` on the
receiver's. weightsync carries their arguments as JSON-safe data
(`CUDAStorageHandle`) instead of a pickle.
"""

from __future__ import annotations

import base64
import ctypes
import os
import re
import time

import torch
from torch.multiprocessing import reductions

from weightsync.errors import WeightTransferTimeout, WeightValidationError
from weightsync.transfer._ipc_records import CUDAStorageHandle, encode_b64

# torch's producer-side reference counts live in shared-memory files of this many int64 slots,
# named `/torch_<pid>_<random>_<n>`; the consumer decrements slot `ref_counter_offset` when it
# lets go. Anything else would have this process write into a file a peer chose.
REF_COUNTER_SLOTS = 10000
_REF_COUNTER_RE = re.compile(r"/torch_[0-9]{1,10}_[0-9]{1,20}_[0-9]{1,20}")

__all__ = [
    "REF_COUNTER_SLOTS",
    "check_ref_counter",
    "cuda_device_uuids",
    "export_cuda_storage",
    "import_cuda_storage",
    "synchronize",
]


def cuda_device_uuids() -> dict[str, int]:
    """The CUDA devices this process sees, by physical UUID -> local device index."""
    if not torch.cuda.is_available():
        return {}
    return {
        str(torch.cuda.get_device_properties(index).uuid): index
        for index in range(torch.cuda.device_count())
    }


def export_cuda_storage(storage: torch.UntypedStorage) -> CUDAStorageHandle:
    """Exports a CUDA storage with CUDA IPC (trainer side).

    Each export takes a reference on the producer side that the consumer releases; export once
    per delivery and keep the storage alive until the receivers acknowledged it.
    """
    whole = torch.empty(0, dtype=torch.uint8, device=storage.device)
    whole.set_(storage, 0, (storage.nbytes(),), (1,))
    # reduce_tensor's arguments for rebuild_cuda_tensor: (tensor class, size, stride, offset,
    # storage class, dtype, device, handle, storage bytes, storage offset, requires_grad,
    # ref counter handle, ref counter offset, event handle, event sync required).
    _, args = reductions.reduce_tensor(whole)  # type: ignore[no-untyped-call]
    device, handle, nbytes, offset = args[6:10]
    counter, counter_offset, event, event_sync = args[11:15]
    return CUDAStorageHandle(
        device_uuid=str(torch.cuda.get_device_properties(device).uuid),
        handle=encode_b64(handle),
        storage_nbytes=int(nbytes),
        storage_offset=int(offset),
        ref_counter_handle=encode_b64(counter),
        ref_counter_offset=int(counter_offset),
        event_handle=encode_b64(event) if event is not None else None,
        event_sync_required=bool(event_sync),
    )


def check_ref_counter(handle: CUDAStorageHandle, *, where: str) -> None:
    """Checks the record's reference-count file and slot against what torch creates.

    Raises:
        WeightValidationError: The name is not a torch reference-count file, the slot is out of
            range, or the file is missing, someone else's, or too small.
    """
    name = base64.b64decode(handle.ref_counter_handle).decode("ascii", "replace")
    if not _REF_COUNTER_RE.fullmatch(name):
        raise WeightValidationError(
            f"{where}.cuda.ref_counter_handle {name!r} is not a torch reference-count file "
            "(/torch_<pid>_<n>_<n>); refused: the receiver would write into it"
        )
    if handle.ref_counter_offset >= REF_COUNTER_SLOTS:
        raise WeightValidationError(
            f"{where}.cuda.ref_counter_offset must be below {REF_COUNTER_SLOTS} (the slots of a "
            f"torch reference-count file), got {handle.ref_counter_offset}"
        )
    try:
        stat = os.stat("/dev/shm" + name)
    except OSError as exc:
        raise WeightValidationError(
            f"{where}.cuda.ref_counter_handle {name!r} cannot be checked: {exc.strerror}; the "
            "trainer exited or the record was not made by torch"
        ) from None
    if stat.st_uid != os.getuid() or stat.st_size < 8 * REF_COUNTER_SLOTS:
        raise WeightValidationError(
            f"{where}.cuda.ref_counter_handle {name!r} is not a reference-count file of this "
            f"user with {REF_COUNTER_SLOTS} slots (owner uid {stat.st_uid}, {stat.st_size} bytes)"
        )


def _allocation_extent(tensor: torch.Tensor) -> int:
    """Bytes from the tensor's first byte to the end of the CUDA allocation holding it.

    The CUDA driver knows the size of the memory an IPC handle opened; torch does not say.
    """
    try:
        driver = ctypes.CDLL("libcuda.so.1")
        address_range = driver.cuMemGetAddressRange_v2
    except (OSError, AttributeError) as exc:
        raise WeightValidationError(
            f"cannot check the size of CUDA IPC memory without the CUDA driver library: {exc}"
        ) from None
    address_range.argtypes = [
        ctypes.POINTER(ctypes.c_uint64),
        ctypes.POINTER(ctypes.c_size_t),
        ctypes.c_uint64,
    ]
    address_range.restype = ctypes.c_int
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    with torch.cuda.device(tensor.device):
        status = address_range(ctypes.byref(base), ctypes.byref(size), tensor.data_ptr())
    if status != 0:
        raise WeightValidationError(
            f"cannot check the size of CUDA IPC memory: cuMemGetAddressRange returned {status}"
        )
    return int(base.value + size.value - tensor.data_ptr())


def import_cuda_storage(handle: CUDAStorageHandle, *, where: str) -> torch.Tensor:
    """Opens an exported CUDA storage on the local device with the same UUID (receiver side).

    Returns:
        The whole storage as a uint8 CUDA tensor.

    Raises:
        WeightValidationError: No visible device has the handle's UUID; the message lists the
            UUIDs this process has.
    """
    devices = cuda_device_uuids()
    index = devices.get(handle.device_uuid)
    if index is None:
        available = ", ".join(sorted(devices)) or "none: this process sees no CUDA device"
        raise WeightValidationError(
            f"{where}.cuda.device_uuid {handle.device_uuid!r} is not a GPU this receiver sees "
            f"(available UUIDs: {available}); CUDA IPC needs trainer and receiver on the same "
            "GPU: check CUDA_VISIBLE_DEVICES"
        )
    check_ref_counter(handle, where=where)
    try:
        tensor = _rebuild(handle, index)
    except Exception as exc:  # a handle or event the driver refuses: garbage or revoked
        raise WeightValidationError(
            f"{where}.cuda: the CUDA driver refused the handle: {type(exc).__name__}: {exc}"
        ) from None
    # The handle maps the whole allocation; the storage it claims must lie inside it, which is
    # checked here, before a byte of it is read.
    extent = _allocation_extent(tensor) if handle.storage_nbytes else 0
    if handle.storage_nbytes > extent:
        raise WeightValidationError(
            f"{where}.cuda.storage_nbytes is {handle.storage_nbytes} but the CUDA allocation "
            f"holds {extent} bytes from storage_offset {handle.storage_offset}"
        )
    return tensor


def _rebuild(handle: CUDAStorageHandle, index: int) -> torch.Tensor:
    # The classes and dtype passed here are ours, never taken from the payload.
    tensor: torch.Tensor = reductions.rebuild_cuda_tensor(  # type: ignore[no-untyped-call]
        torch.Tensor,
        (handle.storage_nbytes,),
        (1,),
        0,
        torch.UntypedStorage,
        torch.uint8,
        index,
        base64.b64decode(handle.handle),
        handle.storage_nbytes,
        handle.storage_offset,
        False,
        base64.b64decode(handle.ref_counter_handle),
        handle.ref_counter_offset,
        base64.b64decode(handle.event_handle) if handle.event_handle is not None else None,
        handle.event_sync_required,
    )
    return tensor


def _new_event() -> torch.cuda.Event:
    return torch.cuda.Event()  # type: ignore[no-untyped-call]


def synchronize(device: torch.device, *, timeout_s: float, what: str) -> None:
    """Waits until the work queued on `device`'s current stream is done, `timeout_s` at most.

    `torch.cuda.synchronize` has no bound: a hung kernel or a peer that never lets a copy finish
    would hang the trainer or the receiver. This records an event and polls it instead.

    Raises:
        WeightTransferTimeout: The device did not finish within `timeout_s`; names `what`.
    """
    event = _new_event()
    event.record(torch.cuda.current_stream(device))
    deadline = time.monotonic() + timeout_s
    pause_s = 0.0
    while not event.query():  # type: ignore[no-untyped-call]
        if time.monotonic() > deadline:
            raise WeightTransferTimeout(
                f"{what}: the GPU {device} did not finish its queued work within {timeout_s:g} s "
                "(timeout_s); a kernel or copy is stuck"
            )
        time.sleep(pause_s)
        pause_s = min(2 * pause_s + 1e-5, 1e-3)  # short waits first: buckets take milliseconds
