"""`weightsync serve` backs its large tensors with transparent huge pages unless told not to."""

from __future__ import annotations

from pathlib import Path

import pytest
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


@pytest.mark.skipif(
    not THP.exists() or "[never]" in THP.read_text(encoding="ascii"),
    reason="this kernel offers no transparent huge pages",
)
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
