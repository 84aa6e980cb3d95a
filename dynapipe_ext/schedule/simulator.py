"""Discrete-event simulation of a pipeline Schedule: times, bubbles and peak memory per rank.

Each rank runs its action list in order; an action starts when the rank is free and its inputs
have arrived: F of stage s needs F of stage s-1 (same micro-batch); B of stage s needs its own F
and B of stage s+1. A transfer between different ranks takes latency + bytes / bandwidth and
overlaps compute; between stages on one rank (e.g. a wave's turning point) it is free.
Memory per rank: activations kept from F to B, plus a transient peak while an action runs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from dynapipe_ext.schedule.schedule_ir import (FORWARD, Action, Schedule, ScheduleError, is_forward_only,
                          validate_schedule)


@dataclass(frozen=True)
class CommModel:
    """Point-to-point transfer time: latency_ms + bytes / bandwidth (bytes per ms)."""

    latency_ms: float = 0.0
    bandwidth_bytes_per_ms: float = math.inf

    def __post_init__(self):
        if self.latency_ms < 0 or not self.bandwidth_bytes_per_ms > 0:
            raise ValueError(f"CommModel needs latency_ms >= 0 and bandwidth > 0, got "
                             f"{self.latency_ms} ms and {self.bandwidth_bytes_per_ms} B/ms")

    def transfer_ms(self, nbytes):
        """Time to move `nbytes` (scalar or array) between two different ranks."""
        return self.latency_ms + np.asarray(nbytes, dtype=np.float64) / self.bandwidth_bytes_per_ms


def _as_matrix(name: str, value, shape: tuple[int, int] | None) -> np.ndarray:
    arr = np.asarray(value, dtype=np.float64)
    if arr.ndim != 2:
        raise ValueError(f"{name} must be a 2-D array [micro-batch][stage], got shape {arr.shape}")
    if shape is not None and arr.shape != shape:
        raise ValueError(f"{name} has shape {arr.shape}, expected {shape} like fwd_ms")
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        mb, stage = np.argwhere(~(np.isfinite(arr) & (arr >= 0)))[0]
        raise ValueError(f"{name}[{mb}][{stage}] = {arr[mb, stage]} is not a finite value >= 0")
    return arr


@dataclass(frozen=True)
class PipelineCosts:
    """Per (micro-batch, stage) costs, each an array of shape [num_mb, num_stages]:
    forward/backward ms, activation bytes kept from F to B, transient peak bytes during the
    action, and bytes stage s sends to stage s+1 (the gradient back has the same size)."""

    fwd_ms: np.ndarray
    bwd_ms: np.ndarray
    act_bytes: np.ndarray = None
    peak_bytes: np.ndarray = None
    comm_bytes: np.ndarray = None

    def __post_init__(self):
        fwd = _as_matrix("fwd_ms", self.fwd_ms, None)
        shape = fwd.shape
        if shape[0] == 0 or shape[1] == 0:
            raise ValueError(f"costs need at least one micro-batch and one stage, got {shape}")
        set_ = object.__setattr__
        set_(self, "fwd_ms", fwd)
        set_(self, "bwd_ms", _as_matrix("bwd_ms", self.bwd_ms, shape))
        for name in ("act_bytes", "peak_bytes", "comm_bytes"):
            value = getattr(self, name)
            set_(self, name, np.zeros(shape) if value is None else _as_matrix(name, value, shape))

    @property
    def num_micro_batches(self) -> int:
        return self.fwd_ms.shape[0]

    @property
    def num_stages(self) -> int:
        return self.fwd_ms.shape[1]

    def reordered(self, order) -> "PipelineCosts":
        """Costs with micro-batch i taken from old index order[i]."""
        idx = np.asarray(order)
        return PipelineCosts(self.fwd_ms[idx], self.bwd_ms[idx], self.act_bytes[idx],
                             self.peak_bytes[idx], self.comm_bytes[idx])


def uniform_costs(num_mb: int, num_stages: int, fwd_ms: float = 1.0, bwd_ms: float = 2.0,
                  act_bytes: float = 1.0) -> PipelineCosts:
    """Identical micro-batches on identical stages (the textbook case)."""
    full = lambda v: np.full((num_mb, num_stages), float(v))  # noqa: E731
    return PipelineCosts(full(fwd_ms), full(bwd_ms), full(act_bytes))


def transfer_matrix(stage_to_rank, costs: PipelineCosts, comm: CommModel | None) -> np.ndarray:
    """ms to move stage s's output of micro-batch m to stage s+1 (and its gradient back):
    zero between stages on the same rank, and zero after the last stage."""
    xfer = np.zeros_like(costs.fwd_ms)
    if comm is None:
        return xfer
    cross = np.array([stage_to_rank[s] != stage_to_rank[s + 1]
                      for s in range(len(stage_to_rank) - 1)] + [False])
    xfer[:, cross] = comm.transfer_ms(costs.comm_bytes[:, cross])
    return xfer


@dataclass(frozen=True)
class SimResult:
    """Outcome of playing a schedule. start_ms[r][i] / end_ms[r][i] belong to
    schedule.rank_actions[r][i]; per-rank tuples are indexed by rank. sequence[r][i] counts the
    actions in the order the simulation placed them, so sorting by (start_ms, sequence) is a
    linear order consistent with dependencies and rank order even with zero durations."""

    schedule: Schedule
    makespan_ms: float
    start_ms: tuple[tuple[float, ...], ...]
    end_ms: tuple[tuple[float, ...], ...]
    busy_ms: tuple[float, ...]
    bubble_fraction: tuple[float, ...]
    peak_memory_bytes: tuple[float, ...]
    sequence: tuple[tuple[int, ...], ...] = ()
    info: dict = field(default_factory=dict, compare=False)

    @property
    def mean_bubble_fraction(self) -> float:
        return float(np.mean(self.bubble_fraction))

    @property
    def max_peak_memory_bytes(self) -> float:
        return max(self.peak_memory_bytes)

    def fits(self, memory_limit: float) -> bool:
        return self.max_peak_memory_bytes <= memory_limit

    def order_keys(self, rank: int) -> list[tuple[float, int]]:
        """(start, sequence) of each action of `rank`, increasing along the rank's order."""
        return list(zip(self.start_ms[rank], self.sequence[rank]))

    def timeline(self, rank: int) -> list[tuple[Action, float, float]]:
        """(action, start, end) of one rank, in execution order."""
        return list(zip(self.schedule.rank_actions[rank], self.start_ms[rank], self.end_ms[rank]))


