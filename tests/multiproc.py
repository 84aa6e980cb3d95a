"""Run a function in N fresh processes that form a torch.distributed world (gloo on CPU unless
asked for CUDA), with a hard timeout: a hung or crashed rank fails the test with a message
instead of hanging CI."""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from contextlib import contextmanager


def free_port() -> int:
    """A TCP port that was free a moment ago on localhost."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def single_process_world(seed: int):
    """This process as a world of one (TP=PP=1) for the duration of the block; the
    environment variables it sets are restored afterwards, so later subprocesses (which
    read MASTER_PORT / WORLD_SIZE) do not inherit a port this process still holds."""
    from megatron.base.distributed_setup import setup_model_parallel, teardown_model_parallel
    names = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                      WORLD_SIZE="1")
    try:
        setup_model_parallel(1, 1, seed=seed)
        yield
    finally:
        teardown_model_parallel()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _child(fn, rank: int, world_size: int, port: int, args: tuple, results,
           device: str = "cpu") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), DYNAPIPE_DEVICE=device)
    import torch
    torch.set_num_threads(1)
    try:
        results.put((rank, "ok", fn(rank, world_size, *args)))
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()


def run_in_processes(fn, world_size: int, args: tuple = (), timeout_s: float = 240.0,
                     may_die: tuple[int, ...] = (), device: str = "cpu",
                     daemon: bool = True) -> list:
    """Call `fn(rank, world_size, *args)` in `world_size` spawned processes (MASTER_ADDR/PORT,
    RANK, WORLD_SIZE and LOCAL_RANK set for env:// init; DYNAPIPE_DEVICE=`device`: "cpu"
    runs gloo even on a GPU host, "cuda" NCCL with rank r on GPU r). Returns the ranks' return values (picklable, e.g.
    numpy arrays); raises RuntimeError with the child traceback if any rank fails and
    TimeoutError naming the silent ranks if the timeout passes. Ranks in `may_die` are
    allowed to exit without a result (fault tests); their value is None. `daemon=False` lets
    the ranks start processes of their own (planner workers); stragglers are still ended."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world_size, port, args, results, device),
                         daemon=daemon) for r in range(world_size)]
    for p in procs:
        p.start()
    done: dict[int, object] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(done) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                silent = sorted(set(range(world_size)) - set(done))
                raise TimeoutError(f"ranks {silent} of {world_size} did not finish within "
                                   f"{timeout_s:.0f} s")
            try:
                rank, status, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                for r in may_die:
                    if r not in done and procs[r].exitcode is not None:
                        done[r] = None
                dead = [r for r, p in enumerate(procs)
                        if r not in done and p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"ranks {dead} exited with codes "
                                       f"{[procs[r].exitcode for r in dead]} without a result")
                continue
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            done[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    return [done.get(r) for r in range(world_size)]
