"""Spindle runtime on 2 gloo processes: two training steps executed from a Spindle wave plan
(and from both baselines' plans) give the loss and every gradient of a single-process run of
the same tasks, in fp32; each rank allocates only the components placed on it."""
import gc

import pytest

from tests.multiproc import run_in_processes

SEED = 11
STRATEGIES = ("spindle", "uniform", "sequential")


def _estimator(model):
    from dynapipe_ext.spindle.estimator import CommModel, Estimator, LayerFit
    # large per-layer overhead: small MetaOps stay on one rank, so the plan hands over
    return Estimator({c.layer_kind: LayerFit(2e-3, 1e-6) for c in model.components},
                     CommModel(1e-4, 1e-9), dtype_bytes=4)


def _parameter_bytes_alive() -> int:
    """Bytes of every torch Parameter alive in this process."""
    import torch
    gc.collect()
    return sum(o.numel() * o.element_size() for o in gc.get_objects()
               if isinstance(o, torch.nn.Parameter))


def _train_two_steps(strategy, rank, world_size, cfg, model) -> dict:
    """Two SGD steps under `strategy`'s plan next to the single-process reference. After each
    step the runtime's weights are compared with the reference's and then copied into it, so
    that each step's gradients are compared from the same weights: otherwise one step's fp32
    rounding (from summing the contrastive head's split batch in another order) reaches the
    next step's gradients through the weights, and those of the contrastive head are about
    1e-3 at the second step, sums of far larger terms (1.3e-5 of the tensor's largest without
    the copy, 3.5e-6 with it)."""
    import torch
    from dynapipe_ext.spindle.checker import check_wave_plan
    from dynapipe_ext.spindle.scheduler import Cluster, component_devices, plan
    from megatron.spindle.mt_model import (build_component, build_components, loss_normaliser,
                                           reference_step, task_data)
    from megatron.spindle.runtime import WaveRuntime
    p = plan(strategy, model, _estimator(model), Cluster(world_size, 2**30))
    check_wave_plan(p)
    before = _parameter_bytes_alive()
    runtime = WaveRuntime(p, model, lambda name: build_component(cfg, name, SEED),
                          lambda t: loss_normaliser(cfg, t), rank)
    alive = _parameter_bytes_alive() - before
    held = sorted(c for c, devs in component_devices(p).items() if rank in devs)
    planned = 4 * sum(model.component(c).num_layers * model.component(c).params_per_layer
                      for c in held)
    ref = build_components(cfg, SEED)
    opt = torch.optim.SGD(runtime.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    losses, worst, worst_weight, checked = [], 0.0, 0.0, 0
    for it in range(2):
        data = task_data(cfg, SEED, it)
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        loss = runtime.run(data)
        ref_loss = reference_step(ref, cfg, data)
        losses.append((loss.item(), ref_loss.item()))
        for comp, module in runtime.modules.items():
            for (name, a), (ref_name, b) in zip(module.named_parameters(),
                                                ref[comp].named_parameters()):
                assert name == ref_name and a.grad is not None, (comp, name)
                scale = max(b.grad.abs().max().item(), 1e-3)      # relative to the tensor's
                worst = max(worst, (a.grad - b.grad).abs().max().item() / scale)
                checked += 1
        opt.step()
        ref_opt.step()
        with torch.no_grad():     # the next step starts from the same weights (docstring)
            for comp, module in runtime.modules.items():
                for a, b in zip(module.parameters(), ref[comp].parameters()):
                    scale = max(b.abs().max().item(), 1e-3)
                    worst_weight = max(worst_weight, (a - b).abs().max().item() / scale)
                    b.copy_(a)
    remote = sum(pc.src != pc.dst for pcs in runtime.pieces for pc in pcs)
    two_input = sum(pc.slot == 1 for pcs in runtime.pieces for pc in pcs)
    events = runtime.events
    reduced = [c for kind, c in events if kind == "reduce"]
    last_backward = max(i for i, (kind, _) in enumerate(events) if kind == "backward")
    early = [c for i, (kind, c) in enumerate(events) if kind == "reduce" and i < last_backward]
    return dict(losses=losses, worst=worst, worst_weight=worst_weight, checked=checked,
                held=held, before=before, built=sorted(runtime.modules), alive=alive,
                planned=planned, remote=remote, two_input=two_input, reduced=reduced, early=early,
                shared=sorted(c for c, devs in component_devices(p).items() if len(devs) > 1
                              and rank in devs))


def _training_matches_reference(rank, world_size):
    from megatron.spindle.mt_model import TinyMTConfig, describe
    from megatron.base.distributed_setup import setup_model_parallel
    setup_model_parallel(1, 1, seed=SEED)
    cfg = TinyMTConfig()
    model = describe(cfg)
    return {s: _train_two_steps(s, rank, world_size, cfg, model) for s in STRATEGIES}


@pytest.mark.slow
def test_spindle_training_equals_single_process_reference_and_places_components():
    """The Spindle plan is the planner's own (dynapipe_ext.spindle.scheduler.plan) under a
    stated estimator with a large per-layer overhead; for the small model it puts the text
    encoder, the LM head and the two-input contrastive head on one rank and the other
    components on the other (not the uniform layout). Uniform and sequential split the
    contrastive head's batch over both ranks (its rows are gathered)."""
    from megatron.spindle.mt_model import COMPONENTS
    results = run_in_processes(_training_matches_reference, 2, timeout_s=300)
    for rank, rank_result in enumerate(results):
        for strategy, r in rank_result.items():
            for loss, ref in r["losses"]:
                assert loss == pytest.approx(ref, rel=1e-5, abs=1e-6), (strategy, rank)
            assert r["checked"] > 0 and r["worst"] < 1e-5, (strategy, rank, r["worst"])
            assert r["worst_weight"] < 1e-6, (strategy, rank, r["worst_weight"])
            assert r["built"] == r["held"], (strategy, rank)
            assert r["before"] == 0 and r["alive"] == r["planned"] > 0, (strategy, rank)
            assert r["two_input"] > 0 or "clip_head" not in r["held"], (strategy, rank)
    for strategy in STRATEGIES:                  # every component's gradients were checked
        assert set(results[0][strategy]["held"]) | set(results[1][strategy]["held"]) == \
            set(COMPONENTS), strategy
    spindle = [r["spindle"] for r in results]
    assert not set(spindle[0]["held"]) & set(spindle[1]["held"])   # disjoint placement
    assert "clip_head" in spindle[1]["held"] and "image_enc" in spindle[0]["held"]
    assert spindle[0]["remote"] > 0                 # activations cross ranks
    uniform = [r["uniform"] for r in results]
    assert spindle[0]["alive"] < uniform[0]["alive"] and spindle[1]["alive"] < uniform[1]["alive"]
    assert all(results[0][s]["losses"][0] != results[0][s]["losses"][1] for s in STRATEGIES)
    # gradient reduction overlaps backward: every component held by both ranks is reduced once,
    # and under the uniform plan (one wave per component) the heads' reductions start before
    # the encoders' backward has run
    for rank_result in results:
        for strategy, r in rank_result.items():
            assert sorted(r["reduced"]) == r["shared"], (strategy, r["reduced"])
        assert {"lm_head", "image_head", "audio_head", "clip_head"} <= set(
            rank_result["uniform"]["early"]), rank_result["uniform"]["early"]


def _bad_data_is_refused(rank, world_size):
    from dynapipe_ext.spindle.scheduler import Cluster, plan
    from megatron.spindle.mt_model import (TinyMTConfig, build_component, describe,
                                           loss_normaliser, task_data)
    from megatron.spindle.runtime import WaveRuntime
    from megatron.base.distributed_setup import setup_model_parallel
    setup_model_parallel(1, 1, seed=SEED)
    cfg = TinyMTConfig()
    model = describe(cfg)
    p = plan("spindle", model, _estimator(model), Cluster(world_size, 2**30))
    runtime = WaveRuntime(p, model, lambda name: build_component(cfg, name, SEED),
                          lambda t: loss_normaliser(cfg, t), rank)
    errors = []
    data = task_data(cfg, SEED)
    short = dict(data, image_text=({k: v[:-1] for k, v in data["image_text"][0].items()},
                                   data["image_text"][1][:-1]))
    for bad in ({k: v for k, v in data.items() if k != "audio_cls"}, short):
        try:
            runtime.run(bad)
        except ValueError as err:
            errors.append(str(err))
    return errors


@pytest.mark.slow
def test_runtime_refuses_missing_or_mis_sized_task_data():
    for errors in run_in_processes(_bad_data_is_refused, 2, timeout_s=120):
        assert len(errors) == 2
        assert "audio_cls" in errors[0] and "image_text" in errors[1]


@pytest.mark.slow
def test_profile_fits_every_layer_kind_of_the_real_model():
    from tests.multiproc import single_process_world
    with single_process_world(SEED):
        from megatron.spindle.measure import profile_layer_fits
        from megatron.spindle.mt_model import (TinyMTConfig, build_components, describe,
                                               task_data)
        cfg = TinyMTConfig()
        comps = build_components(cfg, SEED)
        model = describe(cfg)
        fits = profile_layer_fits(comps, cfg, model, task_data(cfg, SEED),
                                  sample_counts=(1, 2), repeats=1)
    assert set(fits) == {c.layer_kind for c in model.components}
    assert all(f.per_token_s > 0 and f.overhead_s >= 0 for f in fits.values())
