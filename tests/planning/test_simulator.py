"""Discrete-event simulator: textbook 1F1B bubble, dependency rules on hand-made cases, memory,
communication model, and clear errors for malformed or deadlocking schedules."""
import math

import numpy as np
import pytest

from dynapipe_ext.schedule.schedule_ir import (Action, Schedule, ScheduleError, linear_layout, parse_action,
                                      validate_schedule, wave_layout)
from dynapipe_ext.schedule.schedules import one_f_one_b
from dynapipe_ext.schedule.simulator import (CommModel, PipelineCosts, simulate, transfer_matrix,
                                    uniform_costs)


def sched(rows: list[str], stage_to_rank, num_mb: int, name: str = "hand") -> Schedule:
    """Schedule from one string of actions per rank, e.g. '0F0 0B0'."""
    ranks = tuple(tuple(parse_action(a) for a in row.split()) for row in rows)
    return Schedule(name, tuple(stage_to_rank), ranks, num_mb)


@pytest.mark.parametrize("num_ranks,num_mb", [(2, 4), (4, 8), (4, 16), (8, 8), (8, 64), (3, 1)])
def test_uniform_1f1b_reproduces_textbook_bubble(num_ranks, num_mb):
    result = simulate(one_f_one_b(num_mb, num_ranks), uniform_costs(num_mb, num_ranks))
    expected = (num_ranks - 1) / (num_mb + num_ranks - 1)
    for bubble in result.bubble_fraction:
        assert bubble == pytest.approx(expected, rel=0.01, abs=1e-12)


def test_two_ranks_two_micro_batches_exact_times():
    # F=1, B=2 per stage. Rank 1 (last stage): F0 [1,2], B0 [2,4], F1 waits for the rank:
    # [4,5], B1 [5,7]. Rank 0: F0 [0,1], F1 [1,2], B0 after rank 1's B0: [4,6], B1 [7,9].
    result = simulate(one_f_one_b(2, 2), uniform_costs(2, 2, fwd_ms=1, bwd_ms=2))
    assert result.makespan_ms == 9
    assert [a for a, _, _ in result.timeline(0)] == [Action(0, "F", 0), Action(0, "F", 1),
                                                     Action(0, "B", 0), Action(0, "B", 1)]
    assert [(s, e) for _, s, e in result.timeline(0)] == [(0, 1), (1, 2), (4, 6), (7, 9)]
    assert [(s, e) for _, s, e in result.timeline(1)] == [(1, 2), (2, 4), (4, 5), (5, 7)]
    assert result.busy_ms == (6, 6)
    assert result.bubble_fraction == pytest.approx((1 / 3, 1 / 3))


def test_latency_delays_every_cross_rank_transfer():
    # Same case with 0.5 ms latency: rank 1 F0 [1.5,2.5], B0 [2.5,4.5], F1 [4.5,5.5],
    # B1 [5.5,7.5]; rank 0 B0 starts at 4.5+0.5 = 5 -> [5,7], B1 at 7.5+0.5 = 8 -> [8,10].
    result = simulate(one_f_one_b(2, 2), uniform_costs(2, 2, 1, 2), CommModel(latency_ms=0.5))
    assert result.makespan_ms == 10
    assert [(s, e) for _, s, e in result.timeline(1)] == [(1.5, 2.5), (2.5, 4.5), (4.5, 5.5),
                                                          (5.5, 7.5)]
    assert [s for _, s, _ in result.timeline(0)] == [0, 1, 5, 8]


def test_bandwidth_time_scales_with_bytes():
    costs = PipelineCosts(np.ones((1, 2)), np.ones((1, 2)), comm_bytes=[[300.0, 0.0]])
    schedule = sched(["0F0 0B0", "1F0 1B0"], [0, 1], 1)
    # F0 [0,1], 3 ms transfer, F1 [4,5], B1 [5,6], 3 ms back, B0 [9,10]
    result = simulate(schedule, costs, CommModel(latency_ms=0.0, bandwidth_bytes_per_ms=100.0))
    assert result.makespan_ms == 10
    assert result.start_ms == ((0.0, 9.0), (4.0, 5.0))


