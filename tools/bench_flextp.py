"""FlexTP benchmark: TP=2 on gloo with one straggling rank, each run one training of the FlexGPT
(megatron/flextp) on FLAN-like byte data.

1. Steady 2x straggler (FLEXTP_SLOWDOWN=1:2: rank 1 does its block GEMMs twice): mean iteration
   time of even TP (--tp-balance off), resize, migrate and semi, the no-straggler time, and the
   ideal (the no-straggler time with the TP block work split by speed, the block share derived
   from the even and no-straggler runs); loss curves of the same runs.
2. On/off contention: a busy process pinned with `taskset` to rank 1's core, stopped and resumed
   every `--period` iterations (ranks pinned to cores 0 and 1): per-iteration time and partition
   of semi (and of even TP) as a timeline plot.

Writes docs/bench_flextp.json, docs/flextp_timeline.png, docs/flextp_loss.png and the "flextp"
section of docs/BENCHMARKS.md with `--write-doc`. One run per configuration.

3. `--loss-seeds N` (alone: the runs above are skipped): the loss comparison over N seeds (model
   init and data order), no straggler vs resize vs semi under the steady 2x straggler, paired by
   seed; the final loss is the mean of the last `--final-window` iterations (one iteration's
   loss swings by several percent from batch to batch). Writes docs/bench_flextp_loss.json,
   docs/flextp_loss_seeds.png and the "flextp-loss" section with `--write-doc`.

    python tools/bench_flextp.py [--iters 200] [--even-iters 80] [--period 50] [--write-doc]
    python tools/bench_flextp.py --loss-seeds 3 [--iters 200] [--write-doc]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REPO = Path(__file__).resolve().parents[1]
SKIP = 20   # warm-up iterations left out of the time figures


def _worker(rank, port, argv, slowdown, busy_pid, period, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", FLEXTP_SLOWDOWN=slowdown)
    import torch
    import torch.distributed as dist
    from megatron.flextp.train import build_parser, train
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    phases = []

    def contention(it):
        on = busy_pid is not None and (it // period) % 2 == 1
        if rank == 0 and busy_pid is not None:
            os.kill(busy_pid, signal.SIGCONT if on else signal.SIGSTOP)
        phases.append(on)
    records = train(build_parser().parse_args(argv), contention)
    for r, on in zip(records, phases):
        r["contention"] = on
    if rank == 0:
        out.put(records)
    dist.destroy_process_group()


def run(name: str, mode: str, iters: int, slowdown: str = "", busy_pid=None, period=0,
        extra=()) -> list[dict]:
    import multiprocessing as mp
    from tools.benchlib.ports import free_port
    argv = ["--tp-balance", mode, "--train-iters", str(iters), "--pin-cores", *extra]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, argv, slowdown, busy_pid, period, out))
             for r in range(2)]
    for p in procs:
        p.start()
    import queue
    while True:
        try:
            records = out.get(timeout=5)
            break
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"bench_flextp: run {name!r}: a rank exited with {dead}")
    for p in procs:
        p.join()
    t = mean_time(records)
    print(f"[bench_flextp] {name}: {t:.3f} s/iter, final loss {final_loss(records):.4f}",
          flush=True)
    return records


def mean_time(records) -> float:
    return statistics.mean(r["seconds"] for r in records[SKIP:])


def final_loss(records, last: int = 20) -> float:
    return statistics.mean(r["loss"] for r in records[-last:])


def start_busy() -> subprocess.Popen:
    """A spinning process pinned to core 1, stopped until the contention phase resumes it."""
    busy = subprocess.Popen(["taskset", "-c", "1", sys.executable, "-c", "while True: pass"])
    os.kill(busy.pid, signal.SIGSTOP)
    return busy


STEADY = (("no straggler", "off", ""), ("even", "off", "1:2"), ("resize", "resize", "1:2"),
          ("migrate", "migrate", "1:2"), ("semi", "semi", "1:2"))


def interleaved_times(rounds: int, iters: int) -> dict[str, list[float]]:
    """Mean s / iteration of each steady configuration in `rounds` rounds of short runs, the
    configurations taking turns, so a drifting machine load hits them all alike."""
    times = {name: [] for name, _, _ in STEADY}
    for _ in range(rounds):
        for name, mode, slow in STEADY:
            times[name].append(mean_time(run(name, mode, iters, slow)))
    return times


def steady_table(times: dict, runs: dict, factor: int) -> tuple[str, dict]:
    med = {k: statistics.median(v) for k, v in times.items()}
    t_tp = max(0.0, (med["even"] - med["no straggler"]) / (factor - 1))  # straggler block share
    ideal = med["no straggler"] - t_tp + t_tp * 2 * factor / (factor + 1)
    rows = ["| run | s / iteration (median of rounds) | rounds | vs ideal | final loss, long run "
            "(last 20) | final mlp / attn units per rank (units skipped per rank) |",
            "|---|---|---|---|---|---|"]
    for name, values in times.items():
        recs = runs[name]
        last = recs[-1]
        rows.append(f"| {name} | {med[name]:.3f} | {', '.join(f'{v:.3f}' for v in values)} | "
                    f"{med[name] / ideal:.2f}x | {final_loss(recs):.4f} | "
                    f"{last['counts_now']['mlp']} / {last['counts_now']['attn']} (skipping "
                    f"{last['drops_now']['mlp']} / {last['drops_now']['attn']}) |")
    rows.append(f"| ideal (work split by speed) | {ideal:.3f} | | 1.00x | | |")
    return "\n".join(rows), {"ideal": ideal, "block_share_s": t_tp, "times": times}


def plot_timeline(runs: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True)
    for name, recs in runs.items():
        ax.plot([r["seconds"] for r in recs], label=name, lw=1)
    recs = next(iter(runs.values()))
    for i, r in enumerate(recs):
        if r["contention"]:
            for a in (ax, ax2):
                a.axvspan(i - 0.5, i + 0.5, color="orange", alpha=0.15, lw=0)
    ax.set_ylabel("s / iteration (rank 0)")
    ax.set_ylim(0, 3 * statistics.median(r["seconds"] for r in recs))
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title("On/off contention on rank 1's core (shaded: busy process running)")
    semi = runs.get("semi", recs)
    ax2.plot([r["counts_now"]["mlp"][1] for r in semi], label="semi: MLP units on rank 1")
    ax2.plot([r["counts_now"]["mlp"][1] - r["drops_now"]["mlp"][1] for r in semi], ls="--",
             label="... computed (after resize skips)")
    ax2.set_ylabel("units (of 32)")
    ax2.set_xlabel("iteration")
    ax2.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_loss(runs: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4))
    for name, recs in runs.items():
        losses = [r["loss"] for r in recs]
        smooth = [statistics.mean(losses[max(0, i - 9):i + 1]) for i in range(len(losses))]
        ax.plot(smooth, label=name, lw=1)
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss (10-iteration mean)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def long_runs(args) -> tuple[dict, dict]:
    """One long run per steady configuration (loss curves, final partitions) and the on/off
    contention runs."""
    steady = {}
    for name, mode, slow in STEADY:
        steady[name] = run(name, mode, args.even_iters if name == "even" else args.iters, slow)
    busy = start_busy()
    try:
        onoff = {"semi": run("on/off semi", "semi", args.iters, busy_pid=busy.pid,
                             period=args.period)}
        if not args.skip_onoff_even:
            onoff["even"] = run("on/off even", "off", args.iters, busy_pid=busy.pid,
                                period=args.period)
    finally:
        os.kill(busy.pid, signal.SIGCONT)
        busy.kill()
        busy.wait()
    return steady, onoff


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--even-iters", type=int, default=80)
    p.add_argument("--period", type=int, default=50)
    p.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds")
    p.add_argument("--round-iters", type=int, default=60)
    p.add_argument("--reuse-runs", default=None,
                   help="take the long runs from this bench_flextp.json (with --loss-seeds: "
                        "the runs of this bench_flextp_loss.json) instead of running them")
    p.add_argument("--skip-onoff-even", action="store_true")
    p.add_argument("--write-doc", action="store_true")
    p.add_argument("--loss-seeds", type=int, default=0,
                   help="only the loss comparison, over this many seeds (see the docstring)")
    p.add_argument("--seed", type=int, default=1234, help="first seed of --loss-seeds")
    p.add_argument("--final-window", type=int, default=20,
                   help="--loss-seeds: iterations averaged into the final loss")
    p.add_argument("--eval-iters", type=int, default=20,
                   help="--loss-seeds: held-out batches for the trained weights' loss (every "
                        "unit computed)")
    args = p.parse_args()
    if args.loss_seeds:
        return loss_main(args)
    docs = REPO / "docs"
    load = {"before": os.getloadavg()[0]}
    if args.reuse_runs:
        saved = json.loads(Path(args.reuse_runs).read_text())
        steady = {name: saved["steady"][name] for name, _, _ in STEADY}
        onoff = saved["onoff"]
        old = saved["load"]   # [before, after] getloadavg() triples in older files
        load["long runs"] = old["long runs"] if isinstance(old, dict) else old[1][0]
    else:
        steady, onoff = long_runs(args)
        load["long runs"] = os.getloadavg()[0]
    times = interleaved_times(args.rounds, args.round_iters)
    load["after"] = os.getloadavg()[0]
    table, extra = steady_table(times, steady, 2)
    (docs / "bench_flextp.json").write_text(json.dumps(
        {"steady": steady, "onoff": onoff, "load": load, **extra}))
    plot_timeline(onoff, docs / "flextp_timeline.png")
    plot_loss({k: v for k, v in steady.items() if k != "even"}, docs / "flextp_loss.png")
    print(table)
    phase_rows = onoff_table(onoff)
    print(phase_rows)
    if args.write_doc:
        from dynapipe_ext.report.doc_sections import write_section
        write_section(docs / "BENCHMARKS.md", "flextp", "FlexTP: straggler-tolerant tensor "
                      "parallelism", doc_text(args, table, phase_rows, steady, extra, load))


LOSS_RUNS = (("no straggler", "off", ""), ("resize", "resize", "1:2"), ("semi", "semi", "1:2"))


def loss_runs(seeds, iters: int, eval_iters: int) -> tuple[dict, dict]:
    """Per configuration and seed, the per-iteration losses and the held-out loss of the
    trained weights with every unit computed (configurations take turns per seed, so a
    drifting machine load cannot favour one; it does not touch the losses anyway)."""
    out = {name: {} for name, _, _ in LOSS_RUNS}
    held_out = {name: {} for name, _, _ in LOSS_RUNS}
    for seed in seeds:
        for name, mode, slow in LOSS_RUNS:
            recs = run(f"{name} seed {seed}", mode, iters, slow,
                       extra=("--seed", str(seed), "--eval-iters", str(eval_iters)))
            out[name][seed] = [r["loss"] for r in recs]
            held_out[name][seed] = recs[-1]["eval_loss"]
    return out, held_out


def loss_table(losses: dict, window: int, held_out: dict | None = None) -> tuple[str, dict]:
    """Final losses (mean of the last `window` iterations, and the last iteration alone) per
    configuration and seed, each relative to the no-straggler run of its seed; with
    `held_out`, also the trained weights' held-out loss (every unit computed) the same way."""
    base = losses["no straggler"]
    seeds = sorted(base)
    head = ("| run | final loss per seed (mean of last " + str(window) + ") | mean | vs no "
            "straggler per seed | mean | last iteration alone, vs no straggler |")
    if held_out:
        head += " held-out loss per seed | vs no straggler per seed | mean |"
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    summary = {}
    for name, per_seed in losses.items():
        final = [statistics.mean(per_seed[s][-window:]) for s in seeds]
        rel = [f / statistics.mean(base[s][-window:]) - 1 for f, s in zip(final, seeds)]
        last = [per_seed[s][-1] / base[s][-1] - 1 for s in seeds]
        summary[name] = {"final": final, "relative": rel, "last_relative": last}
        row = (f"| {name} | {', '.join(f'{f:.4f}' for f in final)} | "
               f"{statistics.mean(final):.4f} | {', '.join(f'{r:+.2%}' for r in rel)} | "
               f"{statistics.mean(rel):+.2%} | {', '.join(f'{r:+.2%}' for r in last)} |")
        if held_out:
            ev = [held_out[name][s] for s in seeds]
            ev_rel = [e / held_out["no straggler"][s] - 1 for e, s in zip(ev, seeds)]
            summary[name].update(held_out=ev, held_out_relative=ev_rel)
            row += (f" {', '.join(f'{e:.4f}' for e in ev)} | "
                    f"{', '.join(f'{r:+.2%}' for r in ev_rel)} | {statistics.mean(ev_rel):+.2%} |")
        rows.append(row)
    return "\n".join(rows), summary


