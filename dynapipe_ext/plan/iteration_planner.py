"""One call from a global batch to every rank's execution plan:

    lengths -> micro-batch split (planners) -> per data-parallel replica: schedule search
    -> lowering -> (plan checker) -> serialised ExecutionPlan bytes per (dp_rank, pp_rank)

`plan_iteration(iteration, lengths, config)` is pure and deterministic (same inputs, byte-identical
plans), and `config` is a picklable value, so planner worker processes can run it.

Stage layout is fixed for a run. The trainer builds its stage modules once, so every plan of a
run must lay stages on ranks the same way: `pipeline_layout(config)` says how, and the search
only considers schedules of that layout:
* "1f1b", "adaptive": P stages, stage s on pipeline rank s;
* "interleaved": Megatron's virtual pipeline, v*P stages, stage s on rank s mod P
  (`virtual_stages` = v, default 2);
* "wave": Hanayo's W-wave layout, 2*W*P stages (`waves`, default 1);
* "auto": one of those layouts (`auto_layout`: "linear", "interleaved" or "wave"; chosen for
  the run by `choose_auto_layout` from a batch's predicted iteration time), and per replica
  and iteration the fastest fitting schedule on it: 1F1B or adaptive on the linear layout,
  interleaved or adaptive (greedy_order on that layout) on the interleaved one, Hanayo's
  wave or adaptive on the wave one.

Samples reach the data-parallel replicas one of two ways (`replica_split`):
* "micro-batches" (default): the micro-batch DP over the whole batch, then its micro-batches
  split over the replicas (replica_split.balanced_partition). Best balance, but the DP, which
  dominates planning time and grows faster than the batch, is global wherever it runs.
* "samples": the samples are dealt to the replicas first (replica_split.deal_samples: cheap,
  deterministic), then each replica's micro-batch DP, schedule search (and memory retries),
  lowering and check run on that replica alone. Work per replica is O(samples / DP), so the
  plans of a replica can be made on its own node (`plan_iteration(..., replicas=...)`).
Either way, the plans of a replica do not depend on which replicas one call plans.

`forward_only=True` plans evaluation: the same split and candidate schedules, with every
backward dropped (schedule_ir.forward_only) before the search picks the fastest candidate that
fits; memory is then that of forwards alone, and the plans hold no backward or gradient
transfer. The split itself still fits the training memory rule, which is stricter.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from dynapipe_ext.costs.cost_model import CostModel, RankCostModel
from dynapipe_ext.plan.lowering import DTYPES, lower
from dynapipe_ext.batching.microbatch import BatchPlan
from dynapipe_ext.costs.model_spec import ModelSpec
from dynapipe_ext.batching.planners import (STRATEGIES, PlannerConfig, PlanningError, memory_limit_of,
                       plan_micro_batches)
from dynapipe_ext.batching.replica_split import deal_samples
from dynapipe_ext.schedule.registry import (LAYOUT_NAMES, SCHEDULE_NAMES, auto_candidates,
                                            layout_of, layout_stages)
from dynapipe_ext.schedule.schedule_search import (best_candidate, evaluate_candidates, forward_only_candidates,
                              micro_batch_costs)
from dynapipe_ext.schedule.schedules import MemoryLimitError
from dynapipe_ext.schedule.simulator import CommModel

PIPELINE_SCHEDULES = ("auto",) + SCHEDULE_NAMES
AUTO_LAYOUTS = LAYOUT_NAMES
REPLICA_SPLITS = ("micro-batches", "samples")
COST_MODEL_KINDS = ("analytic", "profile")
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
MEMORY_RETRIES = 6     # re-splits under a lower memory limit before giving up


@dataclass(frozen=True)
class CostModelSource:
    """How to (re)build the cost model in any process: "analytic" (AnalyticCostModel with
    `options` as keyword arguments) or "profile" (the cost profile file at `path`, read into a
    ProfiledCostModel with `options`). `options` is a tuple of (name, value) pairs so the
    source stays hashable."""

    kind: str = "analytic"
    path: str = ""
    options: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self):
        if self.kind not in COST_MODEL_KINDS:
            raise ValueError(f"cost model kind must be one of {COST_MODEL_KINDS}, "
                             f"got {self.kind!r}")
        if self.kind == "profile" and not self.path:
            raise ValueError("a 'profile' cost model needs the profile file's path")
        object.__setattr__(self, "options", tuple(sorted(dict(self.options).items())))

    @classmethod
    def analytic(cls, **options) -> "CostModelSource":
        return cls("analytic", "", tuple(options.items()))

    @classmethod
    def profile(cls, path: str, **options) -> "CostModelSource":
        return cls("profile", str(path), tuple(options.items()))


@functools.lru_cache(maxsize=8)
def build_cost_model(source: CostModelSource, spec: ModelSpec, tp: int,
                     num_stages: int) -> CostModel:
    """The cost model `source` describes (built once per process and argument set)."""
    options = dict(source.options)
    if source.kind == "analytic":
        from dynapipe_ext.costs.cost_model import AnalyticCostModel
        return AnalyticCostModel(spec, tp=tp, num_stages=num_stages, **options)
    from dynapipe_ext.costs.cost_profile import ProfiledCostModel, load_profile
    profile = load_profile(source.path)
    if profile.key.get("tensor_model_parallel_size", tp) != tp:
        raise ValueError(f"{source.path}: cost profile was measured at tensor-parallel size "
                         f"{profile.key['tensor_model_parallel_size']}, this run uses {tp}")
    try:   # the run's spec: tied embeddings and the pipeline cut are not in a profile's key
        return ProfiledCostModel(profile, num_stages=num_stages, spec=spec, **options)
    except ValueError as err:
        raise ValueError(f"{source.path}: {err}") from None


@dataclass(frozen=True)
class IterationPlannerConfig:
    """Everything `plan_iteration` needs, fixed for a run. `planner.pipeline_stages` must be
    `pp` and `planner.data_parallel` must be `dp`: the split is costed on P stages whatever the
    layout (a wave rank computes 1/P of the model per micro-batch too). `comm` (None: free
    transfers) times pipeline transfers in the simulations that pick and order the schedule."""

    spec: ModelSpec
    planner: PlannerConfig
    micro_batching: str = "dynamic"
    pipeline_schedule: str = "auto"
    pp: int = 1
    dp: int = 1
    tp: int = 1
    cost_model: CostModelSource = field(default_factory=CostModelSource)
    dtype: str = "float32"
    check_plans: bool = False
    waves: int = 1                    # --pipeline-waves: W of the wave layout
    virtual_stages: int = 2           # --num-virtual-stages-per-pipeline-rank: v, interleaved
    auto_layout: str = "linear"       # the layout "auto" runs on (choose_auto_layout)
    recv_lookahead: int = 1
    comm: CommModel | None = None     # pipeline transfer time in the schedule search
    replica_split: str = "micro-batches"   # see the module docstring
    forward_only: bool = False        # evaluation plans: forwards only, no backward

    def __post_init__(self):
        problems = []
        if self.replica_split not in REPLICA_SPLITS:
            problems.append(f"replica_split must be one of {REPLICA_SPLITS}, "
                            f"got {self.replica_split!r}")
        if self.micro_batching not in STRATEGIES:
            problems.append(f"micro_batching must be one of {sorted(STRATEGIES)}, "
                            f"got {self.micro_batching!r}")
        if self.pipeline_schedule not in PIPELINE_SCHEDULES:
            problems.append(f"pipeline_schedule must be one of {PIPELINE_SCHEDULES}, "
                            f"got {self.pipeline_schedule!r}")
        if self.auto_layout not in AUTO_LAYOUTS:
            problems.append(f"auto_layout must be one of {AUTO_LAYOUTS}, "
                            f"got {self.auto_layout!r}")
        for name in ("pp", "dp", "tp", "waves", "virtual_stages"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.dtype not in DTYPES:
            problems.append(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.planner.model != self.spec.model:
            problems.append(f"planner.model {self.planner.model!r} is not the model "
                            f"{self.spec.model!r}")
        if self.planner.pipeline_stages != self.pp:
            problems.append(f"planner.pipeline_stages {self.planner.pipeline_stages} must equal "
                            f"pp {self.pp}")
        if self.planner.data_parallel != self.dp:
            problems.append(f"planner.data_parallel {self.planner.data_parallel} must equal "
                            f"dp {self.dp}")
        if not problems:
            try:
                self.spec.stage_layers(len(pipeline_layout(self)))
            except ValueError as err:
                problems.append(f"pipeline_schedule {self.pipeline_schedule!r}: {err}")
        if problems:
            raise ValueError("IterationPlannerConfig: " + "; ".join(problems))


def pipeline_layout(config: IterationPlannerConfig) -> tuple[int, ...]:
    """Stage -> pipeline rank for the whole run (the trainer builds its stages from this)."""
    return stage_layout(config.pipeline_schedule, config.pp, config.waves, config.virtual_stages,
                        config.auto_layout)


def stage_layout(pipeline_schedule: str, pp: int, waves: int = 1, virtual_stages: int = 2,
                 auto_layout: str = "linear") -> tuple[int, ...]:
    """Stage -> pipeline rank of a run of `pipeline_schedule` (registry: the layout it is
    declared on; 'auto': `auto_layout`)."""
    return layout_stages(layout_of(pipeline_schedule, auto_layout), pp, waves, virtual_stages)


def schedule_candidates(config: IterationPlannerConfig) -> tuple[str, ...]:
    """The schedules the search may pick from; all share `pipeline_layout(config)`."""
    if config.pipeline_schedule != "auto":
        return (config.pipeline_schedule,)
    return auto_candidates(config.auto_layout)


def choose_auto_layout(config: IterationPlannerConfig, lengths) -> IterationPlannerConfig:
    """For "auto" at PP > 1: the config on the layout ("linear", "interleaved" with
    `virtual_stages`, "wave" with `waves`) whose best candidate is predicted fastest for the
    global batch `lengths` (one the model splits into; ties keep the earlier of linear,
    interleaved, wave). The layout is fixed for a run because the trainer builds its stage
    modules once; schedules are still picked per iteration on it. Other configs unchanged."""
    if config.pipeline_schedule != "auto" or config.pp == 1:
        return config
    best, why = None, []
    for family in AUTO_LAYOUTS:
        try:     # a layout the model does not split into fails here
            trial = replace(config, auto_layout=family)
            plan = plan_iteration(0, lengths, replace(trial, check_plans=False))
        except (ValueError, MemoryLimitError, PlanningError) as err:
            why.append(f"{family}: {err}")
            continue
        predicted = max(plan.predicted_ms)
        if best is None or predicted < best[0]:
            best = (predicted, trial)
    if best is None:
        raise MemoryLimitError("--pipeline-schedule auto: no layout can run the first batch ("
                               + "; ".join(why) + ")")
    return best[1]


def search_memory_limit(cost_model: CostModel, config: IterationPlannerConfig) -> float:
    """Activation bytes per device for the schedule search, under the run's stage layout."""
    if config.planner.memory_limit_bytes is not None:
        return float(config.planner.memory_limit_bytes)
    layout = pipeline_layout(config)
    return float(cost_model.activation_memory_limit(num_stages=len(layout), stage_to_rank=layout))


