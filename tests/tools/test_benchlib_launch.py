"""The benchmarks' torchrun launcher: a group past its time limit ends, workers included."""
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

from tools.benchlib.launch import run_group  # noqa: E402
from tools.benchlib.ports import free_port  # noqa: E402


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_group_past_its_limit_ends_with_its_workers(tmp_path):
    """torchrun starts each worker in a session of its own, so ending torchrun alone would
    leave the worker running; run_group ends both and reports the limit (status None)."""
    pid_file = tmp_path / "pid"
    script = tmp_path / "sleeper.py"
    # the worker lets go of torchrun's output pipe, so that a worker left running cannot
    # hold run_group's read of it open (it would wait for the sleep to end)
    script.write_text("import os, time\n"
                      "null = os.open(os.devnull, os.O_WRONLY)\n"
                      "os.dup2(null, 1)\nos.dup2(null, 2)\n"
                      f"open({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(600)\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script)]
    output, status = run_group(cmd, timeout_s=20, grace_s=20)
    assert status is None
    worker = int(pid_file.read_text())          # the worker had started
    for _ in range(50):                         # reaped a moment after torchrun returns
        if not alive(worker):
            break
        time.sleep(0.1)
    assert not alive(worker), output[-2000:]


def test_a_group_that_ends_in_time_gives_its_output_and_status(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("print('from the worker')\nraise SystemExit(3)\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script)]
    output, status = run_group(cmd, timeout_s=120)
    assert status != 0 and status is not None
    assert "from the worker" in output
