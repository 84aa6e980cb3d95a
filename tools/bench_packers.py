#!/usr/bin/env python
"""Packing efficiency of every packer, GPT and T5, on a preprocessed dataset (the FLAN-like
sample of examples/reproduce_throughput.sh): real tokens / token slots of the rows that
`--micro-batching packing` trains on, each global batch packed alone (at two token budgets) and
with dataset-level packing (`--packing-window`: the whole dataset, or a window, packed ahead of
training, batches of whole rows). Batches come from the trainer's sampler (its seed, mixing
and budget); a T5 row holds `decoder_length(L)` decoder tokens, as tools/bench_throughput.py
sets them. Writes JSON and, with --markdown, the `packers` section of docs/BENCHMARKS.md.

    python tools/bench_packers.py --data-path runs/throughput/flan \\
        --json-out docs/bench_packers.json --markdown docs/BENCHMARKS.md
"""
from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dynapipe_ext.batching.packing import pack_pairs, pack_sequences  # noqa: E402
from megatron.data.sampler import GlobalBatchSampler, PackingWindow  # noqa: E402
from dynapipe_ext.report.doc_sections import write_section  # noqa: E402
from dynapipe_ext.report.packing_table import PACKERS, packed_rows  # noqa: E402
from tools.benchlib.provenance import provenance_end, provenance_start  # noqa: E402


