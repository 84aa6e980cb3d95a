#!/usr/bin/env python
"""Paper-scale projection (a SIMULATION, no training): packing vs dynamic micro-batching for the
DynaPipe paper's models, predicted with the project's planners and pipeline schedule search.

Models: GPT with hidden 4096, 32 layers, 32 heads (GPT-2 vocabulary) and T5 with hidden 1024,
24 + 24 layers, 16 heads (T5 vocabulary), each on 4 pipeline stages (GPT TP=2 - one row of
8,192 tokens does not fit a 40 GiB device at TP=1 even with full recompute - T5 TP=1; DP=1); 65,536 tokens
per global batch; max length 512-8192 (T5 decoder max(128, L/4)). Costs: the AnalyticCostModel
(FLOP and byte counts per layer, A100-like figures of tools/bench_planner.py: 120 TFLOP/s
achieved, 40 GiB, bf16, 16 bytes of model state per parameter) - not a profile of this CPU:
a CPU profile of a small model says nothing reliable about A100 kernels at hidden 4096, so
the analytic model is the honest choice. Sample lengths: bench_planner's seeded FLAN-like
generator. Per global batch: plan the micro-batches (packing: next-fit rows of the max length,
its rows per micro-batch tuned by predicted time over powers of two; dynamic: the DynaPipe
planner), search the schedule (1F1B / adaptive, fastest that fits memory), and take the
simulated makespan; tokens/s = real tokens / makespan, averaged over `--batches` batches.

With --gpt-profiles / --t5-profiles, a second projection (key "cpu_fit") whose costs come from
profiles of this device: tools/profile_cost_model.py measures the real megatron-core layers
at sizes this CPU can run (hidden 256 and 512 here; a hidden-4096 layer at 8k tokens is ~1e13
FLOPs), and per layer kind, recompute mode and field a small law is fitted to all profiles of
a model by non-negative least squares in relative error (fit_cost_laws): time = a x GEMM
FLOPs + b x attention FLOPs + c x tokens x hidden + d; kept / shared / peak bytes = per
token x hidden + per head x s^2 + per s^2 + constant. Two hidden sizes separate the hidden^2
from the hidden terms. The laws are evaluated at the paper's sizes (FittedLawCostModel;
GEMM, attention and score terms divided by TP, no TP communication cost, float32 bytes read as
bf16 = x0.5, memory and model states as above). The fit's relative errors on the profiled
points are stored with its coefficients. Everything else (data, planning, schedules) is the
same as for the analytic rows.

    python tools/project_paper_scale.py --output runs/projection.json

The committed profiles (docs/cpu_profile_*.json, ~7 min of one core in all) came from

    P="python tools/profile_cost_model.py --num-layers 1 --vocab-size 2048 --repeats 3 \
       --threads 1 --recompute-modes none,selective,full --max-position-embeddings 2048"
    $P --model gpt --hidden-size 256 --num-attention-heads 4 --micro-batch-sizes 1,4 \
       --seq-lengths 64,256,1024,2048 --output docs/cpu_profile_gpt_h256.json
    $P --model gpt --hidden-size 512 --num-attention-heads 8 --micro-batch-sizes 1,4 \
       --seq-lengths 64,256,1024 --output docs/cpu_profile_gpt_h512.json
    $P --model t5 --hidden-size 256 --num-attention-heads 4 --micro-batch-sizes 1,4 \
       --seq-lengths 64,256,1024,2048 --dec-seq-lengths 32,128,512 \
       --output docs/cpu_profile_t5_h256.json
    $P --model t5 --hidden-size 512 --num-attention-heads 8 --micro-batch-sizes 1,4 \
       --seq-lengths 64,256,1024 --dec-seq-lengths 32,128,512 \
       --output docs/cpu_profile_t5_h512.json
    python tools/project_paper_scale.py --output runs/projection_cpu_fit.json \
        --gpt-profiles docs/cpu_profile_gpt_h256.json docs/cpu_profile_gpt_h512.json \
        --t5-profiles docs/cpu_profile_t5_h256.json docs/cpu_profile_t5_h512.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dynapipe_ext.plan.paper_projection import MAX_LENGTHS, project_all  # noqa: E402
from megatron.training.arguments import add_flag_group  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", required=True, help="JSON file to write")
    p.add_argument("--max-lengths", nargs="+", type=int, default=list(MAX_LENGTHS))
    p.add_argument("--batches", type=int, default=3, help="global batches per point")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--gpt-profiles", nargs="+", default=[],
                   help="tools/profile_cost_model.py GPT profiles (two hidden sizes) to fit")
    p.add_argument("--t5-profiles", nargs="+", default=[],
                   help="tools/profile_cost_model.py T5 profiles (two hidden sizes) to fit")
    add_flag_group(p, "parallel", ["pipeline_split"], title="", pipeline_split=dict(
        choices=("even", "balanced"),
        help="GPT stages: whole layers, or half layers as the trainer's --pipeline-split "
             "balanced cuts them (costed analytically here)"))
    args = p.parse_args(argv)
    paths = {m: ps for m, ps in (("gpt", args.gpt_profiles), ("t5", args.t5_profiles)) if ps}
    result = project_all(tuple(args.max_lengths), args.batches, args.seed, paths or None,
                         args.pipeline_split)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=1))
    for r in result["rows"]:
        cut = f"  cut {r['pipeline_cut']}" if r.get("pipeline_cut") else ""
        print(f"{r['model']} {r['max_len']:>5} {r['strategy']:<8} "
              f"{r['tokens_per_s']:>12,.0f} tokens/s  {r['speedup_vs_packing']:.2f}x{cut}")
    for r in result.get("cpu_fit", {}).get("rows", []):
        print(f"cpu-fit {r['model']} {r['max_len']:>5} {r['strategy']:<8} "
              f"{r['tokens_per_s']:>12,.2f} tokens/s  {r['speedup_vs_packing']:.2f}x")
    for model, fit in result.get("cpu_fit", {}).get("fits", {}).items():
        print(f"cpu-fit {model} law error (worst over kinds/modes): {fit['summary']}")
    print(f"wrote {args.output} in {result['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
