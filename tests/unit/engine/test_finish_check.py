"""`LiveWeights.check_finish` refuses exactly what `finish` refuses, and changes nothing.

A data-parallel front asks every replica's check before any of them finishes: a check that
disagreed with the finish would commit some replicas and not others.
"""

import pytest

from weightsync import LlamaForCausalLM
from weightsync.engine.weights import LiveWeights, _Transaction

CASES = {
    "no transaction": None,
    "parts missing": _Transaction(explicit=True, announced={"a", "b"}, landed={"a"}),
    "a message refused": _Transaction(explicit=True, refused="unknown name 'x'"),
    "torn elsewhere": _Transaction(explicit=True, announced={"a"}, landed={"a"}),
    "whole": _Transaction(explicit=True, announced={"a"}, landed={"a"}),
    "non-finite": _Transaction(
        explicit=True, announced={"lm_head.weight"}, landed={"lm_head.weight"}
    ),
}


def _weights(case: str) -> LiveWeights:
    live = LiveWeights(LlamaForCausalLM.from_preset("debug"))
    txn = CASES[case]
    if txn is not None:
        live._transaction = _Transaction(
            explicit=True, announced=set(txn.announced), landed=set(txn.landed),
            refused=txn.refused,
        )  # fmt: skip
    live.torn_names = {"b"} if case == "torn elsewhere" else set()
    if case == "non-finite":
        live.refuse_non_finite = True
        dict(live.model.named_weights())["lm_head.weight"].view(-1)[0] = float("nan")
    return live


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("version", ["v1", "x" * 257])
def test_the_check_refuses_exactly_what_finish_refuses_and_changes_nothing(case, version):
    checked, finished = _weights(case), _weights(case)
    try:
        finished.finish(version)
        expected = None
    except Exception as exc:
        expected = type(exc)
    if expected is None:
        checked.check_finish(version)
    else:
        with pytest.raises(expected):
            checked.check_finish(version)
    assert checked.weight_version == 0
    assert checked.in_update == (CASES[case] is not None)
    assert checked.torn_names == _weights(case).torn_names
