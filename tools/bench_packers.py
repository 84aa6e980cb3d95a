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
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dynapipe_ext.packing import pack_pairs, pack_sequences  # noqa: E402
from megatron.data.sampler import GlobalBatchSampler, PackingWindow  # noqa: E402
from tools.doc_sections import write_section  # noqa: E402

PACKERS = ("nextfit", "spfhp", "spfhp-grouped", "lpfhp", "nnlshp")


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
        "packers (dynapipe_ext/packing.py `pack_pairs`).",
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
    refused = [r for r in result["rows"] if "error" in r["windowed"]]
    for r in refused:
        lines.append(f"\n{r['model']} {r['max_len']} {r['packer']} windowed: "
                     f"{r['windowed']['error']}")
    return "\n".join(lines) + "\n"


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
    args = parser.parse_args(argv)
    result = measure(args.data_path, args.models, args.max_lengths, args.tokens_per_global_batch,
                     args.packing_window, args.seed, args.max_pack_depth, args.epochs)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1) + "\n")
    if args.markdown:
        command = args.command or "python tools/bench_packers.py " + " ".join(
            argv if argv is not None else sys.argv[1:])
        write_section(args.markdown, "packers", "Packers: per batch and dataset-level",
                      markdown(result, command))
    return result


if __name__ == "__main__":
    main()
