"""ZERO-resizing: a straggler skips a bounded number of its units for a while (no data moves).

Priority: the units with the smallest weight norm go first (their output is the smallest by the
norm bound |W2 W1 x| <= |W2| |W1| |x|, so skipping them perturbs the layer least); skipped units
rotate: a unit skipped in one interval is computed in the next (see choose_drops). Imputation is
done by the layer (megatron/flextp): it adds each skipped unit's last computed token-mean
contribution to the row-parallel partial sum, so the all-reduce keeps its shape and expected
value. The bound `max_fraction` caps the share of a rank's units that may be skipped:
MAX_DROP_FRACTION (0.375) by default, which balances a straggler up to 1.6x and leaves a 2x one
1.25x its even work; a half (enough for 2x) cost about 2% of held-out loss in the FlexTP loss
study (docs/BENCHMARKS.md), 0.375 and a quarter under 1%."""
from __future__ import annotations

import math

MAX_DROP_FRACTION = 0.375


def max_drops(count: int, max_fraction: float) -> int:
    """Units a rank owning `count` may skip: floor(max_fraction * count), never its last one."""
    if not 0.0 <= max_fraction < 1.0:
        raise ValueError(f"max_drops: max_fraction must be in [0, 1), got {max_fraction}")
    return min(int(math.floor(max_fraction * count + 1e-9)), count - 1)


def drop_counts(counts, speeds, max_fraction: float, offsets=None) -> tuple[int, ...]:
    """Units each rank should skip so that no rank needs longer than the quickest one
    (time_r = units_r / speed_r + offset_r, offsets as in partition.proportional_counts),
    within the bound. Only a rank slower than the fastest skips: resizing trades a straggler's
    training for time; a healthy rank left the longest time after a migration to the slot
    capacity (or by noise in the measured offsets) keeps all its units."""
    offsets = (0.0,) * len(counts) if offsets is None else tuple(offsets)
    if not len(counts) == len(speeds) == len(offsets):
        raise ValueError(f"drop_counts: {len(counts)} counts vs {len(speeds)} speeds vs "
                         f"{len(offsets)} offsets")
    target = min(c / s + o for c, s, o in zip(counts, speeds, offsets))
    fastest = max(speeds)
    return tuple(min(max(0, math.ceil(c - (target - o) * s - 1e-9)), max_drops(c, max_fraction))
                 if s < fastest else 0 for c, s, o in zip(counts, speeds, offsets))


SKIP_ORDERS = ("rotate", "sticky")      # --flextp-skip-order


def choose_drops(units, norms, n_drop: int, rest=()) -> tuple[int, ...]:
    """The `n_drop` units of smallest norm (ties: lower unit id first), ascending, among those
    not in `rest` (the units skipped in the interval before: they are computed now); from all
    units only where too few others are left. A skipped unit gets no gradient, so with
    rest=() (--flextp-skip-order sticky) the same units stay skipped for as long as the
    straggler lasts, in effect pruned; rotating, every unit is computed (and trained, and its
    imputed contribution refreshed) at least every other interval."""
    units = list(units)
    if len(norms) != len(units):
        raise ValueError(f"choose_drops: {len(units)} units but {len(norms)} norms")
    if not 0 <= n_drop < len(units):
        raise ValueError(f"choose_drops: cannot drop {n_drop} of {len(units)} units")
    order = sorted(range(len(units)), key=lambda i: (norms[i], units[i]))
    rest = set(rest)
    fresh = [i for i in order if units[i] not in rest]
    if len(fresh) >= n_drop:
        order = fresh
    return tuple(sorted(units[i] for i in order[:n_drop]))
