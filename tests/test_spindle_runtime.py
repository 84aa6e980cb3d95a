"""Spindle runtime on 2 gloo processes: the loss and gradients of an iteration executed from a
Spindle wave plan (and from both baselines' plans) equal a single-process run of the same
tasks, in fp32."""
import pytest

from multiproc import run_in_processes

SEED = 11


def _estimator(model):
    from dynapipe_ext.spindle.estimator import CommModel, Estimator, LayerFit
    # large per-layer overhead: small MetaOps stay on one rank, so the plan hands over
    return Estimator({c.layer_kind: LayerFit(2e-3, 1e-6) for c in model.components},
                     CommModel(1e-4, 1e-9), dtype_bytes=4)


def _iteration_matches_reference(rank, world_size):
    from dynapipe_ext.spindle.checker import check_wave_plan
    from dynapipe_ext.spindle.scheduler import Cluster, plan
    from megatron.spindle.mt_model import (TinyMTConfig, build_components, describe,
                                           loss_normaliser, reference_step, task_data)
    from megatron.spindle.runtime import WaveRuntime
    from megatron.base.distributed_setup import setup_model_parallel
    setup_model_parallel(1, 1, seed=SEED)
    cfg = TinyMTConfig()
    data = task_data(cfg, SEED)
    ref = build_components(cfg, SEED)
    ref_loss = reference_step(ref, cfg, data)
    comps = build_components(cfg, SEED)
    model = describe(cfg, comps)
    results = {}
    for strategy in ("spindle", "uniform", "sequential"):
        p = plan(strategy, model, _estimator(model), Cluster(world_size, 2**30))
        check_wave_plan(p)
        comps.zero_grad(set_to_none=True)
        runtime = WaveRuntime(p, model, comps, lambda t: loss_normaliser(cfg, t), rank)
        loss = runtime.run(data)
        worst, checked = 0.0, 0
        for comp, users in runtime.users.items():
            if rank not in users:
                continue
            for (name, a), b in zip(comps[comp].named_parameters(),
                                    ref[comp].parameters()):
                worst = max(worst, (a.grad - b.grad).abs().max().item())
                checked += 1
        split = sum(len(pl.devices) < world_size for w in p.waves for pl in w.placed)
        remote = sum(pc.src != pc.dst for pcs in runtime.pieces for pc in pcs)
        results[strategy] = (loss.item(), ref_loss.item(), worst, checked, split, remote)
    return results


@pytest.mark.slow
def test_spindle_iteration_equals_single_process_reference():
    results = run_in_processes(_iteration_matches_reference, 2, timeout_s=240)
    for rank_result in results:
        for strategy, (loss, ref, worst, checked, _, _) in rank_result.items():
            assert loss == pytest.approx(ref, rel=1e-5, abs=1e-6), strategy
            assert checked > 0 and worst < 1e-5, (strategy, worst)
    spindle = results[0]["spindle"]
    assert spindle[4] > 0          # some MetaOp runs on one rank only
    assert spindle[5] > 0          # activations cross ranks
    assert sum(r["spindle"][3] for r in results) < sum(r["uniform"][3] for r in results)


@pytest.mark.slow
def test_profile_fits_every_layer_kind_of_the_real_model():
    from multiproc import single_process_world
    with single_process_world(SEED):
        from megatron.spindle.measure import profile_layer_fits
        from megatron.spindle.mt_model import (TinyMTConfig, build_components, describe,
                                               task_data)
        cfg = TinyMTConfig()
        comps = build_components(cfg, SEED)
        model = describe(cfg, comps)
        fits = profile_layer_fits(comps, cfg, model, task_data(cfg, SEED),
                                  sample_counts=(1, 2), repeats=1)
    assert set(fits) == {c.layer_kind for c in model.components}
    assert all(f.per_token_s > 0 and f.overhead_s >= 0 for f in fits.values())
