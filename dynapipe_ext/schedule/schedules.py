"""Pipeline schedules as functions returning Schedule: 1F1B, interleaved 1F1B, Hanayo's wave,
and DynaPipe's adaptive (memory-aware, wait-free) schedule with micro-batch reordering, on the
linear layout or any other (a greedy order on the wave layout: wave_search)."""
from __future__ import annotations

import functools
import heapq
import itertools
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from dynapipe_ext.schedule.schedule_ir import (BACKWARD, FORWARD, Action, Schedule, ScheduleError, interleaved_layout,
                          linear_layout, stages_of_rank, wave_layout)
from dynapipe_ext.schedule.simulator import CommModel, PipelineCosts, transfer_matrix, uniform_costs


class MemoryLimitError(ScheduleError):
    """No schedule fits the memory limit; the message names the peak and the limit."""


def one_f_one_b(num_mb: int, num_ranks: int) -> Schedule:
    """Classic 1F1B on the linear layout: rank r runs min(P-r-1, m) warm-up forwards, then
    alternates one forward and one backward, then drains the remaining backwards."""
    _check_counts(num_mb, num_ranks)
    ranks = []
    for r in range(num_ranks):
        warmup = min(num_ranks - r - 1, num_mb)
        acts = [Action(r, FORWARD, m) for m in range(warmup)]
        for b in range(num_mb - warmup):
            acts += [Action(r, FORWARD, warmup + b), Action(r, BACKWARD, b)]
        acts += [Action(r, BACKWARD, b) for b in range(num_mb - warmup, num_mb)]
        ranks.append(tuple(acts))
    return Schedule("1f1b", linear_layout(num_ranks), tuple(ranks), num_mb)


def _warmup_then_1f1b(fw: Sequence[Action], bw: Sequence[Action], warmup: int) -> tuple:
    """One rank's order: `warmup` forwards, then one forward and one backward alternately,
    then the remaining backwards (1F1B's three phases over any forward / backward order)."""
    warmup = max(0, min(warmup, len(fw)))
    acts = list(fw[:warmup])
    for k in range(len(fw) - warmup):
        acts += [fw[warmup + k], bw[k]]
    return tuple(acts + list(bw[len(fw) - warmup:]))


def _phased(name: str, layout: tuple[int, ...], num_mb: int, fw_orders, bw_orders,
            warmups: Sequence[int]) -> Schedule:
    """The 1F1B-phased schedule of per-rank forward / backward orders and warm-up counts,
    with every warm-up raised alike by the least amount (found by bisection) that lets the
    order run without deadlock, checked by simulating it (all forwards first never
    deadlocks when the orders follow the dependencies)."""
    from dynapipe_ext.schedule.simulator import simulate   # local: keeps the module graph one-directional
    costs = uniform_costs(num_mb, len(layout))

    def runs(extra: int) -> Schedule | None:
        ranks = tuple(_warmup_then_1f1b(f, b, w + extra)
                      for f, b, w in zip(fw_orders, bw_orders, warmups))
        schedule = Schedule(name, layout, ranks, num_mb)
        try:
            simulate(schedule, costs, validate=extra == 0)
            return schedule
        except ScheduleError:
            return None

    found = runs(0)
    lo, hi = 0, max(len(f) for f in fw_orders)     # runs(lo) fails, runs(hi) succeeds
    while found is None and hi - lo > 1:
        mid = (lo + hi) // 2
        got = runs(mid)
        lo, hi = (lo, mid) if got is not None else (mid, hi)
    if found is None:
        found = runs(hi)
    if found is None:
        raise ScheduleError(f"{name}: the order breaks a dependency")   # not for these orders
    return found


def interleaved_orders(num_mb: int, num_ranks: int, chunks: int, group: int):
    """Megatron's interleaved order, per rank: forwards in groups of `group` micro-batches
    (P in Megatron; its microbatch_group_size_per_vp_stage), each group chunk by chunk
    (stage r, r+P, ...), backwards likewise with the chunks reversed. A last, shorter group
    (variable micro-batch counts) is taken the same way."""
    layout = interleaved_layout(num_ranks, chunks)
    fw_orders, bw_orders = [], []
    groups = [range(g, min(g + group, num_mb)) for g in range(0, num_mb, group)]
    for r in range(num_ranks):
        own = stages_of_rank(layout, r)
        fw_orders.append([Action(s, FORWARD, m) for g in groups for s in own for m in g])
        bw_orders.append([Action(s, BACKWARD, m) for g in groups for s in own[::-1] for m in g])
    return layout, fw_orders, bw_orders


