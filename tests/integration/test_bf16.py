"""Mixed precision (issue 11): bf16 runs match the fp32 single-process reference, main gradients
are fp32 and accumulate exactly, and the data-parallel reduction runs during backward.

bf16 equivalence: the same plans, executor and gloo runs as test_equivalence.py, with bf16
parameters, activations and transfers, against the fp32 reference (test_equivalence's fixture).
Every layout runs once per model and every micro-batching style runs at least once per model
(CASES), to keep the added time modest. Tolerances, with bf16's 8 significant bits (unit
roundoff 2^-9 = 2e-3; the bf16 weights are the fp32 ones rounded):
* loss within 4e-3 relative (one bf16 ulp at the loss; measured <= 1.2e-5: the loss at
  initialisation sits near log(vocab), where rounding errors average out);
* the whole gradient (all parameters concatenated) within 2e-2 relative L2 error (measured
  <= 6.5e-3, a few roundings' worth);
* every parameter's gradient: cosine similarity >= 0.99 (measured >= 0.9985) and relative L2
  error <= 0.15 (measured <= 5.7e-2, worst on layer-norm biases, whose small gradients are sums
  of many bf16 terms that partly cancel). The relative error also catches a gradient off by a
  factor (e.g. a skipped or doubled DP reduction), which the cosine alone would not."""
import numpy as np
import pytest
import torch

from tests.multiproc import run_in_processes
from tests.integration.test_equivalence import LAYOUTS, SEED, SPECS, STYLES, layout_worker, references  # noqa: F401

LOSS_RTOL, TOTAL_RTOL, PARAM_RTOL, MIN_COSINE = 4e-3, 2e-2, 0.15, 0.99
# layout -> (model, style) cases; each model meets each style at least once (the Llama-style
# model of test_equivalence runs its dynamic packed micro-batches at TP=2 x PP=2)
CASES = {
    "tp2": [("gpt", "padding"), ("t5", "packing"), ("t5", "dynamic-packed")],
    "pp2": [("gpt", "packing"), ("t5", "dynamic")],
    "dp2": [("gpt", "dynamic"), ("t5", "padding"), ("gpt", "dynamic-packed")],
    "tp2_pp2": [("gpt", "dynamic"), ("t5", "packing"), ("llama", "dynamic-packed")],
}


def relative_error(value: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(value - ref) / max(np.linalg.norm(ref), 1e-30))


def cosine(value: np.ndarray, ref: np.ndarray) -> float:
    value, ref = value.ravel().astype(np.float64), ref.ravel().astype(np.float64)
    return float(value @ ref / max(np.linalg.norm(value) * np.linalg.norm(ref), 1e-30))


def compare_bf16(reference, result) -> list[str]:
    """Mismatch descriptions of a bf16 result against the fp32 reference (see the tolerances
    in the module docstring); empty when it matches."""
    ref_loss, ref_grads = reference
    loss, grads = result
    problems = []
    if not abs(loss - ref_loss) <= LOSS_RTOL * abs(ref_loss):
        problems.append(f"loss {loss!r} != reference {ref_loss!r}")
    if sorted(grads) != sorted(ref_grads):
        return problems + [f"parameter names differ: {sorted(set(grads) ^ set(ref_grads))[:5]}"]
    total = relative_error(np.concatenate([grads[n].ravel() for n in ref_grads]),
                           np.concatenate([r.ravel() for r in ref_grads.values()]))
    if not total <= TOTAL_RTOL:
        problems.append(f"whole gradient: relative error {total:.3g}")
    for name, ref in ref_grads.items():
        if grads[name].shape != ref.shape:
            problems.append(f"grad {name}: shape {grads[name].shape} != {ref.shape}")
            continue
        rel, cos = relative_error(grads[name], ref), cosine(grads[name], ref)
        if not (rel <= PARAM_RTOL and cos >= MIN_COSINE):
            problems.append(f"grad {name}: relative error {rel:.3g}, cosine {cos:.5f}")
    return problems


@pytest.mark.slow
@pytest.mark.parametrize("layout_name", list(CASES))
def test_bf16_run_matches_the_fp32_reference(references, layout_name):  # noqa: F811
    world_size = LAYOUTS[layout_name][0]
    results = run_in_processes(layout_worker, world_size,
                               (layout_name, CASES[layout_name], "bfloat16"), timeout_s=400)[0]
    assert sorted(results) == sorted(CASES[layout_name])
    failures = {f"{layout_name}/{model}/{style}": problems[:5]
                for (model, style), result in results.items()
                if (problems := compare_bf16(references[model], result))}
    assert not failures, failures


def test_bf16_cases_cover_every_layout_and_every_style_per_model():
    assert set(CASES) == {"tp2", "pp2", "dp2", "tp2_pp2"}
    for model in SPECS:
        assert {s for cases in CASES.values() for m, s in cases if m == model} == set(STYLES)


def test_compare_bf16_flags_a_scaled_or_noisy_gradient():
    rng = np.random.default_rng(0)
    ref = (3.0, {"w": rng.standard_normal(200).astype(np.float32),
                 "b": rng.standard_normal(20).astype(np.float32)})
    close = {n: g + 1e-3 * np.abs(g).max() * rng.standard_normal(g.shape) for n, g in
             ref[1].items()}
    assert compare_bf16(ref, (3.001, close)) == []
    halved = dict(close, b=close["b"] / 2)          # e.g. a DP sum replaced by a mean
    assert [p.split(":")[0] for p in compare_bf16(ref, (3.001, halved))] == [
        "whole gradient", "grad b"]
    assert compare_bf16(ref, (3.1, close))[0].startswith("loss")


