"""Micro-batch planners: one question ("given these sample lengths, which micro-batches?"), four
answers selected by name -- padding, token-budget, packing and dynamic (DynaPipe).

    plan = plan_micro_batches(lengths, PlannerConfig(...), cost_model, "dynamic")

Every micro-batch carries its predicted time and memory from the cost model, its recompute mode
(the cheapest allowed one that fits memory, see cost_model.memory_needed) and a padded shape
rounded up to `round_to` (packed rows are exactly `max_seq_len` long). Micro-batches are then
split over data-parallel replicas so the slowest replica's predicted makespan is as small as
possible (replica_split)."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np

from dynapipe_ext.costs.cost_model import CostModel, MicroBatchCosts, cost_micro_batches, memory_needed
from dynapipe_ext.batching.dp_split import makespan_objective, optimal_split
from dynapipe_ext.batching.packing import ALGORITHMS, pack_pairs, pack_sequences
from dynapipe_ext.batching.microbatch import (DYNAMIC_LAYOUTS, MODEL_TYPES, RECOMPUTE_MODES, BatchPlan, MicroBatch,
                         as_lengths, packed_cost_shape, padding_efficiency)
from dynapipe_ext.batching.ordering import (T5_ORDERS, enc_dec_order, groups_order, length_order, refine_groups,
                       t5_order)
from dynapipe_ext.batching.replica_split import balanced_partition, replica_makespans

OVERLONG_POLICIES = ("error", "truncate")
MAX_TABLE_ENTRIES = 4_000_000     # bounds the dynamic planner's segment table (n x width)
REFINE_ROUNDS = 16   # T5 local-search rounds: on FLAN-like batches later ones add < 0.1%
PACKING_ALGORITHMS = ALGORITHMS    # the packers' own list (batching/packing.py)
# how packing's rows compute attention, hence how they are costed: per sample ("segments",
# the trainer's default: FlexAttention / grouped SDPA) or over the whole row with a
# block-diagonal mask ("mask", S^2 work: packing without a varlen kernel)
PACKED_ATTENTION = ("segments", "mask")
# --attention-backend (megatron/model/attention.py runs them) -> how the planner costs a packed
# row under it: FlexAttention's document mask and SDPA per group of sample lengths compute
# each sample's block ("segments"), "dense-mask" one SDPA over the row ("mask")
ATTENTION_COSTING = {"flex": "segments", "sdpa": "segments", "dense-mask": "mask"}
ATTENTION_BACKENDS = ("auto",) + tuple(ATTENTION_COSTING)


class PlanningError(ValueError):
    """The batch cannot be planned as asked (bad sample, shape over memory, ...)."""


@dataclass(frozen=True)
class PlannerConfig:
    """Limits and knobs shared by all strategies (validated on construction).

    pipeline_stages: stages the cost model cuts the model into (one per pipeline rank); the
        makespan model's P.
    stage_chunks: model chunks each pipeline rank runs per micro-batch (1 on the linear layout,
        v interleaved, 2W on Hanayo's waves). The bubble of the makespan model
        sum t + (P - 1) / stage_chunks * max t shrinks with it, since a warm-up or cool-down
        step is one chunk's work (dp_split's objective with `makespan_stages` as its P).
    memory_limit_bytes: activation bytes per device; None = ask the cost model.
    tokens_per_global_batch: if set, real tokens of the batch (each of encoder and decoder
        for T5) must not exceed it.
    micro_batch_size: rows per micro-batch for padding / packing; None = padding: the most
        rows that fit memory at the maximum lengths; packing: per batch, the grouping of
        least predicted makespan (best_row_grouping).
    token_budget: padded tokens (T5: encoder + decoder) per micro-batch for token-budget;
        None = micro_batch_size-at-max-length worth of tokens.
    overlong: "error" or "truncate" for samples longer than the maximum lengths.
    t5_order: sample order of the dynamic planner for T5 ("auto" = best of ordering.T5_ORDERS
        and of a local-search refinement of the best, see plan_dynamic).
    dp_probes: t_max bounds the dynamic planner evaluates per DP pass (speed only).
    max_segment_samples: most samples in one dynamic micro-batch; None = as many as fit
        memory, but at most max(64, MAX_TABLE_ENTRIES // n) so the segment table stays small
        (the plan is optimal among splits obeying the cap).
    min_padding_efficiency: if set (0 < x <= 1), the dynamic planner only forms micro-batches of
        two or more samples whose real / padded tokens reach it (encoder and decoder apart;
        one-sample micro-batches are always allowed). It trades predicted time for padding:
        the plan is optimal among splits obeying it. None = no constraint (padded layout only).
    dynamic_layout: how the dynamic planner lays out a micro-batch (microbatch.DYNAMIC_LAYOUTS):
        "packed", one token stream of its samples (one row; positions restart per sample,
        attention within a sample; only the end is padded, to round_to), costed by
        microbatch.packed_cost_shape; or "padded", the DynaPipe paper's one sample per row,
        padded to the longest.
    packed_attention: how packing's rows compute attention (PACKED_ATTENTION), so the packing
        strategy is costed as it runs: "segments" by slots and per-sample attention, "mask"
        as dense rows."""

    model: str = "gpt"
    max_seq_len: int = 2048
    max_dec_seq_len: int = 0
    pipeline_stages: int = 1
    stage_chunks: int = 1
    data_parallel: int = 1
    memory_limit_bytes: float | None = None
    tokens_per_global_batch: int | None = None
    round_to: int = 8
    micro_batch_size: int | None = None
    pad_to_max: bool = False
    token_budget: int | None = None
    packing_algorithm: str = "nextfit"
    max_pack_depth: int | None = None
    recompute_modes: tuple[str, ...] = RECOMPUTE_MODES
    overlong: str = "error"
    t5_order: str = "auto"
    dp_probes: int = 32
    max_segment_samples: int | None = None
    min_padding_efficiency: float | None = None
    dynamic_layout: str = DYNAMIC_LAYOUTS[0]   # "packed", the trainer's --dynamic-layout too
    packed_attention: str = "segments"

    @property
    def makespan_stages(self) -> float:
        """The P of the makespan model: 1 + (P - 1) / stage_chunks."""
        return 1.0 + (self.pipeline_stages - 1) / self.stage_chunks

    def __post_init__(self):
        def positive(name, allow_none=False):
            value = getattr(self, name)
            if value is None and allow_none:
                return
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"PlannerConfig.{name} must be a positive integer"
                                 f"{' or None' if allow_none else ''}, got {value!r}")

        if self.model not in MODEL_TYPES:
            raise ValueError(f"PlannerConfig.model must be one of {MODEL_TYPES}, "
                             f"got {self.model!r}")
        for name in ("max_seq_len", "pipeline_stages", "stage_chunks", "data_parallel",
                     "round_to", "dp_probes"):
            positive(name)
        for name in ("tokens_per_global_batch", "micro_batch_size", "token_budget",
                     "max_pack_depth", "max_segment_samples"):
            positive(name, allow_none=True)
        if self.model == "t5":
            positive("max_dec_seq_len")
        elif self.max_dec_seq_len != 0:
            raise ValueError("PlannerConfig.max_dec_seq_len is for T5 only; leave it 0 for GPT")
        if self.min_padding_efficiency is not None and not 0 < self.min_padding_efficiency <= 1:
            raise ValueError(f"PlannerConfig.min_padding_efficiency must be in (0, 1] or None, "
                             f"got {self.min_padding_efficiency!r}")
        if self.memory_limit_bytes is not None and not self.memory_limit_bytes > 0:
            raise ValueError(f"PlannerConfig.memory_limit_bytes must be > 0 or None, "
                             f"got {self.memory_limit_bytes!r}")
        if self.packing_algorithm not in PACKING_ALGORITHMS:
            raise ValueError(f"PlannerConfig.packing_algorithm must be one of "
                             f"{PACKING_ALGORITHMS}, got {self.packing_algorithm!r}")
        modes = tuple(self.recompute_modes)
        if (not modes or any(m not in RECOMPUTE_MODES for m in modes)
                or len(set(modes)) != len(modes)):
            raise ValueError(f"PlannerConfig.recompute_modes must be distinct names from "
                             f"{RECOMPUTE_MODES}, got {self.recompute_modes!r}")
        # cheapest (fastest, most memory) first: the order in which modes are tried
        object.__setattr__(self, "recompute_modes",
                           tuple(sorted(modes, key=RECOMPUTE_MODES.index)))
        if self.overlong not in OVERLONG_POLICIES:
            raise ValueError(f"PlannerConfig.overlong must be one of {OVERLONG_POLICIES}, "
                             f"got {self.overlong!r}")
        if self.dynamic_layout not in DYNAMIC_LAYOUTS:
            raise ValueError(f"PlannerConfig.dynamic_layout must be one of {DYNAMIC_LAYOUTS}, "
                             f"got {self.dynamic_layout!r}")
        if self.packed_attention not in PACKED_ATTENTION:
            raise ValueError(f"PlannerConfig.packed_attention must be one of "
                             f"{PACKED_ATTENTION}, got {self.packed_attention!r}")
        if self.t5_order not in T5_ORDERS + ("auto",):
            raise ValueError(f"PlannerConfig.t5_order must be 'auto' or one of {T5_ORDERS}, "
                             f"got {self.t5_order!r}")


# ------------------------------------------------------------------ input checks

def effective_lengths(lengths, config: PlannerConfig) -> tuple[np.ndarray, dict[int, tuple]]:
    """Validated lengths as planned: shape (n,) GPT / (n, 2) T5, overlong samples truncated
    when the policy says so. Returns (lengths, {sample id: original length} of truncated)."""
    try:
        arr = as_lengths(lengths, config.model).copy()
    except ValueError as err:
        raise PlanningError(str(err)) from None
    if arr.shape[0] == 0:
        raise PlanningError("the global batch is empty: nothing to plan")
    two_d = arr.reshape(len(arr), -1)
    bad = np.flatnonzero((two_d < 1).any(axis=1))
    if bad.size:
        i = int(bad[0])
        raise PlanningError(f"sample {i} has length {_shape_text(arr[i])}: every sample needs "
                            f"at least one token{' on each side' if config.model == 't5' else ''}"
                            f" ({bad.size} such sample(s))")
    limits = np.array([config.max_seq_len] if config.model == "gpt"
                      else [config.max_seq_len, config.max_dec_seq_len])
    over = np.flatnonzero((two_d > limits).any(axis=1))
    truncated: dict[int, tuple] = {}
    if over.size and config.overlong == "error":
        i = int(over[0])
        raise PlanningError(f"sample {i} has length {_shape_text(arr[i])}, over the maximum "
                            f"{_shape_text(limits if config.model == 't5' else limits[0])} "
                            f"({over.size} such sample(s)); set overlong='truncate' to cut them")
    for i in over:
        truncated[int(i)] = tuple(int(x) for x in two_d[i])
    np.minimum(two_d, limits, out=two_d)
    if config.tokens_per_global_batch is not None:
        totals = two_d.sum(axis=0)
        if (totals > config.tokens_per_global_batch).any():
            raise PlanningError(f"the global batch holds {_shape_text(totals)} real tokens, over "
                                f"tokens_per_global_batch={config.tokens_per_global_batch}")
    return arr, truncated


def _shape_text(x) -> str:
    x = np.asarray(x).reshape(-1)
    return str(int(x[0])) if x.size == 1 else "(" + ", ".join(str(int(v)) for v in x) + ")"


# ------------------------------------------------------------------ costing context

@dataclass
class PlanningContext:
    """One planning call: the checked lengths, the config, the cost model and memory limit."""

    config: PlannerConfig
    cost_model: CostModel
    enc: np.ndarray
    dec: np.ndarray            # zeros for GPT
    memory_limit: float
    info: dict = field(default_factory=dict)

    @property
    def n(self) -> int:
        return len(self.enc)

    def padded(self, length, cap: int) -> np.ndarray:
        """Round up to a multiple of round_to, never beyond the maximum length `cap`."""
        r = self.config.round_to
        return np.minimum(-(-np.asarray(length) // r) * r, cap)

    def padded_enc(self, length):
        return self.padded(length, self.config.max_seq_len)

    def padded_dec(self, length):
        if self.config.model == "gpt":
            return np.zeros_like(np.asarray(length))
        return self.padded(length, self.config.max_dec_seq_len)

    def cost(self, rows, seq_len, dec_seq_len, modes: tuple[str, ...] | None = None
             ) -> MicroBatchCosts:
        return cost_micro_batches(self.cost_model, np.asarray(rows), np.asarray(seq_len),
                                  np.asarray(dec_seq_len), self.config.pipeline_stages,
                                  modes or self.config.recompute_modes, self.memory_limit)

    def micro_batch(self, rows, seq_len: int, dec_seq_len: int) -> MicroBatch:
        """A costed micro-batch; PlanningError when no allowed recompute mode fits."""
        return self.micro_batches([rows], [seq_len], [dec_seq_len])[0]

    def micro_batches(self, rows_list, seq_lens, dec_seq_lens) -> list[MicroBatch]:
        """Costed micro-batches (one vectorised cost call); PlanningError naming the first
        one that fits in no allowed recompute mode."""
        c = self.cost(np.array([len(r) for r in rows_list]), np.asarray(seq_lens),
                      np.asarray(dec_seq_lens))
        bad = np.flatnonzero(c.mode < 0)
        if bad.size:
            i = int(bad[0])
            raise PlanningError(self.explain_infeasible(rows_list[i], int(seq_lens[i]),
                                                        int(dec_seq_lens[i])))
        modes = self.config.recompute_modes
        return [MicroBatch(tuple(tuple(int(s) for s in r) for r in rows), int(seq),
                           int(dec), modes[int(mode)], float(t), int(mem))
                for rows, seq, dec, mode, t, mem in zip(rows_list, seq_lens, dec_seq_lens,
                                                         c.mode, c.time_ms, c.memory_bytes)]

    def aligned(self, tokens) -> np.ndarray:
        """Token counts rounded up to a multiple of round_to (a packed stream's only pad)."""
        r = self.config.round_to
        return -(-np.asarray(tokens) // r) * r

    def packed_micro_batches(self, groups) -> list[MicroBatch] | None:
        """Each group of sample ids as one packed token stream (dynamic_layout "packed"),
        costed in one call; None when one of them fits in no allowed recompute mode."""
        enc_t = self.aligned([int(self.enc[g].sum()) for g in groups])
        dec_t = self.aligned([int(self.dec[g].sum()) for g in groups])
        return self.segment_costed([MicroBatch((tuple(int(i) for i in g),), int(e), int(d))
                                    for g, e, d in zip(groups, enc_t, dec_t)])

    def segment_costed(self, mbs: list[MicroBatch], strict: bool = False
                       ) -> list[MicroBatch] | None:
        """`mbs` costed as rows whose samples attend only within themselves (packed streams,
        packing's rows under per-segment attention): their slots and their samples' squared
        lengths (packed_cost_shape). When one fits in no allowed recompute mode: None, or
        with `strict` a PlanningError naming it."""
        squares = [float((self.enc[list(mb.sample_ids)] ** 2).sum()) for mb in mbs]
        slots = np.array([mb.slots() for mb in mbs], dtype=np.float64).reshape(-1, 2)
        shape = packed_cost_shape(slots[:, 0], squares, slots[:, 1])
        c = self.cost(*shape)
        if (c.mode < 0).any():
            if not strict:
                return None
            bad = mbs[int(np.flatnonzero(c.mode < 0)[0])]
            raise PlanningError(self.explain_infeasible(bad.rows, bad.seq_len, bad.dec_seq_len))
        modes = self.config.recompute_modes
        return [replace(mb, recompute=modes[int(m)], time_ms=float(t), memory_bytes=int(mem),
                        cost_shape=tuple(float(x[i]) for x in shape))
                for i, (mb, m, t, mem) in enumerate(zip(mbs, c.mode, c.time_ms,
                                                        c.memory_bytes))]

    def explain_infeasible(self, rows, seq_len: int, dec_seq_len: int) -> str:
        ids = [int(s) for r in rows for s in r]
        what = (f"sample {ids[0]}" if len(ids) == 1 else
                f"micro-batch of samples {ids[:8]}{'...' if len(ids) > 8 else ''}")
        shape = f"rows={len(rows)}, seq_len={seq_len}" + (
            f", dec_seq_len={dec_seq_len}" if self.config.model == "t5" else "")
        lightest = self.config.recompute_modes[-1]
        arr = self.cost_model.stage_cost_arrays(np.array([len(rows)]), np.array([seq_len]),
                           np.array([dec_seq_len]), self.config.pipeline_stages, lightest)
        if not arr.feasible[0]:
            return (f"{what} (shape {shape}) is outside what the cost model knows "
                    f"(beyond its profiled grid or maximum lengths)")
        need = float(memory_needed(arr)[0])
        return (f"{what} (shape {shape}) needs {need / 2**20:.1f} MiB of activation memory "
                f"even with recompute={lightest!r} over {self.config.pipeline_stages} pipeline "
                f"stage(s), over the limit of {self.memory_limit / 2**20:.1f} MiB")

    def rows_that_fit(self, seq_len: int, dec_seq_len: int,
                      modes: tuple[str, ...] | None = None) -> int:
        """Most rows (<= n) of shape (seq_len, dec_seq_len) that fit in one of `modes` (default:
        the allowed ones); 0 if not even one does. Assumes memory grows with rows."""
        lo, hi = 0, self.n
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.cost(np.array([mid]), np.array([seq_len]), np.array([dec_seq_len]),
                         modes).mode[0] >= 0:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def default_rows(self) -> int:
        """micro_batch_size, or the most rows that fit memory at the maximum lengths without
        recompute (the first allowed mode), at least 1."""
        if self.config.micro_batch_size is not None:
            return self.config.micro_batch_size
        dec_max = self.config.max_dec_seq_len if self.config.model == "t5" else 0
        return max(1, self.rows_that_fit(self.config.max_seq_len, dec_max,
                                         self.config.recompute_modes[:1]))


# ------------------------------------------------------------------ strategies

def plan_padding(ctx: PlanningContext) -> list[MicroBatch]:
    """Fixed micro-batch size in input order, padded to the longest sample (or the maximum)."""
    rows = ctx.default_rows()
    starts = np.arange(0, ctx.n, rows)
    if ctx.config.pad_to_max:
        seqs = np.full(len(starts), ctx.config.max_seq_len)
        decs = np.full(len(starts), ctx.config.max_dec_seq_len)
    else:
        seqs = ctx.padded_enc(np.maximum.reduceat(ctx.enc, starts))
        decs = ctx.padded_dec(np.maximum.reduceat(ctx.dec, starts))
    groups = [[(int(i),) for i in range(s, min(s + rows, ctx.n))] for s in starts]
    ctx.info["micro_batch_size"] = rows
    return ctx.micro_batches(groups, seqs, decs)


def plan_token_budget(ctx: PlanningContext) -> list[MicroBatch]:
    """Sort by length (T5: encoder, then decoder) and cut whenever the padded tokens
    rows * (seq_len + dec_seq_len) would pass the budget. A micro-batch that then does not fit
    memory in any allowed recompute mode is halved until it does."""
    cfg = ctx.config
    budget = cfg.token_budget
    if budget is None:
        budget = ctx.default_rows() * (cfg.max_seq_len + cfg.max_dec_seq_len)
    order = length_order(ctx.enc) if cfg.model == "gpt" else enc_dec_order(ctx.enc, ctx.dec)
    pe = ctx.padded_enc(ctx.enc)
    pd = ctx.padded_dec(ctx.dec)
    groups: list[list[int]] = []
    cur: list[int] = []
    cur_e = cur_d = 0
    for s in order:
        s = int(s)
        if pe[s] + pd[s] > budget:
            raise PlanningError(f"sample {s} of padded shape (seq_len={pe[s]}"
                                f"{f', dec_seq_len={pd[s]}' if cfg.model == 't5' else ''}) "
                                f"alone exceeds the token budget {budget}")
        e, d = max(cur_e, pe[s]), max(cur_d, pd[s])
        if cur and (len(cur) + 1) * (e + d) > budget:
            groups.append(cur)
            cur, e, d = [], pe[s], pd[s]
        cur.append(s)
        cur_e, cur_d = e, d
    groups.append(cur)
    out: list[MicroBatch] = []
    for g in groups:
        out.extend(_fitting_halves(ctx, g))
    ctx.info["token_budget"] = int(budget)
    return out


def _fitting_halves(ctx: PlanningContext, ids: list[int]) -> list[MicroBatch]:
    seq, dec = int(ctx.padded_enc(ctx.enc[ids].max())), int(ctx.padded_dec(ctx.dec[ids].max()))
    c = ctx.cost(np.array([len(ids)]), np.array([seq]), np.array([dec]))
    if c.mode[0] >= 0 or len(ids) == 1:
        return [ctx.micro_batch([(i,) for i in ids], seq, dec)]
    half = len(ids) // 2
    return _fitting_halves(ctx, ids[:half]) + _fitting_halves(ctx, ids[half:])


def plan_packing(ctx: PlanningContext) -> list[MicroBatch]:
    """Pack samples into rows of exactly max_seq_len (T5: and max_dec_seq_len) tokens with the
    configured packer, then group `micro_batch_size` rows per micro-batch; with
    micro_batch_size None, the rows per micro-batch (1, 2, 4, ... or the most that fit) of
    the least predicted makespan (best_row_grouping): the most rows that fit would make a
    single micro-batch of a small global batch, and leave a pipeline nothing to overlap."""
    cfg = ctx.config
    packs = _packer_rows(ctx)
    dec = 0 if cfg.model == "gpt" else cfg.max_dec_seq_len

    def costed(groups, strict):
        if cfg.packed_attention == "mask":
            try:
                return ctx.micro_batches(groups, [cfg.max_seq_len] * len(groups),
                                         [dec] * len(groups))
            except PlanningError:
                if strict:
                    raise
                return None
        return ctx.segment_costed([MicroBatch(tuple(tuple(int(s) for s in r) for r in g),
                                              cfg.max_seq_len, dec) for g in groups],
                                  strict=strict)

    if cfg.micro_batch_size is not None:
        rows = cfg.micro_batch_size
        out = costed([packs[i:i + rows] for i in range(0, len(packs), rows)], strict=True)
    else:
        best = best_row_grouping(ctx, packs, lambda groups: costed(groups, strict=False))
        if best is None:     # not even one row per micro-batch fits: name the row
            costed([[row] for row in packs], strict=True)
        _, rows, out = best
    ctx.info.update(micro_batch_size=rows, packed_rows=len(packs))
    return out


def _packer_rows(ctx: PlanningContext) -> list:
    """The configured packer's rows (sample ids per row) of the batch at the maximum lengths."""
    cfg = ctx.config
    if cfg.model == "gpt":
        return pack_sequences(ctx.enc, cfg.max_seq_len, cfg.packing_algorithm,
                              cfg.max_pack_depth)
    return pack_pairs(ctx.enc, ctx.dec, cfg.max_seq_len, cfg.max_dec_seq_len,
                      cfg.packing_algorithm, cfg.max_pack_depth)


def best_row_grouping(ctx: PlanningContext, packs: list, costed):
    """(objective, rows per micro-batch, micro-batches) of the grouping of the packer's rows
    `packs`, in order, into micro-batches of 1, 2, 4, ... rows (and the most rows that fit
    memory) with the least makespan objective (dp_split.makespan_objective); `costed` maps a
    list of row groups to costed micro-batches, or None when one does not fit. None when no
    grouping fits."""
    cfg = ctx.config
    powers = {1 << k for k in range(max(1, len(packs)).bit_length() + 1)}
    best = None
    for rows in sorted(powers | {ctx.default_rows()}):
        mbs = costed([packs[i:i + rows] for i in range(0, len(packs), rows)])
        if mbs is not None:
            value = makespan_objective([mb.time_ms for mb in mbs], cfg.makespan_stages,
                                       cfg.data_parallel)
            if best is None or value < best[0]:
                best = (value, rows, mbs)
    return best


def plan_dynamic(ctx: PlanningContext) -> list[MicroBatch]:
    """DynaPipe: order samples so neighbours have similar shapes, then take the contiguous
    split minimising sum_k t_k / D + (P - 1) max_k t_k (dp_split.optimal_split), each
    micro-batch in the cheapest recompute mode that fits memory, laid out as
    config.dynamic_layout says.

    Packed layout: a micro-batch is one token stream of its samples, costed by its slots and
    per-sample attention (microbatch.packed_cost_shape). The packer's own plan (packing's
    micro-batches at every power-of-two rows per micro-batch, each as one stream) is a
    candidate too, so the plan is never predicted slower than packing's under the same cost
    model; T5 skips the local-search refinement (it refines padded shapes).

    T5 with t5_order="auto" plans the clustering + TSP order of the DynaPipe paper, refines
    its split by a local search over sample moves between micro-batches
    (ordering.refine_groups) and plans the order that makes the refined groups contiguous,
    then the 2-D snake and encoder-lexsort orders; the lowest DP objective wins, so the plan
    is never worse than any of these orders (clustering + TSP included). Each later order
    only looks for plans beating the best so far (_plan_order), which keeps them cheap.
    info["objective_ms_by_order"] holds each order's objective (None: not better than the
    best before it)."""
    cfg = ctx.config
    if cfg.model == "gpt":
        orders = {"length": length_order(ctx.enc)}
    else:
        # clustering + TSP first: usually the best, so its objective prunes the others' tables
        names = T5_ORDERS[::-1] if cfg.t5_order == "auto" else (cfg.t5_order,)
        orders = {name: t5_order(ctx.enc, ctx.dec, name) for name in names}
    by_order = ctx.info.setdefault("objective_ms_by_order", {})
    best = None
    for name, order in orders.items():
        incumbent = _chunked_objective(ctx, order) if best is None else best[2].objective
        planned = _plan_order(ctx, name, order, incumbent)
        if planned is None and best is None:     # the chunked split was not beaten
            planned = _plan_order(ctx, name, order)
        by_order[name] = None if planned is None else planned[2].objective
        if planned is not None:
            best = planned
        if name == "cluster-tsp" and cfg.t5_order == "auto" and cfg.dynamic_layout == "padded":
            # refine now: a low incumbent makes the remaining orders' tables and DPs cheap
            planned = _refined(ctx, best)
            by_order["refined"] = None if planned is None else planned[2].objective
            if planned is not None:
                best = planned
    name, order, split, table = best
    modes = cfg.recompute_modes
    out = [table.shapes.micro_batch(start, end, modes[int(table.mode[end - 1, end - start - 1])],
                                    float(table.time[end - 1, end - start - 1]),
                                    int(table.memory[end - 1, end - start - 1]))
           for start, end in split.segments()]
    objective = split.objective
    if cfg.dynamic_layout == "packed":
        packed = _packing_candidate(ctx)
        if packed is not None and packed[0] < objective:
            objective, out, name = packed[0], packed[1], "packing"
        by_order["packing"] = None if packed is None else packed[0]
    ctx.info.update(objective_ms=objective, segments_costed=table.costed, order=name,
                    dynamic_layout=cfg.dynamic_layout)
    return out


def _packing_candidate(ctx: PlanningContext):
    """(objective, micro-batches) of the best packing plan laid out as packed streams: the
    configured packer's rows grouped as best_row_grouping finds best, each group one stream;
    None when none fits memory."""
    def as_streams(groups):
        return ctx.packed_micro_batches([np.array([s for row in g for s in row], dtype=np.int64)
                                         for g in groups])
    best = best_row_grouping(ctx, _packer_rows(ctx), as_streams)
    return None if best is None else (best[0], best[2])


def _refined(ctx: PlanningContext, best):
    """The plan of the order that makes ordering.refine_groups' improvement of `best`'s
    micro-batches contiguous; None when it does not beat `best`."""
    cfg = ctx.config
    order, split = best[1], best[2]
    groups, _ = refine_groups(ctx.enc, ctx.dec, [order[s:e] for s, e in split.segments()],
                              _segment_time_fn(ctx), cfg.makespan_stages, cfg.data_parallel,
                              max_rounds=REFINE_ROUNDS)
    return _plan_order(ctx, "refined", groups_order(ctx.enc, ctx.dec, groups), split.objective)


def _chunked_objective(ctx: PlanningContext, order: np.ndarray) -> float | None:
    """Objective of the best split of `order` into equal runs of n/8, n/16, n/32 or n/64
    samples (one cost call); an upper bound on the optimum that lets the first order's
    table leave out slow segments (_plan_order). None when none of these fits memory."""
    n = ctx.n
    sizes = np.unique(np.clip(np.round(n / np.array([8, 16, 32, 64])), 1, n)).astype(np.int64)
    starts = [np.arange(0, n, size) for size in sizes]
    begin = np.concatenate(starts)
    end = np.concatenate([np.append(st[1:], n) for st in starts])
    times = ctx.cost(*segment_shapes(ctx, order).cost_shapes(begin, end)).time_ms
    best = None
    for t in np.split(times, np.cumsum([len(st) for st in starts])[:-1]):
        if np.isfinite(t).all():
            value = makespan_objective(t, ctx.config.makespan_stages, ctx.config.data_parallel)
            best = value if best is None else min(best, value)
    return None if best is None else best * (1 + 1e-9)


def _plan_order(ctx: PlanningContext, name: str, order: np.ndarray,
                incumbent: float | None = None):
    """(name, order, optimal contiguous split, segment table) of one sample order; None when
    a plan better than `incumbent` (an objective already reached) does not exist in it.

    With an incumbent F, a micro-batch of time t can only be part of a better split if
    t * (1 / D + P - 1) < F (the objective is at least t / D + (P - 1) t), so the table
    leaves longer segments out: the DP stays exact among the splits that could win, and
    costs far less."""
    cfg = ctx.config
    bound = np.inf if incumbent is None else (
        incumbent / (1.0 / cfg.data_parallel + cfg.makespan_stages - 1))
    try:
        table = SegmentTable(ctx, order, time_bound=bound)
        split = optimal_split(table.time, cfg.makespan_stages, cfg.data_parallel,
                              cfg.dp_probes, np.inf if incumbent is None else incumbent)
    except (PlanningError, ValueError):
        if incumbent is None:
            raise
        return None            # some sample cannot be in any micro-batch under the bound
    if split is None or (incumbent is not None and not split.objective < incumbent):
        return None
    return name, order, split, table


def _segment_time_fn(ctx: PlanningContext):
    """segment_time(rows, max enc, max dec) -> time ms (inf: over memory or over the segment
    cap) for ordering.refine_groups, with the planner's padding and recompute choice."""
    cap = ctx.config.max_segment_samples or max(64, MAX_TABLE_ENTRIES // ctx.n)

    def segment_time(rows, enc_max, dec_max):
        rows = np.asarray(rows)
        t = ctx.cost(rows, ctx.padded_enc(enc_max), ctx.padded_dec(dec_max)).time_ms
        return np.where(rows > cap, np.inf, t)
    return segment_time


class PaddedSegments:
    """Contiguous segments [start, end) of a sample order in the padded layout: one sample per
    row, every row padded to the segment's longest (rounded to round_to)."""

    def __init__(self, ctx: PlanningContext, order: np.ndarray):
        self.order = order
        self.enc_max = RangeMax(ctx.padded_enc(ctx.enc[order]))
        self.dec_max = RangeMax(ctx.padded_dec(ctx.dec[order]))

    def cost_shapes(self, start: np.ndarray, end: np.ndarray):
        """(rows, seq_len, dec_seq_len) arrays the cost model prices the segments at."""
        return end - start, self.enc_max(start, end), self.dec_max(start, end)

    def micro_batch(self, start: int, end: int, mode: str, time_ms: float,
                    memory: int) -> MicroBatch:
        seq, dec = (int(m(np.array([start]), np.array([end]))[0])
                    for m in (self.enc_max, self.dec_max))
        return MicroBatch(tuple((int(s),) for s in self.order[start:end]), seq, dec, mode,
                          time_ms, memory)


class PackedSegments:
    """Contiguous segments [start, end) of a sample order in the packed layout: the segment's
    samples as one token stream (one row) per side, its length rounded up to round_to, costed
    by microbatch.packed_cost_shape from prefix sums of lengths and squared lengths."""

    def __init__(self, ctx: PlanningContext, order: np.ndarray):
        self.ctx = ctx
        self.order = order
        enc, dec = ctx.enc[order].astype(np.int64), ctx.dec[order].astype(np.int64)
        self._cum = [np.concatenate([[0], np.cumsum(x)]) for x in (enc, enc * enc, dec)]

    def _sums(self, start, end):
        return [c[end] - c[start] for c in self._cum]

    def cost_shapes(self, start: np.ndarray, end: np.ndarray):
        enc, square, dec = self._sums(start, end)
        return packed_cost_shape(self.ctx.aligned(enc), square, self.ctx.aligned(dec))

    def micro_batch(self, start: int, end: int, mode: str, time_ms: float,
                    memory: int) -> MicroBatch:
        enc, square, dec = self._sums(start, end)
        enc, dec = int(self.ctx.aligned(enc)), int(self.ctx.aligned(dec))
        shape = tuple(float(x) for x in packed_cost_shape(enc, square, dec))
        return MicroBatch((tuple(int(s) for s in self.order[start:end]),), enc, dec, mode,
                          time_ms, memory, shape)


def segment_shapes(ctx: PlanningContext, order: np.ndarray):
    """The segment shapes of the configured dynamic layout."""
    if ctx.config.dynamic_layout == "packed":
        return PackedSegments(ctx, order)
    return PaddedSegments(ctx, order)


class SegmentTable:
    """Time / recompute mode / memory of every feasible contiguous segment of the order:
    entry [j - 1, k] is the segment of order positions [j - 1 - k, j), shaped by the
    configured layout (`shapes`: PaddedSegments or PackedSegments). Segments that do not
    fit memory even in the lightest mode are inf; their lengths are found per end position
    by a vectorised binary search (memory grows with rows and lengths). With a finite
    `time_bound`, only segments at most that slow are costed and kept (`_segments_under`):
    a much smaller table when the bound is tight."""

    def __init__(self, ctx: PlanningContext, order: np.ndarray, time_bound: float = np.inf):
        self.ctx = ctx
        self.order = order
        self.shapes = segment_shapes(ctx, order)
        n = len(order)
        ends = np.arange(1, n + 1)
        cap = ctx.config.max_segment_samples or max(64, MAX_TABLE_ENTRIES // n)
        if np.isfinite(time_bound):
            end_of, k, costs = self._segments_under(ends, cap, time_bound)
            reach = np.bincount(end_of - 1, minlength=n)
        else:
            reach = self._reach(ends, cap)
        if (reach == 0).any():
            j = int(np.flatnonzero(reach == 0)[0])
            if np.isfinite(time_bound):
                raise PlanningError(f"sample {int(order[j])} alone is slower than the time "
                                    f"bound {time_bound:.3f} ms (or does not fit memory)")
            sample = int(order[j])
            raise PlanningError(ctx.explain_infeasible(
                [(sample,)], int(ctx.padded_enc(ctx.enc[sample])),
                int(ctx.padded_dec(ctx.dec[sample]))))
        ctx.info["segment_cap"] = int(cap)
        if not np.isfinite(time_bound):
            end_of = np.repeat(ends, reach)
            k = np.arange(len(end_of)) - np.repeat(np.cumsum(reach) - reach, reach)
            costs = ctx.cost(*self.shapes.cost_shapes(end_of - 1 - k, end_of))
        width = int(reach.max())
        start = end_of - 1 - k
        self.time = np.full((n, width), np.inf)
        self.mode = np.full((n, width), -1, dtype=np.int64)
        self.memory = np.zeros((n, width))
        self.time[end_of - 1, k] = costs.time_ms
        if ctx.config.min_padding_efficiency is not None and isinstance(self.shapes,
                                                                         PaddedSegments):
            wasteful = k > 0
            wasteful &= ~self._efficient(ctx, order, start, end_of, k + 1)
            self.time[end_of[wasteful] - 1, k[wasteful]] = np.inf
        self.mode[end_of - 1, k] = costs.mode
        self.memory[end_of - 1, k] = costs.memory_bytes
        self.costed = int(len(end_of))

    def _efficient(self, ctx: PlanningContext, order: np.ndarray, start: np.ndarray,
                   end: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Per segment [start, end) of the order: real / padded tokens reach
        min_padding_efficiency on the encoder (GPT) side and, for T5, the decoder side."""
        ok = np.ones(len(start), dtype=bool)
        sides = [(ctx.enc, self.shapes.enc_max)]
        if ctx.config.model == "t5":
            sides.append((ctx.dec, self.shapes.dec_max))
        for real, padded_max in sides:
            cum = np.concatenate([[0], np.cumsum(real[order], dtype=np.int64)])
            ok &= (cum[end] - cum[start]
                   >= ctx.config.min_padding_efficiency * rows * padded_max(start, end))
        return ok

    def _segments_under(self, ends: np.ndarray, cap: int, bound: float):
        """(end, k, costs) of every segment of k + 1 <= cap samples with time <= bound, by
        widening all still-open end positions in doubling chunks of segment lengths (time
        grows with the length of a segment, so an end closes at its first slower one)."""
        found_end, found_k, found = [], [], []
        active = ends
        lo, chunk = 0, 8
        while active.size and lo < cap:
            hi = min(cap, lo + chunk)
            count = np.clip(np.minimum(active, hi) - lo, 0, None)
            end_of = np.repeat(active, count)
            k = lo + np.arange(len(end_of)) - np.repeat(np.cumsum(count) - count, count)
            costs = self.ctx.cost(*self.shapes.cost_shapes(end_of - 1 - k, end_of))
            ok = costs.time_ms <= bound
            # keep each end's prefix of fast-enough lengths (robust to a non-monotone model)
            bad_so_far = np.cumsum(~ok)
            group_start = np.cumsum(count) - count
            before = np.concatenate([[0], bad_so_far])[group_start]
            keep = bad_so_far == np.repeat(before, count)
            found_end.append(end_of[keep])
            found_k.append(k[keep])
            found.append((costs.time_ms[keep], costs.memory_bytes[keep], costs.mode[keep]))
            kept = np.bincount(np.repeat(np.arange(len(active)), count)[keep],
                               minlength=len(active))
            active = active[(kept == count) & (active > hi)]
            lo, chunk = hi, 2 * chunk
        times, memory, modes = (np.concatenate([f[i] for f in found]) for i in range(3))
        return (np.concatenate(found_end), np.concatenate(found_k),
                MicroBatchCosts(times, memory, modes))

    def _reach(self, ends: np.ndarray, cap: int) -> np.ndarray:
        """Per end position, the most samples (<= cap) a segment ending there may hold."""
        lightest = (self.ctx.config.recompute_modes[-1],)
        top = np.minimum(ends, cap)
        # first try the longest allowed segments (memory often binds nowhere), then binary
        # search the rest
        whole = self.ctx.cost(*self.shapes.cost_shapes(ends - top, ends), lightest).mode >= 0
        lo = np.where(whole, top, 0)
        hi = np.where(whole, top, top - 1)
        active = np.flatnonzero(lo < hi)
        while active.size:
            mid = (lo[active] + hi[active] + 1) // 2
            e = ends[active]
            fits = self.ctx.cost(*self.shapes.cost_shapes(e - mid, e), lightest).mode >= 0
            lo[active] = np.where(fits, mid, lo[active])
            hi[active] = np.where(fits, hi[active], mid - 1)
            active = active[lo[active] < hi[active]]
        return lo


class RangeMax:
    """max(values[start:end]) for arrays of (start, end), via a sparse table."""

    def __init__(self, values: np.ndarray):
        values = np.asarray(values)
        self.levels = [values]
        self.sorted = bool(np.all(values[1:] >= values[:-1]))
        width = 1
        while not self.sorted and 2 * width <= len(values):
            prev = self.levels[-1]
            self.levels.append(np.maximum(prev[:-width], prev[width:]))
            width *= 2

    def __call__(self, start: np.ndarray, end: np.ndarray) -> np.ndarray:
        if self.sorted:
            return self.levels[0][end - 1]
        length = end - start
        level = np.floor(np.log2(length)).astype(np.int64)
        out = np.empty(len(start), dtype=self.levels[0].dtype)
        for lv in np.unique(level):
            sel = level == lv
            table = self.levels[lv]
            out[sel] = np.maximum(table[start[sel]], table[end[sel] - (1 << lv)])
        return out


STRATEGIES: dict[str, Callable[[PlanningContext], list[MicroBatch]]] = {
    "padding": plan_padding,
    "token-budget": plan_token_budget,
    "packing": plan_packing,
    "dynamic": plan_dynamic,
}


# ------------------------------------------------------------------ entry point

def memory_limit_of(cost_model: CostModel, config: PlannerConfig) -> float:
    """The config's override, else the cost model's activation limit for the configured
    number of stages."""
    if config.memory_limit_bytes is not None:
        return float(config.memory_limit_bytes)
    return float(cost_model.activation_memory_limit(num_stages=config.pipeline_stages))


def plan_micro_batches(lengths, config: PlannerConfig, cost_model: CostModel,
                       strategy: str = "dynamic") -> BatchPlan:
    """Plan one global batch: GPT `lengths` shape (n,), T5 (n, 2) = (encoder, decoder)."""
    if strategy not in STRATEGIES:
        raise PlanningError(f"unknown micro-batching strategy {strategy!r}; "
                            f"choose one of {sorted(STRATEGIES)}")
    arr, truncated = effective_lengths(lengths, config)
    if config.model == "gpt":
        enc, dec = arr, np.zeros_like(arr)
    else:
        enc, dec = arr[:, 0], arr[:, 1]
    ctx = PlanningContext(config, cost_model, enc, dec, memory_limit_of(cost_model, config))
    mbs = STRATEGIES[strategy](ctx)
    mbs = _enough_for_replicas(ctx, mbs)
    times = [mb.time_ms for mb in mbs]
    parts = balanced_partition(times, config.data_parallel, config.makespan_stages)
    replicas = tuple(tuple(mbs[i] for i in p) for p in parts)
    spans = replica_makespans(times, parts, config.makespan_stages)
    predicted = max(spans)
    info = dict(ctx.info, truncated=truncated, memory_limit_bytes=ctx.memory_limit,
                replica_imbalance=predicted / float(np.mean(spans)) if predicted > 0 else 1.0,
                num_micro_batches=len(mbs),
                recompute={m: sum(mb.recompute == m for mb in mbs) for m in RECOMPUTE_MODES})
    return BatchPlan(strategy, replicas, predicted, info)


def _enough_for_replicas(ctx: PlanningContext, mbs: list[MicroBatch]) -> list[MicroBatch]:
    """Halve the micro-batch with the most samples (a padded one keeps its padded shape, a
    packed stream becomes two streams) until every data-parallel replica can get one;
    PlanningError when samples run out."""
    mbs = list(mbs)
    while len(mbs) < ctx.config.data_parallel:
        big = max(range(len(mbs)), key=lambda i: (len(mbs[i].sample_ids), -i))
        mb = mbs[big]
        if mb.num_rows == 1 and len(mb.sample_ids) > 1:
            # one packed row: halve its samples into two streams (halves of a row that fits
            # memory fit too); micro-batches of several rows are halved by rows below
            mbs[big:big + 1] = ctx.packed_micro_batches(
                np.array_split(np.array(mb.sample_ids), 2))
            continue
        if mb.num_rows < 2:
            raise PlanningError(f"{sum(m.num_rows for m in mbs)} row(s) cannot feed "
                                f"{ctx.config.data_parallel} data-parallel replicas (each needs "
                                f"at least one micro-batch); use a bigger global batch")
        half = mb.num_rows // 2
        mbs[big:big + 1] = [ctx.micro_batch(mb.rows[:half], mb.seq_len, mb.dec_seq_len),
                            ctx.micro_batch(mb.rows[half:], mb.seq_len, mb.dec_seq_len)]
    return mbs


# ------------------------------------------------------------------ metrics

def attention_efficiency(plan: BatchPlan, lengths: np.ndarray) -> float:
    """Useful attention work / computed attention work. GPT: sum l_i^2 / sum rows * s^2; T5:
    self-attention on both sides plus cross-attention, (e^2 + d^2 + e*d) per sample against
    rows * (s^2 + sd^2 + s*sd), at each micro-batch's costed shape: a packed stream computes
    its samples' attention (packed_cost_shape), a row of packing's layout its full length
    squared."""
    lengths = np.asarray(lengths, dtype=np.float64)
    ids = np.asarray(plan.sample_ids(), dtype=np.int64)
    shapes = np.array([mb.costed_shape() for mb in plan.micro_batches]).reshape(-1, 3)
    rows, s, d = shapes.T
    if lengths.ndim == 1:
        useful = float((lengths[ids] ** 2).sum())
        computed = float((rows * s * s).sum())
    else:
        e, dl = lengths[ids, 0], lengths[ids, 1]
        useful = float((e * e + dl * dl + e * dl).sum())
        computed = float((rows * (s * s + d * d + s * d)).sum())
    return useful / computed if computed else 1.0


def predicted_iteration_ms(plan: BatchPlan, num_stages: int) -> float:
    """Makespan model of the slowest replica: sum t + (P - 1) max t of its micro-batches."""
    return max((makespan_objective([mb.time_ms for mb in rep], num_stages)
                for rep in plan.replicas), default=0.0)


def plan_metrics(plan: BatchPlan, lengths: np.ndarray, num_stages: int) -> dict:
    """Padding efficiency (encoder/GPT and decoder), attention efficiency, predicted time."""
    enc_eff, dec_eff = padding_efficiency(plan, np.asarray(lengths))
    return {"micro_batches": len(plan.micro_batches),
            "padding_efficiency": enc_eff,
            "dec_padding_efficiency": dec_eff,
            "attention_efficiency": attention_efficiency(plan, lengths),
            "predicted_iteration_ms": predicted_iteration_ms(plan, num_stages)}
