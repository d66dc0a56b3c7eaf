import asyncio
import threading

import pytest
from engine_helpers import PROMPTS, greedy, make_async_engine, reference_greedy, start_streams

from weightsync.engine.errors import EngineStateError, InvalidRequestError


def test_streams_grow_token_by_token_and_match_the_reference():
    async def main():
        async with make_async_engine() as engine:
            outputs = [
                out async for out in engine.generate(PROMPTS[0], greedy(8), request_id="one")
            ]
            # Each item is cumulative; one the stream had not read yet when the next step's came
            # is replaced by it (the engine steps on without waiting for the reader).
            lengths = [len(o.outputs[0].token_ids) for o in outputs]
            assert lengths == sorted(set(lengths)) and lengths[-1] == 8
            final = outputs[-1].outputs[0].token_ids
            assert all(
                o.outputs[0].token_ids == final[: len(o.outputs[0].token_ids)] for o in outputs
            )
            assert outputs[-1].finished and outputs[-1].request_id == "one"
            ids = engine.engine.tokenizer.encode(PROMPTS[0])
            assert outputs[-1].outputs[0].token_ids == reference_greedy(engine.engine.model, ids, 8)

    asyncio.run(main())


def test_the_event_loop_stays_responsive_while_steps_run():
    async def main():
        async with make_async_engine() as engine:
            # The first forward pass holds until the event loop answers a control call: were it
            # run on the loop's thread, the call could never be answered.
            in_forward, answered = threading.Event(), threading.Event()
            execute = engine.engine.runner.execute

            def held(batch):
                in_forward.set()
                assert answered.wait(timeout=30), "the event loop was blocked by a forward pass"
                return execute(batch)

            engine.engine.runner.execute = held
            stream = start_streams(engine, 1, 4)[0]
            assert await asyncio.to_thread(in_forward.wait, 30)
            assert await engine.is_paused() is False and not stream.outputs
            answered.set()
            assert len((await stream.final()).outputs[0].token_ids) == 4

    asyncio.run(main())


def test_the_engine_steps_on_while_the_event_loop_is_busy():
    async def main():
        async with make_async_engine() as engine:
            all_stepped = threading.Event()
            step = engine.engine.step

            def counted():
                outputs = step()
                if engine.engine.num_steps >= 8:
                    all_stepped.set()
                return outputs

            engine.engine.step = counted
            stream = engine.generate(PROMPTS[0], greedy(8), request_id="busy")
            first = await anext(stream)
            # The event loop is held on a blocking wait from here: no task or callback runs on
            # it, so no step may wait for it to take the outputs of the one before.
            assert all_stepped.wait(timeout=30), "the steps waited for the event loop"
            outputs = [first] + [out async for out in stream]
            assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 8
            ids = engine.engine.tokenizer.encode(PROMPTS[0])
            assert outputs[-1].outputs[0].token_ids == reference_greedy(engine.engine.model, ids, 8)

    asyncio.run(main())


def test_a_control_call_cancelled_before_its_step_boundary_leaves_the_engine_stepping():
    async def main():
        async with make_async_engine() as engine:
            in_forward, release = threading.Event(), threading.Event()
            execute = engine.engine.runner.execute

            def held(batch):
                in_forward.set()
                assert release.wait(timeout=30), "the test never released the forward pass"
                return execute(batch)

            engine.engine.runner.execute = held
            stream = start_streams(engine, 1, 4)[0]
            assert await asyncio.to_thread(in_forward.wait, 30)
            pause = asyncio.create_task(engine.pause_generation(mode="keep"))
            await asyncio.sleep(0)  # the pause call runs up to its wait for the step boundary
            assert not pause.done()
            pause.cancel()
            with pytest.raises(asyncio.CancelledError):
                await pause
            engine.engine.runner.execute = execute
            release.set()
            assert len((await stream.final()).outputs[0].token_ids) == 4
            assert await engine.is_paused() is False

    asyncio.run(main())


def test_leaving_a_stream_early_aborts_its_request():
    async def main():
        async with make_async_engine() as engine:
            async for output in engine.generate("leave early", greedy(100), request_id="early"):
                if len(output.outputs[0].token_ids) == 2:
                    break
            await engine.pause_generation(mode="keep")  # lets the loop process the abort
            assert engine.engine.scheduler.num_unfinished == 0
            assert not engine.engine.has_unfinished_requests()

    asyncio.run(main())


def test_abort_ends_one_stream():
    async def main():
        async with make_async_engine() as engine:
            stream = start_streams(engine, 1, 100)[0]
            await stream.wait_tokens(2)
            await engine.abort(stream.request_id)
            final = await stream.final()
            assert (
                final.outputs[0].finish_reason == "abort" and len(final.outputs[0].token_ids) < 100
            )

    asyncio.run(main())


def test_bad_requests_fail_in_the_caller_and_the_engine_keeps_serving():
    async def main():
        async with make_async_engine() as engine:
            with pytest.raises(InvalidRequestError, match="prompt is empty"):
                async for _ in engine.generate([], greedy(2)):
                    pass
            stream = start_streams(engine, 1, 50)[0]
            await stream.wait_tokens(1)
            with pytest.raises(InvalidRequestError, match="already streaming"):
                async for _ in engine.generate("dup", greedy(2), request_id=stream.request_id):
                    pass
            assert len((await stream.final()).outputs[0].token_ids) == 50

    asyncio.run(main())


def test_a_failing_step_fails_every_stream_and_later_calls(monkeypatch):
    async def main():
        engine = make_async_engine()
        streams = start_streams(engine, 3, 50)
        await asyncio.gather(*(s.wait_tokens(1) for s in streams))

        def broken():
            raise RuntimeError("kernel exploded")

        # The scheduler, not a request: a failing request ends alone (test_failures.py), a
        # failing engine ends every stream.
        monkeypatch.setattr(engine.engine.scheduler, "schedule", broken)
        for stream in streams:
            with pytest.raises(EngineStateError, match="kernel exploded"):
                await stream.task
        with pytest.raises(EngineStateError, match="the engine loop died"):
            async for _ in engine.generate("after", greedy(2)):
                pass
        await engine.shutdown()
        with pytest.raises(EngineStateError, match="shut down"):
            await engine.pause_generation()

    asyncio.run(main())


def test_shutdown_ends_open_streams():
    async def main():
        engine = make_async_engine()
        stream = start_streams(engine, 1, 500)[0]
        await stream.wait_tokens(1)
        await engine.shutdown()
        await engine.shutdown()
        with pytest.raises(EngineStateError, match="shut down"):
            await stream.task

    asyncio.run(main())


def test_shutdown_during_a_wait_pause_ends_the_pause_call():
    async def main():
        engine = make_async_engine()
        stream = start_streams(engine, 1, 500)[0]
        await stream.wait_tokens(1)
        pause = asyncio.create_task(engine.pause_generation(mode="wait"))
        await engine.shutdown()
        with pytest.raises(EngineStateError, match="shut down"):
            await asyncio.wait_for(pause, timeout=60)  # a bound, not a timing: it must end
        with pytest.raises(EngineStateError, match="shut down"):
            await stream.task

    asyncio.run(main())
