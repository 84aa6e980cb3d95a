"""Planning at cluster scale, the simulation (real code): processes stand in for nodes, each of
gloo ranks running the trainer's plan delivery (per-node plan groups, planner workers on each
node's leader) for the paper-GPT layout of dynapipe_ext.plan.cluster_projection; per node and
iteration, the planning CPU time of its planner worker. tools/bench_cluster_planning.py runs
it."""
from __future__ import annotations

import datetime
import functools
import time

import numpy as np

from dynapipe_ext.plan.cluster import block_replicas
from dynapipe_ext.plan.cluster_projection import PP, batch_lengths, paper_config
from megatron.base.process_world import run_in_processes


def _sim_rank(rank: int, world: int, nodes: int, tokens: int, dp: int, iterations: int,
              workers: int) -> dict:
    """One rank of the simulation: real plan delivery; node leaders plan, every rank decodes
    and checks its plans."""
    import torch.distributed as dist
    from megatron.planning.plan_delivery import start_plan_delivery
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=1800))
    per_node = world // nodes
    node, j = divmod(rank, per_node)
    replicas = block_replicas(node, nodes, dp)
    dp_rank, pp_rank = replicas[j % len(replicas)], j % PP
    delivery = start_plan_delivery(paper_config(tokens, dp),
                                   functools.partial(batch_lengths, tokens), rank, world,
                                   dp_rank, pp_rank, 0, iterations, num_workers=workers,
                                   prefetch=1, timeout_s=1800, replicas=replicas)
    rows = []
    with delivery:
        for it in range(iterations):
            got = delivery.fetch(it)
            assert (got.plan.iteration, got.plan.dp_rank, got.plan.pp_rank) == \
                (it, dp_rank, pp_rank), (rank, it)
            timings = got.planning_ms or {}
            rows.append({"iteration": it, "wait_s": got.wait_s,
                         "cpu_s": timings.get("cpu", 0.0) / 1e3,
                         "wall_s": timings.get("total", 0.0) / 1e3})
        dist.barrier()
    return {"node": node, "leader": delivery.is_leader, "replicas": len(replicas),
            "rows": rows}


def simulate(nodes: int, ranks_per_node: int, tokens: int, dp: int, iterations: int,
             workers: int = 1, timeout_s: float = 3600.0) -> dict:
    """Run the simulation with `nodes` x `ranks_per_node` processes; per-node planning times."""
    world = nodes * ranks_per_node
    start = time.monotonic()
    done = run_in_processes(_sim_rank, world, (nodes, tokens, dp, iterations, workers),
                            timeout_s=timeout_s, daemon=False, ranks_per_node=ranks_per_node)
    wall = time.monotonic() - start
    leaders = [v for v in done if v["leader"]]
    later = [row for v in leaders for row in v["rows"] if row["iteration"] > 0]
    waits = [row["wait_s"] for v in done for row in v["rows"] if row["iteration"] > 0]
    return {"nodes": nodes, "ranks": world, "dp": dp, "tokens": tokens,
            "replicas_per_node": dp // nodes, "iterations": iterations,
            "node_cpu_s": float(np.mean([r["cpu_s"] for r in later])),
            "node_cpu_s_max": float(np.max([r["cpu_s"] for r in later])),
            "node_wall_s": float(np.mean([r["wall_s"] for r in later])),
            "max_wait_s": float(max(waits)), "run_wall_s": wall}