@dataclass(frozen=True)
class IterationPlan:
    """The plans of one iteration, for the data-parallel replicas `replicas` (all of them
    unless planned per node). `plan_bytes[(dp_rank, pp_rank)]` is that rank's serialised
    ExecutionPlan; `batch_plan.replicas`, `schedules` and `predicted_ms` (simulated makespan)
    follow `replicas`; `timings_ms` how long planning took (split, schedule, lower_check,
    total; cpu: CPU time of this process, which a loaded machine does not inflate)."""

    iteration: int
    batch_plan: BatchPlan
    plan_bytes: dict
    schedules: tuple[str, ...]
    predicted_ms: tuple[float, ...]
    timings_ms: dict = field(default_factory=dict, compare=False)
    replicas: tuple[int, ...] = ()


@dataclass(frozen=True)
class ReplicaSchedule:
    """The schedule picked for one data-parallel replica, with its simulation."""

    schedule: Any
    result: Any


def split_that_runs(lengths, config: IterationPlannerConfig, cost_model: CostModel,
                    memory_limit: float, timings_ms: dict | None = None
                    ) -> tuple[BatchPlan, list[ReplicaSchedule]]:
    """The micro-batch split and, per replica, the fastest candidate schedule whose simulated
    peak fits `memory_limit`. The split's per-micro-batch memory rule (cost_model.memory_needed)
    is not a bound for a mix of micro-batches, so the simulator decides: when no candidate fits
    some replica, the split is made again under a limit lowered by the smallest overshoot, up
    to MEMORY_RETRIES times; then MemoryLimitError. Never returns a split that no candidate
    schedule can run. `timings_ms` (if given) gains the time spent splitting ("split") and
    searching schedules ("schedule"), retries included."""
    timings_ms = {} if timings_ms is None else timings_ms
    timings_ms.update(split=0.0, schedule=0.0)
    # the split's makespan model knows the layout's chunks per rank (a smaller bubble term)
    layout = pipeline_layout(config)
    planner = replace(config.planner, stage_chunks=len(layout) // config.pp)
    # the split prices one stage per pipeline rank: on a layout of more stages than ranks,
    # each rank's stages together (whatever the pipeline cut)
    split_costs = cost_model if len(layout) == config.pp else RankCostModel(cost_model, layout)
    candidates = schedule_candidates(config)
    dtype_bytes = _DTYPE_BYTES[config.dtype]
    retries = []
    while True:
        t0 = time.perf_counter()
        try:
            batch = plan_micro_batches(lengths, planner, split_costs, config.micro_batching)
        except PlanningError as err:
            if not retries:
                raise
            raise MemoryLimitError(f"no candidate schedule fit the split within "
                                   f"{memory_limit:.4g} bytes, and under the lowered split "
                                   f"limit {retries[-1]:.4g}: {err}") from err
        t1 = time.perf_counter()
        timings_ms["split"] += (t1 - t0) * 1e3
        picked, overshoot = [], 0.0
        for dp_rank, micro_batches in enumerate(batch.replicas):
            costs = micro_batch_costs(micro_batches, cost_model, config.spec, dtype_bytes)
            found = evaluate_candidates(costs, memory_limit, config.pp, candidates, config.comm,
                                        waves=(config.waves,), chunks=(config.virtual_stages,),
                                        adaptive_layout=layout)
            if config.forward_only:
                found = forward_only_candidates(found, costs, config.comm)
            try:
                chosen = best_candidate(found, memory_limit)
            except MemoryLimitError as err:
                peaks = [c.result.max_peak_memory_bytes for c in found if c.result]
                if not peaks or len(retries) == MEMORY_RETRIES:
                    tried = f" (split limits tried: {retries})" if retries else ""
                    raise MemoryLimitError(f"data-parallel replica {dp_rank} "
                                           f"({len(micro_batches)} micro-batches): {err}"
                                           f"{tried}") from err
                overshoot = max(overshoot, min(peaks) - memory_limit)
                continue
            picked.append(ReplicaSchedule(chosen.schedule, chosen.result))
        timings_ms["schedule"] += (time.perf_counter() - t1) * 1e3
        if overshoot == 0.0:
            batch.info["memory_retries"] = retries
            return batch, picked
        split_limit = memory_limit_of(split_costs, planner) - overshoot
        if split_limit <= 0:
            raise MemoryLimitError(f"no split of this batch runs under any candidate schedule "
                                   f"within {memory_limit:.4g} bytes (split limits tried: "
                                   f"{retries})")
        retries.append(float(split_limit))
        planner = replace(planner, memory_limit_bytes=split_limit)


def _wanted_replicas(replicas, dp: int) -> tuple[int, ...]:
    if replicas is None:
        return tuple(range(dp))
    wanted = tuple(sorted(set(int(r) for r in replicas)))
    if not wanted or wanted[0] < 0 or wanted[-1] >= dp:
        raise ValueError(f"replicas to plan must be a non-empty subset of 0..{dp - 1}, "
                         f"got {list(replicas)}")
    return wanted


def _in_batch_ids(mb, ids: np.ndarray):
    """`mb` with its sample ids (indices into a replica's samples) mapped to batch indices."""
    return replace(mb, rows=tuple(tuple(int(ids[s]) for s in row) for row in mb.rows))


def split_per_replica(lengths, config: IterationPlannerConfig, cost_model: CostModel,
                      memory_limit: float, replicas: tuple[int, ...], timings_ms: dict
                      ) -> tuple[BatchPlan, list[ReplicaSchedule]]:
    """replica_split "samples": deal the samples (deal_samples), then `split_that_runs` on the
    samples of each replica in `replicas` alone (DP 1: its memory retries are its own).
    The BatchPlan holds those replicas, in that order, with batch sample ids."""
    arr = np.asarray(lengths)
    dealt = deal_samples(arr, config.dp)
    one = replace(config, dp=1, planner=replace(config.planner, data_parallel=1))
    timings_ms.update(split=0.0, schedule=0.0)
    parts, picked, retries, spans = [], [], {}, []
    for r in replicas:
        ids = dealt[r]
        own: dict = {}
        try:
            batch, chosen = split_that_runs(arr[ids], one, cost_model, memory_limit, own)
        except (MemoryLimitError, PlanningError) as err:
            raise type(err)(f"data-parallel replica {r} ({len(ids)} samples): {err}") from err
        for key in ("split", "schedule"):
            timings_ms[key] += own[key]
        parts.append(tuple(_in_batch_ids(mb, ids) for mb in batch.replicas[0]))
        picked.append(chosen[0])
        retries[r] = batch.info["memory_retries"]
        spans.append(batch.predicted_time_ms)
    info = dict(replica_split="samples", memory_retries=retries,
                num_micro_batches=sum(len(p) for p in parts),
                replica_imbalance=max(spans) / float(np.mean(spans)) if max(spans) > 0 else 1.0)
    return BatchPlan(config.micro_batching, tuple(parts), max(spans), info), picked


def plan_iteration(iteration: int, lengths, config: IterationPlannerConfig,
                   replicas=None, loss_tokens: int = 0) -> IterationPlan:
    """Plan one global batch (`lengths`: GPT (n,), T5 (n, 2)) into the plan bytes of every rank
    of the data-parallel `replicas` (None: all). A replica's bytes are the same whichever
    replicas one call plans; with replica_split "samples" only those replicas are planned.
    `loss_tokens` (the batch's, all replicas) travels in every plan (ExecutionPlan.loss_tokens)."""
    from dynapipe_ext.plan.plan_checker import check_plans
    from dynapipe_ext.plan.serialization import plan_to_bytes

    start, cpu_start = time.perf_counter(), time.process_time()
    wanted = _wanted_replicas(replicas, config.dp)
    cost_model = build_cost_model(config.cost_model, config.spec, config.tp, config.pp)
    memory_limit = search_memory_limit(cost_model, config)
    timings: dict = {}
    try:
        if config.replica_split == "samples":
            batch, picked = split_per_replica(lengths, config, cost_model, memory_limit, wanted,
                                              timings)
        else:
            batch, picked = split_that_runs(lengths, config, cost_model, memory_limit, timings)
            batch = replace(batch, replicas=tuple(batch.replicas[r] for r in wanted))
            picked = [picked[r] for r in wanted]
    except MemoryLimitError as err:
        raise MemoryLimitError(f"iteration {iteration}: {err}") from err
    split_done = time.perf_counter()
    plan_bytes: dict[tuple[int, int], bytes] = {}
    for dp_rank, micro_batches, chosen in zip(wanted, batch.replicas, picked):
        plans = lower(chosen.schedule, micro_batches, config.spec, config.dtype, iteration,
                      dp_rank, config.recv_lookahead, timing=chosen.result)
        if config.check_plans:
            check_plans(plans, config.spec, config.forward_only)
        for plan in plans:
            plan_bytes[(dp_rank, plan.pp_rank)] = plan_to_bytes(
                replace(plan, loss_tokens=int(loss_tokens)))
    total_s = time.perf_counter() - start
    timings.update(lower_check=(time.perf_counter() - split_done) * 1e3, total=total_s * 1e3,
                   cpu=(time.process_time() - cpu_start) * 1e3)
    return IterationPlan(iteration, batch, plan_bytes,
                         tuple(c.schedule.name for c in picked),
                         tuple(float(c.result.makespan_ms) for c in picked), timings, wanted)


@dataclass(frozen=True)
class GlobalBatch:
    """What the planner reads of one global batch: its lengths (GPT (n,), T5 (n, 2)) and the
    loss tokens of all its samples, which the plans carry to every rank."""

    lengths: Any
    loss_tokens: int


def plan_batch(iteration: int, batch, config: IterationPlannerConfig,
               replicas=None) -> IterationPlan:
    """plan_iteration of a GlobalBatch, or of bare lengths (no loss-token count)."""
    if isinstance(batch, GlobalBatch):
        return plan_iteration(iteration, batch.lengths, config, replicas, batch.loss_tokens)
    return plan_iteration(iteration, batch, config, replicas)


def iteration_plan_fn(config: IterationPlannerConfig, replicas=None):
    """`plan_fn(iteration, batch)` for PlanAhead (picklable; `batch` a GlobalBatch or
    lengths), planning `replicas` (None: all)."""
    return functools.partial(plan_batch, config=config, replicas=replicas)
