"""`call_each`: one call on several engines at once; errors after every call ended."""

import threading

import pytest

from weightsync.errors import WeightTransferError, WeightTransferTimeout, WeightValidationError
from weightsync.trainer.senders import call_each


def test_results_come_back_in_the_engines_order():
    assert call_each(["a", "bb", "ccc"], len) == [1, 2, 3]


def test_calls_run_at_the_same_time():
    # Each call waits for all three to have started: only concurrent calls get past it.
    barrier = threading.Barrier(3, timeout=10)
    assert call_each([0, 1, 2], lambda n: (barrier.wait(), n)[1]) == [0, 1, 2]


def test_a_call_that_never_returns_is_a_timeout_naming_the_engine():
    release = threading.Event()
    try:
        with pytest.raises(
            WeightTransferTimeout,
            match=r"update_weights did not return within 0.2 s \(timeout_s\) on engines \[1\]",
        ):
            call_each(
                [0, 1], lambda n: n == 0 or release.wait(), timeout_s=0.2, what="update_weights"
            )
    finally:
        release.set()


def test_even_a_single_engine_is_bounded():
    release = threading.Event()
    try:
        with pytest.raises(WeightTransferTimeout, match=r"on engines \[0\]"):
            call_each(["x"], lambda _: release.wait(), timeout_s=0.1)
    finally:
        release.set()


def test_only_rejections_raise_a_rejection():
    def reject(n):
        raise WeightValidationError(f"engine {n} rejects")

    with pytest.raises(WeightValidationError, match="engine 0 rejects"):
        call_each([0, 1], reject)


def test_a_transfer_failure_wins_over_a_rejection_and_every_call_ends_first():
    finished = []

    def call(n):
        if n == 0:
            raise WeightValidationError("rejected")
        if n == 1:
            raise WeightTransferError("peer died", partially_applied=True)
        finished.append(n)

    with pytest.raises(WeightTransferError, match="peer died") as raised:
        call_each([0, 1, 2], call)
    assert raised.value.partially_applied
    assert finished == [2]
