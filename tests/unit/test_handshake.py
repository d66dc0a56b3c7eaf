"""The handshake that opens a broadcast update, between a trainer and workers over one store.

Each side runs on its own thread against an in-memory store, so that every interleaving of a
refused message with the trainer's update (the trainer there before, arriving meanwhile,
arriving after, or never) is played in a fixed order. A call that should answer at once is
joined with a bound far below the handshake's timeout: waiting out the timeout fails the test.
The interleavings are cases of the reliability table (a refused message is bad input).
"""

import json
import threading
from concurrent.futures import Future

import pytest
import torch

from weightsync.errors import (
    DuplicateMessageError,
    WeightTransferError,
    WeightTransferTimeout,
    WeightValidationError,
)
from weightsync.transfer.base import TensorSpec, WeightTransferUpdateInfo
from weightsync.transfer.nccl import _LATEST as LATEST
from weightsync.transfer.nccl import _metadata_digest as metadata_digest
from weightsync.transfer.nccl import _open_update as open_update
from weightsync.transfer.nccl import _send_identity as send_identity
from weightsync.transfer.nccl import _WorkerHandshake as WorkerHandshake

SPECS = [TensorSpec("a", torch.float32, (3,)), TensorSpec("b", torch.int8, (300,))]
TIMEOUT_S = 30.0  # the handshake's limit: nothing here may come near it
AT_ONCE_S = 5.0  # what "at once" may take on a loaded machine
A, B = "send-a", "send-b"  # two sends (what send_identity gives their messages)
REFUSAL = "WeightValidationError: unknown name 'x'"
DIGEST = metadata_digest(SPECS)  # of a refused message that lists the tensors the trainer sends
BAD_INPUT = pytest.mark.reliability("bad-input")


class Store:
    """The group's store: JSON values under string keys, with blocking reads."""

    def __init__(self):
        self.values = {}
        self.changed = threading.Condition()
        self.after_set = lambda key: None  # a hook: runs right after a key was written

    def write(self, key, value):
        with self.changed:
            self.values[key] = json.loads(json.dumps(value))
            self.changed.notify_all()
        self.after_set(key)

    def wait_for(self, key, timeout_s):
        with self.changed:
            if not self.changed.wait_for(lambda: key in self.values, timeout_s):
                raise WeightTransferTimeout(f"reading {key!r} timed out")
            return self.values[key]


class Group:
    """One rank's end of the group, as the handshake sees it."""

    def __init__(self, store, rank, world_size=2, timeout_s=TIMEOUT_S):
        self.store, self.rank, self.world_size, self.timeout_s = store, rank, world_size, timeout_s

    def set(self, key, value):
        self.store.write(key, value)

    def has(self, keys):
        return all(key in self.store.values for key in keys)

    def lookup(self, key):
        return self.store.values.get(key)

    def get(self, key, timeout_s=None):
        return self.store.wait_for(key, self.timeout_s if timeout_s is None else timeout_s)

    def set_once(self, key, value):
        with self.store.changed:
            if key not in self.store.values:
                self.store.write(key, value)
            return self.store.values[key]

    def delete(self, key):
        self.store.values.pop(key, None)

    def malformed(self, key, detail):
        return WeightTransferError(
            f"the test store holds a malformed value under {key!r} ({detail})"
        )


class Side(threading.Thread):
    """Runs one side's call on a thread; `outcome()` is its result or the error it raised."""

    def __init__(self, call):
        super().__init__(daemon=True)
        self._call, self._box = call, {}
        self.start()

    def run(self):
        try:
            self._box["result"] = self._call()
        except Exception as exc:
            self._box["error"] = exc

    def outcome(self, timeout_s=AT_ONCE_S):
        self.join(timeout_s)
        assert not self.is_alive(), f"still waiting after {timeout_s} s"
        return self._box.get("error", self._box.get("result"))


def groups(world_size=2, timeout_s=TIMEOUT_S):
    store = Store()
    trainer = Group(store, 0, world_size, timeout_s)
    return store, trainer, [Group(store, r, world_size, timeout_s) for r in range(1, world_size)]


def trainer_side(trainer, n, send, specs=SPECS, problem=None, receiving=()):
    return Side(lambda: open_update(trainer, n, send, specs, problem, receiving=receiving))


def announced(store, n):
    """Waits until the trainer has update `n` on the line."""
    store.wait_for(f"update/{n}", AT_ONCE_S)
    with store.changed:
        store.changed.wait_for(lambda: store.values.get(LATEST) == n, AT_ONCE_S)


