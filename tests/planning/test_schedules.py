"""Schedules and schedule search: completeness, wave layouts, adaptive vs 1F1B (property-based),
memory limits, and costs from micro-batches."""
import math
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynapipe_ext.costs.cost_model import AnalyticCostModel
from dynapipe_ext.batching.microbatch import MicroBatch
from dynapipe_ext.costs.model_spec import ModelSpec
from dynapipe_ext.schedule.schedule_ir import (Action, interleaved_layout, linear_layout, stages_of_rank,
                                      wave_layout)
from dynapipe_ext.schedule.schedule_search import (costs_from_micro_batches, evaluate_candidates,
                                          micro_batch_costs, search_schedule)
from dynapipe_ext.schedule.schedules import (MemoryLimitError, adaptive, adaptive_search, candidate_orders,
                                    cost_clusters, greedy_order, hanayo, hanayo_warmups,
                                    interleaved_one_f_one_b, one_f_one_b, relabel, wave,
                                    wave_search)
from dynapipe_ext.schedule.simulator import CommModel, PipelineCosts, simulate, uniform_costs


def assert_complete(schedule):
    """Each (stage, F/B, mb) exactly once, each on the rank that holds its stage."""
    counts = Counter(a for acts in schedule.rank_actions for a in acts)
    expected = {Action(s, k, m) for s in range(schedule.num_stages) for k in "FB"
                for m in range(schedule.num_micro_batches)}
    assert set(counts) == expected
    assert set(counts.values()) == {1}
    for rank, acts in enumerate(schedule.rank_actions):
        assert all(schedule.stage_to_rank[a.stage] == rank for a in acts)


def random_costs(rng, num_mb, num_stages):
    """Long-tailed micro-batch times, a little stage-to-stage noise, memory ~ time."""
    base = rng.lognormal(0.0, 0.8, size=num_mb)[:, None] * rng.uniform(0.8, 1.2,
                                                                        (num_mb, num_stages))
    return PipelineCosts(base, 2 * base, act_bytes=base * 100, peak_bytes=base * 10,
                         comm_bytes=base * 1000)


@pytest.mark.parametrize("num_mb,num_ranks", [(1, 1), (1, 4), (3, 4), (8, 4), (13, 3)])
def test_every_schedule_holds_each_action_once_on_its_rank(num_mb, num_ranks):
    rng = np.random.default_rng(num_mb * 10 + num_ranks)
    assert_complete(one_f_one_b(num_mb, num_ranks))
    assert_complete(adaptive(random_costs(rng, num_mb, num_ranks), comm=CommModel(0.1)))
    for waves in (1, 2):
        assert_complete(wave(num_mb, num_ranks, waves))
    if num_mb % num_ranks == 0:
        assert_complete(interleaved_one_f_one_b(num_mb, num_ranks, 3))


@pytest.mark.parametrize("num_ranks,waves", [(1, 1), (2, 1), (4, 1), (4, 2), (3, 3), (8, 2)])
def test_wave_layout_places_stages_as_waves(num_ranks, waves):
    layout = wave_layout(num_ranks, waves)
    assert len(layout) == 2 * waves * num_ranks
    for rank in range(num_ranks):
        own = stages_of_rank(layout, rank)
        assert len(own) == 2 * waves
        # a rank's stages touch only at a turning point of the waves
        assert all((a + 1) % num_ranks == 0 for a, b in zip(own, own[1:]) if b == a + 1)
    for s in range(len(layout) - 1):
        at_turn = (s + 1) % num_ranks == 0
        if at_turn:         # bottom or top of a wave: both stages on one rank
            assert layout[s] == layout[s + 1]
        else:               # otherwise the neighbour rank, down on even half-waves, up on odd
            step = 1 if (s // num_ranks) % 2 == 0 else -1
            assert layout[s + 1] == layout[s] + step
    assert layout[0] == 0 and layout[-1] == 0


def test_wave_schedule_uses_the_wave_layout_and_overlaps_the_two_directions():
    schedule = wave(8, 4, 1)
    assert schedule.stage_to_rank == wave_layout(4, 1)
    # rank 0 works on stage 7 (the top of the wave) before its last stage-0 forward
    acts = schedule.rank_actions[0]
    assert acts.index(Action(7, "F", 0)) < acts.index(Action(0, "F", 7))


def test_uniform_interleaved_1f1b_matches_megatron_formula():
    # v chunks of F=1, B=2: makespan (v*m + P - 1) * 3 (Narayanan et al. 2021)
    for p, m, v in ((4, 8, 2), (2, 6, 3), (4, 4, 2)):
        result = simulate(interleaved_one_f_one_b(m, p, v), uniform_costs(m, v * p))
        assert result.makespan_ms == (v * m + p - 1) * 3
        assert result.schedule.stage_to_rank == interleaved_layout(p, v)


def test_greedy_on_uniform_costs_is_1f1b():
    for p, m in ((4, 8), (3, 2), (5, 12)):
        got = greedy_order(linear_layout(p), uniform_costs(m, p))
        assert got.schedule.rank_actions == one_f_one_b(m, p).rank_actions


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), num_ranks=st.integers(1, 5), num_mb=st.integers(1, 14),
       slack=st.sampled_from([1.0, 1.3, math.inf]), latency=st.sampled_from([0.0, 0.2]))