def test_stages_on_the_same_rank_exchange_for_free():
    # a one-rank wave: both stages on rank 0, so a large latency never applies
    schedule = sched(["0F0 1F0 1B0 0B0"], wave_layout(1, 1), 1)
    result = simulate(schedule, uniform_costs(1, 2, 1, 2), CommModel(latency_ms=5.0))
    assert result.makespan_ms == 6
    assert result.bubble_fraction == (0.0,)


def test_transfer_matrix_is_zero_at_wave_turning_points_only():
    layout = wave_layout(3, 2)          # ranks 0 1 2 2 1 0 0 1 2 2 1 0
    costs = PipelineCosts(np.ones((1, 12)), np.ones((1, 12)), comm_bytes=np.ones((1, 12)))
    xfer = transfer_matrix(layout, costs, CommModel(latency_ms=1.0))[0]
    same_rank = [layout[s] == layout[s + 1] for s in range(11)]
    assert same_rank.count(True) == 3       # two bottoms and one top of the waves
    assert list(xfer[:-1] == 0) == same_rank
    assert xfer[-1] == 0                    # nothing leaves the last stage


def test_backward_waits_for_the_later_stage_backward():
    # rank 1 is slow (F=1, B=5 on stage 1): rank 0's B0 must wait for it
    fwd = np.array([[1.0, 1.0]])
    bwd = np.array([[1.0, 5.0]])
    result = simulate(sched(["0F0 0B0", "1F0 1B0"], [0, 1], 1), PipelineCosts(fwd, bwd))
    assert result.start_ms[0] == (0.0, 7.0)
    assert result.makespan_ms == 8


def test_peak_memory_counts_kept_activations_and_transient():
    costs = PipelineCosts(np.ones((3, 2)), np.ones((3, 2)), act_bytes=np.full((3, 2), 10.0),
                          peak_bytes=np.full((3, 2), 1.0))
    result = simulate(one_f_one_b(3, 2), costs)
    # rank 0 holds two micro-batches (warm-up 1 + one steady forward), rank 1 only one
    assert result.peak_memory_bytes == (21.0, 11.0)
    assert result.fits(21.0) and not result.fits(20.9)


def test_rank_order_that_runs_backward_before_forward_is_a_deadlock():
    with pytest.raises(ScheduleError, match=r"deadlock.*rank 0.*0B0.*waiting for 0F0"):
        simulate(sched(["0B0 0F0"], [0], 1), uniform_costs(1, 1))


def test_cross_rank_wait_cycle_is_a_deadlock_naming_both_ranks():
    schedule = sched(["0F0 0B0 0F1 0B1", "1F1 1B1 1F0 1B0"], [0, 1], 2)
    with pytest.raises(ScheduleError, match=r"deadlock.*rank 0 .*0B0.*rank 1 .*1F1"):
        simulate(schedule, uniform_costs(2, 2))


@pytest.mark.parametrize("rows,match", [
    (["0F0 0B0 0F1", "1F0 1B0 1F1 1B1"], r"missing, first 0B1"),
    (["0F0 0B0 0F1 0B1 0B1", "1F0 1B0 1F1 1B1"], r"rank 0, position 4, action 0B1.*more than once"),
    (["0F0 0B0 0F1 0B1 1F0", "1B0 1F1 1B1"], r"rank 0, position 4, action 1F0: stage 1 is held "
                                             r"by rank 1"),
    (["0F0 0B0 0F1 0B1 0F2", "1F0 1B0 1F1 1B1"], r"micro-batch in \[0, 2\)"),
])
def test_malformed_schedule_is_a_clear_error(rows, match):
    with pytest.raises(ScheduleError, match=match):
        simulate(sched(rows, [0, 1], 2), uniform_costs(2, 2))


