"""Process groups, seeds and the CPU workarounds megatron-core 0.16.1 needs (docs/DESIGN.md, 1).

`setup_model_parallel` is the one entry point: it checks the layout on every rank before any
collective, starts `torch.distributed` (gloo on CPU, NCCL on GPU; DYNAPIPE_DEVICE=cpu forces
gloo on a GPU host) with a timeout, builds the megatron-core TP/PP/DP groups and the pipeline's
per-direction transfer groups, warms every pipeline pair's transfer path up, seeds the RNGs
and, on CPU, installs an attention score buffer that lives on the CPU and grows on demand.
"""
from __future__ import annotations

import atexit
import datetime
import operator
import os
import sys
from dataclasses import dataclass
from functools import reduce
from typing import NoReturn

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.utils import GlobalMemoryBuffer

from megatron.base.process_world import free_local_port
from megatron.base.rng import seed_model_parallel

DEFAULT_TIMEOUT_S = 120.0
DEVICE_ENV = "DYNAPIPE_DEVICE"    # "cpu": gloo and CPU tensors even where CUDA is visible


def use_cuda() -> bool:
    """Whether this process trains on a GPU: CUDA is visible and DYNAPIPE_DEVICE is not 'cpu'
    (the CPU test suite sets it, so its multi-rank tests run on gloo on a GPU host too)."""
    choice = os.environ.get(DEVICE_ENV, "").strip().lower()
    if choice not in ("", "cpu", "cuda"):
        raise ValueError(f"{DEVICE_ENV}={choice!r}: use 'cpu', 'cuda' or leave it unset")
    return choice != "cpu" and torch.cuda.is_available()


@dataclass(frozen=True)
class ParallelLayout:
    """Where this process sits: tensor, pipeline and data-parallel degree and rank."""

    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    rank: int
    world_size: int
    device: torch.device

    @classmethod
    def data_parallel(cls, rank: int, world_size: int) -> "ParallelLayout":
        """A world of pure data parallelism (TP = PP = 1) on the CPU, for code that needs
        only where a rank sits (checkpoint files of a process group without model parallel
        groups)."""
        return cls(tp=1, pp=1, dp=world_size, tp_rank=0, pp_rank=0, dp_rank=rank, rank=rank,
                   world_size=world_size, device=torch.device("cpu"))


def check_parallel_sizes(world_size: int, tp: int, pp: int, total_layers: int | None = None,
                         num_stages: int | None = None, vocab_size: int | None = None,
                         num_attention_heads: int | None = None) -> int:
    """Return the data-parallel degree or raise a ValueError naming what does not fit.
    Pure arithmetic, so every rank raises the same error before any collective."""
    if tp < 1 or pp < 1:
        raise ValueError(f"tensor ({tp}) and pipeline ({pp}) parallel sizes must be >= 1")
    if world_size % (tp * pp):
        raise ValueError(f"world size {world_size} is not divisible by tensor-parallel size {tp} "
                         f"x pipeline-parallel size {pp} = {tp * pp}")
    stages = num_stages if num_stages is not None else pp
    if stages % pp:
        raise ValueError(f"{stages} pipeline stages cannot be laid out on {pp} pipeline ranks")
    if total_layers is not None and total_layers % stages:
        raise ValueError(f"{total_layers} transformer layers do not split evenly over "
                         f"{stages} pipeline stages")
    if vocab_size is not None and vocab_size % tp:
        raise ValueError(f"vocabulary size {vocab_size} is not divisible by tensor-parallel size "
                         f"{tp}; pad the vocabulary to a multiple of {tp}")
    if num_attention_heads is not None and num_attention_heads % tp:
        raise ValueError(f"{num_attention_heads} attention heads are not divisible by "
                         f"tensor-parallel size {tp}")
    return world_size // (tp * pp)


class CpuGlobalMemoryBuffer(GlobalMemoryBuffer):
    """megatron-core's scratch buffer for attention scores, kept on the CPU.
    The stock one allocates on `torch.cuda.current_device()` whenever it must grow."""

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        needed = reduce(operator.mul, tensor_shape, 1)
        current = self.buffer.get((name, dtype))
        if current is None or current.numel() < needed:
            self.buffer[(name, dtype)] = torch.empty(needed, dtype=dtype, requires_grad=False)
        return self.buffer[(name, dtype)][:needed].view(tensor_shape)


