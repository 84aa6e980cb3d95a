"""AnalyticCostModel: monotone in shape, recompute trades time for memory, limits respected."""
import dataclasses

import numpy as np
import pytest

from dynapipe_ext.costs.cost_model import (AnalyticCostModel, CostModel, cost_micro_batches,
                                     memory_needed)
from dynapipe_ext.costs.model_spec import ModelSpec

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


def test_large_micro_batches_outgrow_the_caches_where_cache_tokens_is_set():
    """cache_tokens prices every flop of a T-token micro-batch 1 + T / cache_tokens slower
    (on a CPU, 8,192-token streams run slower per token than 512-token ones); None leaves
    the rate as it was."""
    plain = AnalyticCostModel(GPT, half_rate_tokens=16, layer_overhead_ms=0)
    cached = AnalyticCostModel(GPT, half_rate_tokens=16, cache_tokens=4096.0, layer_overhead_ms=0)
    for b, s in [(1, 512), (4, 2048), (1, 8192)]:
        assert totals(cached, b, s, 0)[0] == pytest.approx(
            totals(plain, b, s, 0)[0] * (1 + b * s / 4096))
    # per token, a large micro-batch now costs more than two halves of it
    assert totals(cached, 1, 8192, 0)[0] > 2 * totals(cached, 1, 4096, 0)[0] * 1.3
    with pytest.raises(ValueError, match="cache_tokens"):
        AnalyticCostModel(GPT, cache_tokens=0)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_t5_decoder_side_runs_at_the_rate_of_its_own_tokens(recompute):
    """Small operations run below peak by the tokens they see: T5's decoder layers, decoder
    embedding and output layer at the decoder's b * d tokens, the cross-attention's keys and
    values and the encoder side at the encoder's b * s (a 2 x 512 / 32 micro-batch's decoder
    runs 64 tokens, not 1024)."""
    half, b, s, d = 64.0, 2.0, 512.0, 32.0
    peak = AnalyticCostModel(T5, half_rate_tokens=0, layer_overhead_ms=0)
    slow = AnalyticCostModel(T5, half_rate_tokens=half, layer_overhead_ms=0)
    enc, dec = (b * s + half) / (b * s), (b * d + half) / (b * d)
    # stage 0: the encoder side alone (embedding, 4 encoder layers, its final norm)
    cut = [peak.stage_costs(b, s, d, 2, recompute), slow.stage_costs(b, s, d, 2, recompute)]
    assert cut[1][0].fwd_ms == pytest.approx(cut[0][0].fwd_ms * enc)
    assert cut[1][0].bwd_ms == pytest.approx(cut[0][0].bwd_ms * enc)
    # stage 1: the decoder side; the encoder's final norm and the cross-attention's K and V
    # run over the encoder's tokens
    h = T5.hidden_size
    kv = (T5.num_decoder_layers * 2 * b * s * 2 * h * h + 2 * b * s * h) * 1e3 / peak.device_flops
    kv_bwd = kv * 2 + (kv - 2 * b * s * h * 1e3 / peak.device_flops) * (recompute == "full")
    assert cut[1][1].fwd_ms == pytest.approx((cut[0][1].fwd_ms - kv) * dec + kv * enc)
    assert cut[1][1].bwd_ms == pytest.approx((cut[0][1].bwd_ms - kv_bwd) * dec + kv_bwd * enc)


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

    def activation_memory_limit(self, num_stages=None, stage_to_rank=None):
        return self.inner.activation_memory_limit(num_stages, stage_to_rank)


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
    from dynapipe_ext.costs.cost_model import StageCostArrays
    from dynapipe_ext.schedule.schedules import one_f_one_b
    from dynapipe_ext.schedule.simulator import PipelineCosts, simulate
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

    from dynapipe_ext.costs.cost_profile import profile_file_name, profile_key
    from dynapipe_ext.costs.model_spec import EMBEDDING, ENC_LAYER
    v11 = dataclasses.replace(T5, gated_linear_unit=True, add_bias_linear=False,
                              normalization="RMSNorm", position_embedding_type="relative")
    h, f = T5.hidden_size, T5.ffn_size
    plain, gated = AnalyticCostModel(T5), AnalyticCostModel(v11)
    # the gate's h x f, less the plain layer's biases (q, k, v, projection, fc1, fc2)
    assert gated.layer_params(ENC_LAYER) - plain.layer_params(ENC_LAYER) == h * f - 5 * h - f
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
    from tests.multiproc import single_process_world
    small = dataclasses.replace(v11, num_layers=1, num_decoder_layers=1, hidden_size=32,
                                num_attention_heads=4, ffn_hidden_size=48, vocab_size=128)
    with single_process_world(seed=1):
        stage = StageModule(small, 1, 0, build_transformer_config(small), False)
    layer = stage.encoder.layers[0]
    counted = sum(p.numel() for n, p in layer.named_parameters() if "layernorm" not in n)
    assert counted == AnalyticCostModel(small).layer_params(ENC_LAYER)


