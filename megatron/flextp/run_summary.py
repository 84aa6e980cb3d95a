"""Reading a FlexTP training run for tools/bench_flextp_trainer.py: the iterations of its
--stats-file, the balancer's change lines in its log, the final partition, the ideal time of a
straggler run (work split by speed), the table of the runs, and the held-out losses of the
loss study over seeds. Plain Python."""
from __future__ import annotations

import ast
import json
import re
import statistics

FACTOR = 2         # the straggler's slowdown in the benchmark's runs
LOSS_WINDOW = 10   # iterations averaged into the final loss
CHANGE = re.compile(r"\[flextp\] iteration (\d+) \(pipeline rank \d+\): (.*); units per TP rank "
                    r"(\{.*?\}), skipped per layer (\{.*?\}); stragglers \(TP ranks\) (\[.*?\])")


def _json_lines(lines, where: str):
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            yield n, json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}, line {n}: not JSON ({exc})") from None


def iteration_records(lines, where: str = "stats file") -> list[dict]:
    """The training records of a --stats-file (JSON lines): iteration, seconds, loss, in
    order; validation records are left out."""
    out = []
    for n, rec in _json_lines(lines, where):
        if "validation" in rec:
            continue
        if not {"iteration", "iteration_s", "loss"} <= rec.keys():
            raise ValueError(f"{where}, line {n}: no iteration / iteration_s / loss")
        out.append({"iteration": rec["iteration"], "seconds": rec["iteration_s"],
                    "loss": rec["loss"]})
    return out


def held_out_loss(lines, where: str = "stats file") -> float:
    """The loss of the last validation record of a --stats-file (after the last iteration)."""
    losses = [rec["validation"]["loss"] for _, rec in _json_lines(lines, where)
              if "validation" in rec]
    if not losses:
        raise ValueError(f"{where}: no validation record (run with --eval-interval)")
    return losses[-1]


def mean_seconds(records: list[dict], skip: int) -> float:
    """Mean seconds per iteration after the first `skip` iterations."""
    kept = [r["seconds"] for r in records if r["iteration"] > skip]
    if not kept:
        raise ValueError(f"no iterations after the {skip} warm-up ones ({len(records)} in all)")
    return statistics.mean(kept)


def final_loss(records: list[dict], window: int = LOSS_WINDOW) -> float:
    return statistics.mean(r["loss"] for r in records[-window:])


def balance_changes(log: str) -> list[dict]:
    """The balancer's change lines (megatron/flextp/stage_balance.change_line) in a run's log:
    iteration, action, units per TP rank and units skipped per layer per TP rank, by kind."""
    out = []
    for m in CHANGE.finditer(log):
        out.append({"iteration": int(m.group(1)), "action": m.group(2),
                    "counts": ast.literal_eval(m.group(3)), "skips": ast.literal_eval(m.group(4)),
                    "stragglers": ast.literal_eval(m.group(5))})
    return out


def final_partition(changes: list[dict], even: dict) -> dict:
    """Units and skips per TP rank at the end: the last change, else the even start `even`
    (kind -> units per rank)."""
    if changes:
        return {"counts": changes[-1]["counts"], "skips": changes[-1]["skips"]}
    return {"counts": even, "skips": {k: [0] * len(v) for k, v in even.items()}}


def ideal_seconds(no_straggler: float, even: float, factor: float) -> tuple[float, float]:
    """(ideal, block share): the straggler's TP block share t = (even - no straggler) /
    (factor - 1) (it does that work factor times), then the two ranks' block work 2t split by
    speed (1 and 1/factor) takes 2 factor t / (factor + 1) instead of t."""
    share = max(0.0, (even - no_straggler) / (factor - 1))
    return no_straggler - share + share * 2 * factor / (factor + 1), share


def whole_rank_ideal(no_straggler: float, even: float) -> tuple[float, float]:
    """(ideal, f) under a straggler that slows everything its rank runs (a busy process on its
    core): f = even / no straggler, measured; ideal = the iteration's work split by the two
    ranks' speeds 1 and 1/f, no straggler x 2f/(f+1). A bound FlexTP cannot reach when part
    of the slowed work is not TP units (norms, embedding, output layer, optimizer)."""
    factor = max(1.0, even / no_straggler)
    return no_straggler * 2 * factor / (factor + 1), factor


