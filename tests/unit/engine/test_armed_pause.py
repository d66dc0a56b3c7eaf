import pytest

from weightsync import EngineConfig, InvalidRequestError, LLMEngine, SamplingParams


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
    engine.arm_pause(5, mode="keep", on_pause=lambda: fired.append(engine.num_steps))
    engine.resume_generation()
    outputs = run_until_paused(engine)
    assert fired == [engine.num_steps]
    assert engine.armed_pause is None
    # The short request finished; the others stopped exactly at their fifth token.
    assert outputs["r0"].finished and len(outputs["r0"].outputs[0].token_ids) == 3
    assert [len(outputs[r].outputs[0].token_ids) for r in ("r1", "r2")] == [5, 5]


def test_an_armed_pause_waits_while_paused_and_pause_generation_consumes_it():
    engine = make_engine()
    engine.pause_generation(mode="keep")
    engine.arm_pause(0)
    assert engine.step() == [] and engine.armed_pause is not None  # paused: not checked
    engine.pause_generation(mode="keep")
    assert engine.armed_pause is None


@pytest.mark.parametrize(("after_tokens", "mode"), [(-1, "keep"), (1, "later")])
def test_a_bad_armed_pause_is_refused(after_tokens, mode):
    with pytest.raises(InvalidRequestError):
        make_engine().arm_pause(after_tokens, mode=mode)
