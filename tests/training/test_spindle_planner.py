"""Spindle planner: contraction, estimator fit, allocator optimality against brute force,
wavefront scheduler and the wave-plan checker."""
import dataclasses
import itertools
import random

import pytest

from dynapipe_ext.plan.plan_checker import PlanError
from dynapipe_ext.spindle.allocator import allocate, allocate_lanes, relaxed_common_time
from dynapipe_ext.spindle.checker import check_wave_plan
from dynapipe_ext.spindle.configs import CONFIGS, FULL_RECOMPUTE, simulated_estimator
from dynapipe_ext.spindle.contraction import MetaOp, contract, metalevels
from dynapipe_ext.spindle.estimator import CommModel, Estimator, LayerFit, fit_layer
from dynapipe_ext.spindle.model import Component, MTModel, Task, TaskStep
from dynapipe_ext.spindle.scheduler import Cluster, plan, spindle_plan

GiB = 2**30


def _toy(same_kind_backbone: bool = False) -> MTModel:
    comps = (Component("img", "encoder", "vit", 3, 100, 8),
             Component("txt", "encoder", "tf", 2, 100, 8),
             Component("mid", "backbone", "vit" if same_kind_backbone else "tf", 4, 100, 8),
             Component("cls", "head", "head", 1, 10, 4))
    tasks = (Task("a", 8, (TaskStep("img", 16), TaskStep("mid", 16, ("img",)),
                           TaskStep("cls", 1, ("mid",)))),
             Task("b", 4, (TaskStep("txt", 32), TaskStep("img", 16),
                           TaskStep("mid", 32, ("txt", "img")), TaskStep("cls", 1, ("mid",)))))
    return MTModel(comps, tasks)


def test_contraction_makes_one_metaop_per_component_chain_with_levels():
    ops = contract(_toy(), batch_tasks=False)
    names = sorted(m.name for m in ops)
    assert names == ["a:cls", "a:img", "a:mid", "b:cls", "b:img", "b:mid", "b:txt"]
    by = {m.name: m for m in ops}
    assert by["a:img"].layers == 3 and by["b:mid"].layers == 4
    assert by["a:mid"].tokens == 8 * 16 and by["b:mid"].samples == 4
    assert {by[by["b:mid"].name].preds} == {tuple(sorted((by["b:txt"].id, by["b:img"].id)))}
    assert [m.level for m in (by["b:txt"], by["b:mid"], by["b:cls"])] == [0, 1, 2]
    assert all(p < m.id for m in ops for p in m.preds)          # ids are topological
    assert [len(level) for level in metalevels(ops)] == [3, 2, 2]


def test_contraction_joins_components_of_same_kind_and_workload():
    ops = contract(_toy(same_kind_backbone=True), batch_tasks=False)
    by = {m.name: m for m in ops}
    # task a: img (vit, 16 tokens) feeds only mid (vit, 16 tokens): one chain of 7 layers
    assert by["a:img+mid"].layers == 7 and by["a:img+mid"].components == ("img", "mid")
    # task b: mid has two inputs, so it starts a MetaOp of its own
    assert "b:mid" in by and by["b:img"].layers == 3


def test_batching_merges_same_shape_metaops_of_different_tasks():
    ops = contract(_toy())
    img = [m for m in ops if m.components == ("img",)]
    assert len(img) == 1 and img[0].tasks == ("a", "b") and img[0].samples == 12
    assert img[0].sample_keys()[8] == ("b", 0)
    cls = [m for m in ops if m.components == ("cls",)]
    assert len(cls) == 1 and set(cls[0].preds) == {m.id for m in ops if m.components == ("mid",)}


def test_ragged_batching_merges_a_shared_component_across_levels():
    ops = contract(_toy(), ragged=True)
    mid = [m for m in ops if m.components == ("mid",)]
    assert len(mid) == 1 and sorted(mid[0].tasks) == ["a", "b"]
    assert mid[0].tokens == 8 * 16 + 4 * 32
    assert all(p < m.id for m in ops for p in m.preds)
    assert len(contract(_toy())) > len(ops)


def test_model_rejects_bad_descriptions_with_names():
    comp = Component("e", "encoder", "k", 1, 1, 1)
    with pytest.raises(ValueError, match="task 't', step 0: unknown component 'x'"):
        MTModel((comp,), (Task("t", 1, (TaskStep("x", 4),)),))
    with pytest.raises(ValueError, match="input 'f' is not an earlier step"):
        MTModel((comp,), (Task("t", 1, (TaskStep("e", 4, ("f",)),)),))
    with pytest.raises(ValueError, match="role"):
        Component("e", "decoder", "k", 1, 1, 1)


