"""Predicted vs measured activation memory (megatron/bench/memory_bench.py,
tools/bench_memory.py): the measurement follows the plan, and the cost model is close to it."""
import numpy as np
import pytest
import torch

from dynapipe_ext.costs.model_spec import ModelSpec
from tests.multiproc import single_process_world

torch.set_num_threads(1)
GPT = ModelSpec("gpt", 4, 128, 4, 512, max_position_embeddings=256)


@pytest.fixture(scope="module")
def gpt_rows():
    from megatron.bench.memory_bench import predicted_vs_measured
    lengths = np.random.default_rng(3).integers(16, 257, size=24)
    with single_process_world(seed=1):
        return {mode: predicted_vs_measured(GPT, lengths, 256, 0, mode)
                for mode in ("none", "full")}


def test_measured_memory_follows_the_schedule_and_recompute(gpt_rows):
    none, full = gpt_rows["none"], gpt_rows["full"]
    assert all(r.measured_bytes > 0 for r in none + full)
    # under 1F1B rank 0 keeps two micro-batches in flight, the last rank one
    assert none[0].measured_bytes > none[1].measured_bytes
    # recomputing whole layers keeps far less from forward to backward
    assert full[0].measured_bytes < 0.8 * none[0].measured_bytes


def test_cost_model_predicts_activation_memory_without_recompute_within_20_percent(gpt_rows):
    for r in gpt_rows["none"]:
        assert r.ratio == pytest.approx(1.0, abs=0.2), (r.rank, r.predicted_bytes,
                                                        r.measured_bytes)


def test_the_table_flags_rows_outside_the_target():
    import sys
    sys.path.insert(0, "tools")
    from bench_memory import summary, table
    rows = [{"model": "gpt", "max_len": 256, "recompute": "none", "rank": 0,
             "predicted_mib": 10.0, "measured_mib": 9.5, "ratio": 10 / 9.5},
            {"model": "gpt", "max_len": 256, "recompute": "full", "rank": 0,
             "predicted_mib": 7.0, "measured_mib": 10.0, "ratio": 0.7}]
    lines = table(rows).splitlines()
    assert lines[2].endswith("| 1.05 |") and lines[3].endswith("| 0.70 * |")
    assert summary(rows) == pytest.approx({"none": 0.5 / 9.5, "full": 0.3})


def gelu_memory(fn, tokens: int, ffn: int) -> tuple[int, int]:
    """(bytes autograd saves, peak bytes above the start) of one forward + backward of `fn`
    on a [tokens, ffn] fp32 input, read as profile_layers reads them (saved-tensor hooks;
    glibc bytes in use after every aten op)."""
    from megatron.planning.profile_layers import (_PeakAfterEachOp, _SavedTensorCounter,
                                               cpu_bytes_in_use)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, ffn, generator=gen).requires_grad_()
    grad = torch.randn(tokens, ffn, generator=gen)
    counter, tracker = _SavedTensorCounter(), _PeakAfterEachOp(cpu_bytes_in_use)
    base = cpu_bytes_in_use()
    with tracker, torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
        fn(x).backward(grad)
    return sum(counter.storages.values()), tracker.peak - base


def test_the_cpu_gelu_keeps_its_input_and_the_model_counts_its_backward_temporaries():
    """stages.gelu_tanh on CPU fp32 (x * sigmoid(2z)) saves what torch's kernel saves (its
    input) but its backward holds two more [tokens, ffn] tensors: the cost model's
    `sigmoid_gelu` term is that difference."""
    from dynapipe_ext.costs.cost_model import AnalyticCostModel
    from megatron.model.stages import gelu_tanh
    spec = ModelSpec("gpt", 1, 128, 4, 64, max_position_embeddings=256)
    rows, seq, ffn = 2, 256, spec.ffn_size
    unit = rows * seq * ffn * 4
    saved_sig, peak_sig = gelu_memory(gelu_tanh, rows * seq, ffn)
    saved_torch, peak_torch = gelu_memory(
        lambda x: torch.nn.functional.gelu(x, approximate="tanh"), rows * seq, ffn)
    assert saved_sig == saved_torch == unit
    measured = peak_sig - peak_torch
    assert measured == pytest.approx(2 * unit, rel=0.05)

    def peak(**options):
        return AnalyticCostModel(spec, **options).stage_costs(rows, seq, 0, 1)[0].peak_bytes
    assert peak(sigmoid_gelu=True) - peak() == pytest.approx(measured, rel=0.05)


def test_one_layer_kept_and_transient_bytes_match_the_model_on_cpu_fp32():
    """One GPT layer through the trainer's path: bytes saved for backward (hooks) and the
    transient peak above them (glibc, every op) against the analytic model's per-layer kept
    and transient bytes, with the sigmoid GeLU counted."""
    from dynapipe_ext.costs.cost_model import AnalyticCostModel
    from dynapipe_ext.costs.model_spec import GPT_LAYER
    from megatron.planning.profile_layers import ProfiledLayer, make_inputs, measure_layer
    from megatron.model.stages import build_transformer_config
    spec = ModelSpec("gpt", 1, 128, 4, 64, max_position_embeddings=256)
    rows, seq = 2, 256
    with single_process_world(seed=1):
        layer = ProfiledLayer(GPT_LAYER, spec, build_transformer_config(spec))
        data = make_inputs(GPT_LAYER, spec, rows, seq, 0, torch.float32, torch.device("cpu"))
        measured = measure_layer(layer, data, "none", 1, torch.device("cpu"))
    shape = (np.array([rows], float), np.array([seq], float), np.zeros(1))

    def model(**options):
        _, _, kept, transient = AnalyticCostModel(spec, **options)._layer_cost(
            GPT_LAYER, *shape, "none")
        return float(kept[0]), float(transient[0])
    kept, transient = model(sigmoid_gelu=True)
    assert kept == pytest.approx(measured.activation_bytes, rel=0.03)
    assert transient == pytest.approx(measured.peak_bytes, rel=0.15)
    assert model()[1] < 0.5 * measured.peak_bytes     # without the GeLU term: far below
