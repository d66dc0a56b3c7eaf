"""Each pause mode on an AsyncEngine with many requests in flight."""

import asyncio

import pytest
from engine_helpers import (
    catch_up,
    greedy,
    make_async_engine,
    make_engine,
    reference_greedy,
    start_draining,
    start_streams,
)

from weightsync.errors import EngineStateError
from weightsync.serve import ServerConfig
from weightsync.serve._view import EngineView

N = 16
MAX_TOKENS = 24


def expected_tokens(engine, stream, max_tokens=MAX_TOKENS):
    return reference_greedy(
        engine.engine.model, engine.engine.tokenizer.encode(stream.prompt), max_tokens
    )


def test_abort_ends_every_request_with_its_partial_output():
    async def main():
        async with make_async_engine() as engine:
            streams = start_streams(engine, N, MAX_TOKENS)
            await asyncio.gather(*(s.wait_tokens(3) for s in streams))
            await engine.pause_generation(mode="abort")
            assert await engine.is_paused()
            for stream in streams:
                final = await stream.final()
                stream.check_consistent()
                assert final.outputs[0].finish_reason == "abort"
                tokens = final.outputs[0].token_ids
                assert 3 <= len(tokens) < MAX_TOKENS
                assert tokens == expected_tokens(engine, stream)[: len(tokens)]
            assert engine.engine.scheduler.num_unfinished == 0
            await engine.resume_generation()
            again = start_streams(engine, 2, 4)
            assert [(await s.final()).outputs[0].finish_reason for s in again] == ["length"] * 2

    asyncio.run(main())


def test_wait_lets_running_requests_finish_and_queues_new_ones():
    async def main():
        async with make_async_engine() as engine:
            streams = start_streams(engine, N, MAX_TOKENS)
            await asyncio.gather(*(s.wait_tokens(1) for s in streams))
            await engine.pause_generation(mode="wait")
            assert await engine.is_paused() and engine.engine.scheduler.num_unfinished == 0
            steps = engine.num_steps
            for stream in streams:
                # The final output is handed to the stream before the pause returns; its consumer
                # takes it when it next runs: wait for that, then read what it received.
                final = await stream.final()
                stream.check_consistent()
                assert final.outputs[0].finish_reason == "length"
                assert final.outputs[0].token_ids == expected_tokens(engine, stream)
            assert engine.num_steps == steps  # the finals came from steps run before the pause
            late = start_streams(engine, 2, 4)
            await engine.wait_until_idle()  # the loop saw the late requests and runs nothing
            assert engine.num_steps == steps and not any(s.outputs for s in late)
            await engine.resume_generation()
            assert [len((await s.final()).outputs[0].token_ids) for s in late] == [4, 4]

    asyncio.run(main())


@pytest.mark.parametrize("clear_cache", [True, False])
def test_keep_freezes_requests_and_continues_them_after_resume(clear_cache):
    async def main():
        async with make_async_engine() as engine:
            streams = start_streams(engine, N, MAX_TOKENS)
            await asyncio.gather(*(s.wait_tokens(4) for s in streams))
            await engine.pause_generation(mode="keep", clear_cache=clear_cache)
            frozen = await catch_up(engine, streams)
            assert all(0 < n < MAX_TOKENS for n in frozen)
            if clear_cache:
                assert (
                    engine.engine.block_manager.num_free_blocks
                    == engine.engine.config.num_kv_blocks
                )
            late = start_streams(engine, 2, 4)  # queued while paused
            steps = engine.num_steps
            await engine.wait_until_idle()  # the loop saw the late requests and runs nothing
            assert engine.num_steps == steps
            assert [len(s.token_ids) for s in streams] == frozen and not any(
                s.outputs for s in late
            )
            await engine.resume_generation()
            for stream in [*streams, *late]:
                final = await stream.final()
                stream.check_consistent()
                assert final.outputs[0].finish_reason == "length"
            for stream in streams:
                assert stream.token_ids == expected_tokens(engine, stream)
            for stream in late:
                assert stream.token_ids == expected_tokens(engine, stream, 4)

    asyncio.run(main())