def test_fit_layer_recovers_overhead_and_slope():
    fit = fit_layer([(t, 0.002 + 1e-6 * t) for t in (100, 1000, 5000)])
    assert fit.overhead_s == pytest.approx(0.002) and fit.per_token_s == pytest.approx(1e-6)
    with pytest.raises(ValueError, match="two or more token counts"):
        fit_layer([(10, 1.0)])


def _op(i, layers, samples, tokens, kind="k"):
    return MetaOp(i, (f"t{i}",), (samples,), kind, (f"c{i}",), layers, samples, tokens,
                  1, 1, (), 0)


def _est(overhead, per_token):
    return Estimator({"k": LayerFit(overhead, per_token)}, CommModel(1e-5, 1e-9))


def test_relaxed_common_time_is_total_work_over_devices_without_overhead():
    est = _est(0.0, 1e-3)
    ops = [_op(0, 2, 64, 6400), _op(1, 1, 64, 3200), _op(2, 3, 64, 640)]
    c, shares = relaxed_common_time(ops, est, 8)
    work = sum(est.time(m, 1) for m in ops)
    assert c == pytest.approx(work / 8, rel=1e-6)
    assert sum(shares.values()) == pytest.approx(8, rel=1e-6)


@pytest.mark.parametrize("seed", range(12))
def test_integer_allocation_matches_brute_force(seed):
    rng = random.Random(seed)
    est = _est(rng.uniform(0, 0.01), rng.uniform(1e-6, 1e-4))
    n_ops = rng.randint(1, 4)
    devices = rng.randint(n_ops, 7)
    ops = [_op(i, rng.randint(1, 6), rng.randint(1, 9), 0) for i in range(n_ops)]
    ops = [dataclasses.replace(m, tokens=m.samples * rng.randint(10, 3000)) for m in ops]
    counts, time = allocate_lanes([[m] for m in ops], est, devices)
    best = min(max(est.time(m, k) for m, k in zip(ops, ks))
               for ks in itertools.product(range(1, devices + 1), repeat=n_ops)
               if sum(ks) <= devices)
    assert time == pytest.approx(best)
    assert sum(counts) <= devices
    alloc = allocate(ops, est, devices)
    assert alloc.relaxed <= best * (1 + 1e-9)          # C* bounds every integer allocation
    assert alloc.relaxed <= alloc.time * (1 + 1e-9)
    assert alloc.time <= best * (1 + 1e-9)             # lanes never do worse than singletons


def _partitions(items):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _partitions(rest):
        yield [[first]] + part
        for i in range(len(part)):
            yield part[:i] + [[first] + part[i]] + part[i + 1:]


@pytest.mark.parametrize("overhead", [0.0, 0.5, 3.0])
def test_lanes_let_more_metaops_than_devices_share_a_wave_optimally(overhead):
    est = _est(overhead, 1e-3)
    big = _op(0, 1, 63, 63_000)
    smalls = [_op(i, 1, 4, 40 * i) for i in range(1, 5)]
    alloc = allocate([big] + smalls, est, 4)       # five MetaOps, four devices
    assert sorted(i for lane in alloc.lanes for i in lane) == [0, 1, 2, 3, 4]
    best = min(allocate_lanes(lanes, est, 4)[1] for lanes in _partitions([big] + smalls)
               if len(lanes) <= 4)
    assert alloc.time == pytest.approx(best)
    assert alloc.relaxed <= alloc.time


def _plans():
    for name, make in CONFIGS.items():
        model = make()
        est = simulated_estimator(model, full_recompute=name in FULL_RECOMPUTE)
        for n in (8, 16, 32, 64):
            for strategy in ("spindle", "uniform", "sequential"):
                yield name, n, strategy, plan(strategy, model, est, Cluster(n, 80 * GiB))


def test_checker_accepts_every_plan_and_spindle_beats_sequential():
    times = {}
    for name, n, strategy, p in _plans():
        check_wave_plan(p)
        times[name, n, strategy] = p.iteration_s
        assert p.relaxed_s <= p.compute_s * (1 + 1e-9)
    for (name, n, strategy), t in times.items():
        if strategy == "spindle":
            assert t < times[name, n, "sequential"], (name, n)


