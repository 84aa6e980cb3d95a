"""Replica split: the slowest replica's makespan model is minimised (exactly on small cases,
checked against brute force), Karmarkar-Karp differencing is correct, every replica is used."""
import heapq
import itertools

import numpy as np
import pytest

from dynapipe_ext.batching.replica_split import (balanced_partition, exact_partition, imbalance,
                                        kk_partition, local_search, lpt_partition,
                                        replica_makespans)


def brute_force_slowest(times, num_replicas, num_stages):
    """Smallest slowest-replica makespan over every assignment that uses every replica."""
    best = np.inf
    for assign in itertools.product(range(num_replicas), repeat=len(times)):
        if len(set(assign)) < num_replicas:
            continue
        parts = [[i for i, r in enumerate(assign) if r == q] for q in range(num_replicas)]
        best = min(best, max(replica_makespans(times, parts, num_stages)))
    return best


def assert_partition(parts, n, num_replicas):
    assert len(parts) == num_replicas and all(parts)
    assert sorted(i for p in parts for i in p) == list(range(n))
    assert all(p == sorted(p) for p in parts)


@pytest.mark.parametrize("seed", range(40))
def test_small_cases_match_brute_force(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 9))
    num_replicas = int(rng.integers(1, min(n, 4) + 1))
    num_stages = int(rng.integers(1, 9))
    times = np.round(rng.lognormal(2.5, 0.7, n), 2)
    parts = balanced_partition(times, num_replicas, num_stages)
    assert_partition(parts, n, num_replicas)
    assert max(replica_makespans(times, parts, num_stages)) == pytest.approx(
        brute_force_slowest(times, num_replicas, num_stages))


def test_exact_search_matches_brute_force_past_the_heuristics():
    rng = np.random.default_rng(3)
    for _ in range(6):
        times = np.round(rng.lognormal(2.5, 0.8, 9), 2)
        parts = exact_partition(times, 3, 4)
        best = brute_force_slowest(times, 3, 4)
        assert max(replica_makespans(times, parts, 4)) == pytest.approx(best)
        heuristic = local_search(times, kk_partition(times, 3), 4)
        assert max(replica_makespans(times, heuristic, 4)) >= best - 1e-9


def classic_kk_difference(values):
    """Two-way Karmarkar-Karp: replace the two largest numbers by their difference."""
    heap = [-float(v) for v in values]
    heapq.heapify(heap)
    while len(heap) > 1:
        a, b = -heapq.heappop(heap), -heapq.heappop(heap)
        heapq.heappush(heap, -(a - b))
    return -heap[0]


@pytest.mark.parametrize("seed", range(10))
def test_two_way_kk_reaches_the_differencing_value(seed):
    values = np.random.default_rng(seed).integers(1, 1000, size=25).astype(float)
    parts = kk_partition(values, 2)
    assert_partition(parts, 25, 2)
    loads = [values[p].sum() for p in parts]
    assert abs(loads[0] - loads[1]) == pytest.approx(classic_kk_difference(values))
    # the textbook case: KK leaves 2 on {8, 7, 6, 5, 4} (the optimum is 0)
    parts = kk_partition([8, 7, 6, 5, 4], 2)
    assert sorted(sum(np.array([8, 7, 6, 5, 4])[p]) for p in parts) == [14, 16]


@pytest.mark.parametrize("num_replicas", [3, 4, 8])
def test_multiway_kk_spread_is_at_most_the_largest_time(num_replicas):
    values = np.random.default_rng(num_replicas).lognormal(3, 0.7, 60)
    parts = kk_partition(values, num_replicas)
    assert_partition(parts, 60, num_replicas)
    loads = [values[p].sum() for p in parts]
    assert max(loads) - min(loads) <= values.max() + 1e-9


@pytest.mark.parametrize("num_replicas", [2, 4, 8])
def test_never_slower_than_lpt_and_close_to_balanced(num_replicas):
    rng = np.random.default_rng(num_replicas)
    n = 20 * num_replicas
    for _ in range(5):
        times = rng.lognormal(3, 0.6, n)
        parts = balanced_partition(times, num_replicas, 4)
        assert_partition(parts, n, num_replicas)
        assert parts == balanced_partition(times.copy(), num_replicas, 4)   # deterministic
        lpt = lpt_partition(times, num_replicas)
        assert (max(replica_makespans(times, parts, 4))
                <= max(replica_makespans(times, lpt, 4)) + 1e-9)
        assert imbalance(times, parts, 4) <= 1.02


def test_bad_input_is_rejected():
    with pytest.raises(ValueError, match="2 micro-batches cannot be split over 3"):
        balanced_partition([1.0, 2.0], 3)
    with pytest.raises(ValueError, match="finite and >= 0"):
        balanced_partition([1.0, np.inf], 1)
    with pytest.raises(ValueError, match="num_replicas must be >= 1"):
        kk_partition([1.0], 0)
    assert all(len(p) == 1 for p in balanced_partition([5.0, 0.0, 0.0], 3, 4))
