"""FlexTP planning: straggler detection with hysteresis, the resize bound and priority, balanced
partitions and the SEMI decision between resizing and migration."""
import random

import pytest

from dynapipe_ext.flextp.detector import StragglerDetector
from dynapipe_ext.flextp.partition import (Partition, even_partition, proportional_counts,
                                           rebalance, slot_capacity)
from dynapipe_ext.flextp.policy import BalanceCosts, decide
from dynapipe_ext.flextp.resize import choose_drops, drop_counts, max_drops


def noisy(rng, base, sigma=0.15):
    return base * rng.lognormvariate(0.0, sigma)


def test_noise_alone_never_triggers():
    rng = random.Random(3)
    det = StragglerDetector(tp=2)
    for _ in range(5000):
        det.update([noisy(rng, 1.0), noisy(rng, 1.0)], [8, 8])
        assert det.stragglers == set()
    # isolated spikes (3x on one iteration in ten) do not either
    for i in range(500):
        spike = 3.0 if i % 10 == 0 else 1.0
        det.update([noisy(rng, 1.0), noisy(rng, spike, 0.05)], [8, 8])
        assert det.stragglers == set()


def test_steady_2x_slowdown_triggers_then_clears():
    rng = random.Random(4)
    det = StragglerDetector(tp=2)
    for _ in range(50):
        det.update([noisy(rng, 1.0), noisy(rng, 1.0)], [8, 8])
    hit = None
    for i in range(50):
        det.update([noisy(rng, 1.0), noisy(rng, 2.0)], [8, 8])
        if det.stragglers and hit is None:
            hit = i
    assert det.stragglers == {1} and hit is not None and hit < 15
    assert det.relative_speeds()[0] == 1.0 and 0.4 < det.relative_speeds()[1] < 0.6
    # after migration rank 1 does half the work in about the same time: still a straggler
    for _ in range(30):
        det.update([noisy(rng, 1.0), noisy(rng, 1.0)], [10, 5])
    assert det.stragglers == {1}
    for _ in range(30):
        det.update([noisy(rng, 1.0), noisy(rng, 1.0)], [8, 8])
    assert det.stragglers == set() and det.relative_speeds() == (1.0, 1.0)


def test_detector_names_bad_input():
    with pytest.raises(ValueError, match="exit_ratio"):
        StragglerDetector(tp=2, enter_ratio=1.1, exit_ratio=1.2)
    with pytest.raises(ValueError, match="positive"):
        StragglerDetector(tp=2).update([1.0, 0.0], [1, 1])


def test_resize_bound_and_priority():
    assert max_drops(16, 0.25) == 4 and max_drops(1, 0.5) == 0
    # a 2x straggler would need to drop half its units; the bound allows a quarter
    assert drop_counts((16, 16), (1.0, 0.5), 0.25) == (0, 4)
    assert drop_counts((16, 16), (1.0, 0.8), 0.25) == (0, 4)
    assert drop_counts((16, 16), (1.0, 0.9), 0.25) == (0, 2)
    assert drop_counts((16, 16), (1.0, 1.0), 0.25) == (0, 0)
    assert choose_drops((4, 5, 6, 7), (0.3, 0.1, 0.2, 0.1), 2) == (5, 7)
    with pytest.raises(ValueError, match="cannot drop"):
        choose_drops((1, 2), (0.1, 0.2), 2)


def test_rotating_skips_leave_out_the_units_skipped_last_time():
    norms = (0.3, 0.1, 0.2, 0.1, 0.5, 0.4, 0.6, 0.7)
    units = tuple(range(10, 18))
    first = choose_drops(units, norms, 2)
    assert first == (11, 13)
    second = choose_drops(units, norms, 2, rest=first)     # the next-smallest norms
    assert second == (10, 12)
    assert choose_drops(units, norms, 2, rest=second) == first
    # too few others left: from all units, by norm
    assert choose_drops((1, 2, 3), (0.1, 0.2, 0.3), 2, rest=(2, 3)) == (1, 2)


def test_partition_bookkeeping_and_errors():
    p = Partition((1, 0, 1, 1), 2)
    assert p.units_of(0) == (1,) and p.units_of(1) == (0, 2, 3) and p.counts() == (1, 3)
    assert even_partition(4, 2).moves_to(p) == [(0, 0, 1)]
    with pytest.raises(ValueError, match="own no unit"):
        Partition((0, 0), 2)
    with pytest.raises(ValueError, match="do not split evenly"):
        even_partition(5, 2)
    assert slot_capacity(32, 2) == 24 and slot_capacity(32, 2, 2.0) == 31
    with pytest.raises(ValueError, match="max_share must be >= 1"):
        slot_capacity(32, 2, 0.5)


def test_slowdown_switch_parses_and_names_bad_values():
    from megatron.flextp.layers import slowdown_factor
    assert slowdown_factor(1, "1:3") == 3 and slowdown_factor(0, "1:3") == 1
    assert slowdown_factor(0, "") == 1
    with pytest.raises(ValueError, match="FLEXTP_SLOWDOWN"):
        slowdown_factor(0, "fast")


def test_proportional_counts_and_rebalance_move_fewest():
    assert proportional_counts(32, (1.0, 0.5)) == (22, 10)
    assert proportional_counts(32, (1.0, 0.55)) == (21, 11) and proportional_counts(8, (1, 1, 1)) == (3, 3, 2)
    assert proportional_counts(4, (1.0, 0.01)) == (3, 1)
    even = even_partition(8, 2)
    moved = rebalance(even, (5, 3))
    assert moved.counts() == (5, 3) and len(even.moves_to(moved)) == 1
    back = rebalance(moved, (4, 4))
    assert back.counts() == (4, 4) and len(moved.moves_to(back)) == 1