def test_scheduler_respects_dependencies_and_checker_catches_violations():
    model = CONFIGS["ofa-multitask"]()
    est = simulated_estimator(model)
    p = spindle_plan(model, est, Cluster(8, 80 * GiB))
    check_wave_plan(p)
    wave_of = {q.op: w for w, wave in enumerate(p.waves) for q in wave.placed}
    assert all(wave_of[d] < wave_of[m.id] for m in p.metaops for d in m.preds)
    swapped = dataclasses.replace(p, waves=(p.waves[1], p.waves[0]) + p.waves[2:])
    with pytest.raises(PlanError, match="not before"):
        check_wave_plan(swapped)
    wave = p.waves[0]
    a, b = wave.placed[0], wave.placed[1]
    clash = dataclasses.replace(b, devices=a.devices[:1], start_s=a.start_s)
    bad = dataclasses.replace(p, waves=(dataclasses.replace(
        wave, placed=(a, clash) + wave.placed[2:]),) + p.waves[1:])
    with pytest.raises(PlanError, match="overlap"):
        check_wave_plan(bad)
    with pytest.raises(PlanError, match="needs .* GiB"):
        check_wave_plan(dataclasses.replace(p, memory_bytes=1.0))
    with pytest.raises(PlanError, match="never run"):
        check_wave_plan(dataclasses.replace(p, waves=p.waves[:-1]))


def _random_model(rng: random.Random) -> MTModel:
    kinds = ["k0", "k1", "k2"]
    encs = [Component(f"enc{i}", "encoder", rng.choice(kinds), rng.randint(1, 4),
                      rng.randint(10, 10_000), rng.choice([8, 16])) for i in range(3)]
    backbone = Component("bb", "backbone", rng.choice(kinds), rng.randint(1, 6), 5000, 16)
    heads = [Component(f"head{i}", "head", "h", 1, 100, 4) for i in range(2)]
    tasks = []
    for t in range(rng.randint(1, 5)):
        enc = rng.choice(encs)
        seq = rng.choice([4, 8, 16])
        steps = [TaskStep(enc.name, seq)]
        if rng.random() < 0.8:
            steps.append(TaskStep("bb", rng.choice([seq, 2 * seq]), (enc.name,)))
        steps.append(TaskStep(rng.choice(heads).name, 1, (steps[-1].component,)))
        tasks.append(Task(f"t{t}", rng.randint(1, 12), tuple(steps)))
    return MTModel(tuple(encs) + (backbone,) + tuple(heads), tuple(tasks))


@pytest.mark.parametrize("seed", range(12))
def test_every_plan_of_random_models_passes_the_checker(seed):
    rng = random.Random(seed)
    model = _random_model(rng)
    fits = {k: LayerFit(rng.uniform(0, 1e-3), rng.uniform(1e-7, 1e-5))
            for k in ("k0", "k1", "k2", "h")}
    est = Estimator(fits, CommModel(1e-5, 1e-9))
    for n in (1, 2, 3, 5, 8):
        for strategy in ("spindle", "uniform", "sequential"):
            p = plan(strategy, model, est, Cluster(n, 64 * GiB))
            check_wave_plan(p)
            done = [q.op for w in p.waves for q in w.placed]
            assert sorted(done) == sorted(m.id for m in p.metaops)
            samples = {(t, i) for m in p.metaops for t, i in m.sample_keys()}
            assert samples == {(t.name, i) for t in model.tasks for i in range(t.batch_size)}


def test_placement_keeps_heavy_flows_local_and_balances_memory():
    from dynapipe_ext.spindle.scheduler import _place, handover_s
    est = _est(1e-3, 1e-6)
    light = dataclasses.replace(_op(0, 1, 8, 80), out_width=1)
    heavy = dataclasses.replace(_op(1, 1, 8, 8000), out_width=64)
    by_id = {0: light, 1: heavy}
    placed = {0: (0, 1), 1: (4, 5)}
    use_light = dataclasses.replace(_op(2, 1, 8, 80), preds=(0,), tasks=("t0",))
    use_heavy = dataclasses.replace(_op(3, 1, 8, 8000), preds=(1,), tasks=("t1",))
    by_id.update({2: use_light, 3: use_heavy})
    memory = [0.0] * 8
    devices = _place([[use_light], [use_heavy]], [2, 2], placed, by_id, memory, est)
    assert devices == [(0, 1), (4, 5)]                  # each consumer on its producer's devices
    assert handover_s(use_heavy, devices[1], placed, by_id, est) == 0.0
    assert handover_s(use_heavy, (2, 3), placed, by_id, est) > 0.0
    memory = [5.0, 0.0, 3.0, 1.0]
    fresh = _op(4, 1, 8, 80)
    assert _place([[fresh]], [2], {}, {4: fresh}, memory, est) == [(1, 3)]   # least memory


def test_runtime_sample_ranges_follow_the_planner_split():
    from megatron.spindle.runtime import task_ranges
    merged = MetaOp(0, ("a", "b"), (3, 4), "k", ("c",), 1, 7, 70, 1, 1, (), 0)
    ranges = task_ranges(merged, (5, 2))
    assert ranges == {5: {"a": (0, 3), "b": (0, 1)}, 2: {"b": (1, 4)}}