def plot_loss_seeds(losses: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4))
    for (name, per_seed), color in zip(losses.items(), ("C0", "C1", "C2")):
        for k, seed in enumerate(sorted(per_seed)):
            lo = per_seed[seed]
            smooth = [statistics.mean(lo[max(0, i - 9):i + 1]) for i in range(len(lo))]
            ax.plot(smooth, color=color, lw=1, alpha=0.8, label=name if k == 0 else None)
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss (10-iteration mean)")
    ax.set_ylim(top=3.6)
    ax.set_title("one line per seed")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def loss_doc_text(args, table: str, summary: dict, load: dict) -> str:
    seeds = list(range(args.seed, args.seed + args.loss_seeds))
    base = summary["no straggler"]["final"]
    spread = (max(base) - min(base)) / statistics.mean(base)
    again = (" (this text re-rendered from its saved runs with `--reuse-runs "
             "docs/bench_flextp_loss.json`)" if args.reuse_runs else "")
    return f"""Run on {datetime.date.today()} with `python tools/bench_flextp.py --loss-seeds \
{args.loss_seeds} --seed {args.seed} --iters {args.iters} --final-window {args.final_window} \
--eval-iters {args.eval_iters} --write-doc`{again} (1-minute \
load average {load['before']:.1f} before, {load['after']:.1f} after): the FlexGPT and data of the \
section above, {args.iters} iterations per run, seeds {seeds} (model initialisation and data \
order; the no-straggler and straggler runs of a seed see the same batches), resize and semi \
under the steady 2x straggler (`FLEXTP_SLOWDOWN=1:2`). Final loss: the mean over the last \
{args.final_window} iterations; the last column shows how far a single iteration's loss would \
move the comparison. Held-out loss: the trained weights' mean loss over {args.eval_iters} batches \
of held-out samples (the same for every run) with every unit computed, i.e. what the training \
run is worth, without the skips' approximation of the forward pass. The no-straggler runs' final losses spread by {spread:.1%} across seeds \
(their batches differ too, so only the paired columns compare like with like). Raw losses: \
`docs/bench_flextp_loss.json`.

{table}

![loss curves, every seed](flextp_loss_seeds.png)"""


