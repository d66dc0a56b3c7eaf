"""`BlockManager`: the KV cache as fixed-size blocks, with prefix caching.

A sequence holds a table of block ids; block `i` holds its tokens `i * block_size` up to
`(i + 1) * block_size`. A block whose tokens are all computed gets a hash of its tokens chained
with the previous block's hash, so two sequences with the same prefix end on the same chain of
hashes: a new sequence takes the cached blocks of its longest cached prefix (reference-counted,
shared, never written again) and computes only the rest. Freed blocks keep their contents and
hash until they are reused, oldest freed first, so a prefix stays reusable while memory allows.

A request's `cache_salt` seeds its chain: the first block's hash starts from the salt's hash, so
requests share cached blocks only with requests of the same salt (or, unsalted, with the unsalted
ones). A request's LoRA adapter seeds it too (its id and version): KV computed under one adapter
version is never reused by another, nor by the base model. A request that asks for prompt
log-probabilities takes no cached prefix: it computes each prompt token to score it (it still
offers its blocks to others).

Weights change the meaning of cached KV. `bump_epoch` (after a weight update) forgets every hash,
and a sequence whose KV predates the current epoch never registers its blocks, so a prefix is only
ever reused under the weights that computed it.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from weightsync.engine._sequence import Sequence

__all__ = ["BlockManager"]


class _Block:
    """One block: who uses it and, once full and registered, its prefix hash."""

    __slots__ = ("block_hash", "block_id", "ref_count")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: bytes | None = None


def _chain_hash(previous: bytes, token_ids: list[int]) -> bytes:
    """Hash of a full block given the hash of the blocks before it (`_chain_start` for the first)."""
    return hashlib.sha256(previous + array("q", token_ids).tobytes()).digest()


def _chain_start(seq: Sequence) -> bytes:
    """What the first block's hash chains from: b"" unsalted and base, else a 32-byte hash."""
    # A salt's hash is 32 bytes and the unsalted start is empty, so no salt, whatever its text,
    # starts the chain of another salt or of the unsalted requests. An adapter's key is hashed
    # with it, apart from the salt by the prefixes, so no salt can pose as an adapter.
    start = b""
    if seq.cache_salt is not None:
        salt = seq.cache_salt.encode("utf-8", "surrogatepass")
        start = hashlib.sha256(b"cache_salt:" + salt).digest()
    if seq.lora is not None:
        start = hashlib.sha256(b"lora_adapter:" + seq.lora.cache_key + b":" + start).digest()
    return start


class BlockManager:
    """Allocates KV blocks to sequences and shares the blocks of cached prefixes.

    Args:
        num_blocks: Blocks in the cache.
        block_size: Tokens per block.
        enable_prefix_caching: Share and reuse full blocks of identical prefixes.

    >>> manager = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    >>> manager.num_free_blocks
    8
    """

    def __init__(self, *, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.epoch = 0
        self.num_prefix_hit_tokens = 0
        self._blocks = [_Block(i) for i in range(num_blocks)]
        # Free blocks, least recently freed first: allocation evicts from the front.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[bytes, int] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds (some may still serve as cached prefixes)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache."""
        return len(self._cached)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    # --- admission ----------------------------------------------------------------------------

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Returns the cached blocks of `seq`'s longest cached prefix, without taking them.

        Only blocks before the last token count: at least one token must be computed to produce
        the next token's logits, and it must land in a block of the sequence's own.
        """
        if not self.enable_prefix_caching or seq.sampling_params.prompt_logprobs is not None:
            return []
        hits: list[int] = []
        block_hash = _chain_start(seq)
        for index in range((seq.num_tokens - 1) // self.block_size):
            start = index * self.block_size
            block_hash = _chain_hash(block_hash, seq.token_ids[start : start + self.block_size])
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def can_allocate(self, hits: list[int], num_tokens: int) -> bool:
        """Whether a sequence reusing `hits` can hold its first `num_tokens` tokens."""
        new_blocks = self.blocks_for(num_tokens) - len(hits)
        revived = sum(1 for b in hits if self._blocks[b].ref_count == 0)  # cached but free
        return new_blocks + revived <= len(self._free)

    def allocate(self, seq: Sequence, hits: list[int], num_tokens: int) -> None:
        """Gives `seq` (holding no blocks) the blocks `hits` plus new ones up to `num_tokens`.

        Sets `seq.num_computed_tokens` to the tokens the hits cover.
        """
        assert not seq.block_table, f"{seq} already holds blocks"
        for block_id in hits:
            block = self._blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
        seq.block_table = list(hits)
        seq.block_hashes = [self._blocks[b].block_hash for b in hits]  # type: ignore[misc]
        seq.num_computed_tokens = len(hits) * self.block_size
        seq.cache_epoch = self.epoch
        self.num_prefix_hit_tokens += seq.num_computed_tokens
        self.append_slots(seq, num_tokens - seq.num_computed_tokens)

    # --- growth -------------------------------------------------------------------------------

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether `seq` can grow by `num_new_tokens` computed tokens."""
        needed = self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return needed <= len(self._free)

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Adds blocks so that `seq` can hold `num_new_tokens` more computed tokens."""
        needed = self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        for _ in range(needed):
            block_id, _ = self._free.popitem(last=False)
            block = self._blocks[block_id]
            if block.block_hash is not None:  # evict its cached prefix: it is being overwritten
                if self._cached.get(block.block_hash) == block_id:
                    del self._cached[block.block_hash]
                block.block_hash = None
            block.ref_count = 1
            seq.block_table.append(block_id)

    def register_full_blocks(self, seq: Sequence) -> None:
        """Offers `seq`'s newly completed blocks to the prefix cache (call after each step)."""
        if not self.enable_prefix_caching or seq.cache_epoch != self.epoch:
            return
        full = seq.num_computed_tokens // self.block_size
        for index in range(len(seq.block_hashes), full):
            start = index * self.block_size
            previous = seq.block_hashes[-1] if seq.block_hashes else _chain_start(seq)
            block_hash = _chain_hash(previous, seq.token_ids[start : start + self.block_size])
            seq.block_hashes.append(block_hash)
            block = self._blocks[seq.block_table[index]]
            if block_hash not in self._cached and block.block_hash is None:
                self._cached[block_hash] = block.block_id
                block.block_hash = block_hash

    # --- release ------------------------------------------------------------------------------

    def free(self, seq: Sequence) -> None:
        """Releases `seq`'s blocks and resets its KV state; cached blocks stay reusable."""
        # Last blocks first, so a prefix's tail is evicted before its head.
        for block_id in reversed(seq.block_table):
            block = self._blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
        seq.reset_kv()

    def bump_epoch(self) -> None:
        """Forgets every cached prefix: the weights changed, so their KV no longer matches."""
        self.epoch += 1
        for block in self._blocks:
            block.block_hash = None
        self._cached.clear()

    def reset(self) -> None:
        """Frees every block and forgets every cached prefix.

        The caller must have reset the KV state of the sequences that held blocks.
        """
        for block in self._blocks:
            block.ref_count = 0
            block.block_hash = None
        self._free = OrderedDict.fromkeys(range(self.num_blocks))
        self._cached.clear()
        self.epoch += 1
