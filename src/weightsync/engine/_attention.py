"""Attention over a paged KV cache, and the plain causal attention of the no-cache path.

The KV cache of one layer is a tensor (2, num_kv_heads, num_slots, head_dim): keys then values,
one slot per token, `num_slots = num_blocks * block_size`. A sequence's token at position `p`
lives in slot `block_table[p // block_size] * block_size + p % block_size`. Every step writes its
new keys and values into their slots, then each query attends over its sequence's slots.

The step's sequences are attended in at most two parts, one attention call per part and layer,
with no Python loop over sequences:

- decodes (one query each) read their keys and values in place from decode lanes, a per-layer
  rectangle holding each decoding request's KV contiguously (see `LaneGroup`); a step only copies
  into the lanes the columns they lack, usually one token per request. Two decodes or more attend
  as two batched matmuls where that was measured faster (see `_matmul_pays`), any other batch
  through `scaled_dot_product_attention`;
- prefill chunks are an `AttentionGroup` (one `scaled_dot_product_attention` call): their blocks
  are gathered into a padded rectangle, padding masked. Keeping them apart from decodes means one
  long prefill never pads every decode to its length.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F  # noqa: N812

__all__ = [
    "AttentionGroup",
    "AttentionMetadata",
    "LaneGroup",
    "causal_attention",
    "paged_attention",
]


@dataclass
class AttentionGroup:
    """Sequences whose queries attend together, padded to `rows x max_queries` queries.

    Row `r` holds one sequence: its queries sit at positions `start_r .. end_r - 1` of the
    sequence and see its keys `0 .. position` (causal), all of which are in the cache once this
    step's keys are written.

    Attributes:
        query_index: (rows, max_queries) index among the step's tokens of each query; padding
            repeats a real token (its result is dropped).
        block_tables: (rows, max_blocks) KV block ids of each row's positions, block by block;
            past a row's table, padding names a real block (masked out). Keys are attended up
            to `max_context = max_blocks * block_size`.
        mask: (rows, max_queries, max_context) True where the query may see the key. Every
            padding query still sees key 0, so no row of the softmax is empty.
        sources: (num_queries,) flat index into `rows * max_queries` of each real query.
        targets: (num_queries,) index among the step's tokens of the same queries.
        gathered: (2, kv_heads, rows * max_blocks, block_size * head_dim) scratch space that
            each layer gathers the group's keys and values into, overwriting the previous
            layer's.
    """

    query_index: torch.Tensor
    block_tables: torch.Tensor
    mask: torch.Tensor
    sources: torch.Tensor
    targets: torch.Tensor
    gathered: torch.Tensor


@dataclass
class LaneGroup:
    """The step's decodes, attending in place over their decode lanes.

    Lane `i` of a layer's storage holds one decoding request's keys and values, its token at
    position `p` in column `p`. This step's decodes hold lanes `0 .. rows - 1`; before attending,
    each layer copies the listed slots of its paged cache into the lanes (the columns a lane
    lacks: this step's token, or a whole context for a request new to its lane).

    Attributes:
        storage: One (2, lanes, kv_heads, capacity, head_dim) tensor per layer, with
            `lanes >= rows` and `capacity >= context`.
        query_index: (rows,) index among the step's tokens of lane `i`'s query.
        in_token_order: Whether lane `i` holds the step's token `i` for every lane, so that the
            lanes' output is already in token order (when the step has nothing else).
        context: Columns attended: the longest context among the lanes.
        mask: (rows, 1, 1, context) True where lane `i`'s query may see the key: its context,
            up to and including its own position (columns past it belong to no one yet). None
            when every lane's context is `context` long: nothing to mask.
        fill_slots: (fills,) paged-cache slots to copy into the lanes.
        fill_targets: (kv_heads * fills,) where each head of each slot goes, as an index into
            a layer's storage seen as (2, lanes * kv_heads * capacity, head_dim), head-major:
            `fill_targets[h * fills + i]` is slot `i`'s head `h`.
    """

    storage: list[torch.Tensor]
    query_index: torch.Tensor
    in_token_order: bool
    context: int
    mask: torch.Tensor | None
    fill_slots: torch.Tensor
    fill_targets: torch.Tensor


@dataclass
class AttentionMetadata:
    """Where one step's tokens go in the KV cache and what each of them attends to.

    Attributes:
        kv_caches: One (2, num_kv_heads, num_slots, head_dim) tensor per layer.
        slot_mapping: (num_tokens,) slot of each of the step's tokens.
        groups: Groups of sequences attended together over gathered blocks (prefill chunks).
        lanes: The decodes, attended over their lanes (None when the step has none). Every
            token of the step is a real query of exactly one group or of the lanes.
    """

    kv_caches: list[torch.Tensor]
    slot_mapping: torch.Tensor
    groups: list[AttentionGroup] = field(default_factory=list)
    lanes: LaneGroup | None = None


def _expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Repeats each KV head `groups` times along dim -3: query head h reads KV head h // groups."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=-3)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal self-attention of one whole sequence, without a cache (the reference path).

    Args:
        q: (seq, heads, head_dim) queries.
        k: (seq, kv_heads, head_dim) keys.
        v: (seq, kv_heads, head_dim) values.

    Returns:
        (seq, heads, head_dim) attention output.
    """
    groups = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),  # (heads, seq, head_dim)
        _expand_kv(k.transpose(0, 1), groups),
        _expand_kv(v.transpose(0, 1), groups),
        is_causal=True,
    )
    return out.transpose(0, 1)


