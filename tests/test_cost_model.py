"""AnalyticCostModel: monotone in shape, recompute trades time for memory, limits respected."""
import numpy as np
import pytest

from dynapipe_ext.cost_model import (AnalyticCostModel, CostModel, cost_micro_batches,
                                     memory_needed)
from dynapipe_ext.model_spec import ModelSpec

GPT = ModelSpec("gpt", num_layers=8, hidden_size=512, num_attention_heads=8, vocab_size=5000)
T5 = ModelSpec("t5", num_layers=4, hidden_size=512, num_attention_heads=8, vocab_size=5000,
               num_decoder_layers=4)


def totals(model, rows, seq, dec, stages=2, recompute="none"):
    costs = model.stage_costs(rows, seq, dec, stages, recompute)
    return (sum(c.fwd_ms + c.bwd_ms for c in costs), sum(c.activation_bytes for c in costs))


@pytest.mark.parametrize("spec", [GPT, T5])
def test_time_and_memory_grow_with_rows_and_lengths(spec):
    model = AnalyticCostModel(spec)
    for mode in ("none", "selective", "full"):
        base = totals(model, 4, 256, 64, recompute=mode)
        for bigger in [(5, 256, 64), (4, 264, 64)] + ([(4, 256, 72)] if spec.model == "t5" else []):
            grown = totals(model, *bigger, recompute=mode)
            assert grown[0] > base[0] and grown[1] > base[1], (mode, bigger)


def test_attention_makes_time_superlinear_in_length():
    model = AnalyticCostModel(GPT, half_rate_tokens=0, layer_overhead_ms=0)
    # same tokens, longer rows: more attention work
    assert totals(model, 1, 2048, 0)[0] > totals(model, 8, 256, 0)[0]


@pytest.mark.parametrize("spec", [GPT, T5])
def test_recompute_trades_time_for_memory(spec):
    model = AnalyticCostModel(spec)
    t_none, m_none = totals(model, 4, 512, 128, recompute="none")
    t_sel, m_sel = totals(model, 4, 512, 128, recompute="selective")
    t_full, m_full = totals(model, 4, 512, 128, recompute="full")
    assert t_none < t_sel < t_full
    assert m_none > m_sel > m_full


def test_backward_is_twice_forward_without_recompute():
    for c in AnalyticCostModel(GPT).stage_costs(2, 128, 0, 4):
        assert c.bwd_ms == pytest.approx(2 * c.fwd_ms)


def test_shapes_over_max_lengths_are_infeasible():
    model = AnalyticCostModel(T5, max_seq_len=512, max_dec_seq_len=128)
    assert model.stage_costs(1, 512, 128, 2) is not None
    assert model.stage_costs(1, 520, 128, 2) is None
    assert model.stage_costs(1, 512, 136, 2) is None
    assert model.stage_costs(0, 512, 128, 2) is None


def test_memory_limit_subtracts_heaviest_stage_states():
    model = AnalyticCostModel(GPT, device_mem_bytes=8 * 2**30, num_stages=4)
    states = model.model_state_bytes(4)
    assert sum(states) == pytest.approx(sum(model.model_state_bytes(1)))
    assert model.activation_memory_limit() == pytest.approx(8 * 2**30 - max(states))
    # fewer stages hold more layers each: less room for activations
    assert model.activation_memory_limit(1) < model.activation_memory_limit(4)


def test_tensor_parallel_splits_work():
    one, two = AnalyticCostModel(GPT, tp=1), AnalyticCostModel(GPT, tp=2)
    assert totals(two, 4, 512, 0)[0] < totals(one, 4, 512, 0)[0]
    assert totals(two, 4, 512, 0)[1] < totals(one, 4, 512, 0)[1]
    with pytest.raises(ValueError, match="tp=3"):
        AnalyticCostModel(GPT, tp=3)


class ScalarOnly(CostModel):
    """A cost model without the vectorised fast path (like a plain profile lookup)."""

    def __init__(self, inner):
        self.inner = inner

    def stage_costs(self, rows, seq_len, dec_seq_len, num_stages, recompute="none"):
        return self.inner.stage_costs(rows, seq_len, dec_seq_len, num_stages, recompute)

    def activation_memory_limit(self):
        return self.inner.activation_memory_limit()


