"""FlexTP in the main training loop (`--tp-balance` of pretrain_gpt.py): measure, detect,
decide and apply at iteration boundaries, composed with PP, DP and dynamic micro-batches.

Each iteration every rank reports the TP compute seconds and work its FlexPairs measured
(megatron/flextp/stage_layers.py; work = tokens x units x MACs, so variable micro-batch shapes
compare) and the seconds of their forward all-reduces, in one float64 all-reduce over the whole
world. Between two all-reduces every TP rank of a layer spans the same wall time, pair compute
+ other compute + waiting, so pair seconds + all-reduce seconds differ between ranks by the
other compute's difference: a straggler slowed as a whole (another process on its core) takes
that much longer in its norms, residuals and the rest outside the pairs, and the policies then
give it fewer units than its pair speed alone says (`offsets`, dynapipe_ext/flextp/policy.py).
The output head's norm and output layer come after the last pair's all-reduce and before the
cross-entropy's, which are not timed; each rank times that compute itself (HeadTimer) and
reports it too, so its difference between ranks counts as outside work as well.
A pipeline stage's decision uses the figures of its own ranks only: for each TP rank index,
the slowest of the data-parallel replicas (a slow replica holds the DP all-reduce of all of
them). Every rank of a stage thus feeds the same numbers to the same detector and policy
(dynapipe_ext/flextp) and takes the same decision; the replicas of a stage keep one partition,
so their gradients still add up slot by slot. Migration runs within each TP group
(point-to-point); resizing skips the smallest-norm units of each layer (the replicas hold
equal weights, so they pick the same ones), by default not those it skipped in the interval
before (--flextp-skip-order rotate). A decision that changes the counts migrates, whatever
else it does (semi's migrate+resize also sets skips)."""
from __future__ import annotations

import contextlib
import statistics
import time

import torch
import torch.distributed as dist

from dynapipe_ext.flextp.detector import StragglerDetector
from dynapipe_ext.flextp.partition import even_partition, proportional_counts, rebalance
from dynapipe_ext.flextp.policy import BalanceCosts, decide, parse_speeds
from dynapipe_ext.flextp.resize import MAX_DROP_FRACTION, choose_drops, max_drops
from megatron.flextp.layers import MODELLED_BANDWIDTH, modelled_clock, slowdown_factor
from megatron.flextp.stage_layers import FlexPair, HeadTimer, convert_stages, migrate_pairs


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


def stage_figures(table: torch.Tensor, pp_rank: int, tp: int):
    """Per TP rank index of pipeline rank `pp_rank`: (seconds, work, all-reduce seconds, head
    seconds) of its slowest replica. `table` rows are (pp rank, tp rank, seconds, work,
    tokens, all-reduce seconds, head seconds), one per world rank."""
    times, work, syncs, heads = [0.0] * tp, [0.0] * tp, [0.0] * tp, [0.0] * tp
    for pp, t, seconds, done, _, sync, head in table.tolist():
        if int(pp) != pp_rank or seconds <= 0 or done <= 0:
            continue
        t = int(t)
        if work[t] == 0 or done / seconds < work[t] / times[t]:
            times[t], work[t], syncs[t], heads[t] = seconds, done, sync, head
    return times, work, syncs, heads


def outside_seconds(times, syncs, stragglers, heads=None) -> tuple[float, ...]:
    """Per TP rank, the seconds it spends outside the pairs beyond what the healthy ranks do
    (0 for the healthy ones, never below 0): pair seconds + all-reduce seconds is the same
    span less the outside compute between the pairs on every rank (module docstring), and
    `heads`, the output head's compute timed on each rank (HeadTimer), adds what falls
    outside those spans."""
    heads = heads or (0.0,) * len(times)
    spans = [t + s - h for t, s, h in zip(times, syncs, heads)]
    healthy = [x for r, x in enumerate(spans) if r not in stragglers]
    if not healthy or not stragglers:
        return (0.0,) * len(times)
    base = sum(healthy) / len(healthy)
    return tuple(max(0.0, base - x) if r in stragglers else 0.0 for r, x in enumerate(spans))


def change_line(iteration: int, pp_rank: int, record: dict) -> str:
    """The log line of a partition or skip change (tools/bench_flextp_trainer.py parses it)."""
    outside = ", ".join(f"{s:.4f}" for s in record.get("outside_s", ()))
    return (f"[flextp] iteration {iteration} (pipeline rank {pp_rank}): {record['action']}; "
            f"units per TP rank {record['counts']}, skipped per layer {record['skips']}; "
            f"stragglers (TP ranks) {record['stragglers']}"
            + (f"; seconds outside the pairs beyond the healthy ranks [{outside}]"
               if outside else ""))


