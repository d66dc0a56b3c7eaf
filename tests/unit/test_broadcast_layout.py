"""The broadcast protocol reads in one module: both of its ends, its handshake, its group."""

import importlib.util

from weightsync.transfer import group, nccl

BOTH_ENDS = {
    "NCCLWeightTransferInitInfo",  # how a worker joins
    "TrainerGroup",  # the trainer's end, which owns its send
    "trainer_init",
    "NCCLTrainerSendWeightsArgs",
    "trainer_send_weights",
    "NCCLWeightTransferEngine",  # the workers' end
    "GlooWeightTransferEngine",
}
FOLDED = [
    "nccl_trainer",
    "_handshake",
    "_identity",
    "_broadcast",
    "_watch",
    "_group",
    "_group_store",
]


def test_both_ends_of_the_broadcast_are_one_module():
    assert set(nccl.__all__) == BOTH_ENDS
    assert {getattr(nccl, name).__module__ for name in BOTH_ENDS} == {nccl.__name__}


def test_the_protocol_is_not_spread_over_helper_modules():
    left = [name for name in FOLDED if importlib.util.find_spec(f"weightsync.transfer.{name}")]
    assert left == []


def test_the_group_holds_its_store():
    store_calls = ["set", "get", "lookup", "set_once", "delete", "has", "append", "claim_rank"]
    assert all(callable(getattr(group.BroadcastGroup, call)) for call in store_calls)
    assert group.BroadcastGroup.__module__ == group.__name__


def test_the_handshake_names_its_phases_in_one_place():
    assert [phase.name for phase in nccl._Phase] == ["AWAITED", "OPEN", "DECIDED"]