@BAD_INPUT
def test_a_refusal_while_the_trainer_waits_reaches_it_at_once():
    """Trainer on the line first, then the message is refused: both sides end at once."""
    store, trainer, (worker,) = groups()
    sending = trainer_side(trainer, 1, A)
    announced(store, 1)
    WorkerHandshake(worker).refuse(A, REFUSAL, DIGEST)
    error = sending.outcome()
    assert isinstance(error, WeightValidationError)
    assert f"update rejected before any byte moved by rank 1: {REFUSAL}" in str(error)
    assert store.values["update/1/decision"] == {"refused": f"rank 1: {REFUSAL}"}


@BAD_INPUT
def test_a_refusal_before_the_trainer_comes_is_paired_with_its_send():
    """The message refused before the trainer starts its update: the trainer learns at once."""
    _, trainer, (worker,) = groups()
    WorkerHandshake(worker).refuse(A, REFUSAL, DIGEST)  # returns: nothing was on the line
    error = trainer_side(trainer, 1, A).outcome()
    assert isinstance(error, WeightValidationError) and f"rank 1: {REFUSAL}" in str(error)


@BAD_INPUT
def test_a_refusal_while_the_trainer_announces_is_paired_with_its_send():
    """The message refused between the trainer's announcement and its going live: paired."""
    store, trainer, (worker,) = groups()
    handshake = WorkerHandshake(worker)

    def refuse_mid_announcement(key):
        if key == "update/1":  # written, but `update/latest` does not say 1 yet
            store.after_set = lambda key: None
            handshake.refuse(A, REFUSAL, DIGEST)

    store.after_set = refuse_mid_announcement
    error = trainer_side(trainer, 1, A).outcome()
    assert isinstance(error, WeightValidationError) and f"rank 1: {REFUSAL}" in str(error)


@BAD_INPUT
def test_a_stray_refusal_never_fails_the_next_update_of_another_send():
    """A stray message refused with no trainer; the trainer's next update goes, even when it is
    on the line before its own message reaches the worker."""
    store, trainer, (worker,) = groups()
    handshake = WorkerHandshake(worker)
    handshake.refuse(B, REFUSAL, DIGEST)
    sending = trainer_side(trainer, 1, A)
    announced(store, 1)
    receiving = Side(lambda: handshake.join(A, SPECS))
    assert receiving.outcome() is None and sending.outcome() is None
    assert store.values["update/1/decision"] == {"go": True}


@BAD_INPUT
@pytest.mark.parametrize("first", ["worker", "trainer"])
def test_a_stray_refused_copy_of_a_send_never_fails_that_sends_update(first):
    """A copy of the trainer's next message, mangled (other tensors, same send), refused with no
    trainer on the line: the trainer's update of that send waits for the worker's own answer
    and goes, whichever side comes first."""
    store, trainer, (worker,) = groups()
    handshake = WorkerHandshake(worker)
    handshake.refuse(A, REFUSAL, metadata_digest(SPECS[:1]))
    if first == "worker":
        receiving = Side(lambda: handshake.join(A, SPECS))
        sending = trainer_side(trainer, 1, A)
    else:
        sending = trainer_side(trainer, 1, A)
        announced(store, 1)
        receiving = Side(lambda: handshake.join(A, SPECS))
    assert receiving.outcome() is None and sending.outcome() is None
    assert store.values["update/1/decision"] == {"go": True}


@BAD_INPUT
def test_an_accepted_message_withdraws_the_refusal_kept_for_its_send():
    """The same message refused (a busy engine), then sent again and accepted before the
    trainer comes: the trainer's update takes the worker's ready answer, not the old refusal."""
    store, trainer, (worker,) = groups()
    handshake = WorkerHandshake(worker)
    handshake.refuse(A, "EngineBusyError: requests are in flight", DIGEST)
    receiving = Side(lambda: handshake.join(A, SPECS))
    with store.changed:  # the withdrawal is written before the worker waits for the update
        assert store.changed.wait_for(lambda: store.values.get("update/early/1") == [], AT_ONCE_S)
    sending = trainer_side(trainer, 1, A)
    assert receiving.outcome() is None and sending.outcome() is None


@BAD_INPUT
@pytest.mark.parametrize("first", ["worker", "trainer"])
def test_a_message_sent_again_after_its_update_took_the_kept_refusal_goes_with_the_next(first):
    """The trainer's update took the refusal kept from before it (a busy engine); the message
    sent again waits for the update sent again and goes, whichever side comes first."""
    store, trainer, (worker,) = groups()
    handshake = WorkerHandshake(worker)
    handshake.refuse(A, "EngineBusyError: requests are in flight", DIGEST)
    refused = trainer_side(trainer, 1, A).outcome()
    assert isinstance(refused, WeightValidationError) and "EngineBusyError" in str(refused)
    if first == "worker":
        receiving = Side(lambda: handshake.join(A, SPECS))
        sending = trainer_side(trainer, 2, A)
    else:
        sending = trainer_side(trainer, 2, A)
        announced(store, 2)
        receiving = Side(lambda: handshake.join(A, SPECS))
    assert receiving.outcome() is None and sending.outcome() is None


