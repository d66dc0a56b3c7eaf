"""`weightsync serve` backs its large tensors with transparent huge pages unless told not to."""

from __future__ import annotations

from pathlib import Path

import pytest
from replica_support import replica_pids
from serve_support import Server

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def advised_huge_kib(pid: int) -> int:
    """KiB of the process's mappings advised to use huge pages (`hg` in their VmFlags)."""
    total, size = 0, 0
    for line in Path(f"/proc/{pid}/smaps").read_text(encoding="ascii").splitlines():
        if line.startswith("Size:"):
            size = int(line.split()[1])
        elif line.startswith("VmFlags:") and "hg" in line.split()[1:]:
            total += size
    return total


needs_huge_pages = pytest.mark.skipif(
    not THP.exists() or "[never]" in THP.read_text(encoding="ascii"),
    reason="this kernel offers no transparent huge pages",
)


@needs_huge_pages
@pytest.mark.parametrize(
    ("setting", "advised"), [(None, True), ("0", False)], ids=["default", "off"]
)
def test_large_tensors_are_advised_onto_huge_pages_unless_the_environment_says_no(
    monkeypatch, setting, advised
):
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    if setting is not None:
        monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", setting)
    server = Server("tiny", "--port", "0")
    try:
        kib = advised_huge_kib(server.proc.pid)
        # The tiny preset's KV cache alone is tens of MiB.
        assert (kib >= 4096) == advised, f"{kib} KiB advised onto huge pages"
    finally:
        assert server.stop() == 0


@needs_huge_pages
def test_each_replica_of_a_data_parallel_server_advises_its_tensors_onto_huge_pages(monkeypatch):
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    server = Server("tiny", "--port", "0", "--data-parallel-size", "2")
    try:
        pids = replica_pids(server.base_url)
        assert len(pids) == 2
        kib = [advised_huge_kib(pid) for pid in pids]
        assert all(k >= 4096 for k in kib), f"KiB advised onto huge pages, per replica: {kib}"
    finally:
        assert server.stop() == 0
