"""Measured training under every pipeline schedule at PP=2 on this machine, predicted next to it.

For GPT and T5 (4 layers each: GPT 4, T5 2 + 2), one short `torchrun --nproc-per-node 2` run
of pretrain_gpt.py / pretrain_t5.py per schedule: 1f1b and adaptive (2 stages), interleaved
(v = 2) and wave (W = 1) (4 virtual stages), and auto. The runs see the same batches (same seed
and data). Measured: each iteration's wall time (`iteration_s` of --stats-file) and real
tokens/s, over the iterations after the first `--skip`. Predicted: the planner's simulated
makespan of the same iterations, planned again here with the run's own configuration
(plan_iteration is deterministic; auto's layout chosen as the trainer chooses it), with the
CPU's default analytic cost model or, with `--cost-model profile`, a profile of each model made
on this machine by the first run (cached under runs/bench_pipeline_training/profiles). Rank 0's
busy time (forward + backward, from the trainer's time parts) is reported beside it: a schedule
cannot run faster than its busiest rank. Writes the "Pipeline schedules measured" section of
docs/BENCHMARKS.md and docs/bench_pipeline_training.json (`_profile` in both names with
--cost-model profile).

    python tools/bench_pipeline_training.py [--iters 12] [--skip 2] [--rounds 2] [--models gpt t5]
        [--cost-model profile]
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import shlex
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dynapipe_ext.report.doc_sections import write_section  # noqa: E402
from megatron.bench.schedule_bench import (  # noqa: E402
    MODELS, SCHEDULES, predicted_rank_compute_ms, rank_busy_ms, run_argv)
from tools.benchlib.launch import run_group  # noqa: E402
from tools.benchlib.provenance import provenance_end, provenance_start  # noqa: E402


PROFILE_DIR = REPO / "runs" / "bench_pipeline_training" / "profiles"
# one training run's limit: a hang guard (runs take about a minute; a first-use profile, a
# few minutes)
RUN_TIMEOUT_S = 1800.0


def cost_flags(cost_model: str) -> list[str]:
    return ([] if cost_model == "analytic" else
            ["--cost-model", "profile", "--cost-model-cache-dir", str(PROFILE_DIR)])


def train(model: str, schedule: str, iters: int, out: Path, port: int,
          extra: list[str]) -> list[dict]:
    """One torchrun of 2 processes; the --stats-file records of its iterations."""
    stats = out / f"{model}_{schedule.split()[0]}.jsonl"
    if stats.exists():
        stats.unlink()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(port),
           f"pretrain_{model}.py"] + run_argv(model, schedule, iters, stats) + extra
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    output, status = run_group(cmd, RUN_TIMEOUT_S, cwd=REPO, env=env)
    if status is None:
        raise RuntimeError(f"{model} {schedule}: ran past {RUN_TIMEOUT_S:.0f} s\n{output[-3000:]}")
    if status:
        raise RuntimeError(f"{model} {schedule}: exit {status}\n{output[-3000:]}")
    chosen = [line for line in output.splitlines() if "--pipeline-schedule auto:" in line]
    records = [json.loads(line) for line in stats.read_text().splitlines()
               if '"validation"' not in line]
    return records, (chosen[0].split("auto: ", 1)[1] if chosen else ""), busy_shares(output)


RANK_SHARES = re.compile(r"\[train\] rank (\d+): host overhead [\d.]+% \(forward ([\d.]+)% \| "
                         r"backward ([\d.]+)%")


def busy_shares(log: str) -> dict[int, float]:
    """Each rank's forward + backward share of the whole run's time, from the trainer's last
    '[train] rank R: host overhead ...' lines."""
    return {int(m.group(1)): (float(m.group(2)) + float(m.group(3))) / 100
            for m in RANK_SHARES.finditer(log)}


def predicted_ms(model: str, schedule: str, iters: int,
                 extra: list[str]) -> tuple[list[float], list[str], list[list[float]]]:
    """The planner's simulated makespan, chosen schedule and each pipeline rank's predicted
    compute (forward + backward of its stages, ms) of each iteration, planned as the run
    planned it (same flags, same data, 2 local ranks)."""
    from dynapipe_ext.plan.iteration_planner import (build_cost_model, choose_auto_layout,
                                                     pipeline_layout, plan_iteration)
    from megatron.training.arguments import parse_args
    from megatron.training.training import (given_cut, model_spec, open_training_data,
                                            planner_config)
    os.environ["LOCAL_WORLD_SIZE"] = "2"      # the run's memory share per rank
    os.environ["WORLD_SIZE"] = "2"
    import torch
    torch.set_num_threads(1)                  # the runs' OMP_NUM_THREADS=1: their profile's key
    cfg = parse_args(model, run_argv(model, schedule, iters, Path("unused")) + extra,
                     has_cuda=False)
    data = open_training_data(cfg, 0)
    spec = model_spec(cfg, data.vocab_size)
    spec = dataclasses.replace(spec, pipeline_cut=given_cut(cfg, spec))
    plan_cfg = planner_config(cfg, spec, 1)
    if cfg.pipeline_schedule == "auto":
        plan_cfg = choose_auto_layout(plan_cfg, data.batch_lengths(0))
    layout = pipeline_layout(plan_cfg)
    cost_model = build_cost_model(plan_cfg.cost_model, plan_cfg.spec, plan_cfg.tp, plan_cfg.pp)
    times, names, per_rank = [], [], []
    for it in range(iters):
        plan = plan_iteration(it, data.batch_lengths(it), plan_cfg)
        times.append(max(plan.predicted_ms))
        names.append(plan.schedules[0])
        compute = [0.0] * plan_cfg.pp
        for mb in plan.batch_plan.micro_batches:
            rows, seq, dec = mb.costed_shape()
            costs = cost_model.stage_cost_arrays([rows], [seq], [dec], len(layout),
                                                 mb.recompute)
            for stage, rank in enumerate(layout):
                compute[rank] += float(costs.fwd_ms[stage, 0] + costs.bwd_ms[stage, 0])
        per_rank.append(compute)
    return times, names, per_rank


def measure(models, iters: int, skip: int, rounds: int, out: Path,
            cost_model: str = "analytic") -> list[dict]:
    """Per (model, schedule): `rounds` runs, the schedules of a model taking turns in each
    round (so a change in the machine's load hits them alike)."""
    rows, port = {}, 29610
    for model in models:
        for r in range(rounds):
            for schedule in SCHEDULES:
                records, chosen, shares = train(model, schedule, iters, out, port,
                                                cost_flags(cost_model))
                port += 1
                key = (model, schedule)
                if key not in rows:
                    predicted, names, per_rank = predicted_ms(model, schedule, iters,
                                                              cost_flags(cost_model))
                    rows[key] = {"model": model, "schedule": schedule, "auto_layout": chosen,
                                 "measured_ms": [], "predicted_ms": [], "tokens": 0,
                                 "orders": names[skip:], "per_round_median_ms": [],
                                 "predicted_by_iteration": predicted, "busy_ms": [],
                                 "predicted_rank_compute_ms":
                                     predicted_rank_compute_ms(per_rank),
                                 "rank_busy_ms": []}
                row = rows[key]
                row["rank_busy_ms"].append(rank_busy_ms(records, shares))
                kept = [rec for rec in records if rec["iteration"] > skip]
                measured = [1e3 * rec["iteration_s"] for rec in kept]
                row["measured_ms"] += measured
                row["predicted_ms"] += [row["predicted_by_iteration"][rec["iteration"] - 1]
                                        for rec in kept]
                row["tokens"] += sum(rec["real_tokens"] for rec in kept)
                row["busy_ms"] += [1e3 * (rec["time_parts"]["forward"]
                                          + rec["time_parts"]["backward"]) for rec in kept]
                row["per_round_median_ms"].append(statistics.median(measured))
                print(json.dumps({"round": r, "model": model, "schedule": schedule,
                                  "median_ms": row["per_round_median_ms"][-1]}), flush=True)
    for row in rows.values():
        row["tokens_per_s"] = row["tokens"] / (sum(row["measured_ms"]) / 1e3)
        row["measured_over_predicted"] = sum(row["measured_ms"]) / sum(row["predicted_ms"])
    return list(rows.values())


def markdown(result: dict) -> str:
    load = ", ".join(f"{x:.1f}" for x in result["load_before"])
    after = ", ".join(f"{x:.1f}" for x in result["load_after"])
    lines = [f"Command: `{result['command']}`  ", f"Date: {result['date']}  ",
             "Runs: `torchrun --nproc-per-node 2` on this CPU, gloo, fp32, PP=2, dynamic "
             "micro-batches, quickstart data (`examples/prepare_data.sh`), "
             f"{result['rounds']} round(s) of one run per schedule (the schedules take turns), "
             f"{result['iters']} iterations each, the first {result['skip']} left out. GPT: 4 "
             "layers, hidden 128, 8,192 tokens per batch; T5: 2 + 2 layers, hidden 128, 4,096 "
             "tokens. 1f1b / adaptive cut the model into 2 stages, interleaved (v=2) and wave "
             "(W=1) into 4 virtual stages. Predicted: the planner's simulated makespan of the "
             "same iterations, " + COST_TEXT[result.get("cost_model", "analytic")] + ". "
             "Rank 0 busy: its forward + backward time per iteration (median), from the "
             "trainer's time parts; no schedule beats its busiest rank. Per rank, measured "
             "/ predicted: each rank's forward + backward ms per iteration after the first "
             "(the trainer's closing per-rank shares x the mean iteration time, median of the "
             "rounds) against the cost model's price of the stages that rank ran for the "
             "same micro-batches (mean per iteration after the first): where the two part, "
             "the cost model misprices that rank's layers. "
             "The machine has 2 cores shared with other jobs (1-minute load "
             f"average {load} before, {after} after), so single runs are noisy.", "",
             "| model | schedule | tokens/s | measured ms / iteration (median; per round) | "
             "predicted ms (median) | measured / predicted (sums) | rank 0 busy ms | "
             "per rank: busy ms measured / compute predicted | orders run |",
             "|---|---|---:|---:|---:|---:|---:|---|---|"]
    for r in result["rows"]:
        name = r["schedule"] + (f" ({r['auto_layout'].split(' ')[0]})" if r["auto_layout"]
                                else "")
        orders = sorted({o.split("[")[0] for o in r["orders"]})
        busy = f"{statistics.median(r['busy_ms']):.0f}" if r.get("busy_ms") else "-"
        lines.append(f"| {r['model']} | {name} | {r['tokens_per_s']:,.0f} | "
                     f"{statistics.median(r['measured_ms']):.0f} ("
                     + ", ".join(f"{m:.0f}" for m in r["per_round_median_ms"]) + ") | "
                     f"{statistics.median(r['predicted_ms']):.0f} | "
                     f"{r['measured_over_predicted']:.2f} | {busy} | {rank_cell(r)} | "
                     f"{', '.join(orders)} |")
    lines += ["", noise_note(result["rows"])]
    return "\n".join(lines)


def rank_cell(row: dict) -> str:
    """'r0 237 / 207, r1 60 / 150': per pipeline rank, measured busy ms (median of the rounds)
    / predicted compute ms per iteration ('-' for runs recorded without them)."""
    measured, predicted = row.get("rank_busy_ms"), row.get("predicted_rank_compute_ms")
    if not measured or not predicted or not all(measured):
        return "-"
    return ", ".join(f"r{r} {statistics.median(m[r] for m in measured):.0f} / {p:.0f}"
                     for r, p in enumerate(predicted))


TARGET = 0.15     # the measured / predicted criterion
COST_TEXT = {"analytic": "`--cost-model analytic` (the CPU default: nominal 0.05 TFLOP/s, no "
                         "link time)",
             "profile": "`--cost-model profile` (each model profiled on this CPU by its first "
                        "run, then cached; no link time)"}


def noise_note(rows: list) -> str:
    """What the machine's noise is, read off runs that executed the same plans: auto on the
    linear layout plans exactly as adaptive (both pick per iteration among the same orders
    when adaptive wins them all)."""
    same = []
    for auto in (r for r in rows if r["schedule"] == "auto"):
        for other in rows:
            if (other["model"] == auto["model"] and other["schedule"] != "auto"
                    and other["orders"] == auto["orders"]):
                same.append(f"{auto['model']} auto and {other['schedule']} ran the same plans "
                            f"and measured {statistics.median(auto['measured_ms']):.0f} and "
                            f"{statistics.median(other['measured_ms']):.0f} ms")
    spread = max(max(r["per_round_median_ms"]) / min(r["per_round_median_ms"]) for r in rows)
    ratios = [r["measured_over_predicted"] for r in rows]
    text = (f"Reading it: the same run repeated differs by up to {spread:.2f}x between rounds"
            + (f"; {'; '.join(same)}" if same else "") + ". ")
    if spread > 1 + TARGET:
        return text + (
            "The machine's load is larger than the differences the planner predicts between "
            "these schedules (a few percent at 15-20 micro-batches per iteration, where the "
            "bubble is small), so this table cannot rank them, and the measured / predicted "
            f"ratios ({min(ratios):.2f} to {max(ratios):.2f}) reflect the 2 cores shared by "
            "several jobs more than the cost model: the 15% criterion cannot be judged on this "
            "machine.")
    name = lambda r: f"{r['model']} {r['schedule']}"  # noqa: E731
    inside = [name(r) for r in rows if abs(r["measured_over_predicted"] - 1) <= TARGET]
    outside = [f"{name(r)} ({r['measured_over_predicted']:.2f})" for r in rows
               if abs(r["measured_over_predicted"] - 1) > TARGET]
    return text + (
        f"Rounds agree within {TARGET:.0%}, so the cost model can be judged: measured / "
        f"predicted is {min(ratios):.2f} to {max(ratios):.2f}; within {TARGET:.0%} for "
        + (", ".join(inside) or "none") + "; outside for " + (", ".join(outside) or "none")
        + ". The differences between schedules are a few percent, near the spread of the "
        "rounds, so the ranking between them is not settled by this table.")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--skip", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--models", nargs="+", choices=tuple(MODELS), default=tuple(MODELS))
    parser.add_argument("--cost-model", choices=tuple(COST_TEXT), default="analytic",
                        help="the runs' and the predictions' cost model")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--reuse", default=None,
                        help="re-render the table from a saved docs/bench_pipeline_training.json")
    args = parser.parse_args(argv)
    if args.reuse:
        result = json.loads(Path(args.reuse).read_text())
        body = markdown(result)
        print(body)
        if not args.no_write:
            write_section(REPO / "docs" / "BENCHMARKS.md", *section(result.get("cost_model",
                                                                               "analytic")), body)
        return
    out = REPO / "runs" / "bench_pipeline_training"
    out.mkdir(parents=True, exist_ok=True)
    before = os.getloadavg()
    start = provenance_start("python tools/bench_pipeline_training.py " + shlex.join(
        sys.argv[1:] if argv is None else argv))
    rows = measure(args.models, args.iters, args.skip, args.rounds, out, args.cost_model)
    now = datetime.datetime.now(datetime.timezone.utc)
    command = "python tools/bench_pipeline_training.py" + (
        f" --iters {args.iters}" if args.iters != 12 else "") + (
        f" --skip {args.skip}" if args.skip != 2 else "") + (
        f" --rounds {args.rounds}" if args.rounds != 2 else "") + (
        " --cost-model profile" if args.cost_model == "profile" else "")
    result = {**provenance_end(start), "date": now.strftime("%Y-%m-%d %H:%M UTC"),
              "command": command,
              "iters": args.iters, "skip": args.skip, "rounds": args.rounds,
              "load_before": before, "cost_model": args.cost_model,
              "load_after": os.getloadavg(), "rows": rows}
    body = markdown(result)
    print(body)
    if not args.no_write:
        suffix = "" if args.cost_model == "analytic" else "_profile"
        (REPO / "docs" / f"bench_pipeline_training{suffix}.json").write_text(
            json.dumps(result, indent=1) + "\n")
        write_section(REPO / "docs" / "BENCHMARKS.md", *section(args.cost_model), body)


def section(cost_model: str) -> tuple[str, str]:
    """The BENCHMARKS.md section (name, title) of a cost model's table."""
    if cost_model == "analytic":
        return "pipeline_training", "Pipeline schedules measured"
    return ("pipeline_training_profile",
            "Pipeline schedules measured, predicted with a profile of this CPU")


if __name__ == "__main__":
    main()
