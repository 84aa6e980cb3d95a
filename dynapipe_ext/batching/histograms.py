"""Length histograms for the histogram packers: Krell et al.'s public Wikipedia / SQuAD
histograms (third-party data, looked up beside the checkout) and the histograms JSON format
({name: {"max_len": S, "counts": [...]}}, counts[i] = sequences of length i + 1)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

HISTOGRAMS_ENV = "DYNAPIPE_LENGTH_HISTOGRAMS"


def reference_histograms_path() -> Path | None:
    """Krell et al.'s public length histograms (Wikipedia, SQuAD). Third-party data, so not in
    the repository: $DYNAPIPE_LENGTH_HISTOGRAMS, else shared/benchmarks/length_histograms.json
    beside the checkout; None when neither exists."""
    candidates = [os.environ.get(HISTOGRAMS_ENV),
                  Path(__file__).resolve().parents[3] / "shared" / "benchmarks"
                  / "length_histograms.json"]
    found = [Path(c) for c in candidates if c and Path(c).is_file()]
    return found[0] if found else None


def load_histogram(path: Path, name: str) -> tuple[np.ndarray, int]:
    """(hist indexed by length, max_len) of entry `name` in a histograms JSON file."""
    if not path.is_file():
        raise ValueError(f"--histograms {path}: no such file. Pack the lengths of a dataset "
                         f"you have instead with --from-dataset PREFIX (e.g. data/quickstart/"
                         f"flan after examples/quickstart.sh)")
    with open(path) as f:
        data = json.load(f)
    entries = [k for k, v in data.items() if isinstance(v, dict) and "counts" in v]
    if name not in entries:
        raise ValueError(f"{path}: no histogram named {name!r}; it holds {entries}")
    entry = data[name]
    counts = np.asarray(entry["counts"], dtype=np.int64)
    max_len = int(entry.get("max_len", counts.size))
    if counts.size != max_len:
        raise ValueError(f"{path}: histogram {name!r} has {counts.size} counts but max_len "
                         f"{max_len}")
    hist = np.zeros(max_len + 1, dtype=np.int64)
    hist[1:] = counts
    return hist, max_len
