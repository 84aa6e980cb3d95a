"""Timelines of a pipeline iteration — simulated or measured by the executor — as Chrome trace
JSON (chrome://tracing, ui.perfetto.dev) and as a per-rank Gantt chart (matplotlib, Agg)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterable, Sequence

from dynapipe_ext.plan.instructions import (Backward, ExecutionPlan, Forward, FreeBuffer, LoadInput,
                           RecvActivationFinish, RecvGradFinish)
from dynapipe_ext.schedule.schedule_ir import FORWARD

COMPUTE = "compute"
COMM = "comm"
OTHER = "other"


@dataclass(frozen=True)
class TimelineEvent:
    """One box of the timeline: `kind` is 'F', 'B', 'comm' or another instruction name."""

    rank: int
    kind: str
    category: str        # COMPUTE, COMM or OTHER
    start_ms: float
    end_ms: float
    mb: int
    stage: int = -1
    label: str = ""


def events_from_simulation(result, comm_ms=None) -> list[TimelineEvent]:
    """Compute boxes of a simulator.SimResult; with `comm_ms` (a [mb][stage] array: time to
    move stage s's output to s+1, e.g. simulator.transfer_matrix) also one comm bar per
    cross-rank transfer on the receiving rank, from the producer's end for that long."""
    schedule = result.schedule
    events, end_of = [], {}
    for rank in range(schedule.num_ranks):
        for act, start, end in result.timeline(rank):
            events.append(TimelineEvent(rank, act.kind, COMPUTE, start, end, act.mb, act.stage,
                                        str(act)))
            end_of[act] = end
    if comm_ms is None:
        return events
    s2r = schedule.stage_to_rank
    for act, end in end_of.items():
        to = act.stage + 1 if act.kind == FORWARD else act.stage - 1
        if not 0 <= to < len(s2r) or s2r[to] == s2r[act.stage]:
            continue
        ms = float(comm_ms[act.mb][min(act.stage, to)])
        if ms > 0:
            what = "act" if act.kind == FORWARD else "grad"
            events.append(TimelineEvent(s2r[to], "comm", COMM, end, end + ms, act.mb, to,
                                        f"{what} mb{act.mb} {act.stage}->{to}"))
    return events


def events_from_records(plan: ExecutionPlan, records: Sequence, t0: float = 0.0
                        ) -> list[TimelineEvent]:
    """Events of Executor.run(plan, record_times=True) records; `t0` (seconds, same clock) is
    the time zero, e.g. the earliest start over all ranks. Receive finishes (waits) become comm
    bars; computes, loads and other transfer steps keep their instruction names."""
    events = []
    for ins, start_s, end_s in records:
        kind = type(ins)
        start, end = (start_s - t0) * 1e3, (end_s - t0) * 1e3
        stage = getattr(ins, "stage", -1)
        if kind is Forward or kind is Backward:
            k = "F" if kind is Forward else "B"
            events.append(TimelineEvent(plan.pp_rank, k, COMPUTE, start, end, ins.mb, stage,
                                        f"{stage}{k}{ins.mb}"))
        elif kind is RecvActivationFinish or kind is RecvGradFinish:
            events.append(TimelineEvent(plan.pp_rank, "comm", COMM, start, end, ins.mb, stage,
                                        f"{kind.__name__} mb{ins.mb} from {ins.peer}"))
        elif kind is not FreeBuffer:
            cat = OTHER if kind is LoadInput else COMM
            events.append(TimelineEvent(plan.pp_rank, kind.__name__, cat, start, end, ins.mb,
                                        stage, f"{kind.__name__} mb{ins.mb}"))
    return events


def chrome_trace(events: Iterable[TimelineEvent], name: str = "pipeline") -> dict:
    """Chrome trace-event JSON object: one thread per rank, complete ('X') events in µs."""
    events = list(events)
    trace = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": name}}]
    for rank in sorted({e.rank for e in events}):
        trace.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": rank,
                      "args": {"name": f"rank {rank}"}})
    for e in events:
        trace.append({"name": e.label or e.kind, "cat": e.category, "ph": "X", "pid": 0,
                      "tid": e.rank, "ts": e.start_ms * 1e3,
                      "dur": max(e.end_ms - e.start_ms, 0.0) * 1e3,
                      "args": {"mb": e.mb, "stage": e.stage, "kind": e.kind}})
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def write_chrome_trace(events: Iterable[TimelineEvent], path, name: str = "pipeline") -> None:
    with open(path, "w") as f:
        json.dump(chrome_trace(events, name), f)


_COLORS = {"F": "#7fb3e6", "B": "#f2a65a"}


def draw_gantt(events: Sequence[TimelineEvent], path, title: str = "",
               num_ranks: int | None = None) -> None:
    """Per-rank Gantt chart as a PNG: forward (blue) and backward (orange) boxes labelled with
    the micro-batch, darker shades for later stages of the same rank; comm as thin grey bars."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgb
    from matplotlib.patches import Patch

    events = list(events)
    if not events:
        raise ValueError("no events to draw")
    ranks = num_ranks or (max(e.rank for e in events) + 1)
    t_end = max(e.end_ms for e in events)
    fig, ax = plt.subplots(figsize=(14, 1.2 + 0.7 * ranks), dpi=110)
    stages_of = {}
    for e in events:
        if e.category == COMPUTE:
            stages_of.setdefault(e.rank, set()).add(e.stage)
    for e in events:
        y = ranks - 1 - e.rank
        width = max(e.end_ms - e.start_ms, t_end * 1e-4)
        if e.category == COMPUTE:
            stages = sorted(stages_of[e.rank])
            shade = 1.0 - 0.35 * stages.index(e.stage) / max(len(stages) - 1, 1)
            color = tuple(c * shade for c in to_rgb(_COLORS.get(e.kind, "#999999")))
            ax.broken_barh([(e.start_ms, width)], (y - 0.3, 0.6), facecolors=color,
                           edgecolors="black", linewidth=0.4)
            if width > t_end / 120:
                ax.text(e.start_ms + width / 2, y, str(e.mb), ha="center", va="center",
                        fontsize=7 if width > t_end / 60 else 5)
        elif e.category == COMM:
            ax.broken_barh([(e.start_ms, width)], (y - 0.42, 0.08), facecolors="#555555")
    ax.set_yticks(range(ranks))
    ax.set_yticklabels([f"rank {r}" for r in reversed(range(ranks))])
    ax.set_ylim(-0.6, ranks - 0.4)
    ax.set_xlim(0, t_end * 1.01)
    ax.set_xlabel("time (ms)")
    ax.grid(axis="x", linestyle=":", linewidth=0.5)
    fig.legend(handles=[Patch(color=_COLORS["F"], label="forward (label = micro-batch; darker = "
                                                        "later stage of the rank)"),
                        Patch(color=_COLORS["B"], label="backward"),
                        Patch(color="#555555", label="communication")],
               loc="lower center", ncol=3, fontsize=8, frameon=False)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.35 / (1.2 + 0.7 * ranks), 1, 1))
    fig.savefig(path)
    plt.close(fig)
