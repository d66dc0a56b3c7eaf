"""Stop strings never make a stream run ahead of the answer: every output's text is a prefix of
the final text, so a stream's deltas join into exactly the non-streamed answer."""

from __future__ import annotations

import pytest
from engine_helpers import PROMPTS, greedy, small_config

from weightsync.engine.llm_engine import LLMEngine

pytestmark = pytest.mark.reliability("output")


def run_outputs(engine: LLMEngine, prompt: str, **params) -> list[str]:
    """The text of every output a request gives, step by step, as a stream delivers them."""
    engine.add_request("watched", prompt, greedy(24, **params))
    texts = []
    while engine.has_unfinished_requests():
        texts += [out.outputs[0].text for out in engine.step() if out.request_id == "watched"]
    return texts


@pytest.mark.parametrize("completes", [True, False], ids=["stop-completes", "stop-never-completes"])
def test_a_stop_strings_first_characters_are_held_until_it_is_decided(debug_model, completes):
    """A multi-character stop string: no output shows characters the final answer leaves out."""
    engine = LLMEngine(debug_model, engine_config=small_config())
    free = engine.generate(PROMPTS[1], greedy(24))[0].outputs[0].text
    # Characters 6 to 8 arrive one step apart (one byte each): the stop's first two come a step
    # before its last. A stop that never completes begins the same way.
    stop = free[6:9] if completes else free[6:8] + "\x00\x01"
    assert len(stop.encode()) == len(stop)
    texts = run_outputs(engine, PROMPTS[1], stop=[stop])
    final = texts[-1]
    assert final == (free[: free.index(stop)] if completes else free)
    for text in texts:
        assert final.startswith(text), (text, final)
    assert len(set(texts)) > 3  # text was streamed along the way, not only at the end
