"""A hostile process on a broadcast group's store: it connects to the trainer's `TCPStore` as
any process that reaches its port can, and writes garbage, huge or forged values under the
handshake's keys while an update is on its way.

Neither the trainer nor the worker may hang past `timeout_s`, crash, or take such a value as an
answer: each call ends within its bound with a weightsync error that names the store and the
key, and a hostile value is never echoed whole into a message.
"""

from __future__ import annotations

import datetime
import json
import threading
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from weightsync import (
    NCCLTrainerSendWeightsArgs,
    WeightSyncError,
    trainer_init,
    trainer_send_weights,
)
from weightsync.transfer.base import TensorSpec, WeightTransferUpdateInfo
from weightsync.transfer.nccl import GlooWeightTransferEngine

pytestmark = pytest.mark.reliability("fault")

TIMEOUT_S = 3.0  # the group's limit: every call below must end within it, plus slack
BOUND_S = 2 * TIMEOUT_S + 10.0  # a handshake and the store calls after it, on a loaded machine
MESSAGE_CHARS = 2000  # a hostile value is cut, never echoed whole
SPECS = [TensorSpec(f"layer.{i}.weight", torch.float32, (8, 8)) for i in range(3)]
HUGE = json.dumps({"refused": "x" * (2 << 20)})  # a well-formed answer, 2 MiB long


class Call(threading.Thread):
    """Runs a call on a thread; `ended()` is what it raised (None if it returned), in time."""

    def __init__(self, call: Callable[[], Any]) -> None:
        super().__init__(daemon=True)
        self._call, self._error = call, ""
        self.start()

    def run(self) -> None:
        try:
            self._call()
        except WeightSyncError as exc:  # kept as text: the error's frames hold the group
            self._error = f"{type(exc).__name__}: {exc}"
        except BaseException as exc:  # not a weightsync error: a crash, for the test
            self._error = f"CRASH {type(exc).__name__}: {exc}"

    def ended(self) -> str:
        self.join(BOUND_S)
        assert not self.is_alive(), f"still waiting after {BOUND_S} s"
        return self._error


@pytest.fixture
def parties(no_leftovers):
    """The trainer's group, a worker joined to it, and a hostile client of the same store."""
    group = trainer_init(world_size=2, backend="gloo", timeout_s=TIMEOUT_S)
    engine = GlooWeightTransferEngine(expected_specs={s.name: s for s in SPECS})
    hostile = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", group.init_info["master_port"], is_master=False,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )  # fmt: skip
    held = SimpleNamespace(group=group, engine=engine, hostile=hostile)
    del group, engine, hostile
    yield held
    held.engine.shutdown()
    held.group.close()
    vars(held).clear()  # pytest keeps the fixture's value: it must not keep the sockets


def joined(group, engine) -> None:
    joining = Call(lambda: engine.init_transfer_engine(group.init_info))
    group.connect()
    assert joining.ended() == ""


def update(group, engine, hostile, before_worker: Callable[[Any], None]) -> tuple[str, str]:
    """One update: the trainer announces it, the hostile client writes, then the worker's
    message comes. Returns how the trainer's send and the worker's receive ended."""
    tensors = {s.name: torch.randn(s.shape) for s in SPECS}
    info = WeightTransferUpdateInfo.from_named_tensors(tensors.items()).to_dict()
    sending = Call(
        lambda: trainer_send_weights(tensors.items(), NCCLTrainerSendWeightsArgs(group, info))
    )
    hostile.wait(["update/1"])  # the announcement: the trainer now polls for the answer
    before_worker(hostile)
    receiving = Call(lambda: engine.receive_weights(info, lambda pairs: None))
    return sending.ended(), receiving.ended()


def assert_names(error: str, port: int, key: str) -> None:
    assert error and not error.startswith("CRASH"), error
    assert f"the transfer store at 127.0.0.1:{port}" in error and repr(key) in error, error
    assert len(error) < MESSAGE_CHARS, len(error)


def test_a_garbage_latest_update_fails_the_worker_at_once_naming_the_key(parties, record_property):
    """`update/latest` overwritten with bytes that are not JSON: the worker's message fails."""
    group, engine, hostile = parties.group, parties.engine, parties.hostile
    joined(group, engine)
    hostile.set("update/latest", b"\xff\xfe not json")
    info = WeightTransferUpdateInfo.from_specs(SPECS).to_dict()
    error = Call(lambda: engine.receive_weights(info, lambda pairs: None)).ended()
    assert_names(error, group.init_info["master_port"], "update/latest")
    assert "not JSON" in error
    record_property("message", error[:160])


def test_a_deeply_nested_announcement_is_refused_unparsed(parties, record_property):
    """An announcement nested 100 000 deep (a parser's recursion bomb) under `update/1`."""
    group, engine, hostile = parties.group, parties.engine, parties.hostile
    joined(group, engine)
    hostile.set("update/1", "[" * 100_000)
    hostile.set("update/latest", "1")
    info = WeightTransferUpdateInfo.from_specs(SPECS).to_dict()
    error = Call(lambda: engine.receive_weights(info, lambda pairs: None)).ended()
    assert_names(error, group.init_info["master_port"], "update/1")
    record_property("message", error[:160])


def test_a_huge_answer_is_taken_by_neither_side(parties, record_property):
    """A 2 MiB answer written under the worker's key before the worker answers."""
    group, engine, hostile = parties.group, parties.engine, parties.hostile
    joined(group, engine)
    key = "update/1/answer/1"
    sent, received = update(group, engine, hostile, lambda store: store.set(key, HUGE))
    port = group.init_info["master_port"]
    for error in (sent, received):
        assert_names(error, port, key)
        assert f"more than {1 << 20}" in error
    record_property("message", sent[:160])


def test_a_forged_decision_is_no_decision(parties, record_property):
    """A decision of the wrong form under `update/1/decision` before the worker reads it: the
    worker fails naming the key; the trainer, whose worker never answered, times out."""
    group, engine, hostile = parties.group, parties.engine, parties.hostile
    joined(group, engine)
    key = "update/1/decision"
    sent, received = update(group, engine, hostile, lambda store: store.set(key, '"go"'))
    assert_names(received, group.init_info["master_port"], key)
    assert sent.startswith("WeightTransferTimeout: ") and f"after {TIMEOUT_S:g} s" in sent, sent
    record_property("message", received[:160])


def test_a_garbage_rank_claim_refuses_the_join(parties, record_property):
    """The worker's rank claimed first with bytes that are not text: its join is refused."""
    group, engine, hostile = parties.group, parties.engine, parties.hostile
    hostile.set("rank/1", b"\xff\xfe")
    joining = Call(lambda: engine.init_transfer_engine(group.init_info))
    error = joining.ended()
    assert error.startswith("WeightValidationError: rank 1 was claimed by another process"), error
    assert_names(error, group.init_info["master_port"], "rank/1")
    record_property("message", error[:160])
