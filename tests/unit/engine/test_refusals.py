"""A refused control call has no side effects: requests, the pause and the update stay as they were.

Every call an engine can refuse (sleep, wake up, pause in each mode, resume, the update calls,
the transfer engine's init and shutdown, relabel, reset) is made in every state where it is
refused. Each refusal must leave the requests in flight (and their tokens), the pause state, an
armed pause, the update in progress, the version and the sleep as they were; afterwards the
requests still complete with all their tokens, and an update that paused a running engine still
resumes it when it ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from engine_helpers import debug_model, greedy, make_async_engine, make_engine

from weightsync.engine.llm_engine import LLMEngine
from weightsync.errors import (
    EngineBusyError,
    EngineStateError,
    InvalidRequestError,
    TornWeightsError,
    WeightTransferError,
    WeightUpdateStateError,
    WeightValidationError,
)

IDS = ["a", "b"]
MAX_TOKENS = 12
STATES = ("running", "paused", "updating", "asleep", "torn")


@pytest.fixture(scope="module")
def policy():
    return dict(debug_model(seed=4).named_weights())


def build(state: str, local_source, policy) -> LLMEngine:
    """An engine in `state`, with the requests of `IDS` in flight (queued, running or frozen)."""
    engine = make_engine()
    engine.init_weight_transfer_engine(local_source.init_request)
    local_source.tensors = policy
    if state == "updating":  # opened on an idle, running engine: it pauses for the update
        engine.start_weight_update()
    for request_id in IDS:
        engine.add_request(request_id, f"prompt {request_id}", greedy(MAX_TOKENS))
    if state == "updating":
        return engine  # the requests wait in the queue for the update's end
    engine.step()
    engine.step()
    if state == "paused":
        engine.pause_generation(mode="keep")
    elif state == "asleep":
        engine.sleep(1, mode="keep")
    elif state == "torn":
        engine.pause_generation(mode="keep")
        local_source.fail_after = 2
        with pytest.raises(WeightTransferError):
            engine.update_weights(local_source.update_info())
        local_source.fail_after = None
        assert engine.weights.is_torn
    return engine


def snapshot(engine: LLMEngine) -> dict[str, Any]:
    """What a refusal must not change."""
    scheduler = engine.scheduler
    return {
        "unfinished": engine.unfinished(IDS),
        "tokens": {
            s.request_id: s.num_output_tokens for s in [*scheduler.running, *scheduler.waiting]
        },
        "pause": engine.pause_state,
        "armed": engine.armed_pause,
        "update": engine.weight_update,
        "version": engine.weight_version,
        "sleeping": engine.is_sleeping(),
        "torn": sorted(engine.weights.torn_names),
    }


def finish_requests(engine: LLMEngine, local_source, state: str) -> dict[str, Any]:
    """Ends the state as a trainer would; returns each request's final output."""
    if state == "asleep":
        engine.wake_up()
    if state == "updating":
        engine.finish_weight_update()
        # The update paused a running engine: its end resumes it (no caller paused it).
        assert not engine.is_paused()
    if state == "torn":
        engine.update_weights(local_source.update_info())  # covers every torn weight
    engine.resume_generation()
    finals = {}
    for _ in range(10 * MAX_TOKENS):
        finals.update({o.request_id: o for o in engine.step() if o.finished})
        if len(finals) == len(IDS):
            break
    return finals


