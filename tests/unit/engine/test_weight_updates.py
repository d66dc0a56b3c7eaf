"""Weight updates through a transfer backend: when they are accepted, versions, torn weights."""

import asyncio
import logging
import threading

import pytest
import torch
from engine_helpers import (
    catch_up,
    debug_model,
    greedy,
    make_async_engine,
    make_engine,
    model_with,
    reference_greedy,
    start_streams,
)

from weightsync.engine.errors import (
    EngineBusyError,
    EngineStateError,
    InvalidRequestError,
    TornWeightsError,
)
from weightsync.errors import WeightTransferError, WeightValidationError

N = 16
MAX_TOKENS = 24


class _OnMessage(logging.Handler):
    """Calls `callback` when a record's message contains `text` (records are handled in the
    thread that logs them: here, the event loop's)."""

    def __init__(self, text, callback):
        super().__init__()
        self.text, self.callback = text, callback

    def emit(self, record):
        if self.text in record.getMessage():
            self.callback()


def prompt_ids(engine, stream):
    return engine.engine.tokenizer.encode(stream.prompt)


def test_keep_clear_cache_and_new_weights_recompute_every_token_after_resume(
    local_source, new_weights
):
    new_model = model_with(new_weights)

    async def run(clear_cache):
        async with make_async_engine() as engine:
            local_source.tensors = new_weights
            await engine.init_weight_transfer_engine(local_source.init_request)
            streams = start_streams(engine, N, MAX_TOKENS)
            await asyncio.gather(*(s.wait_tokens(3) for s in streams))
            await engine.pause_generation(mode="keep", clear_cache=clear_cache)
            await engine.update_weights(local_source.update_info())
            assert engine.weight_version == 1
            await engine.resume_generation()
            matches = []
            for stream in streams:
                final = (await stream.final()).outputs[0]
                before = final.weight_versions.count(0)
                assert final.weight_versions == [0] * before + [1] * (MAX_TOKENS - before)
                assert 3 <= before < MAX_TOKENS
                old_prefix = prompt_ids(engine, stream) + final.token_ids[:before]
                fresh = reference_greedy(new_model, old_prefix, MAX_TOKENS - before)
                matches.append(final.token_ids[before:] == fresh)
            return matches

    assert all(asyncio.run(run(clear_cache=True)))
    # Stale KV from the old weights changes the continuation: the check above has teeth.
    assert not all(asyncio.run(run(clear_cache=False)))


def test_per_token_versions_across_two_in_flight_updates(local_source, new_weights):
    third = {n: t.flip(0).clone() for n, t in new_weights.items()}
    models = {
        0: debug_model(seed=0),
        "step-1": model_with(new_weights),
        2: model_with(third),
    }

    async def main():
        async with make_async_engine() as engine:
            await engine.init_weight_transfer_engine(local_source.init_request)
            streams = start_streams(engine, N, MAX_TOKENS)
            await asyncio.gather(*(s.wait_tokens(2) for s in streams))
            await engine.pause_generation(mode="keep")
            local_source.tensors = new_weights
            await engine.update_weights(local_source.update_info(weight_version="step-1"))
            counts = await catch_up(engine, streams)
            await engine.resume_generation()
            await asyncio.gather(
                *(s.wait_tokens(n + 3) for s, n in zip(streams, counts, strict=True))
            )
            await engine.pause_generation(mode="keep")
            local_source.tensors = third
            await engine.update_weights(local_source.update_info())  # unlabeled: counts updates
            assert engine.weight_version == 2
            await engine.resume_generation()
            for stream in streams:
                final = (await stream.final()).outputs[0]
                spans = final.weight_version_spans
                assert [s.weight_version for s in spans] == [0, "step-1", 2]
                assert spans[0].start == 0 and spans[-1].end == MAX_TOKENS
                assert spans[1].end - spans[1].start >= 3
                # Each span continues its prefix exactly as a fresh decode with its weights would.
                for span in spans:
                    prefix = prompt_ids(engine, stream) + final.token_ids[: span.start]
                    expected = reference_greedy(
                        models[span.weight_version], prefix, span.end - span.start
                    )
                    assert final.token_ids[span.start : span.end] == expected

    asyncio.run(main())


def test_updates_on_a_busy_unpaused_engine_say_to_pause_first(local_source, new_weights):
    local_source.tensors = new_weights

    async def main():
        async with make_async_engine() as engine:
            await engine.init_weight_transfer_engine(local_source.init_request)
            streams = start_streams(engine, 4, MAX_TOKENS)
            await asyncio.gather(*(s.wait_tokens(1) for s in streams))
            with pytest.raises(EngineBusyError, match=r"call pause_generation\(mode="):
                await engine.update_weights(local_source.update_info())
            assert engine.weight_version == 0
            for stream in streams:
                assert set((await stream.final()).outputs[0].weight_versions) == {0}
            # Idle now: accepted without a pause.
            await engine.update_weights(local_source.update_info())
            assert engine.weight_version == 1 and not await engine.is_paused()

    asyncio.run(main())


