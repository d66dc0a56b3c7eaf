"""Sleep and wake up: what sleeps, what memory goes, what a sleeping engine refuses.

vLLM 0.32 on a CPU frees nothing when asleep, and a request sent to it while asleep waits for a
wake-up; here the KV cache (level 1) and the weights (level 2) really go, and the engine says no
at once.
"""

import pytest
import torch
from engine_helpers import debug_model, greedy, make_engine

from weightsync.errors import (
    EngineStateError,
    InvalidRequestError,
    TornWeightsError,
    WeightUpdateStateError,
)


def run(engine, *prompts, tokens=6):
    return [o.outputs[0].token_ids for o in engine.generate(list(prompts), greedy(tokens))]


def test_level_1_frees_the_kv_cache_and_wake_up_brings_it_back(local_source):
    engine = make_engine()
    expected = run(engine, "before")
    held = engine.runner.kv_cache_bytes
    assert held > 0
    engine.sleep(1)
    assert engine.is_sleeping() and engine.is_paused()
    assert engine.runner.kv_cache_bytes == 0  # the memory went
    with pytest.raises(EngineStateError, match=r"asleep .*wake_up\(\)"):
        engine.add_request("r", "during", greedy(2))
    engine.wake_up()
    assert not engine.is_sleeping() and not engine.is_paused()
    assert engine.runner.kv_cache_bytes == held
    assert run(engine, "before") == expected  # the weights were kept


def test_the_kv_cache_wakes_as_clean_as_it_started_whatever_memory_it_gets(monkeypatch):
    # Memory handed back by the allocator holds anything; NaN bytes stand for the worst of it.
    # Attention reads a block's unwritten slots with weight 0, and 0 * NaN is NaN.
    grow = torch.UntypedStorage.resize_

    def resize_to_garbage(storage, nbytes):
        had = storage.nbytes()
        grown = grow(storage, nbytes)
        if nbytes > had:
            torch.empty(0, dtype=torch.uint8).set_(storage).fill_(0xFF)
        return grown

    engine = make_engine()
    params = greedy(6, logprobs=0, prompt_logprobs=0)
    (before,) = engine.generate([[1, 2, 3, 4, 5]], params)
    monkeypatch.setattr(torch.UntypedStorage, "resize_", resize_to_garbage)
    engine.sleep(1)
    engine.wake_up()
    (after,) = engine.generate([[1, 2, 3, 4, 5]], params)
    assert after.outputs[0].token_ids == before.outputs[0].token_ids
    assert after.outputs[0].logprobs == pytest.approx(before.outputs[0].logprobs)


def test_the_weights_sleep_at_level_1_and_wake_alone_for_an_update(local_source, policy):
    engine = make_engine()
    engine.init_weight_transfer_engine(local_source.init_request)
    local_source.tensors = policy
    engine.sleep(1)
    with pytest.raises(EngineStateError, match="the weights are asleep"):
        engine.start_weight_update()
    with pytest.raises(EngineStateError, match="the weights are asleep"):
        engine.update_weights(local_source.update_info())
    engine.wake_up(["weights"])  # a colocated trainer's order: weights, update, then the rest
    assert engine.is_sleeping()
    engine.update_weights(local_source.update_info(weight_version="after-sleep"))
    with pytest.raises(EngineStateError, match="asleep"):
        engine.resume_generation()
    engine.wake_up(["kv_cache", "scheduling"])
    assert not engine.is_sleeping() and not engine.is_paused()
    assert engine.weight_version == "after-sleep"
    assert engine.generate(["x"], greedy(2))[0].outputs[0].weight_versions == ["after-sleep"] * 2


def test_waking_the_last_memory_wakes_scheduling_as_vllm_does(local_source):
    engine = make_engine()
    expected = run(engine, "before")
    engine.sleep(1)
    engine.wake_up(["weights"])
    assert engine.is_sleeping()  # the KV cache still sleeps, and scheduling with it
    engine.wake_up(["kv_cache"])  # SkyRL's second call: no `scheduling` tag
    assert not engine.is_sleeping() and not engine.is_paused()
    assert run(engine, "before") == expected


