"""Attention over a paged KV cache, and the plain causal attention of the no-cache path.

The KV cache of one layer is a tensor (2, num_kv_heads, num_slots, head_dim): keys then values,
one slot per token, `num_slots = num_blocks * block_size`. A sequence's token at position `p`
lives in slot `block_table[p // block_size] * block_size + p % block_size`. Every step writes its
new keys and values into their slots, then each query attends over its sequence's slots.

The step's sequences are attended in groups, one `scaled_dot_product_attention` call per group and
layer, with no Python loop over sequences: a group pads its sequences' queries and contexts to a
rectangle and masks the padding. The runner puts decodes (one query each) in one group and prefill
chunks in another, so that one long prefill never pads every decode to its length.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F  # noqa: N812

__all__ = ["AttentionGroup", "AttentionMetadata", "causal_attention", "paged_attention"]


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
class AttentionMetadata:
    """Where one step's tokens go in the KV cache and what each of them attends to.

    Attributes:
        kv_caches: One (2, num_kv_heads, num_slots, head_dim) tensor per layer.
        slot_mapping: (num_tokens,) slot of each of the step's tokens.
        groups: Groups of sequences attended together; every token of the step is a real query
            of exactly one group.
    """

    kv_caches: list[torch.Tensor]
    slot_mapping: torch.Tensor
    groups: list[AttentionGroup] = field(default_factory=list)


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
    if len(meta.groups) == 1 and meta.groups[0].query_index.numel() == q.shape[0]:
        # One group without padding holds every token, row by row in batch order, which is the
        # token order: its output needs no reordering (the usual all-decode step).
        return _attend_group(q, cache, meta.groups[0])
    out = torch.empty_like(q)
    for group in meta.groups:  # at most two: decodes, then prefill chunks
        attended = _attend_group(q, cache, group).index_select(0, group.sources)
        out.index_copy_(0, group.targets, attended)
    return out
