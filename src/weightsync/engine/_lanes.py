"""Decode lanes: each decoding request's keys and values kept contiguous, so decodes attend in place.

The paged KV cache scatters a request's tokens over blocks. Attending over it means copying every
request's blocks into one padded rectangle, for every layer of every step: a copy the size of the
whole batch's context, which on a CPU costs more than the attention that reads it.

Decodes (one query per request) read a second copy of their keys and values instead, kept per layer
as a rectangle `(2, lanes, kv_heads, capacity, head_dim)`: each decoding request owns one lane (a
row) and its token at position `p` sits in column `p`. The step's requests hold lanes `0 .. rows-1`,
so those lanes cut at the longest context are a view of the rectangle that attention reads without
copying anything. Each step copies into the lanes only the columns they lack: in steady decoding,
the one new token per request, taken from the paged cache right after it is written there.

The paged cache stays the source of truth (prefix caching, preemption and recompute work on blocks
as before); a lane is a copy that can always be rebuilt from it. A request that just finished its
prefill, was preempted or reset, or moved to another lane gets its lane filled from its blocks in
the step that needs it. The rectangle grows to the most decoding requests and the longest context
seen, the size of the padded scratch a gathered attention would need, but per layer.
"""

from __future__ import annotations

import torch

from weightsync.engine._attention import LaneGroup
from weightsync.engine._sequence import Sequence


class _Lane:
    """Which lane a request holds and how many of its leading tokens the lane holds."""

    __slots__ = ("index", "num_kv_resets", "num_tokens")

    def __init__(self, index: int, num_kv_resets: int) -> None:
        self.index = index
        self.num_kv_resets = num_kv_resets
        self.num_tokens = 0


class DecodeLanes:
    """Assigns lanes to each step's decoding requests and owns the per-layer lane storage.

    Args:
        num_layers: Decoder layers (one rectangle each).
        kv_heads: Key/value heads.
        head_dim: Size of one head.
        block_size: Tokens per block of the paged cache.
        dtype: The KV cache's dtype.
        device: The KV cache's device.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.block_size = block_size
        self._shape = (kv_heads, head_dim)
        self._dtype, self._device = dtype, device
        self.storage = [self._empty(0, 0) for _ in range(num_layers)]
        self._held: dict[Sequence, _Lane] = {}

    def _empty(self, lanes: int, capacity: int) -> torch.Tensor:
        kv_heads, head_dim = self._shape
        return torch.zeros(
            (2, lanes, kv_heads, capacity, head_dim), dtype=self._dtype, device=self._device
        )

    def _reserve(self, lanes: int, capacity: int) -> None:
        """Grows every layer's rectangle to at least `lanes x capacity`, keeping what it holds."""
        _, held_lanes, _, held_capacity, _ = self.storage[0].shape
        if lanes <= held_lanes and capacity <= held_capacity:
            return
        lanes = max(lanes, held_lanes)
        # Doubling the columns keeps regrowth (a copy of every lane) rare as contexts lengthen.
        grown_capacity = max(capacity, min(2 * held_capacity, capacity + 1024))
        capacity = grown_capacity if capacity > held_capacity else held_capacity
        for layer, old in enumerate(self.storage):
            grown = self._empty(lanes, capacity)
            grown[:, :held_lanes, :, :held_capacity] = old
            self.storage[layer] = grown

    def clear(self) -> None:
        """Forgets every lane (after a failed step, whose fills may not have happened)."""
        self._held = {}

    def release(self) -> None:
        """Forgets every lane and frees their memory (the engine sleeps); they regrow on use."""
        self._held = {}
        self.storage = [self._empty(0, 0) for _ in self.storage]

    def plan(self, rows: list[tuple[Sequence, int, int]]) -> LaneGroup:
        """Gives each decoding request a lane among `0 .. len(rows) - 1` and lists the fills.

        A request keeps its lane from the previous step when that lane is still in range and
        its KV was not reset since; the others take the free lanes and are filled from 0.
        Requests absent from `rows` (finished, preempted, paused) lose their lanes.

        Args:
            rows: `(sequence, index of its query among the step's tokens, end)` per decoding
                request, `end` being one past its query's position: the context it attends.
                The step's keys and values must reach the paged cache before the fills run.

        Returns:
            The lanes' attention inputs for this step.
        """
        count = len(rows)
        kept: dict[Sequence, _Lane] = {}
        for seq, _, _ in rows:
            lane = self._held.get(seq)
            if lane is not None and lane.index < count and lane.num_kv_resets == seq.num_kv_resets:
                kept[seq] = lane
        free = iter(sorted(set(range(count)) - {lane.index for lane in kept.values()}))
        query_index = [0] * count
        ends = [0] * count
        fill_slots: list[int] = []
        fill_lanes: list[int] = []  # lane of each fill
        fill_columns: list[int] = []  # its column: the slot's position in its sequence
        size = self.block_size
        for seq, query, end in rows:
            lane = kept.get(seq) or _Lane(next(free), seq.num_kv_resets)
            kept[seq] = lane
            query_index[lane.index], ends[lane.index] = query, end
            positions = range(lane.num_tokens, end)
            table = seq.block_table
            fill_slots.extend(table[p // size] * size + p % size for p in positions)
            fill_lanes.extend([lane.index] * len(positions))
            fill_columns.extend(positions)
            lane.num_tokens = end
        self._held = kept
        context = max(ends)
        self._reserve(count, context)
        # Flat index of (lane, head, column) in storage seen as (2, lanes * kv_heads * capacity,
        # head_dim), head-major to match the (2, kv_heads, fills, head_dim) the paged cache gives.
        _, _, kv_heads, capacity, _ = self.storage[0].shape
        heads = torch.arange(kv_heads)[:, None]  # (kv_heads, 1)
        lanes = torch.tensor(fill_lanes, dtype=torch.long)[None]  # (1, fills)
        targets = (lanes * kv_heads + heads) * capacity + torch.tensor(
            fill_columns, dtype=torch.long
        )[None]
        # (rows, 1, 1, context): broadcast over heads and the query heads sharing a KV head.
        mask = (torch.arange(context) < torch.tensor(ends)[:, None])[:, None, None, :]
        return LaneGroup(
            storage=self.storage,
            query_index=self._to_device(query_index),
            in_token_order=query_index == list(range(count)),
            context=context,
            # Requests of one length (a static batch) need no mask: SDPA then skips applying it.
            mask=None if min(ends) == context else mask.to(self._device),
            fill_slots=self._to_device(fill_slots),
            fill_targets=targets.flatten().to(self._device),
        )

    def _to_device(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(self._device)
