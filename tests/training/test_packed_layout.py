"""Padding-free dynamic micro-batches (PlannerConfig.dynamic_layout "packed"): one token stream
per micro-batch, costed by its slots and its samples' attention, never predicted slower than
packing's plan."""
import dataclasses

import numpy as np
import pytest

from dynapipe_ext.costs.cost_model import AnalyticCostModel, memory_needed
from dynapipe_ext.batching.dp_split import makespan_objective
from dynapipe_ext.batching.microbatch import packed_cost_shape, padding_efficiency
from dynapipe_ext.costs.model_spec import ModelSpec
from dynapipe_ext.batching.planners import PlannerConfig, plan_micro_batches, plan_metrics

GPT = ModelSpec("gpt", num_layers=4, hidden_size=256, num_attention_heads=4, vocab_size=1000)
T5 = ModelSpec("t5", num_layers=2, hidden_size=256, num_attention_heads=4, vocab_size=1000,
               num_decoder_layers=2)


def lognormal(n, seed, mean, cap):
    rng = np.random.default_rng(seed)
    return np.minimum(np.exp(rng.normal(mean, 1.0, n)).astype(np.int64) + 1, cap)


def gpt_config(**kw):
    base = dict(model="gpt", max_seq_len=1024, pipeline_stages=2, memory_limit_bytes=4e8,
                dynamic_layout="packed", packing_algorithm="spfhp")
    return PlannerConfig(**dict(base, **kw))


def t5_config(**kw):
    base = dict(model="t5", max_seq_len=1024, max_dec_seq_len=256, pipeline_stages=2,
                memory_limit_bytes=4e8, dynamic_layout="packed")
    return PlannerConfig(**dict(base, **kw))


