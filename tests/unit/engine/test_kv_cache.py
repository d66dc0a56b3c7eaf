from engine_helpers import make_sequence

from weightsync.engine._kv_cache import BlockManager


def manager(num_blocks=8, prefix=True):
    return BlockManager(num_blocks=num_blocks, block_size=4, enable_prefix_caching=prefix)


def run_prefill(bm, seq):
    hits = bm.match_prefix(seq)
    assert bm.can_allocate(hits, seq.num_tokens)
    bm.allocate(seq, hits, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.register_full_blocks(seq)
    return hits


def test_identical_prefixes_share_blocks():
    bm = manager()
    a = make_sequence(list(range(10)), "a")
    assert run_prefill(bm, a) == []
    assert len(a.block_table) == 3 and bm.num_cached_blocks == 2
    b = make_sequence([*range(8), 99, 98, 97], "b")
    hits = run_prefill(bm, b)
    assert hits == a.block_table[:2]
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert bm.num_free_blocks == 8 - 4


def test_last_token_is_never_served_from_the_cache():
    bm = manager()
    run_prefill(bm, make_sequence(list(range(8)), "a"))
    again = make_sequence(list(range(8)), "b")
    assert len(bm.match_prefix(again)) == 1  # the second block holds the last token


def test_freed_blocks_stay_reusable_until_evicted():
    bm = manager(num_blocks=4)
    a = make_sequence([*list(range(8)), 50], "a")
    run_prefill(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 2
    b = make_sequence([*list(range(8)), 60], "b")
    assert len(run_prefill(bm, b)) == 2
    bm.free(b)
    # Filling the cache with something else evicts the old prefix.
    c = make_sequence(list(range(100, 116)), "c")
    run_prefill(bm, c)
    assert bm.match_prefix(make_sequence([*list(range(8)), 70], "d")) == []


def test_capacity_checks_and_growth():
    bm = manager(num_blocks=2)
    a = make_sequence(list(range(5)), "a")
    assert not bm.can_allocate([], 9)
    bm.allocate(a, [], 5)
    assert len(a.block_table) == 2
    a.num_computed_tokens = 5
    assert bm.can_append(a, 3) and not bm.can_append(a, 4)


def test_epoch_bump_forgets_prefixes_and_stale_sequences_do_not_register():
    bm = manager()
    a = make_sequence(list(range(6)), "a")
    run_prefill(bm, a)
    bm.bump_epoch()
    assert bm.num_cached_blocks == 0
    a.token_ids += [6, 7, 8]
    a.num_computed_tokens = 9
    bm.append_slots(a, 0)
    bm.register_full_blocks(a)  # its KV predates the new weights
    assert bm.num_cached_blocks == 0


def test_disabled_prefix_caching_never_hits():
    bm = manager(prefix=False)
    run_prefill(bm, make_sequence(list(range(10)), "a"))
    assert bm.match_prefix(make_sequence(list(range(10)), "b")) == []
