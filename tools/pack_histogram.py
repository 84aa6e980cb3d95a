#!/usr/bin/env python
"""Pack one length histogram and print one JSON object with the packing's figures. The
histogram is either made on the fly from a preprocessed dataset (`--from-dataset PREFIX`: the
GPT view's sample lengths at `--seq-length`), or read from a histograms JSON file
(`--histograms F --name NAME`; format {name: {"max_len": S, "counts": [...]}}, counts[i] =
number of sequences of length i + 1)."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dynapipe_ext.batching.histograms import load_histogram  # noqa: E402
from dynapipe_ext.batching.packing import (ALGORITHMS, count_next_fit_rows, histogram_of,  # noqa: E402
                                  pack_histogram)
from megatron.training.arguments import add_flag_group  # noqa: E402


def dataset_histogram(prefix: str, seq_length: int) -> tuple[np.ndarray, int]:
    """(hist indexed by length, seq_length) of the GPT view of the dataset at `prefix`."""
    from megatron.data.multitask_dataset import MultiTaskDataset
    try:
        dataset = MultiTaskDataset(prefix)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"--from-dataset {prefix}: {exc}") from None
    return histogram_of(dataset.gpt_lengths(seq_length), seq_length), seq_length


def next_fit_figures(hist: np.ndarray, row_len: int, max_depth: int | None,
                     seed: int) -> dict:
    """Next-fit over the histogram's sequences in a seeded random order (as a data loader sees
    them)."""
    lengths = np.repeat(np.arange(hist.size), hist)
    np.random.default_rng(seed).shuffle(lengths)
    start = time.perf_counter()
    rows = count_next_fit_rows(lengths, row_len, max_depth)
    return {"packs": rows, "seconds": time.perf_counter() - start, "strategies": None}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--from-dataset", metavar="PREFIX",
                        help="histogram of a preprocessed dataset's GPT sample lengths")
    source.add_argument("--histograms", type=Path, help="histograms JSON file (with --name)")
    parser.add_argument("--name", help="histogram name in the --histograms file")
    add_flag_group(parser, "model", ["seq_length"], title="", seq_length=dict(
        default=512, help="with --from-dataset: samples are cut to this many tokens, and it "
                          "is the default pack length (default 512)"))
    parser.add_argument("--algorithm", choices=ALGORITHMS, default="spfhp")
    parser.add_argument("--max-depth", type=int, default=None,
                        help="most sequences per pack (default: no limit; NNLSHP uses 3)")
    parser.add_argument("--row-len", type=int, default=None,
                        help="pack length (default: the histogram's max_len)")
    parser.add_argument("--seed", type=int, default=1234, help="shuffle seed for nextfit")
    args = parser.parse_args(argv)
    if args.row_len is not None and args.row_len <= 0:
        parser.error(f"--row-len must be > 0, got {args.row_len} (leave it out for the "
                     f"histogram's max_len)")

    if args.histograms is not None:
        if not args.name:
            parser.error("--histograms needs --name")
        try:
            hist, max_len = load_histogram(args.histograms, args.name)
        except ValueError as err:
            raise SystemExit(str(err)) from None
    else:
        hist, max_len = dataset_histogram(args.from_dataset, args.seq_length)
        args.name = args.from_dataset
        args.histograms = args.from_dataset
    row_len = max_len if args.row_len is None else args.row_len
    try:
        if args.algorithm == "nextfit":
            figures = next_fit_figures(hist, row_len, args.max_depth, args.seed)
        else:
            start = time.perf_counter()
            packing = pack_histogram(hist, row_len, args.algorithm, args.max_depth)
            seconds = time.perf_counter() - start
    except ValueError as err:
        raise SystemExit(f"{args.histograms} [{args.name}]: {err}") from None
    if args.algorithm != "nextfit":
        figures = {"packs": packing.packs, "seconds": seconds,
                   "strategies": len(packing.strategies)}
        if not np.array_equal(packing.histogram(), np.pad(hist, (0, row_len + 1 - hist.size))):
            raise SystemExit("internal error: packing does not hold every sequence exactly once")
    sequences = int(hist.sum())
    tokens = int((hist * np.arange(hist.size)).sum())
    result = {"name": args.name, "algorithm": args.algorithm, "max_depth": args.max_depth,
              "row_len": row_len, "sequences": sequences, "tokens": tokens,
              "packs": figures["packs"],
              "efficiency": tokens / (figures["packs"] * row_len) if figures["packs"] else 1.0,
              "padding_efficiency": tokens / (sequences * row_len) if sequences else 1.0,
              "avg_depth": sequences / figures["packs"] if figures["packs"] else 0.0,
              "strategies": figures["strategies"], "seconds": round(figures["seconds"], 6)}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