def decoder_length(max_len: int) -> int:
    """T5 decoder row length at encoder length `max_len` (tools/bench_throughput.py's rule)."""
    return max(128, max_len // 4)


def planner_rows(lengths: np.ndarray, row_lens: tuple, algorithm: str,
                 max_depth: int | None) -> list[list[int]]:
    """Rows plan_packing makes of one global batch's lengths."""
    if lengths.ndim == 1:
        return pack_sequences(lengths, row_lens[0], algorithm, max_depth)
    return pack_pairs(lengths[:, 0], lengths[:, 1], row_lens[0], row_lens[1], algorithm,
                      max_depth)


def efficiency(sampler: GlobalBatchSampler, lengths: np.ndarray, row_lens: tuple,
               algorithm: str, max_depth: int | None, samples: int) -> dict:
    """Real / slot tokens (per side) over the batches covering the first `samples` stream
    samples; the planner packs with `algorithm` (next-fit in window mode)."""
    real = np.zeros(len(row_lens))
    rows = batches = 0
    start = time.perf_counter()
    while sampler.consumed_before(batches) < samples:
        batch_lengths = lengths[sampler.batch(batches)]
        rows += len(planner_rows(batch_lengths, row_lens, algorithm, max_depth))
        real += batch_lengths.reshape(len(batch_lengths), -1).sum(axis=0)
        batches += 1
    eff = real / (rows * np.asarray(row_lens, dtype=np.float64))
    return {"real_over_slots": [round(float(x), 4) for x in eff], "rows": rows,
            "batches": batches, "seconds": round(time.perf_counter() - start, 2)}


def measure(prefix: str, models, max_lengths, budgets, window: int | None, seed: int,
            max_depth: int | None, epochs: float) -> dict:
    from megatron.data.multitask_dataset import MultiTaskDataset
    dataset = MultiTaskDataset(prefix)
    window = window or len(dataset)
    samples = int(epochs * len(dataset))
    rows_out = []
    for model in models:
        for max_len in max_lengths:
            if model == "gpt":
                lengths, row_lens = dataset.gpt_lengths(max_len), (max_len,)
            else:
                dec = decoder_length(max_len)
                lengths, row_lens = dataset.t5_lengths(max_len, dec), (max_len, dec)
            row_tokens = sum(row_lens)
            for algorithm in PACKERS:
                entry = {"model": model, "max_len": max_len, "row_lengths": list(row_lens),
                         "packer": algorithm, "per_batch": {}}
                for budget in budgets:
                    sampler = GlobalBatchSampler(lengths, dataset.task_ids,
                                                 max(budget, row_tokens), seed=seed)
                    entry["per_batch"][str(budget)] = efficiency(
                        sampler, lengths, row_lens, algorithm, max_depth, samples)
                packed = GlobalBatchSampler(
                    lengths, dataset.task_ids, max(budgets[0], row_tokens), seed=seed,
                    packing=PackingWindow(window, algorithm, row_lens, max_depth))
                try:
                    entry["windowed"] = efficiency(packed, lengths, row_lens, "nextfit",
                                                   max_depth, samples)
                except ValueError as err:      # e.g. an NNLS system too big to solve
                    entry["windowed"] = {"error": str(err)}
                rows_out.append(entry)
                print(json.dumps(entry), flush=True)
    return {"data_path": prefix, "samples_in_dataset": len(dataset), "window": window,
            "samples_measured": samples, "seed": seed, "max_pack_depth": max_depth,
            "budgets": list(budgets), "rows": rows_out}


def cell(result: dict) -> str:
    if "error" in result:
        return "refused"
    return " / ".join(f"{x:.3f}" for x in result["real_over_slots"])


def markdown(result: dict, command: str) -> str:
    budgets = result["budgets"]
    machine = f"{platform.machine()}, Python {platform.python_version()}"
    lines = [
        f"Command: `{command}`  ",
        f"Date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC  ",
        f"Machine: {machine} (packing only, no training)  ",
        f"Data: `{result['data_path']}`, {result['samples_in_dataset']:,} samples (the "
        f"FLAN-like sample of examples/reproduce_throughput.sh: tools/make_flan_sample.py "
        f"--num-samples 4000 --seed 1234, SentencePiece 2,000); global batches from the "
        f"trainer's sampler (seed {result['seed']}) until {result['samples_measured']:,} stream "
        f"samples are consumed; T5 rows hold max(128, L / 4) decoder tokens; pack depth "
        f"{result['max_pack_depth'] or 'unlimited (nnlshp: 3 for its exact-fill packs)'}.",
        "",
        "Cells: real tokens / token slots of the rows `--micro-batching packing` trains on "
        "(T5: encoder / decoder). Per batch: the packer packs each global batch of "
        + " or ".join(f"{b:,}" for b in budgets) + " tokens alone (today's default path). "
        f"Windowed: `--packing-window {result['window']}` packs that many stream samples "
        f"(the whole dataset) with the packer ahead of training, global batches of "
        f"{budgets[0]:,} tokens take whole rows, and the planner's next-fit rebuilds them "
        "(megatron/data/sampler.py). `nextfit` windowed is next-fit over the stream, whose "
        "rows the batches then take whole. T5 `spfhp` / `lpfhp` / `nnlshp` are the pair "
        "packers (dynapipe_ext/batching/packing.py `pack_pairs`). Windowed batches hold whole rows, so "
        "where a row holds more than half a batch's tokens (T5 at 4096: rows of up to 5,120 "
        "tokens) a batch holds one row and carries fewer tokens than a batch packed alone. On "
        "small batches (8,192 tokens, a few rows) the 2-D pair packers gain little over "
        "next-fit and lose to it on some batches; with 65,536-token batches or a window they "
        "need fewer rows than next-fit (the table's windowed rows).",
        "",
        "| model | max len | packer | "
        + " | ".join(f"per batch {b:,}" for b in budgets)
        + f" | windowed ({budgets[0]:,}) | windowed rows | pack s |",
        "|---|---:|---|" + "---:|" * (len(budgets) + 3),
    ]
    for r in result["rows"]:
        w = r["windowed"]
        lines.append(f"| {r['model']} | {r['max_len']} | {r['packer']} | "
                     + " | ".join(cell(r["per_batch"][str(b)]) for b in budgets)
                     + f" | {cell(w)} | {w.get('rows', '-')} | {w.get('seconds', '-')} |")
    lines.append("")
    for model, max_len in dict.fromkeys((r["model"], r["max_len"]) for r in result["rows"]):
        here = [r for r in result["rows"] if (r["model"], r["max_len"]) == (model, max_len)]
        ok = [r for r in here if "error" not in r["windowed"]]
        best = max(ok, key=lambda r: r["windowed"]["real_over_slots"][0], default=None)
        per = max(here, key=lambda r: r["per_batch"][str(budgets[0])]["real_over_slots"][0])
        nf = next(r for r in here if r["packer"] == "nextfit")
        if best is None:
            continue
        text = (f"- {model.upper()} {max_len}: best windowed `{best['packer']}` "
                f"{cell(best['windowed'])}; best per batch of {budgets[0]:,} tokens "
                f"`{per['packer']}` {cell(per['per_batch'][str(budgets[0])])}; next-fit per "
                f"batch {cell(nf['per_batch'][str(budgets[0])])}")
        if model == "gpt" and max_len == 2048:
            met = best["windowed"]["real_over_slots"][0] >= 0.97
            text += f" (target windowed >= 0.97: {'met' if met else 'NOT met'})"
        lines.append(text + ".")
    refused = [r for r in result["rows"] if "error" in r["windowed"]]
    for r in refused:
        lines.append(f"\n{r['model']} {r['max_len']} {r['packer']} windowed: "
                     f"{r['windowed']['error']}")
    return "\n".join(lines) + "\n"


def load_timed(paths) -> list[dict]:
    """Rows of tools/bench_throughput.py result files, one per (model, max length, packer,
    per batch / windowed): tokens/s, seconds per iteration, real / slots, the load average."""
    out = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        settings = data["settings"]
        windowed = "--packing-window" in settings.get("train_args", [])
        for row in data["rows"]:
            out.append({"model": row["model"], "max_len": row["max_len"],
                        "packer": settings["packing_algorithm"],
                        "mode": "windowed" if windowed else "per batch",
                        "strategy": row["strategy"], "tokens_per_s": row.get("tokens_per_s"),
                        "iteration_s": row.get("iteration_s"),
                        "real_over_slots": [row.get("padding_efficiency_enc"),
                                            row.get("padding_efficiency_dec")],
                        "shapes": row.get("shapes"), "error": row.get("error"),
                        "real_tokens": row.get("real_tokens"),
                        "executor_cpu_s_per_rank": row.get("executor_cpu_s_per_rank"),
                        "load_average_end": data.get("load_average_end"),
                        "date": data.get("date"), "commit": data.get("commit"),
                        "settings": {k: settings[k] for k in (
                            "num_layers", "hidden_size", "pp", "tokens_per_global_batch",
                            "warmup_iters", "iters", "train_args")}})
    return out


def timed_markdown(timed: list[dict]) -> str:
    """Tokens/s of short training runs per packer, per batch and windowed."""
    if not timed:
        return ""
    by = {(t["model"], t["max_len"], t["packer"], t["mode"]): t for t in timed}
    s = timed[0]["settings"]
    loads = [t["load_average_end"][0] for t in timed if t.get("load_average_end")]
    lines = ["", "Timed in training (`tools/bench_throughput.py --strategies "
             f"packing+segment-attn --packing-algorithm P [--train-args '--packing-window "
             f"N']`, CPU, 2 ranks, PP={s['pp']}, {s['num_layers']} layers (T5: half each "
             f"side), hidden {s['hidden_size']}, {s['tokens_per_global_batch']:,} tokens per "
             f"global batch, {s['warmup_iters']} warm-up + {s['iters']} timed iterations per "
             f"run). The machine's 2 cores were shared with other work: load average "
             f"{min(loads):.1f}-{max(loads):.1f} at the ends of the runs, so wall-clock tokens/s "
             f"are noise at this scale (tens of percent between like runs). CPU tokens/s "
             f"(real tokens / executor CPU seconds of the busiest rank, which a descheduled "
             f"process does not accrue) is the steadier figure; rows: packed rows of each "
             f"timed global batch; real / slots of those batches.", "",
             "| model | max len | packer | per batch tokens/s | CPU tokens/s | rows | real/slots "
             "| windowed tokens/s | CPU tokens/s | rows | real/slots |",
             "|---|---:|---|---:|---:|---|---:|---:|---:|---|---:|"]
    keys = sorted({k[:3] for k in by}, key=lambda k: (k[0], k[1], PACKERS.index(k[2])
                                                      if k[2] in PACKERS else 99))
    summary = []
    for model, max_len in dict.fromkeys(k[:2] for k in keys):
        rates = {(p, mode): cpu_tokens_per_s(t) for (m, L, p, mode), t in by.items()
                 if (m, L) == (model, max_len)}
        base = rates.get(("nextfit", "per batch"))
        best = max((k for k in rates if rates[k]), key=lambda k: rates[k], default=None)
        if base and best:
            summary.append(f"- {model.upper()} {max_len}: CPU tokens/s next-fit per batch "
                           f"{base:,.0f}, best `{best[0]}` {best[1]} {rates[best]:,.0f} "
                           f"({rates[best] / base:.2f}x).")
    for model, max_len, packer in keys:
        cells = []
        for mode in ("per batch", "windowed"):
            t = by.get((model, max_len, packer, mode))
            if t is None or t.get("error") or t.get("tokens_per_s") is None:
                cells += ["-", "-", "-", "-"]
                continue
            eff = [x for x in t["real_over_slots"] if x is not None]
            rows = [packed_rows(shape) for shape in t["shapes"] or []]
            rate = cpu_tokens_per_s(t)
            cpu_rate = "-" if rate is None else f"{rate:,.0f}"
            cells += [f"{t['tokens_per_s']:,.0f}", cpu_rate,
                      " ".join("?" if r is None else str(r) for r in rows) or "-",
                      " / ".join(f"{x:.2f}" for x in eff)]
        lines.append(f"| {model} | {max_len} | {packer} | " + " | ".join(cells) + " |")
    return "\n".join(lines + [""] + summary) + "\n"


def cpu_tokens_per_s(t: dict) -> float | None:
    """Real tokens per executor CPU second of the busiest rank of a timed run."""
    cpu = t.get("executor_cpu_s_per_rank")
    if t.get("error") or not cpu or max(cpu) <= 0 or not t.get("real_tokens"):
        return None
    return t["real_tokens"] / max(cpu)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-path", required=True, help="preprocessed dataset prefix")
    parser.add_argument("--models", nargs="+", choices=("gpt", "t5"), default=["gpt", "t5"])
    parser.add_argument("--max-lengths", nargs="+", type=int, default=[2048, 4096])
    parser.add_argument("--tokens-per-global-batch", nargs="+", type=int,
                        default=[8192, 65536], help="per-batch budgets; the first is also "
                        "the windowed batches' budget")
    parser.add_argument("--packing-window", type=int, default=None,
                        help="stream samples packed together (default: the dataset's size)")
    parser.add_argument("--max-pack-depth", type=int, default=None)
    parser.add_argument("--epochs", type=float, default=2.0,
                        help="stream samples measured, in dataset sizes")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--json-out", default=None)
    parser.add_argument("--markdown", default=None, help="write the `packers` section here")
    parser.add_argument("--command", default=None, help="command line shown in the docs")
    parser.add_argument("--timed", nargs="*", default=[],
                        help="tools/bench_throughput.py result files of packing runs, one "
                             "packer each, with or without --train-args '--packing-window N'")
    args = parser.parse_args(argv)
    start = provenance_start("python tools/bench_packers.py " + shlex.join(
        sys.argv[1:] if argv is None else argv))
    result = measure(args.data_path, args.models, args.max_lengths, args.tokens_per_global_batch,
                     args.packing_window, args.seed, args.max_pack_depth, args.epochs)
    result["timed"] = load_timed(args.timed)
    result = {**provenance_end(start), "invoked_by": args.command, **result}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1) + "\n")
    if args.markdown:
        command = args.command or "python tools/bench_packers.py " + " ".join(
            argv if argv is not None else sys.argv[1:])
        write_section(args.markdown, "packers", "Packers: per batch and dataset-level",
                      markdown(result, command) + timed_markdown(result["timed"]))
    return result


if __name__ == "__main__":
    main()
