"""Where a benchmark's figures come from, as its JSON records them: the commit (and the tracked
files that differed from it), the UTC start date, the exact command, the machine (CPU
model, logical cores, Python, torch) and the load average before and after the run."""
from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (else what platform says)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit() -> tuple[str, list[str]]:
    """(short commit of HEAD, tracked files that differ from it); ("unknown", []) outside a
    git checkout."""
    def git(*args) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, text=True,
                              capture_output=True).stdout.strip()
    commit = git("rev-parse", "--short", "HEAD")
    if not commit:
        return "unknown", []
    changed = git("status", "--porcelain", "--untracked-files=no").splitlines()
    return commit, [line[3:] for line in changed]


def machine_fields() -> dict:
    """CPU model, logical cores, Python and torch versions of this machine."""
    try:
        import torch
        torch_version = torch.__version__
    except ImportError:
        torch_version = None
    return {"cpu_model": cpu_model(), "logical_cpus": os.cpu_count(),
            "python": platform.python_version(), "torch": torch_version}


def provenance_start(command: str) -> dict:
    """The provenance fields known when a run starts (see provenance_end)."""
    commit, changed = git_commit()
    started = datetime.datetime.now(datetime.timezone.utc)
    return {"commit": commit, "uncommitted_changes": changed,
            "date": started.strftime("%Y-%m-%d %H:%M UTC"), "started_utc": started.isoformat(),
            "command": command.strip(), "machine_fields": machine_fields(),
            "load_average_before": list(os.getloadavg())}


def provenance_end(start: dict) -> dict:
    """`start` with the load average after the run and the wall time since it started."""
    started = datetime.datetime.fromisoformat(start["started_utc"])
    now = datetime.datetime.now(datetime.timezone.utc)
    return dict(start, load_average_after=list(os.getloadavg()),
                wall_s=(now - started).total_seconds())