@BAD_INPUT
def test_a_refusal_is_kept_for_the_next_update_only():
    """A refusal of a send not on the line waits for the next update alone, not a later one."""
    _, trainer, (worker,) = groups()
    handshake = WorkerHandshake(worker)
    handshake.refuse(A, REFUSAL, DIGEST)  # kept for update 1
    first = trainer_side(trainer, 1, B)
    assert Side(lambda: handshake.join(B, SPECS)).outcome() is None
    assert first.outcome() is None
    second = trainer_side(trainer, 2, A)  # the same send as the old refusal, one update later
    assert Side(lambda: handshake.join(A, SPECS)).outcome() is None
    assert second.outcome() is None


@BAD_INPUT
@pytest.mark.parametrize("first", ["worker", "trainer"])
def test_the_same_update_sent_again_after_a_refusal_goes(first):
    """Refused at once, then the same update sent again: it lands, whichever side comes first."""
    store, trainer, (worker,) = groups()
    handshake = WorkerHandshake(worker)
    sending = trainer_side(trainer, 1, A)
    announced(store, 1)
    handshake.refuse(A, "EngineBusyError: requests are in flight", DIGEST)
    assert isinstance(sending.outcome(), WeightValidationError)
    if first == "worker":  # the retried message comes before the trainer's next update
        receiving = Side(lambda: handshake.join(A, SPECS))
        sending = trainer_side(trainer, 2, A)
    else:
        sending = trainer_side(trainer, 2, A)
        announced(store, 2)
        receiving = Side(lambda: handshake.join(A, SPECS))
    assert receiving.outcome() is None and sending.outcome() is None


@BAD_INPUT
def test_a_message_that_comes_after_its_update_was_refused_is_answered_at_once():
    """One worker refuses, the other's call failed before it got the message; when the message
    then arrives it is answered at once with the update's refusal."""
    _, trainer, (first, second) = groups(world_size=3)
    WorkerHandshake(first).refuse(A, REFUSAL, DIGEST)
    failed = Future()
    failed.set_exception(ConnectionError("the server did not answer"))
    error = trainer_side(trainer, 1, A, receiving=[Future(), failed]).outcome()
    assert f"rank 1: {REFUSAL}; rank 2: ConnectionError: the server did not answer" in str(error)
    late = Side(lambda: WorkerHandshake(second).join(A, SPECS)).outcome()
    assert isinstance(late, WeightValidationError)
    assert "update #1, which this message belongs to, was refused (rank 1: " in str(late)


@BAD_INPUT
def test_a_worker_given_other_metadata_refuses_and_says_why():
    """The worker's message announces other tensors than the trainer sends: refused by both."""
    _, trainer, (worker,) = groups()
    sending = trainer_side(trainer, 1, A)
    error = Side(lambda: WorkerHandshake(worker).join(A, SPECS[:1])).outcome()
    message = "the update info this worker got (1 tensors) differs from what the trainer sends (2"
    assert isinstance(error, WeightValidationError) and message in str(error)
    assert message in str(sending.outcome())


@BAD_INPUT
def test_a_trainer_that_refuses_its_own_update_tells_every_worker():
    """The trainer's own refusal reaches a worker already waiting and one that comes later."""
    _, trainer, (first, second) = groups(world_size=3)
    waiting = Side(lambda: WorkerHandshake(first).join(A, SPECS))
    problem = WeightValidationError("the iterator is empty")
    with pytest.raises(WeightValidationError, match="the iterator is empty"):
        open_update(trainer, 1, A, None, problem)
    for error in (
        waiting.outcome(),
        Side(lambda: WorkerHandshake(second).join(A, SPECS)).outcome(),
    ):
        assert "rank 0: the iterator is empty" in str(error)


@pytest.mark.reliability("fault")
def test_a_silent_worker_is_a_timeout_on_both_sides():
    """A worker that gets no message, a trainer that never sends: each side times out."""
    _, trainer, _ = groups(timeout_s=0.2)
    with pytest.raises(
        WeightTransferTimeout, match=r"timed out after 0.2 s \(timeout_s\): ranks \[1\]"
    ):
        open_update(trainer, 1, A, SPECS, None)
    _, _, (lonely,) = groups(timeout_s=0.2)
    with pytest.raises(
        WeightTransferTimeout, match=r"timed out after 0.2 s \(timeout_s\): no update"
    ):
        WorkerHandshake(lonely).join(A, SPECS)


def test_the_store_forgets_old_rounds():
    store, trainer, (worker,) = groups()
    handshake = WorkerHandshake(worker)
    for n in (1, 2, 3):
        sending = trainer_side(trainer, n, A)
        assert Side(lambda: handshake.join(A, SPECS)).outcome() is None
        assert sending.outcome() is None
    assert not any(key.startswith("update/1") for key in store.values)
    assert store.values[LATEST] == 3 and "update/2/decision" in store.values