# ------------------------------------------------------------------ GPT half layers (pipeline_cut)

from dynapipe_ext.costs.cost_model import half_layer_shares                          # noqa: E402
from dynapipe_ext.costs.model_spec import (EMBEDDING, GPT_ATTENTION, GPT_LAYER,      # noqa: E402
                                     GPT_MLP, HEAD, balanced_cut)

HALF_OPTIONS = [dict(), dict(tp=2), dict(dropout=True, fused_attention=False),
                dict(sigmoid_gelu=True, dtype_bytes=2)]


@pytest.mark.parametrize("options", HALF_OPTIONS)
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_attention_and_mlp_halves_add_up_to_the_gpt_layer(options, recompute):
    model = AnalyticCostModel(GPT, **options)
    b, s = np.array([1.0, 3.0, 8.0, 2.0]), np.array([64.0, 512.0, 128.0, 4096.0])
    d = np.zeros_like(b)
    whole = model._layer_cost(GPT_LAYER, b, s, d, recompute)
    attention = model._layer_cost(GPT_ATTENTION, b, s, d, recompute)
    mlp = model._layer_cost(GPT_MLP, b, s, d, recompute)
    names = ("fwd flops", "recompute flops", "kept bytes", "transient bytes")
    assert np.all(attention[0] > 0) and np.all(mlp[0] > 0)
    for name, w, a, m in zip(names, whole, attention, mlp):
        if name == "kept bytes" and recompute == "full":
            # each half is its own checkpoint unit and keeps its own input: the layer input
            np.testing.assert_allclose(a, w, rtol=1e-12)
            np.testing.assert_allclose(m, w, rtol=1e-12)
        else:
            np.testing.assert_allclose(a + m, w, rtol=1e-12, err_msg=name)
    assert model.layer_params(GPT_ATTENTION) + model.layer_params(GPT_MLP) == \
        model.layer_params(GPT_LAYER)


def test_half_layers_split_as_the_attention_and_mlp_blocks():
    """The attention half holds the s^2 work and the QKV / projection weights, the MLP half
    work linear in s and the h x ffn weights; with dropout and an unfused attention at 2-byte
    precision, the halves keep Korthikanti et al.'s attention block + its norm
    (s b h (13 + 5 a s / h)) and MLP block + its norm (21 s b h), 34 + 5 a s / h in all."""
    model = AnalyticCostModel(GPT, dropout=True, fused_attention=False, dtype_bytes=2)
    h, f, a = GPT.hidden_size, GPT.ffn_size, GPT.num_attention_heads
    b, s = np.array([2.0, 2.0]), np.array([256.0, 512.0])

    def cost(kind, recompute="none"):
        return model._layer_cost(kind, b, s, np.zeros_like(b), recompute)
    mlp_fwd, att_fwd = cost(GPT_MLP)[0], cost(GPT_ATTENTION)[0]
    assert mlp_fwd[1] == pytest.approx(2 * mlp_fwd[0]) and att_fwd[1] > 2.1 * att_fwd[0]
    assert model.layer_params(GPT_ATTENTION) == 4 * h * h + 4 * h     # + q, k, v, proj biases
    assert model.layer_params(GPT_MLP) == 2 * h * f + f + h
    sbh = s * b * h
    np.testing.assert_allclose(cost(GPT_ATTENTION)[2], sbh * (13 + 5 * a * s / h))
    np.testing.assert_allclose(cost(GPT_MLP)[2], sbh * 21)
    np.testing.assert_allclose(cost(GPT_LAYER)[2], sbh * (34 + 5 * a * s / h))
    # selective recompute redoes only attention-core work
    assert np.all(cost(GPT_MLP, "selective")[1] == 0) and np.all(cost(GPT_ATTENTION,
                                                                      "selective")[1] > 0)