def test_adaptive_never_loses_to_1f1b_and_respects_memory(seed, num_ranks, num_mb, slack,
                                                          latency):
    rng = np.random.default_rng(seed)
    costs = random_costs(rng, num_mb, num_ranks)
    comm = CommModel(latency, 1e4)
    base = simulate(one_f_one_b(num_mb, num_ranks), costs, comm)
    limit = base.max_peak_memory_bytes * slack
    found = adaptive_search(costs, limit, comm)
    replay = simulate(found.schedule, costs, comm)   # wait-free execution of the order
    assert replay.makespan_ms == pytest.approx(found.makespan_ms)
    assert replay.makespan_ms <= base.makespan_ms * (1 + 1e-9)
    assert replay.max_peak_memory_bytes <= limit


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), num_ranks=st.integers(1, 4), num_mb=st.integers(1, 10),
       waves=st.integers(1, 2), extra=st.integers(0, 4), priority=st.sampled_from(["BFA", "FAB"]))
def test_greedy_order_replays_exactly_and_fits_its_limit(seed, num_ranks, num_mb, waves, extra,
                                                         priority):
    rng = np.random.default_rng(seed)
    layout = wave_layout(num_ranks, waves)
    costs = random_costs(rng, num_mb, len(layout))
    comm = CommModel(0.05, 1e4)
    limit = float(np.max(costs.act_bytes.sum(axis=1)) * 2 + np.max(costs.peak_bytes))
    got = greedy_order(layout, costs, limit, comm, extra, rng.permutation(num_mb), "g", priority)
    replay = simulate(got.schedule, costs, comm)
    assert replay.makespan_ms == pytest.approx(got.makespan_ms)
    assert replay.peak_memory_bytes == pytest.approx(got.peak_memory_bytes)
    assert replay.max_peak_memory_bytes <= limit


def test_adaptive_reordering_beats_1f1b_on_long_tailed_costs():
    rng = np.random.default_rng(3)
    costs = random_costs(rng, 32, 4)
    base = simulate(one_f_one_b(32, 4), costs).makespan_ms
    found = adaptive_search(costs)
    assert found.makespan_ms < 0.95 * base


def test_memory_limit_lowers_in_flight_micro_batches():
    costs = uniform_costs(8, 4, act_bytes=10.0)
    assert simulate(one_f_one_b(8, 4), costs).peak_memory_bytes[0] == 40
    found = adaptive_search(costs, memory_limit=25.0)
    result = simulate(found.schedule, costs)
    assert result.max_peak_memory_bytes <= 25.0
    assert result.makespan_ms > simulate(one_f_one_b(8, 4), costs).makespan_ms


def test_memory_infeasible_is_a_clear_error():
    costs = uniform_costs(4, 2, act_bytes=10.0)
    with pytest.raises(MemoryLimitError, match=r"micro-batch 0 alone needs 10 bytes on rank 0, "
                                               r"over the memory limit 5"):
        greedy_order(linear_layout(2), costs, memory_limit=5.0)
    with pytest.raises(MemoryLimitError, match=r"no pipeline schedule fits the memory limit 5 "
                                               r"bytes \(1f1b: peak 20 bytes; adaptive: .*\)"):
        search_schedule(costs, 5.0, 2, candidates=("1f1b", "adaptive"))