def summarize(runs: dict, skip: int, reference: str | None = None) -> dict:
    """Per configuration: the round times, their median, final loss (mean over rounds of the
    last-window means), the last round's final partition; plus the ideal. With `reference`
    (the name of an even run under the synthetic 2x straggler), "even" ran under a straggler
    that slows its whole rank (whole_rank_ideal); `reference` gives the TP block share, the
    part FlexTP can move."""
    out = {}
    for name, rounds in runs.items():
        times = [mean_seconds(r["records"], skip) for r in rounds]
        out[name] = {"times": times, "median": statistics.median(times),
                     "final_loss": statistics.mean(final_loss(r["records"]) for r in rounds),
                     "partition": rounds[-1]["partition"],
                     "changes": [len(r["changes"]) for r in rounds]}
    none, even = out["no straggler"]["median"], out["even"]["median"]
    if reference is None:
        ideal, share = ideal_seconds(none, even, FACTOR)
        return {"configs": out, "ideal": ideal, "block_share_s": share, "factor": FACTOR}
    _, share = ideal_seconds(none, out[reference]["median"], FACTOR)
    ideal, factor = whole_rank_ideal(none, even)
    return {"configs": out, "ideal": ideal, "block_share_s": share, "factor": factor}


def summarize_losses(runs: dict, baseline: str = "no straggler") -> dict:
    """The loss study: per configuration, the held-out loss per seed, its relative difference
    to `baseline`'s of the same seed, and the means. `runs`: name -> seed (str) -> loss."""
    base = runs[baseline]
    out = {}
    for name, per_seed in runs.items():
        seeds = [s for s in per_seed if s in base]
        rel = {s: per_seed[s] / base[s] - 1.0 for s in seeds}
        out[name] = {"losses": {s: per_seed[s] for s in seeds},
                     "mean": statistics.mean(per_seed[s] for s in seeds),
                     "relative": rel, "mean_relative": statistics.mean(rel.values()),
                     "worst_relative": max(rel.values(), key=abs)}
    return out


def render_loss_table(summary: dict) -> str:
    seeds = list(next(iter(summary.values()))["losses"])
    rows = ["| run | held-out loss per seed (" + ", ".join(seeds) + ") | mean | vs no straggler "
            "per seed | mean | largest |", "|---|---|---|---|---|---|"]
    for name, c in summary.items():
        losses = ", ".join(f"{c['losses'][s]:.4f}" for s in seeds)
        rel = ", ".join(f"{100 * c['relative'][s]:+.2f}%" for s in seeds)
        rows.append(f"| {name} | {losses} | {c['mean']:.4f} | {rel} | "
                    f"{100 * c['mean_relative']:+.2f}% | {100 * c['worst_relative']:+.2f}% |")
    return "\n".join(rows)


def _units(part: dict) -> str:
    c, s = part["counts"], part["skips"]
    return f"{c['mlp']} / {c['attn']} (skipping {s['mlp']} / {s['attn']})"


def render_table(summary: dict) -> str:
    ideal = summary["ideal"]
    rows = ["| run | s / iteration (median of rounds) | rounds | vs ideal | final loss (last "
            f"{LOSS_WINDOW}, mean of rounds) | final mlp / attn units per TP rank (skipped per "
            "layer) | balancer changes per round |",
            "|---|---|---|---|---|---|---|"]
    for name, c in summary["configs"].items():
        rows.append(f"| {name} | {c['median']:.3f} | {', '.join(f'{t:.3f}' for t in c['times'])}"
                    f" | {c['median'] / ideal:.2f}x | {c['final_loss']:.4f} | "
                    f"{_units(c['partition'])} | {', '.join(map(str, c['changes']))} |")
    rows.append(f"| ideal (work split by speed) | {ideal:.3f} | | 1.00x | | | |")
    return "\n".join(rows)