def test_component_devices_and_summary_show_the_placement():
    from dynapipe_ext.spindle.scheduler import component_devices, plan_summary
    model = _toy()
    est = Estimator({c.layer_kind: LayerFit(2e-3, 1e-6) for c in model.components},
                    CommModel(1e-5, 1e-9))
    uniform = plan("uniform", model, est, Cluster(2, GiB))
    assert component_devices(uniform) == {c.name: (0, 1) for c in model.components}
    p = plan("spindle", model, est, Cluster(4, GiB))
    held = component_devices(p)
    by_id = {m.id: m for m in p.metaops}
    for w in p.waves:
        for pl in w.placed:
            for comp in by_id[pl.op].components:
                assert set(pl.devices) <= set(held[comp])
    lines = plan_summary(p)
    assert lines[0].startswith(f"spindle: {len(p.metaops)} MetaOps in {len(p.waves)} waves")
    assert sum(line.startswith("  wave ") for line in lines) == len(p.waves)
    for d in range(4):
        comps = sorted(c for c, devs in held.items() if d in devs)
        assert f"  device {d} holds: {', '.join(comps) or 'nothing'}" in lines


def test_lower_bound_is_below_every_plan_and_overlap_only_hides_reductions():
    """The global bound (work / N, critical path) is below every strategy's wave compute; the
    overlapped iteration is at least the waves and at most waves + every reduction after
    them, and strictly below that where a component finishes its backward early."""
    from dynapipe_ext.spindle.scheduler import lower_bound_s
    hidden = 0
    for name, n, strategy, p in _plans():
        model = CONFIGS[name]()
        est = simulated_estimator(model, full_recompute=name in FULL_RECOMPUTE)
        work, path = lower_bound_s(model, est, n)
        assert 0 < max(work, path) <= p.compute_s * (1 + 1e-9), (name, n, strategy)
        waves = sum(w.time_s for w in p.waves)
        assert waves <= p.overlapped_s <= p.iteration_s * (1 + 1e-9), (name, n, strategy)
        hidden += p.overlapped_s < p.iteration_s * (1 - 1e-6)
    assert hidden > 0


def test_overlapped_reduction_starts_after_the_components_last_backward():
    """Two chained one-layer components on one wave each, two devices: the encoder's
    reduction can only start after the backward of wave 0 (the end), the head's after the
    backward of wave 1, overlapping wave 0's backward."""
    from dynapipe_ext.spindle.scheduler import BACKWARD_SHARE, uniform_plan
    comps = (Component("enc", "encoder", "e", 1, 1000, 8), Component("head", "head", "h", 1,
                                                                      1000, 4))
    model = MTModel(comps, (Task("t", 4, (TaskStep("enc", 8), TaskStep("head", 8, ("enc",)))),))
    comm = CommModel(1e-3, 0.0)             # every all-reduce over 2 devices: 2 ms
    est = Estimator({"e": LayerFit(0.01, 1e-9), "h": LayerFit(0.01, 1e-9)}, comm)
    p = uniform_plan(model, est, Cluster(2, GiB))
    t0, t1 = (w.time_s for w in p.waves)
    reduce = comm.allreduce(4000, 2)
    assert p.sync_s == pytest.approx(2 * reduce)
    head_ready = (1 - BACKWARD_SHARE) * (t0 + t1) + BACKWARD_SHARE * t1
    assert head_ready + reduce < t0 + t1           # hidden behind wave 0's backward
    assert p.overlapped_s == pytest.approx(t0 + t1 + reduce)
    assert p.iteration_s == pytest.approx(t0 + t1 + 2 * reduce)


def test_planner_refuses_a_component_larger_than_one_device_naming_it():
    """Components run data-parallel only: one whose weights, gradients and sharded optimizer
    state cannot fit one device is refused by every strategy with its name and memory."""
    from dynapipe_ext.spindle.scheduler import ComponentTooLarge, component_memory_bytes
    model = CONFIGS["vision-audio-llm"]()
    est = simulated_estimator(model, full_recompute=True)
    need = component_memory_bytes(model, "llm", est, 8)
    assert need > 40 * GiB                               # a 6.4B-parameter backbone
    for strategy in ("spindle", "uniform", "sequential"):
        with pytest.raises(ComponentTooLarge, match=r"component 'llm' needs \d+\.\d\d GiB"):
            plan(strategy, model, est, Cluster(8, 40 * GiB))
    check_wave_plan(plan("spindle", model, est, Cluster(8, 80 * GiB)))