def test_keep_returns_within_one_step_and_double_pause_and_resume_are_harmless():
    async def main():
        async with make_async_engine() as engine:
            await engine.resume_generation()  # not paused: harmless
            streams = start_streams(engine, N, MAX_TOKENS)
            await asyncio.gather(*(s.wait_tokens(2) for s in streams))
            before = engine.num_steps
            await engine.pause_generation(mode="keep")
            assert engine.num_steps - before <= 1
            await engine.pause_generation(mode="keep")
            await engine.pause_generation(mode="wait")  # already paused: returns at once
            assert engine.num_steps - before <= 1 and await engine.is_paused()
            await engine.resume_generation()
            await engine.resume_generation()
            for stream in streams:
                assert len((await stream.final()).outputs[0].token_ids) == MAX_TOKENS

    asyncio.run(main())


def test_abort_after_keep_aborts_the_frozen_requests():
    async def main():
        async with make_async_engine() as engine:
            streams = start_streams(engine, N, MAX_TOKENS)
            await asyncio.gather(*(s.wait_tokens(2) for s in streams))
            await engine.pause_generation(mode="keep")
            await engine.pause_generation(mode="abort")
            finals = [await s.final() for s in streams]
            assert {f.outputs[0].finish_reason for f in finals} == {"abort"}

    asyncio.run(main())


def test_resume_cancels_a_draining_wait_pause():
    async def main():
        async with make_async_engine() as engine:
            streams = start_streams(engine, 4, MAX_TOKENS)
            await asyncio.gather(*(s.wait_tokens(1) for s in streams))
            pause = await start_draining(engine)
            await engine.resume_generation()
            await pause
            assert not await engine.is_paused()
            assert [len((await s.final()).outputs[0].token_ids) for s in streams] == [
                MAX_TOKENS
            ] * 4

    asyncio.run(main())


def test_the_pause_route_refuses_a_wait_pause_that_a_resume_called_off():
    async def main():
        async with make_async_engine() as engine:
            view = EngineView(engine, ServerConfig(model_name="debug"))
            streams = start_streams(engine, 2, 200)
            await asyncio.gather(*(s.wait_tokens(1) for s in streams))
            pause = await start_draining(engine, view.pause("wait", True, None))
            await engine.resume_generation()
            with pytest.raises(EngineStateError, match="generation is running"):
                await asyncio.wait_for(pause, timeout=60)  # not {"status": "paused"}
            assert view.last_pause is None and not await engine.is_paused()
            assert await view.pause("keep", True, None) == {"status": "paused"}
            assert view.last_pause is not None and view.last_pause.mode == "keep"

    asyncio.run(main())


def test_aborting_the_last_running_request_completes_a_wait_pause():
    async def main():
        async with make_async_engine() as engine:
            streams = start_streams(engine, 2, 200)
            await asyncio.gather(*(s.wait_tokens(1) for s in streams))
            pause = await start_draining(engine)
            for stream in streams:
                await engine.abort(stream.request_id)
            await pause
            assert await engine.is_paused()
            assert [(await s.final()).outputs[0].finish_reason for s in streams] == ["abort"] * 2

    asyncio.run(main())


def test_sync_engine_pause_modes():
    engine = make_engine()
    for i in range(N):
        engine.add_request(f"r{i}", f"prompt {i}", greedy(12))
    for _ in range(3):
        engine.step()
    engine.pause_generation(mode="wait")
    assert engine.is_paused()
    finals = [o for o in engine.step() if o.finished]
    assert len(finals) == N and {f.outputs[0].finish_reason for f in finals} == {"length"}
    engine.resume_generation()
    for i in range(N):
        engine.add_request(f"s{i}", f"prompt {i}", greedy(12))
    engine.step()
    engine.pause_generation(mode="abort")
    aborted = engine.step()
    assert len(aborted) == N and {o.outputs[0].finish_reason for o in aborted} == {"abort"}
    assert all(len(o.outputs[0].token_ids) == 1 for o in aborted)
    assert not engine.has_unfinished_requests()
