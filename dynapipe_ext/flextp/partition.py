"""Which tensor-parallel rank owns which unit (an attention head, or a group of MLP ffn columns).

A unit is the smallest slice FlexTP moves or drops: a column-parallel weight keeps the rows of its
units, the following row-parallel weight keeps the matching columns, so any assignment of units to
ranks computes the same layer. A rank keeps its units in ascending global order."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Partition:
    """owner[u] is the TP rank that holds unit u."""
    owner: tuple[int, ...]
    tp: int

    def __post_init__(self):
        if self.tp < 1:
            raise ValueError(f"Partition: tp must be >= 1, got {self.tp}")
        bad = [u for u, r in enumerate(self.owner) if not 0 <= r < self.tp]
        if bad:
            raise ValueError(f"Partition: units {bad} have owners outside 0..{self.tp - 1}")
        empty = [r for r in range(self.tp) if r not in self.owner]
        if empty:
            raise ValueError(f"Partition: ranks {empty} own no unit (each rank needs at least "
                             f"one, the collectives need every rank)")

    @property
    def num_units(self) -> int:
        return len(self.owner)

    def units_of(self, rank: int) -> tuple[int, ...]:
        return tuple(u for u, r in enumerate(self.owner) if r == rank)

    def counts(self) -> tuple[int, ...]:
        return tuple(self.owner.count(r) for r in range(self.tp))

    def moves_to(self, other: "Partition") -> list[tuple[int, int, int]]:
        """(unit, from_rank, to_rank) for every unit whose owner differs in `other`."""
        if other.num_units != self.num_units or other.tp != self.tp:
            raise ValueError(f"Partition.moves_to: {self.num_units} units over {self.tp} ranks "
                             f"vs {other.num_units} over {other.tp}")
        return [(u, a, b) for u, (a, b) in enumerate(zip(self.owner, other.owner)) if a != b]


def partition_from_counts(counts) -> Partition:
    """Contiguous blocks: rank 0 the first counts[0] units, and so on (megatron's layout when
    the counts are equal)."""
    counts = [int(c) for c in counts]
    if any(c < 1 for c in counts):
        raise ValueError(f"partition_from_counts: every rank needs >= 1 unit, got {counts}")
    return Partition(tuple(r for r, c in enumerate(counts) for _ in range(c)), len(counts))


def even_partition(num_units: int, tp: int) -> Partition:
    """Megatron's equal shards; num_units must divide by tp."""
    if num_units % tp:
        raise ValueError(f"even_partition: {num_units} units do not split evenly over TP={tp}")
    return partition_from_counts([num_units // tp] * tp)


MAX_SHARE = 1.5     # --tp-balance-max-share's default


def slot_capacity(num_units: int, tp: int, max_share: float = MAX_SHARE) -> int:
    """Units one rank may hold (FlexTP's slots): `max_share` times the even share, rounded
    down, at least the even share and at most what leaves one unit to every other rank."""
    if max_share < 1:
        raise ValueError(f"slot_capacity: max_share must be >= 1, got {max_share}")
    even = num_units // tp
    return max(even, min(int(max_share * even + 1e-9), num_units - (tp - 1)))


def proportional_counts(num_units: int, speeds, min_units: int = 1,
                        max_units: int | None = None, offsets=None) -> tuple[int, ...]:
    """Units per rank, each rank in [min_units, max_units], that minimise the slowest rank's
    time (units / speed + offset): each unit goes where it finishes first (ties: the lower
    rank). `offsets` (default 0): each rank's time outside these units, in units of one unit's
    time at full speed (a rank slowed as a whole is slower in its replicated work too)."""
    speeds = [float(s) for s in speeds]
    offsets = [0.0] * len(speeds) if offsets is None else [float(o) for o in offsets]
    if len(offsets) != len(speeds):
        raise ValueError(f"proportional_counts: {len(offsets)} offsets vs {len(speeds)} speeds")
    if not speeds or any(s <= 0 for s in speeds):
        raise ValueError(f"proportional_counts: speeds must be positive, got {speeds}")
    top = num_units if max_units is None else max_units
    if not min_units * len(speeds) <= num_units <= top * len(speeds):
        raise ValueError(f"proportional_counts: {num_units} units cannot give {len(speeds)} "
                         f"ranks between {min_units} and {top} each")
    counts = [min_units] * len(speeds)
    for _ in range(num_units - min_units * len(speeds)):
        room = [i for i in range(len(speeds)) if counts[i] < top]
        r = min(room, key=lambda i: ((counts[i] + 1) / speeds[i] + offsets[i], i))
        counts[r] += 1
    return tuple(counts)


def rebalance(current: Partition, target_counts) -> Partition:
    """A partition with `target_counts` that moves the fewest units from `current`: a rank with
    a surplus gives away its highest-numbered units to ranks short of units, in rank order."""
    target_counts = tuple(int(c) for c in target_counts)
    if len(target_counts) != current.tp or sum(target_counts) != current.num_units:
        raise ValueError(f"rebalance: target counts {target_counts} do not cover "
                         f"{current.num_units} units over {current.tp} ranks")
    owner = list(current.owner)
    spare = []
    for r in range(current.tp):
        surplus = current.counts()[r] - target_counts[r]
        if surplus > 0:
            spare += list(current.units_of(r))[-surplus:]
    spare.sort()
    for r in range(current.tp):
        short = target_counts[r] - current.counts()[r]
        for _ in range(max(short, 0)):
            owner[spare.pop(0)] = r
    return Partition(tuple(owner), current.tp)