def test_scalar_fallback_matches_vectorised_costs():
    fast = AnalyticCostModel(T5, max_seq_len=1024)
    rows = np.array([1, 3, 3, 8, 2])
    seq = np.array([64, 128, 128, 1024, 2048])     # the last one is infeasible
    dec = np.array([8, 16, 16, 64, 8])
    a = fast.stage_cost_arrays(rows, seq, dec, 2, "selective")
    b = ScalarOnly(fast).stage_cost_arrays(rows, seq, dec, 2, "selective")
    assert list(a.feasible) == list(b.feasible) == [True] * 4 + [False]
    ok = a.feasible
    np.testing.assert_allclose(a.fwd_ms[:, ok], b.fwd_ms[:, ok])
    np.testing.assert_allclose(a.activation_bytes[:, ok], b.activation_bytes[:, ok], rtol=1e-9)


def test_cheapest_fitting_recompute_mode_is_chosen():
    model = AnalyticCostModel(GPT)
    rows, seq = np.array([2]), np.array([1024])
    needs = {m: float(memory_needed(model.stage_cost_arrays(rows, seq, 0, 4, m))[0])
             for m in ("none", "selective", "full")}
    assert needs["none"] > needs["selective"] > needs["full"]
    modes = ("none", "selective", "full")
    for limit, expected in [(needs["none"], 0), (needs["selective"], 1), (needs["full"], 2),
                            (needs["full"] * 0.99, -1)]:
        c = cost_micro_batches(model, rows, seq, 0, 4, modes, limit)
        assert c.mode[0] == expected
        assert np.isfinite(c.time_ms[0]) == (expected >= 0)


def test_per_micro_batch_rule_is_no_bound_for_a_mix():
    """The counterexample of cost_model.memory_needed's docstring: two micro-batches that each
    need 10 of a limit of 10 peak at 15 together under 1F1B (the simulator is the truth)."""
    from dynapipe_ext.cost_model import StageCostArrays
    from dynapipe_ext.schedules import one_f_one_b
    from dynapipe_ext.simulator import PipelineCosts, simulate
    kept = np.array([[5.0, 0.0], [5.0, 0.0]])          # [stage][micro-batch]: A keeps 5
    transient = np.array([[0.0, 10.0], [0.0, 10.0]])   # B's transient peak is 10
    zeros = np.zeros((2, 2))
    need = memory_needed(StageCostArrays(zeros, zeros, kept, transient, np.ones(2, bool)))
    assert need.tolist() == [10.0, 10.0]
    costs = PipelineCosts(np.ones((2, 2)), np.ones((2, 2)), kept.T, transient.T)
    assert simulate(one_f_one_b(2, 2), costs).max_peak_memory_bytes == 15.0


def test_whole_stage_full_recompute_keeps_the_stage_input_and_rematerialises_every_layer():
    per_layer = AnalyticCostModel(GPT, full_recompute="layer")
    per_stage = AnalyticCostModel(GPT, full_recompute="stage")
    args = (np.array([4]), np.array([256]), np.array([0]), 2)
    none = per_layer.stage_cost_arrays(*args, "none")
    layer = per_layer.stage_cost_arrays(*args, "full")
    stage = per_stage.stage_cost_arrays(*args, "full")
    hidden = 4 * 4 * 256 * GPT.hidden_size          # fp32 [seq, rows, hidden]
    # stage 1 keeps only its received input; stage 0 (no input) only the output it sends on
    assert stage.activation_bytes[:, 0].tolist() == [hidden, hidden]
    assert (stage.activation_bytes < layer.activation_bytes).all()
    # its backward holds every layer's no-recompute activations at once
    assert (stage.peak_bytes[:, 0] >= none.activation_bytes[:, 0] - hidden).all()
    assert (stage.peak_bytes > layer.peak_bytes).all()
    with pytest.raises(ValueError, match="full_recompute"):
        AnalyticCostModel(GPT, full_recompute="block")