def install_cpu_memory_buffer() -> None:
    """Replace megatron-core's global memory buffer by the CPU one (idempotent)."""
    if not isinstance(parallel_state._GLOBAL_MEMORY_BUFFER, CpuGlobalMemoryBuffer):
        parallel_state._GLOBAL_MEMORY_BUFFER = CpuGlobalMemoryBuffer()


def seed_everything(seed: int, on_gpu: bool | None = None) -> None:
    """Seed torch and megatron-core's RNG tracker per rank as Megatron-LM does (the streams
    dropout draws from; megatron/base/rng.py), on the CPU generator when not on a GPU."""
    seed_model_parallel(seed, parallel_state.get_tensor_model_parallel_rank(),
                        parallel_state.get_pipeline_model_parallel_rank(),
                        use_cuda() if on_gpu is None else on_gpu)


def rendezvous_url(world_size: int) -> str:
    """torch.distributed's init_method: "env://" when MASTER_ADDR and MASTER_PORT are set
    (torchrun, or the user), else tcp:// on the given address or 127.0.0.1 and the given port,
    a free local one for a world of one process, or 29500 (every rank must agree). Nothing goes
    into os.environ, so subprocesses started later do not inherit a port this process holds."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if addr and port:
        return "env://"
    addr = addr or "127.0.0.1"
    port = port or str(free_local_port() if world_size == 1 else 29500)
    host = f"[{addr}]" if ":" in addr and not addr.startswith("[") else addr   # IPv6 literal
    return f"tcp://{host}:{port}"


def setup_model_parallel(tp: int = 1, pp: int = 1, seed: int = 1234,
                         timeout_s: float = DEFAULT_TIMEOUT_S, backend: str | None = None,
                         total_layers: int | None = None, num_stages: int | None = None,
                         vocab_size: int | None = None,
                         num_attention_heads: int | None = None) -> ParallelLayout:
    """Start torch.distributed (RANK, WORLD_SIZE, MASTER_ADDR/PORT as set by torchrun; without
    them a world of one on a free local port, see rendezvous_url) if needed, check the layout,
    build megatron-core's groups and seed.
    Raises ValueError on every rank, before any collective, when the sizes do not fit."""
    world_size = dist.get_world_size() if dist.is_initialized() else int(
        os.environ.get("WORLD_SIZE", "1"))
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    try:
        check_parallel_sizes(world_size, tp, pp, total_layers, num_stages, vocab_size,
                             num_attention_heads)
    except ValueError as err:
        raise ValueError(f"rank {rank}: {err}") from None
    on_gpu = use_cuda() and backend != "gloo"
    backend = backend or ("nccl" if on_gpu else "gloo")
    if on_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=rendezvous_url(world_size), rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    # megatron-core turns this into timedelta(minutes=...), so a fraction of a minute works too.
    timeout_min = timeout_s / 60.0
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tp, pp, distributed_timeout_minutes=timeout_min)
    global _P2P_GROUPS
    _P2P_GROUPS = make_pipeline_p2p_groups(datetime.timedelta(seconds=timeout_s))
    warm_up_pipeline_transfers(_P2P_GROUPS, current_layout().device)
    if not on_gpu:
        install_cpu_memory_buffer()
    seed_everything(seed, on_gpu)
    return current_layout()


_P2P_GROUPS = None


def make_pipeline_p2p_groups(timeout: datetime.timedelta) -> tuple:
    """Two process groups over this rank's pipeline group: one carries the transfers towards
    higher pipeline ranks, the other those towards lower ones. NCCL runs a pair's operations of
    one group in posting order on one stream, so with a single group a receive posted early
    could hold back a send to the same peer; per direction, each pair's stream carries only
    sends one way, in the order both sides' plans agree on (dynapipe_ext/plan/lowering.py)."""
    mine = dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    groups = None
    for ranks in sorted({tuple(r) for r in everyone}):   # same creation order on every rank
        pair = tuple(dist.new_group(list(ranks), timeout=timeout) for _ in range(2))
        if tuple(ranks) == tuple(mine):
            groups = pair
    return groups


