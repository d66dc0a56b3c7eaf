"""How many threads a server's forward pass computes on: every core that other work leaves free.

On a machine of its own, a server computes fastest on every core it may run on. Where other
processes keep some of those cores busy (a trainer, another server, a build), a forward pass split
over a busy core waits for it at every step, and computing on fewer threads is faster. So the
step thread re-decides at step boundaries, from what the other processes used of this process's
cores over its last `period_s` of stepping (time it waits for work is not counted): Linux's
`/proc/stat` for the cores, less this process's own time from `/proc/self/stat` (the server's own
HTTP work is its own, not other work), never on more threads than a cgroup v2 CPU quota allows.
Where `/proc` is missing, or does not list each of those cores, it computes on every core but one.

A matmul's rounding depends on how many threads split it, as it depends on the batch: logprobs
may differ in the last bits between two loads of the machine. `--num-threads N` fixes the count.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

__all__ = ["ComputeThreads", "cpu_limit", "threads_for", "usable_cores"]

logger = logging.getLogger(__name__)

_SLACK_CORES = 0.5  # other work under half a core (a client, a daemon) leaves every core to compute
_PERIOD_S = 0.5
_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")  # "<quota> <period>" in microseconds, or "max ..."

Reading = tuple[int, int]
"""Clock ticks since boot: busy on the watched cores (every process), and this process's own."""


def usable_cores() -> list[int]:
    """The cores this process may run on (a `taskset` or cgroup limit counts)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def cpu_limit(cores: int) -> int:
    """`cores`, or fewer where a cgroup v2 CPU quota (a container's `--cpus`) allows fewer."""
    try:
        quota, period = _CPU_MAX.read_text(encoding="ascii").split()[:2]
        if quota != "max":
            return max(1, min(cores, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError, ZeroDivisionError):  # no cgroup v2, or a file not its form
        pass
    return cores


def threads_for(cores: int, others: float) -> int:
    """Threads to compute on: `cores` less each core that other work keeps busy, at least one.

    Args:
        cores: The cores this process may run on.
        others: The cores' worth of time other processes used of them lately (0.0 to `cores`).
    """
    return max(1, cores - math.ceil(max(0.0, others - _SLACK_CORES)))


def read_ticks(cores: Sequence[int]) -> Reading | None:
    """This machine's busy ticks on `cores` and this process's own ticks.

    None without `/proc`, or where `/proc/stat` does not list each of `cores`.
    """
    wanted, busy = {f"cpu{core}" for core in cores}, 0
    try:
        with open("/proc/stat", encoding="ascii") as stat:
            for line in stat:
                name, *ticks = line.split() or [""]
                if name in wanted:
                    # user nice system idle iowait irq softirq steal (guest time is already
                    # counted in user and nice): all but idle and iowait are busy.
                    values = [int(tick) for tick in ticks[:8]]
                    busy += sum(values) - values[3] - values[4]
                    wanted.discard(name)
        if wanted:  # cores it does not list (a virtualized /proc): their work would go unseen
            return None
        with open("/proc/self/stat", "rb") as own:  # the process's name may be any bytes
            fields = own.read().rsplit(b")", 1)[1].split()
        return busy, int(fields[11]) + int(fields[12])  # utime, stime: every thread of this one
    except (OSError, ValueError, IndexError):  # no /proc, or not in the form Linux writes
        return None


def _set_torch_threads(threads: int) -> None:
    """Sets the calling thread's torch threads to `threads`, for good."""
    # torch starts a thread's OpenMP count, at its first parallel op, from the count any thread
    # set last: a count set before that op would be lost to another thread's set in between.
    # Asking for the count first starts it now.
    torch.get_num_threads()
    torch.set_num_threads(threads)


class ComputeThreads:
    """Sets the calling thread's torch threads to every core other work leaves free.

    The server's step thread calls `adjust` before each step; at most every `period_s` it reads
    what the other processes used of the cores since the last reading and sets `threads` to
    `threads_for` of it. It calls `rest` before it waits for work: other work is measured only
    while the server steps.
    """

    def __init__(
        self,
        cores: Sequence[int] | None = None,
        *,
        period_s: float = _PERIOD_S,
        read: Callable[[Sequence[int]], Reading | None] = read_ticks,
        set_threads: Callable[[int], None] = _set_torch_threads,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._follow = cores is None  # the affinity may change as it runs (taskset -a -p)
        self.cores = usable_cores() if cores is None else sorted(cores)
        self.limit = cpu_limit(len(self.cores))  # never more threads than a CPU quota allows
        self.threads = self.limit
        self.others = 0.0  # the cores' worth other work used over the last period
        self._read: Callable[[Sequence[int]], Reading | None] | None = read
        self._period_s, self._set, self._clock = period_s, set_threads, clock
        self._last: tuple[float, Reading] | None = None  # the last good reading, and when
        self._read_at = -math.inf  # when the last reading was tried
        self._set_yet = False
        # The measurement under way: other work's ticks over this many seconds of stepping.
        self._ticks, self._seconds = 0, 0.0

    def adjust(self) -> None:
        """Re-decides, at most every `period_s`, how many threads the calling thread computes on."""
        now = self._clock()
        if self._read is None or now - self._read_at < self._period_s:
            return
        self._read_at = now
        if self._follow and (cores := usable_cores()) != self.cores:
            self.cores, self.limit, self._last = cores, cpu_limit(len(cores)), None
            self._ticks, self._seconds = 0, 0.0
        reading = self._read(self.cores)
        if reading is None and self._set_yet:
            # /proc was read before: a passing failure (no file descriptor to spare under load)
            # leaves the count as it is, and the next good reading starts a new measurement.
            self._last = None
            return
        if reading is None:  # no /proc: every core but one, from now on
            self._apply(max(1, self.limit - 1))
            self._read = None
            logger.info("the cores' use cannot be read from /proc: computing on %d threads, "
                        "every core but one (--num-threads fixes it)", self.threads)  # fmt: skip
            return
        self._take(now, reading)
        self._apply(min(self.limit, threads_for(len(self.cores), self.others)))

    def rest(self) -> None:
        """The step thread stops stepping for now; its next step keeps the count decided last.

        What other processes do with the cores while the server waits (a trainer training
        between two rounds of generation) says nothing of what its steps compete with. The
        stretch stepped since the last reading joins the measurement, which goes on from the
        next step: it covers only time spent stepping, however short each burst of steps.
        """
        if self._read is not None and self._last is not None:
            reading = self._read(self.cores)
            if reading is not None:
                self._take(self._clock(), reading)
        self._last = None
        self._read_at = -math.inf

    def _take(self, now: float, reading: Reading) -> None:
        """Adds the stretch since the last reading; `period_s` of stepping sets `others`."""
        if self._last is not None and now > self._last[0]:
            then, (busy, own) = self._last
            self._ticks += (reading[0] - busy) - (reading[1] - own)
            self._seconds += now - then
            if self._seconds >= self._period_s:
                others = self._ticks / (_TICKS_PER_S * self._seconds)
                self.others = min(max(others, 0.0), float(len(self.cores)))
                self._ticks, self._seconds = 0, 0.0
        self._last = (now, reading)

    def _apply(self, threads: int) -> None:
        if threads != self.threads or not self._set_yet:
            if threads != self.threads:
                logger.debug("computing on %d threads: other work used %.2f of %d cores",
                             threads, self.others, len(self.cores))  # fmt: skip
            self._set(threads)
            self.threads, self._set_yet = threads, True
