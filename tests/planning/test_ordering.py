"""T5 sample orders: every order is a permutation; the clustering + TSP tour is short; the
partition local search never worsens its objective; the planner's chosen order is never worse
than clustering + TSP on FLAN-like multi-task batches; bounded segment tables are exact."""
import itertools

import numpy as np
import pytest

from dynapipe_ext.costs.cost_model import AnalyticCostModel
from dynapipe_ext.batching.dp_split import makespan_objective
from dynapipe_ext.batching.ordering import (T5_ORDERS, cluster_tsp_order, groups_order, open_tour,
                                   refine_groups, t5_order)
from dynapipe_ext.batching.planners import (PlannerConfig, PlanningContext, SegmentTable,
                                   _segment_time_fn, memory_limit_of, plan_micro_batches)
from dynapipe_ext.batching.synthetic import DEVICE, T5_SPEC, multitask_t5_batch


@pytest.mark.parametrize("n", [0, 1, 2, 3, 17, 300])
@pytest.mark.parametrize("method", T5_ORDERS)
def test_every_order_is_a_permutation(method, n):
    rng = np.random.default_rng(n)
    enc = rng.integers(1, 2000, n)
    dec = rng.integers(1, 300, n)
    if n > 10:
        enc[: n // 3] = 64                 # many duplicate points
        dec[: n // 3] = 8
    order = t5_order(enc, dec, method)
    assert sorted(order.tolist()) == list(range(n))


def path_length(dist, path):
    return sum(dist[a, b] for a, b in zip(path[:-1], path[1:]))


@pytest.mark.parametrize("seed", range(25))
def test_open_tour_is_near_the_shortest_path(seed):
    rng = np.random.default_rng(seed)
    k = int(rng.integers(2, 8))
    points = rng.random((k, 2))
    dist = np.abs(points[:, None, :] - points[None, :, :]).sum(axis=2)
    path = open_tour(dist)
    assert sorted(path.tolist()) == list(range(k))
    shortest = min(path_length(dist, p) for p in itertools.permutations(range(k)))
    assert path_length(dist, path) <= 1.05 * shortest + 1e-12


def test_open_tour_orders_points_on_a_line():
    x = np.array([5.0, 1.0, 9.0, 3.0, 7.0, 2.0])
    path = open_tour(np.abs(x[:, None] - x[None, :]), start=1)
    assert np.all(np.diff(x[path]) > 0) or np.all(np.diff(x[path]) < 0)


def test_cluster_tsp_keeps_clusters_contiguous():
    # three well-separated task shapes: each must be one contiguous run of the order
    rng = np.random.default_rng(0)
    centres = [(100, 10), (1500, 20), (300, 400)]
    enc = np.concatenate([rng.integers(c[0], c[0] + 20, 30) for c in centres])
    dec = np.concatenate([rng.integers(c[1], c[1] + 5, 30) for c in centres])
    order = cluster_tsp_order(enc, dec, num_clusters=3)
    task = order // 30
    assert (np.diff(task) != 0).sum() == 2


def t5_context(batch, stages=4, **kw):
    cost = AnalyticCostModel(T5_SPEC, max_seq_len=2048, max_dec_seq_len=512, **DEVICE)
    config = PlannerConfig(model="t5", max_seq_len=2048, max_dec_seq_len=512,
                           pipeline_stages=stages, **kw)
    return PlanningContext(config, cost, batch[:, 0], batch[:, 1],
                           memory_limit_of(cost, config)), cost


def test_refine_never_worsens_and_reports_its_objective():
    batch = multitask_t5_batch(7, tokens=16384)
    ctx, _ = t5_context(batch)
    segment_time = _segment_time_fn(ctx)
    order = t5_order(ctx.enc, ctx.dec, "enc")
    groups = [order[i:i + 5] for i in range(0, len(order), 5)]

    def objective(gs):
        times = [segment_time(np.array([len(g)]), ctx.enc[g].max()[None],
                              ctx.dec[g].max()[None])[0] for g in gs]
        return makespan_objective(times, 4)

    refined, value = refine_groups(ctx.enc, ctx.dec, groups, segment_time, 4)
    assert sorted(np.concatenate(refined).tolist()) == list(range(len(batch)))
    assert value == pytest.approx(objective(refined))
    assert value < objective(groups)
    order2 = groups_order(ctx.enc, ctx.dec, refined)
    assert sorted(order2.tolist()) == list(range(len(batch)))


@pytest.mark.parametrize("seed,stages", [(0, 4), (1, 8), (2, 4), (3, 8)])
def test_chosen_order_is_never_worse_than_clustering_tsp(seed, stages):
    batch = multitask_t5_batch(seed)
    ctx, cost = t5_context(batch, stages)
    auto = plan_micro_batches(batch, ctx.config, cost, "dynamic")
    tsp_config = PlannerConfig(**{**ctx.config.__dict__, "t5_order": "cluster-tsp"})
    tsp = plan_micro_batches(batch, tsp_config, cost, "dynamic")
    assert auto.info["objective_ms"] <= tsp.info["objective_ms"] + 1e-9
    assert auto.predicted_time_ms <= tsp.predicted_time_ms + 1e-9
    assert sorted(auto.sample_ids()) == list(range(len(batch)))


@pytest.mark.parametrize("bound", [15.0, 40.0, 150.0])
def test_bounded_segment_table_is_the_full_table_cut_at_the_bound(bound):
    batch = multitask_t5_batch(4, tokens=32768)
    ctx, _ = t5_context(batch)
    order = t5_order(ctx.enc, ctx.dec, "snake")
    full = SegmentTable(ctx, order).time
    cut = SegmentTable(ctx, order, time_bound=bound).time
    expected = np.where(full <= bound, full, np.inf)
    assert np.array_equal(cut, expected[:, :cut.shape[1]])
    assert np.isinf(expected[:, cut.shape[1]:]).all()


def test_refine_works_with_one_stage():
    # one stage: no bubble term, the local search still lowers the sum of times
    batch = multitask_t5_batch(5, tokens=16384)
    ctx, _ = t5_context(batch, stages=1)
    order = t5_order(ctx.enc, ctx.dec, "enc")
    groups = [order[i:i + 5] for i in range(0, len(order), 5)]
    segment_time = _segment_time_fn(ctx)
    start = sum(segment_time(np.array([len(g)]), ctx.enc[g].max()[None],
                             ctx.dec[g].max()[None])[0] for g in groups)
    with np.errstate(all="raise"):
        _, value = refine_groups(ctx.enc, ctx.dec, groups, segment_time, 1)
    assert value < start
