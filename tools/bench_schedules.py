"""Benchmark pipeline schedules on FLAN-like heterogeneous micro-batches.

Two comparisons at equal memory: (1) the textbook case (even stages, F = 1, B = 2 per rank's
share of the model) for P in {2, 4, 8} and m in {P, 2P, 4P}: 1F1B, interleaved 1F1B (v = 2, 4),
Hanayo's wave (W = 1, 2, 4) and adaptive, all under 1F1B's own peak as the per-rank activation
cap, each bubble share next to its analytic figure; (2) simulated makespan and bubble fraction
of 1f1b, adaptive, interleaved (v = 2) and wave (W = 1, 2) on micro-batches cut by the
project's planners from seeded long-tailed sample lengths, under the cost model's activation
limit. Plus the median wall / CPU time of full plan generation (schedule search, lowering, plan
check) for 64 dynamic-planner micro-batches on 8 stages (issue 4's target). Writes the
"Schedules" section of docs/BENCHMARKS.md and docs/bench_schedules.json. Also run by
`python tools/bench_planner.py --schedules`.

    python tools/bench_schedules.py [--quick] [--timing-only]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")   # one core, as the target says; set before numpy loads

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dynapipe_ext.costs.cost_model import AnalyticCostModel  # noqa: E402
from dynapipe_ext.plan.lowering import lower  # noqa: E402
from dynapipe_ext.costs.model_spec import ModelSpec  # noqa: E402
from dynapipe_ext.plan.plan_checker import check_plans  # noqa: E402
from dynapipe_ext.batching.planners import PlannerConfig, plan_micro_batches  # noqa: E402
from dynapipe_ext.schedule.registry import SCHEDULE_NAMES, auto_candidates  # noqa: E402
from dynapipe_ext.schedule.schedule_search import (evaluate_candidates,  # noqa: E402
                                                   micro_batch_costs, search_schedule)
from dynapipe_ext.schedule.schedules import hanayo, interleaved_one_f_one_b  # noqa: E402
from dynapipe_ext.schedule.simulator import CommModel, PipelineCosts  # noqa: E402
from dynapipe_ext.batching.synthetic import flan_like_lengths  # noqa: E402
from dynapipe_ext.report.doc_sections import write_section  # noqa: E402
from tools.benchlib.provenance import provenance_end, provenance_start  # noqa: E402
from tools.benchlib.workloads import machine  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SPEC = ModelSpec("gpt", num_layers=32, hidden_size=2048, num_attention_heads=16, vocab_size=32000)
COMM = CommModel(latency_ms=0.02, bandwidth_bytes_per_ms=25e6)   # 25 GB/s links
MAX_SEQ_LEN = 2048


def flan_like_gpt_lengths(num_samples: int, seed: int) -> np.ndarray:
    """GPT sample lengths (input + target + EOD, truncated to MAX_SEQ_LEN) from
    the seeded FLAN-like generator (dynapipe_ext.batching.synthetic)."""
    inputs, targets = flan_like_lengths(num_samples, seed)
    return np.minimum(inputs + targets + 1, MAX_SEQ_LEN)


def cost_model(num_ranks: int) -> AnalyticCostModel:
    return AnalyticCostModel(SPEC, device_flops=100e12, device_mem_bytes=40 * 2**30,
                             dtype_bytes=2, num_stages=num_ranks)


def planned_micro_batches(num_ranks: int, strategy: str, num_samples: int, seed: int):
    model = cost_model(num_ranks)
    config = PlannerConfig(model="gpt", max_seq_len=MAX_SEQ_LEN, pipeline_stages=num_ranks,
                           dynamic_layout="padded")
    lengths = flan_like_gpt_lengths(num_samples, seed)
    return plan_micro_batches(lengths, config, model, strategy).micro_batches, model


def time_cv(costs: PipelineCosts) -> float:
    """Coefficient of variation of per-micro-batch compute time (heterogeneity)."""
    total = (costs.fwd_ms + costs.bwd_ms).sum(axis=1)
    return float(total.std() / total.mean())


def candidate_rows(found, limit: float) -> dict:
    """Per candidate: simulated makespan, mean bubble, peak / limit, fit and chosen order
    (or the reason it could not be built)."""
    rows = {}
    for cand in found:
        res = cand.result
        rows[cand.name] = ({"error": cand.reason} if res is None else
                           {"makespan_ms": res.makespan_ms, "bubble": res.mean_bubble_fraction,
                            "peak_over_limit": res.max_peak_memory_bytes / limit,
                            "fits": res.fits(limit), "chosen_order": res.schedule.name})
    return rows


TEXTBOOK_COLUMNS = (("1f1b", "1f1b", 1), ("interleaved2", "interleaved", 2),
                    ("interleaved4", "interleaved", 4), ("wave1", "wave", 1),
                    ("wave2", "wave", 2), ("wave4", "wave", 4), ("adaptive", "adaptive", 1))


def textbook(num_ranks: int, num_mb: int) -> dict:
    """Even stages, F = 1 and B = 2 per micro-batch for a rank's share of the model (P / n
    per stage of an n-stage cut), one unit of activations per micro-batch and model copy;
    cap = 1F1B's own peak. Per schedule: makespan, bubble share, the analytic figure
    (P-1)/(c*m + P-1) with c stages per rank (1, v or 2W), peak in model copies, under the
    cap and without one."""
    def costs(n: int) -> PipelineCosts:
        return PipelineCosts(np.full((num_mb, n), num_ranks / n),
                             np.full((num_mb, n), 2 * num_ranks / n),
                             np.full((num_mb, n), 1.0 / n))
    cap = evaluate_candidates(costs, np.inf, num_ranks, ("1f1b",))[0].result.max_peak_memory_bytes
    cells = {}
    for limit_name, limit in (("capped", cap), ("free", np.inf)):
        found = {c.name: c for c in evaluate_candidates(
            costs, limit, num_ranks, SCHEDULE_NAMES,
            waves=(1, 2, 4), chunks=(2, 4))}
        for label, _, per_rank in TEXTBOOK_COLUMNS:
            cand = found[label]
            analytic = (num_ranks - 1) / (per_rank * num_mb + num_ranks - 1)
            res = cand.result
            cells.setdefault(label, {})[limit_name] = (
                {"error": cand.reason} if res is None else
                {"makespan": res.makespan_ms, "bubble": res.mean_bubble_fraction,
                 "analytic_bubble": analytic, "peak_copies": res.max_peak_memory_bytes,
                 "order": res.schedule.name})
    return {"P": num_ranks, "m": num_mb, "cap_copies": cap, "cells": cells}


def textbook_cell(cell: dict) -> str:
    if "error" in cell:
        return "does not fit"
    return f"{cell['makespan']:.2f} / {cell['bubble']:.1%} ({cell['analytic_bubble']:.1%})"


def textbook_markdown(rows: list) -> str:
    lines = ["Equal memory, textbook case: even stages, F = 1 and B = 2 per micro-batch for a "
             "rank's share of the model, one unit of activations per micro-batch and model "
             "copy, free links. Every schedule runs under the same per-rank activation cap, "
             "1F1B's own peak (1 model copy); interleaved and wave fit it by holding fewer "
             "micro-batches in flight (warm-up slope, rounds: schedules.fit_levels), adaptive "
             "by its memory-aware admission. Cells: makespan / simulated bubble share "
             "(analytic figure (P-1)/(c*m+P-1), c = 1, v or 2W stages per rank); 'does not "
             "fit': no variant stays under the cap.", "",
             "| P | m | 1F1B | interleaved v=2 | interleaved v=4 | wave W=1 | wave W=2 | "
             "wave W=4 | adaptive | fastest |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        capped = {k: v["capped"] for k, v in row["cells"].items()}
        ok = {k: v["makespan"] for k, v in capped.items() if "error" not in v}
        best = min(ok, key=ok.get)
        lines.append(f"| {row['P']} | {row['m']} | " + " | ".join(
            textbook_cell(capped[label]) for label, *_ in TEXTBOOK_COLUMNS) + f" | {best} |")
    lines += ["", "The same without a memory cap (makespan / bubble share, peak in model "
              "copies):", "",
              "| P | m | 1F1B | interleaved v=2 | interleaved v=4 | wave W=1 | wave W=2 | "
              "wave W=4 | adaptive | fastest |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        free = {k: v["free"] for k, v in row["cells"].items()}
        best = min(free, key=lambda k: free[k]["makespan"])
        lines.append(f"| {row['P']} | {row['m']} | " + " | ".join(
            f"{free[label]['makespan']:.2f} / {free[label]['bubble']:.1%}, "
            f"{free[label]['peak_copies']:.2f}" for label, *_ in TEXTBOOK_COLUMNS)
            + f" | {best} |")
    return "\n".join(lines)


def compare(num_ranks: int, strategy: str, num_samples: int, seed: int) -> dict:
    mbs, model = planned_micro_batches(num_ranks, strategy, num_samples, seed)
    source = micro_batch_costs(mbs, model, SPEC)
    limit = model.activation_memory_limit(num_stages=num_ranks)
    found = evaluate_candidates(source, limit, num_ranks, SCHEDULE_NAMES, COMM,
                                waves=(1, 2), chunks=(2,))
    return {"P": num_ranks, "strategy": strategy, "num_micro_batches": len(mbs),
            "time_cv": time_cv(source(num_ranks)), "memory_limit_bytes": limit,
            "candidates": candidate_rows(found, limit)}


def synthetic(num_ranks: int, num_mb: int, seed: int) -> dict:
    """Micro-batch times drawn i.i.d. long-tailed (log-normal sigma 0.8), equal on all stages;
    memory limit = 1f1b's own peak (so 1f1b just fits)."""
    rng = np.random.default_rng(seed)
    t = rng.lognormal(0, 0.8, num_mb)

    def for_stages(n: int) -> PipelineCosts:
        per = np.repeat(t[:, None], n, axis=1) * num_ranks / n
        return PipelineCosts(per, 2 * per, act_bytes=per * 1e6, comm_bytes=per * 1e5)
    base = evaluate_candidates(for_stages, np.inf, num_ranks, ("1f1b",), COMM)[0].result
    limit = base.max_peak_memory_bytes
    found = evaluate_candidates(for_stages, limit, num_ranks, SCHEDULE_NAMES, COMM,
                                waves=(1, 2), chunks=(2,))
    return {"P": num_ranks, "strategy": "synthetic-lognormal", "num_micro_batches": num_mb,
            "time_cv": float(t.std() / t.mean()), "memory_limit_bytes": limit,
            "candidates": candidate_rows(found, limit)}