def test_search_keeps_the_fastest_fitting_candidate():
    rng = np.random.default_rng(11)
    per_stages = {n: random_costs(rng, 12, n) for n in (3, 6)}
    found = evaluate_candidates(per_stages, math.inf, 3)
    assert [c.name for c in found] == ["1f1b", "adaptive", "interleaved2", "wave1"]
    schedule, result = search_schedule(per_stages, math.inf, 3)
    assert result.makespan_ms == min(c.result.makespan_ms for c in found)
    assert result.schedule is schedule
    # a limit below 1f1b's peak leaves 1f1b out
    limit = found[0].result.max_peak_memory_bytes * 0.99
    schedule, result = search_schedule(per_stages, limit, 3)
    assert schedule.name != "1f1b" and result.max_peak_memory_bytes <= limit


def test_forcing_one_schedule_and_skipping_candidates_without_costs():
    costs = uniform_costs(8, 4)
    schedule, _ = search_schedule(costs, math.inf, 4, candidates=("1f1b",))
    assert schedule.name == "1f1b"
    found = evaluate_candidates(costs, math.inf, 4, candidates=("wave",))
    assert found[0].result is None and "no stage costs for a cut into 8 stages" in found[0].reason
    with pytest.raises(MemoryLimitError, match="wave1: no stage costs"):
        search_schedule(costs, math.inf, 4, candidates=("wave",))
    with pytest.raises(ValueError, match=r"unknown pipeline schedule\(s\) \['gpipe'\]"):
        search_schedule(costs, math.inf, 4, candidates=("gpipe",))
    schedule, _ = search_schedule(lambda n: uniform_costs(8, n), math.inf, 4,
                                  candidates=("wave",), waves=(2,))
    assert schedule.stage_to_rank == wave_layout(4, 2)


def test_wave_search_with_memory_limit_fits_or_explains():
    costs = uniform_costs(8, 8, act_bytes=1.0)
    found = wave_search(costs, 4, 1, memory_limit=6.0)
    assert max(found.peak_memory_bytes) <= 6.0
    with pytest.raises(MemoryLimitError, match="wave1: no order fits the memory limit 1"):
        wave_search(costs, 4, 1, memory_limit=1.0)


def test_candidate_orders_are_permutations_and_clusters_sort_by_cost():
    rng = np.random.default_rng(5)
    costs = random_costs(rng, 20, 2)
    total = (costs.fwd_ms + costs.bwd_ms).sum(axis=1)
    groups = cost_clusters(costs, 3)
    assert sorted(m for g in groups for m in g) == list(range(20))
    assert all(max(total[a]) <= min(total[b]) for a, b in zip(groups, groups[1:]))
    orders = candidate_orders(costs)
    assert len({tuple(o) for _, o in orders}) == len(orders)
    assert all(sorted(o) == list(range(20)) for _, o in orders)


def test_relabel_maps_reordered_schedule_back_to_original_indices():
    costs = PipelineCosts([[1.0], [5.0], [2.0]], [[1.0], [5.0], [2.0]])
    order = [1, 2, 0]
    made = greedy_order(linear_layout(1), costs.reordered(order)).schedule
    back = relabel(made, order)
    assert [a.mb for a in back.rank_actions[0] if a.kind == "F"] == order
    assert simulate(back, costs).makespan_ms == simulate(made, costs.reordered(order)).makespan_ms


def test_costs_from_micro_batches_asks_the_cost_model():
    spec = ModelSpec("gpt", num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=100)
    model = AnalyticCostModel(spec, max_seq_len=128)
    mbs = [MicroBatch(((0,), (1,)), 32), MicroBatch(((2,),), 128, recompute="full")]
    costs = costs_from_micro_batches(mbs, model, 2, spec, dtype_bytes=2)
    assert costs.fwd_ms.shape == (2, 2)
    direct = model.stage_costs(1, 128, 0, 2, "full")
    assert costs.act_bytes[1].tolist() == [c.activation_bytes for c in direct]
    assert costs.comm_bytes.tolist() == [[2 * 32 * 64 * 2, 0], [1 * 128 * 64 * 2, 0]]
    source = micro_batch_costs(mbs, model, spec)
    assert source(4) is source(4) and source(4).num_stages == 4
    with pytest.raises(ValueError, match=r"micro-batch 0 \(1 rows x seq_len 256.*infeasible"):
        costs_from_micro_batches([MicroBatch(((0,),), 256)], model, 2)