class StageBalancer:
    """The `--tp-balance` loop of one rank (see the module docstring)."""

    def __init__(self, pairs: dict[str, list[FlexPair]], mode: str, layout, group,
                 interval: int = 10, max_fraction: float = MAX_DROP_FRACTION,
                 accuracy_weight: float = 1.0,
                 min_horizon: int = 20, patience: int = 6, warmup_iters: int = 3,
                 verbose: bool = False, skip_order: str = "rotate", heads=()):
        self.pairs, self.mode, self.layout, self.group = pairs, mode, layout, group
        self.heads = list(heads)      # HeadTimer of this rank's output head, if it has one
        self.skip_order = skip_order
        self.tp = layout.tp
        self.interval, self.max_fraction = interval, max_fraction
        self.accuracy_weight, self.min_horizon = accuracy_weight, min_horizon
        self.detector = StragglerDetector(self.tp, patience=patience)
        self.warmup_iters, self.verbose = warmup_iters, verbose
        self.optimizer = None
        self.observed, self.lasted = 0, 0
        self._interval_rows: list = []
        self.history: list[dict] = []
        # units each TP rank skips per layer, by kind (every rank of the stage knows them)
        self.skips = {k: [0] * self.tp for k in pairs}
        self.bandwidth = 1.0
        if mode == "semi":   # one figure for every rank, so every replica decides alike
            bw = torch.tensor([measure_bandwidth(group)], dtype=torch.float64)
            dist.all_reduce(bw, op=dist.ReduceOp.MIN)
            self.bandwidth = float(bw)

    def counts(self) -> dict[str, list[int]]:
        return {k: list(ps[0].partition.counts()) for k, ps in self.pairs.items() if ps}

    def start_uneven(self, speeds) -> None:
        """Before training: the partition proportional to known relative speeds (no optimizer
        state yet, so only the weights move)."""
        for kind, ps in self.pairs.items():
            if ps:
                part = ps[0].partition
                target = proportional_counts(part.num_units, speeds, max_units=ps[0].capacity)
                migrate_pairs(ps, None, rebalance(part, target), self.group)

    @contextlib.contextmanager
    def all_units(self):
        """Every unit computed inside the block (validation measures the whole model, not the
        resized one); the skips come back after it."""
        saved = [(p, p.drops) for ps in self.pairs.values() for p in ps]
        for p, _ in saved:
            p.set_drops(())
        try:
            yield
        finally:
            for p, drops in saved:
                p.set_drops(drops)

    @contextlib.contextmanager
    def even_layout(self):
        """Megatron's even partition inside the block, the layout of a checkpoint: units move
        back with their fp32 main copies and Adam moments, so each slotted parameter holds this
        rank's even shard in its leading `tp_shard_size` entries and zeros after (what
        --save writes and --load fills, as an ordinary TP run's). After the block the units
        move to the partition of before and its skips and imputation state come back, exactly
        (migration copies). Collective within every TP group. An error inside the block ends
        the run (as a failed save or load does), so nothing is restored then."""
        before = {kind: (ps[0].partition, [(p, p.drops, p.contrib.clone()) for p in ps])
                  for kind, ps in self.pairs.items() if ps}
        for kind, (part, _) in before.items():
            even = even_partition(part.num_units, self.tp)
            if part != even:
                migrate_pairs(self.pairs[kind], self.optimizer, even, self.group)
        yield
        for kind, (part, saved) in before.items():
            if self.pairs[kind][0].partition != part:
                migrate_pairs(self.pairs[kind], self.optimizer, part, self.group)
                for p, drops, contrib in saved:
                    p.contrib.copy_(contrib)
                    p.set_drops(drops)

    def begin(self) -> None:
        """Start of an iteration: clear the pairs' timers."""
        for ps in self.pairs.values():
            for p in ps:
                p.reset_timer()
        for h in self.heads:
            h.reset_timer()

    def end(self, iteration: int) -> dict:
        """End of an iteration (after the optimizer step): share the figures, feed the detector,
        decide at interval ends. Collective over the world."""
        mine = [p for ps in self.pairs.values() for p in ps]
        row = torch.zeros(self.layout.world_size, 7, dtype=torch.float64)
        row[self.layout.rank] = torch.tensor([self.layout.pp_rank, self.layout.tp_rank,
                                              sum(p.seconds for p in mine),
                                              sum(p.work for p in mine),
                                              max((p.tokens for p in mine), default=0.0),
                                              sum(p.sync_seconds for p in mine),
                                              sum(h.seconds for h in self.heads)],
                                             dtype=torch.float64)
        dist.all_reduce(row)
        times, work, syncs, heads = stage_figures(row, self.layout.pp_rank, self.tp)
        record = {"iteration": iteration, "times": times, "work": work, "heads": heads,
                  "action": None}
        if all(t > 0 for t in times) and all(w > 0 for w in work):
            warm = self.observed >= self.warmup_iters
            changed = warm and self.detector.update(times, work)
            self.lasted = 0 if changed else self.lasted + 1
            self.observed += 1
            self._interval_rows.append((times, work, float(row[self.layout.rank, 4]), syncs,
                                        warm, heads))
        record["stragglers"] = sorted(self.detector.stragglers)
        if self.observed and self.observed % self.interval == 0 and self._interval_rows:
            record.update(self._decide())
            self._interval_rows = []
        record.update(counts=self.counts(),
                      drops={k: [len(p.drops) for p in ps] for k, ps in self.pairs.items()})
        record["skips"] = {k: list(v) for k, v in self.skips.items()}
        before = self.history[-1] if self.history else record
        self.history.append(record)
        if self.verbose and (record["counts"], record["skips"]) != (before["counts"],
                                                                    before["skips"]):
            print(change_line(iteration + 1, self.layout.pp_rank, record), flush=True)
        return record

    def _decide(self) -> dict:
        speeds = self.detector.relative_speeds()
        fast = max(range(self.tp), key=lambda r: speeds[r])
        rows = self._interval_rows
        sec_per_work = sum(r[0][fast] for r in rows) / sum(r[1][fast] for r in rows)
        tokens = sum(r[2] for r in rows) / len(rows)
        # per TP rank, outside seconds beyond the healthy ranks': the median over the
        # interval's iterations after the warm-up (one slow all-reduce must not move units;
        # the first iterations' waits are start-up, not the ranks' speeds)
        per_row = [outside_seconds(r[0], r[3], self.detector.stragglers, r[5])
                   for r in rows if r[4]]
        outside = tuple(statistics.median(o[i] for o in per_row) if per_row else 0.0
                        for i in range(self.tp))
        unit_seconds = {kind: ps[0].unit_macs() * tokens * len(ps) * sec_per_work
                        for kind, ps in self.pairs.items() if ps}
        all_units = sum(unit_seconds[k] * self.pairs[k][0].partition.num_units
                        for k in unit_seconds)
        actions = {}
        for kind, ps in self.pairs.items():
            if not ps:
                continue
            numel = sum(param.numel() // param.shape[axis] * per * halves
                        for param, axis, per, halves in ps[0].sharded())
            part = ps[0].partition
            cap = ps[0].capacity
            costs = BalanceCosts(
                unit_seconds=unit_seconds[kind],
                bytes_per_unit=numel * 4 * 4 * len(ps),   # weight, main, 2 moments in fp32
                bandwidth=self.bandwidth, accuracy_weight=self.accuracy_weight,
                max_fraction=self.max_fraction, min_horizon=self.min_horizon, max_units=cap)
            # each kind takes its share (by unit work) of the outside seconds, in its units
            share = unit_seconds[kind] * part.num_units / all_units
            offsets = tuple(o * share / unit_seconds[kind] for o in outside)
            decision = decide(self.mode, part.counts(), speeds, self.lasted, costs, offsets)
            counts = decision.counts
            if counts != part.counts():
                migrate_pairs(ps, self.optimizer, rebalance(part, counts), self.group)
            rank_drops = decision.drops[self.layout.tp_rank]
            for p in ps:
                n = min(rank_drops, max_drops(len(p.units()), self.max_fraction))
                rest = p.drops if self.skip_order == "rotate" else ()
                p.set_drops(choose_drops(p.units(), p.unit_norms(), n, rest) if n else ())
            self.skips[kind] = [min(d, max_drops(c, self.max_fraction))
                                for d, c in zip(decision.drops, decision.counts)]
            actions[kind] = decision.action
        return {"action": actions, "speeds": list(speeds), "outside_s": list(outside)}


