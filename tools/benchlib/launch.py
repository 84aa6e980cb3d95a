"""Running a torchrun group to its end, or ending all of it at a time limit."""
from __future__ import annotations

import signal
import subprocess


def run_group(cmd: list[str], timeout_s: float, grace_s: float = 30.0,
              **popen_kwargs) -> tuple[str, int | None]:
    """Run `cmd` (a torchrun command line): its stdout and stderr as one text and its exit
    status, or None for the status when it ran past `timeout_s`. torchrun starts every worker
    in a session of its own, so killing torchrun (or its process group) would leave the
    workers running, on a GPU holding the device from whatever runs next; SIGTERM lets
    torchrun end them first, SIGKILL follows after `grace_s`."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            **popen_kwargs)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
        return output, proc.returncode
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            output, _ = proc.communicate(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
        return output, None