def test_level_2_frees_the_weights_and_they_wake_torn_until_an_update_lands(local_source, policy):
    engine = make_engine()
    engine.init_weight_transfer_engine(local_source.init_request)
    before = sum(p.untyped_storage().nbytes() for p in engine.model.parameters())
    engine.sleep(2)
    assert sum(p.untyped_storage().nbytes() for p in engine.model.parameters()) == 0
    engine.wake_up()
    assert not engine.is_sleeping() and engine.is_paused()  # torn: no generation
    assert sum(p.untyped_storage().nbytes() for p in engine.model.parameters()) == before
    with pytest.raises(TornWeightsError):
        engine.resume_generation()
    local_source.tensors = policy
    engine.update_weights(local_source.update_info(weight_version="reloaded"))
    engine.resume_generation()
    held = dict(engine.model.named_weights())
    assert all(torch.equal(held[name], tensor) for name, tensor in policy.items())


def test_weights_torn_by_a_level_2_sleep_are_not_blamed_on_a_failed_update(local_source, policy):
    engine = make_engine()
    engine.init_weight_transfer_engine(local_source.init_request)
    engine.sleep(2)
    engine.wake_up()
    with pytest.raises(TornWeightsError) as refused:
        engine.resume_generation()
    message = str(refused.value)
    assert "a level-2 sleep discarded" in message and "since wake_up" in message
    assert "failed" not in message
    # An update that covers part of them names the same cause for the rest.
    one = {"model.norm.weight": policy["model.norm.weight"]}
    local_source.tensors = one
    with pytest.raises(TornWeightsError, match=r"still torn \(a level-2 sleep discarded") as left:
        engine.update_weights(local_source.update_info(weight_version="part"))
    assert "failed" not in str(left.value)
    assert engine.weight_version == 0


def test_keep_mode_freezes_requests_that_finish_their_tokens_after_wake_up():
    engine = make_engine()
    expected = run(engine, "frozen one", "frozen two", tokens=10)
    engine.add_request("a", "frozen one", greedy(10))
    engine.add_request("b", "frozen two", greedy(10))
    engine.step()
    engine.step()
    engine.sleep(1, mode="keep")  # their KV goes with the cache: they recompute it on wake-up
    assert engine.has_unfinished_requests() and engine.step() == []
    engine.wake_up()
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.outputs[0].token_ids
    assert [finals["a"], finals["b"]] == expected


def test_abort_mode_ends_the_requests_in_flight():
    engine = make_engine()
    engine.add_request("a", "ends now", greedy(10))
    engine.step()
    engine.sleep(1)  # abort is the default, as vLLM's
    ended = [o for o in engine.step() if o.request_id == "a"]
    assert ended and ended[0].outputs[0].finish_reason == "abort"


def test_bad_levels_and_tags_are_refused_and_change_nothing():
    engine = make_engine()
    for level in (3, -1, True, "1"):
        with pytest.raises(InvalidRequestError, match="sleep level must be 0, 1 or 2"):
            engine.sleep(level)
    assert not engine.is_sleeping()
    engine.sleep(0)  # scheduling only: nothing freed
    assert engine.runner.kv_cache_bytes > 0
    with pytest.raises(InvalidRequestError, match="unknown"):
        engine.wake_up(["weights", "bogus"])  # vLLM wakes everything on an unknown tag
    assert engine.is_sleeping()
    engine.wake_up(["scheduling"])
    assert not engine.is_sleeping()


def test_sleep_during_an_update_is_refused(local_source):
    engine = make_engine()
    engine.init_weight_transfer_engine(local_source.init_request)
    engine.start_weight_update()
    with pytest.raises(WeightUpdateStateError, match="sleep: a weight update is in progress"):
        engine.sleep(1)
    assert not engine.is_sleeping() and engine.weight_update is not None


def test_reset_writes_zeros_that_a_compare_sees_and_keeps_generating():
    engine = make_engine()
    before = engine.weight_checksums()
    engine.reset_weights()
    after = engine.weight_checksums()
    assert all(before[name] != after[name] for name in before)
    assert all(not t.any() for _, t in engine.model.named_weights())
    assert engine.generate(["x"], greedy(2))[0].outputs[0].finish_reason == "length"


def test_reset_is_refused_on_a_busy_engine():
    engine = make_engine()
    engine.add_request("r", "busy", greedy(20))
    engine.step()
    with pytest.raises(EngineStateError, match="needs a paused or idle engine"):
        engine.reset_weights()
    assert not all(not t.any() for _, t in engine.model.named_weights())


@pytest.fixture
def policy():
    return dict(debug_model(seed=3).named_weights())
