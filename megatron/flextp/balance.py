"""FlexTP at run time: every iteration each TP rank reports the compute time it measured (its
step time less the time spent in TP all-reduces) and the work it did; every `interval` iterations
the SEMI policy (or the fixed `--tp-balance` mode) decides per block kind whether to keep the
partition, ZERO-resize the straggler or migrate units, and this module applies the decision."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from dynapipe_ext.flextp.detector import StragglerDetector
from dynapipe_ext.flextp.partition import rebalance
from dynapipe_ext.flextp.policy import BalanceCosts, decide
from dynapipe_ext.flextp.resize import choose_drops, max_drops
from megatron.flextp.layers import MODELLED_BANDWIDTH, modelled_clock
from megatron.flextp.migrate import migrate_blocks

KINDS = ("attn", "mlp")


def unit_macs(block) -> int:
    """Multiply-adds of one unit per token (column rows + row columns against the hidden size)."""
    return (block.col_rows + block.row_cols) * block.hidden


def unit_bytes(block, optimizer) -> int:
    """Bytes migrating one unit sends: its slices of the weights and optimizer fields (fp32)."""
    numel = sum(p.numel() // p.shape[axis] * per for p, axis, per in block.sharded())
    return numel * (1 + len(optimizer.FIELDS)) * 4


def rank_work(model) -> float:
    """MACs per token this rank computes in the FlexTP blocks (skipped units excluded)."""
    return float(sum((len(b.units()) - len(b.drops)) * unit_macs(b)
                     for kind in KINDS for b in model.blocks(kind)))


def apply_resize(blocks, n_drop: int, max_fraction: float) -> list[tuple[int, ...]]:
    """Skip the `n_drop` smallest-norm units of each block (at most the bound); returns them."""
    out = []
    for b in blocks:
        n = min(n_drop, max_drops(len(b.units()), max_fraction))
        b.set_drops(choose_drops(b.units(), b.unit_norms(), n) if n else ())
        out.append(b.drops)
    return out


def measure_bandwidth(group, nbytes: int = 1 << 20, repeats: int = 3) -> float:
    """Bytes per second of one all-reduce of `nbytes` on the TP group (best of `repeats`);
    MODELLED_BANDWIDTH under FLEXTP_CLOCK=modelled."""
    if modelled_clock():
        return MODELLED_BANDWIDTH
    buf = torch.zeros(nbytes // 4)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dist.all_reduce(buf, group=group)
        best = min(best, time.perf_counter() - start)
    return nbytes / best


class Balancer:
    def __init__(self, model, optimizer, mode: str, group, rank: int, tp: int,
                 interval: int = 10, max_fraction: float = 0.25, accuracy_weight: float = 1.0,
                 min_horizon: int = 20, detector: StragglerDetector | None = None,
                 warmup_iters: int = 3):
        self.model, self.optimizer, self.mode = model, optimizer, mode
        self.group, self.rank, self.tp, self.interval = group, rank, tp, interval
        self.max_fraction, self.accuracy_weight, self.min_horizon = (
            max_fraction, accuracy_weight, min_horizon)
        self.detector = detector or StragglerDetector(tp)
        self.bandwidth = measure_bandwidth(group) if mode == "semi" else 1.0
        self.iteration, self.lasted, self.warmup_iters = 0, 0, warmup_iters
        self._times = []
        # units each rank skips now, per block kind (every rank derives the same figures)
        self.drop_counts = {k: [0] * tp for k in KINDS}

    def observe(self, compute_seconds: float) -> dict:
        """Record this iteration; at interval ends decide and apply. Returns what happened."""
        buf = torch.zeros(2 * self.tp, dtype=torch.float64)
        buf[self.rank], buf[self.tp + self.rank] = compute_seconds, rank_work(self.model)
        dist.all_reduce(buf, group=self.group)
        times, work = buf[:self.tp].tolist(), buf[self.tp:].tolist()
        # the first iterations (allocator, thread pools, lazy init) are not the ranks' speed
        changed = self.iteration >= self.warmup_iters and self.detector.update(times, work)
        self.lasted = 0 if changed else self.lasted + 1
        self.iteration += 1
        self._times.append((times, work))
        record = {"times": times, "work": work, "stragglers": sorted(self.detector.stragglers),
                  "action": None}
        if self.iteration % self.interval:
            return record
        speeds = self.detector.relative_speeds()
        # seconds per MAC-per-token from the fastest rank over the interval
        recent = self._times[-self.interval:]
        fast = max(range(self.tp), key=lambda r: speeds[r])
        sec_per_mac = (sum(t[fast] for t, _ in recent) / sum(w[fast] for _, w in recent))
        self._times = []
        actions = {}
        for kind in KINDS:
            blocks = self.model.blocks(kind)
            costs = BalanceCosts(unit_seconds=unit_macs(blocks[0]) * len(blocks) * sec_per_mac,
                                 bytes_per_unit=unit_bytes(blocks[0], self.optimizer)
                                 * len(blocks),
                                 bandwidth=self.bandwidth, accuracy_weight=self.accuracy_weight,
                                 max_fraction=self.max_fraction, min_horizon=self.min_horizon)
            part = blocks[0].partition
            decision = decide(self.mode, part.counts(), speeds, self.lasted, costs)
            if decision.action == "migrate":
                migrate_blocks(blocks, self.optimizer, rebalance(part, decision.counts),
                               self.group)
            apply_resize(blocks, decision.drops[self.rank], self.max_fraction)
            self.drop_counts[kind] = [min(d, max_drops(c, self.max_fraction))
                                      for d, c in zip(decision.drops, decision.counts)]
            actions[kind] = decision.action
        record.update(action=actions, speeds=list(speeds),
                      counts={k: list(self.model.blocks(k)[0].partition.counts()) for k in KINDS},
                      drops={k: list(v) for k, v in self.drop_counts.items()})
        return record
