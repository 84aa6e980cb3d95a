"""The pipeline schedules and stage layouts, each declared once.

A layout says where the stages of a run live: `LAYOUTS[name].stages(pp, param)` is the
stage -> pipeline rank map (its length is the stage count), `param` being v of interleaving or
W of waves. A schedule is a `ScheduleDecl`: its name (the value of `--pipeline-schedule`), its
builder, the layouts it runs on (the first is the one its name on the flag lays out) and
whether `auto` tries it. The flag's choices, `auto`'s candidates per layout, the schedule
search and the flag's help all read `SCHEDULES`; adding a schedule is one declaration here
plus its builder.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from dynapipe_ext.schedule.schedule_ir import (Schedule, interleaved_layout, linear_layout,
                                               wave_layout)
from dynapipe_ext.schedule.schedules import (adaptive_search, fit_levels, hanayo_levels,
                                             interleaved_levels, one_f_one_b)
from dynapipe_ext.schedule.simulator import CommModel, PipelineCosts


@dataclass(frozen=True)
class Layout:
    """A stage layout: `stages(pp, value)` maps each stage to its pipeline rank, `value` being
    that of its parameter `param` ("virtual_stages": v, "waves": W; "" for none)."""

    name: str
    stages: Callable[[int, int], tuple[int, ...]]
    param: str = ""


LAYOUTS = {layout.name: layout for layout in (
    Layout("linear", lambda pp, _: linear_layout(pp)),
    Layout("interleaved", interleaved_layout, "virtual_stages"),
    Layout("wave", wave_layout, "waves"),
)}
LAYOUT_NAMES = tuple(LAYOUTS)


@dataclass(frozen=True)
class BuildRequest:
    """What a builder gets: one replica's stage costs, the ranks, the layout's stage -> rank
    map and parameter, the activation memory limit per rank and the link model."""

    costs: PipelineCosts
    num_ranks: int
    stage_to_rank: tuple[int, ...]
    param: int
    memory_limit: float
    comm: CommModel | None


@dataclass(frozen=True)
class ScheduleDecl:
    """One schedule: `layouts[0]` is the layout `--pipeline-schedule NAME` runs on; with more
    than one layout the builder takes any stage -> rank map it is given."""

    name: str
    build: Callable[[BuildRequest], Schedule]
    layouts: tuple[str, ...]
    in_auto: bool
    summary: str

    @property
    def home_layout(self) -> str:
        return self.layouts[0]


def _one_f_one_b(req: BuildRequest) -> Schedule:
    return one_f_one_b(req.costs.num_micro_batches, req.num_ranks)


def _adaptive(req: BuildRequest) -> Schedule:
    return adaptive_search(req.costs, req.memory_limit, req.comm,
                           stage_to_rank=req.stage_to_rank).schedule


def _interleaved(req: BuildRequest) -> Schedule:
    levels = interleaved_levels(req.costs.num_micro_batches, req.num_ranks, req.param)
    return fit_levels(levels, req.costs, req.memory_limit, f"interleaved{req.param}", req.comm)


def _wave(req: BuildRequest) -> Schedule:
    levels = hanayo_levels(req.costs.num_micro_batches, req.num_ranks, req.param)
    return fit_levels(levels, req.costs, req.memory_limit, f"wave{req.param}", req.comm)


SCHEDULES = {decl.name: decl for decl in (
    ScheduleDecl("1f1b", _one_f_one_b, ("linear",), True,
                 "1F1B on P stages"),
    ScheduleDecl("adaptive", _adaptive, LAYOUT_NAMES, True,
                 "DynaPipe's memory-aware order of the micro-batches on the run's layout"),
    ScheduleDecl("interleaved", _interleaved, ("interleaved",), True,
                 "Megatron's interleaved 1F1B on v*P stages"),
    ScheduleDecl("wave", _wave, ("wave",), True,
                 "Hanayo's wave schedule on 2*W*P stages"),
)}
SCHEDULE_NAMES = tuple(SCHEDULES)


def schedule_decl(name: str) -> ScheduleDecl:
    """The declaration of schedule `name`; ValueError naming the choices otherwise."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose from {SCHEDULE_NAMES}")
    return SCHEDULES[name]


def layout_of(pipeline_schedule: str, auto_layout: str = "linear") -> str:
    """The layout a run of `--pipeline-schedule` lays out ('auto': `auto_layout`)."""
    if pipeline_schedule == "auto":
        return auto_layout
    return schedule_decl(pipeline_schedule).home_layout


def layout_stages(layout: str, pp: int, waves: int = 1, virtual_stages: int = 2
                  ) -> tuple[int, ...]:
    """Stage -> pipeline rank of `layout` at `pp` ranks; its length is the stage count."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown stage layout {layout!r}; choose from {LAYOUT_NAMES}")
    decl = LAYOUTS[layout]
    return decl.stages(pp, layout_params(waves, virtual_stages).get(decl.param, 0))


def layout_params(waves, virtual_stages) -> dict:
    """The layouts' parameters by name (`Layout.param`)."""
    return {"waves": waves, "virtual_stages": virtual_stages}


def auto_candidates(layout: str) -> tuple[str, ...]:
    """The schedules `auto` tries on `layout`: those declared for it (its own first)."""
    found = [d for d in SCHEDULES.values() if d.in_auto and layout in d.layouts]
    return tuple(d.name for d in sorted(found, key=lambda d: d.home_layout != layout))