def test_transfer_time_changes_the_picked_schedule():
    """Four micro-batches on two ranks: with free transfers the wave (less bubble) wins; when
    each cross-rank transfer costs 20 ms, its two crossings per micro-batch lose to 1F1B's one."""
    from dynapipe_ext.schedule.simulator import CommModel, PipelineCosts

    def costs(num_stages):
        fwd = np.full((4, num_stages), 8.0 / num_stages)
        return PipelineCosts(fwd, 2 * fwd, comm_bytes=np.full((4, num_stages), 1e6))
    source = {2: costs(2), 4: costs(4)}
    free, free_result = search_schedule(source, math.inf, 2, ("1f1b", "wave"))
    slow, slow_result = search_schedule(source, math.inf, 2, ("1f1b", "wave"),
                                        comm=CommModel(latency_ms=20.0))
    assert free.name.startswith("wave") and slow.name == "1f1b"
    assert slow_result.makespan_ms > free_result.makespan_ms
    # 1F1B: (m + P - 1) x 12 ms of compute on the critical path, plus at least one crossing
    # each way
    assert slow_result.makespan_ms >= 5 * 12.0 + 2 * 20.0


def test_planner_config_comm_reaches_the_simulation_that_picks_the_schedule():
    from dataclasses import replace

    from dynapipe_ext.plan.iteration_planner import (CostModelSource, IterationPlannerConfig,
                                                plan_iteration)
    from dynapipe_ext.batching.planners import PlannerConfig
    from dynapipe_ext.schedule.simulator import CommModel
    spec = ModelSpec("gpt", num_layers=4, hidden_size=128, num_attention_heads=4,
                     vocab_size=512)
    planner = PlannerConfig(model="gpt", max_seq_len=256, pipeline_stages=2, data_parallel=1)
    config = IterationPlannerConfig(spec, planner, pp=2, dp=1, check_plans=True,
                                    cost_model=CostModelSource.analytic(max_seq_len=256))
    lengths = np.random.default_rng(4).integers(8, 256, size=64)
    free = plan_iteration(0, lengths, config)
    slow = plan_iteration(0, lengths, replace(config, comm=CommModel(latency_ms=50.0)))
    transfers = 2 * len(slow.batch_plan.micro_batches)    # one each way per micro-batch
    assert slow.batch_plan.micro_batches == free.batch_plan.micro_batches
    assert slow.predicted_ms[0] >= free.predicted_ms[0] + 2 * 50.0
    assert slow.predicted_ms[0] <= free.predicted_ms[0] + transfers * 50.0


def even_costs(num_mb, num_ranks):
    """A CostSource of the textbook case: the model costs F = 1, B = 2 per rank-share and
    keeps 1 unit of activations per micro-batch, spread evenly over however many stages."""
    return lambda n: uniform_costs(num_mb, n, fwd_ms=num_ranks / n, bwd_ms=2 * num_ranks / n,
                                   act_bytes=num_ranks / n)


ANALYTIC_CASES = ([("1f1b", p, m, 1) for p in (2, 4, 8) for m in (p, 2 * p, 4 * p, p + 3)]
                  + [("interleaved", p, m, v) for p in (2, 4, 8) for m in (p, 2 * p, 4 * p)
                     for v in (2, 4)]
                  + [("wave", p, m, w) for p in (2, 4, 8) for m in (2 * p, 4 * p)
                     for w in (1, 2, 4)])


@pytest.mark.parametrize("name,num_ranks,num_mb,k", ANALYTIC_CASES)
def test_bubble_share_on_even_stages_is_the_analytic_figure(name, num_ranks, num_mb, k):
    """Ideal-time bubble shares: 1F1B (P-1)/(m+P-1); Megatron's interleaving with v chunks
    (P-1)/(v*m+P-1) (m a multiple of P); Hanayo's W waves (P-1)/(2*W*m+P-1) (m >= 2P)."""
    costs = even_costs(num_mb, num_ranks)
    if name == "1f1b":
        schedule, chunks = one_f_one_b(num_mb, num_ranks), 1
    elif name == "interleaved":
        schedule, chunks = interleaved_one_f_one_b(num_mb, num_ranks, k), k
    else:
        schedule, chunks = hanayo(num_mb, num_ranks, k), 2 * k
    result = simulate(schedule, costs(schedule.num_stages))
    analytic = (num_ranks - 1) / (chunks * num_mb + num_ranks - 1)
    assert result.bubble_fraction == pytest.approx([analytic] * num_ranks)
    assert result.makespan_ms == pytest.approx(3 * num_mb + 3 * (num_ranks - 1) / chunks)


