"""Every private torch call weightsync makes, in one place: CUDA IPC export and import.

Both go through `torch.multiprocessing.reductions`, the functions torch itself uses to move a CUDA
tensor between processes: `reduce_tensor` on the trainer's side, `rebuild_cuda_tensor` on the
receiver's. weightsync carries their arguments as JSON-safe data
(`CUDAStorageHandle`) instead of a pickle.
"""

from __future__ import annotations

import base64

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from weightsync.errors import WeightValidationError
from weightsync.transfer._ipc_records import CUDAStorageHandle, encode_b64

__all__ = ["cuda_device_uuids", "export_cuda_storage", "import_cuda_storage"]


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
    _, args = reduce_tensor(whole)  # type: ignore[no-untyped-call]
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
    # The classes and dtype passed here are ours, never taken from the payload.
    tensor: torch.Tensor = rebuild_cuda_tensor(  # type: ignore[no-untyped-call]
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