CUT_GPT = ModelSpec("gpt", num_layers=4, hidden_size=512, num_attention_heads=8,
                    vocab_size=5000)


def cut(spec, units):
    import dataclasses
    return dataclasses.replace(spec, pipeline_cut=units)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_a_cut_inside_a_layer_moves_work_between_stages_and_keeps_the_total(recompute):
    even, uneven = AnalyticCostModel(CUT_GPT), AnalyticCostModel(cut(CUT_GPT, (5, 3)))
    assert uneven.spec.stage_layers(2) == [(EMBEDDING, GPT_LAYER, GPT_LAYER, GPT_ATTENTION),
                                           (GPT_MLP, GPT_LAYER, HEAD)]
    b, s = np.array([1.0, 4.0, 2.0]), np.array([128.0, 512.0, 2048.0])
    a, c = (m.stage_cost_arrays(b, s, np.zeros_like(b), 2, recompute) for m in (even, uneven))
    np.testing.assert_allclose(c.fwd_ms.sum(axis=0), a.fwd_ms.sum(axis=0), rtol=1e-12)
    np.testing.assert_allclose(c.bwd_ms.sum(axis=0), a.bwd_ms.sum(axis=0), rtol=1e-12)
    # the cut layer's halves keep its input twice under full recompute (one per half)
    extra = 4 * b * s * CUT_GPT.hidden_size if recompute == "full" else 0.0
    np.testing.assert_allclose(c.activation_bytes.sum(axis=0),
                               a.activation_bytes.sum(axis=0) + extra, rtol=1e-12)
    # the head makes the last stage heavier; moving an MLP half off it evens it out (at
    # lengths where the head's share is that large: at 2048, attention dominates)
    def imbalance(arrays):
        time = (arrays.fwd_ms + arrays.bwd_ms)[:, :2]
        return time.max(axis=0) / time.min(axis=0)
    assert np.all(imbalance(a) > 1.2)
    assert np.all(imbalance(c) < imbalance(a))
    # the attention half of layer 2 moved to stage 0: its parameters' states with it
    moved = uneven.layer_params(GPT_ATTENTION) * uneven.bytes_per_param_state
    assert moved > 0
    np.testing.assert_allclose(np.subtract(uneven.model_state_bytes(2), even.model_state_bytes(2)),
                               [moved, -moved])


def test_a_half_layer_counts_half_a_layer_of_overhead():
    def fwd(spec, overhead):
        model = AnalyticCostModel(spec, layer_overhead_ms=overhead)
        return model.stage_cost_arrays(np.array([2]), np.array([128]), np.array([0]), 2).fwd_ms
    for units in [(5, 3), (1, 7), (4, 4)]:
        spec = cut(CUT_GPT, units)
        added = fwd(spec, 1.0) - fwd(spec, 0.0)
        np.testing.assert_allclose(added[:, 0], np.array(units) / 2)


def test_whole_stage_recompute_of_half_layer_stages():
    model = AnalyticCostModel(cut(CUT_GPT, (5, 3)), full_recompute="stage")
    args = (np.array([4.0]), np.array([256.0]), np.array([0.0]), 2)
    full, none = model.stage_cost_arrays(*args, "full"), model.stage_cost_arrays(*args, "none")
    hidden = 4 * 4 * 256 * CUT_GPT.hidden_size
    assert full.activation_bytes[:, 0].tolist() == [hidden, hidden]
    assert np.all(full.peak_bytes[:, 0] >= none.activation_bytes[:, 0] - hidden)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_half_layer_shares_are_the_analytic_halves_over_the_whole(recompute):
    model = AnalyticCostModel(GPT, tp=2)
    b, s = np.array([1.0, 4.0]), np.array([64.0, 2048.0])
    shares = half_layer_shares(GPT, 2, b, s, recompute)
    att, mlp = shares[GPT_ATTENTION], shares[GPT_MLP]
    for name in ("fwd_ms", "bwd_ms", "param_count"):
        np.testing.assert_allclose(att[name] + mlp[name], 1.0, rtol=1e-12)
    kept_sum = 2.0 if recompute == "full" else 1.0
    np.testing.assert_allclose(att["activation_bytes"] + mlp["activation_bytes"], kept_sum)
    fwd = model._layer_cost(GPT_ATTENTION, b, s, 0 * b, recompute)[0]
    np.testing.assert_allclose(att["fwd_ms"],
                               fwd / model._layer_cost(GPT_LAYER, b, s, 0 * b, recompute)[0])
    # attention's share grows with the length (s^2 work)
    assert att["fwd_ms"][1] > att["fwd_ms"][0]