def loss_main(args) -> None:
    docs = REPO / "docs"
    load = {"before": os.getloadavg()[0]}
    seeds = range(args.seed, args.seed + args.loss_seeds)
    if args.reuse_runs:      # re-render from a saved bench_flextp_loss.json
        saved = json.loads(Path(args.reuse_runs).read_text())
        losses = {name: {int(s): v for s, v in runs.items()}
                  for name, runs in saved["losses"].items()}
        held_out = {name: {int(s): v for s, v in runs.items()}
                    for name, runs in saved.get("held_out", {}).items()}
        load = saved["load"]
    else:
        losses, held_out = loss_runs(seeds, args.iters, args.eval_iters)
        load["after"] = os.getloadavg()[0]
    table, summary = loss_table(losses, args.final_window, held_out)
    (docs / "bench_flextp_loss.json").write_text(json.dumps(
        {"losses": losses, "held_out": held_out, "summary": summary, "load": load,
         "iters": args.iters, "window": args.final_window, "eval_iters": args.eval_iters}))
    plot_loss_seeds(losses, docs / "flextp_loss_seeds.png")
    print(table)
    if args.write_doc:
        from dynapipe_ext.report.doc_sections import write_section
        write_section(docs / "BENCHMARKS.md", "flextp-loss", "FlexTP: loss over seeds",
                      loss_doc_text(args, table, summary, load))


