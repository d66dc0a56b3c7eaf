"""`ModelRunner`: owns the KV cache tensors and runs one scheduled batch through the model."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from weightsync.engine._attention import AttentionGroup, AttentionMetadata
from weightsync.engine._lanes import DecodeLanes
from weightsync.engine._sampler import TokenLogprobs, position_logprobs, sample, token_logprobs
from weightsync.engine._scheduler import ScheduledSequence
from weightsync.engine._sequence import Sequence
from weightsync.engine.lora import LoRABatch
from weightsync.engine.model import LlamaForCausalLM, _check_fits_memory

_SCORED_POSITIONS = 256  # prompt positions whose logits are scored together

__all__ = ["ModelRunner"]


class _Row(NamedTuple):
    """One sequence of a step, as attention sees it."""

    first_query: int  # index among the step's tokens of its first query
    start: int  # position of its first query in the sequence
    end: int  # one past the position of its last query: the context attended
    block_table: list[int]


class ModelRunner:
    """Turns a scheduled batch into model inputs, runs the forward pass and samples.

    Args:
        model: The model.
        num_blocks: KV-cache blocks (shared with the `BlockManager`'s numbering).
        block_size: Tokens per block.
        eos_token_ids: The tokenizer's end-of-sequence ids (kept from being sampled before a
            request's `min_tokens`).
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        *,
        num_blocks: int,
        block_size: int,
        eos_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.model = model
        self.eos_token_ids = eos_token_ids
        self.block_size = block_size
        self.device = model.device
        config = model.config
        slots = num_blocks * block_size
        # One (2, kv_heads, slots, head_dim) tensor per layer: keys, then values.
        shape = (2, config.num_key_value_heads, slots, config.kv_head_dim)
        kv_bytes = math.prod(shape) * config.num_hidden_layers * model.dtype.itemsize
        model_bytes = sum(t.nbytes for t in (*model.parameters(), *model.buffers()))
        _check_fits_memory(
            kv_bytes + model_bytes,
            f"the KV cache (num_kv_blocks {num_blocks} x block_size {block_size} slots, for "
            f"{config.num_hidden_layers} layers of {config.num_key_value_heads} KV heads of "
            f"head_dim {config.kv_head_dim}) with the model's {model_bytes / 1e9:.1f} GB",
            self.device,
            "lower num_kv_blocks (--num-kv-blocks)",
        )
        self.kv_caches = [
            torch.zeros(shape, dtype=model.dtype, device=self.device)
            for _ in range(config.num_hidden_layers)
        ]
        # Scratch space that attention gathers each prefill chunk's context into; it grows to
        # the largest step seen and is reused by every layer of every step (see
        # `AttentionGroup.gathered`). Decodes read their decode lanes instead.
        self._gather_space = torch.empty(0, dtype=model.dtype, device=self.device)
        self.lanes = DecodeLanes(
            num_layers=config.num_hidden_layers,
            kv_heads=config.num_key_value_heads,
            head_dim=config.kv_head_dim,
            block_size=block_size,
            dtype=model.dtype,
            device=self.device,
        )

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes the KV cache holds now (0 while released)."""
        return sum(kv.untyped_storage().nbytes() for kv in self.kv_caches)

    def release_kv_cache(self) -> None:
        """Frees the KV cache's memory, and the decode lanes' and scratch space's (to sleep).

        Every cached value is lost: the scheduler's blocks must be reset with it, so each
        request recomputes its KV once the cache is back (`restore_kv_cache`).
        """
        for kv in self.kv_caches:
            kv.untyped_storage().resize_(0)  # the tensors stay: their memory goes
        self.lanes.release()
        self._gather_space = torch.empty(0, dtype=self._gather_space.dtype, device=self.device)

    def restore_kv_cache(self) -> None:
        """Allocates the KV cache again, as large as before `release_kv_cache`; harmless twice.

        The memory comes back zeroed, as it started: attention reads a block's unwritten slots
        with weight 0, and whatever the allocator left there (a NaN, say) would survive that.
        """
        for kv in self.kv_caches:
            nbytes = kv.numel() * kv.element_size()
            if kv.untyped_storage().nbytes() != nbytes:
                kv.untyped_storage().resize_(nbytes)
                kv.zero_()

    def _gather_buffer(self, num_blocks: int) -> torch.Tensor:
        """A (2, kv_heads, num_blocks, block_size * head_dim) view of the scratch space."""
        _, kv_heads, _, head_dim = self.kv_caches[0].shape
        numel = 2 * kv_heads * num_blocks * self.block_size * head_dim
        if self._gather_space.numel() < numel:
            self._gather_space = torch.empty(
                numel, dtype=self._gather_space.dtype, device=self.device
            )
        return self._gather_space[:numel].view(2, kv_heads, num_blocks, -1)

    def _group(self, rows: list[_Row], gathered: torch.Tensor) -> AttentionGroup:
        """Pads sequences into one `AttentionGroup`.

        Args:
            rows: The sequences, in batch order.
            gathered: The group's scratch space, (2, kv_heads, rows * longest table, block values).
        """
        first = torch.tensor([row.first_query for row in rows])
        starts = torch.tensor([row.start for row in rows])
        ends = torch.tensor([row.end for row in rows])
        max_queries = int((ends - starts).max())
        longest_table = max(len(row.block_table) for row in rows)
        # Past a row's table the padded entries name block 0: a real block, masked out below.
        tables = torch.tensor(
            [r.block_table + [0] * (longest_table - len(r.block_table)) for r in rows]
        )
        key_pos = torch.arange(longest_table * self.block_size)  # (max_context,)
        query_pos = starts[:, None] + torch.arange(max_queries)  # (rows, max_queries)
        is_query = query_pos < ends[:, None]
        # Causal within the row's context; a padding query (past `end`) sees the whole context.
        mask = (key_pos <= query_pos[..., None]) & (key_pos < ends[:, None, None])
        query_index = torch.where(is_query, first[:, None] + query_pos - starts[:, None], 0)
        sources = is_query.flatten().nonzero().squeeze(1)
        return AttentionGroup(
            query_index=query_index.to(self.device),
            block_tables=tables.to(self.device),
            mask=mask.to(self.device),
            sources=sources.to(self.device),
            targets=query_index[is_query].to(self.device),
            gathered=gathered,
        )

    def prepare(
        self, batch: list[ScheduledSequence]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Builds the flat inputs of a step, on the model's device.

        Returns:
            (tokens,) input ids, (tokens,) positions, the attention metadata, and the index
            among the step's tokens of each row to sample (the last token of each sampling
            sequence, in batch order).
        """
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        decodes: list[tuple[Sequence, int, int]] = []
        prefills: list[_Row] = []
        sample_rows: list[int] = []
        size = self.block_size
        for item in batch:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_tokens
            query_start = len(input_ids)
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slot_mapping.extend(table[p // size] * size + p % size for p in range(start, end))
            if item.num_tokens == 1:
                decodes.append((seq, query_start, end))
            else:
                prefills.append(_Row(query_start, start, end, table))
            if item.samples:
                sample_rows.append(query_start + item.num_tokens - 1)
        groups = []
        if prefills:
            longest_table = max(len(row.block_table) for row in prefills)
            groups.append(self._group(prefills, self._gather_buffer(len(prefills) * longest_table)))
        if not decodes:
            self.lanes.clear()  # a request holds a lane only while it decodes
        meta = AttentionMetadata(
            self.kv_caches,
            self._to_device(slot_mapping),
            groups,
            self.lanes.plan(decodes) if decodes else None,
        )
        return self._to_device(input_ids), self._to_device(positions), meta, sample_rows

    def _to_device(self, values: list[int]) -> torch.Tensor:
        # Built on the CPU from Python ints, then copied once: no per-element device writes.
        return torch.tensor(values, dtype=torch.long).to(self.device)

    @torch.inference_mode()
    def execute(
        self, batch: list[ScheduledSequence]
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """Runs one step.

        Returns:
            The sampled token of each sampling sequence, in batch order, and its
            log-probabilities (None for a request that did not ask for them).
        """
        input_ids, positions, meta, sample_rows = self.prepare(batch)
        lora = self._lora_batch(batch)
        try:
            hidden = self.model(input_ids, positions, meta, lora)  # (tokens, hidden)
        except BaseException:
            self.lanes.clear()  # the lanes' planned fills may not all have happened
            raise
        self._score_prompts(batch, hidden)
        if not sample_rows:
            return [], []
        logits = self.model.compute_logits(hidden[self._to_device(sample_rows)])  # (seqs, vocab)
        sampling = [item.seq for item in batch if item.samples]
        tokens = sample(logits, sampling, self.eos_token_ids)
        return tokens, token_logprobs(logits, [s.sampling_params for s in sampling], tokens)

    def _lora_batch(self, batch: list[ScheduledSequence]) -> LoRABatch | None:
        """The step's token rows grouped by LoRA adapter, in `prepare`'s order (None: no adapter)."""
        spans = []
        first = 0
        for item in batch:
            spans.append((item.seq.lora, first, item.num_tokens))
            first += item.num_tokens
        return LoRABatch.of_rows(spans, self.device)

    def _score_prompts(self, batch: list[ScheduledSequence], hidden: torch.Tensor) -> None:
        """Fills the prompt log-probabilities of the prompt tokens this step's chunks predict.

        Position p's logits predict token p + 1: a chunk of positions [start, end) scores the
        prompt tokens start + 1 .. end (the prompt's own, not a sampled one). A chunk computed
        again (after a preemption) writes the same values again.
        """
        query_start = 0
        for item in batch:
            seq = item.seq
            start = seq.num_computed_tokens
            end = min(start + item.num_tokens, seq.num_prompt_tokens - 1)
            if seq.prompt_logprobs is not None and start < end:
                num_top = seq.sampling_params.prompt_logprobs or 0
                # A slice of positions at a time: a long prompt's logits over a large
                # vocabulary (2048 x 152k floats: 1.2 GB) need not exist all at once.
                for first in range(start, end, _SCORED_POSITIONS):
                    last = min(first + _SCORED_POSITIONS, end)
                    offset = query_start + first - start
                    rows = self._to_device(list(range(offset, offset + last - first)))
                    logits = self.model.compute_logits(hidden[rows])  # (last - first, vocab)
                    next_tokens = seq.token_ids[first + 1 : last + 1]
                    scored = position_logprobs(logits, next_tokens, num_top)
                    seq.prompt_logprobs[first + 1 : last + 1] = scored
            query_start += item.num_tokens