def micro_batches_for_count(num_ranks: int, target: int, seed: int):
    """The dynamic planner's micro-batches for the fewest seeded samples that give at least
    `target` of them (bisection over the sample count; the count found is reported as is).
    Returns (micro-batches, cost model, number of samples)."""
    count = lambda n: len(planned_micro_batches(num_ranks, "dynamic", n, seed)[0])  # noqa: E731
    lo, hi = target - 1, 2 * target      # count(n) <= n < target at lo
    while count(hi) < target:
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if count(mid) >= target else (mid, hi)
    mbs, model = planned_micro_batches(num_ranks, "dynamic", hi, seed)
    return mbs, model, hi


def timed(fn, *args, **kwargs):
    """(fn(...), wall seconds, CPU seconds of this process)."""
    w0, c0 = time.perf_counter(), time.process_time()
    value = fn(*args, **kwargs)
    return value, time.perf_counter() - w0, time.process_time() - c0


PLAN_PHASES = ("search", "lower", "check")
TIMED_CANDIDATES = (("1f1b", ("1f1b",)), ("adaptive", ("adaptive",)),
                    ("interleaved2", ("interleaved",)), ("wave1", ("wave",)),
                    ("auto (linear layout)", auto_candidates("linear")),
                    ("all four", SCHEDULE_NAMES))