def test_packed_cost_shape_keeps_slots_and_attention_work():
    rng = np.random.default_rng(0)
    for _ in range(50):
        lengths = rng.integers(8, 2000, rng.integers(1, 40))
        slots = -(-lengths.sum() // 8) * 8
        square = float((lengths.astype(np.float64) ** 2).sum())
        rows, seq, dec = packed_cost_shape(slots, square, 3 * slots)
        assert rows * seq == pytest.approx(slots)            # token-linear work: the slots
        assert rows * seq * seq == pytest.approx(square)     # attention: sum of l_i^2
        assert rows * dec == pytest.approx(3 * slots)        # decoder slots share the rows
        assert rows >= 1 - 1e-12 and seq <= lengths.max() + 1e-9


def test_packed_cost_shape_keeps_lengths_of_at_least_one():
    """A stream mostly of pads (one 1-token sample in 8 slots; a T5 row whose decoder holds
    fewer slots than its encoder's rows would be): still a shape a cost model knows, with the
    slots kept and at least the samples' attention charged."""
    rows, seq, dec = packed_cost_shape([8.0, 1024.0], [1.0, 5 * 10.0 ** 2], [0.0, 40.0])
    np.testing.assert_allclose(rows * seq, [8.0, 1024.0])
    np.testing.assert_allclose(rows * dec, [0.0, 40.0])
    assert (seq >= 1).all() and dec[1] >= 1
    assert (rows * seq * seq >= np.array([1.0, 500.0])).all()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gpt_streams_hold_every_sample_once_with_almost_no_pad(seed):
    lengths = lognormal(300, seed, 4.8, 1024)
    config = gpt_config()
    plan = plan_micro_batches(lengths, config, AnalyticCostModel(GPT), "dynamic")
    assert sorted(plan.sample_ids()) == list(range(len(lengths)))
    assert len(plan.micro_batches) > 1
    for mb in plan.micro_batches:
        assert mb.num_rows == 1                       # one token stream
        real = int(lengths[list(mb.sample_ids)].sum())
        assert mb.seq_len == -(-real // config.round_to) * config.round_to
        assert mb.cost_shape is not None
    assert padding_efficiency(plan, lengths)[0] >= 0.97
    # attention is costed per sample, so none is wasted
    assert plan_metrics(plan, lengths, 2)["attention_efficiency"] == pytest.approx(1.0)


def test_t5_streams_keep_encoder_and_decoder_in_the_same_sample_order():
    lengths = np.stack([lognormal(200, 3, 4.8, 1024), lognormal(200, 4, 3.0, 256)], axis=1)
    plan = plan_micro_batches(lengths, t5_config(), AnalyticCostModel(T5), "dynamic")
    assert sorted(plan.sample_ids()) == list(range(len(lengths)))
    enc_eff, dec_eff = padding_efficiency(plan, lengths)
    assert enc_eff >= 0.97 and dec_eff >= 0.9
    for mb in plan.micro_batches:
        (row,) = mb.rows                              # one row: both streams in this order
        enc, dec = lengths[list(row)].sum(axis=0)
        assert enc <= mb.seq_len < enc + 8 and dec <= mb.dec_seq_len < dec + 8


@pytest.mark.parametrize("stages,replicas", [(1, 1), (2, 1), (4, 1), (2, 2)])
@pytest.mark.parametrize("seed", [0, 5])
def test_packed_dynamic_is_never_predicted_slower_than_packing(stages, replicas, seed):
    lengths = lognormal(400, seed, 5.0, 1024)
    config = gpt_config(pipeline_stages=stages, data_parallel=replicas)
    cost = AnalyticCostModel(GPT, layer_overhead_ms=0.5)
    dynamic = plan_micro_batches(lengths, config, cost, "dynamic")
    for rows in (1, 2, 4, 8):
        packing = plan_micro_batches(lengths, dataclasses.replace(config, micro_batch_size=rows),
                                     cost, "packing")
        times = [mb.time_ms for mb in packing.micro_batches]
        assert dynamic.info["objective_ms"] <= makespan_objective(times, stages, replicas) + 1e-6


def test_packing_plan_is_taken_when_it_is_the_best():
    """Lengths 600, 500, 500, 400 with room for 1,000 tokens per micro-batch and a large
    per-micro-batch cost: no contiguous split of the length order needs fewer than three
    micro-batches, the packer finds two (600+400, 500+500). The planner takes packing's."""
    spec = dataclasses.replace(GPT, max_position_embeddings=1024)
    cost = AnalyticCostModel(spec, layer_overhead_ms=50.0, max_seq_len=1000)
    shape = packed_cost_shape([1000.0], [600.0 ** 2 + 400 ** 2], [0.0])
    limit = float(memory_needed(cost.stage_cost_arrays(*shape, 1))[0]) * 1.0001
    config = gpt_config(max_seq_len=1000, pipeline_stages=1, memory_limit_bytes=limit,
                        packing_algorithm="lpfhp", recompute_modes=("none",))
    plan = plan_micro_batches([600, 500, 500, 400], config, cost, "dynamic")
    assert plan.info["order"] == "packing"
    assert sorted(sorted(mb.sample_ids) for mb in plan.micro_batches) == [[0, 3], [1, 2]]
    padded = plan_micro_batches([600, 500, 500, 400],
                                dataclasses.replace(config, dynamic_layout="padded"), cost,
                                "dynamic")
    # padded rows of 400 + 500 would pad to 1,000 slots: that split is worse still
    assert len(padded.micro_batches) >= 3 and plan.predicted_time_ms < padded.predicted_time_ms


def test_streams_are_halved_to_feed_every_replica():
    lengths = np.full(12, 50)
    plan = plan_micro_batches(lengths, gpt_config(pipeline_stages=1, data_parallel=4),
                              AnalyticCostModel(GPT, layer_overhead_ms=100.0), "dynamic")
    assert all(len(rep) >= 1 for rep in plan.replicas) and len(plan.replicas) == 4
    assert sorted(plan.sample_ids()) == list(range(12))
    assert all(mb.num_rows == 1 for mb in plan.micro_batches)


def test_a_large_per_micro_batch_cost_makes_fewer_larger_streams():
    lengths = lognormal(300, 9, 4.8, 1024)
    counts = [len(plan_micro_batches(lengths, gpt_config(pipeline_stages=1),
                                     AnalyticCostModel(GPT, layer_overhead_ms=ms),
                                     "dynamic").micro_batches) for ms in (0.0, 1.0, 100.0)]
    assert counts[0] >= counts[1] >= counts[2]
    assert counts[2] < counts[0]


def test_host_floor_prices_a_micro_batch_at_max_of_host_and_device():
    """A stage's forward / backward is max(layers x host ms, device time): tiny micro-batches
    cost the floor, large ones their FLOPs, never the sum."""
    plain = AnalyticCostModel(GPT, device_flops=1e12)
    floored = AnalyticCostModel(GPT, device_flops=1e12, host_fwd_ms_per_layer=2.0,
                                host_bwd_ms_per_layer=3.0)
    rows, seq = np.array([1.0, 64.0]), np.array([16.0, 1024.0])
    base = plain.stage_cost_arrays(rows, seq, np.zeros(2), 2)
    got = floored.stage_cost_arrays(rows, seq, np.zeros(2), 2)
    layers = 2          # 4 layers over 2 stages
    np.testing.assert_allclose(got.fwd_ms, np.maximum(base.fwd_ms, layers * 2.0))
    np.testing.assert_allclose(got.bwd_ms, np.maximum(base.bwd_ms, layers * 3.0))
    assert (got.fwd_ms[:, 0] == layers * 2.0).all()           # host-bound
    assert (got.fwd_ms[:, 1] > layers * 2.0).all()            # device-bound
    np.testing.assert_array_equal(got.activation_bytes, base.activation_bytes)


def test_gpu_analytic_model_has_a_host_floor_and_the_cpu_none():
    from megatron.planning import device_costs
    gpu = AnalyticCostModel(GPT, **device_costs.analytic_device_options("cuda"))
    cpu = AnalyticCostModel(GPT, **device_costs.analytic_device_options("cpu"))
    assert min(gpu.host_ms_per_layer) >= 1.0 and cpu.host_ms_per_layer == (0.0, 0.0)
    # with it, a GPU plan of a FLAN-like batch cuts fewer micro-batches (a small model: its
    # micro-batches are host-bound)
    lengths = lognormal(400, 2, 5.0, 1024)
    config = gpt_config(pipeline_stages=2, memory_limit_bytes=4e10)
    fewer = plan_micro_batches(lengths, config, AnalyticCostModel(
        GPT, device_flops=3e14, **device_costs.analytic_device_options("cuda")), "dynamic")
    more = plan_micro_batches(lengths, config, AnalyticCostModel(
        GPT, device_flops=3e14, half_rate_tokens=512.0), "dynamic")
    assert len(fewer.micro_batches) < len(more.micro_batches)


def test_packing_rows_stay_rows_when_halved_for_replicas():
    """A packing micro-batch of several rows is split by rows to feed every replica (its rows
    keep the packed length); only a single packed row is split into two streams."""
    lengths = np.full(40, 100)                      # 4 rows of 1,000 tokens
    config = gpt_config(max_seq_len=1000, pipeline_stages=1, data_parallel=2,
                        micro_batch_size=8, packing_algorithm="nextfit")
    plan = plan_micro_batches(lengths, config, AnalyticCostModel(GPT), "packing")
    assert len(plan.micro_batches) == 2
    assert all(mb.num_rows == 2 and mb.seq_len == 1000 for mb in plan.micro_batches)
    assert sorted(plan.sample_ids()) == list(range(40))
