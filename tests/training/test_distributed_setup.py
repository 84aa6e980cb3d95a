"""setup_model_parallel's rendezvous: torchrun's MASTER_ADDR/PORT used as given; without them a
world of one on a free loopback port that does not leak into os.environ (later subprocesses
would inherit it and collide with whatever holds the old fixed default)."""
import errno
import os
import socket
import subprocess
import sys

import pytest

from megatron.base.distributed_setup import rendezvous_url

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NAMES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


def test_torchrun_environment_is_used_as_given(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.7")
    monkeypatch.setenv("MASTER_PORT", "29400")
    assert rendezvous_url(4) == "env://"


def test_defaults_do_not_touch_the_environment(monkeypatch):
    for name in NAMES:
        monkeypatch.delenv(name, raising=False)
    url = rendezvous_url(1)
    assert "MASTER_PORT" not in os.environ and "MASTER_ADDR" not in os.environ
    assert url.startswith("tcp://127.0.0.1:")
    port = int(url.rsplit(":", 1)[1])
    with socket.socket() as sock:                  # it was free on the loopback
        sock.bind(("127.0.0.1", port))
    assert rendezvous_url(2) == "tcp://127.0.0.1:29500"   # every rank must agree on it
    monkeypatch.setenv("MASTER_PORT", "29400")
    assert rendezvous_url(2) == "tcp://127.0.0.1:29400"
    monkeypatch.setenv("MASTER_ADDR", "::1")
    monkeypatch.delenv("MASTER_PORT")
    assert rendezvous_url(2) == "tcp://[::1]:29500"


CHILD = """
import os, torch, torch.distributed as dist
from megatron.base.distributed_setup import setup_model_parallel, teardown_model_parallel
layout = setup_model_parallel(1, 1, seed=1, timeout_s=30)
t = torch.ones(2)
dist.all_reduce(t)
assert layout.world_size == 1 and t.tolist() == [1.0, 1.0]
leaked = {n: os.environ[n] for n in ("MASTER_ADDR", "MASTER_PORT") if n in os.environ}
assert not leaked, f"left in os.environ: {leaked}"
teardown_model_parallel()
print("OK")
"""


@pytest.mark.slow
def test_in_process_world_picks_a_free_port_and_leaves_no_trace():
    """A world of one started without MASTER_PORT while 29500 (the old fixed default) is held
    by someone else: it still starts, and its port is not left for children to inherit."""
    env = {k: v for k, v in os.environ.items() if k not in NAMES}
    env.update(PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    holder = socket.socket()
    try:
        try:
            holder.bind(("127.0.0.1", 29500))
            holder.listen(1)
        except OSError as err:                     # another job has it: just as good
            assert err.errno == errno.EADDRINUSE
        done = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=120)
    finally:
        holder.close()
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stderr[-3000:]


END_SCRIPT = """
import atexit, sys
import torch.distributed as dist
from megatron.base.distributed_setup import end_process, setup_model_parallel

class Finalized:
    def __del__(self):
        print("finalized", flush=True)

KEEP = Finalized()        # a module global: only interpreter finalization deletes it
setup_model_parallel(1, 1)
atexit.register(lambda: print(f"atexit ran, groups up: {dist.is_initialized()}"))
sys.stdout.write("last words")    # no newline: a pipe holds it until a flush
end_process(int(sys.argv[1]))
"""


@pytest.mark.parametrize("status", [0, 3])
def test_end_process_exits_with_the_status_without_finalizing(status):
    """end_process: the atexit handlers run (after the groups were torn down, on success only),
    buffered output is flushed, the status comes through, and interpreter finalization (where
    gloo's threads abort the process) does not run."""
    env = {k: v for k, v in os.environ.items() if k not in NAMES}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, "-c", END_SCRIPT, str(status)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == status, done.stderr[-3000:]
    assert "last words" in done.stdout
    assert f"atexit ran, groups up: {status != 0}" in done.stdout
    assert "finalized" not in done.stdout