def generate_plans(mbs, costs, limit: float, num_ranks: int, candidates) -> dict:
    """One full plan generation (schedule search, lowering, plan check) with each phase's
    wall and CPU seconds; the micro-batches' stage costs are computed beforehand. Lowering
    orders transfers by the search's own simulation of the chosen schedule. The cache of built
    interleaved / wave orders is emptied first, so each run pays for building them."""
    interleaved_one_f_one_b.cache_clear()
    hanayo.cache_clear()
    (schedule, result), *search = timed(search_schedule, costs, limit, num_ranks, candidates,
                                        COMM)
    plans, *lowering = timed(lower, schedule, mbs, SPEC, "bfloat16", timing=result)
    _, *check = timed(check_plans, plans, SPEC)
    return {"schedule": schedule.name, "makespan_ms": result.makespan_ms,
            "seconds": dict(zip(PLAN_PHASES, (search, lowering, check)))}


def time_plan_generation(repeats: int, seed: int, num_ranks: int = 8, target: int = 64) -> dict:
    """Median wall and CPU ms of search, lowering and check (and their per-run total) for
    `target` FLAN-like micro-batches from the dynamic planner on `num_ranks` stages, per
    candidate schedule and for the full search over the default candidates."""
    mbs, model, samples = micro_batches_for_count(num_ranks, target, seed)
    source = micro_batch_costs(mbs, model, SPEC)
    (costs, *costing) = timed(lambda: {n: source(n) for n in (num_ranks, 2 * num_ranks)})
    limit = model.activation_memory_limit(num_stages=num_ranks)
    rows = {}
    for label, candidates in TIMED_CANDIDATES:
        runs = [generate_plans(mbs, costs, limit, num_ranks, candidates) for _ in range(repeats)]
        row = {"schedule": runs[-1]["schedule"], "makespan_ms": runs[-1]["makespan_ms"]}
        for clock, k in (("wall", 0), ("cpu", 1)):
            for phase in PLAN_PHASES:
                row[f"{phase}_{clock}_ms"] = 1e3 * statistics.median(
                    r["seconds"][phase][k] for r in runs)
            row[f"total_{clock}_ms"] = 1e3 * statistics.median(
                sum(r["seconds"][p][k] for p in PLAN_PHASES) for r in runs)
        rows[label] = row
        print(label, json.dumps(row), flush=True)
    return {"num_micro_batches": len(mbs), "num_samples": samples, "num_stages": num_ranks,
            "repeats": repeats, "costing_wall_ms": 1e3 * costing[0],
            "costing_cpu_ms": 1e3 * costing[1], "target_ms": 100.0,
            "load_average": os.getloadavg(), "candidates": rows}