def test_costs_must_match_the_schedule_and_be_valid():
    with pytest.raises(ValueError, match=r"2 micro-batches x 2 stages but the costs are for 3 x 2"):
        simulate(one_f_one_b(2, 2), uniform_costs(3, 2))
    with pytest.raises(ValueError, match=r"bwd_ms\[1\]\[0\] = -1.0"):
        PipelineCosts(np.ones((2, 2)), [[1, 1], [-1, 1]])
    with pytest.raises(ValueError, match=r"act_bytes has shape \(1, 2\), expected \(2, 2\)"):
        PipelineCosts(np.ones((2, 2)), np.ones((2, 2)), act_bytes=np.ones((1, 2)))
    with pytest.raises(ValueError, match="latency_ms >= 0"):
        CommModel(latency_ms=-1)


def test_action_string_round_trip_and_bad_text():
    for act in (Action(0, "F", 0), Action(12, "B", 305)):
        assert parse_action(str(act)) == act
    with pytest.raises(ScheduleError, match="cannot parse action 'xF1'"):
        parse_action("xF1")


def test_busy_and_bubble_agree_with_the_timeline():
    rng = np.random.default_rng(7)
    costs = PipelineCosts(rng.uniform(0.5, 2, (6, 3)), rng.uniform(1, 4, (6, 3)))
    result = simulate(one_f_one_b(6, 3), costs, CommModel(0.1))
    for r in range(3):
        line = result.timeline(r)
        assert all(e1 <= s2 + 1e-12 for (_, _, e1), (_, s2, _) in zip(line, line[1:]))
        busy = sum(e - s for _, s, e in line)
        assert busy == pytest.approx(result.busy_ms[r])
        assert result.bubble_fraction[r] == pytest.approx(1 - busy / result.makespan_ms)
    assert result.makespan_ms == pytest.approx(max(e for r in range(3)
                                                    for _, _, e in result.timeline(r)))
    assert not math.isnan(result.mean_bubble_fraction)


def test_validate_accepts_every_generated_1f1b():
    for p in range(1, 5):
        for m in range(1, 7):
            validate_schedule(one_f_one_b(m, p))
            assert one_f_one_b(m, p).stage_to_rank == linear_layout(p)


@pytest.mark.parametrize("layout", [linear_layout(3), wave_layout(2, 2)])
def test_placement_sequence_orders_zero_duration_actions_by_dependency(layout):
    num_mb, num_stages = 4, len(layout)
    if layout == linear_layout(3):
        schedule = one_f_one_b(num_mb, 3)
    else:   # every stage runs all forwards, then all backwards (a valid, if greedy, order)
        ranks = [[] for _ in range(max(layout) + 1)]
        for s in range(num_stages):
            ranks[layout[s]] += [Action(s, "F", m) for m in range(num_mb)]
        for s in reversed(range(num_stages)):
            ranks[layout[s]] += [Action(s, "B", m) for m in range(num_mb)]
        schedule = Schedule("waves", layout, tuple(map(tuple, ranks)), num_mb)
    zero = np.zeros((num_mb, num_stages))
    result = simulate(schedule, PipelineCosts(zero, zero))
    key = {a: k for r, acts in enumerate(schedule.rank_actions)
           for a, k in zip(acts, result.order_keys(r))}
    assert sorted(s for seq in result.sequence for s in seq) == list(range(2 * num_mb * num_stages))
    for r in range(schedule.num_ranks):
        assert result.order_keys(r) == sorted(result.order_keys(r))
    for m in range(num_mb):
        for s in range(1, num_stages):
            assert key[Action(s - 1, "F", m)] < key[Action(s, "F", m)]
            assert key[Action(s, "B", m)] < key[Action(s - 1, "B", m)]
        assert key[Action(num_stages - 1, "F", m)] < key[Action(num_stages - 1, "B", m)]