def onoff_table(onoff: dict) -> str:
    rows = ["| run | s / iteration, contention off | contention on |", "|---|---|---|"]
    for name, recs in onoff.items():
        off = [r["seconds"] for r in recs[SKIP:] if not r["contention"]] or [float("nan")]
        on = [r["seconds"] for r in recs[SKIP:] if r["contention"]] or [float("nan")]
        rows.append(f"| {name} | {statistics.mean(off):.3f} | {statistics.mean(on):.3f} |")
    return "\n".join(rows)


def doc_text(args, table, phase_rows, steady, extra, load) -> str:
    none = final_loss(steady["no straggler"])
    rel = {k: final_loss(v) / none - 1 for k, v in steady.items() if k != "no straggler"}
    reuse = (f" --reuse-runs FILE` (the long runs from the previous invocation, same flags, run "
             f"just before; `" if args.reuse_runs else "")
    return f"""Run on {datetime.date.today()} with `python tools/bench_flextp.py --iters {args.iters} \
--even-iters {args.even_iters} --period {args.period} --rounds {args.rounds} --round-iters \
{args.round_iters}{reuse} --write-doc`: TP=2 on gloo, 2 CPU cores shared with other jobs whose load \
drifts a lot (1-minute load average {load['long runs']:.1f} after the long runs, \
{load['before']:.1f} / {load['after']:.1f} before / after the timing rounds; in an earlier \
attempt it fell from 21 to 5 during the bench, and the same no-straggler run took 0.53 and 0.20 s \
per iteration at its start and end). Timings are therefore taken in {args.rounds} interleaved \
rounds of {args.round_iters}-iteration runs (each configuration once per round, the median \
reported); loss curves, final partitions and the on/off timeline come from one long run each. \
Model: the FlexGPT of `megatron/flextp` (2 layers, hidden 256, 8 heads, ffn 1024 in 32 units of \
32 columns, sequence 128, batch 8, byte vocabulary), FlexAdamW lr 1e-3 (10 warm-up iterations), \
data: FLAN-like samples of `megatron.data.flan_synthetic` (the quickstart's generator) as bytes. \
Times: mean wall seconds per iteration on rank 0 after {SKIP} warm-up iterations, migrations \
included. Raw records: `docs/bench_flextp.json`.

### Steady 2x straggler (`FLEXTP_SLOWDOWN=1:2`)

{table}

The ideal: the no-straggler time with the straggler's block share ({extra['block_share_s']:.3f} s, \
even minus no-straggler) split by speed (x 2f/(f+1), f = 2). Final loss of the long runs relative \
to the no-straggler run: {', '.join(f'{k} {v:+.2%}' for k, v in rel.items())} (the even run is \
shorter, {args.even_iters} iterations). Migrate reproduces the no-straggler losses (same batches, \
exact math; only the all-reduce order differs). Resize skips up to a quarter of the straggler's \
units (the bound), semi resizes until its cost model prefers a migration.

![loss curves](flextp_loss.png)

### On/off contention (`taskset`: a busy process on rank 1's core, {args.period} iterations on, \
{args.period} off, ranks pinned to cores 0 and 1)

{phase_rows}

![timeline](flextp_timeline.png)

The busy process competes with the other jobs on the machine as well, so it slows rank 1 by less \
than 2x and by varying amounts; the detector only flags it when the smoothed ratio stays above 1.3 \
for 6 iterations.

### What is and is not integrated

The figures above come from the small FlexTP trainer (`megatron/flextp/train.py`, `torchrun -m \
megatron.flextp.train --tp-balance semi`): real GEMMs, real gloo all-reduces, real AdamW \
(FlexAdamW with fp32 master copies), timings measured by the ranks themselves. The same policies \
also run in `pretrain_gpt.py --tp-balance {{resize,migrate,semi}}` \
(`megatron/flextp/stage_layers.py`, `stage_balance.py`): the megatron-core GPT layers keep their \
TP units in fixed-size slots (up to twice the even share), composed with PP, DP and the dynamic \
micro-batches; tests at TP=2 x PP=2 and TP=2 x DP=2 (`tests/test_flextp_integration.py`) show \
migration training like even TP within fp32 tolerance. Their speed on the main trainer is \
measured in the section "FlexTP in the main trainer" below. `--save` / `--load` work with `--tp-balance`: checkpoints are written in the even layout of an \
ordinary TP run (units migrated back for the save, optimizer state included), so they resume \
with or without `--tp-balance` and at other TP / PP sizes (`tests/test_flextp_checkpoint.py`)."""


if __name__ == "__main__":
    main()
