"""Wave plans: Spindle's greedy wavefront scheduler with device placement, and the two
baselines in the same form (uniform layout: every component over all devices, all tasks'
data together; sequential: each task over all devices, one after another).

A plan is a list of waves; in a wave every MetaOp runs data-parallel on its own devices, and
the wave ends when its slowest MetaOp does. Backward replays the waves in reverse on the same
devices, so the estimator's forward+backward times cover both. Each component's gradients
are all-reduced over the devices that ran it: `WavePlan.iteration_s` charges every reduction
after the waves, `WavePlan.overlapped_s` starts each as soon as the component's last backward
is done (the runtime's behaviour). `lower_bound_s` is a bound no plan can beat.""" 
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from .allocator import allocate
from .contraction import MetaOp, contract
from .estimator import Estimator
from .model import MTModel

STRATEGIES = ("spindle", "uniform", "sequential")


@dataclass(frozen=True)
class Cluster:
    """Homogeneous devices: how many and how much memory each."""
    num_devices: int
    memory_bytes: float

    def __post_init__(self):
        if self.num_devices < 1:
            raise ValueError(f"num_devices must be >= 1, got {self.num_devices}")


@dataclass(frozen=True)
class Placed:
    """One MetaOp in a wave: its devices (in sample-split order), when it starts within the
    wave (MetaOps of one lane share devices and run one after another), compute time T_m(n)
    and the time to receive its inputs from devices that produced them elsewhere."""
    op: int
    devices: tuple[int, ...]
    start_s: float
    compute_s: float
    handover_s: float

    @property
    def end_s(self) -> float:
        return self.start_s + self.compute_s + self.handover_s


@dataclass(frozen=True)
class Wave:
    placed: tuple[Placed, ...]
    relaxed_s: float          # C* of this wave's MetaOps (continuous relaxation)

    @property
    def time_s(self) -> float:
        return max(p.end_s for p in self.placed)

    @property
    def compute_s(self) -> float:
        """The wave's time without hand-over (what C* bounds)."""
        lanes: dict[tuple[int, ...], float] = {}
        for p in self.placed:
            lanes[p.devices] = lanes.get(p.devices, 0.0) + p.compute_s
        return max(lanes.values())


@dataclass(frozen=True)
class WavePlan:
    """A whole iteration: MetaOps, their waves, the closing gradient all-reduce time and the
    bytes each device holds (model state of the components it runs, kept activations)."""
    strategy: str
    num_devices: int
    memory_bytes: float
    metaops: tuple[MetaOp, ...]
    waves: tuple[Wave, ...]
    sync_s: float
    device_memory: tuple[int, ...] = field(default=())
    overlapped_s: float = 0.0     # iteration with each all-reduce overlapped (overlapped_iteration_s)

    @property
    def iteration_s(self) -> float:
        """Waves, then every gradient all-reduce after them (nothing overlapped)."""
        return sum(w.time_s for w in self.waves) + self.sync_s

    @property
    def relaxed_s(self) -> float:
        """Sum of the waves' C*: what the waves would take with real-valued device counts."""
        return sum(w.relaxed_s for w in self.waves)

    @property
    def compute_s(self) -> float:
        return sum(w.compute_s for w in self.waves)


