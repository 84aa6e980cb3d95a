"""Pipeline schedules as plain data: per rank, an ordered list of compute actions.

`Action(stage=1, kind="F", mb=3)` prints as `1F3`: forward of micro-batch 3 on stage 1.
Stages are virtual stages (model chunks); `stage_to_rank` says which pipeline rank holds each.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

FORWARD = "F"
BACKWARD = "B"


class Action(NamedTuple):
    stage: int
    kind: str   # FORWARD or BACKWARD
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.mb}"


@dataclass(frozen=True)
class Schedule:
    name: str
    stage_to_rank: tuple[int, ...]
    rank_actions: tuple[tuple[Action, ...], ...]
    num_micro_batches: int

    @property
    def num_ranks(self) -> int:
        return len(self.rank_actions)

    @property
    def num_stages(self) -> int:
        return len(self.stage_to_rank)

    def __str__(self) -> str:
        return "\n".join(f"rank {r}: " + " ".join(map(str, acts))
                         for r, acts in enumerate(self.rank_actions))


def linear_layout(num_ranks: int) -> tuple[int, ...]:
    """Stage s on rank s."""
    return tuple(range(num_ranks))


def interleaved_layout(num_ranks: int, chunks: int) -> tuple[int, ...]:
    """Megatron's interleaving: stage s on rank s mod P (v chunks per rank)."""
    return tuple(s % num_ranks for s in range(num_ranks * chunks))


def wave_layout(num_ranks: int, waves: int) -> tuple[int, ...]:
    """Hanayo: 2*W*P stages as W down-and-up waves over P ranks; each rank holds 2W
    non-adjacent stages and every turning point stays on one rank (no transfer there)."""
    down = list(range(num_ranks))
    return tuple(r for _ in range(waves) for r in down + down[::-1])


class ScheduleError(ValueError):
    """A schedule that is malformed or cannot run to completion."""


def parse_action(text: str) -> Action:
    """Inverse of str(Action): '1F3' -> Action(1, 'F', 3)."""
    for kind in (FORWARD, BACKWARD):
        head, sep, tail = text.strip().partition(kind)
        if sep and head.isdigit() and tail.isdigit():
            return Action(int(head), kind, int(tail))
    raise ScheduleError(f"cannot parse action {text!r}: expected <stage>F<mb> or <stage>B<mb>")


def stages_of_rank(stage_to_rank: tuple[int, ...], rank: int) -> tuple[int, ...]:
    """Stages held by `rank`, in increasing order."""
    return tuple(s for s, r in enumerate(stage_to_rank) if r == rank)


def is_forward_only(schedule: Schedule) -> bool:
    """Whether `schedule` has no backward at all (evaluation: forwards only, see forward_only)."""
    return all(act.kind != BACKWARD for actions in schedule.rank_actions for act in actions)


def forward_only(schedule: Schedule) -> Schedule:
    """The schedule's forwards in the same per-rank order, without backwards: what evaluation
    runs. Every forward depends only on forwards, so any order that ran with the backwards
    runs without them."""
    return Schedule(f"{schedule.name}-fwd", schedule.stage_to_rank,
                    tuple(tuple(a for a in acts if a.kind == FORWARD)
                          for acts in schedule.rank_actions),
                    schedule.num_micro_batches)


def _kinds(schedule: Schedule) -> tuple[str, ...]:
    """The action kinds every (stage, mb) must have: F and B, or F alone when forward-only."""
    return (FORWARD,) if is_forward_only(schedule) else (FORWARD, BACKWARD)


def _looks_complete(schedule: Schedule) -> bool:
    """Fast path of validate_schedule: set operations only, no per-action Python loop."""
    num_stages, num_mb = schedule.num_stages, schedule.num_micro_batches
    expected = len(_kinds(schedule)) * num_stages * num_mb
    if expected == 0 or sum(map(len, schedule.rank_actions)) != expected:
        return False
    for rank, actions in enumerate(schedule.rank_actions):
        if not actions:
            continue
        stages, kinds, mbs = (set(column) for column in zip(*actions))
        if (not kinds <= {FORWARD, BACKWARD} or min(mbs) < 0 or max(mbs) >= num_mb
                or not stages <= set(stages_of_rank(schedule.stage_to_rank, rank))):
            return False
    return len({a for actions in schedule.rank_actions for a in actions}) == expected


def validate_schedule(schedule: Schedule) -> None:
    """Raise ScheduleError unless every (stage, F/B, mb) occurs exactly once, on the rank that
    holds its stage (F alone in a forward-only schedule, one without any backward). Says which
    action is wrong, where, or which one is missing."""
    num_stages, num_mb = schedule.num_stages, schedule.num_micro_batches
    if _looks_complete(schedule):
        return
    if num_stages == 0 or num_mb <= 0:
        raise ScheduleError(f"schedule {schedule.name!r}: needs stages and micro-batches, got "
                            f"{num_stages} stages and {num_mb} micro-batches")
    bad_ranks = sorted({r for r in schedule.stage_to_rank if not 0 <= r < schedule.num_ranks})
    if bad_ranks:
        raise ScheduleError(f"schedule {schedule.name!r}: stage_to_rank names ranks {bad_ranks} "
                            f"but there are {schedule.num_ranks} ranks")
    seen: set[Action] = set()
    for rank, actions in enumerate(schedule.rank_actions):
        for i, act in enumerate(actions):
            stage, kind, mb = act
            where = f"schedule {schedule.name!r}, rank {rank}, position {i}, action {act}"
            if kind != FORWARD and kind != BACKWARD:
                raise ScheduleError(f"{where}: kind must be 'F' or 'B'")
            if not (0 <= stage < num_stages and 0 <= mb < num_mb):
                raise ScheduleError(f"{where}: stage must be in [0, {num_stages}) and "
                                    f"micro-batch in [0, {num_mb})")
            if schedule.stage_to_rank[stage] != rank:
                raise ScheduleError(f"{where}: stage {stage} is held by rank "
                                    f"{schedule.stage_to_rank[stage]}")
            if act in seen:
                raise ScheduleError(f"{where}: appears more than once")
            seen.add(act)
    kinds = _kinds(schedule)
    expected = len(kinds) * num_stages * num_mb
    if len(seen) != expected:
        missing = next(Action(s, k, m) for m in range(num_mb) for s in range(num_stages)
                       for k in kinds if Action(s, k, m) not in seen)
        owner = schedule.stage_to_rank[missing.stage]
        raise ScheduleError(f"schedule {schedule.name!r}: {expected - len(seen)} action(s) "
                            f"missing, first {missing} (rank {owner})")
