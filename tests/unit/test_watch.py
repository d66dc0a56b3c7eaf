"""A receiver's watch: what a trainer that went away left behind is released between calls."""

import gc
import threading
import weakref

import pytest
import torch
from test_ipc_handles import Rig

from weightsync import GlooWeightTransferEngine
from weightsync.transfer.base import _Watch as Watch
from weightsync.transfer.nccl import trainer_init

SWEEP_S = 10.0  # a sweep comes every second: this bound fails a watch that never sweeps


def next_sweep(watch):
    """Waits for a sweep that starts after this call (the hook every sweep sets)."""
    watch.swept.clear()
    assert watch.swept.wait(SWEEP_S), "no sweep came"


def test_a_watch_sweeps_until_stopped_or_told_there_is_nothing_left():
    answers = iter([True, False])
    watch = Watch(lambda: next(answers), name="a-test-watch", period_s=0.01)
    watch._thread.join(SWEEP_S)
    assert not watch.is_running  # the second sweep found nothing left to watch
    stopped = Watch(lambda: True, name="a-test-watch", period_s=0.01)
    next_sweep(stopped)
    stopped.stop()
    assert not stopped.is_running


def test_a_failing_sweep_is_logged_and_the_watch_goes_on(caplog):
    calls = []

    def sweep():
        calls.append(1)
        if len(calls) == 1:
            raise OSError("a transient failure")
        return True

    watch = Watch(sweep, name="a-test-watch", period_s=0.01)
    try:
        next_sweep(watch)
        next_sweep(watch)
    finally:
        watch.stop()
    assert len(calls) >= 2 and "a transient failure" in caplog.text


def test_segments_a_closed_session_unlinked_are_unmapped_between_updates():
    rig = Rig(packed=True, bucket_size_bytes=256)
    try:
        rig.send()
        mappings, watch = rig.engine._mappings, rig.engine._watch
        assert mappings.open_segments  # kept for the next update
        rig.session.close()  # unlinks them: these mappings are all that keeps their memory
        next_sweep(watch)
        assert mappings.open_segments == []
        assert rig.engine.is_initialized  # a new session's init_info is all it needs
    finally:
        rig.close()
    assert not watch.is_running  # shutdown stops it


def test_a_receiver_dropped_without_shutdown_is_collected_and_its_watch_ends():
    rig = Rig(packed=True, bucket_size_bytes=256)
    try:
        rig.send()  # the receiver now holds mappings of the session's segments
        receiver, watch = weakref.ref(rig.engine), rig.engine._watch
        rig.engine = None  # dropped, never shut down
        gc.collect()
        assert receiver() is None  # its watch does not keep it (and its mappings) alive
        watch._thread.join(SWEEP_S)
        assert not watch.is_running  # the next period found nothing left to watch
    finally:
        rig.session.close()


@pytest.fixture
def joined():
    """A trainer's gloo group and a receiver in it, both in this process."""
    trainer = trainer_init(world_size=2, backend="gloo", timeout_s=30)
    engine = GlooWeightTransferEngine(params={"w": torch.zeros(4)})
    joining = threading.Thread(target=engine.init_transfer_engine, args=(trainer.init_info,))
    joining.start()
    trainer.connect()
    joining.join(30)
    assert engine.is_initialized
    yield trainer, engine
    engine.shutdown()
    trainer.close()


def test_a_receiver_leaves_the_group_of_a_trainer_that_closed_it(joined):
    trainer, engine = joined
    assert engine._release_gone() is True  # the trainer answers: nothing to release
    trainer.close()
    next_sweep(engine._watch)
    assert not engine.is_initialized  # left: its connections and port are closed
    assert engine._release_gone() is False


def test_the_watch_never_waits_for_a_call_in_progress(joined):
    trainer, engine = joined
    holding, done = threading.Event(), threading.Event()

    def a_call_in_progress():  # a receive, say, on another thread: it finds out for itself
        with engine._busy:
            holding.set()
            done.wait(SWEEP_S)

    call = threading.Thread(target=a_call_in_progress)
    call.start()
    try:
        assert holding.wait(SWEEP_S)
        trainer.close()
        assert engine._release_gone() is True and engine.is_initialized  # did not wait
    finally:
        done.set()
        call.join(SWEEP_S)
    assert engine._release_gone() is False and not engine.is_initialized
