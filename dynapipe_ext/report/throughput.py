"""The report of tools/bench_throughput.py: rows of its runs merged over rounds, speed-ups
over packing, and the markdown of the "Training throughput" section of docs/BENCHMARKS.md
(measured table, MFU breakdown, targets, the paper-scale projections). Plain Python."""
from __future__ import annotations

import math

STRATEGIES = ("padding", "packing", "packing+segment-attn", "packing+window", "dynamic+padded",
              "dynamic")
BASELINE = "packing"
MFU_TARGET = 0.55      # issue 11: GPT dynamic at 2048 on this CPU
MFU_PARTS = ("mfu", "padding", "waits", "other_compute", "descheduled", "host", "optimizer")


def merge_rounds(rows: list[dict]) -> list[dict]:
    """One row per (model, max length, strategy): the round with the median tokens/s, with
    every round's figure in `tokens_per_s_rounds` (rounds interleave the strategies, so a
    slow spell of a shared machine hits them alike)."""
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["model"], r["max_len"], r["strategy"]), []).append(r)
    out = []
    for group in groups.values():
        ok = sorted((r for r in group if "tokens_per_s" in r), key=lambda r: r["tokens_per_s"])
        if not ok:
            out.append(group[0])
            continue
        out.append(dict(ok[(len(ok) - 1) // 2],
                        tokens_per_s_rounds=[r["tokens_per_s"] for r in ok],
                        tokens_per_s_by_round={r["round"]: r["tokens_per_s"]
                                               for r in ok if "round" in r}))
    return out


def add_ratios(rows: list[dict]) -> None:
    """Within each (model, max length) group: speedup_vs_packing against the `packing` row
    (dense masks, the paper's baseline) where there is one, and speedup_vs_best_packing against
    the fastest packing row of any kind (the strongest baseline measured), naming it."""
    for row in rows:
        if "tokens_per_s" not in row:
            continue
        group = [r for r in rows if r["model"] == row["model"] and r["max_len"] == row["max_len"]
                 and r["strategy"].startswith(BASELINE) and "tokens_per_s" in r]
        dense = [r for r in group if r["strategy"] == BASELINE]
        if dense:
            row["speedup_vs_packing"] = row["tokens_per_s"] / dense[0]["tokens_per_s"]
        if group:
            best = max(group, key=lambda r: r["tokens_per_s"])
            row["speedup_vs_best_packing"] = row["tokens_per_s"] / best["tokens_per_s"]
            row["best_packing"] = best["strategy"]


def median(values) -> float:
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return float("nan")
    mid = len(vals) // 2
    return vals[mid] if len(vals) % 2 else (vals[mid - 1] + vals[mid]) / 2


def ratio_text(row: dict) -> str:
    """The row against the fastest packing row of its model and length."""
    ratio = row.get("speedup_vs_best_packing")
    if ratio is None:
        return "n/a (no packing row)"
    return f"{ratio:.2f}x" if row["strategy"] == row["best_packing"] else (
        f"{ratio:.2f}x ({row['best_packing']})")


def table_order(rows: list[dict]) -> list[dict]:
    """Rows by model, max length, then strategy in STRATEGIES order."""
    order = {s: i for i, s in enumerate(STRATEGIES)}
    return sorted(rows, key=lambda r: (r["model"], r["max_len"], order.get(r["strategy"], 99)))


def measured_table(rows: list[dict]) -> list[str]:
    """Markdown rows of the measured runs, grouped by model and max length."""
    out = ["| model | max len | strategy | rows/mb | tokens/s | MFU | vs fastest packing | "
           "pad eff enc/dec | micro-batches | recompute | schedule | plan ms | plan wait ms | "
           "peak MiB/rank | s/iter |",
           "|---|---:|---|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---:|---:|"]
    for r in table_order(rows):
        if "error" in r:
            out.append(f"| {r['model']} | {r['max_len']} | {r['strategy']} | | failed: "
                       f"{r['error'][:120].replace('|', '/')} | | | | | | | | | | |")
            continue
        dec = r.get("padding_efficiency_dec")
        eff = f"{r['padding_efficiency_enc']:.2f}" + (f"/{dec:.2f}" if dec is not None else "")
        sched = sorted({s.split("[")[0] for s in r["schedules"]})
        packer = (f" ({r['packing_algorithm']})" if r["strategy"].startswith("packing")
                  and r.get("packing_algorithm") else "")
        out.append(
            f"| {r['model']} | {r['max_len']} | {r['strategy']}{packer} | "
            f"{rows_per_micro_batch_text(r)} | {r['tokens_per_s']:,.0f}{spread_text(r)} | "
            f"{percent(r.get('mfu'))} | {ratio_text(r)} | {eff} | "
            f"{median(r['micro_batches']):.0f} | {'/'.join(r['recompute'])} | "
            f"{'/'.join(sched)} | {median(r['planning_ms']):.0f} | "
            f"{1e3 * median(r['plan_wait_s']):.1f} | "
            f"{max(r['peak_memory_bytes']) / 2**20:,.0f} | {median(r['iteration_s']):.2f} |")
    return out


def rows_per_micro_batch_text(row: dict) -> str:
    """Rows per micro-batch: the fixed count, the range packing's per-batch search chose, or
    'var' (dynamic sizes every micro-batch)."""
    if row.get("micro_batch_size"):
        return str(row["micro_batch_size"])
    chosen = row.get("rows_per_micro_batch") or []
    if row["strategy"].startswith("packing") and chosen:
        return str(chosen[0]) if len(chosen) == 1 else f"{min(chosen)}-{max(chosen)}"
    return "var"


def spread_text(row: dict) -> str:
    """' (min-max)' of a row's tokens/s: over its rounds when there were several, else over
    its timed iterations."""
    values = row.get("tokens_per_s_rounds") or []
    if len(values) < 2:
        values = row.get("iteration_tokens_per_s") or []
    if len(values) < 2:
        return ""
    return f" ({min(values):,.0f}-{max(values):,.0f})"


def percent(share: float | None) -> str:
    return "n/a" if share is None else f"{100 * share:.1f}%"


def sgemm_note(rows: list[dict]) -> str:
    rates = [r["sgemm_flops"] for r in rows if r.get("sgemm_flops")]
    return (f": {min(rates) / 1e9:.1f}-{max(rates) / 1e9:.1f} GFLOP/s" if rates else "")


def mfu_section(rows: list[dict]) -> list[str]:
    table = mfu_table(rows)
    if not table:
        return []
    return ["Where the ranks' time went (shares of ranks x wall time, adding up to 100%; "
            "tools/bench_throughput.py mfu_fields says how each is measured):", "",
            *table, ""]


def mfu_table(rows: list[dict]) -> list[str]:
    """Markdown rows: MFU on real tokens and where the rest of the ranks' time went
    (mfu_fields), per measured run."""
    out = ["| model | max len | strategy | MFU | padding | transfer + sync waits | "
           "other compute (non-GEMM, GEMM below peak, recompute) | descheduled (other "
           "processes) | host | optimizer |",
           "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in table_order(rows):
        parts = r.get("mfu_breakdown")
        if parts:
            out.append(f"| {r['model']} | {r['max_len']} | {r['strategy']} | " +
                       " | ".join(percent(parts.get(k)) for k in MFU_PARTS) + " |")
    return out if len(out) > 2 else []


def rate_text(tokens_per_s: float) -> str:
    """Tokens/s with thousands separators, or 3 significant digits below 100."""
    return f"{tokens_per_s:,.0f}" if tokens_per_s >= 100 else f"{tokens_per_s:.3g}"


def projection_table(projection: dict) -> list[str]:
    out = ["| model | max len | packing tokens/s | dynamic tokens/s | dynamic vs packing | "
           "micro-batches packing/dynamic | packing rows/mb |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    rows = projection["rows"]
    for model in ("gpt", "t5"):
        for L in sorted({r["max_len"] for r in rows if r["model"] == model}):
            pack = next(r for r in rows if (r["model"], r["max_len"], r["strategy"]) ==
                        (model, L, "packing"))
            dyn = next(r for r in rows if (r["model"], r["max_len"], r["strategy"]) ==
                       (model, L, "dynamic"))
            out.append(f"| {model} | {L} | {rate_text(pack['tokens_per_s'])} | "
                       f"{rate_text(dyn['tokens_per_s'])} | {dyn['speedup_vs_packing']:.2f}x | "
                       f"{median(pack['micro_batches']):.0f}/{median(dyn['micro_batches']):.0f}"
                       f" | {median(pack['micro_batch_size']):.0f} |")
    return out


def paired_rows(rows: list[dict], model: str, strategy: str, baseline: str, has: str):
    """(max length, `strategy`'s row, `baseline`'s row) of one model at each max length where
    both have the field `has` (a row that failed has neither)."""
    def row(L, name):
        return next((r for r in rows if r["model"] == model and r["max_len"] == L
                     and r["strategy"] == name and r.get(has)), None)
    for L in sorted({r["max_len"] for r in rows if r["model"] == model}):
        mine, base = row(L, strategy), row(L, baseline)
        if mine and base:
            yield L, mine, base


def stronger_baseline_ratios(rows: list[dict], model: str, strategy: str = "dynamic",
                             baseline: str = "packing+segment-attn") -> list[tuple[int, float]]:
    """(max length, `strategy` tokens/s / `baseline` tokens/s) of one model."""
    return [(L, mine["tokens_per_s"] / base["tokens_per_s"])
            for L, mine, base in paired_rows(rows, model, strategy, baseline, "tokens_per_s")]


def per_round_ratios(rows: list[dict], model: str, strategy: str = "dynamic",
                     baseline: str = "packing+segment-attn") -> list[tuple[int, list[float]]]:
    """(max length, `strategy` / `baseline` tokens/s of each round both ran) of one model, from
    merged rows (merge_rounds); the strategies take turns within a round, so a slow spell of
    the machine hits both sides of a round's ratio alike. Lengths with fewer than two such
    rounds are left out."""
    out = []
    for L, mine, base in paired_rows(rows, model, strategy, baseline, "tokens_per_s_by_round"):
        a, b = mine["tokens_per_s_by_round"], base["tokens_per_s_by_round"]
        ratios = [a[k] / b[k] for k in sorted(set(a) & set(b))]
        if len(ratios) >= 2:
            out.append((L, ratios))
    return out


def busiest_rank_compute_s(row: dict) -> float | None:
    """Forward + backward seconds per timed iteration of the row's busiest rank (its time
    parts): no schedule of the same micro-batches on the same stages is shorter."""
    parts, iterations = row.get("time_parts_per_rank"), row.get("iterations")
    if not parts or not iterations:
        return None
    return max(p.get("forward", 0.0) + p.get("backward", 0.0) for p in parts) / iterations


def waitless_ceilings(rows: list[dict], model: str, strategy: str = "dynamic",
                      baseline: str = "packing+segment-attn") -> list[tuple[int, float]]:
    """(max length, the baseline's seconds per iteration / `strategy`'s busiest rank's compute
    per iteration) of one model: the most `strategy` could gain over the baseline if none of
    its ranks ever waited, its compute as measured. The two rows train the same global
    batches, so seconds per iteration compare as tokens/s do."""
    out = []
    for L, mine, base in paired_rows(rows, model, strategy, baseline, "elapsed_s"):
        busy = busiest_rank_compute_s(mine)
        if busy and base.get("iterations"):
            out.append((L, base["elapsed_s"] / base["iterations"] / busy))
    return out


def geometric_mean(values) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values))


PADDING_FREE_TARGET = 1.25     # geometric mean of dynamic / packing+segment-attn
PADDING_FREE_SLOTS = 0.97      # real tokens / token slots of dynamic (packed)


def padding_free_lines(rows: list[dict], model: str) -> list[str]:
    """The padding-free targets of one model: dynamic (packed) vs packing with per-segment
    attention (geometric mean, worst point), vs dynamic+padded at every point, slots real."""
    lines = []
    strong = stronger_baseline_ratios(rows, model)
    if strong:
        values = [v for _, v in strong]
        geo = geometric_mean(values)
        ok = "met" if geo >= PADDING_FREE_TARGET and min(values) >= 1.0 else "NOT met"
        lines.append(f"- {model.upper()} dynamic vs packing+segment-attn: "
                     f"{', '.join(f'{L}: {v:.2f}x' for L, v in strong)}; geometric mean "
                     f"{geo:.2f}x, lowest {min(values):.2f}x (target >= {PADDING_FREE_TARGET}x, "
                     f"none below 1.0x: {ok})")
    by_round = per_round_ratios(rows, model)
    if by_round:
        medians = [median(r) for _, r in by_round]
        lines.append(f"- {model.upper()} the same round by round, median (min-max): "
                     + ", ".join(f"{L}: {median(r):.2f}x ({min(r):.2f}-{max(r):.2f})"
                                 for L, r in by_round)
                     + f"; geometric mean of the medians {geometric_mean(medians):.2f}x")
    ceilings = waitless_ceilings(rows, model)
    if ceilings:
        lines.append(f"- {model.upper()} ceiling of dynamic with no waits at all (packing+"
                     f"segment-attn's seconds per iteration / dynamic's busiest rank's forward "
                     f"+ backward): {', '.join(f'{L}: {v:.2f}x' for L, v in ceilings)}; "
                     f"geometric mean {geometric_mean(v for _, v in ceilings):.2f}x")
    padded = stronger_baseline_ratios(rows, model, baseline="dynamic+padded")
    if padded:
        ok = "met" if min(v for _, v in padded) >= 1.0 else "NOT met"
        lines.append(f"- {model.upper()} dynamic vs dynamic+padded: "
                     f"{', '.join(f'{L}: {v:.2f}x' for L, v in padded)} (>= 1.0x at every "
                     f"point: {ok})")
    slots = [(r["max_len"], r["padding_efficiency_enc"], r.get("padding_efficiency_dec"))
             for r in rows if r["model"] == model and r["strategy"] == "dynamic"
             and "padding_efficiency_enc" in r]
    if slots:
        worst = min(min(e, d if d is not None else 1.0) for _, e, d in slots)
        ok = "met" if worst >= PADDING_FREE_SLOTS else "NOT met"
        lines.append(f"- {model.upper()} dynamic real tokens / slots: lowest {worst:.3f} "
                     f"(target >= {PADDING_FREE_SLOTS}: {ok})")
    return lines


def target_lines(rows: list[dict], projection: dict | None) -> list[str]:
    """Whether the issue's targets are met, from the figures above."""
    lines = []
    for model, target in (("gpt", 2.0), ("t5", 2.5)):
        lines += padding_free_lines(rows, model)
        r = next((r for r in rows if r["model"] == model and r["max_len"] == 4096
                  and r["strategy"] == "dynamic" and "speedup_vs_packing" in r), None)
        if r is None:
            lines.append(f"- {model.upper()} dynamic vs packing at max length 4096: not measured")
            continue
        ok = "met" if r["speedup_vs_packing"] >= target else "NOT met"
        lines.append(f"- {model.upper()} dynamic vs packing at max length 4096: "
                     f"{r['speedup_vs_packing']:.2f}x (target >= {target}x: {ok})")
        curve = sorted((x["max_len"], x["speedup_vs_packing"]) for x in rows
                       if x["model"] == model and x["strategy"] == "dynamic"
                       and "speedup_vs_packing" in x)
        grows = all(b[1] >= a[1] for a, b in zip(curve, curve[1:]))
        lines.append(f"- {model.upper()} speed-up over max length "
                     f"{', '.join(f'{L}: {v:.2f}x' for L, v in curve)} - "
                     f"{'grows with max length' if grows else 'does NOT grow monotonically'}")
    mfu = next((r for r in rows if r["model"] == "gpt" and r["max_len"] == 2048
                and r["strategy"] == "dynamic" and r.get("mfu") is not None), None)
    if mfu is not None:
        ok = "met" if mfu["mfu"] >= MFU_TARGET else "NOT met"
        lines.append(f"- GPT dynamic MFU on real tokens at max length 2048: "
                     f"{percent(mfu['mfu'])} (target >= {percent(MFU_TARGET)}: {ok})")
    if projection:
        sims = [("analytic A100 costs", projection["rows"])]
        if projection.get("cpu_fit"):
            sims.append(("costs fitted to a CPU profile", projection["cpu_fit"]["rows"]))
        for label, sim_rows in sims:
            for model, target in projection["targets_8192"].items():
                r = next((r for r in sim_rows if r["model"] == model
                          and r["max_len"] == 8192 and r["strategy"] == "dynamic"), None)
                if r:
                    ok = "met" if r["speedup_vs_packing"] >= target else "NOT met"
                    lines.append(f"- Simulation ({label}), {model.upper()} at 8192: "
                                 f"{r['speedup_vs_packing']:.2f}x (paper {target}x: {ok})")
    return lines


def memory_note(rows: list[dict], default: float) -> str:
    raised = sorted({(r["model"], r["max_len"], r["memory_gib"]) for r in rows
                     if r.get("memory_gib", default) != default})
    return ", ".join(f"{m.upper()} {L}: {g:g} GiB" for m, L, g in raised) or "none"


def report_markdown(result: dict, plots: dict) -> str:
    s = result["settings"]
    rows = result["rows"]
    projection = result.get("projection")
    lines = [
        f"Command: `{result['command']}`  ",
        f"Date: {result['date']}; commit `{result['commit']}`; wall time "
        f"{result['wall_s'] / 60:.0f} min for the training runs  ",
        f"Device: {result['device']} - {result['machine']}; load average "
        f"{', '.join(f'{x:.1f}' for x in result['load_average_end'])} at the end of the runs "
        f"(the machine is shared: figures are noisy, ratios come from the same invocation)",
        "",
        f"Measured: real training iterations of the training loop (`train_step`) with "
        f"{s['pp']}-stage pipeline parallelism, TP={s['tp']}, "
        f"{'bf16' if s['bf16'] else 'fp32'}, {s['threads']} thread(s) per rank; "
        f"GPT {s['num_layers']} layers / T5 {max(s['pp'], s['num_layers'] // 2)}+"
        f"{max(s['pp'], s['num_layers'] // 2)} layers, hidden {s['hidden_size']}, "
        f"{s['num_attention_heads']} heads, SentencePiece vocabulary; FLAN-like data from "
        f"tools/make_flan_sample.py; {s['tokens_per_global_batch']:,} tokens per global batch "
        f"(at least the max length"
        + (f", at least {s['rows_per_global_batch']} max-length rows"
           if s.get("rows_per_global_batch") else "")
        + f"); {s['warmup_iters']} warm-up + {s['iters']} timed iterations "
        f"(the same global batches for every strategy"
        + (f"; {s['rounds']} rounds, strategies interleaved, median round shown"
           if s.get("rounds", 1) > 1 else "")
        + "). T5 decoder max = max(128, L/4).",
        ("Planning: analytic cost model with this device's figures "
         f"({s['device_flops'] / 1e9:g} GFLOP/s, " if s.get("cost_model", "analytic") ==
         "analytic" else "Planning: the run's profile (--cost-model profile) with ("
         ) + f"{s['memory_gib']:g} GiB activations per rank, "
        f"doubled for a (model, max length) where not one packed row of the max length fits: "
        f"{memory_note(rows, s['memory_gib'])}) for "
        "every strategy; schedule 'auto' (faster of 1F1B and adaptive per iteration); recompute "
        "per micro-batch (cheapest that fits). Padding and packing use their best rows per "
        "micro-batch (power of two, least predicted time); packing is "
        + ("the packer with the most real tokens per slot on the timed batches (named in the "
           "table)" if s["packing_algorithm"] == "best" else s["packing_algorithm"])
        + " into rows of "
        "the max length, attention one SDPA call with the block-diagonal mask built on the "
        "device (megatron/model/attention.py mode 'mask'); packing+segment-attn is the same "
        "packing with only the samples' blocks computed (mode 'segments': FlexAttention on "
        "CUDA; on CPU, where torch 2.13 FlexAttention has no backward and nested-tensor SDPA "
        "finds no backend, segments grouped by length, one SDPA call per length). dynamic: "
        "DynaPipe's micro-batches as packed token streams (--dynamic-layout packed, attention "
        "per segment as above); dynamic+padded: the paper's rows, one sample each, padded to "
        "the longest of the micro-batch.",
        "Columns: tokens/s = sample tokens (no pads) / wall time of the timed iterations; "
        "(min-max over rounds, else over timed iterations); "
        "pad eff = real / padded tokens (T5 encoder/decoder); micro-batches, plan ms (planner "
        "worker time per iteration), plan wait ms (time train_step waited for its plan), "
        "s/iter: medians; peak MiB/rank: peak resident memory (CPU) or allocated (GPU), max "
        "over ranks; MFU: model FLOPs of the real tokens (dynapipe_ext/batching/model_flops.py) / "
        "(ranks x wall time x the one-thread sgemm rate measured before each group"
        f"{sgemm_note(rows)}).",
        "",
        *measured_table(rows),
        "",
        *mfu_section(rows),
        f"![speed-up over packing]({plots.get('speedup', 'throughput_speedup.png')})",
        f"![padding efficiency]({plots.get('padding', 'throughput_padding.png')})",
        "",
        "Targets:",
        *target_lines(rows, projection),
        "",
        "Reading the figures: the measured model is tiny (hidden 256), so attention's share of "
        "the work grows like S/hidden and a dense S x S masked attention over a packed row "
        "(memory-bound softmax on the CPU) soon dominates an iteration: that is why plain "
        "packing falls so far behind at long max lengths here, further than on the paper's "
        "GPUs and models (hidden 1024-4096). Packing with per-segment attention removes that "
        "waste; what dynamic micro-batching still gains over it is fewer pad positions, more "
        "(smaller) micro-batches for the pipeline and, at long max lengths, no recompute. The "
        "paper-scale simulations "
        "below use the analytic cost model and, separately, cost laws fitted to a profile of "
        "this CPU; their packed-attention and pipeline costs are estimates, not measurements, "
        "and they are reported as they came out.",
    ]
    if projection:
        dev = projection["device"]
        lines += [
            "",
            "### Paper-scale projection (SIMULATION, not measured)",
            "",
            f"Command: `python tools/project_paper_scale.py` (same commit). GPT hidden 4096, 32 "
            f"layers, TP={projection['tensor_parallel']['gpt']}; T5 hidden 1024, 24+24 layers, "
            f"TP={projection['tensor_parallel']['t5']}; {projection['stages']} pipeline stages; "
            f"{projection['tokens']:,} tokens per global batch; mean of "
            f"{projection['batches']} FLAN-like global batches (tools/bench_planner.py's "
            f"generator). Costs from the AnalyticCostModel with A100-like figures "
            f"({dev['device_flops'] / 1e12:g} TFLOP/s achieved, {dev['device_mem_bytes'] / 2**30:g} "
            f"GiB, bf16), not from a profile: predicted iteration time = simulated makespan of "
            f"the best schedule (1F1B/adaptive) of the planned micro-batches; packing tuned "
            f"as above.",
            "",
            *projection_table(projection),
        ]
    if projection and projection.get("cpu_fit"):
        lines += ["", *cpu_fit_section(projection["cpu_fit"])]
    return "\n".join(lines) + "\n"


def cpu_fit_section(fit: dict) -> list[str]:
    """Markdown of the projection whose costs are laws fitted to profiles of this CPU."""
    def grid_text(src: dict) -> str:
        layer = max((g for k, g in src["grid"].items() if k.endswith("_layer")), key=len)
        return ", ".join(f"{axis} {'/'.join(str(int(v)) for v in pts)}"
                         for axis, pts in layer.items())
    profiles = "; ".join(
        f"{model.upper()} " + " and ".join(
            f"hidden {p['hidden_size']} ({p['num_attention_heads']} heads, {grid_text(p)}, "
            f"{p['seconds'] or 0:.0f} s)" for p in srcs)
        for model, srcs in fit["profiles"].items())
    first = next(iter(fit["profiles"].values()))[0]
    errors = []
    for model, f in fit["fits"].items():
        errs = ", ".join(f"{field} {e['median_rel_err_worst'] * 100:.0f}% / "
                         f"{e['max_rel_err_worst'] * 100:.0f}% / "
                         f"{e.get('max_rel_err_large_worst', float('nan')) * 100:.0f}%"
                         for field, e in f["summary"].items() if field != "shared_bytes")
        errors.append(f"{model.upper()}: {errs}")
    return [
        "### Paper-scale projection with costs fitted to a profile of this CPU (SIMULATION, "
        "not measured)",
        "",
        "Command: `python tools/project_paper_scale.py --gpt-profiles docs/cpu_profile_gpt_"
        "h256.json docs/cpu_profile_gpt_h512.json --t5-profiles docs/cpu_profile_t5_h256.json "
        "docs/cpu_profile_t5_h512.json` "
        f"(commit `{fit.get('commit', 'unknown')}`, {fit.get('date', 'date unknown')}; profiles "
        "from tools/profile_cost_model.py, commands in the docstring of "
        "tools/project_paper_scale.py). "
        "Same paper models, layout, tokens, batches and planning as the table above; only the "
        "costs differ. Method: the real megatron-core layers were profiled on this CPU "
        f"({first['device']}, {first['dtype']}, {first['threads']} thread, median of "
        f"{first['repeats']} runs, recompute {'/'.join(first['modes'])}) at two small sizes - "
        f"{profiles} - and per layer kind, recompute mode and field a law was fitted by "
        "non-negative least squares in relative error: time = a x GEMM FLOPs + b x attention "
        "FLOPs + c x tokens x hidden + d; kept / shared / peak bytes = terms per token x "
        "hidden, per head x s^2, per s^2 and a constant. The laws are evaluated at the "
        "paper's sizes and lengths (up to 8192: an extrapolation from the profiled sizes and "
        "lengths), GEMM/attention FLOPs and score bytes divided by TP, no TP communication "
        f"cost; the float32 bytes are scaled by {fit['byte_scale']:g} (read as bf16); device "
        "memory and model states as the analytic projection (40 GiB, 16 bytes per "
        "parameter). Absolute tokens/s are those of a pipeline of 4 (or 8) such CPU cores and "
        "mean nothing for an A100; the ratios are the result.",
        f"Fit quality on the profiled points, relative error of the law, worst over the "
        f"transformer-layer and head laws and recompute modes (median / max over all points / "
        f"max over the points of at least 10% of the largest value): {'; '.join(errors)}. "
        "Kept bytes follow the law exactly; times are within ~10% at the median but single "
        "points are off by up to the max shown (the laws per kind and mode, with their "
        "errors, are in docs/bench_throughput.json under projection.cpu_fit); the transient "
        "peak fits poorly and only enters the memory check.",
        "",
        *projection_table(fit),
    ]
