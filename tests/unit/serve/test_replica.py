"""The replica side of a data-parallel server: the finish check agrees with the finish itself."""

import pytest

from weightsync import LlamaForCausalLM
from weightsync.engine._transaction import Transaction as _Transaction
from weightsync.engine.weights import LiveWeights
from weightsync.serve._fleet import replica_argv, replica_device
from weightsync.serve._replica import check_finish
from weightsync.serve.cli import parse_serve_args

CASES = {
    "no transaction": None,
    "parts missing": _Transaction(explicit=True, announced={"a", "b"}, landed={"a"}),
    "torn elsewhere": _Transaction(explicit=True, announced={"a"}, landed={"a"}),
    "whole": _Transaction(explicit=True, announced={"a"}, landed={"a"}),
    "non-finite": _Transaction(
        explicit=True, announced={"lm_head.weight"}, landed={"lm_head.weight"}
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_the_check_refuses_exactly_what_finish_refuses_and_changes_nothing(case):
    def weights() -> LiveWeights:
        live = LiveWeights(LlamaForCausalLM.from_preset("debug"))
        txn = CASES[case]
        live.transaction = (
            None
            if txn is None
            else _Transaction(explicit=True, announced=set(txn.announced), landed=set(txn.landed))
        )
        live.torn_names = {"b"} if case == "torn elsewhere" else set()
        if case == "non-finite":
            live.refuse_non_finite = True
            dict(live.model.named_weights())["lm_head.weight"].view(-1)[0] = float("nan")
        return live

    checked, finished = weights(), weights()
    try:
        finished.finish("v1")
        expected = None
    except Exception as exc:
        expected = type(exc)
    if expected is None:
        check_finish(checked, "v1")
    else:
        with pytest.raises(expected):
            check_finish(checked, "v1")
    assert checked.weight_version == 0
    assert (checked.transaction is None) == (CASES[case] is None)


def test_a_replica_takes_the_fronts_options_but_its_own_address_keys_and_index():
    args, transfer = parse_serve_args(["serve", "tiny", "--data-parallel-size", "2",
                                       "--admin-api-key", "secret", "--port", "9000",
                                       "--no-prefix-caching", "--weight-transfer-config.backend",
                                       "gloo"])  # fmt: skip
    argv = replica_argv(args, transfer)
    assert argv[0] == "tiny"
    assert "--no-prefix-caching" in argv
    assert argv[argv.index("--weight-transfer-config") + 1] == '{"backend": "gloo"}'
    for own in ("--admin-api-key", "secret", "--port", "--data-parallel-size", "--worker-index"):
        assert own not in argv
    assert [replica_device("cuda", i) for i in range(2)] == ["cuda:0", "cuda:1"]
    assert replica_device("cpu", 1) == "cpu"