# ------------------------------------------------------------------ model_spec: the cut itself

def test_stage_layers_under_a_cut():
    spec = cut(CUT_GPT, (1, 2, 2, 3))
    assert spec.stage_layers(4) == [(EMBEDDING, GPT_ATTENTION), (GPT_MLP, GPT_ATTENTION),
                                    (GPT_MLP, GPT_ATTENTION), (GPT_MLP, GPT_LAYER, HEAD)]
    assert [spec.stage_first_layer(4, k) for k in range(4)] == [0, 0, 1, 2]
    whole = cut(CUT_GPT, (4, 4))
    assert whole.stage_layers(2) == CUT_GPT.stage_layers(2)
    # every half-layer unit is in exactly one stage, in order
    for units in [(5, 3), (3, 5), (1, 7), (2, 1, 5), (8,)]:
        stages = cut(CUT_GPT, units).stage_layers(len(units))
        flat = [k for kinds in stages for k in kinds if k not in (EMBEDDING, HEAD)]
        halves = [h for k in flat for h in ((GPT_ATTENTION, GPT_MLP) if k == GPT_LAYER
                                            else (k,))]
        assert halves == [GPT_ATTENTION, GPT_MLP] * CUT_GPT.num_layers, units
        assert [sum(2 if k == GPT_LAYER else 1 for k in kinds if k not in (EMBEDDING, HEAD))
                for kinds in stages] == list(units)


@pytest.mark.parametrize("units, message", [
    ((5, 4), "sum to that"), ((0, 8), "at least one"), ((9, -1), "at least one")])
def test_invalid_cuts_are_rejected(units, message):
    with pytest.raises(ValueError, match=message):
        cut(CUT_GPT, units)


def test_cut_needs_gpt_and_the_right_stage_count():
    with pytest.raises(ValueError, match="GPT only"):
        cut(T5, (8, 8))
    with pytest.raises(ValueError, match="is for 2 stages, not 4"):
        cut(CUT_GPT, (5, 3)).stage_layers(4)


def test_balanced_cut_is_the_best_of_all_cuts():
    import itertools
    rng = np.random.default_rng(7)
    for _ in range(60):
        n = int(rng.integers(1, 9))
        stages = int(rng.integers(1, n + 1))
        costs = rng.integers(1, 20, n).astype(float) if rng.random() < 0.5 else rng.random(n)
        best = min(max(sum(costs[i:j]) for i, j in zip((0,) + c, c + (n,)))
                   for c in itertools.combinations(range(1, n), stages - 1))
        runs = balanced_cut(costs, stages)
        assert len(runs) == stages and sum(runs) == n and min(runs) >= 1
        ends = np.cumsum(runs)
        assert max(costs[e - r:e].sum() for e, r in zip(ends, runs)) == pytest.approx(best)
    with pytest.raises(ValueError, match="cannot cut 3 units into 4"):
        balanced_cut([1, 2, 3], 4)
    with pytest.raises(ValueError, match="cannot cut 3 units into 0"):
        balanced_cut([1, 2, 3], 0)


def test_analytic_balanced_cut_gives_a_large_output_layer_fewer_half_layers():
    from dynapipe_ext.costs.cost_model import analytic_balanced_cut
    small_vocab = ModelSpec("gpt", 8, 256, 4, 256)
    large_vocab = ModelSpec("gpt", 8, 256, 4, 65536)
    assert analytic_balanced_cut(small_vocab, 2, 256) == (8, 8)
    cut = analytic_balanced_cut(large_vocab, 2, 256)
    assert sum(cut) == 16 and cut[1] < cut[0]
    # the cut it picks is the least max-stage time of all cuts, by the model's own stage costs
    def slowest(units):
        model = AnalyticCostModel(dataclasses.replace(large_vocab, pipeline_cut=units),
                                  num_stages=2)
        arrays = model.stage_cost_arrays(np.array([1.0]), np.array([256.0]), np.array([0.0]), 2)
        return float((arrays.fwd_ms + arrays.bwd_ms).max())
    assert slowest(cut) == min(slowest((k, 16 - k)) for k in range(1, 16))


