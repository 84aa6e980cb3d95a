"""Planning at cluster scale: which ranks form a node, which data-parallel replicas a node
plans, how many planner workers a node runs, and what plan wait that predicts.

Every node plans the replicas that have a rank on it (its planning leader, the node's lowest
rank, runs the planner workers) and sends the plans to its own ranks only; with
replica_split "samples" (iteration_planner) a node's planning work per iteration is the
samples of its replicas, not the whole batch. Nodes follow torchrun: global ranks are
numbered node by node, LOCAL_WORLD_SIZE ranks each."""
from __future__ import annotations

import math
import os
from typing import Sequence


def ranks_per_node_from_env(world_size: int) -> int:
    """Ranks per node as torchrun says (LOCAL_WORLD_SIZE), else the whole world (one node)."""
    value = os.environ.get("LOCAL_WORLD_SIZE")
    if not value:
        return world_size
    try:
        size = int(value)
    except ValueError:
        raise ValueError(f"LOCAL_WORLD_SIZE must be an integer, got {value!r}") from None
    return size


def default_replica_split(world_size: int, ranks_per_node: int) -> str:
    """'--replica-split auto': the whole-batch split ('micro-batches', best balance) while
    the run is one node; 'samples' once it spans several, where planning the whole batch on
    every node would not keep up (docs/BENCHMARKS.md, "Planning at cluster scale")."""
    return "samples" if world_size > ranks_per_node else "micro-batches"


def node_ranks(rank: int, world_size: int, ranks_per_node: int) -> list[int]:
    """The global ranks of `rank`'s node (torchrun numbering: node n holds ranks
    n*ranks_per_node .. (n+1)*ranks_per_node - 1)."""
    if ranks_per_node < 1 or world_size % ranks_per_node:
        raise ValueError(f"{world_size} ranks cannot form nodes of {ranks_per_node} ranks "
                         f"(ranks per node, LOCAL_WORLD_SIZE, must divide the world size)")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size}")
    first = rank - rank % ranks_per_node
    return list(range(first, first + ranks_per_node))


def all_nodes(world_size: int, ranks_per_node: int) -> list[list[int]]:
    """The ranks of every node, node 0 first."""
    return [node_ranks(r, world_size, ranks_per_node)
            for r in range(0, world_size, ranks_per_node)]


def node_replicas(dp_ranks: Sequence[int]) -> tuple[int, ...]:
    """The replicas a node plans: those of its ranks (`dp_ranks`, one per rank)."""
    return tuple(sorted(set(int(d) for d in dp_ranks)))


def block_replicas(node: int, num_nodes: int, dp_size: int) -> tuple[int, ...]:
    """Replicas of `node` when `dp_size` replicas lie on `num_nodes` nodes in order (for
    simulations whose processes stand in for nodes of a bigger layout)."""
    if not 0 <= node < num_nodes or dp_size < num_nodes or dp_size % num_nodes:
        raise ValueError(f"{dp_size} replicas cannot be laid on {num_nodes} nodes evenly "
                         f"(node {node})")
    per = dp_size // num_nodes
    return tuple(range(node * per, (node + 1) * per))


# ------------------------------------------------------------------ planner workers

def free_cores(ranks_per_node: int, cores: int | None = None) -> int:
    """Cores of this node left after one per training rank (os.sched_getaffinity: the cores
    this process may use)."""
    if cores is None:
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:   # not Linux
            cores = os.cpu_count() or 1
    return max(0, cores - ranks_per_node)


def auto_num_workers(free: int, plan_s: float, iteration_s: float | None,
                     margin: float = 1.5, cap: int = 16) -> tuple[int, str]:
    """Planner workers for a node and why: enough that `margin` x the planning time of one
    iteration (`plan_s`, one worker) fits in one iteration (`iteration_s`: plans come one
    per iteration, so W workers keep up when plan_s / W <= iteration_s), at least 1, at most
    the free cores and `cap`. Without an iteration time yet (`None`), as many as there are
    free cores, up to 2."""
    limit = max(1, min(cap, free))
    if iteration_s is None or iteration_s <= 0:
        need = min(2, limit)
        return need, (f"{need} (no iteration time measured yet; {free} free core(s))")
    need = max(1, math.ceil(margin * plan_s / iteration_s))
    workers = min(need, limit)
    why = (f"{workers} (planning {plan_s:.3g} s per iteration on one core, iterations "
           f"{iteration_s:.3g} s, x{margin:g} margin -> {need}; {free} free core(s))")
    return workers, why


def predicted_wait_share(plan_s: float, iteration_s: float, workers: int) -> float:
    """Steady-state share of time the trainer waits for plans when `workers` plan ahead in
    parallel: iterations come every max(iteration_s, plan_s / workers) seconds, and the
    excess over iteration_s is waiting."""
    if workers < 1 or iteration_s <= 0:
        raise ValueError(f"workers must be >= 1 and iteration_s > 0, got {workers}, "
                         f"{iteration_s}")
    period = max(iteration_s, plan_s / workers)
    return (period - iteration_s) / period