def peak_memory(schedule: Schedule, costs: PipelineCosts) -> list[float]:
    """Peak bytes per rank. It depends only on each rank's order: during F of (m, s) the rank
    holds what it kept so far + act[m, s] + peak[m, s]; during B, kept + peak[m, s]. In a
    forward-only schedule (evaluation) a forward keeps nothing once it is done."""
    act, peak = costs.act_bytes.tolist(), costs.peak_bytes.tolist()
    keeps = not is_forward_only(schedule)
    result = []
    for actions in schedule.rank_actions:
        kept = top = 0.0
        for stage, kind, mb in actions:
            a = act[mb][stage]
            if kind == FORWARD:
                top = max(top, kept + a + peak[mb][stage])
                if keeps:
                    kept += a
            else:
                top = max(top, kept + peak[mb][stage])
                kept -= a
        result.append(top)
    return result


def _check_shapes(schedule: Schedule, costs: PipelineCosts) -> None:
    want = (schedule.num_micro_batches, schedule.num_stages)
    got = (costs.num_micro_batches, costs.num_stages)
    if want != got:
        raise ValueError(f"schedule {schedule.name!r} has {want[0]} micro-batches x {want[1]} "
                         f"stages but the costs are for {got[0]} x {got[1]}")


def simulate(schedule: Schedule, costs: PipelineCosts, comm: CommModel | None = None,
             validate: bool = True) -> SimResult:
    """Play `schedule` with `costs`; raise ScheduleError if it is malformed or deadlocks."""
    if validate:
        validate_schedule(schedule)
    _check_shapes(schedule, costs)
    num_stages, last = schedule.num_stages, schedule.num_stages - 1
    s2r = schedule.stage_to_rank
    fwd, bwd = costs.fwd_ms.tolist(), costs.bwd_ms.tolist()
    xfer = transfer_matrix(s2r, costs, comm).tolist()
    f_end: list = [None] * (costs.num_micro_batches * num_stages)
    b_end: list = [None] * len(f_end)
    rank_actions = schedule.rank_actions
    num_ranks = len(rank_actions)
    pos, free = [0] * num_ranks, [0.0] * num_ranks
    starts = [[0.0] * len(acts) for acts in rank_actions]
    ends = [[0.0] * len(acts) for acts in rank_actions]
    seqs = [[0] * len(acts) for acts in rank_actions]
    placed = 0
    todo, queued = list(range(num_ranks - 1, -1, -1)), [True] * num_ranks

    def wake(rank: int) -> None:
        if not queued[rank]:
            queued[rank] = True
            todo.append(rank)

    while todo:
        r = todo.pop()
        queued[r] = False
        acts, i, t = rank_actions[r], pos[r], free[r]
        n, st, en, sq = len(acts), starts[r], ends[r], seqs[r]
        while i < n:
            stage, kind, mb = acts[i]
            k = mb * num_stages + stage
            if kind == FORWARD:
                if stage:
                    e = f_end[k - 1]
                    if e is None:
                        break
                    ready = e + xfer[mb][stage - 1]
                    t = t if t > ready else ready
                t_end = t + fwd[mb][stage]
                f_end[k] = t_end
                if stage < last and s2r[stage + 1] != r:
                    wake(s2r[stage + 1])
            else:
                e = f_end[k]
                if e is None:
                    break
                if stage < last:
                    e2 = b_end[k + 1]
                    if e2 is None:
                        break
                    e2 += xfer[mb][stage]
                    e = e if e > e2 else e2
                t = t if t > e else e
                t_end = t + bwd[mb][stage]
                b_end[k] = t_end
                if stage and s2r[stage - 1] != r:
                    wake(s2r[stage - 1])
            st[i], en[i], sq[i] = t, t_end, placed
            placed += 1
            t = t_end
            i += 1
        pos[r], free[r] = i, t
    if any(pos[r] < len(rank_actions[r]) for r in range(num_ranks)):
        raise ScheduleError(_deadlock_message(schedule, pos, f_end, b_end))
    makespan = max(free)
    busy = [float(sum(e - s for s, e in zip(st, en))) for st, en in zip(starts, ends)]
    bubble = [1.0 - b / makespan if makespan > 0 else 0.0 for b in busy]
    return SimResult(schedule, makespan, tuple(map(tuple, starts)), tuple(map(tuple, ends)),
                     tuple(busy), tuple(bubble), tuple(peak_memory(schedule, costs)),
                     tuple(map(tuple, seqs)))


def _deadlock_message(schedule: Schedule, pos, f_end, b_end) -> str:
    num_stages = schedule.num_stages
    lines = []
    for r, acts in enumerate(schedule.rank_actions):
        if pos[r] >= len(acts):
            continue
        stage, kind, mb = act = acts[pos[r]]
        k = mb * num_stages + stage
        if kind == FORWARD:
            needs = [Action(stage - 1, FORWARD, mb)]
        else:
            needs = [Action(stage, FORWARD, mb)]
            if stage < num_stages - 1 and b_end[k + 1] is None:
                needs.append(Action(stage + 1, "B", mb))
        waits = [str(a) for a in needs
                 if (f_end if a.kind == FORWARD else b_end)[a.mb * num_stages + a.stage] is None]
        lines.append(f"rank {r} stuck at position {pos[r]} on {act}, waiting for "
                     f"{', '.join(waits)}")
    return (f"schedule {schedule.name!r} cannot complete (deadlock): " + "; ".join(lines))