def warm_up_pipeline_transfers(groups: tuple, device: torch.device) -> dict:
    """One tiny exchange between neighbouring pipeline ranks on each direction's group, with
    the same isend/irecv calls the handlers use. NCCL creates a pair's communicator on the
    pair's first operation and blocks the host until the peer joins; done here, at set-up, no
    SendXStart / RecvXStart of a plan is ever such a rendezvous (lowering.py's deadlock
    argument assumes it is not). Neighbours are the pairs the trainer's layouts use (linear
    and wave: stage s and s+1 sit on adjacent pipeline ranks). The same code runs on gloo.
    Each rank first receives from the side the traffic comes from, then sends on, so the
    chain of communicator creations always completes. Returns {(direction, peer pipeline
    rank): the pipeline rank that peer sent} (direction 0: towards higher ranks)."""
    received = {}
    if groups is None:
        return received
    me, size = dist.get_rank(groups[0]), dist.get_world_size(groups[0])
    for direction, group in enumerate(groups):
        step = 1 if direction == 0 else -1
        source, target = me - step, me + step
        works, buffers = [], {}
        if 0 <= source < size:
            buffers[source] = torch.full((1,), -1, dtype=torch.int64, device=device)
            works.append(dist.irecv(buffers[source], dist.get_global_rank(group, source),
                                    group=group))
        if 0 <= target < size:
            works.append(dist.isend(torch.full((1,), me, dtype=torch.int64, device=device),
                                    dist.get_global_rank(group, target), group=group))
        for work in works:
            work.wait()
        received.update({(direction, peer): int(t.item()) for peer, t in buffers.items()})
    bad = {k: v for k, v in received.items() if v != k[1]}
    if bad:
        raise RuntimeError(f"pipeline rank {me}: transfer warm-up received {bad} "
                           f"((direction, peer): value), expected each peer's own rank")
    return received


def pipeline_p2p_groups() -> tuple:
    """(towards higher pipeline ranks, towards lower pipeline ranks), made by
    setup_model_parallel; group ranks equal pipeline ranks."""
    if _P2P_GROUPS is None:
        raise RuntimeError("pipeline_p2p_groups() before setup_model_parallel()")
    return _P2P_GROUPS


def current_layout() -> ParallelLayout:
    """The layout of this process as megatron-core's parallel_state sees it."""
    return ParallelLayout(
        tp=parallel_state.get_tensor_model_parallel_world_size(),
        pp=parallel_state.get_pipeline_model_parallel_world_size(),
        dp=parallel_state.get_data_parallel_world_size(),
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        rank=dist.get_rank(), world_size=dist.get_world_size(),
        device=torch.device("cuda", torch.cuda.current_device()) if (
            use_cuda() and dist.get_backend() == "nccl") else torch.device("cpu"))


def teardown_model_parallel() -> None:
    """Destroy megatron-core's groups and the default process group."""
    global _P2P_GROUPS
    _P2P_GROUPS = None
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def end_process(code: int) -> NoReturn:
    """Leave a torch.distributed process with exit status `code`: tear the groups down (after
    a success only: after a failure a peer may be gone), run the atexit handlers (planner
    workers are stopped there), flush stdout / stderr, then `os._exit`, skipping CPython's
    interpreter finalization.

    Why not a plain `sys.exit`: gloo's worker threads release the tensors of finished
    collectives, and that takes the GIL. During finalization CPython ends any other thread
    that asks for the GIL with `pthread_exit`, whose forced unwind through torch's C++ aborts
    the whole process ("terminate called without an active exception", SIGABRT) after a run
    that succeeded. Destroying the process groups does not close the window: a group's
    threads stop only when its last reference, some held inside torch, goes."""
    try:
        if code == 0:
            teardown_model_parallel()
        atexit._run_exitfuncs()    # what finalization would have run first
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)
