"""The claims table of docs/BENCHMARKS.md and the results table of README.md, written from the
benchmark JSONs in docs/ (tools/write_claims.py), so that every figure they state is one its
JSON gives: each claim below reads its figures from the JSON it cites, and its date and
provenance come from that JSON. One current answer per claim; earlier runs live in
docs/BENCHMARK_LOG.md. Plain Python on already-loaded JSON (dicts), no file access."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from dynapipe_ext.report.throughput import geometric_mean, median

PROVENANCE_FIELDS = ("commit", "date", "command")
UNKNOWN = "unknown"
EQUAL_PADDING = 0.99       # real tokens per slot at which padding counts as equal


@dataclass(frozen=True)
class Source:
    """A JSON in docs/ and, optionally, the key of the run inside it that a figure comes from
    (gpu_h100_runs.json holds several runs, each with its own provenance)."""
    file: str
    part: tuple = ()


@dataclass(frozen=True)
class Claim:
    """One row: what is claimed, the figure text (from `figure(docs)`), the hardware, whether
    measured or simulated, the JSONs it cites, the BENCHMARKS section that reads it, and the
    README question it answers (README's results table holds the claims that have one)."""
    claim: str
    figure: Callable[[dict], str]
    hardware: str
    kind: str
    sources: tuple
    section: str = ""
    question: str = ""
    extra_links: tuple = field(default_factory=tuple)


# ---------------------------------------------------------------------------- provenance

def part_of(docs: dict, source: Source):
    doc = docs[source.file]
    for key in source.part:
        doc = doc[key]
    return doc


def provenance(doc) -> dict:
    """commit, date and command of a benchmark JSON (top level, its `meta` or its
    `provenance` block); UNKNOWN for what it does not record."""
    blocks = [doc] if isinstance(doc, dict) else []
    if isinstance(doc, dict):
        blocks += [doc.get("meta") or {}, doc.get("provenance") or {}]
    out = {}
    for name in PROVENANCE_FIELDS:
        out[name] = next((str(b[name]) for b in blocks if b.get(name)), UNKNOWN)
    return out


def source_dates(docs: dict, sources) -> str:
    dates = []
    for s in sources:
        date = provenance(part_of(docs, s))["date"]
        date = date.split(" ")[0] if date != UNKNOWN else "date unknown"
        if date not in dates:
            dates.append(date)
    return " / ".join(dates)


# ---------------------------------------------------------------------------- helpers

def rows_of(doc) -> list:
    return doc["rows"] if isinstance(doc, dict) else doc


def pick(rows, **match) -> dict:
    """The one row whose fields equal `match` (an error naming the match otherwise)."""
    found = [r for r in rows if all(r.get(k) == v for k, v in match.items())]
    if len(found) != 1:
        raise KeyError(f"{len(found)} rows match {match}")
    return found[0]


def x(value: float) -> str:
    return f"{value:.2f}x"


def pct(value: float, digits: int = 0) -> str:
    return f"{100 * value:.{digits}f}%"


def lengths_text(lengths) -> str:
    return " / ".join(str(L) for L in lengths)


# ---------------------------------------------------------------------------- padding-free

def packing_rows(rows, model: str, max_len: int) -> list[dict]:
    return [r for r in rows if r["model"] == model and r["max_len"] == max_len
            and r["strategy"].startswith("packing") and "tokens_per_s" in r]


def best_packing(rows, model: str, max_len: int) -> dict:
    """Packing at its best: the packing row of the highest median tokens/s."""
    return max(packing_rows(rows, model, max_len), key=lambda r: r["tokens_per_s"])


def round_ratios(mine: dict, base: dict) -> list[float]:
    """`mine` / `base` tokens/s, round by round (rounds interleave the strategies)."""
    a, b = mine.get("tokens_per_s_by_round") or {}, base.get("tokens_per_s_by_round") or {}
    common = sorted(set(a) & set(b))
    if not common:
        return [mine["tokens_per_s"] / base["tokens_per_s"]]
    return [a[k] / b[k] for k in common]


def lengths(rows, model: str) -> list[int]:
    return sorted({r["max_len"] for r in rows if r["model"] == model})


def slots(row: dict) -> float:
    """Real tokens per slot of a row, the worse of encoder and decoder."""
    dec = row.get("padding_efficiency_dec")
    return min(row["padding_efficiency_enc"], dec if dec is not None else 1.0)


def vs_best_packing(docs: dict, model: str) -> str:
    rows = rows_of(docs["bench_padding_free.json"])
    parts, medians, winners = [], [], []
    for L in lengths(rows, model):
        best = best_packing(rows, model, L)
        ratios = round_ratios(pick(rows, model=model, max_len=L, strategy="dynamic"), best)
        medians.append(median(ratios))
        parts.append(f"{x(median(ratios))} ({min(ratios):.2f}-{max(ratios):.2f})")
        winners.append(f"{best['strategy']} ({best['packing_algorithm']})")
    rounds = docs["bench_padding_free.json"]["settings"].get("rounds", 1)
    return (f"{' / '.join(parts)} at max length {lengths_text(lengths(rows, model))} (median "
            f"and min-max of {rounds} interleaved rounds' ratios; geometric mean "
            f"{x(geometric_mean(medians))}); packing at its best was "
            f"{' / '.join(winners)}")


def equal_padding(docs: dict, model: str) -> str:
    """Dynamic vs packing at its best where both fill >= EQUAL_PADDING of their slots, else
    how far the packing falls short."""
    rows = rows_of(docs["bench_padding_free.json"])
    parts = []
    for L in lengths(rows, model):
        dyn = pick(rows, model=model, max_len=L, strategy="dynamic")
        fill = max(packing_rows(rows, model, L), key=slots)
        if slots(fill) >= EQUAL_PADDING and slots(dyn) >= EQUAL_PADDING:
            ratios = round_ratios(dyn, fill)
            parts.append(f"{L}: {x(median(ratios))} ({min(ratios):.2f}-{max(ratios):.2f}) vs "
                         f"{fill['strategy']} at {slots(fill):.3f} / {slots(dyn):.3f}")
        else:
            parts.append(f"{L}: not equal (best packing fills {slots(fill):.3f}, dynamic "
                         f"{slots(dyn):.3f})")
    return "; ".join(parts)


def dynamic_slots(docs: dict) -> str:
    rows = rows_of(docs["bench_padding_free.json"])
    out = []
    for model in ("gpt", "t5"):
        dyn = [r for r in rows if r["model"] == model and r["strategy"] == "dynamic"
               and "padding_efficiency_enc" in r]
        packs = [max(packing_rows(rows, model, L), key=slots) for L in lengths(rows, model)]
        if dyn:
            out.append(f"{model.upper()} dynamic lowest {min(map(slots, dyn)):.3f}, packing's "
                       f"best fill {min(map(slots, packs)):.3f}-{max(map(slots, packs)):.3f}")
    return "; ".join(out) + " (T5: the worse of encoder and decoder)"


def plan_wait(docs: dict) -> str:
    rows = [r for r in rows_of(docs["bench_padding_free.json"]) if r["strategy"] == "dynamic"
            and "plan_wait_s" in r]
    shares = [sum(r["plan_wait_s"]) / sum(r["iteration_s"]) for r in rows]
    total = sum(sum(r["plan_wait_s"]) for r in rows) / sum(sum(r["iteration_s"]) for r in rows)
    return (f"{pct(total, 2)} of the timed iterations of dynamic's {len(rows)} runs (median "
            f"rounds), worst run {pct(max(shares), 2)}; target 2%")


def mfu(docs: dict) -> str:
    row = pick(rows_of(docs["bench_padding_free.json"]), model="gpt", max_len=2048,
               strategy="dynamic")
    return (f"GPT dynamic at max length 2048: {pct(row['mfu'], 1)} of the one-thread sgemm rate "
            f"(target 55%: {'met' if row['mfu'] >= 0.55 else 'not met'})")


# ---------------------------------------------------------------------------- GPU

def gpu_rows(docs: dict, run: str) -> list:
    return docs["gpu_h100_runs.json"]["throughput"][run]["rows"]


def gpu_gpt(docs: dict) -> str:
    rows = gpu_rows(docs, "gpt_strategies_2048_4096")
    dyn = pick(rows, max_len=4096, strategy="dynamic")["tokens_per_s"]
    flex = pick(rows, max_len=4096, strategy="packing+segment-attn")["tokens_per_s"]
    dense = pick(rows, max_len=4096, strategy="packing")["tokens_per_s"]
    profiled = pick(gpu_rows(docs, "gpt_4096_dynamic_profile"), strategy="dynamic")
    return (f"within one run: {x(dyn / flex)} of packing with FlexAttention ({dyn:,.0f} vs "
            f"{flex:,.0f} tokens/s), {x(dyn / dense)} of packing with a dense mask "
            f"({dense:,.0f}); the profiled plan ran {profiled['tokens_per_s']:,.0f} tokens/s "
            f"in a separate run, not set against either")


def gpu_t5(docs: dict) -> str:
    rows = gpu_rows(docs, "t5_2048")
    dyn = pick(rows, strategy="dynamic")["tokens_per_s"]
    flex = pick(rows, strategy="packing+segment-attn")["tokens_per_s"]
    return f"{x(dyn / flex)} ({dyn:,.0f} vs {flex:,.0f} tokens/s, one run)"


def gpu_memory(docs: dict) -> str:
    suite = docs["gpu_h100_runs.json"]["gpu_suite"]
    return (f"{suite['training_gpt_1gpu']['predicted_over_measured']:.2f} (GPT), "
            f"{suite['training_t5_1gpu']['predicted_over_measured']:.2f} (T5)")


def gpu_bf16(docs: dict) -> str:
    suite = docs["gpu_h100_runs.json"]["gpu_suite"]
    out = []
    for model in ("gpt", "t5"):
        s = suite[f"bf16_vs_fp32_1gpu_{model}"]
        loss = abs(s["bf16_loss"] - s["fp32_loss"]) / abs(s["fp32_loss"])
        out.append(f"{model.upper()} loss {loss:.1e} relative, worst gradient "
                   f"{pct(s['worst_grad_rel_error'], 1)}")
    return "; ".join(out) + " (tolerance 5%)"


# ---------------------------------------------------------------------------- planner

def planner_time(docs: dict) -> str:
    rows = docs["bench_planner.json"]["rows"]
    out = []
    for model, target in (("gpt", 50), ("t5", 100)):
        r = pick(rows, model=model, tokens=65536, max_len=4096, stages=4, strategy="dynamic")
        out.append(f"{model.upper()} {r['plan_cpu_ms']:.1f} ms CPU / {r['plan_ms']:.1f} ms wall "
                   f"(target {target} ms: {'met' if r['plan_cpu_ms'] <= target else 'not met'})")
    return "; ".join(out)


def planner_prediction(docs: dict) -> str:
    rows = docs["bench_planner.json"]["rows"]
    out = []
    for model in ("gpt", "t5"):
        def ms(strategy):
            return pick(rows, model=model, tokens=65536, max_len=4096, stages=4,
                        strategy=strategy)["predicted_iteration_ms"]
        out.append(f"{model.upper()} {x(ms('packing') / ms('dynamic'))}")
    return ", ".join(out) + " faster (65,536 tokens, max length 4096, 4 stages)"


def sample_order(docs: dict) -> str:
    order = docs["bench_planner.json"]["order_rows"]
    ratios = [r["chosen_ms"] / r["objective_ms"]["cluster-tsp"] for r in order]
    return (f"{sum(ratios) / len(ratios):.4f} on average, worst {max(ratios):.4f} over "
            f"{len(ratios)} batches")


def replica_balance(docs: dict) -> str:
    rows = docs["bench_planner.json"]["replica_rows"]
    dps = sorted({r["dp"] for r in rows})
    return f"{max(r['after'] for r in rows):.4f} at DP {'/'.join(map(str, dps))} (target 1.02)"


# ---------------------------------------------------------------------------- packers

def packers(docs: dict) -> str:
    rows = docs["bench_packers.json"]["rows"]
    gpt = [r for r in rows if r["model"] == "gpt" and r["max_len"] == 2048]
    window = max(gpt, key=lambda r: r["windowed"]["real_over_slots"][0])
    per_batch = max(gpt, key=lambda r: r["per_batch"]["8192"]["real_over_slots"][0])
    nextfit = pick(gpt, packer="nextfit")
    return (f"GPT, max length 2048: {window['windowed']['real_over_slots'][0]:.3f} with the "
            f"dataset packed ahead (`{window['packer']}`); "
            f"{per_batch['per_batch']['8192']['real_over_slots'][0]:.3f} per 8,192-token batch "
            f"(`{per_batch['packer']}`); next-fit per batch "
            f"{nextfit['per_batch']['8192']['real_over_slots'][0]:.3f}")


# ---------------------------------------------------------------------------- schedules

def adaptive_vs_1f1b(docs: dict) -> str:
    rows = docs["bench_schedules.json"]["rows"]

    def gains(kind):
        return [r["candidates"]["1f1b"]["makespan_ms"] / r["candidates"]["adaptive"]["makespan_ms"]
                for r in rows if r["strategy"] == kind]
    synthetic, dynamic = gains("synthetic-lognormal"), gains("dynamic")
    return (f"{min(synthetic):.2f}x-{max(synthetic):.2f}x on long-tailed synthetic costs; "
            f"{min(dynamic):.2f}x-{max(dynamic):.2f}x on dynamic's FLAN-like micro-batches "
            f"(P = 2 / 4 / 8)")


def plan_generation(docs: dict) -> str:
    timing = docs["bench_schedules.json"]["plan_timing"]
    cands = timing["candidates"]
    single = {k: v["total_cpu_ms"] for k, v in cands.items() if k in ("1f1b", "wave1")}
    every = next(v for k, v in cands.items() if k.startswith("all"))
    return (f"{single['1f1b']:.1f} ms (1F1B) to {single['wave1']:.1f} ms (wave) CPU for one "
            f"layout's candidates; {every['total_cpu_ms']:.1f} ms for all four (target "
            f"{timing['target_ms']:.0f} ms)")


WAVES = ("wave1", "wave2", "wave4")
HANAYO_PAPER = ("Hanayo (Liu et al., SC'23), abstract: the wave \"mitigates the issues of "
                "pipeline bubbles and excessive memory consumption\" without model copies")


def fits_1f1b_memory(cell: dict) -> bool:
    """Whether a schedule's textbook cell found an order under 1F1B's peak (its capped run)."""
    return bool(cell.get("capped")) and "error" not in cell["capped"]


def hanayo_memory(docs: dict) -> str:
    book = docs["bench_schedules.json"]["textbook"]
    at_2p = [t for t in book if t["m"] == 2 * t["P"]]
    peaks = [t["cells"][w]["free"]["peak_copies"] for t in at_2p for w in WAVES]
    misfits = sorted({t["P"] for t in book if t["m"] >= 2 * t["P"]
                      and not any(fits_1f1b_memory(t["cells"][w]) for w in WAVES)})
    return (f"the wave (W = 1 / 2 / 4) holds {min(peaks):.2f}-{max(peaks):.2f} model copies of "
            f"activations at m = 2P, 1F1B 1.00; under 1F1B's memory no wave fits at P = "
            f"{' / '.join(map(str, misfits))} (m >= 2P), where the paper claims relief of "
            f"both bubbles and memory")


def hanayo_table(docs: dict) -> str:
    """The wave's simulated peak memory beside 1F1B's and the paper's claim, per textbook case."""
    book = docs["bench_schedules.json"]["textbook"]
    lines = ["| P | m | 1F1B peak (model copies) | wave W=1 / 2 / 4 peak, no cap | wave fits "
             "under 1F1B's peak (W=1 / 2 / 4) | wave bubble, no cap / 1F1B's | the paper |",
             "|---:|---:|---:|---|---|---|---|"]
    for t in book:
        cells = t["cells"]
        peaks = " / ".join(f"{cells[w]['free']['peak_copies']:.2f}" for w in WAVES)
        fits = " / ".join("yes" if fits_1f1b_memory(cells[w]) else "no" for w in WAVES)
        bubble = " / ".join(f"{pct(cells[w]['free']['bubble'], 1)}" for w in WAVES)
        lines.append(f"| {t['P']} | {t['m']} | {cells['1f1b']['free']['peak_copies']:.2f} | "
                     f"{peaks} | {fits} | {bubble} / {pct(cells['1f1b']['free']['bubble'], 1)} "
                     f"| less bubble and less memory |")
    return "\n".join(lines)


def schedules_measured(docs: dict) -> str:
    rows = docs["bench_pipeline_training.json"]["rows"]
    out = []
    for model in ("gpt", "t5"):
        mine = sorted((r for r in rows if r["model"] == model),
                      key=lambda r: -r["tokens_per_s"])
        out.append(f"{model.upper()} " + ", ".join(
            f"{r['schedule'].split(' (')[0].split(' layout')[0]} {r['tokens_per_s']:,.0f}"
            for r in mine))
        ratio = [r["measured_over_predicted"] for r in mine]
        out[-1] += f" tokens/s (measured / predicted {min(ratio):.2f}-{max(ratio):.2f})"
    return "; ".join(out)


# ---------------------------------------------------------------------------- memory, costs

def memory_model(docs: dict) -> str:
    worst = docs["memory_validation.json"]["worst_abs_error"]
    return (f"worst {pct(max(worst['none'], worst['selective']))} (no recompute, selective), "
            f"{pct(worst['full'])} (full recompute)")


def cost_model(docs: dict) -> str:
    check = docs["cost_model_check.json"]
    out = []
    for model in ("t5", "gpt"):
        s = check[model]["summary"]
        out.append(f"{model.upper()} max {s['profile']['max_shape_error_pct']:.0f}% vs "
                   f"{s['analytic']['max_shape_error_pct']:.0f}%")
    return "; ".join(out)


def dense_mask_cpu(docs: dict) -> str:
    rows = docs["bench_throughput.json"]["rows"]
    return ", ".join(f"{m.upper()} {x(pick(rows, model=m, max_len=4096, strategy='dynamic')['speedup_vs_packing'])}"
                     for m in ("gpt", "t5"))


def paper_scale(docs: dict) -> str:
    proj = docs["bench_throughput.json"]["projection"]
    out = []
    for model, target in proj["targets_8192"].items():
        r = pick(proj["rows"], model=model, max_len=8192, strategy="dynamic")
        out.append(f"{model.upper()} {x(r['speedup_vs_packing'])} (paper {target}x)")
    return ", ".join(out)


# ---------------------------------------------------------------------------- FlexTP

FLEXTP_RUNS = (("bench_flextp_trainer.json", "synthetic PP=1"),
               ("bench_flextp_trainer_pp2.json", "synthetic PP=2"),
               ("bench_flextp_trainer_taskset.json", "busy process PP=1"),
               ("bench_flextp_trainer_pp2_taskset.json", "busy process PP=2"))


def flextp_config(doc: dict, prefix: str) -> dict:
    """The run's policy `prefix` (the exact name first: "even" before "even, synthetic ...")."""
    configs = doc["summary"]["configs"]
    if prefix in configs:
        return configs[prefix]
    return next(v for k, v in configs.items() if k.startswith(prefix + ","))


def flextp_speed(docs: dict) -> str:
    semi, migrate, resize = [], [], []
    for name, _ in FLEXTP_RUNS:
        doc = docs[name]
        ideal = doc["summary"]["ideal"]      # the time with the straggler's share balanced
        semi.append(flextp_config(doc, "semi")["median"] / ideal)
        migrate.append(flextp_config(doc, "migrate")["median"] / ideal)
        resize.append(flextp_config(doc, "even")["median"] / flextp_config(doc, "resize")["median"])
    label = " / ".join(lab for _, lab in FLEXTP_RUNS)
    return (f"semi {' / '.join(f'{v:.2f}x' for v in semi)} and migrate "
            f"{' / '.join(f'{v:.2f}x' for v in migrate)} of the ideal time (targets 1.10x, "
            f"1.15x); resize {' / '.join(f'{v:.2f}x' for v in resize)} faster than even TP "
            f"(target 1.2x) ({label})")


LOSS_BOUND = 0.01      # the loss cost FlexTP may have: +1% held-out loss


def mean_and_two_se(values) -> tuple[float, float]:
    """Mean and two standard errors (about a 95% interval) of per-seed values."""
    values = list(values)
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else float("inf")
    return mean, 2 * (var / n) ** 0.5


def flextp_loss(docs: dict) -> str:
    """Each policy's same-seed held-out loss difference from no straggler, mean +- 2 SE over
    seeds, against the criterion restated at the study's resolution: a loss cost of at most
    LOSS_BOUND with ~95% confidence (mean + 2 SE below it)."""
    summary = docs["bench_flextp_loss.json"]["summary"]
    seeds = len(summary["no straggler"]["losses"])
    out, passed = [], []
    for name, s in summary.items():
        if name == "no straggler":
            continue
        mean, two_se = mean_and_two_se(s["relative"].values())
        out.append(f"{name} {100 * mean:+.2f} +- {100 * two_se:.2f}%")
        passed.append((name, mean + two_se < LOSS_BOUND))
    failing = [n for n, ok in passed if not ok]
    return (f"same-seed difference from no straggler, mean +- 2 standard errors over {seeds} "
            f"seeds: {', '.join(out)}; criterion (cost below {pct(LOSS_BOUND)} with ~95% "
            f"confidence) met by "
            f"{', '.join(n for n, ok in passed if ok) or 'none'}"
            + (f", not resolved for {', '.join(failing)}" if failing else ""))


# ---------------------------------------------------------------------------- Spindle

def spindle_sim(docs: dict) -> str:
    rows = rows_of(docs["bench_spindle.json"])
    bound = [r["spindle_to_bound"] for r in rows]
    compute = [r["spindle_compute_to_bound"] for r in rows]
    uniform = [r["uniform_ms"] / r["spindle_ms"] for r in rows]
    devices = sorted({r["devices"] for r in rows})
    return (f"whole iteration {min(bound):.2f}x-{max(bound):.2f}x the lower bound (wave compute "
            f"{min(compute):.2f}x-{max(compute):.2f}x); {min(uniform):.2f}x-{max(uniform):.2f}x "
            f"faster than uniform at {devices[0]}-{devices[-1]} devices")


def spindle_run(docs: dict) -> str:
    rows = rows_of(docs["bench_spindle_run.json"])
    sp = pick(rows, strategy="spindle")
    out = [f"vs {r['strategy']} {x(r['measured_ms'] / sp['measured_ms'])} by median, "
           f"{x(r['min_ms'] / sp['min_ms'])} by fastest iteration"
           for r in rows if r["strategy"] != "spindle"]
    return (f"{'; '.join(out)}; predicted {sp['predicted_ms']:.1f} ms, measured "
            f"{sp['measured_ms']:.1f} ms")


# ---------------------------------------------------------------------------- the claims

PF = Source("bench_padding_free.json")
CLAIMS = (
    Claim("Dynamic micro-batching (packed streams) vs packing at its very best (the faster of "
          "per-batch and dataset-level packing, each with its best packer, rows per "
          "micro-batch searched, per-segment attention), GPT, PP=2",
          lambda d: vs_best_packing(d, "gpt"), "CPU, 2 ranks", "measured", (PF,),
          "#against-packing-at-its-very-best",
          "Does dynamic micro-batching beat packing at its very best (GPT)?"),
    Claim("The same, T5", lambda d: vs_best_packing(d, "t5"), "CPU, 2 ranks", "measured", (PF,),
          "#against-packing-at-its-very-best",
          "Does dynamic micro-batching beat packing at its very best (T5)?"),
    Claim(f"What dynamic gains from its planner once padding is equal (both >= "
          f"{EQUAL_PADDING} real tokens per slot), GPT",
          lambda d: equal_padding(d, "gpt"), "CPU, 2 ranks", "measured", (PF,),
          "#against-packing-at-its-very-best",
          "And once padding is equal (GPT; T5 pair packing cannot fill its slots)?"),
    Claim("The same, T5", lambda d: equal_padding(d, "t5"), "CPU, 2 ranks", "measured", (PF,),
          "#against-packing-at-its-very-best"),
    Claim("Real tokens per slot", dynamic_slots, "CPU, 2 ranks", "measured", (PF,),
          "#against-packing-at-its-very-best"),
    Claim("Time spent waiting for plans (planning ahead in a worker process)", plan_wait,
          "CPU, 2 ranks", "measured", (PF,), "#against-packing-at-its-very-best"),
    Claim("MFU on real tokens", mfu, "CPU, 2 ranks", "measured", (PF,),
          "#against-packing-at-its-very-best"),
    Claim("Dynamic (padded rows, analytic plan) vs packing, GPT 16 layers x hidden 2048, max "
          "length 4096, TP = PP = DP = 1", gpu_gpt, "one H100 80GB", "measured",
          (Source("gpu_h100_runs.json", ("throughput", "gpt_strategies_2048_4096")),
           Source("gpu_h100_runs.json", ("throughput", "gpt_4096_dynamic_profile"))),
          "#gpu-first-runs-on-one-h100-2026-11-23", "And on a GPU?"),
    Claim("Dynamic (padded rows) vs packing with FlexAttention, T5 8+8 layers x hidden 2048, "
          "max length 2048", gpu_t5, "one H100 80GB", "measured",
          (Source("gpu_h100_runs.json", ("throughput", "t5_2048")),),
          "#gpu-first-runs-on-one-h100-2026-11-23"),
    Claim("Peak memory of rank 0, predicted / measured", gpu_memory, "one H100 80GB",
          "measured", (Source("gpu_h100_runs.json"),), "#gpu-first-runs-on-one-h100-2026-11-23"),
    Claim("bf16 step vs the fp32 reference", gpu_bf16, "one H100 80GB", "measured",
          (Source("gpu_h100_runs.json"),), "#gpu-first-runs-on-one-h100-2026-11-23"),
    Claim("Planning time of `dynamic`, 65,536 tokens, max length 4096, 4 stages",
          planner_time, "CPU, one core", "measured", (Source("bench_planner.json"),),
          "#planner", "Is the planner fast enough?"),
    Claim("Predicted iteration time of `dynamic` vs packing, same batches", planner_prediction,
          "analytic A100-like costs", "simulated", (Source("bench_planner.json"),), "#planner",
          "How do its plans compare with packing's?"),
    Claim("T5 sample order vs the paper's clustering + TSP (objective of the chosen plan / "
          "clustering + TSP's)", sample_order, "analytic costs", "simulated",
          (Source("bench_planner.json"),), "#t5-sample-order-flan-like-multi-task-batches",
          "Does it match the paper's method?"),
    Claim("Worst data-parallel replica imbalance of dynamic plans", replica_balance,
          "analytic costs", "simulated", (Source("bench_planner.json"),), "#replica-balance"),
    Claim("Real tokens per slot of the packers", packers, "CPU (packing only)", "measured",
          (Source("bench_packers.json"),), "#packers-per-batch-and-dataset-level"),
    Claim("Adaptive schedule vs 1F1B at equal memory", adaptive_vs_1f1b, "analytic costs",
          "simulated", (Source("bench_schedules.json"),), "#schedules",
          "Do schedules fit memory?"),
    Claim("Hanayo's wave: activation memory vs 1F1B (textbook stages)", hanayo_memory,
          "unit costs", "simulated", (Source("bench_schedules.json"),),
          "#hanayos-wave-its-memory-beside-1f1bs-and-the-papers-claim"),
    Claim("Plan generation (schedule search, lowering, check), 64 micro-batches on 8 stages",
          plan_generation, "CPU, one core", "measured", (Source("bench_schedules.json"),),
          "#schedules"),
    Claim("Schedules measured at PP=2 (GPT 4 layers, T5 2+2), tokens/s", schedules_measured,
          "CPU, 2 ranks", "measured", (Source("bench_pipeline_training.json"),),
          "#pipeline-schedules-measured", "Which schedule is fastest here?"),
    Claim("Activation memory per pipeline rank, predicted vs measured", memory_model, "CPU",
          "measured", (Source("memory_validation.json"),),
          "#activation-memory-predicted-vs-measured"),
    Claim("Micro-batch time, error in shape ranking after one scale factor (profiled vs "
          "analytic cost model)", cost_model, "CPU", "measured",
          (Source("cost_model_check.json"),),
          "#cost-model-predicted-vs-measured-micro-batch-time-cpu"),
    Claim("Dynamic vs next-fit packing with a dense S x S mask (a weak baseline on CPU), "
          "8,192 tokens per batch, max length 4096", dense_mask_cpu, "CPU, 2 ranks",
          "measured", (Source("bench_throughput.json"),), "#training-throughput"),
    Claim("Dynamic vs packing at the paper's model sizes, max length 8192", paper_scale,
          "analytic A100-like costs", "simulated", (Source("bench_throughput.json"),),
          "#paper-scale-projection-simulation-not-measured"),
    Claim("FlexTP in `pretrain_gpt.py`, steady straggler on TP rank 1, TP=2", flextp_speed,
          "CPU, 2 cores, ranks pinned", "measured",
          tuple(Source(name) for name, _ in FLEXTP_RUNS),
          "#flextp-does-it-absorb-a-straggler-and-at-what-loss",
          "FlexTP under a steady straggler?"),
    Claim("FlexTP loss cost: held-out loss after 200 iterations, 2x straggler, resize bound "
          "0.375 (noise floor: migrate changes only summation order)", flextp_loss,
          "CPU, 2 ranks", "measured", (Source("bench_flextp_loss.json"),),
          "#flextp-held-out-loss-over-seeds", "And at what loss?"),
    Claim("Spindle vs the global lower bound and the uniform layout, 3 multi-task multi-modal "
          "models", spindle_sim, "assumed accelerator (400 TFLOP/s)", "simulated",
          (Source("bench_spindle.json"),),
          "#spindle-multi-task-multi-modal-wavefront-scheduling-simulation",
          "Spindle vs the global lower bound / uniform?"),
    Claim("Spindle vs the uniform layout, small model, 2 processes", spindle_run, "CPU, 2 ranks",
          "measured", (Source("bench_spindle_run.json"),),
          "#spindle-measured-run-2-processes-this-machine"),
)


# ---------------------------------------------------------------------------- tables

def evidence(claim: Claim, prefix: str) -> str:
    files = []
    for s in claim.sources:
        if s.file not in files:
            files.append(s.file)
    links = [f"[{f}]({prefix}{f})" for f in files]
    if claim.section:
        page = "docs/BENCHMARKS.md" if prefix else ""
        links.append(f"[section]({page}{claim.section})")
    return ", ".join(links)


def commits(docs: dict, claim: Claim) -> str:
    out = []
    for s in claim.sources:
        c = provenance(part_of(docs, s))["commit"]
        c = f"`{c}`" if c != UNKNOWN else "commit unknown"
        if c not in out:
            out.append(c)
    return " / ".join(out)


def hardware_text(docs: dict, claim: Claim) -> str:
    """The claim's hardware, with the 1-minute load average before and after each cited run
    that recorded it (a shared machine's figures are only as good as its load)."""
    loads = []
    for s in claim.sources:
        doc = part_of(docs, s)
        before = doc.get("load_average_before") if isinstance(doc, dict) else None
        after = doc.get("load_average_after") if isinstance(doc, dict) else None
        if before and after:
            text = f"{before[0]:.1f} / {after[0]:.1f}"
            if text not in loads:
                loads.append(text)
    if not loads:
        return claim.hardware
    return f"{claim.hardware}, load average {', '.join(loads)} before / after"


def claims_table(docs: dict) -> str:
    """The claims table of docs/BENCHMARKS.md (links relative to docs/)."""
    lines = ["| claim | figure | hardware | date | commit | kind | evidence |",
             "|---|---|---|---|---|---|---|"]
    for c in CLAIMS:
        lines.append(f"| {c.claim} | {c.figure(docs)} | {hardware_text(docs, c)} | "
                     f"{source_dates(docs, c.sources)} | {commits(docs, c)} | {c.kind} | "
                     f"{evidence(c, '')} |")
    return "\n".join(lines)


def results_table(docs: dict) -> str:
    """README's results table: the claims with a question (links relative to the root)."""
    lines = ["| question | answer | kind | date | evidence |", "|---|---|---|---|---|"]
    for c in CLAIMS:
        if c.question:
            lines.append(f"| {c.question} | {c.figure(docs)} | {c.kind}, {hardware_text(docs, c)} | "
                         f"{source_dates(docs, c.sources)} | {evidence(c, 'docs/')} |")
    return "\n".join(lines)


def cited_files() -> list[str]:
    out = []
    for c in CLAIMS:
        for s in c.sources:
            if s.file not in out:
                out.append(s.file)
    return out


def missing_provenance(docs: dict) -> list[str]:
    """'file[part]: field' for every cited run whose JSON records no commit, date or command
    (not even as an explicit UNKNOWN in a `provenance` block)."""
    out = []
    for c in CLAIMS:
        for s in c.sources:
            doc = part_of(docs, s)
            blocks = [doc, doc.get("meta") or {}, doc.get("provenance") or {}] \
                if isinstance(doc, dict) else []
            for name in PROVENANCE_FIELDS:
                if not any(b.get(name) for b in blocks):
                    item = f"{s.file}{list(s.part) if s.part else ''}: {name}"
                    if item not in out:
                        out.append(item)
    return out



# ---------------------------------------------------------------------------- sections

def load_text(values) -> str:
    return ", ".join(f"{v:.1f}" for v in values) if values else "not recorded"


def loaded_text(doc: dict) -> str:
    """Whether the run shared its cores: a 1-minute load average above the bench's own two
    ranks before or after it."""
    loads = [v[0] for v in (doc.get("load_average_before"), doc.get("load_average_after")
                            or doc.get("load_average_end")) if v]
    if loads and max(loads) > 2 * 2:
        return ("**The machine was loaded** (other processes shared its cores), so absolute "
                "tokens/s are low and noisy; the strategies take turns within each round, so a "
                "slow spell hits all of a round alike, and ratios are taken round by round.")
    return "The bench's own ranks and planner workers were the machine's load."


def padding_free_section(docs: dict) -> str:
    """The section that opens docs/BENCHMARKS.md: the padding-free comparison's provenance,
    its measured table and what it answers (dynamic vs packing at its very best)."""
    from dynapipe_ext.report.throughput import measured_table
    doc = docs["bench_padding_free.json"]
    s, machine = doc["settings"], doc.get("machine_fields") or {}
    done = doc.get("groups_done")
    status = ("complete" if doc.get("complete", True) else
              f"PARTIAL: the run was cut off after {len(done or [])} of its (model, max length) "
              f"groups ({', '.join(f'{m.upper()} {L}' for m, L in done or [])})")
    lines = [
        f"Command: `{doc['command']}`  ",
        f"Commit `{doc['commit']}`"
        + (f" (with uncommitted changes to {', '.join(doc['uncommitted_changes'])})"
           if doc.get("uncommitted_changes") else "")
        + f"; started {doc['date']}; wall time {doc.get('wall_s', 0) / 60:.0f} min; {status}  ",
        f"Machine: {machine.get('cpu_model', doc.get('machine', 'not recorded'))}, "
        f"{machine.get('logical_cpus', '?')} logical CPUs, torch {machine.get('torch', '?')}; "
        f"load average (1, 5, 15 min) {load_text(doc.get('load_average_before'))} before and "
        f"{load_text(doc.get('load_average_after') or doc.get('load_average_end'))} after. "
        + loaded_text(doc),
        "",
        f"GPT {s['num_layers']} layers / T5 {max(s['pp'], s['num_layers'] // 2)}+"
        f"{max(s['pp'], s['num_layers'] // 2)}, hidden {s['hidden_size']}, fp32, PP={s['pp']} "
        f"(one process per stage), {s['warmup_iters']} warm-up + {s['iters']} timed iterations, "
        f"{s.get('rounds', 1)} rounds with the strategies interleaved (the median round shown, "
        f"min-max over rounds in brackets), global batches of {s['rows_per_global_batch']} "
        "max-length rows of tokens (the same batches for per-batch packing and dynamic; "
        "packing+window's are whole rows of its window). Packing at its very best is "
        "the faster of: packing+segment-attn, each global batch packed alone with the packer "
        "of most real tokens per slot on the timed batches and the rows per micro-batch the "
        "planner finds fastest per batch; and packing+window, the data stream packed ahead "
        f"in windows of {s.get('packing_window', '?')} samples (`--packing-window`, "
        "dataset-level packing as NeMo and Megatron-Bridge users pack offline; GPT rows, T5 "
        "encoder-decoder pairs with both lengths held) with its own best packer, at the same "
        "tokens per global batch. Both compute attention per sample (per-segment attention). "
        "dynamic: DynaPipe's micro-batches as packed token streams.",
        "",
        *measured_table(rows_of(doc)),
        "",
        "What it answers (ratios round by round against packing at its very best, median and "
        "min-max; the table's 'vs fastest packing' divides the median rounds instead, so the "
        "two differ where rounds spread):",
    ]
    rows = rows_of(doc)
    for model in ("gpt", "t5"):
        if any(r["model"] == model for r in rows):
            lines.append(f"- {model.upper()}: {vs_best_packing(docs, model)}.")
            lines.append(f"- {model.upper()} once padding is equal (both >= {EQUAL_PADDING} real "
                         f"tokens per slot): {equal_padding(docs, model)}.")
    return "\n".join(lines)
