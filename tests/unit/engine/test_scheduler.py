import pytest
from engine_helpers import make_sequence

from weightsync.engine._kv_cache import BlockManager
from weightsync.engine._scheduler import Scheduler
from weightsync.engine._sequence import SequenceStatus
from weightsync.engine.config import EngineConfig
from weightsync.engine.errors import InvalidRequestError
from weightsync.engine.pause import PauseState


def make_scheduler(**overrides):
    config = EngineConfig(
        **{
            "block_size": 4,
            "num_kv_blocks": 64,
            "max_num_batched_tokens": 16,
            "max_num_seqs": 4,
            **overrides,
        }
    )
    bm = BlockManager(num_blocks=config.num_kv_blocks, block_size=4, enable_prefix_caching=True)
    return Scheduler(config, bm)


def fake_step(scheduler):
    """Schedules, 'samples' token 1 for each sequence that reached its end, finishes max_tokens."""
    batch = scheduler.schedule()
    for item in batch:
        if item.samples:
            item.seq.token_ids.append(1)
            if item.seq.num_output_tokens >= item.seq.sampling_params.max_tokens:
                item.seq.finish("length")
    scheduler.finish_step(batch)
    return {item.seq.request_id: item.num_tokens for item in batch}


def test_long_prompts_are_chunked_under_the_token_budget():
    scheduler = make_scheduler()
    scheduler.add(make_sequence(list(range(40)), "long"))
    assert fake_step(scheduler) == {"long": 16}
    assert fake_step(scheduler) == {"long": 16}
    assert fake_step(scheduler) == {"long": 8}  # the last chunk samples
    assert fake_step(scheduler) == {"long": 1}


def test_new_requests_join_running_ones_each_step():
    scheduler = make_scheduler()
    scheduler.add(make_sequence([1, 2, 3], "a"))
    assert fake_step(scheduler) == {"a": 3}
    scheduler.add(make_sequence([4, 5], "b"))
    assert fake_step(scheduler) == {"a": 1, "b": 2}


def test_max_num_seqs_caps_admissions():
    scheduler = make_scheduler(max_num_seqs=2)
    for i in range(3):
        scheduler.add(make_sequence([i + 1, 9], f"r{i}"))
    assert set(fake_step(scheduler)) == {"r0", "r1"}
    assert [s.request_id for s in scheduler.waiting] == ["r2"]


def test_a_full_kv_cache_preempts_the_newest_and_recomputes_it_later():
    scheduler = make_scheduler(num_kv_blocks=4, max_num_batched_tokens=64, max_num_seqs=4)
    a, b = (
        make_sequence(list(range(7)), "a", max_tokens=8),
        make_sequence(list(range(10, 17)), "b", max_tokens=8),
    )
    scheduler.add(a)
    scheduler.add(b)
    fake_step(scheduler)  # both hold 2 blocks (8 slots): the cache is full
    fake_step(scheduler)  # position 7 still fits
    assert fake_step(scheduler) == {"a": 1}  # a grows into a third block: b is preempted
    assert scheduler.num_preemptions == 1
    assert (
        b.status is SequenceStatus.WAITING
        and b.num_computed_tokens == 0
        and b.num_output_tokens == 2
    )
    while scheduler.num_unfinished:
        fake_step(scheduler)
    assert a.num_output_tokens == b.num_output_tokens == 8


def test_pause_modes():
    scheduler = make_scheduler()
    running = make_sequence([1, 2], "run", max_tokens=3)
    scheduler.add(running)
    fake_step(scheduler)
    queued = make_sequence([3, 4], "queued")
    scheduler.add(queued)
    # wait: the running one drains, the queued one is not admitted.
    scheduler.pause("wait")
    assert scheduler.state is PauseState.DRAINING
    while scheduler.state is PauseState.DRAINING:
        assert "queued" not in fake_step(scheduler)
    assert running.is_finished and not queued.was_started
    assert scheduler.schedule() == []
    # keep freezes, double pause is harmless, abort ends everything unfinished.
    scheduler.resume()
    fake_step(scheduler)
    scheduler.pause("keep")
    scheduler.pause("keep")
    scheduler.pause("wait")
    assert scheduler.state is PauseState.PAUSED and scheduler.schedule() == []
    aborted = scheduler.abort({"queued"})
    assert aborted == [queued] and queued.finish_reason == "abort"
    with pytest.raises(InvalidRequestError, match="pause mode must be one of"):
        scheduler.pause("stop")


def test_reset_cache_sends_kept_sequences_back_for_recompute():
    scheduler = make_scheduler()
    seqs = [make_sequence([i, i + 1, i + 2], f"s{i}") for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    fake_step(scheduler)
    scheduler.pause("keep")
    scheduler.reset_cache()
    assert [s.request_id for s in scheduler.waiting] == ["s0", "s1", "s2"]
    assert all(s.num_computed_tokens == 0 and not s.block_table for s in seqs)
    assert scheduler.block_manager.num_free_blocks == 64
    scheduler.resume()
    assert fake_step(scheduler) == {"s0": 4, "s1": 4, "s2": 4}
