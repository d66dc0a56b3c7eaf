"""`ModelRunner`: owns the KV cache tensors and runs one scheduled batch through the model."""

from __future__ import annotations

import torch

from weightsync.engine.attention import AttentionMetadata, PrefillSpan
from weightsync.engine.model import LlamaForCausalLM
from weightsync.engine.sampling import TokenLogprobs, sample, token_logprobs
from weightsync.engine.scheduler import ScheduledSequence

__all__ = ["ModelRunner"]


class ModelRunner:
    """Turns a scheduled batch into model inputs, runs the forward pass and samples.

    Args:
        model: The model.
        num_blocks: KV-cache blocks (shared with the `BlockManager`'s numbering).
        block_size: Tokens per block.
    """

    def __init__(self, model: LlamaForCausalLM, *, num_blocks: int, block_size: int) -> None:
        self.model = model
        self.block_size = block_size
        config = model.config
        slots = num_blocks * block_size
        # One (2, slots, kv_heads, head_dim) tensor per layer: keys, then values.
        self.kv_caches = [
            torch.zeros(2, slots, config.num_key_value_heads, config.kv_head_dim, dtype=model.dtype)
            for _ in range(config.num_hidden_layers)
        ]

    def _slots(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        """(end - start,) cache slots of token positions start..end-1 of a sequence."""
        positions = torch.arange(start, end)
        blocks = torch.tensor(block_table, dtype=torch.long)[positions // self.block_size]
        return blocks * self.block_size + positions % self.block_size

    def prepare(
        self, batch: list[ScheduledSequence]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Builds the flat inputs of a step.

        Returns:
            (tokens,) input ids, (tokens,) positions, the attention metadata, and the index
            among the step's tokens of each row to sample (the last token of each sampling
            sequence, in batch order).
        """
        input_ids: list[int] = []
        positions: list[torch.Tensor] = []
        slot_mapping: list[torch.Tensor] = []
        decode_index: list[int] = []
        decode_contexts: list[torch.Tensor] = []
        prefills: list[PrefillSpan] = []
        sample_rows: list[int] = []
        for item in batch:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_tokens
            query_start = len(input_ids)
            input_ids.extend(seq.token_ids[start:end])
            positions.append(torch.arange(start, end))
            context = self._slots(seq.block_table, 0, end)  # (end,)
            slot_mapping.append(context[start:end])
            if item.num_tokens == 1:
                decode_index.append(query_start)
                decode_contexts.append(context)
            else:
                prefills.append(PrefillSpan(query_start, item.num_tokens, context))
            if item.samples:
                sample_rows.append(query_start + item.num_tokens - 1)
        meta = AttentionMetadata(self.kv_caches, torch.cat(slot_mapping), prefills=prefills)
        if decode_index:
            longest = max(c.shape[0] for c in decode_contexts)
            lengths = torch.tensor([c.shape[0] for c in decode_contexts])
            padded = torch.zeros(len(decode_contexts), longest, dtype=torch.long)
            for row, context in enumerate(decode_contexts):
                padded[row, : context.shape[0]] = context
            meta.decode_token_index = torch.tensor(decode_index, dtype=torch.long)
            meta.decode_slots = padded  # (decodes, longest)
            mask = torch.arange(longest)[None, :] < lengths[:, None]  # (decodes, longest)
            meta.decode_mask = mask[:, None, None, :]
        return torch.tensor(input_ids, dtype=torch.long), torch.cat(positions), meta, sample_rows

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
        hidden = self.model(input_ids, positions, meta)  # (tokens, hidden)
        if not sample_rows:
            return [], []
        logits = self.model.compute_logits(hidden[sample_rows])  # (sampling seqs, vocab)
        sampling = [item.seq for item in batch if item.samples]
        params = [s.sampling_params for s in sampling]
        tokens = sample(logits, params, [s.generator for s in sampling])
        return tokens, token_logprobs(logits, params, tokens)
