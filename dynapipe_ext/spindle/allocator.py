"""Malleable allocator: give the MetaOps of one wave devices so that they finish together.

* Continuous relaxation: every MetaOp m takes a real share x_m of the devices (below one
  device it time-shares one: T_m(x) = T_m(1) / x); bisection on the common finish time C
  finds the least C whose shares fit the devices: C*, a lower bound for the wave.
* Rounding: MetaOps whose share is below one device are packed (first-fit decreasing) into
  lanes that run them one after another on one device group; every other MetaOp is a lane of
  its own. Lanes then get whole devices one at a time, always to the current bottleneck,
  which is optimal for min-max when lane times do not grow with more devices. Finally lanes
  are merged pairwise while that shortens the wave: two MetaOps that each deserve 1.5
  devices run one after another on 3 instead of on 1 and 2. Besides the packing above, a few
  seeded orders of the MetaOps are cut into lanes whose relaxed shares add up to nearly whole
  devices; the shortest wave found is kept.
"""
from __future__ import annotations

import heapq
import itertools
import random
from dataclasses import dataclass
from typing import Sequence

from .contraction import MetaOp
from .estimator import Estimator

_ITERS = 100
_SHARE_TRIALS = 24
_PACK_SLACK = (1.0, 1.05, 1.1, 1.2, 1.35, 1.5, 2.0)    # lane capacities tried, x C*


@dataclass(frozen=True)
class Allocation:
    """Lanes (MetaOp ids run one after another on the same devices), devices per lane, the
    wave time (slowest lane) and the relaxed optimum C* (a lower bound on `time`)."""
    lanes: tuple[tuple[int, ...], ...]
    counts: tuple[int, ...]
    time: float
    relaxed: float

    def devices_of(self, op: int) -> int:
        for lane, n in zip(self.lanes, self.counts):
            if op in lane:
                return n
        raise KeyError(f"MetaOp {op} is not in this allocation")


def _share_for(m: MetaOp, est: Estimator, c: float, cap: int) -> float:
    """Least real share in (0, cap] with T_m <= c (cap if even that is too slow)."""
    if est.time(m, float(cap)) > c:
        return float(cap)
    if est.time(m, 1) <= c:
        return est.time(m, 1) / c
    lo, hi = 1.0, float(cap)
    for _ in range(_ITERS):
        mid = (lo + hi) / 2
        if est.time(m, mid) <= c:
            hi = mid
        else:
            lo = mid
    return hi


def relaxed_common_time(ops: Sequence[MetaOp], est: Estimator, num_devices: int
                        ) -> tuple[float, dict[int, float]]:
    """C* and the real device share of every MetaOp at C*."""
    if not ops:
        raise ValueError("a wave needs at least one MetaOp")
    caps = {m.id: est.max_devices(m, num_devices) for m in ops}
    lo = max(est.time(m, caps[m.id]) for m in ops)        # nobody can be faster than this
    hi = sum(est.time(m, 1) for m in ops)                  # everything on one device

    def need(c: float) -> float:
        return sum(_share_for(m, est, c, caps[m.id]) for m in ops)

    if need(lo) <= num_devices:
        c = lo
    else:
        for _ in range(_ITERS):
            mid = (lo + hi) / 2
            if need(mid) <= num_devices:
                hi = mid
            else:
                lo = mid
        c = hi
    return c, {m.id: _share_for(m, est, c, caps[m.id]) for m in ops}


def lane_time(lane: Sequence[MetaOp], est: Estimator, n: int) -> float:
    return sum(est.time(m, n) for m in lane)


def allocate_lanes(lanes: Sequence[Sequence[MetaOp]], est: Estimator, num_devices: int
                   ) -> tuple[list[int], float]:
    """Whole devices per lane minimising the slowest lane (greedy to the bottleneck)."""
    if len(lanes) > num_devices:
        raise ValueError(f"{len(lanes)} lanes cannot share {num_devices} devices")
    caps = [max(est.max_devices(m, num_devices) for m in lane) for lane in lanes]
    counts = [1] * len(lanes)
    heap = [(-lane_time(lane, est, 1), i) for i, lane in enumerate(lanes)]
    heapq.heapify(heap)
    spare = num_devices - len(lanes)
    while spare > 0:
        _, i = heap[0]
        if counts[i] >= caps[i]:
            break                      # the bottleneck cannot go faster: the max is final
        counts[i] += 1
        spare -= 1
        heapq.heapreplace(heap, (-lane_time(lanes[i], est, counts[i]), i))
    return counts, max(lane_time(lane, est, n) for lane, n in zip(lanes, counts))


