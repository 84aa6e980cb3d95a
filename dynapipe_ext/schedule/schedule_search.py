"""Schedule search: simulate the allowed candidate schedules and keep the fastest that fits memory.

Costs come per stage count, because 1F1B / adaptive cut the model into P stages, a W-wave
schedule into 2*W*P and interleaving with v chunks into v*P: pass one PipelineCosts (P stages
only), a mapping {num_stages: PipelineCosts}, or a callable num_stages -> PipelineCosts (e.g.
micro_batch_costs(...), which asks the cost model and caches per stage count).

`comm` (simulator.CommModel: latency + bytes / bandwidth per cross-rank transfer) enters every
simulation that builds, ranks and times the candidates, so both the pick and the transfer
order that lowering derives from the winning simulation account for the link; None treats
transfers as free. The iteration planner passes the run's (--p2p-bandwidth-gbps /
--p2p-latency-us).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence, Union

import numpy as np

from dynapipe_ext.costs.cost_model import CostModel
from dynapipe_ext.batching.microbatch import MicroBatch
from dynapipe_ext.costs.model_spec import ModelSpec, stage_output_shapes
from dynapipe_ext.schedule.registry import (LAYOUTS, SCHEDULE_NAMES, BuildRequest, layout_params,
                                            schedule_decl)
from dynapipe_ext.schedule.schedule_ir import Schedule, ScheduleError, forward_only
from dynapipe_ext.schedule.schedules import MemoryLimitError
from dynapipe_ext.schedule.simulator import CommModel, PipelineCosts, SimResult, simulate

CostSource = Union[PipelineCosts, Mapping[int, PipelineCosts], Callable[[int], PipelineCosts]]


@dataclass(frozen=True)
class Candidate:
    """One simulated candidate; `schedule`/`result` are None when it could not be built
    (`reason` says why, e.g. the model does not split into that many stages)."""

    name: str
    schedule: Schedule | None
    result: SimResult | None
    reason: str = ""

    def fits(self, memory_limit: float) -> bool:
        return self.result is not None and self.result.fits(memory_limit)


def costs_for(costs: CostSource, num_stages: int) -> PipelineCosts:
    """The costs of a `num_stages` cut from any CostSource; ValueError when there are none."""
    if isinstance(costs, PipelineCosts):
        found = costs if costs.num_stages == num_stages else None
    elif isinstance(costs, Mapping):
        found = costs.get(num_stages)
    else:
        found = costs(num_stages)
    if found is None:
        raise ValueError(f"no stage costs for a cut into {num_stages} stages")
    if found.num_stages != num_stages:
        raise ValueError(f"costs asked for {num_stages} stages have {found.num_stages}")
    return found


def _variants(name: str, num_ranks: int, waves: Sequence[int], chunks: Sequence[int],
              adaptive_layout: tuple[int, ...] | None):
    """(label, layout parameter, stage -> rank) of each schedule a candidate name stands for:
    one per value of its layout's parameter; a schedule declared for several layouts runs
    once, on `adaptive_layout` (default linear)."""
    decl = schedule_decl(name)
    layout = LAYOUTS[decl.home_layout]
    if len(decl.layouts) > 1 and adaptive_layout is not None:
        return [(name, 0, adaptive_layout)]
    if not layout.param:
        return [(name, 0, layout.stages(num_ranks, 0))]
    values = layout_params(waves, chunks)[layout.param]
    return [(f"{name}{v}", v, layout.stages(num_ranks, v)) for v in values]


def evaluate_candidates(costs: CostSource, memory_limit: float, num_ranks: int,
                        candidates: Sequence[str] = SCHEDULE_NAMES,
                        comm: CommModel | None = None, waves: Sequence[int] = (1,),
                        chunks: Sequence[int] = (2,),
                        adaptive_layout: Sequence[int] | None = None) -> list[Candidate]:
    """Build and simulate every allowed candidate ('wave' once per W in `waves`,
    'interleaved' once per v in `chunks`; 'adaptive' on `adaptive_layout`, default linear).
    Wave and interleaved are fitted to `memory_limit` with fewer micro-batches in flight
    (schedules.fit_levels)."""
    layout = tuple(adaptive_layout) if adaptive_layout is not None else None
    unknown = [c for c in candidates if c not in SCHEDULE_NAMES]
    if unknown or not candidates:
        raise ValueError(f"unknown pipeline schedule(s) {unknown or list(candidates)}; "
                         f"choose from {SCHEDULE_NAMES}")
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    found = []
    for name in candidates:
        for label, param, s2r in _variants(name, num_ranks, waves, chunks, layout):
            try:
                stage_costs = costs_for(costs, len(s2r))
                schedule = schedule_decl(name).build(BuildRequest(
                    stage_costs, num_ranks, s2r, param, memory_limit, comm))
                found.append(Candidate(label, schedule, simulate(schedule, stage_costs, comm)))
            except (ValueError, ScheduleError) as err:   # MemoryLimitError included
                found.append(Candidate(label, None, None, str(err)))
    return found


def forward_only_candidates(found: Sequence[Candidate], costs: CostSource,
                            comm: CommModel | None = None) -> list[Candidate]:
    """The candidates as evaluation runs them: backwards dropped (schedule_ir.forward_only) and
    simulated again, so makespan and peak memory are those of forwards alone (no activation
    kept past its forward)."""
    out = []
    for c in found:
        if c.schedule is None:
            out.append(c)
            continue
        schedule = forward_only(c.schedule)
        stage_costs = costs_for(costs, schedule.num_stages)
        out.append(Candidate(c.name, schedule, simulate(schedule, stage_costs, comm)))
    return out


def best_candidate(found: Sequence[Candidate], memory_limit: float) -> Candidate:
    """The fitting candidate with the smallest makespan (earlier candidate on ties);
    MemoryLimitError naming every candidate's peak (or failure) and the limit otherwise."""
    fitting = [c for c in found if c.fits(memory_limit)]
    if fitting:
        return min(fitting, key=lambda c: c.result.makespan_ms)
    why = "; ".join(f"{c.name}: peak {c.result.max_peak_memory_bytes:.4g} bytes" if c.result
                    else f"{c.name}: {c.reason}" for c in found)
    raise MemoryLimitError(f"no pipeline schedule fits the memory limit {memory_limit:.4g} "
                           f"bytes ({why})")