def fmt(row: dict, name: str) -> str:
    cell = row["candidates"].get(name)
    if cell is None:
        return "n/a"
    if "error" in cell:
        return "does not fit" if "memory limit" in cell["error"] else "n/a"
    text = f"{cell['makespan_ms']:.0f} / {cell['bubble']:.1%}"
    return text if cell["fits"] else text + " (over memory)"


def timing_markdown(t: dict) -> str:
    """Issue 4's plan-generation target as a table: median ms per phase, wall / CPU."""
    load = ", ".join(f"{x:.1f}" for x in t["load_average"])
    lines = [f"Full plan generation for {t['num_micro_batches']} FLAN-like micro-batches (the "
             f"dynamic planner's cut of {t['num_samples']} seeded samples, GPT, bf16) on "
             f"{t['num_stages']} stages: schedule search (build + simulate the candidates, keep "
             f"the fastest that fits), lowering to per-rank instruction lists and the plan "
             f"check. Median over {t['repeats']} runs, wall / CPU ms (process_time, one "
             f"thread); total = median of the per-run sums. Target: <= {t['target_ms']:.0f} ms. "
             f"Stage costs from the cost model are computed once beforehand "
             f"({t['costing_wall_ms']:.1f} ms wall). Load average (1, 5, 15 min) at the end: "
             f"{load} on a shared machine, so CPU time is the one-core figure to read.", "",
             "| candidates | chosen | search | lowering | check | total | target met (CPU) |",
             "|---|---|---:|---:|---:|---:|---|"]
    for label, row in t["candidates"].items():
        cells = [f"{row[f'{p}_wall_ms']:.1f} / {row[f'{p}_cpu_ms']:.1f}"
                 for p in (*PLAN_PHASES, "total")]
        met = "yes" if row["total_cpu_ms"] <= t["target_ms"] else "no"
        lines.append(f"| {label} | `{row['schedule']}` | " + " | ".join(cells) + f" | {met} |")
    return "\n".join(lines)