@pytest.mark.parametrize("model", list(SPECS))
def test_bf16_stages_hold_only_bf16_and_hand_over_bf16_with_an_fp32_loss(model):
    """megatron-core leaves position embeddings and local-spec norms fp32; the whole stage must
    be bf16 (as Float16Module casts it), the hand-over bf16 and the token losses fp32."""
    from megatron.model.batch_tensors import build_micro_batch, unsplit_micro_batch
    from megatron.model.init_weights import initialize_stage_weights
    from megatron.model.stages import build_rank_stages, build_transformer_config
    from tests.multiproc import single_process_world
    from tests.integration.test_equivalence import global_batch
    spec, samples = SPECS[model], global_batch(model, 3)
    with single_process_world(seed=SEED):
        stages = build_rank_stages(spec, (0, 0), 0, build_transformer_config(spec, pp=1,
                                                                             dtype="bfloat16"))
        initialize_stage_weights(stages, SEED)
        wrong = [n for s in stages.values() for n, p in s.named_parameters()
                 if p.dtype != torch.bfloat16]
        assert not wrong, wrong
        batch = build_micro_batch(unsplit_micro_batch(sorted(samples), samples, model),
                                  samples, model, 0)
        handed = stages[0]((), batch)
        assert all(t.dtype == torch.bfloat16 for t in handed)
        losses = stages[1](handed, batch)
        assert losses.dtype == torch.float32 and torch.isfinite(losses).all()


# ---- fp32 main gradients ----

def bf16_linear_stack(layers: int = 3, width: int = 8) -> torch.nn.Sequential:
    torch.manual_seed(SEED)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(
        torch.bfloat16)


def test_main_grads_are_fp32_and_accumulate_micro_batches_exactly():
    from megatron.training.grad_buffer import GradBuffer
    model = bf16_linear_stack()
    params = list(model.parameters())
    inputs = [torch.randn(4, 8, dtype=torch.bfloat16) for _ in range(5)]
    # expected: each micro-batch's bf16 gradient, summed in fp32 in micro-batch order
    expected = [torch.zeros(p.shape, dtype=torch.float32) for p in params]
    for x in inputs:
        for e, g in zip(expected, torch.autograd.grad(model(x).float().sum(), params)):
            e.add_(g)
    buffer = GradBuffer({0: params}, bucket_numel=16)
    for x in inputs:
        model(x).float().sum().backward()
    assert all(p.grad is None for p in params)          # freed into main_grad
    assert buffer.data.dtype == torch.float32 and buffer.data.numel() == sum(
        p.numel() for p in params)
    for p, e in zip(params, expected):
        assert p.main_grad.dtype == torch.float32
        assert p.main_grad.data_ptr() >= buffer.data.data_ptr()   # a view into the one buffer
        assert torch.equal(p.main_grad, e)
    # the bf16 sum in .grad would already differ: the fp32 buffer is what keeps the bits
    assert len(buffer.buckets) > 1 and all(b.stage == 0 for b in buffer.buckets)
    buffer.zero()
    assert all(torch.count_nonzero(p.main_grad) == 0 for p in params)


def test_a_parameter_gets_one_gradient_buffer_only():
    from megatron.training.grad_buffer import GradBuffer
    params = list(bf16_linear_stack(1).parameters())
    GradBuffer({0: params})
    with pytest.raises(ValueError, match="already have a main_grad"):
        GradBuffer({0: params})


def overlap_worker(rank, world_size):
    """DP=2 over gloo: two micro-batches; returns (buckets launched before / during / after the
    last backward, the main grads after finish, this replica's unreduced grads)."""
    from megatron.base.distributed_setup import setup_model_parallel
    from megatron.training.grad_buffer import GradBuffer
    from megatron.core import parallel_state
    setup_model_parallel(1, 1, seed=SEED, timeout_s=60)
    model = bf16_linear_stack(layers=4)
    torch.manual_seed(100 + rank)                       # each replica its own data
    inputs = [torch.randn(4, 8, dtype=torch.bfloat16) for _ in range(2)]
    params = list(model.parameters())
    local = [np.zeros(p.shape, np.float32) for p in params]   # this replica's own sum
    for x in inputs:
        for acc, g in zip(local, torch.autograd.grad(model(x).float().sum(), params)):
            acc += g.float().numpy()
    one_layer = sum(p.numel() for p in model[0].parameters())
    buffer = GradBuffer({0: params}, parallel_state.get_data_parallel_group(),
                        bucket_numel=one_layer)
    seen = {}

    def record(module, grad_output):
        """Runs in each backward just before layer 0's own gradients: layers 1-3 are done."""
        seen[len(seen)] = buffer._next

    model[0].register_full_backward_pre_hook(record)
    buffer.expect_backwards({0: 2})
    launched = []
    for x in inputs:
        buffer.before_backward(0)
        model(x).float().sum().backward()
        launched.append(buffer._next)
        buffer.after_backward(0)
    stats = buffer.finish()
    assert buffer.finish() is stats      # the optimizer's own finish must not reduce again
    return launched, seen, stats, [p.main_grad.numpy().copy() for p in params], local


@pytest.mark.slow
def test_data_parallel_buckets_are_reduced_during_the_last_backward():
    (launched0, seen0, stats0, reduced0, local0), (_, _, _, reduced1, local1) = \
        run_in_processes(overlap_worker, 2, timeout_s=120)
    # nothing goes during the first backward; in the last one, layers 3..1's buckets were
    # launched before layer 0's backward ran, and all 4 before backward() returned
    assert launched0 == [0, 4]
    assert seen0[0] == 0 and seen0[1] == 3
    assert stats0["launched_early"] == stats0["buckets"] == 4
    for r0, r1, a, b in zip(reduced0, reduced1, local0, local1):
        assert np.array_equal(r0, r1) and np.array_equal(r0, a + b)