def _attend_group(q: torch.Tensor, cache: torch.Tensor, group: AttentionGroup) -> torch.Tensor:
    """One group's attention: (num_tokens, heads, head_dim) queries -> (rows * max_queries, ...)."""
    rows, max_queries = group.query_index.shape
    _, kv_heads, _, head_dim = cache.shape
    max_context = group.mask.shape[2]
    num_blocks = cache.shape[2] * head_dim // group.gathered.shape[3]
    heads = q.shape[1]
    groups = heads // kv_heads
    # Copy each row's blocks, keys and values of every head in one index_select (whole blocks
    # of one head are contiguous: block_size * head_dim values), into scratch space rather
    # than a new tensor: a fresh tensor of many megabytes per layer costs page faults that can
    # exceed the copy itself. Heads outermost, so that each row's keys of one head come out as
    # one contiguous (max_context, head_dim) matrix, as attention reads them.
    blocks = cache.view(2, kv_heads, num_blocks, -1)  # (2, kv_heads, num_blocks, block values)
    kv = torch.index_select(blocks, 2, group.block_tables.flatten(), out=group.gathered)
    kv = kv.view(2, kv_heads, rows, max_context, head_dim).transpose(1, 2)  # (2, rows, kv, ctx, d)
    # Grouped-query attention without copying keys and values per query head: the `groups`
    # query heads that share a KV head (heads h = kv_head * groups + g) become `groups` times
    # as many query rows of that KV head, each row keeping its query's mask.
    queries = q.index_select(0, group.query_index.flatten())
    queries = queries.view(rows, max_queries, kv_heads, groups, head_dim)
    queries = queries.permute(0, 2, 3, 1, 4).reshape(rows, kv_heads, groups * max_queries, head_dim)
    mask = group.mask[:, None, None].expand(rows, 1, groups, max_queries, max_context)
    mask = mask.reshape(rows, 1, groups * max_queries, max_context)
    out = F.scaled_dot_product_attention(queries, kv[0], kv[1], attn_mask=mask)
    out = out.view(rows, kv_heads, groups, max_queries, head_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(rows * max_queries, heads, head_dim)


def _attend_lanes(
    layer_index: int, q: torch.Tensor, cache: torch.Tensor, lanes: LaneGroup
) -> torch.Tensor:
    """The decodes' attention: (num_tokens, heads, head_dim) queries -> (rows, heads, head_dim)."""
    storage = lanes.storage[layer_index]  # (2, lanes, kv_heads, capacity, head_dim)
    _, _, kv_heads, _, head_dim = storage.shape
    if lanes.fill_slots.numel():
        fills = cache.index_select(2, lanes.fill_slots)  # (2, kv_heads, fills, head_dim)
        # One row copy per head and slot, into flat positions computed once for all layers.
        flat = storage.view(2, -1, head_dim)  # (2, lanes * kv_heads * capacity, head_dim)
        flat.index_copy_(1, lanes.fill_targets, fills.view(2, -1, head_dim))
    rows, context = lanes.query_index.shape[0], lanes.context
    heads = q.shape[1]
    # Views, not copies: rows `0 .. rows-1`, columns `0 .. context-1` of the rectangle.
    keys = storage[0, :rows, :, :context]  # (rows, kv_heads, context, head_dim)
    values = storage[1, :rows, :, :context]
    # Grouped-query attention without copying keys and values per query head: the `groups`
    # query heads that share a KV head (heads h = kv_head * groups + g) are that KV head's
    # `groups` query rows.
    queries = q.index_select(0, lanes.query_index).view(rows, kv_heads, heads // kv_heads, head_dim)
    if rows > 1 and _matmul_pays(queries):
        out = _matmul_attention(queries, keys, values, lanes.mask)
    else:
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=lanes.mask)
    return out.reshape(rows, heads, head_dim)


def _matmul_pays(queries: torch.Tensor) -> bool:
    """Whether decodes `(rows, kv_heads, groups, head_dim)` attend faster as `_matmul_attention`.

    Measured against SDPA's fused CPU kernel in float32 (`benchmarks/results/micro/`): on two
    threads, where two query heads share each KV head, the matmuls were 0.97 to 2.0 times as fast
    from 4 to 64 decodes over 96 to 2,000 columns (`attention.json`, `attention_groups.json`).
    With 1, 4 or 8 query heads per KV head they were 0.71 to 1.76 times as fast, often slower,
    and on one thread SDPA was mostly faster: those keep SDPA.
    """
    return (
        queries.shape[2] == 2
        and queries.device.type == "cpu"
        and queries.dtype == torch.float32
        and torch.get_num_threads() > 1
    )


def _matmul_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """Attention as two batched matmuls around a softmax: (..., queries, head_dim) -> same shape."""
    scores = torch.matmul(q, keys.transpose(-1, -2)).mul_(q.shape[-1] ** -0.5)
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), values)


def paged_attention(
    layer_index: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """Writes this step's keys and values into the cache, then attends over each context.

    Args:
        layer_index: Which layer's cache to use.
        q: (num_tokens, heads, head_dim) queries of the step's tokens.
        k: (num_tokens, kv_heads, head_dim) their keys.
        v: (num_tokens, kv_heads, head_dim) their values.
        meta: Slots and groups of the step.

    Returns:
        (num_tokens, heads, head_dim) attention output.
    """
    cache = meta.kv_caches[layer_index]  # (2, kv_heads, num_slots, head_dim)
    cache[0].index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
    cache[1].index_copy_(1, meta.slot_mapping, v.transpose(0, 1))
    if meta.lanes is not None and meta.lanes.in_token_order and not meta.groups:
        return _attend_lanes(layer_index, q, cache, meta.lanes)  # the usual all-decode step
    out = torch.empty_like(q)
    if meta.lanes is not None:
        out.index_copy_(0, meta.lanes.query_index, _attend_lanes(layer_index, q, cache, meta.lanes))
    for group in meta.groups:
        attended = _attend_group(q, cache, group).index_select(0, group.sources)
        out.index_copy_(0, group.targets, attended)
    return out
