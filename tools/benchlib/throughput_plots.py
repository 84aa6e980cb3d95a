"""Plots of tools/bench_throughput.py's report: speed-up over packing and padding efficiency
against the max length (headless matplotlib)."""
from __future__ import annotations

from pathlib import Path

from dynapipe_ext.report.throughput import STRATEGIES

# plot styles, one per strategy
STYLES = dict(zip(STRATEGIES, ("s-", "kD--", "^-", "v--", "o-")))


def label_lengths(ax, lengths) -> None:
    """Log-2 x axis labelled with the max lengths themselves."""
    ax.set_xscale("log", base=2)
    ticks = sorted(set(lengths))
    if ticks:
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()


def new_figure(panels: int, size: tuple[float, float]):
    """A headless matplotlib figure with `panels` axes side by side."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt.subplots(1, panels, figsize=size)


def finish_axes(ax, lengths, ylabel: str, title: str) -> None:
    label_lengths(ax, lengths)
    ax.set_xlabel("max sequence length")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def save_figure(fig, result: dict, path: Path) -> None:
    """Stamp the figure with machine, commit and date of the run, write it and free it."""
    import matplotlib.pyplot as plt
    fig.suptitle(f"{result['machine']} - commit {result['commit']} - {result['date']}",
                 fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_speedup(result: dict, path: Path) -> None:
    rows = [r for r in result["rows"] if "speedup_vs_packing" in r]
    proj = (result.get("projection") or {}).get("rows", [])
    fitted = ((result.get("projection") or {}).get("cpu_fit") or {}).get("rows", [])
    fig, axes = new_figure(2, (11, 4.2))
    for ax, model in zip(axes, ("gpt", "t5")):
        for strategy, style in STYLES.items():
            pts = sorted((r["max_len"], r["speedup_vs_packing"]) for r in rows
                         if r["model"] == model and r["strategy"] == strategy)
            if pts:
                ax.plot(*zip(*pts), style, label=f"{strategy} (measured)")
        for sim_rows, style, color, label in (
                (proj, "o:", "grey", "dynamic (SIMULATED, paper scale, analytic A100 costs)"),
                (fitted, "v-.", "tab:purple",
                 "dynamic (SIMULATED, paper scale, CPU-profile fit)")):
            pts = sorted((r["max_len"], r["speedup_vs_packing"]) for r in sim_rows
                         if r["model"] == model and r["strategy"] == "dynamic")
            if pts:
                ax.plot(*zip(*pts), style, color=color, label=label)
        finish_axes(ax, [r["max_len"] for r in rows + proj + fitted if r["model"] == model],
                    "tokens/s relative to packing", f"{model.upper()}: speed-up over packing")
    save_figure(fig, result, path)


def plot_padding(result: dict, path: Path) -> None:
    rows = [r for r in result["rows"] if "padding_efficiency_enc" in r]
    fig, axes = new_figure(3, (13, 4))
    panels = (("gpt", "padding_efficiency_enc", "GPT"),
              ("t5", "padding_efficiency_enc", "T5 encoder"),
              ("t5", "padding_efficiency_dec", "T5 decoder"))
    for ax, (model, key, title) in zip(axes, panels):
        for strategy, style in STYLES.items():
            if strategy == "packing+segment-attn":
                continue        # same micro-batches as packing
            pts = sorted((r["max_len"], r[key]) for r in rows
                         if r["model"] == model and r["strategy"] == strategy
                         and r.get(key) is not None)
            if pts:
                ax.plot(*zip(*pts), style, label=strategy)
        ax.set_ylim(0, 1.05)
        finish_axes(ax, [r["max_len"] for r in rows if r["model"] == model],
                    "real tokens / token slots", f"padding efficiency: {title}")
    save_figure(fig, result, path)
