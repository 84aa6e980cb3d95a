"""The proof the system is right (issue 5 item 8): for one fixed global batch, the loss and every
parameter gradient of a TP / PP / DP run equal the single-process reference that runs the whole
batch unsplit. Micro-batches come from the real planners (padding, packing, dynamic), plans from
lowering of a real schedule (1F1B; a wave layout for local stage hand-over and the two-tensor T5
transfers), executed by the real executor over gloo. Each case also forces a mix of recompute
modes, which must not change any number.

Tolerance on CPU fp32: loss within 1e-6 relative (measured <= 2e-7); every gradient element
within rtol 1e-5 plus an absolute floor of 1e-6 x the largest gradient of that parameter
(measured: max |diff| <= 9.2e-7 x max |grad| for every parameter of every case; results are
not bit-exact, only summation order differs)."""
import dataclasses
import os

import numpy as np
import pytest
import torch

from dynapipe_ext.costs.cost_model import AnalyticCostModel
from dynapipe_ext.runtime.executor import Executor
from dynapipe_ext.plan.lowering import lower
from dynapipe_ext.costs.model_spec import ModelSpec
from dynapipe_ext.batching.planners import PlannerConfig, plan_micro_batches
from dynapipe_ext.schedule.schedules import hanayo, interleaved_one_f_one_b, one_f_one_b, wave
from tests.multiproc import run_in_processes, single_process_world

SEED = 17
MAX_SEQ, MAX_DEC = 64, 32      # planner limits (packed row length); samples are shorter
MEMORY_LIMIT = 2e6              # small enough that dynamic planning must split the batch
SPECS = {
    "gpt": ModelSpec("gpt", 4, 32, 4, 128, max_position_embeddings=64),
    "t5": ModelSpec("t5", 2, 32, 4, 128, num_decoder_layers=2, max_position_embeddings=64),
}
# a decoder model of today (Llama / Qwen / Mistral: RMSNorm, rotary positions with Llama 3.1's
# scaling, SwiGLU, grouped-query attention, no linear biases but q/k/v ones, untied output
# layer), run with dynamic packed micro-batches on the LLAMA_LAYOUTS
LLAMA = ModelSpec("gpt", 4, 32, 4, 128, max_position_embeddings=64, ffn_hidden_size=48,
                  normalization="RMSNorm", position_embedding_type="rope", use_rope_scaling=True,
                  rope_scaling_original_max_position_embeddings=64, swiglu=True,
                  num_query_groups=2, add_bias_linear=False, add_qkv_bias=True,
                  tied_embeddings=False)
ALL_SPECS = {**SPECS, "llama": LLAMA}
LLAMA_LAYOUTS = ("tp2", "pp2", "dp2", "tp2_pp2")
# "dynamic-packed": dynamic micro-batches as one token stream each (dynamic_layout "packed")
STYLES = ("padding", "packing", "dynamic", "dynamic-packed")
# packing with the histogram / pair packers (plain "packing" is next-fit): other rows, same math
PACKER_STYLES = ("packing-spfhp", "packing-lpfhp", "packing-nnlshp")
RTOL, LOSS_RTOL, ATOL_FRACTION = 1e-5, 1e-6, 1e-6
BUCKET_NUMEL = 4096             # several DP buckets per stage, so their order is exercised
# name -> (processes, tensor parallel, pipeline parallel, schedule); "wave" is the greedy order
# on the W=1 wave layout (what adaptive runs there), "hanayoW" Hanayo's order with W waves,
# "interleavedV" Megatron's interleaving with V stages per rank
LAYOUTS = {
    "tp2": (2, 2, 1, "1f1b"),
    "pp2": (2, 1, 2, "1f1b"),
    "dp2": (2, 1, 1, "1f1b"),
    "tp2_pp2": (4, 2, 2, "1f1b"),
    "pp2_wave": (2, 1, 2, "wave"),
    "pp2_cut": (2, 1, 2, "1f1b"),
    "pp2_wave_cut": (2, 1, 2, "wave"),
    "pp2_hanayo2": (2, 1, 2, "hanayo2"),
    "pp2_interleaved2": (2, 1, 2, "interleaved2"),
}
# layouts that run dynamic micro-batches only (kept small)
DYNAMIC_ONLY = ("pp2_hanayo2", "pp2_interleaved2")
# 2 waves on 2 ranks are 8 stages: GPT's 4 layers in 8 half-layer stages, T5 with 4 + 4 layers
DEEP_T5 = dataclasses.replace(SPECS["t5"], num_layers=4, num_decoder_layers=4)
# GPT stages cut inside layers (ModelSpec.pipeline_cut, half-layer units per stage); these
# layouts run the GPT cases only
CUTS = {"pp2_cut": (5, 3), "pp2_wave_cut": (3, 2, 2, 1)}
HALF_LAYER_CUTS = {"pp2_hanayo2": (1,) * 8}     # GPT only; T5 gets DEEP_T5


