"""Collectives that make the ranks of a run agree: every rank's small object, small integers
reduced over ranks, and "did any rank find a problem" (so that all ranks raise together and
none waits in a later collective for a peer that already failed). Each works unchanged without
a process group (one process)."""
from __future__ import annotations

import torch
import torch.distributed as dist


def distributed() -> bool:
    """A process group with more than one rank is up."""
    return dist.is_initialized() and dist.get_world_size() > 1


def gather_from_ranks(mine) -> list:
    """Every rank's `mine` (a small picklable object built by this run, never read from a
    file), in rank order over the default group."""
    if not distributed():
        return [mine]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def reduce_over_ranks(values: list[int], op) -> list[int]:
    """All-reduce small integers over the default group (as they are without one)."""
    tensor = torch.tensor(values, dtype=torch.int64)
    if distributed():
        if dist.get_backend() == "nccl":
            tensor = tensor.cuda()
        dist.all_reduce(tensor, op=op)
    return [int(v) for v in tensor.tolist()]


def problems_of_all_ranks(problems: list[str]) -> list[list[str]]:
    """Each rank's list of problems, in rank order, the same on every rank. Costs one integer
    all-reduce when no rank has a problem (the common case); only then gathers the texts."""
    if not distributed():
        return [list(problems)]
    if reduce_over_ranks([1 if problems else 0], dist.ReduceOp.MAX)[0] == 0:
        return [[] for _ in range(dist.get_world_size())]
    return gather_from_ranks(list(problems))
