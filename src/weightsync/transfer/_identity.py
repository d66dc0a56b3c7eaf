"""How the two ends of a broadcast tell update messages apart, before any byte moves.

A message's *send* ties a worker's refusal to the trainer's update it belongs to, and a digest
of the announced names, dtypes and shapes catches two sides that announce different things.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from weightsync.transfer.base import TensorSpec, WeightTransferUpdateInfo, dtype_name

__all__ = ["metadata_digest", "send_identity"]

_VLLM_WIRE_KEYS = frozenset({"packed", "packed_buffer_size_bytes", "packed_num_buffers"})


def metadata_digest(specs: Sequence[TensorSpec]) -> int:
    """A 63-bit digest of names, dtypes and shapes, to catch sides that announce different things."""
    text = json.dumps([[s.name, dtype_name(s.dtype), list(s.shape)] for s in specs])
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def send_identity(update_info: object) -> str:
    """Which send an update message belongs to: 16 hex digits both sides compute alike.

    The message's `send_id` when it has one (every update info built by
    `WeightTransferUpdateInfo.from_specs` or `from_named_tensors` has a fresh one), else its
    content: a message mangled on its way keeps its send, a stray one has another.
    """
    data: Any = update_info.to_dict() if isinstance(update_info, WeightTransferUpdateInfo) else None
    if data is None and isinstance(update_info, Mapping):
        data = dict(update_info)
    if isinstance(data, dict) and isinstance(data.get("send_id"), str):
        key: Any = ["send_id", data["send_id"]]
    elif isinstance(data, dict):  # null fields are as good as absent (to_dict leaves them out)
        # vLLM's older wire keys describe the wire, not the message: a trainer's copy may lack them.
        content = {k: v for k, v in data.items() if v is not None and k not in _VLLM_WIRE_KEYS}
        key = ["content", content]
    else:
        key = ["content", update_info]
    try:
        text = json.dumps(key, sort_keys=True, default=repr)
    except (TypeError, ValueError, RecursionError):  # keys of mixed types, a nesting too deep
        text = secrets.token_hex(8)  # nothing to recognise it by: it pairs with nothing
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
