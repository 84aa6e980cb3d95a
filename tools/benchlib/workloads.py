"""The machine a benchmark ran on, as its report states it."""
from __future__ import annotations

import os
import platform
from pathlib import Path

import numpy as np


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = ""
    if hasattr(os, "getloadavg"):
        load = f", load average {os.getloadavg()[0]:.1f} at the end of the run"
    return (f"{cpu}, {os.cpu_count()} logical CPUs, Python {platform.python_version()}, "
            f"numpy {np.__version__}, 1 thread{load}")
