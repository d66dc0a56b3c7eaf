"""Decode lanes: decodes attend over contiguous copies of their KV that always match the cache."""

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from engine_helpers import PROMPTS, greedy, reference_greedy, small_config

from weightsync.engine import _attention
from weightsync.engine._lanes import DecodeLanes
from weightsync.engine.llm_engine import LLMEngine
from weightsync.engine.model import LlamaForCausalLM


def assert_lanes_match_the_cache(engine: LLMEngine) -> int:
    """Every live lane holds exactly its request's keys and values, as the paged cache has them.

    A finished or reset request's lane is stale until the next step drops it. Returns the
    number of lanes checked.
    """
    runner = engine.runner
    size = runner.block_size
    live = {
        seq: lane
        for seq, lane in runner.lanes._held.items()
        if not seq.is_finished and lane.num_kv_resets == seq.num_kv_resets
    }
    for seq, lane in live.items():
        slots = [seq.block_table[p // size] * size + p % size for p in range(lane.num_tokens)]
        for cache, storage in zip(runner.kv_caches, runner.lanes.storage, strict=True):
            expected = cache[:, :, slots]  # (2, kv_heads, tokens, head_dim)
            assert torch.equal(storage[:, lane.index, :, : lane.num_tokens], expected)
    return len(live)


def test_lanes_stay_dense_and_refill_after_a_move_or_a_reset(debug_model):
    engine = LLMEngine(debug_model, engine_config=small_config())
    seqs = [
        engine.input_processor.process(f"r{i}", p, greedy(4)) for i, p in enumerate(PROMPTS[:3])
    ]
    for seq in seqs:  # blocks for 20 tokens each, as if prefilled
        engine.scheduler.block_manager.allocate(seq, [], 20)
    lanes = DecodeLanes(
        num_layers=2, kv_heads=2, head_dim=16, block_size=8, dtype=torch.float32, device="cpu"
    )
    first = lanes.plan([(seqs[0], 0, 10), (seqs[1], 1, 12), (seqs[2], 2, 9)])
    assert first.fill_slots.numel() == 10 + 12 + 9  # new lanes are filled from position 0
    assert [lanes._held[s].index for s in seqs] == [0, 1, 2]
    # The next token of each: one fill each, lanes kept.
    second = lanes.plan([(seqs[0], 0, 11), (seqs[1], 1, 13), (seqs[2], 2, 10)])
    assert second.fill_slots.tolist() == [
        seqs[0].block_table[1] * 8 + 2,
        seqs[1].block_table[1] * 8 + 4,
        seqs[2].block_table[1] * 8 + 1,
    ]
    assert second.mask.shape == (3, 1, 1, 13)
    assert second.mask[2, 0, 0].tolist() == [True] * 10 + [False] * 3
    # seqs[0] finished: seqs[2] moves from lane 2 to lane 0 and is refilled whole.
    third = lanes.plan([(seqs[1], 0, 14), (seqs[2], 1, 11)])
    assert (lanes._held[seqs[1]].index, lanes._held[seqs[2]].index) == (1, 0)
    assert third.query_index.tolist() == [1, 0]  # lane 0 holds the step's token 1
    assert not third.in_token_order
    assert third.fill_slots.numel() == 1 + 11
    # A reset (preemption, cleared cache) makes the kept lane stale: refilled whole.
    engine.scheduler.block_manager.free(seqs[1])  # resets its KV state
    engine.scheduler.block_manager.allocate(seqs[1], [], 20)
    fourth = lanes.plan([(seqs[1], 0, 15), (seqs[2], 1, 12)])
    assert fourth.fill_slots.numel() == 15 + 1
    assert lanes.storage[0].shape[1] == 3  # grown to the most lanes used, never shrunk
    # Contexts of one length (a static batch) need no mask.
    fifth = lanes.plan([(seqs[2], 0, 16), (seqs[1], 1, 16)])
    assert fifth.mask is None and fifth.in_token_order and fifth.context == 16


def test_lanes_match_the_cache_as_requests_finish_at_different_steps(debug_model):
    # max_tokens from 3 to 14: requests finish one after another and the last lanes move down.
    engine = LLMEngine(debug_model, engine_config=small_config())
    expected = {}
    for index, prompt in enumerate(PROMPTS[:6]):
        engine.add_request(f"r{index}", prompt, greedy(3 + 2 * index + index % 2))
        expected[f"r{index}"] = reference_greedy(
            debug_model, engine.tokenizer.encode(prompt), 3 + 2 * index + index % 2
        )
    finals, checked = {}, 0
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
        checked += assert_lanes_match_the_cache(engine)
    assert checked > 0
    assert {r: o.outputs[0].token_ids for r, o in finals.items()} == expected


def test_matmul_attention_equals_sdpa_and_ignores_masked_columns():
    torch.manual_seed(0)
    q = torch.randn(3, 2, 2, 16)  # (rows, kv_heads, query heads per KV head, head_dim)
    lanes = torch.randn(2, 3, 2, 12, 16)
    keys, values = lanes[0, :, :, :9], lanes[1, :, :, :9]  # views, as the engine reads lanes
    mask = (torch.arange(9) < torch.tensor([9, 4, 6])[:, None])[:, None, None, :]
    out = _attention._matmul_attention(q, keys, values, mask)
    assert torch.allclose(out, F.scaled_dot_product_attention(q, keys, values, attn_mask=mask),
                          atol=1e-6)  # fmt: skip
    lanes[:, 1, :, 4:9] = 1e4  # what row 1 may not see
    assert torch.equal(_attention._matmul_attention(q, keys, values, mask)[1], out[1])


def test_the_matmul_form_is_taken_only_where_it_was_measured_faster():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        pays = {g: _attention._matmul_pays(torch.zeros(8, 8 // g, g, 64)) for g in (1, 2, 4, 8)}
        assert pays == {1: False, 2: True, 4: False, 8: False}
        assert not _attention._matmul_pays(torch.zeros(8, 4, 2, 64, dtype=torch.bfloat16))
        torch.set_num_threads(1)
        assert not _attention._matmul_pays(torch.zeros(8, 4, 2, 64))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
def test_float32_decodes_of_mixed_lengths_match_the_reference_on_either_attention(threads):
    # In float32 with two query heads per KV head (the debug shape), two threads take the matmul
    # form and one keeps SDPA (see _matmul_pays); with requests of different lengths in one
    # batch (a mask), both must give the logprobs of the reference, the whole sequence at once.
    model = LlamaForCausalLM.from_preset("debug", seed=0, dtype=torch.float32)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert _attention._matmul_pays(torch.zeros(5, 2, 2, 16)) == (threads > 1)
        engine = LLMEngine(model, engine_config=small_config())
        for index, prompt in enumerate(PROMPTS[:5]):
            engine.add_request(f"r{index}", prompt, greedy(6, logprobs=0))
        finals = {}
        while engine.has_unfinished_requests():
            finals.update({o.request_id: o.outputs[0] for o in engine.step() if o.finished})
    finally:
        torch.set_num_threads(before)
    for index, prompt in enumerate(PROMPTS[:5]):
        ids, out = engine.tokenizer.encode(prompt), finals[f"r{index}"]
        with torch.inference_mode():
            logits = model.compute_logits(model(torch.tensor(ids + out.token_ids)))
        chosen = logits[len(ids) - 1 : -1].log_softmax(-1)
        expected = chosen.gather(1, torch.tensor(out.token_ids)[:, None]).squeeze(1)
        assert torch.allclose(torch.tensor(out.logprobs), expected, atol=1e-5)


def test_a_kept_pause_with_a_cleared_cache_refills_the_lanes(debug_model):
    engine = LLMEngine(debug_model, engine_config=small_config())
    want = [o.outputs[0].token_ids for o in engine.generate(PROMPTS[:4], greedy(12))]
    for index, prompt in enumerate(PROMPTS[:4]):
        engine.add_request(f"r{index}", prompt, greedy(12))
    for _ in range(4):
        engine.step()
    engine.pause_generation(mode="keep", clear_cache=True)  # every request recomputes its KV
    engine.resume_generation()
    finals, checked = {}, 0
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
        checked += assert_lanes_match_the_cache(engine)
    assert checked > 0
    assert [finals[f"r{i}"].outputs[0].token_ids for i in range(4)] == want