def test_dropout_masks_add_kept_bytes():
    args = (np.array([2]), np.array([128]), np.array([0]), 1, "none")
    def kept(**options):
        return AnalyticCostModel(GPT, **options).stage_cost_arrays(*args).activation_bytes[0, 0]
    s, b, h, a = 128, 2, GPT.hidden_size, GPT.num_attention_heads
    # per GPT layer, fp32: 2 one-byte sbh masks x 2 (x 8 layers); an unfused attention also
    # keeps 3 more a*s^2*b copies (its dropout mask and dropped-out scores)
    assert kept(dropout=True) - kept() == pytest.approx(8 * 2 * (2 * s * b * h))
    unfused = dict(fused_attention=False)
    assert kept(dropout=True, **unfused) - kept(**unfused) == pytest.approx(
        8 * 2 * (2 * s * b * h + 3 * a * b * s * s))


def test_fused_attention_keeps_no_s_squared_activations():
    s, b, a = 1024, 2, GPT.num_attention_heads
    def kept(seq, **options):
        return AnalyticCostModel(GPT, **options).stage_cost_arrays(
            np.array([b]), np.array([seq]), np.array([0]), 1, "none").activation_bytes[0, 0]
    # doubling the length doubles what the fused attention keeps (linear in s)...
    linear = kept(2 * s) / kept(s)
    assert kept(2 * s, fused_attention=False) / kept(s, fused_attention=False) > linear
    # ...up to the head's logits, which are linear too
    assert linear == pytest.approx(2.0, rel=1e-9)


def test_gated_mlp_has_three_matrices_and_matches_the_built_layer():
    """T5 v1.1's gated GeLU: an MLP of 3 h x f matrices in parameters, flops and kept
    activations; the parameter count equals a built encoder layer's (no biases, RMSNorm
    weights aside)."""
    import dataclasses

    import torch

    from dynapipe_ext.cost_profile import profile_file_name, profile_key
    from dynapipe_ext.model_spec import EMBEDDING, ENC_LAYER
    v11 = dataclasses.replace(T5, gated_linear_unit=True, add_bias_linear=False,
                              normalization="RMSNorm", position_embedding_type="relative")
    h, f = T5.hidden_size, T5.ffn_size
    plain, gated = AnalyticCostModel(T5), AnalyticCostModel(v11)
    assert gated.layer_params(ENC_LAYER) - plain.layer_params(ENC_LAYER) == h * f
    fwd_plain = plain.stage_costs(1, 256, 64, 2)[0]
    fwd_gated = gated.stage_costs(1, 256, 64, 2)[0]
    assert fwd_gated.fwd_ms > fwd_plain.fwd_ms
    assert fwd_gated.activation_bytes > fwd_plain.activation_bytes
    # relative buckets keep a float score bias per self-attention: grows with s^2
    rel = AnalyticCostModel(dataclasses.replace(T5, position_embedding_type="relative"))
    (small,), (big,) = rel.stage_costs(1, 128, 32, 1), rel.stage_costs(1, 256, 32, 1)
    (small0,), (big0,) = plain.stage_costs(1, 128, 32, 1), plain.stage_costs(1, 256, 32, 1)
    extra_small = small.activation_bytes - small0.activation_bytes
    extra_big = big.activation_bytes - big0.activation_bytes
    assert extra_small > 0 and extra_big - extra_small > 2 * extra_small   # ~4x: quadratic
    # no learned position table with relative buckets
    assert plain.layer_params(EMBEDDING) - gated.layer_params(EMBEDDING) == \
        T5.max_position_embeddings * h
    key_plain, key_gated = profile_key(T5, 1, "cpu", "float32"), profile_key(v11, 1, "cpu",
                                                                             "float32")
    assert "gated_linear_unit" not in key_plain and key_gated["gated_linear_unit"] is True
    assert profile_file_name(key_plain) != profile_file_name(key_gated)

    from megatron.model.stages import StageModule, build_transformer_config
    from multiproc import single_process_world
    small = dataclasses.replace(v11, num_layers=1, num_decoder_layers=1, hidden_size=32,
                                num_attention_heads=4, ffn_hidden_size=48, vocab_size=128)
    with single_process_world(seed=1):
        stage = StageModule(small, 1, 0, build_transformer_config(small), False)
    layer = stage.encoder.layers[0]
    counted = sum(p.numel() for n, p in layer.named_parameters() if "layernorm" not in n)
    assert counted == AnalyticCostModel(small).layer_params(ENC_LAYER)
