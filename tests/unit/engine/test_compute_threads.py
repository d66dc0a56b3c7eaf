"""How many threads a server's steps compute on: every core that other processes leave free."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Sequence

import pytest
import torch
from engine_helpers import greedy, make_engine

from weightsync.engine import _cores
from weightsync.engine._cores import ComputeThreads, cpu_limit, threads_for
from weightsync.engine.async_engine import STEP_THREAD_NAME, AsyncEngine

TICKS = 100  # clock ticks per second on Linux (SC_CLK_TCK)


@pytest.mark.parametrize(
    ("cores", "others", "threads"),
    [(2, 0.0, 2), (2, 0.5, 2), (2, 0.6, 1), (2, 2.0, 1), (16, 0.4, 16), (16, 3.2, 13), (1, 0.0, 1)],
)
def test_other_work_above_half_a_core_takes_a_core_from_the_forward_pass(cores, others, threads):
    assert threads_for(cores, others) == threads


class FakeMachine:
    """A clock and `/proc` readings the test moves by hand."""

    def __init__(self) -> None:
        self.now, self.busy, self.own = 0.0, 0, 0
        self.reads = 0
        self.set_to: list[int] = []

    def read(self, _cores: Sequence[int]) -> tuple[int, int]:
        self.reads += 1
        return self.busy, self.own

    def run(self, seconds: float, *, others: float, own: float) -> None:
        """`seconds` pass with other processes busy on `others` cores and this one on `own`."""
        self.now += seconds
        self.own += round(own * seconds * TICKS)
        self.busy += round((own + others) * seconds * TICKS)

    def threads(self, cores: int = 2) -> ComputeThreads:
        return ComputeThreads(
            range(cores), read=self.read, set_threads=self.set_to.append, clock=lambda: self.now
        )


def test_the_threads_follow_what_other_processes_leave_free():
    machine = FakeMachine()
    threads = machine.threads(cores=2)
    threads.adjust()
    assert machine.set_to == [2]  # nothing measured yet: every core
    machine.run(0.3, others=1.0, own=1.0)
    threads.adjust()  # within the period: not read again
    assert machine.reads == 1 and machine.set_to == [2]
    machine.run(0.3, others=1.0, own=1.0)
    threads.adjust()
    assert threads.others == pytest.approx(1.0, abs=0.05) and machine.set_to == [2, 1]
    machine.run(0.6, others=0.9, own=1.0)
    threads.adjust()  # unchanged: torch is not told again
    assert machine.set_to == [2, 1]
    machine.run(0.6, others=0.05, own=1.9)  # the server's own work is not other work
    threads.adjust()
    assert machine.set_to == [2, 1, 2] and threads.threads == 2


def test_other_work_while_the_server_rests_leaves_the_count_decided_while_it_stepped():
    machine = FakeMachine()
    threads = machine.threads(cores=2)
    threads.adjust()
    machine.run(0.6, others=0.1, own=1.9)  # stepping beside a client: every core
    threads.adjust()
    threads.rest()  # no work: a trainer trains on both cores meanwhile
    machine.run(5.0, others=2.0, own=0.0)
    threads.adjust()  # the first step after the rest: the trainer's 5 s are not counted
    assert machine.set_to == [2] and threads.threads == 2
    machine.run(0.6, others=1.2, own=0.8)  # the trainer goes on beside the steps
    threads.adjust()
    assert threads.others == pytest.approx(1.2, abs=0.05) and machine.set_to == [2, 1]


def test_short_bursts_beside_a_busy_trainer_add_up_to_a_measurement():
    # Bursts of steps shorter than the period, a trainer on 1.2 cores beside them and on both
    # cores while the server rests: the stepping stretches add up and the trainer is seen.
    machine = FakeMachine()
    threads = machine.threads(cores=2)
    for _ in range(3):
        threads.adjust()  # the burst's first step
        machine.run(0.2, others=1.2, own=0.8)
        threads.rest()
        machine.run(1.0, others=2.0, own=0.0)
    assert threads.others == pytest.approx(1.2, abs=0.05)
    threads.adjust()
    assert threads.threads == 1 and machine.set_to == [2, 1]


def test_the_step_thread_rests_before_it_answers_idle():
    machine = FakeMachine()
    threads = ComputeThreads(range(2), read=machine.read, set_threads=lambda n: None,
                             clock=lambda: machine.now)  # fmt: skip
    rests = []
    threads.rest = lambda: rests.append(threading.current_thread().name)  # type: ignore[method-assign]

    async def main() -> None:
        async with AsyncEngine.from_engine(make_engine(), compute_threads=threads) as engine:
            async for _ in engine.generate("hello", greedy(2), request_id="a"):
                pass
            await engine.wait_until_idle()

    asyncio.run(main())
    assert rests and set(rests) == {STEP_THREAD_NAME}


def test_without_proc_it_computes_on_every_core_but_one_and_stops_reading():
    reads: list[int] = []
    set_to: list[int] = []

    def read(_cores: Sequence[int]) -> None:
        reads.append(1)

    threads = ComputeThreads(range(4), read=read, set_threads=set_to.append, clock=time.monotonic)
    threads.adjust()
    threads.adjust()
    assert set_to == [3] and len(reads) == 1


def test_the_step_thread_sets_its_threads_before_its_steps():
    machine = FakeMachine()
    calls: list[tuple[str, int]] = []

    def record(n: int) -> None:
        calls.append((threading.current_thread().name, n))

    threads = ComputeThreads(range(2), read=machine.read, set_threads=record, clock=lambda: 0.0)

    async def main() -> list[int]:
        async with AsyncEngine.from_engine(make_engine(), compute_threads=threads) as engine:
            outputs = [out async for out in engine.generate("hello", greedy(4), request_id="a")]
            return outputs[-1].outputs[0].token_ids

    assert len(asyncio.run(main())) == 4
    assert calls == [(STEP_THREAD_NAME, 2)]


@pytest.mark.parametrize(
    ("cpu_max", "limit"),
    [("max 100000\n", 8), ("200000 100000\n", 2), ("150000 100000\n", 2), ("50000 100000\n", 1),
     ("1600000 100000\n", 8), ("garbage\n", 8), (None, 8)],
)  # fmt: skip
def test_a_cgroup_cpu_quota_caps_the_threads(tmp_path, monkeypatch, cpu_max, limit):
    path = tmp_path / "cpu.max"
    if cpu_max is not None:
        path.write_text(cpu_max)
    monkeypatch.setattr(_cores, "_CPU_MAX", path)
    assert cpu_limit(8) == limit
    machine = FakeMachine()
    threads = machine.threads(cores=8)
    threads.adjust()  # nothing measured yet: every core the quota allows
    assert machine.set_to == [limit]


@pytest.mark.parametrize(
    ("stat", "own"),
    [("cpu0 1 2 3\n", "1 (x) S 1 2"), ("cpu0 a b c d e f g h\n", "1 (x) S"), ("", ""),
     ("cpu0 1 2 3 4 5 6 7 8\n", "1 (a) b) S 0 0 0 0 0 0 0 0 x y")],
)  # fmt: skip
def test_a_proc_file_not_in_linux_form_reads_as_none(tmp_path, monkeypatch, stat, own):
    # A step must never fail for the thread count: an unreadable /proc is "no /proc".
    files = {"/proc/stat": tmp_path / "stat", "/proc/self/stat": tmp_path / "self"}
    files["/proc/stat"].write_text(stat)
    files["/proc/self/stat"].write_text(own)
    real_open = open
    monkeypatch.setattr(
        "builtins.open", lambda path, *a, **k: real_open(files.get(path, path), *a, **k)
    )
    assert _cores.read_ticks([0]) is None


def test_a_core_that_proc_stat_does_not_list_reads_as_none(tmp_path, monkeypatch):
    # A container whose /proc/stat is virtualized (lxcfs numbers its cores from 0) lists other
    # cores than the process's affinity: summing only the listed ones would read a busy machine
    # as a quiet one, and the server would compute on every core beside other work.
    files = {"/proc/stat": tmp_path / "stat", "/proc/self/stat": tmp_path / "self"}
    files["/proc/stat"].write_text("cpu 9 0 9 90 0 0 0 0\ncpu0 9 0 9 90 0 0 0 0\n")
    files["/proc/self/stat"].write_text("1 (x) S" + " 0" * 10 + " 3 4\n")
    real_open = open
    monkeypatch.setattr(
        "builtins.open", lambda path, *a, **k: real_open(files.get(path, path), *a, **k)
    )
    assert _cores.read_ticks([0]) == (18, 7)
    assert _cores.read_ticks([0, 4]) is None


def test_a_process_name_that_is_not_ascii_is_read(tmp_path, monkeypatch):
    # The name in /proc/self/stat is whatever the process was called (a prctl, a renamed binary):
    # bytes, not ASCII. Reading it as ASCII failed the first reading, which meant "no /proc" for
    # the server's whole life.
    files = {"/proc/stat": tmp_path / "stat", "/proc/self/stat": tmp_path / "self"}
    files["/proc/stat"].write_text("cpu0 9 0 9 90 0 0 0 0\n")
    files["/proc/self/stat"].write_bytes("1 (trainer-ñ) S".encode() + b" 0" * 10 + b" 3 4\n")
    real_open = open
    monkeypatch.setattr(
        "builtins.open", lambda path, *a, **k: real_open(files.get(path, path), *a, **k)
    )
    assert _cores.read_ticks([0]) == (18, 7)


def test_without_proc_the_fallback_is_logged_once(caplog):
    # The server logged "every core other processes leave free" at start; a user must learn
    # that it cannot follow the load and computes on a fixed count instead.
    threads = ComputeThreads(range(4), read=lambda _cores: None, set_threads=lambda _n: None)
    with caplog.at_level(logging.INFO, logger=_cores.__name__):
        threads.adjust()
        threads.adjust()
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 1 and "3 threads" in lines[0] and "/proc" in lines[0], lines


def test_the_step_threads_count_holds_when_another_thread_sets_torchs_first(tmp_path, monkeypatch):
    # torch starts each thread's OpenMP count from the count last set by any thread, at its
    # first parallel op: a count set on a thread before that op is overwritten if another thread
    # (a repack, a user's) set torch's count in between, and `adjust` would not set it again.
    monkeypatch.setattr(_cores, "_CPU_MAX", tmp_path / "none")  # no quota: 2 of 2 cores
    machine = FakeMachine()
    threads = ComputeThreads(range(2), read=machine.read, clock=lambda: machine.now)
    adjusted, go, seen = threading.Event(), threading.Event(), []

    def step_thread() -> None:
        threads.adjust()  # nothing measured yet: every core
        adjusted.set()
        go.wait(30)
        torch.ones(64, 64) @ torch.ones(64, 64)  # the first step's first op
        seen.append(torch.get_num_threads())

    original = torch.get_num_threads()
    stepper = threading.Thread(target=step_thread)
    stepper.start()
    try:
        assert adjusted.wait(30)
        other = threading.Thread(target=torch.set_num_threads, args=(1,))
        other.start()
        other.join(30)
    finally:
        go.set()
        stepper.join(30)
        torch.set_num_threads(original)
    assert threads.threads == 2 and seen == [2]


def test_a_reading_that_fails_once_after_good_ones_leaves_the_threads_following_the_load():
    # Out of file descriptors for a moment (a server under load): /proc is there, and the count
    # must not fall back to every core but one for good.
    machine, failing = FakeMachine(), [False]

    def read(cores: Sequence[int]) -> tuple[int, int] | None:
        return None if failing[0] else machine.read(cores)

    threads = ComputeThreads(
        range(4), read=read, set_threads=machine.set_to.append, clock=lambda: machine.now
    )
    threads.adjust()
    assert machine.set_to == [4]
    machine.run(0.6, others=0.0, own=1.0)
    failing[0] = True
    threads.adjust()
    failing[0] = False
    machine.run(0.6, others=2.0, own=1.0)
    threads.adjust()  # a new measurement starts
    machine.run(0.6, others=2.0, own=1.0)
    threads.adjust()
    assert machine.set_to == [4, 2] and threads.others == pytest.approx(2.0, abs=0.05)


def test_a_narrower_affinity_while_it_runs_narrows_the_threads(tmp_path, monkeypatch):
    # `taskset -a -p -c 0 PID` (or a container's cpuset changed as it runs): four threads on one
    # core would wait for each other at every step.
    monkeypatch.setattr(_cores, "_CPU_MAX", tmp_path / "none")
    affinity = {0, 1, 2, 3}
    monkeypatch.setattr(_cores.os, "sched_getaffinity", lambda _pid: set(affinity), raising=False)
    machine = FakeMachine()
    threads = ComputeThreads(read=machine.read, set_threads=machine.set_to.append,
                             clock=lambda: machine.now)  # fmt: skip
    threads.adjust()
    affinity.intersection_update({0})
    machine.run(0.6, others=0.0, own=1.0)
    threads.adjust()
    assert machine.set_to == [4, 1] and threads.cores == [0]
