"""What a fault case may not leave behind: processes, threads, listening ports, fds, segments.

`Snapshot.take()` records what this test process and its descendants hold; after a case,
`assert_none_left(before)` waits (bounded) for everything new to go away and fails naming what
stayed. Shared-memory segments are the ones under /dev/shm with weightsync's prefix.
"""

from __future__ import annotations

import gc
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from weightsync.transfer.memory import SESSION_PREFIX

GRACE_S = 15.0
"""How long leftovers may take to go: a killed child is reaped, a closed socket released."""


def _children(pid: int) -> set[int]:
    """Every live descendant of `pid` (zombies included: they are not reaped yet)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # exited while we looked
        # The command name may hold spaces and parentheses: fields resume after the last ')'.
        parents[int(entry)] = int(stat.rsplit(b")", 1)[1].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def _listening_ports(pids: set[int]) -> set[int]:
    inodes = set().union(*(_socket_inodes(pid) for pid in pids))
    ports = set()
    for fields in _tcp_sockets():
        if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
            ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def _tcp_sockets() -> Iterator[list[str]]:
    """The fields of every row of the kernel's TCP tables (IPv4 and IPv6)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            yield row.split()


@dataclass(frozen=True)
class Snapshot:
    """What this process and its descendants hold at one moment."""

    processes: frozenset[int]
    threads: frozenset[str]
    ports: frozenset[int]
    fds: int
    segments: frozenset[str]

    @classmethod
    def take(cls) -> Snapshot:
        """Record the current state."""
        me = os.getpid()
        children = _children(me)
        return cls(
            processes=frozenset(children),
            threads=frozenset(f"{t.name}#{t.ident}" for t in threading.enumerate()),
            ports=frozenset(_listening_ports({me} | children)),
            fds=len(os.listdir("/proc/self/fd")),
            segments=frozenset(n for n in os.listdir("/dev/shm") if n.startswith(SESSION_PREFIX)),
        )

    def new_since(self, before: Snapshot) -> dict[str, object]:
        """What this snapshot holds that `before` did not (empty when nothing)."""
        new: dict[str, object] = {
            "processes": sorted(self.processes - before.processes),
            "threads": sorted(self.threads - before.threads),
            "ports": sorted(self.ports - before.ports),
            "segments": sorted(self.segments - before.segments),
        }
        if self.fds > before.fds:
            new["fds"] = self.fds - before.fds
        return {k: v for k, v in new.items() if v}


def assert_none_left(before: Snapshot, grace_s: float = GRACE_S) -> None:
    """Fail unless, within `grace_s`, nothing new since `before` is still held."""
    deadline = time.monotonic() + grace_s
    while True:
        # A closed handle's pipe can stay open while only a reference cycle holds it (an error
        # and its traceback, say): garbage, but an fd until the collector runs, and whether it
        # ran within the grace was luck. Collect first, so what stays is held for real.
        gc.collect()
        left = Snapshot.take().new_since(before)
        if not left:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"left over after {grace_s} s: {left}")
        time.sleep(0.05)


def listening_ports(pid: int) -> set[int]:
    """The TCP ports process `pid` listens on."""
    return _listening_ports({pid})


def mapped_segment_bytes(pid: int) -> int:
    """Bytes process `pid` maps of weightsync's shared-memory segments (unlinked ones too)."""
    total = 0
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            if f"/dev/shm/{SESSION_PREFIX}" in line:
                start, end = line.split()[0].split("-")
                total += int(end, 16) - int(start, 16)
    return total


def established_to(pid: int, port: int) -> int:
    """How many TCP connections process `pid` and its descendants hold to port `port`."""
    inodes = set().union(*(_socket_inodes(p) for p in {pid} | _children(pid)))
    count = 0
    for fields in _tcp_sockets():
        remote_port = int(fields[2].rsplit(":", 1)[1], 16)
        if fields[3] == "01" and remote_port == port and fields[9] in inodes:  # 01: ESTABLISHED
            count += 1
    return count