def default_ffn_unit(ffn: int, tp: int) -> int:
    """ffn columns per MLP unit: 16 units per TP rank, or fewer where ffn does not split so."""
    for per_rank in range(16, 0, -1):
        if ffn % (per_rank * tp) == 0:
            return ffn // (per_rank * tp)
    raise ValueError(f"--ffn-hidden-size {ffn} does not split over TP={tp}")


def build_balancer(cfg, stages, layout, verbose: bool = True) -> StageBalancer:
    """Convert this rank's stages to FlexTP slots and make the run's balancer (before the
    gradient buffer and optimizer exist; set `.optimizer` once they do). Collective."""
    from megatron.core import parallel_state
    ffn_unit = cfg.flextp_ffn_unit or default_ffn_unit(cfg.ffn_hidden_size, layout.tp)
    pairs = convert_stages(stages, layout.tp, layout.tp_rank, ffn_unit,
                           slowdown_factor(layout.tp_rank), imputes=cfg.tp_balance != "migrate",
                           max_share=cfg.tp_balance_max_share)
    heads = [HeadTimer(m.head, modelled_clock()) for m in stages.values()
             if getattr(m, "head", None) is not None]
    balancer = StageBalancer(pairs, cfg.tp_balance, layout,
                             parallel_state.get_tensor_model_parallel_group(),
                             interval=cfg.flextp_interval,
                             max_fraction=cfg.flextp_max_drop_fraction,
                             accuracy_weight=cfg.flextp_accuracy_weight,
                             min_horizon=cfg.flextp_min_horizon, patience=cfg.flextp_patience,
                             verbose=verbose and layout.rank == 0,
                             skip_order=cfg.flextp_skip_order, heads=heads)
    speeds = parse_speeds(cfg.flextp_initial_speeds, layout.tp)
    if speeds is not None:
        balancer.start_uneven(speeds)
    return balancer
