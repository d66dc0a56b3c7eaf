"""The live weights own the update transaction and what guards it: whoever calls them directly.

`engine.weights` is the one object that decides who may update, who may generate and what pause
follows an update; a caller that reaches it without going through `LLMEngine` meets the same rules.
"""

import pytest
from engine_helpers import greedy, make_engine

from weightsync.engine.pause import PauseState
from weightsync.errors import EngineBusyError, TornWeightsError, WeightUpdateStateError


def busy_engine():
    engine = make_engine()
    engine.add_request("r", "a prompt", greedy(8))
    engine.step()  # the request runs: the engine is busy and not paused
    return engine


def test_the_weights_refuse_a_transaction_on_a_busy_unpaused_engine():
    engine = busy_engine()
    with pytest.raises(EngineBusyError, match=r"call pause_generation\(mode="):
        engine.weights.start()
    assert not engine.weights.in_update
    assert engine.scheduler.state is PauseState.UNPAUSED


def test_a_transaction_opened_on_the_weights_holds_the_scheduler_and_gives_it_back():
    engine = make_engine()  # idle: an update is accepted without a pause
    engine.weights.start()
    assert engine.scheduler.state is PauseState.PAUSED  # no step runs while it is open
    with pytest.raises(WeightUpdateStateError, match="weight update is in progress"):
        engine.weights.check_can_generate("generate()")
    assert engine.weights.finish("v1") is True
    assert engine.scheduler.state is PauseState.UNPAUSED  # the update's pause ended with it
    assert engine.generate(["hi"], greedy(2))[0].outputs[0].weight_versions == ["v1", "v1"]


def test_torn_weights_keep_the_engine_they_guard_from_generating():
    engine = make_engine()
    engine.weights.start()
    engine.weights.torn_names = {"lm_head.weight"}  # as a failed update leaves them
    engine.weights.abort()
    assert engine.scheduler.state is PauseState.PAUSED
    with pytest.raises(TornWeightsError, match="failed weight update left 1 weights torn"):
        engine.resume_generation()
