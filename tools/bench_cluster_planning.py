#!/usr/bin/env python
"""Planning at cluster scale: a simulation with processes standing in for nodes, and a
projection to paper-scale clusters. Writes the "Planning at cluster scale" section of
docs/BENCHMARKS.md and a JSON file.

1. Simulation (real code): for 1, 2 and 4 "nodes" of --ranks-per-node gloo ranks each, the
   trainer's plan delivery (megatron/planning/plan_delivery.start_plan_delivery, per-node
   plan groups, planner worker processes on each node's leader) plans the iterations of a
   --dp-replica x --pp-stage layout (paper GPT hidden 4096, 32 layers, TP 2, max length 4096,
   FLAN-like lengths, replica_split "samples"); node n plans replicas n*DP/N .. and its ranks
   receive, decode and check plans of those replicas (the training side only consumes plans).
   Per node and iteration: the planning CPU time of its planner worker.
2. Projection: per-replica planning CPU time measured by plan_iteration on the real batches of
   64-1,024 GPUs (TP 2 x PP 8 = 16 GPUs per replica, so DP = GPUs / 16; 8 GPUs per node, so a
   node plans the one replica it holds a part of) at 1M and 4M tokens per batch, next to the
   predicted iteration time (the slowest replica's simulated makespan with the same analytic
   A100-like costs as tools/project_paper_scale.py) and the plan-wait share predicted for the
   trainer's default worker count (cluster.predicted_wait_share). With --global, also today's
   planning of the whole batch by one process (replica_split "micro-batches") for contrast.

    python tools/bench_cluster_planning.py                 # ~10 min of CPU on 2 cores
    python tools/bench_cluster_planning.py --quick         # 1M tokens, smaller simulation
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")        # planning is measured on one core each

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dynapipe_ext.plan.cluster_projection import markdown, project  # noqa: E402
from dynapipe_ext.report.doc_sections import write_section  # noqa: E402
from megatron.planning.cluster_sim import simulate  # noqa: E402
from tools.benchlib.workloads import machine  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="1M tokens, 16 replicas simulated, projection at 1M only")
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--dp-replicas", type=int, default=64)
    parser.add_argument("--sim-tokens", type=int, default=4 * 2**20)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--gpus", type=int, nargs="+", default=[64, 256, 512, 1024])
    parser.add_argument("--tokens", type=int, nargs="+", default=[2**20, 4 * 2**20])
    parser.add_argument("--global", dest="with_global", action="store_true",
                        help="also plan each batch the old way (whole batch, one process)")
    parser.add_argument("--output", default="runs/cluster_planning.json")
    parser.add_argument("--no-doc", action="store_true", help="do not touch docs/BENCHMARKS.md")
    parser.add_argument("--render", metavar="JSON",
                        help="only write the docs section from a JSON file this tool wrote")
    args = parser.parse_args(argv)
    if args.render:
        saved = json.loads(Path(args.render).read_text())
        write_section(REPO / "docs" / "BENCHMARKS.md", "cluster", "Planning at cluster scale",
                      markdown(saved["simulation"], saved["projection"],
                               saved.get("command", "python tools/bench_cluster_planning.py"),
                               saved["when"], saved["machine"]))
        return 0
    if args.quick:
        args.sim_tokens, args.dp_replicas, args.tokens = 2**20, 16, [2**20]
    sims = []
    for nodes in args.nodes:
        sim = simulate(nodes, args.ranks_per_node, args.sim_tokens, args.dp_replicas,
                       args.iterations)
        print(f"[sim] {nodes} node(s): planning CPU per node per iteration "
              f"{sim['node_cpu_s']:.2f} s (max {sim['node_cpu_s_max']:.2f} s), "
              f"run {sim['run_wall_s']:.0f} s", flush=True)
        sims.append(sim)
    rows = []
    for tokens in args.tokens:
        for gpus in args.gpus:
            row = project(gpus, tokens, args.with_global)
            print(f"[projection] {gpus} GPUs, {tokens:,} tokens: node planning "
                  f"{row['node_plan_s']:.3f} s, iteration {row['iteration_s']:.2f} s, wait "
                  f"{100 * row['wait_share']:.1f}%", flush=True)
            rows.append(row)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    command = "python tools/bench_cluster_planning.py " + " ".join(argv or sys.argv[1:])
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps({"simulation": sims, "projection": rows,
                                             "when": when, "machine": machine(),
                                             "command": command.strip()}, indent=1))
    if not args.no_doc:
        write_section(REPO / "docs" / "BENCHMARKS.md", "cluster", "Planning at cluster scale",
                      markdown(sims, rows, command.strip(), when, machine()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