@functools.lru_cache(maxsize=256)
def interleaved_one_f_one_b(num_mb: int, num_ranks: int, chunks: int, group: int | None = None,
                            slope: int = 2) -> Schedule:
    """Megatron's interleaved 1F1B (virtual pipeline, Narayanan et al. 2021): v = `chunks`
    stages per rank (stage s on rank s mod P), micro-batches in groups of P, rank r runs
    (v-1)*P + 2*(P-r-1) warm-up forwards, then 1F1B, then drains. On even stages with m a
    multiple of P its bubble is (P-1)/(v*m + P-1) of the makespan and its peak
    ((v+1)*P - 1)/(v*P) model copies of activations (rank 0). Any m works (a short last
    group). Fewer micro-batches in flight (less memory): `slope` 1 or 0 instead of 2 warm-up
    forwards per later rank, `group` < P micro-batches per chunk round (interleaved_levels)."""
    _check_counts(num_mb, num_ranks)
    group = num_ranks if group is None else group
    if chunks < 1 or group < 1 or slope < 0:
        raise ScheduleError(f"interleaved 1F1B needs chunks >= 1, group >= 1 and slope >= 0, "
                            f"got chunks={chunks}, group={group}, slope={slope}")
    layout, fw_orders, bw_orders = interleaved_orders(num_mb, num_ranks, chunks, group)
    warmups = [(chunks - 1) * group + slope * (num_ranks - r - 1) for r in range(num_ranks)]
    return _phased(f"interleaved{chunks}", layout, num_mb, fw_orders, bw_orders, warmups)


