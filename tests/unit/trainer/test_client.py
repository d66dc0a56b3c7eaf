"""`call_each`: one call on several engines at once; errors after every call ended."""

import threading

import pytest

from weightsync.errors import WeightTransferError, WeightValidationError
from weightsync.trainer.client import call_each


def test_results_come_back_in_the_engines_order():
    assert call_each(["a", "bb", "ccc"], len) == [1, 2, 3]


def test_calls_run_at_the_same_time():
    # Each call waits for all three to have started: only concurrent calls get past it.
    barrier = threading.Barrier(3, timeout=10)
    assert call_each([0, 1, 2], lambda n: (barrier.wait(), n)[1]) == [0, 1, 2]


def test_a_single_engine_is_called_on_the_callers_thread():
    assert call_each(["x"], lambda _: threading.current_thread()) == [threading.current_thread()]


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
