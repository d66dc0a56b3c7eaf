"""vLLM's trainer-side NCCL helpers, same names and signatures, over gloo: for CPU test runs.

A framework's trainer imports two of vLLM's helpers to send weights to a vLLM server: the
trainer's end of the group (`vllm.distributed.weight_transfer.nccl_common.trainer_init`) and the
packed broadcast (`vllm.distributed.weight_transfer.packed_tensor.packed_nccl_broadcast_producer`).
Both need CUDA. These two take the same arguments and drive a `weightsync serve
--weight-transfer-config '{"backend": "gloo"}'` server over gloo, so a CPU test swaps the two
imports and runs the framework's own trainer loop:

```python
from weightsync.trainer.vllm_gloo import packed_nccl_broadcast_producer, trainer_init
```

The bytes travel by weightsync's broadcast protocol (a handshake validates each update before a
byte moves, every step has a timeout), which vLLM's server does not speak: the stand-in is for a
weightsync server only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from weightsync.errors import WeightValidationError
from weightsync.transfer.base import TransferStats, WeightTransferUpdateInfo, _parse_info
from weightsync.transfer.nccl import (
    NCCLTrainerSendWeightsArgs,
    NCCLWeightTransferInitInfo,
    TrainerGroup,
    trainer_send_weights,
)
from weightsync.transfer.nccl import trainer_init as _open_group

__all__ = ["GlooTrainerCommunicator", "packed_nccl_broadcast_producer", "trainer_init"]

logger = logging.getLogger(__name__)


class _GroupHandle:
    """What a vLLM client reaches as `communicator.group` to close it.

    TRL's `close_communicator` sets the group's `store` and `socket` to None; here that closes
    the group (its store's port is free again).
    """

    _trainer: TrainerGroup

    def __init__(self, trainer: TrainerGroup) -> None:
        object.__setattr__(self, "_trainer", trainer)  # past the refusing __setattr__ below

    def __setattr__(self, name: str, value: object) -> None:
        if name in ("store", "socket") and value is None:
            self._trainer.close()
            return
        raise AttributeError(f"the gloo stand-in's group has no settable attribute {name!r}")


class GlooTrainerCommunicator:
    """The trainer's end of a gloo weight-transfer group, as `trainer_init` returns it.

    Pass it as `group` to `packed_nccl_broadcast_producer`. `close()` leaves the group.

    Attributes:
        trainer_group: weightsync's own trainer group underneath.
        group: A handle a vLLM client may close the group through (see `close`).
    """

    def __init__(self, trainer_group: TrainerGroup) -> None:
        self.trainer_group = trainer_group
        self.group = _GroupHandle(trainer_group)

    def close(self) -> None:
        """Closes the group; the workers leave it at their next call. Safe to call twice."""
        self.trainer_group.close()


def trainer_init(init_info: Mapping[str, Any]) -> GlooTrainerCommunicator:
    """Joins the group the server's workers are joining, as rank 0; blocks until it forms.

    Same call as vLLM's `nccl_common.trainer_init`: `init_info` is the dict given to the
    server's `/init_weight_transfer_engine` (`master_address`, `master_port`, `world_size`,
    `rank_offset` 1, optionally `packed`, `bucket_size_bytes`, `num_buffers`, `timeout_s`).
    Make the server's call on another thread first, as with vLLM: both sides wait for the
    other.

    Raises:
        WeightValidationError: A malformed init info, or a `rank_offset` other than 1.
        WeightTransferTimeout: The workers did not join within `timeout_s`.
    """
    info = _parse_info(NCCLWeightTransferInitInfo, dict(init_info), what="init_info")
    if info.rank_offset != 1:
        raise WeightValidationError(
            f"init_info.rank_offset must be 1 (the trainer is rank 0), got {info.rank_offset}"
        )
    group = _open_group(
        world_size=info.world_size,
        backend="gloo",
        master_address=info.master_address,
        master_port=info.master_port,
        wire=info.wire,
    )
    try:
        group.connect()
    except BaseException:
        group.close()
        raise
    return GlooTrainerCommunicator(group)


def packed_nccl_broadcast_producer(
    iterator: Iterator[tuple[str, torch.Tensor]],
    group: Any,
    src: int,
    post_iter_func: Callable[[tuple[str, torch.Tensor]], torch.Tensor],
    buffer_size_bytes: int | None = None,
    num_buffers: int | None = None,
) -> TransferStats:
    """Broadcasts one update to the server's workers, packed: vLLM's producer, over gloo.

    The server must be receiving the update whose `update_info` lists these tensors' names,
    dtypes and shapes in this order (its `/update_weights`, on another thread). The announced
    metadata is taken from the tensors themselves, so the iterator's tensors are held until
    the update is sent.

    Args:
        iterator: `(name, tensor)` pairs, e.g. `model.named_parameters()`.
        group: The communicator from `trainer_init`.
        src: The source rank: 0, the trainer.
        post_iter_func: Maps each pair to the tensor to send (e.g. `lambda item: item[1]`).
        buffer_size_bytes: Bucket size; the group's (from its init info) when None, and must
            equal it when given.
        num_buffers: Buckets in flight; the group's when None, and must equal it when given.

    Returns:
        What was sent and how fast.

    Raises:
        WeightValidationError: `group` is not from `trainer_init`, `src` is not 0, a wire
            parameter differs from the group's, or the server refused the update (nothing
            moved).
        WeightTransferError: The transfer failed; the group is closed.
    """
    if not isinstance(group, GlooTrainerCommunicator):
        raise WeightValidationError(
            f"group must be the communicator weightsync.trainer.vllm_gloo.trainer_init "
            f"returned, got {type(group).__name__}"
        )
    if src != 0:
        raise WeightValidationError(f"src must be 0 (the trainer's rank), got {src!r}")
    wire = NCCLWeightTransferInitInfo(**group.trainer_group.init_info).wire
    for name, given, own in (
        ("buffer_size_bytes", buffer_size_bytes, wire.bucket_size_bytes),
        ("num_buffers", num_buffers, wire.num_buffers),
    ):
        if given is not None and given != own:
            raise WeightValidationError(
                f"{name}={given} differs from the group's {own}: both ends use the value of "
                "the init info; leave it out, or pass it in the init info"
            )
    named = [(name, post_iter_func((name, tensor))) for name, tensor in iterator]
    # The message the server was given, as the framework built it: names, dtypes, shapes.
    update_info = WeightTransferUpdateInfo.from_named_tensors(named).to_dict()
    del update_info["send_id"]  # the server's copy has none: the content identifies the send
    return trainer_send_weights(
        named, NCCLTrainerSendWeightsArgs(group=group.trainer_group, update_info=update_info)
    )
