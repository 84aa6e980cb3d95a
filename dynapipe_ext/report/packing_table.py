"""Packer tables: the histogram packers' table of the Planner section (tools/bench_planner.py)
and the helpers of the Packers section (tools/bench_packers.py)."""
from __future__ import annotations

from dynapipe_ext.batching.packing import HISTOGRAM_ALGORITHMS
from dynapipe_ext.batching.packing import ALGORITHMS as PACKERS  # the Packers section's


def packing_markdown(rows: list[dict]) -> str:
    lines = ["", "### Histogram packers on the public length histograms", "",
             "Krell et al.'s Wikipedia (BERT, 512) and SQuAD 1.1 (384) histograms "
             "(`shared/benchmarks/length_histograms.json`, not shipped). `spfhp` is the reference algorithm (one new "
             "pack per sequence that fits nowhere); `spfhp-grouped` lets a new pack take "
             "several sequences of the length that opened it. The `spfhp` counts equal those of "
             "the reference code's `pack_using_spfhp`, pinned in tests/data/test_packing.py. "
             "`nnlshp` at depth 16 has too many exact-fill strategies to solve (refused, -). "
             "Per-packer efficiency on the FLAN-like sample, GPT and T5, per batch and "
             "dataset-level: \"Packers: per batch and dataset-level\" below.", "",
             "| histogram | depth | spfhp | spfhp-grouped | lpfhp | nnlshp | "
             "efficiency spfhp / grouped / lpfhp / nnlshp |", "|---|---:|---:|---:|---:|---:|---:|"]
    by = {(r["name"], r["depth"], r["algorithm"]): r for r in rows}
    for name, depth in dict.fromkeys((r["name"], r["depth"]) for r in rows):
        cells = [by[name, depth, a] for a in HISTOGRAM_ALGORITHMS]
        lines.append(f"| {name} | {depth} | "
                     + " | ".join("-" if c["packs"] is None else str(c["packs"])
                                  for c in cells) + " | "
                     + " / ".join("-" if c["efficiency"] is None else f"{c['efficiency']:.4f}"
                                  for c in cells) + " |")
    return "\n".join(lines)


def packed_rows(shapes: str) -> int | None:
    """Rows of one iteration from its shapes summary ('5*1x2048', '2*2x512/128 1x512/128');
    None when the summary is cut short ('(+N more)')."""
    if "more)" in shapes:
        return None
    total = 0
    for part in shapes.split():
        count, _, shape = part.rpartition("*")
        total += int(count or 1) * int(shape.split("x")[0])
    return total