def test_token_weighted_length_is_the_sample_length_of_an_average_token():
    from dynapipe_ext.costs.model_spec import token_weighted_length
    assert token_weighted_length([2, 4], 100) == pytest.approx((4 + 16) / 6)
    assert token_weighted_length([2, 4], 3) == pytest.approx((4 + 9) / 5)     # cut at max_len
    assert token_weighted_length([[1, 1], [3, 1]], 100) == pytest.approx((4 + 16) / 6)  # T5 parts


def test_grouped_query_attention_shrinks_k_and_v_in_params_flops_and_kept_bytes():
    """With 8 heads in 2 query groups, K and V are a quarter of MHA's: the attention half's
    parameters are (2 + 2/4) h^2 / tp instead of 4 h^2 / tp, and its linear flops and kept
    Q/K/V bytes shrink; the MLP is untouched. Model FLOPs (MFU) count the smaller K and V."""
    from dynapipe_ext.batching.model_flops import real_flops
    mha = ModelSpec("gpt", num_layers=2, hidden_size=64, num_attention_heads=8,
                    vocab_size=1000)
    gqa = dataclasses.replace(mha, num_query_groups=2)
    h = 64
    a, g = AnalyticCostModel(mha, tp=2), AnalyticCostModel(gqa, tp=2)
    assert a.layer_params("gpt_attention") == (4 * h * h + 3 * h) / 2 + h     # biases: q, k, v
    assert g.layer_params("gpt_attention") == ((2 + 2 * 2 / 8) * h * h + 1.5 * h) / 2 + h
    assert g.layer_params("gpt_mlp") == a.layer_params("gpt_mlp")
    b, s = np.array([2.0]), np.array([128.0])
    full, grouped = a._attention_terms(b, s), g._attention_terms(b, s)
    assert grouped.lin[0] == pytest.approx(full.lin[0] * (2 + 0.5) / 4)
    assert grouped.kept_lin[0] < full.kept_lin[0]
    assert sum(g.model_state_bytes(1)) < sum(a.model_state_bytes(1))
    per_token_saved = 3 * 2 * 2 * h * (h - 2 * h // 8) * mha.num_layers   # K and V rows
    assert real_flops(mha, [100]) - real_flops(gqa, [100]) == pytest.approx(
        100 * per_token_saved)
    with pytest.raises(ValueError, match="--num-query-groups 3 must be > 0 and divide"):
        dataclasses.replace(mha, num_query_groups=3)


@pytest.mark.parametrize("options", [{}, {"kv_channels": 8}, {"kv_channels": 32},
                                     {"num_query_groups": 2}, {"gated_linear_unit": True},
                                     {"swiglu": True, "num_query_groups": 2}])
def test_layer_linear_flops_are_the_model_flops_count(options):
    """The analytic model's linear flops of a layer equal model_flops' count (the MFU
    numerator) for every attention width: --kv-channels 8 at 8 heads makes Q, K, V, the core
    and the projection a quarter of hidden 256 wide (T5 v1.1's d_kv works so), GQA shrinks K
    and V; the attention core's flops scale with the width too, and causal attention (GPT,
    T5's decoder) counts half the pairs (a query and its earlier keys)."""
    from dynapipe_ext.batching.model_flops import _per_token_linear
    b, s, d = np.array([2.0]), np.array([96.0]), np.array([40.0])
    gpt = ModelSpec("gpt", num_layers=2, hidden_size=256, num_attention_heads=8,
                    vocab_size=1000, **options)
    layer, cross_q_out, cross_kv = _per_token_linear(gpt)
    terms = AnalyticCostModel(gpt, tp=2)._layer_terms("gpt_layer", b, s, d)
    assert terms.lin[0] == pytest.approx(layer * 2 * 96 / 2)
    # causal: the pairs of a query and its earlier keys, as model_flops counts them
    assert terms.att[0] == pytest.approx(4 * 2 * (96 * 97 / 2) * gpt.attention_width / 2)
    if "num_query_groups" in options:
        return                      # T5 has no grouped-query attention (nor rotary SwiGLU)
    t5 = ModelSpec("t5", num_layers=1, num_decoder_layers=1, hidden_size=256,
                   num_attention_heads=8, vocab_size=1000, **options)
    layer, cross_q_out, cross_kv = _per_token_linear(t5)
    dec = AnalyticCostModel(t5)._layer_terms("dec_layer", b, s, d)
    assert dec.lin[0] == pytest.approx((layer + cross_q_out) * 2 * 40 + cross_kv * 2 * 96)
    assert dec.att[0] == pytest.approx(4 * 2 * (40 * 41 / 2 + 96 * 40) * t5.attention_width)
    enc = AnalyticCostModel(t5)._layer_terms("enc_layer", b, s, d)       # bidirectional
    assert enc.att[0] == pytest.approx(4 * 2 * 96 * 96 * t5.attention_width)
    narrow = AnalyticCostModel(t5).layer_params("dec_layer")
    assert (narrow < AnalyticCostModel(dataclasses.replace(t5, kv_channels=0))
            .layer_params("dec_layer")) == (t5.attention_width < 256)


def test_rank_cost_model_folds_a_layouts_stages_onto_their_ranks():
    """RankCostModel: rank r's times and kept bytes are the sums over the stages the layout
    gives it, its transient peak their largest, its model states theirs together; the
    activation limit follows from the busiest rank's states."""
    from dynapipe_ext.costs.cost_model import RankCostModel
    spec = dataclasses.replace(GPT, pipeline_cut=(5, 3, 3, 5))   # 16 half layers, 4 stages
    inner = AnalyticCostModel(spec, device_mem_bytes=2**30)
    wave = (0, 1, 1, 0)
    ranks = RankCostModel(inner, wave)
    rows, seq, dec = np.array([2, 4]), np.array([256, 512]), np.array([0, 0])
    per_stage = inner.stage_cost_arrays(rows, seq, dec, 4, "selective")
    per_rank = ranks.stage_cost_arrays(rows, seq, dec, 2, "selective")
    for field in ("fwd_ms", "bwd_ms", "activation_bytes"):
        got, stages = getattr(per_rank, field), getattr(per_stage, field)
        np.testing.assert_allclose(got[0], stages[0] + stages[3])
        np.testing.assert_allclose(got[1], stages[1] + stages[2])
    np.testing.assert_allclose(per_rank.peak_bytes[0],
                               np.maximum(per_stage.peak_bytes[0], per_stage.peak_bytes[3]))
    states = inner.model_state_bytes(4)
    assert ranks.model_state_bytes(2) == pytest.approx([states[0] + states[3],
                                                        states[1] + states[2]])
    assert ranks.activation_memory_limit() == pytest.approx(
        inner.activation_memory_limit(4, wave))
    with pytest.raises(ValueError, match="prices the 2 pipeline ranks of its layout, not 4"):
        ranks.stage_cost_arrays(rows, seq, dec, 4)
    with pytest.raises(ValueError, match="leaves a rank without stages"):
        RankCostModel(inner, (0, 2, 2, 0))


@pytest.mark.parametrize("options", [
    dict(),                                          # GPT-2: every linear has a bias
    dict(normalization="RMSNorm", position_embedding_type="rope", swiglu=True,
         num_query_groups=2, add_bias_linear=False),  # Llama / Mistral
    dict(normalization="RMSNorm", position_embedding_type="rope", swiglu=True,
         num_query_groups=2, add_bias_linear=False, add_qkv_bias=True),     # Qwen2
])
def test_layer_params_count_the_layers_as_built_and_profiled(options):
    """The analytic parameters of a GPT layer (SwiGLU's three matrices, GQA's smaller K and V,
    q / k / v biases, the linears' biases) are those of the layer StageModule builds and of the
    one the cost profiler measures, norms aside; rotary positions hold no parameter and a
    learned position table only for learned positions; the profiler's layer turns q and k."""
    from megatron.model.stages import StageModule, build_transformer_config
    from megatron.planning.profile_layers import ProfiledLayer
    from tests.multiproc import single_process_world
    spec = ModelSpec("gpt", 1, 32, 4, 128, ffn_hidden_size=48, **options)
    model = AnalyticCostModel(spec)
    with single_process_world(seed=1):
        config = build_transformer_config(spec)
        stage = StageModule(spec, 1, 0, config, False)
        profiled = ProfiledLayer(GPT_LAYER, spec, config)
        embedding = ProfiledLayer(EMBEDDING, spec, config)
    for layer in (stage.decoder.layers[0], profiled.body.layers[0]):
        counted = sum(p.numel() for n, p in layer.named_parameters() if "layernorm" not in n)
        assert counted == model.layer_params(GPT_LAYER)
    assert (profiled.rotary is not None) == spec.rotary
    assert sum(p.numel() for p in embedding.parameters()) == model.layer_params(EMBEDDING)
