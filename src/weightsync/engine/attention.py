"""Attention over a paged KV cache, and the plain causal attention of the no-cache path.

The KV cache of one layer is a tensor (2, num_slots, num_kv_heads, head_dim): keys then values,
one slot per token, `num_slots = num_blocks * block_size`. A sequence's token at position `p` lives
in slot `block_table[p // block_size] * block_size + p % block_size`. Every step writes its new keys
and values into their slots, then each query attends over its sequence's slots: decode queries (one
per sequence) together in one padded batch, prefill chunks one sequence at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F  # noqa: N812

__all__ = ["AttentionMetadata", "PrefillSpan", "causal_attention", "paged_attention"]


@dataclass
class PrefillSpan:
    """One sequence's prefill chunk in a step.

    Attributes:
        query_start: Index of its first token among the step's tokens.
        num_queries: Tokens of the chunk.
        context_slots: (context_len,) cache slots of the sequence's tokens 0..context_len-1,
            the chunk being the last `num_queries` of them.
    """

    query_start: int
    num_queries: int
    context_slots: torch.Tensor


@dataclass
class AttentionMetadata:
    """Where one step's tokens go in the KV cache and what each of them attends to.

    Attributes:
        kv_caches: One (2, num_slots, num_kv_heads, head_dim) tensor per layer.
        slot_mapping: (num_tokens,) slot of each of the step's tokens.
        decode_token_index: (num_decodes,) index, among the step's tokens, of each decode query.
        decode_slots: (num_decodes, max_context_len) slots of each decode sequence's context,
            padded with slot 0.
        decode_mask: (num_decodes, 1, 1, max_context_len) True where a slot is real context.
        prefills: The prefill chunks of the step.
    """

    kv_caches: list[torch.Tensor]
    slot_mapping: torch.Tensor
    decode_token_index: torch.Tensor | None = None
    decode_slots: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None
    prefills: list[PrefillSpan] = field(default_factory=list)


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
        meta: Slots and masks of the step.

    Returns:
        (num_tokens, heads, head_dim) attention output.
    """
    cache = meta.kv_caches[layer_index]  # (2, num_slots, kv_heads, head_dim)
    cache[0].index_copy_(0, meta.slot_mapping, k)
    cache[1].index_copy_(0, meta.slot_mapping, v)
    groups = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    if meta.decode_token_index is not None:
        assert meta.decode_slots is not None and meta.decode_mask is not None
        keys = cache[0][meta.decode_slots].transpose(1, 2)  # (decodes, kv_heads, ctx, head_dim)
        values = cache[1][meta.decode_slots].transpose(1, 2)
        decodes = meta.decode_token_index.shape[0]
        # The query heads sharing a KV head become that head's query rows: grouped-query
        # attention without copying keys and values per query head.
        queries = q[meta.decode_token_index].view(decodes, k.shape[1], groups, q.shape[2])
        decoded = F.scaled_dot_product_attention(queries, keys, values, attn_mask=meta.decode_mask)
        out[meta.decode_token_index] = decoded.reshape(decodes, q.shape[1], q.shape[2])
    for span in meta.prefills:
        end = span.query_start + span.num_queries
        context_len = span.context_slots.shape[0]
        if context_len == span.num_queries:  # no cached prefix: the chunk is the whole context
            out[span.query_start : end] = causal_attention(
                q[span.query_start : end], k[span.query_start : end], v[span.query_start : end]
            )
            continue
        keys = cache[0][span.context_slots].transpose(0, 1)  # (kv_heads, ctx, head_dim)
        values = cache[1][span.context_slots].transpose(0, 1)
        # Query i sits at position context_len - num_queries + i and sees keys up to it.
        query_pos = torch.arange(context_len - span.num_queries, context_len)
        mask = torch.arange(context_len)[None, :] <= query_pos[:, None]  # (queries, ctx)
        chunk = F.scaled_dot_product_attention(
            q[span.query_start : end].transpose(0, 1),  # (heads, queries, head_dim)
            _expand_kv(keys, groups),
            _expand_kv(values, groups),
            attn_mask=mask,
        )
        out[span.query_start : end] = chunk.transpose(0, 1)
    return out