def interleaved_levels(num_mb: int, num_ranks: int, chunks: int) -> list:
    """Interleaved 1F1B builds from most to least memory: Megatron's, warm-up slopes 1 and
    0, then groups of P-1, P/2 and 1 micro-batches (slope 1); what fit_levels walks."""
    first = [dict(slope=2), dict(slope=1), dict(slope=0)]
    groups = sorted({g for g in (num_ranks - 1, num_ranks // 2, 1) if 0 < g < num_ranks},
                    reverse=True)
    return [lambda kw=kw: interleaved_one_f_one_b(num_mb, num_ranks, chunks, **kw)
            for kw in first + [dict(group=g, slope=1) for g in groups]]


def hanayo_orders(num_mb: int, num_ranks: int, waves: int, group: int | None = None):
    """Hanayo's wave order, per rank: micro-batches enter stage 0 back to back, so micro-batch
    i reaches stage s at step i + s; a rank runs its forwards in that order (ties: the earlier
    micro-batch), its backwards in the mirrored order (step i + S-1-s). With `group`, the
    micro-batches go in rounds of that many, one round's wave after the other."""
    layout = wave_layout(num_ranks, waves)
    last = len(layout) - 1
    group = group or num_mb
    fw_orders, bw_orders = [], []
    for r in range(num_ranks):
        own = stages_of_rank(layout, r)
        fw = sorted(((m // group, m % group + s, m, s) for m in range(num_mb) for s in own))
        bw = sorted(((m // group, m % group + last - s, m, s) for m in range(num_mb)
                     for s in own))
        fw_orders.append([Action(s, FORWARD, m) for *_, m, s in fw])
        bw_orders.append([Action(s, BACKWARD, m) for *_, m, s in bw])
    return layout, fw_orders, bw_orders


def hanayo_warmups(num_ranks: int, waves: int, group: int | None = None) -> list[int]:
    """Warm-up forwards of rank r in Hanayo's schedule: 2*(2W-1)*P + r (in rounds of g < 2P
    micro-batches: (2W-1)*g + r). The last stage sits on rank 0 (the waves end where they
    start), so backwards begin there and the warm-up grows with r, the mirror of 1F1B's; at
    m = 2P on even stages rank r then holds 2*(2W-1)*P + r + 1 stage activations at its
    peak, each 1/(2*W*P) of the model."""
    span = 2 * num_ranks if group is None else min(group, 2 * num_ranks)
    return [(2 * waves - 1) * span + r for r in range(num_ranks)]


@functools.lru_cache(maxsize=256)
def hanayo(num_mb: int, num_ranks: int, waves: int = 1, group: int | None = None) -> Schedule:
    """Hanayo's wave schedule (Liu et al., SC'23): the model in 2*W*P stages folded W times
    down and up over the P ranks (schedule_ir.wave_layout: rank r holds stages r, 2P-1-r,
    2P+r, ...; no transfer at a turning point), each rank in 1F1B phases over the wave order
    (hanayo_orders) with hanayo_warmups forwards first. On even stages with m >= 2P its
    bubble is the paper's (P-1)/(2*W*m + P-1), that of interleaving with v = 2W chunks
    (test_schedules); with m < 2P all forwards run first. Its peak is (4W-1)/(2W) model
    copies of activations at m = 2P; for larger m the order needs more warm-up forwards to
    run at all (up to 2W*(S-2) + 1, S = 2*W*P stages), so the peak grows with m up to about
    2.3 copies (W=1) or 3.8 (W=2) (docs/BENCHMARKS.md, Schedules). `group`: rounds of that
    many micro-batches (hanayo_levels), less memory and more bubble. The order is fixed by
    the shape alone; `wave_search` (greedy_order on the wave layout) instead rebuilds it
    from each iteration's costs under the memory limit."""
    _check_counts(num_mb, num_ranks)
    if waves < 1 or (group is not None and group < 1):
        raise ScheduleError(f"wave schedule needs waves >= 1 and group >= 1, got "
                            f"waves={waves}, group={group}")
    layout, fw_orders, bw_orders = hanayo_orders(num_mb, num_ranks, waves, group)
    return _phased(f"wave{waves}", layout, num_mb, fw_orders, bw_orders,
                   hanayo_warmups(num_ranks, waves, group))


def hanayo_levels(num_mb: int, num_ranks: int, waves: int) -> list:
    """Hanayo builds from most to least memory: all micro-batches in one wave, then rounds
    of 3P/2, P, P/2 and 1 micro-batches; what fit_levels walks."""
    rounds = {g for g in (3 * num_ranks // 2, num_ranks, num_ranks // 2, 1) if 0 < g < num_mb}
    groups = [None] + sorted(rounds, reverse=True)
    return [lambda g=g: hanayo(num_mb, num_ranks, waves, g) for g in groups]


def fit_levels(builds, costs: PipelineCosts, memory_limit: float, name: str,
               comm: CommModel | None = None) -> Schedule:
    """Of `builds` (callables, from most to least memory), the one with the smallest
    simulated makespan among those whose peak under `costs` fits `memory_limit` (the first
    that fits when there is no limit); MemoryLimitError naming the lowest peak otherwise."""
    from dynapipe_ext.schedule.simulator import peak_memory, simulate
    lowest, best = math.inf, None
    for build in builds:
        schedule = build()
        top = max(peak_memory(schedule, costs))
        lowest = min(lowest, top)
        if top > memory_limit:
            continue
        if memory_limit == math.inf:
            return schedule
        span = simulate(schedule, costs, comm, validate=False).makespan_ms
        if best is None or span < best[0]:
            best = (span, schedule)
    if best is None:
        raise MemoryLimitError(f"{name}: no warm-up fits the memory limit {memory_limit:.4g} "
                               f"bytes; lowest peak found {lowest:.4g}")
    return best[1]


def _check_counts(num_mb: int, num_ranks: int) -> None:
    if num_mb < 1 or num_ranks < 1:
        raise ScheduleError(f"need at least one micro-batch and one rank, got num_mb={num_mb}, "
                            f"num_ranks={num_ranks}")


@dataclass(frozen=True)
class GreedyOrder:
    """A per-rank order found by the greedy simulation, with what that simulation predicted."""

    schedule: Schedule
    makespan_ms: float
    peak_memory_bytes: tuple[float, ...]


def base_inflight_caps(stage_to_rank: Sequence[int]) -> list[int]:
    """Micro-batches a rank must hold to never starve in steady state: the stages from its first
    stage to the end, divided by its stage count (P-r for 1F1B, about P - r/2W for a wave)."""
    num_stages, caps = len(stage_to_rank), []
    for r in range(max(stage_to_rank) + 1):
        own = stages_of_rank(tuple(stage_to_rank), r)
        caps.append(max(1, math.ceil((num_stages - own[0]) / len(own))))
    return caps


def greedy_order(stage_to_rank: Sequence[int], costs: PipelineCosts, memory_limit: float = math.inf,
                 comm: CommModel | None = None, extra_inflight: int = 0,
                 mb_order: Sequence[int] | None = None, name: str = "greedy",
                 priority: str = "BFA") -> GreedyOrder:
    """Build each rank's action order by simulating the pipeline: whenever a rank is free it runs
    a ready backward (earliest micro-batch first), else a ready forward of a micro-batch it has
    already admitted, else admits the next micro-batch (in `mb_order`) at its first stage if
    (a) fewer than cap_r = base_inflight_caps + extra_inflight are in flight on the rank and
    (b) the activations of all in-flight micro-batches on the rank's stages, plus the largest
    transient peak among them, stay within `memory_limit`. Admission reserves the micro-batch's
    activations on all the rank's stages, so a later forward never waits for memory (no memory
    deadlock). Replaying the order "wait-free" reproduces this simulation exactly."""
    s2r = tuple(stage_to_rank)
    num_mb, num_stages = costs.num_micro_batches, costs.num_stages
    if len(s2r) != num_stages:
        raise ValueError(f"layout has {len(s2r)} stages, costs have {num_stages}")
    order = list(range(num_mb)) if mb_order is None else [int(m) for m in mb_order]
    if sorted(order) != list(range(num_mb)):
        raise ValueError(f"mb_order must be a permutation of range({num_mb}), got {order}")
    rank_of = {m: i for i, m in enumerate(order)}   # micro-batch -> admission position
    num_ranks = max(s2r) + 1
    rank_stages = [stages_of_rank(s2r, r) for r in range(num_ranks)]
    first = [st[0] for st in rank_stages]
    caps = [c + extra_inflight for c in base_inflight_caps(s2r)]
    fwd, bwd = costs.fwd_ms.tolist(), costs.bwd_ms.tolist()
    act, peak = costs.act_bytes, costs.peak_bytes
    xfer = transfer_matrix(s2r, costs, comm).tolist()
    # per (mb, rank): activations kept over the rank's stages, and the largest transient
    reserve = np.stack([act[:, st].sum(axis=1) for st in rank_stages], axis=1).tolist()
    transient = np.stack([peak[:, st].max(axis=1) for st in rank_stages], axis=1).tolist()
    act_l, peak_l = act.tolist(), peak.tolist()

    pend_b = [[] for _ in range(num_ranks)]      # (pos, -stage, stage, mb, arrival)
    pend_f = [[] for _ in range(num_ranks)]      # forwards of admitted micro-batches
    admit_at = [dict() for _ in range(num_ranks)]  # mb -> arrival time at the rank's first stage
    for m in order:
        admit_at[s2r[0]][m] = 0.0
    next_admit = [0] * num_ranks
    inflight = [dict() for _ in range(num_ranks)]  # mb -> transient bound
    top_transient = [0.0] * num_ranks               # max of inflight[r].values()
    reserved = [0.0] * num_ranks
    kept, top = [0.0] * num_ranks, [0.0] * num_ranks
    free = [0.0] * num_ranks
    acts = [[] for _ in range(num_ranks)]
    events = [(0.0, r) for r in range(num_ranks)]
    heapq.heapify(events)
    remaining = 2 * num_mb * num_stages
    bounded = memory_limit < math.inf
    if sorted(priority) != ["A", "B", "F"]:
        raise ValueError(f"priority must order the letters B, F, A, got {priority!r}")

    def deliver(rank: int, item, when: float, forward: bool) -> None:
        """Make an action known to `rank`, ready from `when`."""
        stage, mb = item
        if forward and stage == first[rank]:
            admit_at[rank][mb] = when
        else:
            (pend_f if forward else pend_b)[rank].append((rank_of[mb], -stage, stage, mb, when))
        if when >= free[rank]:   # else the rank sees it when its current action ends
            heapq.heappush(events, (when, rank))

    def pick(pending: list, now: float):
        best = None
        for i, item in enumerate(pending):
            if item[4] <= now and (best is None or item < pending[best]):
                best = i
        return None if best is None else pending.pop(best)

    def admit(r: int, now: float):
        """The next micro-batch if rank r may start it at its first stage now, else None."""
        mb = order[next_admit[r]]
        if admit_at[r].get(mb, math.inf) > now:
            return None
        if bounded:
            t = transient[mb][r]
            need = reserved[r] + reserve[mb][r] + (t if t > top_transient[r] else top_transient[r])
            if need > memory_limit:
                if not inflight[r]:
                    raise MemoryLimitError(
                        f"micro-batch {mb} alone needs {need:.4g} bytes on rank {r}, over the "
                        f"memory limit {memory_limit:.4g}")
                return None
        next_admit[r] += 1
        inflight[r][mb] = t = transient[mb][r]
        if t > top_transient[r]:
            top_transient[r] = t
        reserved[r] += reserve[mb][r]
        return mb

    def backward(r: int, stage: int, mb: int, now: float) -> float:
        end = now + bwd[mb][stage]
        acts[r].append(Action(stage, BACKWARD, mb))
        top[r] = max(top[r], kept[r] + peak_l[mb][stage])
        kept[r] -= act_l[mb][stage]
        if stage == first[r]:          # the micro-batch leaves this rank
            reserved[r] -= reserve[mb][r]
            if inflight[r].pop(mb) >= top_transient[r]:
                top_transient[r] = max(inflight[r].values(), default=0.0)
        if stage:
            deliver(s2r[stage - 1], (stage - 1, mb), end + xfer[mb][stage - 1], False)
        return end

    def forward(r: int, stage: int, mb: int, now: float) -> float:
        end = now + fwd[mb][stage]
        acts[r].append(Action(stage, FORWARD, mb))
        kept[r] += act_l[mb][stage]
        top[r] = max(top[r], kept[r] + peak_l[mb][stage])
        if stage + 1 < num_stages:
            deliver(s2r[stage + 1], (stage + 1, mb), end + xfer[mb][stage], True)
        else:
            deliver(r, (stage, mb), end, False)
        return end

    while events:
        now, r = heapq.heappop(events)
        if free[r] > now:
            continue
        for choice in priority:
            if choice == "B":
                if pend_b[r]:
                    item = pick(pend_b[r], now)
                    if item is not None:
                        end = backward(r, item[2], item[3], now)
                        break
            elif choice == "F":
                if pend_f[r]:
                    item = pick(pend_f[r], now)
                    if item is not None:
                        end = forward(r, item[2], item[3], now)
                        break
            elif next_admit[r] < num_mb and len(inflight[r]) < caps[r]:
                mb = admit(r, now)
                if mb is not None:
                    end = forward(r, first[r], mb, now)
                    break
        else:
            continue
        free[r] = end
        remaining -= 1
        heapq.heappush(events, (end, r))
    if remaining:
        raise ScheduleError(f"greedy order {name!r} stalled with {remaining} actions left "
                            f"(in-flight caps {caps})")
    schedule = Schedule(name, s2r, tuple(map(tuple, acts)), num_mb)
    return GreedyOrder(schedule, max(free), tuple(top))


def cost_clusters(costs: PipelineCosts, num_clusters: int = 3) -> list[list[int]]:
    """Micro-batches grouped by total compute time (quantile bins, cheapest group first); each
    group keeps the original micro-batch order."""
    total = (costs.fwd_ms + costs.bwd_ms).sum(axis=1)
    k = max(1, min(num_clusters, len(total)))
    edges = np.quantile(total, np.linspace(0, 1, k + 1)[1:-1])
    labels = np.searchsorted(edges, total, side="right")
    groups = [np.flatnonzero(labels == c).tolist() for c in range(k)]
    return [g for g in groups if g]


def candidate_orders(costs: PipelineCosts, num_clusters: int = 3) -> list[tuple[str, list[int]]]:
    """Micro-batch orders worth trying: as given, by cost ascending / descending, and the
    non-monotone permutations of the cost clusters. Duplicates are dropped."""
    total = (costs.fwd_ms + costs.bwd_ms).sum(axis=1)
    ident = list(range(len(total)))
    found = [("given", ident),
             ("cost-desc", np.argsort(-total, kind="stable").tolist()),
             ("cost-asc", np.argsort(total, kind="stable").tolist())]
    groups = cost_clusters(costs, num_clusters)
    monotone = (tuple(range(len(groups))), tuple(range(len(groups)))[::-1])
    for perm in itertools.permutations(range(len(groups))):
        if perm in monotone:    # close to cost-asc / cost-desc already
            continue
        found.append(("clusters" + "".join(map(str, perm)),
                      [m for c in perm for m in groups[c]]))
    seen, unique = set(), []
    for label, order in found:
        if tuple(order) not in seen:
            seen.add(tuple(order))
            unique.append((label, order))
    return unique


def relabel(schedule: Schedule, mb_order: Sequence[int], name: str | None = None) -> Schedule:
    """The same schedule with micro-batch i renamed mb_order[i] (run a schedule made for
    reordered costs on the original micro-batch indices)."""
    ranks = tuple(tuple(Action(a.stage, a.kind, int(mb_order[a.mb])) for a in acts)
                  for acts in schedule.rank_actions)
    return Schedule(name or schedule.name, schedule.stage_to_rank, ranks,
                    schedule.num_micro_batches)


# (extra in-flight micro-batches, priority) pairs the adaptive search tries; the first one ranks
# all micro-batch orders, the others refine the best orders.
ADAPTIVE_SETTINGS = ((2, "BFA"), (2, "FAB"))


def adaptive(costs: PipelineCosts, memory_limit: float = math.inf,
             comm: CommModel | None = None, **search_options) -> Schedule:
    """DynaPipe's adaptive schedule on the linear layout; see adaptive_search."""
    return adaptive_search(costs, memory_limit, comm, **search_options).schedule


def adaptive_search(costs: PipelineCosts, memory_limit: float = math.inf,
                    comm: CommModel | None = None, num_clusters: int = 3,
                    settings: Sequence[tuple[int, str]] = ADAPTIVE_SETTINGS, refine_top: int = 1,
                    stage_to_rank: Sequence[int] | None = None) -> GreedyOrder:
    """DynaPipe's adaptive schedule: greedy memory-aware orders (greedy_order) for every
    candidate micro-batch order (candidate_orders) under settings[0]; the `refine_top` best
    orders are retried under the other settings; on the linear layout 1F1B's own order (given
    micro-batch order) is a candidate too, so adaptive never loses to 1F1B when 1F1B fits.
    Returns the smallest predicted makespan that fits `memory_limit`; the schedule's name says
    how it was made, e.g. 'adaptive[cost-asc,+2,BFA]'."""
    from dynapipe_ext.schedule.simulator import simulate   # local: keeps the module graph one-directional
    s2r = tuple(stage_to_rank) if stage_to_rank is not None else linear_layout(costs.num_stages)
    fitting: list[tuple[float, int, GreedyOrder]] = []
    refusals: list[str] = []
    lowest_peak = [math.inf]

    def consider(got: GreedyOrder, rank_key: int) -> None:
        peak = max(got.peak_memory_bytes)
        lowest_peak[0] = min(lowest_peak[0], peak)
        if peak <= memory_limit:
            fitting.append((got.makespan_ms, rank_key, got))

    def build(label: str, order, extra: int, priority: str) -> GreedyOrder | None:
        try:
            return greedy_order(s2r, costs, memory_limit, comm, extra, order,
                                f"adaptive[{label},+{extra},{priority}]", priority)
        except MemoryLimitError as err:
            refusals.append(str(err))
            return None

    orders = candidate_orders(costs, num_clusters)
    first_pass = []
    for i, (label, order) in enumerate(orders):
        got = build(label, order, *settings[0])
        if got is not None:
            consider(got, len(fitting))
            first_pass.append((got.makespan_ms if max(got.peak_memory_bytes) <= memory_limit
                               else math.inf, i))
    for _, i in sorted(first_pass)[:refine_top]:
        label, order = orders[i]
        for extra, priority in settings[1:]:
            got = build(label, order, extra, priority)
            if got is not None:
                consider(got, len(fitting))
    if s2r == linear_layout(costs.num_stages):
        sched = one_f_one_b(costs.num_micro_batches, costs.num_stages)
        res = simulate(Schedule("adaptive[given,1f1b]", s2r, sched.rank_actions,
                                sched.num_micro_batches), costs, comm, validate=False)
        consider(GreedyOrder(res.schedule, res.makespan_ms, res.peak_memory_bytes), len(fitting))
    if not fitting:
        raise MemoryLimitError(f"adaptive: no order fits the memory limit {memory_limit:.4g} "
                               f"bytes; " + (f"lowest peak found {lowest_peak[0]:.4g}"
                                             if lowest_peak[0] < math.inf else refusals[0]))
    return min(fitting, key=lambda item: item[:2])[2]


def wave_settings(num_ranks: int) -> tuple[tuple[int, str], ...]:
    """(extra in-flight, priority) pairs wave_search tries: a deep pipeline, forwards first
    (the memory limit caps it; shallower caps never won in tools/bench_schedules.py)."""
    return ((num_ranks, "FAB"),)


def wave_search(costs: PipelineCosts, num_ranks: int, waves: int = 1,
                memory_limit: float = math.inf, comm: CommModel | None = None,
                settings: Sequence[tuple[int, str]] | None = None) -> GreedyOrder:
    """A greedy order on Hanayo's wave layout (2*W*P stages as W down-and-up waves over P
    ranks, schedule_ir.wave_layout): each rank's order comes from the ready-first simulation
    of this iteration's costs with the memory cap (greedy_order), the fastest fitting one of
    `settings`. Unlike `hanayo` (the paper's fixed wave order and warm-ups) the order follows
    the costs and admits micro-batches only while they fit; what the adaptive schedule runs on
    a wave layout."""
    _check_counts(costs.num_micro_batches, num_ranks)
    if waves < 1:
        raise ScheduleError(f"wave schedule needs waves >= 1, got {waves}")
    layout = wave_layout(num_ranks, waves)
    if costs.num_stages != len(layout):
        raise ValueError(f"wave with P={num_ranks}, W={waves} needs costs for {len(layout)} "
                         f"stages, got {costs.num_stages}")
    best, lowest_peak, refusal = None, math.inf, ""
    for extra, priority in settings or wave_settings(num_ranks):
        try:
            got = greedy_order(layout, costs, memory_limit, comm, extra,
                               name=f"wave{waves}[+{extra},{priority}]", priority=priority)
        except MemoryLimitError as err:
            refusal = str(err)
            continue
        peak = max(got.peak_memory_bytes)
        lowest_peak = min(lowest_peak, peak)
        if peak <= memory_limit and (best is None or got.makespan_ms < best.makespan_ms):
            best = got
    if best is None:
        raise MemoryLimitError(f"wave{waves}: no order fits the memory limit "
                               f"{memory_limit:.4g} bytes; " + (
                                   f"lowest peak found {lowest_peak:.4g}"
                                   if lowest_peak < math.inf else refusal))
    return best


def wave(num_mb: int, num_ranks: int, waves: int = 1, costs: PipelineCosts | None = None,
         memory_limit: float = math.inf, comm: CommModel | None = None) -> Schedule:
    """The greedy order on the wave layout (see wave_search). Without costs every stage of
    every micro-batch costs F=1, B=2."""
    _check_counts(num_mb, num_ranks)
    if costs is None:
        costs = uniform_costs(num_mb, 2 * waves * num_ranks)
    if costs.num_micro_batches != num_mb:
        raise ValueError(f"wave with {num_mb} micro-batches got costs for "
                         f"{costs.num_micro_batches}")
    return wave_search(costs, num_ranks, waves, memory_limit, comm).schedule