def spec_of(model: str, layout_name: str) -> ModelSpec:
    if layout_name in HALF_LAYER_CUTS:
        return (dataclasses.replace(SPECS["gpt"], pipeline_cut=HALF_LAYER_CUTS[layout_name])
                if model == "gpt" else DEEP_T5)
    cut = CUTS.get(layout_name, ())
    return dataclasses.replace(ALL_SPECS[model], pipeline_cut=cut) if cut else ALL_SPECS[model]


def reference_key(model: str, layout_name: str) -> str:
    """Which single-process reference a case compares with (a cut does not change it)."""
    return "t5_deep" if model == "t5" and layout_name in HALF_LAYER_CUTS else model


def pipeline_schedule(schedule_name: str, num_mb: int, pp: int):
    """The Schedule a layout's name stands for, and its stage count."""
    if schedule_name == "wave":
        return wave(num_mb, pp)
    if schedule_name.startswith("hanayo"):
        return hanayo(num_mb, pp, int(schedule_name[len("hanayo"):]))
    if schedule_name.startswith("interleaved"):
        return interleaved_one_f_one_b(num_mb, pp, int(schedule_name[len("interleaved"):]))
    return one_f_one_b(num_mb, pp)


def global_batch(model: str, n: int = 14) -> dict:
    """Fixed samples, lengths 3..40 (T5 decoder 2..20); GPT loss only on the second half of
    each sample (prompt tokens carry no loss), so the token weighting matters."""
    rng = np.random.default_rng(SEED)
    samples = {}
    for i in range(n):
        if model == "gpt":
            length = int(rng.integers(3, 41))
            mask = (np.arange(length) >= length // 2).astype(np.float32)
            samples[i] = (rng.integers(1, 128, length), rng.integers(1, 128, length), mask)
        else:
            le, ld = int(rng.integers(3, 41)), int(rng.integers(2, 21))
            samples[i] = (rng.integers(1, 128, le), rng.integers(1, 128, ld),
                          rng.integers(1, 128, ld), np.ones(ld, np.float32))
    return samples


def lengths_of(samples, model):
    if model == "gpt":
        return [len(samples[i][0]) for i in sorted(samples)]
    return [(len(samples[i][0]), len(samples[i][1])) for i in sorted(samples)]


def plan_replica(model, style, num_stages, tp, dp, dp_rank, spec=None):
    """This replica's micro-batches from the real planner, with recompute modes cycled."""
    spec = spec or ALL_SPECS[model]
    model = spec.model
    samples = global_batch(model)
    style, _, variant = style.partition("-")
    config = PlannerConfig(model=model, max_seq_len=MAX_SEQ,
                           max_dec_seq_len=MAX_DEC if model == "t5" else 0,
                           pipeline_stages=num_stages, data_parallel=dp, micro_batch_size=3,
                           memory_limit_bytes=MEMORY_LIMIT,
                           packing_algorithm=variant if style == "packing" and variant
                           else "nextfit",
                           dynamic_layout="packed" if variant == "packed" else "padded")
    cost = AnalyticCostModel(spec, tp=tp, max_seq_len=MAX_SEQ,
                             max_dec_seq_len=MAX_DEC if model == "t5" else None,
                             num_stages=num_stages, half_rate_tokens=1.0)
    plan = plan_micro_batches(lengths_of(samples, model), config, cost, style.split("-")[0])
    assert sorted(plan.sample_ids()) == sorted(samples)
    modes = ("none", "full", "selective")
    mbs = [dataclasses.replace(mb, recompute=modes[i % 3])
           for i, mb in enumerate(plan.replicas[dp_rank])]
    return samples, mbs, plan


def run_case(model, style, tp, pp, schedule_name, layout, dtype="float32", spec=None):
    """One training step of one case on this rank; returns (loss, full grads by name).
    Gradients go through the real GradBuffer (fp32 main grads, DP buckets reduced during the
    last backward of each stage)."""
    from megatron.core import parallel_state

    from megatron.model.batch_tensors import build_micro_batch, count_loss_tokens
    from megatron.model.init_weights import initialize_stage_weights
    from megatron.model.stages import (build_rank_stages, build_transformer_config,
                                       tied_embedding_group)
    from megatron.base.distributed_setup import pipeline_p2p_groups
    from megatron.training.grad_buffer import GradBuffer, backwards_per_stage
    from megatron.training.handlers import (all_reduce_data_parallel_grads, global_mean_loss,
                                            make_handlers)
    from tests.reference_model import gather_full_grads

    spec = spec or ALL_SPECS[model]
    num_stages = pipeline_schedule(schedule_name, 1, pp).num_stages
    samples, mbs, _ = plan_replica(model, style, num_stages, tp, layout.dp, layout.dp_rank,
                                   spec)
    schedule = pipeline_schedule(schedule_name, len(mbs), pp)
    assert schedule.num_stages == num_stages
    plans = lower(schedule, mbs, spec, dtype=dtype)
    plan = plans[layout.pp_rank]
    tied = model != "llama"      # GPT and T5 keep Megatron's default, a tied output layer
    stages = build_rank_stages(spec, schedule.stage_to_rank, layout.pp_rank,
                               build_transformer_config(spec, tp=tp, pp=pp, dtype=dtype),
                               tie_embeddings=tied)
    initialize_stage_weights(stages, SEED)
    grad_buffer = GradBuffer({s: list(m.parameters()) for s, m in stages.items()},
                             parallel_state.get_data_parallel_group() if layout.dp > 1 else None,
                             bucket_numel=BUCKET_NUMEL,
                             tied_group=tied_embedding_group(spec, schedule.stage_to_rank, tied))
    table = make_handlers(stages, lambda m: build_micro_batch(mbs[m], samples, spec.model, 0),
                          pipeline_p2p_groups(),
                          global_loss_tokens=count_loss_tokens(samples, list(samples)),
                          timeout_s=60, grad_buffer=grad_buffer)
    grad_buffer.expect_backwards(backwards_per_stage(plan.instructions))
    Executor(table).run(plan)
    table.runtime.check_drained()
    all_reduce_data_parallel_grads(grad_buffer)
    loss, tokens = global_mean_loss(table.runtime)
    assert tokens == count_loss_tokens(samples, list(samples))
    return loss, gather_full_grads(stages)


def layout_worker(rank, world_size, layout_name, cases=None, dtype="float32"):
    """Runs the (model, style) `cases` (default: all) of one layout; rank 0 returns the
    results."""
    from megatron.base.distributed_setup import setup_model_parallel
    _, tp, pp, schedule_name = LAYOUTS[layout_name]
    models = ("gpt",) if layout_name in CUTS else tuple(SPECS)
    styles = ("dynamic",) if layout_name in DYNAMIC_ONLY else STYLES
    cases = cases or ([(model, style) for model in models for style in styles]
                      + ([("llama", "dynamic-packed")] if layout_name in LLAMA_LAYOUTS else []))
    results = {}
    for model in ALL_SPECS:
        if not any(m == model for m, _ in cases):
            continue
        layout = setup_model_parallel(tp, pp, seed=SEED, timeout_s=60)
        for style in STYLES + PACKER_STYLES:
            if (model, style) in cases:
                results[(model, style)] = run_case(model, style, tp, pp, schedule_name, layout,
                                                   dtype, spec_of(model, layout_name))
    return results if rank == 0 else None


@pytest.fixture(scope="module")
def references():
    """Single-process reference loss and grads per model (computed once, in this process)."""
    from tests.reference_model import reference_loss_and_grads
    torch.set_num_threads(1)
    with single_process_world(seed=SEED):
        found = {model: reference_loss_and_grads(SPECS[model], global_batch(model),
                                                 sorted(global_batch(model)), SEED)
                 for model in SPECS}
        found["t5_deep"] = reference_loss_and_grads(DEEP_T5, global_batch("t5"),
                                                    sorted(global_batch("t5")), SEED)
        found["llama"] = reference_loss_and_grads(LLAMA, global_batch("gpt"),
                                                  sorted(global_batch("gpt")), SEED,
                                                  tie_embeddings=False)
        return found


def compare(reference, result) -> list[str]:
    """Mismatch descriptions (empty when loss and every gradient match)."""
    ref_loss, ref_grads = reference
    loss, grads = result
    problems = []
    if not abs(loss - ref_loss) <= LOSS_RTOL * abs(ref_loss):
        problems.append(f"loss {loss!r} != reference {ref_loss!r}")
    if sorted(grads) != sorted(ref_grads):
        problems.append(f"parameter names differ: {sorted(set(grads) ^ set(ref_grads))[:5]}")
        return problems
    for name, ref in ref_grads.items():
        atol = ATOL_FRACTION * float(np.abs(ref).max())
        if grads[name].shape != ref.shape or not np.allclose(grads[name], ref, rtol=RTOL,
                                                             atol=atol):
            worst = float(np.abs(grads[name] - ref).max()) if grads[name].shape == ref.shape \
                else float("nan")
            problems.append(f"grad {name}: max abs diff {worst:.3g} (scale "
                            f"{float(np.abs(ref).max()):.3g})")
    return problems


@pytest.mark.slow
@pytest.mark.parametrize("layout_name", list(LAYOUTS))
def test_parallel_run_equals_single_process_reference(references, layout_name):
    world_size = LAYOUTS[layout_name][0]
    results = run_in_processes(layout_worker, world_size, (layout_name,), timeout_s=400)[0]
    failures = {}
    for (model, style), result in results.items():
        problems = compare(references[reference_key(model, layout_name)], result)
        if problems:
            failures[f"{layout_name}/{model}/{style}"] = problems[:5]
    assert not failures, failures


@pytest.mark.slow
@pytest.mark.parametrize("layout_name", ["pp2", "tp2_pp2"])
def test_packers_runs_equal_single_process_reference(references, layout_name):
    """Rows of SPFHP / LPFHP / NNLSHP (T5: the pair packers) keep attention within each
    sample: loss and gradients equal the unpacked reference, as next-fit's rows do."""
    world_size = LAYOUTS[layout_name][0]
    cases = [(model, style) for model in SPECS for style in PACKER_STYLES]
    results = run_in_processes(layout_worker, world_size, (layout_name, cases),
                               timeout_s=400)[0]
    assert sorted(results) == sorted(cases)
    failures = {f"{layout_name}/{model}/{style}": compare(references[model], result)[:5]
                for (model, style), result in results.items()
                if compare(references[model], result)}
    assert not failures, failures


def test_compare_flags_a_wrong_gradient_and_loss():
    """The comparison itself is not vacuous: a 1e-4 relative error in one entry is caught."""
    ref = (2.0, {"w": np.linspace(-1, 1, 50, dtype=np.float32)})
    assert compare(ref, (2.0, {"w": ref[1]["w"].copy()})) == []
    bad = ref[1]["w"].copy()
    bad[7] *= 1 + 1e-4
    assert [p.split(":")[0] for p in compare(ref, (2.0 + 1e-5, {"w": bad}))] == [
        "loss 2.00001 != reference 2.0", "grad w"]


def test_planned_micro_batches_are_varied():
    """The three styles really differ: padding pads, packing packs, dynamic varies shapes."""
    for model in SPECS:
        shapes = {}
        for style in STYLES:
            _, _, plan = plan_replica(model, style, 2, 1, 1, 0)
            shapes[style] = plan.micro_batches
        assert any(mb.is_packed for mb in shapes["packing"]), model
        assert not any(mb.is_packed for mb in shapes["padding"] + shapes["dynamic"]), model
        assert len({(mb.num_rows, mb.seq_len) for mb in shapes["dynamic"]}) > 1, model
        packed = shapes["dynamic-packed"]
        assert all(mb.num_rows == 1 for mb in packed) and any(mb.is_packed for mb in packed)
        assert len(packed) > 1, model
        # the packers' rows differ from next-fit's, so their equivalence cases test other rows
        rows = {style: sorted(row for mb in plan_replica(model, style, 2, 1, 1, 0)[2]
                              .micro_batches for row in mb.rows)
                for style in ("packing",) + PACKER_STYLES}
        assert all(rows[style] != rows["packing"] for style in PACKER_STYLES), model


def dead_peer_worker(rank, world_size):
    """Rank 1 dies after the groups are up; rank 0 must fail with a message, not hang."""
    import time

    from megatron.model.batch_tensors import build_micro_batch, count_loss_tokens
    from megatron.model.init_weights import initialize_stage_weights
    from megatron.model.stages import (build_rank_stages, build_transformer_config,
                                       tied_embedding_group)
    from megatron.base.distributed_setup import pipeline_p2p_groups, setup_model_parallel
    from megatron.training.handlers import make_handlers
    layout = setup_model_parallel(1, 2, seed=SEED, timeout_s=20)
    if rank == 1:
        os._exit(3)
    spec = SPECS["gpt"]
    samples, mbs, _ = plan_replica("gpt", "padding", 2, 1, 1, 0)
    schedule = one_f_one_b(len(mbs), 2)
    stages = build_rank_stages(spec, schedule.stage_to_rank, layout.pp_rank,
                               build_transformer_config(spec, pp=2))
    initialize_stage_weights(stages, SEED)
    table = make_handlers(stages, lambda m: build_micro_batch(mbs[m], samples, "gpt", 0),
                          pipeline_p2p_groups(),
                          count_loss_tokens(samples, list(samples)), timeout_s=10)
    start = time.monotonic()
    try:
        Executor(table).run(lower(schedule, mbs, spec)[0])
    except Exception as err:  # noqa: BLE001 - the error itself is the result
        return f"{type(err).__name__}: {err}", time.monotonic() - start
    return "no error", time.monotonic() - start


@pytest.mark.slow
def test_dead_peer_is_an_error_not_a_hang():
    message, seconds = run_in_processes(dead_peer_worker, 2, timeout_s=120, may_die=(1,))[0]
    assert message.startswith("InstructionError"), message
    assert "TransferError" in message and "pipeline rank 1" in message, message
    assert seconds < 60


def p2p_route_worker(rank, world_size):
    """Which group each side of a transfer uses: returns [(peer, send, group index)]."""
    import torch.distributed as dist

    from megatron.base.distributed_setup import pipeline_p2p_groups, setup_model_parallel
    from megatron.training.handlers import PipelineRuntime
    setup_model_parallel(1, 2, seed=SEED, timeout_s=30)
    groups = pipeline_p2p_groups()
    assert groups[0] is not groups[1]
    assert [dist.get_process_group_ranks(g) for g in groups] == [[0, 1], [0, 1]]
    runtime = PipelineRuntime({}, lambda mb: {}, groups, timeout_s=30)
    peer = 1 - rank
    return [(peer, send, groups.index(runtime._route(peer, send)[1])) for send in (True, False)]


@pytest.mark.slow
def test_each_direction_of_pipeline_traffic_has_its_own_group_on_both_ends():
    rank0, rank1 = run_in_processes(p2p_route_worker, 2, timeout_s=120)
    # rank 0 -> rank 1 goes on group 0 at both ends; rank 1 -> rank 0 on group 1
    assert rank0 == [(1, True, 0), (1, False, 1)]
    assert rank1 == [(0, True, 1), (0, False, 0)]


@pytest.mark.parametrize("layout_name", DYNAMIC_ONLY)
def test_wave_and_interleaved_cases_run_varied_micro_batches_on_their_layouts(layout_name):
    """What the slow equivalence cases of the wave (W=2) and interleaved layouts run: several
    dynamic micro-batches of different shapes, on 8 / 4 stages laid out as Hanayo's waves /
    Megatron's interleaving, with T5 on the wave layout as 4 + 4 whole layers."""
    from dynapipe_ext.schedule.schedule_ir import interleaved_layout, wave_layout
    _, tp, pp, schedule_name = LAYOUTS[layout_name]
    expected = wave_layout(2, 2) if layout_name == "pp2_hanayo2" else interleaved_layout(2, 2)
    for model in SPECS:
        spec = spec_of(model, layout_name)
        _, mbs, _ = plan_replica(model, "dynamic", len(expected), tp, 1, 0, spec)
        schedule = pipeline_schedule(schedule_name, len(mbs), pp)
        assert schedule.stage_to_rank == expected
        assert len(spec.stage_layers(len(expected))) == len(expected)
        assert len(mbs) > 2 and len({(mb.num_rows, mb.seq_len) for mb in mbs}) > 1, model