def sample_split(samples: int, n: int) -> list[int]:
    """Samples per device when `samples` are split as evenly as possible over n devices (the
    first ones get the extra sample); the same rule the runtime uses."""
    return [samples // n + (1 if i < samples % n else 0) for i in range(n)]


def _owners(m: MetaOp, devices: Sequence[int]) -> dict[tuple[str, int], int]:
    """Device holding each (task, index) sample of m."""
    keys = m.sample_keys()
    out: dict[tuple[str, int], int] = {}
    start = 0
    for dev, k in zip(devices, sample_split(m.samples, len(devices))):
        out.update((key, dev) for key in keys[start:start + k])
        start += k
    return out


def handover_s(m: MetaOp, devices: Sequence[int], placed: dict[int, tuple[int, ...]],
               by_id: dict[int, MetaOp], est: Estimator) -> float:
    """Time for m's devices to receive the samples of its inputs that sit on other devices:
    the busiest receiver's bytes, forward activations plus backward gradients (x2)."""
    dst = _owners(m, devices)
    incoming = {d: 0.0 for d in devices}
    for p in m.preds:
        src = _owners(by_id[p], placed[p])
        per_sample = est.output_bytes(by_id[p]) / by_id[p].samples
        for key, s in src.items():
            d = dst.get(key)
            if d is not None and d != s:
                incoming[d] += per_sample
    worst = max(devices, key=lambda d: incoming[d])
    if incoming[worst] == 0:
        return 0.0
    return 2 * (est.comm.alpha_s + incoming[worst] * est.comm.beta_s_per_byte)


def _place(lanes: Sequence[Sequence[MetaOp]], counts: Sequence[int],
           placed: dict[int, tuple[int, ...]], by_id: dict[int, MetaOp], memory: list[float],
           est: Estimator) -> list[tuple[int, ...]]:
    """Devices for each lane of a wave: heaviest input flows first, each taking the free
    devices that hold most of its input bytes (keeps heavy flows local), ties broken by the
    least memory in use (balance), then device index."""
    free = set(range(len(memory)))
    chosen: list[tuple[int, ...]] = [()] * len(lanes)

    def inflow(i: int) -> float:
        return sum(est.output_bytes(by_id[p]) for m in lanes[i] for p in m.preds)

    for i in sorted(range(len(lanes)), key=lambda i: (-inflow(i), i)):
        local = {d: 0.0 for d in free}
        first_pred: tuple[int, ...] = ()
        for m in lanes[i]:
            for p in m.preds:
                first_pred = first_pred or placed[p]
                per_dev = est.output_bytes(by_id[p]) / len(placed[p])
                for d in placed[p]:
                    if d in local:
                        local[d] += per_dev
        pick = sorted(free, key=lambda d: (-local[d], memory[d], d))[:counts[i]]
        # keep a predecessor's sample order on the devices it shares with the lane
        pick.sort(key=lambda d: (first_pred.index(d) if d in first_pred else len(first_pred), d))
        chosen[i] = tuple(pick)
        free.difference_update(pick)
    return chosen


def _charge_activations(m: MetaOp, devices: Sequence[int], memory: list[float],
                        hosted: list[set[str]], model: MTModel, est: Estimator) -> None:
    """Kept activations of m, and the replicated model state of components new to a device."""
    for dev, k in zip(devices, sample_split(m.samples, len(devices))):
        memory[dev] += est.activation_bytes(m, k)
        for comp in m.components:
            if comp not in hosted[dev]:
                hosted[dev].add(comp)
                c = model.component(comp)
                memory[dev] += c.num_layers * c.params_per_layer * est.replicated_bytes_per_param


def _charge_sharded_state(memory: list[float], hosted: list[set[str]], model: MTModel,
                          est: Estimator) -> None:
    """Optimizer state of each component, sharded over the devices that use it (as Megatron's
    distributed optimizer shards it over its data-parallel group)."""
    for comp in {c for h in hosted for c in h}:
        users = [d for d, h in enumerate(hosted) if comp in h]
        c = model.component(comp)
        share = c.num_layers * c.params_per_layer * est.sharded_bytes_per_param / len(users)
        for d in users:
            memory[d] += share


BACKWARD_SHARE = 2 / 3     # of a MetaOp's forward + backward time (backward ~ 2x forward)


def _component_users(metaops: Sequence[MetaOp], waves: Sequence[Wave]
                     ) -> tuple[dict[str, set[int]], dict[str, int]]:
    """Devices that run each component, and the first wave that runs it (its backward there
    is the component's last)."""
    by_id = {m.id: m for m in metaops}
    users: dict[str, set[int]] = {}
    first: dict[str, int] = {}
    for w, wave in enumerate(waves):
        for p in wave.placed:
            for comp in by_id[p.op].components:
                users.setdefault(comp, set()).update(p.devices)
                first.setdefault(comp, w)
    return users, first


def _allreduce_s(model: MTModel, comp: str, n: int, est: Estimator) -> float:
    c = model.component(comp)
    return est.comm.allreduce(c.num_layers * c.params_per_layer * 4, n)   # fp32 gradients


def _reductions_end(model: MTModel, users: dict[str, set[int]], ready: dict[str, float],
                    num_devices: int, est: Estimator) -> float:
    """When the last gradient all-reduce ends. A reduction needs all its devices' links: they
    are issued in ready order (larger first on ties), each starting when it is ready and every
    one of its devices has finished its previous reduction."""
    link_free = [0.0] * num_devices
    end = 0.0
    costs = {c: _allreduce_s(model, c, len(users[c]), est) for c in users}
    for comp in sorted(users, key=lambda c: (ready[c], -costs[c], c)):
        if costs[comp] == 0:
            continue
        devs = sorted(users[comp])
        start = max([ready[comp]] + [link_free[d] for d in devs])
        for d in devs:
            link_free[d] = start + costs[comp]
        end = max(end, start + costs[comp])
    return end


def overlapped_iteration_s(model: MTModel, metaops: Sequence[MetaOp], waves: Sequence[Wave],
                           num_devices: int, est: Estimator) -> float:
    """Iteration time when each component's gradient all-reduce starts as soon as its last
    backward is done and overlaps the backward of later-replayed waves (what the runtime
    does: async all-reduce per component, waited for before the optimizer step).

    Timeline: forward of every wave (1 - BACKWARD_SHARE of each wave's time), then backward in
    reverse wave order; a component's reduction is ready when the backward of the first wave
    that runs it ends (wave granularity: never earlier than the runtime can start it); then
    as in `_reductions_end`. Compute is assumed not to slow down while a reduction runs."""
    times = [w.time_s for w in waves]
    t = (1 - BACKWARD_SHARE) * sum(times)
    done_backward = [0.0] * len(waves)
    for w in reversed(range(len(waves))):
        t += BACKWARD_SHARE * times[w]
        done_backward[w] = t
    users, first = _component_users(metaops, waves)
    ready = {c: done_backward[first[c]] for c in users}
    return max(t, _reductions_end(model, users, ready, num_devices, est))


def lower_bound_s(model: MTModel, est: Estimator, num_devices: int) -> tuple[float, float]:
    """Global lower bounds on an iteration's compute, whatever the plan: (total single-device
    work / N, critical path). Work: every component runs all its tokens at least once, and a
    MetaOp on n devices costs n x T(n) >= T(1) device-seconds, so each component costs at
    least layers x (overhead + per_token x its tokens of all tasks). Critical path: the
    longest chain of one task's steps, each at best layers x (overhead + per_token x the
    task's tokens at that step / N). Hand-over and all-reduce are left out (bound on compute)."""
    def fit(comp):
        c = model.component(comp)
        if c.layer_kind not in est.fits:
            raise KeyError(f"no profile fit for layer kind {c.layer_kind!r}")
        return c, est.fits[c.layer_kind]

    work = 0.0
    for comp in (c.name for c in model.components):
        tokens = sum(t.batch_size * s.seq_len for t in model.tasks for s in t.steps
                     if s.component == comp)
        if tokens:
            c, f = fit(comp)
            work += c.num_layers * (f.overhead_s + f.per_token_s * tokens)
    path = 0.0
    for task in model.tasks:
        finish: dict[str, float] = {}
        for step in task.steps:
            c, f = fit(step.component)
            own = c.num_layers * (f.overhead_s + f.per_token_s * task.batch_size
                                  * step.seq_len / num_devices)
            finish[step.component] = own + max((finish[i] for i in step.inputs), default=0.0)
        path = max(path, max(finish.values()))
    return work / num_devices, path


def gradient_sync_s(model: MTModel, metaops: Sequence[MetaOp], waves: Sequence[Wave],
                    num_devices: int, est: Estimator) -> float:
    """Time of every component's gradient all-reduce over the devices that ran it, all issued
    after the last wave (the same link rule as the overlapped case, `_reductions_end`)."""
    users, _ = _component_users(metaops, waves)
    return _reductions_end(model, users, dict.fromkeys(users, 0.0), num_devices, est)


def _build(strategy: str, model: MTModel, metaops: list[MetaOp], groups: list[list[MetaOp]],
           est: Estimator, cluster: Cluster) -> WavePlan:
    """Turn an ordered list of MetaOp groups (one per wave) into a placed, timed plan."""
    check_components_fit(model, est, cluster)
    by_id = {m.id: m for m in metaops}
    placed: dict[int, tuple[int, ...]] = {}
    memory = [0.0] * cluster.num_devices
    hosted: list[set[str]] = [set() for _ in range(cluster.num_devices)]
    waves = []
    for group in groups:
        alloc = allocate(group, est, cluster.num_devices)
        lanes = [[by_id[i] for i in lane] for lane in alloc.lanes]
        devices = _place(lanes, alloc.counts, placed, by_id, memory, est)
        items = []
        for lane, devs in zip(lanes, devices):
            start = 0.0
            for m in lane:
                item = Placed(m.id, devs, start, est.time(m, len(devs)),
                              handover_s(m, devs, placed, by_id, est))
                items.append(item)
                start = item.end_s
        for lane, devs in zip(lanes, devices):
            for m in lane:
                placed[m.id] = devs
                _charge_activations(m, devs, memory, hosted, model, est)
        waves.append(Wave(tuple(items), alloc.relaxed))
    _charge_sharded_state(memory, hosted, model, est)
    sync = gradient_sync_s(model, metaops, waves, cluster.num_devices, est)
    overlapped = overlapped_iteration_s(model, metaops, waves, cluster.num_devices, est)
    return WavePlan(strategy, cluster.num_devices, cluster.memory_bytes, tuple(metaops),
                    tuple(waves), sync, tuple(int(x) for x in memory), overlapped)


def _bottom_level(metaops: Sequence[MetaOp], est: Estimator, num_devices: int) -> dict[int, float]:
    """Longest remaining path (at full-cluster speed) from each MetaOp to the end of its task:
    the scheduler starts the longest chains first."""
    succs: dict[int, list[int]] = {m.id: [] for m in metaops}
    for m in metaops:
        for p in m.preds:
            succs[p].append(m.id)
    out: dict[int, float] = {}
    for m in sorted(metaops, key=lambda m: -m.id):       # ids are topological
        t = est.time(m, est.max_devices(m, num_devices))
        out[m.id] = t + max((out[s] for s in succs[m.id]), default=0.0)
    return out


def wavefront_groups(metaops: Sequence[MetaOp], est: Estimator, num_devices: int
                     ) -> list[list[MetaOp]]:
    """Greedy wavefront: each wave takes every MetaOp whose inputs are done (all tasks mixed);
    the allocator packs small ones into shared lanes."""
    rank = _bottom_level(metaops, est, num_devices)
    done: set[int] = set()
    groups = []
    while len(done) < len(metaops):
        ready = [m for m in metaops if m.id not in done and all(p in done for p in m.preds)]
        ready.sort(key=lambda m: (-rank[m.id], m.id))
        groups.append(ready)
        done.update(m.id for m in ready)
    return groups


def spindle_plan(model: MTModel, est: Estimator, cluster: Cluster) -> WavePlan:
    """Spindle: contracted MetaOps, wavefront groups, malleable allocation, placement. Two
    contractions are planned (same-shape batches only; also ragged batches of a component's
    data across tasks) and the faster plan is kept (all-reduce overlapped, as the runtime
    runs it)."""
    best = None
    for ragged in (False, True):
        metaops = contract(model, ragged=ragged)
        p = _build("spindle", model, metaops,
                   wavefront_groups(metaops, est, cluster.num_devices), est, cluster)
        if best is None or p.overlapped_s < best.overlapped_s:     # as the runtime runs it
            best = p
    return best


def sequential_plan(model: MTModel, est: Estimator, cluster: Cluster) -> WavePlan:
    """Baseline: tasks one after another, each MetaOp alone on all devices."""
    metaops = contract(model, batch_tasks=False)
    names = [t.name for t in model.tasks]
    order = sorted(metaops, key=lambda m: (names.index(m.tasks[0]), m.id))
    return _build("sequential", model, metaops, [[m] for m in order], est, cluster)


def uniform_plan(model: MTModel, est: Estimator, cluster: Cluster) -> WavePlan:
    """Baseline (Megatron-LM style): every component over all devices, all tasks' data through
    it at once, components one after another in dependency order."""
    order = _component_order(model)
    metaops = []
    for comp in order:
        c = model.component(comp)
        users = [(t, s) for t in model.tasks for s in t.steps if s.component == comp]
        preds = sorted({order.index(src) for _, s in users for src in s.inputs})
        metaops.append(MetaOp(
            id=len(metaops), tasks=tuple(t.name for t, _ in users),
            task_samples=tuple(t.batch_size for t, _ in users), kind=c.layer_kind,
            components=(comp,), layers=c.num_layers,
            samples=sum(t.batch_size for t, _ in users),
            tokens=sum(t.batch_size * s.seq_len for t, s in users),
            params=c.num_layers * c.params_per_layer, out_width=c.hidden_size,
            preds=tuple(preds), level=0))
    return _build("uniform", model, metaops, [[m] for m in metaops], est, cluster)


def _component_order(model: MTModel) -> list[str]:
    """Components in an order where every input of every task comes first."""
    deps: dict[str, set[str]] = {c.name: set() for c in model.components}
    for t in model.tasks:
        for s in t.steps:
            deps[s.component].update(s.inputs)
    order: list[str] = []
    while len(order) < len(deps):
        ready = [c.name for c in model.components
                 if c.name not in order and deps[c.name] <= set(order)]
        if not ready:
            raise ValueError("components depend on each other in a cycle")
        order += ready
    return [c for c in order if model.users(c)]


def component_devices(plan: WavePlan) -> dict[str, tuple[int, ...]]:
    """Devices that hold each component: every device of every MetaOp that runs it."""
    by_id = {m.id: m for m in plan.metaops}
    out: dict[str, set[int]] = {}
    for w in plan.waves:
        for p in w.placed:
            for comp in by_id[p.op].components:
                out.setdefault(comp, set()).update(p.devices)
    return {c: tuple(sorted(d)) for c, d in out.items()}


def plan_summary(plan: WavePlan) -> list[str]:
    """What a plan decided, one line each: per wave its MetaOps with devices (the allocation)
    and start times; then the components each device holds (the placement)."""
    by_id = {m.id: m for m in plan.metaops}
    lines = [f"{plan.strategy}: {len(plan.metaops)} MetaOps in {len(plan.waves)} waves on "
             f"{plan.num_devices} devices, predicted {plan.iteration_s * 1e3:.2f} ms"]
    for w, wave in enumerate(plan.waves):
        ops = ", ".join(f"{by_id[p.op].name} x{by_id[p.op].samples} on {list(p.devices)}"
                        f" @{p.start_s * 1e3:.2f}ms" for p in wave.placed)
        lines.append(f"  wave {w} ({wave.time_s * 1e3:.2f} ms): {ops}")
    held = component_devices(plan)
    for d in range(plan.num_devices):
        comps = sorted(c for c, devs in held.items() if d in devs)
        lines.append(f"  device {d} holds: {', '.join(comps) or 'nothing'}")
    return lines


class ComponentTooLarge(ValueError):
    """A component does not fit one device: Spindle splits components only data-parallel."""


def component_memory_bytes(model: MTModel, comp: str, est: Estimator, num_devices: int) -> int:
    """Least bytes one device needs to run `comp` at all: its replicated weights and gradients,
    its optimizer state sharded over every device, and the kept activations of one sample at
    its longest step (data parallelism cannot split below a sample)."""
    c = model.component(comp)
    params = c.num_layers * c.params_per_layer
    tokens = max((s.seq_len for t in model.tasks for s in t.steps if s.component == comp),
                 default=0)
    activations = est.activation_factor * c.num_layers * tokens * c.hidden_size * est.dtype_bytes
    return int(params * (est.replicated_bytes_per_param
                         + est.sharded_bytes_per_param / num_devices) + activations)


def check_components_fit(model: MTModel, est: Estimator, cluster: Cluster) -> None:
    """Refuse a model with a component larger than one device's memory, naming it: tensor or
    pipeline parallelism inside a component is not built, so no plan could run it."""
    for c in model.components:
        need = component_memory_bytes(model, c.name, est, cluster.num_devices)
        if need > cluster.memory_bytes:
            raise ComponentTooLarge(
                f"component {c.name!r} needs {need / 2**30:.2f} GiB on one device (weights and "
                f"gradients {c.num_layers * c.params_per_layer * est.replicated_bytes_per_param / 2**30:.2f} GiB, "
                f"optimizer state sharded over {cluster.num_devices} devices, one sample's "
                f"activations), a device has {cluster.memory_bytes / 2**30:.2f} GiB: Spindle "
                f"runs a component data-parallel only (no tensor or pipeline parallelism "
                f"inside a component)")


PLANNERS = {"spindle": spindle_plan, "uniform": uniform_plan, "sequential": sequential_plan}


def plan(strategy: str, model: MTModel, est: Estimator, cluster: Cluster) -> WavePlan:
    if strategy not in PLANNERS:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    return PLANNERS[strategy](model, est, cluster)


def compare(model: MTModel, est: Estimator, cluster: Cluster) -> dict[str, WavePlan]:
    """The three strategies' plans for one model and cluster (each checked by the caller)."""
    return {s: plan(s, model, est, cluster) for s in STRATEGIES}