def test_a_message_and_its_parsed_info_have_one_identity():
    info = WeightTransferUpdateInfo.from_specs(SPECS, weight_version=1)
    message = json.loads(json.dumps(info.to_dict()))
    assert send_identity(message) == send_identity(info)
    mangled = {**message, "shapes": message["shapes"][:-1]}
    assert send_identity(mangled) == send_identity(info)  # the send it came from
    again = WeightTransferUpdateInfo.from_specs(SPECS, weight_version=1)
    assert send_identity(again) != send_identity(info)  # another send of the same tensors
    bare = {k: v for k, v in message.items() if k != "send_id"}
    assert send_identity(bare) == send_identity({**bare, "weight_version": 1, "x": None})
    assert send_identity(bare) != send_identity({**bare, "shapes": [[4], [300]]})
    unordered = {1: "a", "b": 2}  # keys json cannot sort: recognised by nothing
    assert send_identity(unordered) != send_identity(unordered)


def test_metadata_digest_is_stable_and_sees_every_field():
    digest = metadata_digest(SPECS)
    assert digest == metadata_digest(list(SPECS)) and 0 <= digest < 2**63
    changed = [TensorSpec("a", torch.float32, (4,)), *SPECS[1:]]
    renamed = [TensorSpec("z", torch.float32, (3,)), *SPECS[1:]]
    retyped = [TensorSpec("a", torch.float64, (3,)), *SPECS[1:]]
    assert len({digest, *map(metadata_digest, (changed, renamed, retyped))}) == 4


@pytest.mark.reliability("bad-input")
def test_a_repeat_of_the_message_received_last_is_refused_once_the_trainer_stays_silent():
    """A message of the send_id the worker received last, and no update after it: a repeat (a
    client's retry), refused as one. By content, the same message may be the next update's
    (every step of a vLLM client looks alike): a timeout, as before. The next update of that
    send_id still goes (a client may keep one)."""
    _, trainer, (worker,) = groups()
    handshake = WorkerHandshake(worker)
    sending = trainer_side(trainer, 1, A)
    assert Side(lambda: handshake.join(A, SPECS, by_id=True)).outcome() is None
    assert sending.outcome() is None
    worker.timeout_s = 0.2  # what the trainer's silence takes to tell
    with pytest.raises(DuplicateMessageError, match=r"repeat of update #1's"):
        handshake.join(A, SPECS, by_id=True)
    with pytest.raises(WeightTransferTimeout, match="no update of the trainer's arrived"):
        handshake.join(A, SPECS)
    with pytest.raises(WeightTransferTimeout, match="no update of the trainer's arrived"):
        handshake.join(B, SPECS, by_id=True)  # another send: never a repeat
    worker.timeout_s = TIMEOUT_S
    sending = trainer_side(trainer, 2, A)
    assert Side(lambda: handshake.join(A, SPECS, by_id=True)).outcome() is None
    assert sending.outcome() is None


@pytest.mark.reliability("bad-input")
def test_a_repeat_of_the_message_received_last_never_answers_the_next_update():
    """The trainer is on the line with the next update (another send_id) when a client's retry
    of the last message comes: refused at once as a repeat, without answering that update,
    whose own message then goes."""
    _, trainer, (worker,) = groups()
    handshake = WorkerHandshake(worker)
    sending = trainer_side(trainer, 1, A)
    assert Side(lambda: handshake.join(A, SPECS, by_id=True)).outcome() is None
    assert sending.outcome() is None
    sending = trainer_side(trainer, 2, B)
    announced(trainer.store, 2)
    repeat = Side(lambda: handshake.join(A, SPECS, by_id=True)).outcome()
    assert isinstance(repeat, DuplicateMessageError), repeat
    assert "the trainer sends another one now (update #2)" in str(repeat)
    assert Side(lambda: handshake.join(B, SPECS, by_id=True)).outcome() is None
    assert sending.outcome() is None


def test_a_repeat_is_told_apart_after_updates_that_went_without_the_worker():
    """Update 1 went; the trainer then refused its own update 2 (another send): a repeat of
    update 1's message, with no update after, is still a repeat."""
    _, trainer, (worker,) = groups()
    handshake = WorkerHandshake(worker)
    sending = trainer_side(trainer, 1, A)
    assert Side(lambda: handshake.join(A, SPECS, by_id=True)).outcome() is None
    assert sending.outcome() is None
    refused = trainer_side(trainer, 2, B, problem=WeightValidationError("the trainer's own"))
    assert isinstance(refused.outcome(), WeightValidationError)
    worker.timeout_s = 0.2
    with pytest.raises(DuplicateMessageError, match=r"repeat of update #1's"):
        handshake.join(A, SPECS, by_id=True)