@pytest.mark.parametrize("num_ranks,waves", [(2, 1), (4, 1), (4, 2), (8, 1), (3, 2)])
def test_hanayo_order_and_memory_profile(num_ranks, waves):
    """At m = 2P rank r keeps hanayo_warmups[r] + 1 stage activations at its peak (the
    last stage is on rank 0, where backwards start: the warm-up grows with r), and its first
    backward is its last stage's backward of micro-batch 0."""
    num_mb = 2 * num_ranks
    schedule = hanayo(num_mb, num_ranks, waves)
    assert schedule.stage_to_rank == wave_layout(num_ranks, waves)
    assert_complete(schedule)
    peaks = simulate(schedule, uniform_costs(num_mb, 2 * waves * num_ranks)).peak_memory_bytes
    assert list(peaks) == [w + 1 for w in hanayo_warmups(num_ranks, waves)]
    for rank, acts in enumerate(schedule.rank_actions):
        first_b = next(a for a in acts if a.kind == "B")
        assert first_b == Action(stages_of_rank(schedule.stage_to_rank, rank)[-1], "B", 0)
        forwards = [a for a in acts if a.kind == "F"]
        steps = [a.mb + a.stage for a in forwards]     # the wave front: micro-batch + stage
        assert steps == sorted(steps)


@pytest.mark.parametrize("num_mb", [1, 3, 5, 7, 10, 13])
def test_interleaved_and_wave_take_any_micro_batch_count(num_mb):
    rng = np.random.default_rng(num_mb)
    for schedule in (interleaved_one_f_one_b(num_mb, 4, 2), interleaved_one_f_one_b(num_mb, 3, 3),
                     hanayo(num_mb, 4, 1), hanayo(num_mb, 2, 2)):
        assert_complete(schedule)
        simulate(schedule, random_costs(rng, num_mb, schedule.num_stages))   # no deadlock


def test_interleaved_at_1f1b_memory_keeps_its_bubble():
    """Capped at 1F1B's peak, interleaving runs fewer warm-ups (slope 1) at the same
    makespan on even stages; the wave, which needs (4W-1)/(2W) copies at m = 2P, cannot."""
    costs = even_costs(16, 4)
    limit = simulate(one_f_one_b(16, 4), costs(4)).max_peak_memory_bytes
    found = {c.name: c for c in evaluate_candidates(costs, limit, 4, waves=(1,), chunks=(2,))}
    free = {c.name: c for c in evaluate_candidates(costs, math.inf, 4, waves=(1,), chunks=(2,))}
    assert found["interleaved2"].result.max_peak_memory_bytes <= limit
    assert free["interleaved2"].result.max_peak_memory_bytes > limit
    assert found["interleaved2"].result.makespan_ms == free["interleaved2"].result.makespan_ms
    assert found["wave1"].result is None and "no warm-up fits" in found["wave1"].reason


def test_auto_picks_wave_or_interleaved_when_predicted_fastest():
    """All candidates on even stages: few micro-batches and free links favour interleaving
    (v=4: least bubble); with link latency the wave's transfer-free turning points win."""
    everything = ("1f1b", "adaptive", "interleaved", "wave")
    costs = even_costs(4, 4)
    schedule, result = search_schedule(costs, math.inf, 4, everything, waves=(1, 2),
                                       chunks=(2, 4))
    assert schedule.name == "interleaved4"
    found = evaluate_candidates(costs, math.inf, 4, everything, waves=(1, 2), chunks=(2, 4))
    assert result.makespan_ms == min(c.result.makespan_ms for c in found)

    eight = even_costs(8, 4)

    def linked(n):
        c = eight(n)
        return PipelineCosts(c.fwd_ms, c.bwd_ms, c.act_bytes, comm_bytes=np.ones_like(c.fwd_ms))
    comm = CommModel(latency_ms=0.1)
    schedule, result = search_schedule(linked, math.inf, 4, everything, comm, waves=(1, 2),
                                       chunks=(2, 4))
    assert schedule.name == "wave2"
    found = evaluate_candidates(linked, math.inf, 4, everything, comm, waves=(1, 2),
                                chunks=(2, 4))
    assert result.makespan_ms == min(c.result.makespan_ms for c in found)
    # why: the wave's chain of stages crosses ranks less often than interleaving's
    crossings = lambda s: sum(s.stage_to_rank[i] != s.stage_to_rank[i + 1]  # noqa: E731
                              for i in range(s.num_stages - 1))
    assert crossings(schedule) < crossings(interleaved_one_f_one_b(8, 4, 4))
