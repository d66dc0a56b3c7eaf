import asyncio
import time

import pytest
from engine_helpers import make_async_engine, start_draining, start_streams

from weightsync import EngineConfig, InvalidRequestError, LLMEngine, SamplingParams
from weightsync.engine._armed_pause import ArmedPause


def make_engine():
    return LLMEngine("debug", engine_config=EngineConfig(num_kv_blocks=64))


def run_until_paused(engine):
    outputs = {}
    while not engine.is_paused():
        for output in engine.step():
            outputs[output.request_id] = output
    return outputs


def test_an_armed_pause_lands_when_every_request_has_its_tokens():
    engine = make_engine()
    fired = []
    engine.pause_generation(mode="keep")  # queue while paused, arm, then run
    for i, max_tokens in enumerate([3, 20, 20]):
        engine.add_request(f"r{i}", "ab", SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    engine.scheduler.armed_pause = ArmedPause(5, on_pause=lambda: fired.append(engine.num_steps))
    engine.resume_generation()
    outputs = run_until_paused(engine)
    assert fired == [engine.num_steps]
    assert engine.scheduler.armed_pause is None
    # The short request finished; the others stopped exactly at their fifth token.
    assert outputs["r0"].finished and len(outputs["r0"].outputs[0].token_ids) == 3
    assert [len(outputs[r].outputs[0].token_ids) for r in ("r1", "r2")] == [5, 5]


def test_an_armed_pause_waits_while_paused_and_lands_at_once_on_an_idle_engine():
    engine = make_engine()
    engine.pause_generation(mode="keep")
    engine.scheduler.armed_pause = ArmedPause(0)
    assert not engine.has_work() and engine.step() == []  # paused: not checked
    assert engine.scheduler.armed_pause is not None
    engine.resume_generation()
    assert engine.has_work()  # nothing runs, so every request has its tokens: it is due
    engine.step()
    assert engine.is_paused() and engine.scheduler.armed_pause is None


@pytest.mark.parametrize(("after_tokens", "mode"), [(-1, "keep"), (1, "later")])
def test_a_bad_armed_pause_is_refused(after_tokens, mode):
    with pytest.raises(InvalidRequestError):
        ArmedPause(after_tokens, mode=mode)


def test_arming_again_tells_whoever_waits_for_the_replaced_pause():
    engine = make_engine()
    fired = []
    engine.arm_pause(5, on_pause=lambda: fired.append("first"))
    engine.arm_pause(0, mode="abort", on_pause=lambda: fired.append("second"))
    assert fired == ["first"]  # replaced: it will never land
    assert engine.armed_pause.mode == "abort"


def test_a_pause_waiting_for_an_armed_pause_lands_with_the_one_armed_after_it():
    async def main():
        async with make_async_engine() as engine:
            streams = start_streams(engine, 2, 200)
            await asyncio.gather(*(s.wait_tokens(1) for s in streams))
            await engine.arm_pause(190, mode="keep")
            pause = asyncio.create_task(engine.pause_generation(mode="keep"))
            await asyncio.sleep(0)  # the task runs up to its wait for the armed pause
            assert not pause.done()
            await engine.arm_pause(0, mode="abort")  # lands at the next step
            # Holding the event loop, so that the waiting pause wakes only after it landed.
            deadline = time.monotonic() + 30
            while not engine.engine.is_paused() and time.monotonic() < deadline:
                time.sleep(0.001)
            assert await asyncio.wait_for(pause, timeout=60) == "abort"
            assert await engine.is_paused()
            finals = [await s.final() for s in streams]
            assert {f.outputs[0].finish_reason for f in finals} == {"abort"}

    asyncio.run(main())


def test_a_pause_of_a_paused_engine_leaves_the_armed_pause_and_its_mode_alone():
    """Queue while paused, arm, then resume: a plain pause in between neither takes the armed
    pause's mode (an armed abort would end the queued requests) nor uses it up."""

    async def main():
        async with make_async_engine() as engine:
            await engine.pause_generation(mode="keep")
            streams = start_streams(engine, 2, 40)
            await engine.arm_pause(5, mode="abort")
            assert await asyncio.wait_for(engine.pause_generation(mode="keep"), 30) == "keep"
            assert engine.engine.scheduler.num_unfinished == 2  # queued, not aborted
            assert (
                engine.engine.armed_pause is not None and engine.engine.armed_pause.mode == "abort"
            )
            await engine.resume_generation()
            finals = [await asyncio.wait_for(s.final(), 60) for s in streams]
            assert [f.outputs[0].finish_reason for f in finals] == ["abort"] * 2
            assert [len(f.outputs[0].token_ids) for f in finals] == [5, 5]  # where it was armed

    asyncio.run(main())


def test_a_pause_during_a_drain_does_not_wait_for_a_pause_armed_then():
    """An armed pause lands only while generation runs: a `keep` pause that comes while a
    `wait` pause drains freezes the drain at once instead of waiting for it, and leaves the
    armed pause for after the resume."""

    async def main():
        async with make_async_engine() as engine:
            streams = start_streams(engine, 2, 200)
            await asyncio.gather(*(s.wait_tokens(1) for s in streams))
            draining = await start_draining(engine)
            await engine.arm_pause(0, mode="keep")
            assert await asyncio.wait_for(engine.pause_generation(mode="keep"), 30) == "keep"
            assert await engine.is_paused()
            await asyncio.wait_for(draining, 30)
            assert engine.engine.scheduler.num_unfinished == 2  # frozen mid-drain, kept
            assert engine.engine.armed_pause is not None  # still armed: it lands after resume
            await engine.resume_generation()
            assert await asyncio.wait_for(engine.pause_generation(mode="abort"), 30) == "keep"
            assert engine.engine.scheduler.num_unfinished == 2  # its mode, not the caller's

    asyncio.run(main())