def _pack(small: Sequence[MetaOp], est: Estimator, capacity: float) -> list[list[MetaOp]]:
    """First-fit decreasing of one-device times into lanes of `capacity` seconds."""
    lanes: list[list[MetaOp]] = []
    loads: list[float] = []
    for m in sorted(small, key=lambda m: (-est.time(m, 1), m.id)):
        t = est.time(m, 1)
        for i, load in enumerate(loads):
            if load + t <= capacity:
                lanes[i].append(m)
                loads[i] += t
                break
        else:
            lanes.append([m])
            loads.append(t)
    return lanes


def _whole_share_lanes(order: Sequence[MetaOp], shares: dict[int, float],
                       tolerance: float = 0.1) -> list[list[MetaOp]]:
    """Cut `order` into lanes, closing a lane once its summed relaxed share is within
    `tolerance` of a whole number of devices (>= 1)."""
    lanes: list[list[MetaOp]] = []
    lane: list[MetaOp] = []
    total = 0.0
    for m in order:
        lane.append(m)
        total += shares[m.id]
        if total >= 1 - tolerance and abs(total - round(total)) <= tolerance:
            lanes.append(lane)
            lane, total = [], 0.0
    if lane:
        lanes.append(lane)
    return lanes


def _merge_to(lanes: list[list[MetaOp]], est: Estimator, limit: int) -> list[list[MetaOp]]:
    """Join the two lightest lanes until at most `limit` remain."""
    lanes = [list(lane) for lane in lanes]
    while len(lanes) > limit:
        lanes.sort(key=lambda lane: lane_time(lane, est, 1))
        lanes[1] = lanes[0] + lanes[1]
        lanes.pop(0)
    return lanes


def _merge_while_better(lanes: list[list[MetaOp]], counts: list[int], time: float,
                        est: Estimator, num_devices: int):
    """Best-improvement pairwise lane merging until no merge shortens the wave."""
    while len(lanes) > 1:
        best = None
        for i, j in itertools.combinations(range(len(lanes)), 2):
            trial = [lane for k, lane in enumerate(lanes) if k not in (i, j)]
            trial.append(lanes[i] + lanes[j])
            t_counts, t_time = allocate_lanes(trial, est, num_devices)
            if t_time < time * (1 - 1e-9) and (best is None or t_time < best[2]):
                best = (trial, t_counts, t_time)
        if best is None:
            break
        lanes, counts, time = best
    return lanes, counts, time


def allocate(ops: Sequence[MetaOp], est: Estimator, num_devices: int) -> Allocation:
    """Lanes and integer device counts for one wave, best over a few packing capacities."""
    relaxed, shares = relaxed_common_time(ops, est, num_devices)
    small = [m for m in ops if shares[m.id] < 1]
    large = [[m] for m in ops if shares[m.id] >= 1]
    candidates = [_merge_to(large + _pack(small, est, relaxed * slack), est, num_devices)
                  for slack in _PACK_SLACK]
    rng = random.Random(0)
    order = sorted(ops, key=lambda m: (-shares[m.id], m.id))
    for trial in range(_SHARE_TRIALS):
        candidates.append(_merge_to(_whole_share_lanes(order, shares), est, num_devices))
        order = list(order)
        rng.shuffle(order)
    best = None
    for lanes in candidates:
        counts, time = allocate_lanes(lanes, est, num_devices)
        if best is None or time < best[2]:
            best = (lanes, counts, time)
    lanes, counts, time = _merge_while_better(*best, est, num_devices)
    return Allocation(tuple(tuple(m.id for m in lane) for lane in lanes), tuple(counts), time,
                      relaxed)
