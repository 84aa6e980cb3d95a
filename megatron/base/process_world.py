"""A torch.distributed world of local processes: a free loopback port for the rendezvous, and
`run_in_processes`, which spawns one process per rank, collects each rank's result and ends
a hung or crashed world with a message instead of hanging (tests, the cluster-planning
simulation)."""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback


def free_local_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bound on the loopback only)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _child(fn, rank: int, world_size: int, port: int, args: tuple, results, device: str,
           ranks_per_node: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank % ranks_per_node),
                      LOCAL_WORLD_SIZE=str(ranks_per_node), DYNAPIPE_DEVICE=device)
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
                     daemon: bool = True, ranks_per_node: int | None = None) -> list:
    """Call `fn(rank, world_size, *args)` in `world_size` spawned processes (MASTER_ADDR/PORT,
    RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE set for env:// init, `ranks_per_node`
    ranks per node, default all; DYNAPIPE_DEVICE=`device`: "cpu" runs gloo even on a GPU
    host, "cuda" NCCL with rank r on GPU r). Returns the ranks' return values (picklable, e.g.
    numpy arrays); raises RuntimeError with the child traceback if any rank fails and
    TimeoutError naming the silent ranks if the timeout passes. Ranks in `may_die` are
    allowed to exit without a result (fault tests); their value is None. `daemon=False` lets
    the ranks start processes of their own (planner workers); stragglers are still ended."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_local_port()
    per_node = ranks_per_node or world_size
    procs = [ctx.Process(target=_child, args=(fn, r, world_size, port, args, results, device,
                                              per_node), daemon=daemon)
             for r in range(world_size)]
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