def markdown(results: dict, command: str) -> str:
    lines = [f"Command: `{command}` (also run by `python tools/bench_planner.py --schedules`)  ",
             f"Date: {results['date']}  ", f"Machine: {results['machine']}  ", "",
             textbook_markdown(results["textbook"]), "",
             "Model: GPT 32 layers, hidden 2048, 16 heads, vocab 32000; AnalyticCostModel "
             "(100 TFLOP/s, 40 GiB per device, 2-byte activations); links 0.02 ms + 25 GB/s. "
             "Sample lengths: tools/bench_planner.py's seeded FLAN-like generator (input + "
             "target + EOD; log-normal body, 4% long documents), truncated to 2048. "
             "Memory limit: the cost model's activation limit (synthetic rows: 1f1b's own "
             "peak). Cells: simulated makespan ms / mean bubble fraction; adaptive chooses its "
             "order under the limit, interleaved and wave their warm-up (fit_levels).", "",
             "| P | micro-batches | n | time CV | 1f1b | adaptive | interleaved v=2 | "
             "wave W=1 | wave W=2 | adaptive vs 1f1b |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in results["rows"]:
        c = row["candidates"]
        speed = ("n/a" if "error" in c.get("1f1b", {"error": 1})
                 or "error" in c.get("adaptive", {"error": 1}) else
                 f"{c['1f1b']['makespan_ms'] / c['adaptive']['makespan_ms']:.2f}x")
        lines.append(f"| {row['P']} | {row['strategy']} | {row['num_micro_batches']} | "
                     f"{row['time_cv']:.2f} | {fmt(row, '1f1b')} | {fmt(row, 'adaptive')} | "
                     f"{fmt(row, 'interleaved2')} | {fmt(row, 'wave1')} | {fmt(row, 'wave2')} | "
                     f"{speed} |")
    lines += ["", timing_markdown(results["plan_timing"]), ""]
    lines += ["Reading the tables. Textbook case: on even stages every schedule's simulated "
              "bubble share equals its analytic figure wherever the order is unconstrained "
              "(tests/planning/test_schedules.py checks this); Hanayo's order needs m >= 2P (at m = P "
              "it runs all forwards first and keeps 1F1B's bubble). Without a cap, more stages "
              "per rank win (wave W=4 = 8 per rank first, then interleaved v=4), but the wave "
              "holds (4W-1)/(2W) model copies of activations at m = 2P and more beyond, "
              "interleaving ((v+1)P-1)/(vP). At 1F1B's memory interleaving keeps its bubble "
              "(a warm-up slope of 1 instead of Megatron's 2 suffices when B = 2F) and wins "
              "every row; the wave does not fit at all for P >= 4 and m >= 2P, and where it "
              "fits it loses to interleaving with as many stages per rank. Planned "
              "micro-batches: the planners fill the activation limit, so schedules that keep "
              "more micro-batches in flight get little or no room; interleaving then runs "
              "close to 1F1B (its extra transfers cost here), adaptive stays ahead on "
              "long-tailed costs, and the wave loses: its 2W*P even layer-count stages put "
              "embedding and output layer (this model's heavy head) both on rank 0."]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples and repeats")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--timing-only", action="store_true",
                        help="only the plan-generation timing, printed (nothing written)")
    args = parser.parse_args(argv)
    start = provenance_start("python tools/bench_schedules.py " + shlex.join(
        sys.argv[1:] if argv is None else argv))
    repeats = 5 if args.quick else 21
    if args.timing_only:
        print(timing_markdown(time_plan_generation(repeats, args.seed)))
        return
    samples = 1500 if args.quick else 3000
    book = []
    for num_ranks in (2, 4, 8):
        for num_mb in (num_ranks, 2 * num_ranks, 4 * num_ranks):
            book.append(textbook(num_ranks, num_mb))
            print(json.dumps(book[-1]), flush=True)
    rows = []
    for num_ranks in (2, 4, 8):
        for strategy in ("dynamic", "token-budget"):
            rows.append(compare(num_ranks, strategy, samples, args.seed))
            print(json.dumps(rows[-1]), flush=True)
        rows.append(synthetic(num_ranks, 64, args.seed + num_ranks))
        print(json.dumps(rows[-1]), flush=True)
    plan_timing = time_plan_generation(repeats, args.seed)
    now = datetime.datetime.now(datetime.timezone.utc)
    results = {**provenance_end(start), "date": now.strftime("%Y-%m-%d %H:%M UTC"),
               "machine": machine(), "textbook": book, "rows": rows,
               "plan_timing": plan_timing}
    command = "python tools/bench_schedules.py" + (" --quick" if args.quick else "")
    body = markdown(results, command)
    print(body)
    if not args.no_write:
        (REPO / "docs" / "bench_schedules.json").write_text(json.dumps(results, indent=1) + "\n")
        write_section(REPO / "docs" / "BENCHMARKS.md", "schedules", "Schedules", body)


if __name__ == "__main__":
    main()
