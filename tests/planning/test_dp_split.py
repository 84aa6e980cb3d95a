"""The DynaPipe split DP is the exact optimum of sum t / D + (P - 1) max t over contiguous
splits: checked against enumerating all 2^(n-1) splits."""
import itertools

import numpy as np
import pytest

from dynapipe_ext.costs.cost_model import AnalyticCostModel, cost_micro_batches
from dynapipe_ext.batching.dp_split import makespan_objective, optimal_split
from dynapipe_ext.costs.model_spec import ModelSpec
from dynapipe_ext.batching.ordering import length_order, t5_order
from dynapipe_ext.batching.planners import PlannerConfig, plan_micro_batches


def all_splits(n):
    """Every way to cut positions 0..n-1 into contiguous segments, as lists of (start, end)."""
    for cuts in itertools.product((False, True), repeat=n - 1):
        ends = [j + 1 for j, cut in enumerate(cuts) if cut] + [n]
        yield list(zip([0] + ends[:-1], ends))


def brute_force(segment_time, n, stages, dp):
    """Min objective over all contiguous splits; segment_time(a, b) -> time or inf."""
    cache = {}

    def cached(a, b):
        if (a, b) not in cache:
            cache[a, b] = segment_time(a, b)
        return cache[a, b]

    best = np.inf
    for segs in all_splits(n):
        times = [cached(a, b) for a, b in segs]
        if all(np.isfinite(times)):
            best = min(best, makespan_objective(times, stages, dp))
    return best


def test_objective_is_sum_over_dp_plus_bubble_term():
    assert makespan_objective([1.0, 3.0, 2.0], 4, 2) == pytest.approx(6.0 / 2 + 3 * 3.0)
    assert makespan_objective([], 4) == 0.0


@pytest.mark.parametrize("seed", range(40))
def test_table_split_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 15))
    width = int(rng.integers(1, n + 1))
    table = rng.random((n, width)) * 10
    if seed % 2:
        table = np.round(table)          # many ties between segment times
    table[rng.random((n, width)) < 0.25] = np.inf
    table[:, 0] = np.where(np.isfinite(table[:, 0]), table[:, 0], 5.0)
    stages, dp = int(rng.integers(1, 9)), int(rng.integers(1, 4))

    def seg(a, b):
        return table[b - 1, b - a - 1] if b - a <= width else np.inf

    split = optimal_split(table, stages, dp, probes=int(rng.integers(1, 6)))
    assert split.objective == pytest.approx(brute_force(seg, n, stages, dp), rel=1e-9)
    # the returned split is real: its segments tile 0..n and its times are the table's
    assert split.segments()[0][0] == 0 and split.ends[-1] == n
    assert all(seg(a, b) == t for (a, b), t in zip(split.segments(), split.times))
    assert split.objective == pytest.approx(makespan_objective(split.times, stages, dp))


@pytest.mark.parametrize("seed", range(12))
def test_upper_bound_keeps_the_optimum_or_reports_none(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 15))
    table = np.round(rng.random((n, n)) * 10, 1) + 0.1
    table[rng.random((n, n)) < 0.3] = np.inf
    table[:, 0] = np.where(np.isfinite(table[:, 0]), table[:, 0], 5.0)
    best = optimal_split(table, 4, 1 + seed % 3)
    above = optimal_split(table, 4, 1 + seed % 3, upper_bound=best.objective * 1.001)
    assert above.objective == pytest.approx(best.objective) and above.ends == best.ends
    assert optimal_split(table, 4, 1 + seed % 3, upper_bound=best.objective) is None


def test_no_feasible_split_is_an_error():
    table = np.array([[1.0, np.inf], [np.inf, np.inf]])
    with pytest.raises(ValueError, match="position 1"):
        optimal_split(table, 2)


def _planner_brute_force(lengths, config, cost_model):
    """Brute force over splits of the planner's own order, costing each segment directly."""
    if config.model == "gpt":
        order = length_order(lengths)
        enc, dec = lengths[order], np.zeros(len(order), dtype=np.int64)
    else:
        order = t5_order(lengths[:, 0], lengths[:, 1], config.t5_order)
        enc, dec = lengths[order, 0], lengths[order, 1]
    r = config.round_to

    def seg(a, b):
        s = min(-(-int(enc[a:b].max()) // r) * r, config.max_seq_len)
        d = min(-(-int(dec[a:b].max()) // r) * r, config.max_dec_seq_len) \
            if config.model == "t5" else 0
        c = cost_micro_batches(cost_model, np.array([b - a]), np.array([s]), np.array([d]),
                               config.pipeline_stages, config.recompute_modes,
                               config.memory_limit_bytes)
        return float(c.time_ms[0])

    return brute_force(seg, len(order), config.pipeline_stages, config.data_parallel)


GPT_SPEC = ModelSpec("gpt", num_layers=4, hidden_size=256, num_attention_heads=4, vocab_size=1000)
T5_SPEC = ModelSpec("t5", num_layers=2, hidden_size=256, num_attention_heads=4, vocab_size=1000,
                    num_decoder_layers=2)


@pytest.mark.parametrize("seed", range(6))
def test_gpt_dynamic_plan_is_brute_force_optimum(seed):
    rng = np.random.default_rng(100 + seed)
    n = int(rng.integers(8, 15))
    lengths = np.minimum(np.exp(rng.normal(4.5, 1.0, n)).astype(np.int64) + 1, 1024)
    cost = AnalyticCostModel(GPT_SPEC, device_flops=1e12)
    stages = [1, 2, 4][seed % 3]
    # a memory limit that makes long segments infeasible and some need recompute
    limit = [2e8, 8e7, 3e8][seed % 3]
    config = PlannerConfig(model="gpt", max_seq_len=1024, pipeline_stages=stages,
                           data_parallel=1 + seed % 2, memory_limit_bytes=limit,
                           dynamic_layout="padded")
    plan = plan_micro_batches(lengths, config, cost, "dynamic")
    expected = _planner_brute_force(lengths, config, cost)
    assert plan.info["objective_ms"] == pytest.approx(expected, rel=1e-9)
    assert makespan_objective([mb.time_ms for mb in plan.micro_batches], stages,
                              config.data_parallel) == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("seed", range(6))
def test_t5_dynamic_plan_is_brute_force_optimum(seed):
    rng = np.random.default_rng(200 + seed)
    n = int(rng.integers(8, 15))
    enc = np.minimum(np.exp(rng.normal(4.5, 1.0, n)).astype(np.int64) + 1, 512)
    dec = np.minimum(np.exp(rng.normal(3.0, 1.0, n)).astype(np.int64) + 1, 128)
    lengths = np.stack([enc, dec], axis=1)
    cost = AnalyticCostModel(T5_SPEC, device_flops=1e12)
    config = PlannerConfig(model="t5", max_seq_len=512, max_dec_seq_len=128,
                           pipeline_stages=[1, 2, 4][seed % 3],
                           memory_limit_bytes=[1.5e8, 4e7][seed % 2],
                           t5_order=["snake", "enc", "cluster-tsp"][seed % 3],
                           dynamic_layout="padded")
    plan = plan_micro_batches(lengths, config, cost, "dynamic")
    assert plan.info["objective_ms"] == pytest.approx(
        _planner_brute_force(lengths, config, cost), rel=1e-9)
