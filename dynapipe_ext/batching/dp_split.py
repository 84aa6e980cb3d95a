"""DynaPipe's dynamic program: cut an ordered sequence of samples into contiguous micro-batches
minimising the pipeline makespan model  sum_k t_k / D + (P - 1) * max_k t_k.

Input is a segment-time table: seg_time[j - 1, k] is the time of the micro-batch made of order
positions [j - 1 - k, j) (k + 1 samples), inf where that micro-batch does not fit in memory.

For a bound T on every micro-batch time, g(T) = min sum_k t_k over splits with all t_k <= T is
a prefix DP, f[j] = min_i f[i] + t(i, j). The optimum is min over T of g(T)/D + (P-1)*T, taken
over the distinct segment times. Instead of trying all of them, a branch and bound evaluates g
for batches of bounds at once (one vectorised DP pass per batch) and discards ranges of bounds
that provably cannot win:
  * g is non-increasing in T, so on a range below an evaluated bound T_b, g >= g(T_b);
  * the split found at T_b has a largest time M <= T_b, and g is constant on [M, T_b], where
    the objective is smallest at T = M: that split's own objective covers the whole range.
The result is the exact optimum (tests compare it with brute force)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Split:
    """Segment ends (exclusive order positions, the last one is n), each segment's time, and
    the makespan objective of the split."""

    ends: tuple[int, ...]
    times: tuple[float, ...]
    objective: float

    def segments(self) -> list[tuple[int, int]]:
        starts = (0,) + self.ends[:-1]
        return list(zip(starts, self.ends))


def makespan_objective(times, num_stages: int, dp_degree: int = 1) -> float:
    """sum(t) / dp_degree + (num_stages - 1) * max(t): the pipeline makespan model."""
    times = np.asarray(times, dtype=np.float64)
    if times.size == 0:
        return 0.0
    return float(times.sum() / dp_degree + (num_stages - 1) * times.max())


def _last_finite(seg_time: np.ndarray) -> np.ndarray:
    """Per row, 1 + the largest k with a finite time (0 when none)."""
    finite = np.isfinite(seg_time)
    width = seg_time.shape[1]
    return np.where(finite.any(axis=1), width - np.argmax(finite[:, ::-1], axis=1), 0)


def min_sum_splits(seg_time: np.ndarray, caps: np.ndarray):
    """For each cap T in `caps`: g(T) (the min sum of times over splits with every segment
    time <= T; inf when none) and the back-pointers of that split. One pass over positions,
    vectorised over caps and segment lengths."""
    n, width = seg_time.shape
    caps = np.asarray(caps, dtype=np.float64)
    num = len(caps)
    best = np.full((num, n + 1), np.inf)
    best[:, 0] = 0.0
    back = np.zeros((num, n + 1), dtype=np.int64)
    reach = _last_finite(seg_time)
    probe = np.arange(num)
    cap_col = caps[:, None]
    for j in range(1, n + 1):
        w = min(int(reach[j - 1]), j)
        if w == 0:
            continue
        t = seg_time[j - 1, :w]
        # best[:, j-1-k] for k = 0..w-1: the prefix before a segment of k+1 samples ending at j
        cand = best[:, j - 1::-1][:, :w] + t
        cand[t > cap_col] = np.inf
        k = cand.argmin(axis=1)
        best[:, j] = cand[probe, k]
        back[:, j] = k
    return best[:, n], back


def _trace(seg_time: np.ndarray, back_row: np.ndarray) -> tuple[tuple[int, ...], tuple[float, ...]]:
    ends, times = [], []
    j = len(back_row) - 1
    while j > 0:
        k = int(back_row[j])
        ends.append(j)
        times.append(float(seg_time[j - 1, k]))
        j -= k + 1
    return tuple(reversed(ends)), tuple(reversed(times))


def _largest_times(seg_time: np.ndarray, back: np.ndarray, found: np.ndarray) -> np.ndarray:
    """The largest segment time of each found split (rows of `back`), all traced at once."""
    largest = np.zeros(len(back))
    cols = np.flatnonzero(found)
    pos = np.full(len(cols), back.shape[1] - 1)
    while cols.size:
        k = back[cols, pos]
        largest[cols] = np.maximum(largest[cols], seg_time[pos - 1, k])
        pos = pos - k - 1
        keep = pos > 0
        cols, pos = cols[keep], pos[keep]
    return largest


def optimal_split(seg_time, num_stages: int, dp_degree: int = 1, probes: int = 32,
                  upper_bound: float = np.inf) -> Split | None:
    """The exact minimiser of the makespan objective over contiguous splits (module doc).
    Raises ValueError when no split fits (some position is in no finite segment). With a
    finite `upper_bound` (an objective already reached elsewhere), ranges that cannot beat it
    are pruned from the start, and None is returned when no split is below it."""
    seg_time = np.asarray(seg_time, dtype=np.float64)
    if seg_time.ndim != 2:
        raise ValueError(f"seg_time must be 2-D (positions, segment lengths), got {seg_time.shape}")
    n = seg_time.shape[0]
    if n == 0:
        return Split((), (), 0.0)
    if num_stages < 1 or dp_degree < 1 or probes < 1:
        raise ValueError("num_stages, dp_degree and probes must be >= 1")
    values = np.unique(seg_time[np.isfinite(seg_time)])
    slope = num_stages - 1
    best: Split | None = None
    # unresolved candidate index ranges [lo, hi) with a lower bound on g over them
    pending = [(0, len(values), 0.0)]
    while True:
        bound = upper_bound if best is None else min(best.objective, upper_bound)
        pending = [(lo, hi, g) for lo, hi, g in pending
                   if lo < hi and g / dp_degree + slope * values[lo] < bound]
        if not pending:
            break
        pending.sort(key=lambda r: r[2] / dp_degree + slope * values[r[0]])
        chosen, rest = pending[:probes], pending[probes:]
        per = max(1, probes // len(chosen))
        plan = []
        for lo, hi, g in chosen:
            if per == 1:
                idx = np.array([hi - 1 if best is None else (lo + hi - 1) // 2])
            else:
                idx = np.unique(np.linspace(lo, hi - 1, min(per, hi - lo)).round().astype(int))
            plan.append((lo, hi, g, idx))
        caps = values[np.concatenate([p[3] for p in plan])]
        sums, back = min_sum_splits(seg_time, caps)
        largest = _largest_times(seg_time, back, np.isfinite(sums))
        pending = rest
        col = 0
        for lo, hi, g_parent, idx in plan:
            start = lo
            for p in idx:
                g = sums[col]
                if np.isfinite(g):
                    # trace (in Python) only the splits that may beat the best so far
                    bound = upper_bound if best is None else best.objective
                    if g / dp_degree + slope * largest[col] < bound * (1 + 1e-12):
                        ends, times = _trace(seg_time, back[col])
                        split = Split(ends, times,
                                      makespan_objective(times, num_stages, dp_degree))
                        if split.objective < bound:
                            best = split
                    top = int(np.searchsorted(values, largest[col]))
                    pending.append((start, top, g))   # bounds below this split's max
                # infeasible: every bound <= values[p] is infeasible too; drop [start, p]
                start = int(p) + 1
                col += 1
            pending.append((start, hi, g_parent))
    if best is None and np.isfinite(upper_bound):
        return None
    if best is None:
        uncovered = int(np.flatnonzero(_last_finite(seg_time) == 0)[0]) \
            if (_last_finite(seg_time) == 0).any() else -1
        raise ValueError("no split fits: "
                         + (f"order position {uncovered} ends no feasible segment"
                            if uncovered >= 0 else "no feasible chain of segments"))
    return best