def search_schedule(costs: CostSource, memory_limit: float, num_ranks: int,
                    candidates: Sequence[str] = SCHEDULE_NAMES,
                    comm: CommModel | None = None, waves: Sequence[int] = (1,),
                    chunks: Sequence[int] = (2,),
                    adaptive_layout: Sequence[int] | None = None) -> tuple[Schedule, SimResult]:
    """Fastest candidate schedule that fits `memory_limit` bytes per rank, with its simulation.
    `--pipeline-schedule NAME` is candidates=(NAME,)."""
    chosen = best_candidate(evaluate_candidates(costs, memory_limit, num_ranks, candidates, comm,
                                                waves, chunks, adaptive_layout), memory_limit)
    return chosen.schedule, chosen.result


def costs_from_micro_batches(micro_batches: Sequence[MicroBatch], cost_model: CostModel,
                             num_stages: int, model_spec: ModelSpec | None = None,
                             dtype_bytes: int = 2) -> PipelineCosts:
    """Ask the cost model for every micro-batch's stage costs under a `num_stages` cut.
    With `model_spec`, comm_bytes are the sizes of the tensors each stage sends on
    (stage_output_shapes at `dtype_bytes` per element); without it they are zero."""
    if not micro_batches:
        raise ValueError("costs_from_micro_batches needs at least one micro-batch")
    shape = (len(micro_batches), num_stages)
    fwd, bwd, act, peak, comm = (np.zeros(shape) for _ in range(5))
    for mode in sorted({mb.recompute for mb in micro_batches}):
        idx = [i for i, mb in enumerate(micro_batches) if mb.recompute == mode]
        rows, seq, dec = np.array([micro_batches[i].costed_shape() for i in idx]).T
        arrays = cost_model.stage_cost_arrays(rows, seq, dec, num_stages, mode)
        if not np.all(arrays.feasible):
            mb_index = idx[int(np.argmin(arrays.feasible))]
            mb = micro_batches[mb_index]
            raise ValueError(f"micro-batch {mb_index} ({mb.num_rows} rows x seq_len "
                             f"{mb.seq_len}, dec_seq_len {mb.dec_seq_len}, recompute {mode!r}) "
                             f"is outside what the cost model knows (infeasible shape)")
        fwd[idx], bwd[idx] = arrays.fwd_ms.T, arrays.bwd_ms.T
        act[idx], peak[idx] = arrays.activation_bytes.T, arrays.peak_bytes.T
    if model_spec is not None:
        layers = model_spec.stage_layers(num_stages)
        for i, mb in enumerate(micro_batches):
            for s in range(num_stages):
                shapes = stage_output_shapes(layers[s], mb.num_rows, mb.seq_len,
                                             mb.dec_seq_len, model_spec.hidden_size)
                comm[i, s] = dtype_bytes * sum(math.prod(sh) for sh in shapes)
    return PipelineCosts(fwd, bwd, act, peak, comm)


def micro_batch_costs(micro_batches: Sequence[MicroBatch], cost_model: CostModel,
                      model_spec: ModelSpec | None = None,
                      dtype_bytes: int = 2) -> Callable[[int], PipelineCosts]:
    """A CostSource for search_schedule: num_stages -> costs_from_micro_batches(...), cached."""
    cache: dict[int, PipelineCosts] = {}

    def for_stages(num_stages: int) -> PipelineCosts:
        if num_stages not in cache:
            cache[num_stages] = costs_from_micro_batches(micro_batches, cost_model, num_stages,
                                                         model_spec, dtype_bytes)
        return cache[num_stages]
    return for_stages
