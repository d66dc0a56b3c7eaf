"""What machine produced a benchmark result: recorded in every results file as `machine`.

Figures from different machines are not comparable; the docs' performance page prints this beside
each file's chart.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

import torch


def _cpu_model() -> str:
    """The CPU's marketing name (Linux: /proc/cpuinfo), else whatever the platform reports."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def describe_machine() -> dict[str, Any]:
    """Cores, CPU model, GPU (if any), OS, Python and torch versions of this machine."""
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {
        "cores": os.cpu_count(),
        "cpu": _cpu_model(),
        "gpus": gpus,
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