COSTS = BalanceCosts(unit_seconds=0.01, bytes_per_unit=1e6, bandwidth=1e9, max_fraction=0.25,
                     min_horizon=20)


def test_modes_and_semi_choices():
    even = (16, 16)
    assert decide("off", even, (1.0, 0.5), 100, COSTS).action == "keep"
    r = decide("resize", even, (1.0, 0.5), 100, COSTS)
    assert r.action == "resize" and r.drops == (0, 4) and r.counts == even
    m = decide("migrate", even, (1.0, 0.5), 100, COSTS)
    assert m.action == "migrate" and m.counts == (22, 10)
    # heavy, lasting imbalance with a cheap link: migrate
    assert decide("semi", even, (1.0, 0.5), 100, COSTS).action == "migrate"
    # the same imbalance over a slow link just detected: resizing avoids the transfer
    slow = BalanceCosts(unit_seconds=0.01, bytes_per_unit=1e6, bandwidth=1e6, min_horizon=5)
    assert decide("semi", even, (1.0, 0.5), 0, slow).action == "resize"
    # ... but once it has lasted long enough, migration pays off
    assert decide("semi", even, (1.0, 0.5), 5000, slow).action == "migrate"
    # balanced again after a migration: go back to even when it pays
    assert decide("semi", (21, 11), (1.0, 1.0), 100, COSTS).counts == even
    assert decide("semi", even, (1.0, 1.0), 100, COSTS).action == "keep"
    # a one-unit change of the balanced partition is within noise: no move
    assert decide("migrate", (21, 11), (1.0, 0.5), 100, COSTS).action == "keep"
    assert decide("migrate", (21, 11), (1.0, 0.48), 100, COSTS).action == "keep"   # 4% gain
    assert decide("migrate", (21, 11), (1.0, 0.45), 100, COSTS).counts == (22, 10)   # 9%
    with pytest.raises(ValueError, match="--tp-balance"):
        decide("fast", even, (1.0, 1.0), 0, COSTS)


def test_proportional_counts_respect_a_capacity():
    assert proportional_counts(8, (1.0, 0.1)) == (7, 1)
    assert proportional_counts(8, (1.0, 0.1), max_units=5) == (5, 3)
    with pytest.raises(ValueError, match="between 1 and 3"):
        proportional_counts(8, (1.0, 1.0), max_units=3)


def test_a_rank_slowed_as_a_whole_gets_fewer_units():
    """offsets: a straggler's time outside the balanced units (in unit times) counts in every
    rank time, so it gets fewer units and skips more than its unit speed alone says."""
    assert proportional_counts(32, (1.0, 0.5), offsets=(0.0, 8.0)) == (24, 8)   # 24 = 8/0.5 + 8
    assert proportional_counts(32, (1.0, 0.5), max_units=20, offsets=(0.0, 8.0)) == (20, 12)
    assert drop_counts((16, 16), (1.0, 0.8), 0.5) == (0, 4)
    assert drop_counts((16, 16), (1.0, 0.8), 0.5, offsets=(0.0, 2.0)) == (0, 5)
    # migrated to the capacity and left the longest: the healthy rank still computes all
    # its units (24 > 8 / 0.5 + 2), and resize gives the same answer
    assert drop_counts((24, 8), (1.0, 0.5), 0.25, offsets=(0.0, 2.0)) == (0, 0)
    assert decide("resize", (24, 8), (1.0, 0.5), 100, COSTS, offsets=(0.0, 2.0)).drops == (0, 0)
    even = (16, 16)
    m = decide("migrate", even, (1.0, 0.5), 100, COSTS, offsets=(0.0, 8.0))
    assert m.counts == (24, 8)
    capped = BalanceCosts(unit_seconds=0.01, bytes_per_unit=1e6, bandwidth=1e9, max_units=20)
    assert decide("migrate", even, (1.0, 0.5), 100, capped, offsets=(0.0, 8.0)).counts == (20, 12)
    # the cost comparison counts the offsets: keeping even costs 16/0.5 + 8 unit times per step
    semi = decide("semi", even, (1.0, 0.5), 100, COSTS, offsets=(0.0, 8.0))
    assert semi.costs["keep"] == pytest.approx(100 * 40 * 0.01)
    with pytest.raises(ValueError, match="offsets"):
        proportional_counts(32, (1.0, 0.5), offsets=(0.0,))


def test_semi_migrates_to_the_capacity_and_resizes_the_rest():
    """A straggler left the slowest by a migration the slot capacity clamps: semi migrates
    and skips on top, unless the accuracy charge outweighs the time it saves."""
    capped = BalanceCosts(unit_seconds=0.01, bytes_per_unit=1e6, bandwidth=1e9, max_units=20,
                          max_fraction=0.25)
    even = (16, 16)
    # to (20, 12): the straggler needs 12 / 0.5 + 8 = 32 unit times against 20; skipping 3
    # (a quarter of 12) leaves 26, charged 3 / 32 of the even step (16 unit times)
    d = decide("semi", even, (1.0, 0.5), 100, capped, offsets=(0.0, 8.0))
    assert (d.action, d.counts, d.drops) == ("migrate+resize", (20, 12), (0, 3))
    assert d.costs["migrate+resize"] == pytest.approx(d.costs["migrate"] - 100 * (6 - 1.5) * 0.01)
    heavy = BalanceCosts(unit_seconds=0.01, bytes_per_unit=1e6, bandwidth=1e9, max_units=20,
                         max_fraction=0.25, accuracy_weight=100.0)
    assert decide("semi", even, (1.0, 0.5), 100, heavy, offsets=(0.0, 8.0)).action == "migrate"
    # migrate alone never skips
    assert decide("migrate", even, (1.0, 0.5), 100, capped, offsets=(0.0, 8.0)).drops == (0, 0)