Call = Callable[[LLMEngine, Any], object]
# (what, the call, the states where it is refused, the error)
REFUSED: list[tuple[str, Call, tuple[str, ...], type[Exception]]] = [
    ("sleep at level 7", lambda e, s: e.sleep(7), STATES, InvalidRequestError),
    ("sleep in a bogus mode", lambda e, s: e.sleep(1, mode="bogus"), STATES, InvalidRequestError),
    ("sleep (abort)", lambda e, s: e.sleep(1), ("updating",), WeightUpdateStateError),
    ("sleep (keep)", lambda e, s: e.sleep(0, mode="keep"), ("updating",), WeightUpdateStateError),
    ("sleep (wait)", lambda e, s: e.sleep(2, mode="wait"), ("updating",), WeightUpdateStateError),
    (
        "wake up a bogus tag",
        lambda e, s: e.wake_up(["weights", "bogus"]),
        STATES,
        InvalidRequestError,
    ),
    (
        "pause in a bogus mode",
        lambda e, s: e.pause_generation(mode="bogus"),
        STATES,
        InvalidRequestError,
    ),
    (
        "pause after -1 tokens",
        lambda e, s: e.pause_generation(mode="keep", after_tokens=-1),
        STATES,
        InvalidRequestError,
    ),
    ("resume", lambda e, s: e.resume_generation(), ("updating",), WeightUpdateStateError),
    ("resume", lambda e, s: e.resume_generation(), ("asleep",), EngineStateError),
    ("resume", lambda e, s: e.resume_generation(), ("torn",), TornWeightsError),
    ("start", lambda e, s: e.start_weight_update(), ("running",), EngineBusyError),
    ("start", lambda e, s: e.start_weight_update(), ("updating",), WeightUpdateStateError),
    ("start", lambda e, s: e.start_weight_update(), ("asleep",), EngineStateError),
    ("update", lambda e, s: e.update_weights(s.update_info()), ("running",), EngineBusyError),
    ("update", lambda e, s: e.update_weights(s.update_info()), ("asleep",), EngineStateError),
    (
        "finish",
        lambda e, s: e.finish_weight_update(),
        ("running", "paused", "asleep", "torn"),
        WeightUpdateStateError,
    ),
    (
        "finish with a bad label",
        lambda e, s: e.finish_weight_update(["v"]),
        STATES,
        WeightValidationError,
    ),
    (
        "init",
        lambda e, s: e.init_weight_transfer_engine(s.init_request),
        ("updating",),
        WeightUpdateStateError,
    ),
    (
        "shut the transfer engine down",
        lambda e, s: e.shutdown_weight_transfer_engine(),
        ("updating",),
        WeightUpdateStateError,
    ),
    ("relabel", lambda e, s: e.update_weight_version("v9"), ("updating",), WeightUpdateStateError),
    ("reset the weights", lambda e, s: e.reset_weights(), ("running",), EngineBusyError),
    ("reset the weights", lambda e, s: e.reset_weights(), ("updating",), WeightUpdateStateError),
    ("reset the weights", lambda e, s: e.reset_weights(), ("asleep",), EngineStateError),
]
CASES = [
    pytest.param(state, call, error, id=f"{what}-{state}")
    for what, call, states, error in REFUSED
    for state in states
]


@pytest.mark.parametrize(("state", "call", "error"), CASES)
def test_a_refused_call_changes_nothing_and_the_requests_complete(
    state, call, error, local_source, policy
):
    engine = build(state, local_source, policy)
    before = snapshot(engine)
    with pytest.raises(error):
        call(engine, local_source)
    assert snapshot(engine) == before
    finals = finish_requests(engine, local_source, state)
    assert sorted(finals) == IDS
    for output in finals.values():
        assert output.outputs[0].finish_reason == "length"
        assert len(output.outputs[0].token_ids) == MAX_TOKENS


@pytest.mark.parametrize("state", STATES)
def test_reset_prefix_cache_is_never_refused_and_leaves_requests_and_pause(
    state, local_source, policy
):
    engine = build(state, local_source, policy)
    before = snapshot(engine)
    assert engine.reset_prefix_cache() is True
    assert snapshot(engine) == before
    finals = finish_requests(engine, local_source, state)
    assert [len(finals[i].outputs[0].token_ids) for i in IDS] == [MAX_TOKENS] * len(IDS)


def test_a_refused_pause_keeps_the_armed_pause():
    engine = make_engine()
    engine.arm_pause(3, mode="keep")
    armed = engine.armed_pause
    with pytest.raises(InvalidRequestError, match="pause mode"):
        engine.pause_generation(mode="bogus")
    assert engine.armed_pause is armed and not engine.is_paused()


@pytest.mark.parametrize(
    ("level", "mode", "error"),
    [
        (1, "abort", WeightUpdateStateError),
        (0, "keep", WeightUpdateStateError),
        (7, "abort", InvalidRequestError),
        (1, "bogus", InvalidRequestError),
    ],
)
def test_an_async_sleep_refused_during_an_update_aborts_nothing(local_source, level, mode, error):
    """`/sleep` during an update used to abort the queued requests, then leave the engine paused."""

    async def main() -> None:
        async with make_async_engine() as engine:
            await engine.start_weight_update()  # an idle, running engine: paused for the update
            streams = [asyncio.create_task(_final(engine, f"queued {i}")) for i in range(len(IDS))]
            await engine.wait_until_idle()  # the loop took the requests in, and runs nothing
            assert engine.num_unfinished_requests() == len(IDS)
            with pytest.raises(error):
                await engine.sleep(level, mode=mode)
            assert engine.num_unfinished_requests() == len(IDS)
            assert engine.weight_update is not None and not await engine.is_sleeping()
            await engine.finish_weight_update()
            assert not await engine.is_paused()  # it was running: the update's end resumes it
            finals = await asyncio.wait_for(asyncio.gather(*streams), 60)
            assert [f.outputs[0].finish_reason for f in finals] == ["length"] * len(IDS)
            assert all(len(f.outputs[0].token_ids) == MAX_TOKENS for f in finals)

    asyncio.run(main())


async def _final(engine, prompt: str):
    final = None
    async for output in engine.generate(prompt, greedy(MAX_TOKENS)):
        final = output
    return final