def test_a_cancelled_update_still_blocks_steps_until_the_transfer_ends(local_source, new_weights):
    local_source.tensors = new_weights
    local_source.gate = threading.Event()

    async def main():
        async with make_async_engine() as engine:
            execute = engine.engine.runner.execute
            steps_during_transfer = []

            def watched(batch):
                steps_during_transfer.append(not local_source.gate.is_set())
                return execute(batch)

            engine.engine.runner.execute = watched
            await engine.init_weight_transfer_engine(local_source.init_request)
            update = asyncio.create_task(engine.update_weights(local_source.update_info()))
            # The update holds the engine's lock and is receiving (blocked at the gate).
            assert await asyncio.to_thread(local_source.at_gate.wait, 30)
            stream = start_streams(engine, 1, 4)[0]
            cancelled = asyncio.Event()
            handler = _OnMessage("cancelled during", cancelled.set)
            logger = logging.getLogger("weightsync.engine.async_engine")
            logger.addHandler(handler)
            level = logger.level
            logger.setLevel(logging.INFO)
            try:
                update.cancel()
                await asyncio.wait_for(cancelled.wait(), timeout=30)  # the update took the cancel
            finally:
                logger.removeHandler(handler)
                logger.setLevel(level)
            # ...and keeps the lock until the transfer ends: `watched` records any step before.
            assert not update.done() and engine.num_steps == 0 and not stream.outputs
            local_source.gate.set()
            with pytest.raises(asyncio.CancelledError):
                await update
            final = await stream.final()
            assert final.outputs[0].weight_versions == [1] * 4
            assert steps_during_transfer == [False] * 4

    asyncio.run(main())


def test_idle_update_serves_new_weights_and_forgets_old_prefixes(local_source, new_weights):
    engine = make_engine()
    prompt = "A prompt long enough to fill a few KV-cache blocks"
    engine.generate([prompt], greedy(4))
    assert engine.generate([prompt], greedy(4))[0].num_cached_tokens > 0
    local_source.tensors = new_weights
    engine.init_weight_transfer_engine(local_source.init_request)
    stats = engine.update_weights(local_source.update_info(weight_version="v2"))
    assert stats.num_tensors == len(new_weights)
    out = engine.generate([prompt], greedy(8))[0]
    assert out.num_cached_tokens == 0
    assert out.outputs[0].weight_versions == ["v2"] * 8
    assert out.outputs[0].token_ids == reference_greedy(
        model_with(new_weights), engine.tokenizer.encode(prompt), 8
    )


def test_a_failed_update_leaves_the_engine_paused_until_a_complete_one_lands(
    local_source, new_weights
):
    engine = make_engine()
    local_source.tensors = new_weights
    engine.init_weight_transfer_engine(local_source.init_request)
    for i in range(N):
        engine.add_request(f"r{i}", f"prompt {i}", greedy(10))
    engine.step()
    engine.pause_generation(mode="keep")
    local_source.fail_after = 5
    with pytest.raises(WeightTransferError) as failure:
        engine.update_weights(local_source.update_info())
    assert failure.value.partially_applied
    assert engine.is_paused() and engine.weight_version == 0
    with pytest.raises(
        TornWeightsError, match=r"land an update that covers them with update_weights\(...\) first"
    ):
        engine.resume_generation()
    with pytest.raises(TornWeightsError, match=r"generate\(\): a failed weight update"):
        engine.generate(["x"], greedy(2))
    assert engine.step() == [] and engine.num_steps == 1  # paused: nothing runs
    local_source.fail_after = None
    engine.update_weights(local_source.update_info())
    engine.resume_generation()
    finals = []
    while engine.has_unfinished_requests():
        finals += [o for o in engine.step() if o.finished]
    assert len(finals) == N
    assert all(o.outputs[0].weight_versions == [0] + [1] * 9 for o in finals)


def test_a_failed_update_pauses_an_idle_engine_but_a_clean_failure_does_not(
    local_source, new_weights
):
    engine = make_engine()
    prompt = "A prompt long enough to fill a few KV-cache blocks"
    engine.generate([prompt], greedy(4))
    local_source.tensors = new_weights
    engine.init_weight_transfer_engine(local_source.init_request)
    local_source.fail_after = 0  # fails before writing anything
    with pytest.raises(WeightTransferError):
        engine.update_weights(local_source.update_info())
    assert not engine.is_paused() and not engine.weights.is_torn
    assert engine.generate([prompt], greedy(4))[0].num_cached_tokens > 0  # nothing was written
    local_source.fail_after = 3
    with pytest.raises(WeightTransferError):
        engine.update_weights(local_source.update_info())
    assert engine.is_paused()
    with pytest.raises(TornWeightsError):
        engine.resume_generation()


def test_rejected_updates_change_nothing(local_source, new_weights):
    engine = make_engine()
    prompt = "A prompt long enough to fill a few KV-cache blocks"
    engine.generate([prompt], greedy(4))
    before = {n: t.clone() for n, t in engine.model.named_weights()}
    local_source.tensors = {**new_weights, "model.norm.weight": torch.ones(3)}
    engine.init_weight_transfer_engine(local_source.init_request)
    with pytest.raises(
        WeightValidationError,
        match=r"'model.norm.weight': model has float64\[64\], update has float32\[3\]",
    ):
        engine.update_weights(local_source.update_info())
    assert engine.weight_version == 0 and not engine.is_paused()
    assert all(torch.equal(t, before[n]) for n, t in engine.model.named_weights())
    # The prefix cache stands too: the weights it was computed with are still the weights.
    assert engine.generate([prompt], greedy(4))[0].num_cached_tokens > 0


def test_update_entry_points_check_their_arguments():
    engine = make_engine()
    with pytest.raises(EngineStateError, match="call init_weight_transfer_engine"):
        engine.update_weights({"update_info": {"names": [], "dtype_names": [], "shapes": []}})
    with pytest.raises(InvalidRequestError, match=r"expects \{'update_info'"):
        engine.update_weights({"names": []})
    with pytest.raises(InvalidRequestError, match=r"expects \{'init_info'"):
        engine.init_weight_transfer_engine({"backend": "gloo"})
