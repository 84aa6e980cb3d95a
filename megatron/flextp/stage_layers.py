"""FlexTP in the main model: uneven TP partitions of the megatron-core layers that
megatron/model/stages.py builds (`pretrain_gpt.py --tp-balance ...`).

`convert_stages` swaps each GPT layer's four TP linears (attention linear_qkv / linear_proj, MLP
linear_fc1 / linear_fc2; of a half layer, --pipeline-split, the two it holds) for `SlotColumn` /
`SlotRow`, which keep the same parameter names and call contract ((output, bias), megatron-core's
TP mappings for the collectives). A pair of them is one `FlexPair`: its units (query groups, one
head each without grouped-query attention; groups of `ffn_unit` ffn columns) sit in fixed-size
*slots*, `capacity` units per rank, of which the first len(units) are used, in ascending unit
order. A gated MLP's fc1 (--gated-gelu) holds two halves, [gate rows of the used units; up rows
of them; spare zeros], what megatron-core's MLP chunks its output into. The
shapes of the parameters, their fp32 main gradients and their Adam moments therefore never
change, so GradBuffer, TrainOptimizer, clipping and the DP all-reduce run untouched; migration
(`migrate_pairs`) copies slot contents (weights, fp32 main copies, both Adam moments) between
the TP ranks and zeroes the slots it empties (zero weight, gradient and moments: AdamW leaves
them at zero). The price is memory: capacity is --tp-balance-max-share (default 1.5) times the
even share (at most all units but one per other rank), so the TP-split weights and their
optimizer state take up to that much more space (the planner's memory model counts it,
device_costs.slot_share); migration clamps a larger imbalance to the capacity.

ZERO-resizing: a pair may skip some of its units (`FlexPair.drops`); the column output then has
fewer units (attention: fewer heads, the module's per-partition head counts follow), and the row
linear adds each skipped unit's last computed token-mean contribution (imputation) before the
all-reduce, whose shape stays [s, b, hidden].

Checkpoints: each slotted parameter carries `tp_shard_size`, its even shard's length, and
--save / --load run inside StageBalancer.even_layout (the even partition: those leading entries
hold the even shard), so the files are those of an ordinary TP run (megatron/model/full_state.py):
layout-free shards of the full tensors, loadable at even TP, another TP, or with FlexTP again.

Timing: each pair measures the wall time from its column input to its row all-reduce (the TP
compute of the layer, no communication) and the work it did (tokens x units x MACs per unit),
what the straggler detector needs, and the wall time of its forward all-reduce (`sync_seconds`:
mostly waiting for the slowest TP rank, so the differences between ranks show how much longer
one rank spends between two all-reduces, in and outside the pairs); on CUDA with events, read
when the balancer takes the figures (one wait per iteration, not a synchronize per layer).
FLEXTP_SLOWDOWN=RANK:FACTOR (megatron/flextp/layers.py) makes TP rank RANK redo its slot GEMMs (a reproducible straggler);
under FLEXTP_CLOCK=modelled the pair instead reports its work at a modelled rate divided by the
factor, and redoes nothing (the same figures on a loaded machine).
GPT only (T5 is refused by the configuration check).
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                    reduce_from_tensor_model_parallel_region)

from dynapipe_ext.flextp.partition import MAX_SHARE, Partition, even_partition, slot_capacity
from megatron.flextp.layers import COMM, checked_drops, modelled_clock, modelled_seconds
from megatron.flextp.migrate import exchange_units, new_layout

KINDS = ("attn", "mlp")


capacity = slot_capacity     # slots per rank (dynapipe_ext/flextp/partition.py)


class SpanClock:
    """Seconds between `begin` and `end` marks, summed: wall time on the CPU; on CUDA a pair
    of events per span, read only when `seconds` is asked (synchronising at both ends instead
    would stall the host four times per layer and micro-batch)."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self._seconds = 0.0
        self._spans: list = []      # CUDA (start, end) events not yet read
        self._open = None

    @staticmethod
    def _mark(x: torch.Tensor):
        if x.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def begin(self, x: torch.Tensor) -> None:
        """Open a span (on the device of `x`)."""
        self._open = self._mark(x)

    def end(self, x: torch.Tensor) -> None:
        """Close the open span, if any."""
        if self._open is None:
            return
        if isinstance(self._open, float):
            self._seconds += time.perf_counter() - self._open
        else:
            self._spans.append((self._open, self._mark(x)))
        self._open = None

    def add(self, seconds: float) -> None:
        self._seconds += seconds

    @property
    def seconds(self) -> float:
        """Seconds since reset (on CUDA this waits for the last span)."""
        if self._spans:
            self._spans[-1][1].synchronize()
            self._seconds += sum(a.elapsed_time(b) for a, b in self._spans) / 1e3
            self._spans.clear()
        return self._seconds


class FlexPair:
    """One column + row linear pair of one layer on one TP rank: which units it holds (slots
    0..n-1, ascending), which it skips, its imputation state and its compute timer."""

    def __init__(self, kind: str, partition: Partition, rank: int, cap: int, col_rows: int,
                 row_cols: int, hidden: int, slowdown: int = 1, attention=None,
                 device=None, imputes: bool = True, modelled: bool = False, halves: int = 1,
                 heads_per_unit: int = 1):
        self.kind, self.partition, self.rank, self.capacity = kind, partition, rank, cap
        self.col_rows, self.row_cols, self.hidden = col_rows, row_cols, hidden
        # a gated MLP's fc1 (halves 2): [gate rows of the held units; up rows of them; spare
        # zeros], col_rows rows per unit in each half, as megatron-core's MLP chunks its output
        self.halves = halves
        self.heads_per_unit = heads_per_unit     # attention: a unit is one query group
        self.slowdown, self.attention = slowdown, attention
        self.modelled = modelled                 # FLEXTP_CLOCK=modelled: no timer, no GEMM redone
        self.burn = 1 if modelled else slowdown
        self.drops: tuple[int, ...] = ()
        self.column = self.row = None          # set by convert_stages
        # per slot: last token-mean output (imputation), on the layer's device so recording it
        # and adding it back need no host copy; recorded only where skips can happen
        self.contrib = torch.zeros(cap, hidden, device=device)
        self.imputes = imputes
        self.clock, self.sync_clock = SpanClock(), SpanClock()
        self._started = False
        self.reset_timer()
        self._refresh()

    def units(self) -> tuple[int, ...]:
        return self.partition.units_of(self.rank)

    def computed_slots(self) -> list[int]:
        return [i for i, u in enumerate(self.units()) if u not in self.drops]

    def unit_macs(self) -> int:
        """Multiply-adds of one unit per token."""
        return (self.halves * self.col_rows + self.row_cols) * self.hidden

    def _refresh(self) -> None:
        n = len(self.units())
        if n > self.capacity:
            raise ValueError(f"FlexTP: rank {self.rank} would hold {n} {self.kind} units, "
                             f"capacity is {self.capacity}")
        slots = self.computed_slots()
        self._all = len(slots) == n
        self._index = torch.tensor(slots, dtype=torch.long)
        self._skipped = torch.tensor([i for i in range(n) if i not in slots], dtype=torch.long)
        self._on_device: dict = {}             # (skipped?, per, device) -> index there
        if self.attention is not None:   # megatron-core reshapes q/k/v by these counts
            self.attention.num_attention_heads_per_partition = len(slots) * self.heads_per_unit
            self.attention.num_query_groups_per_partition = len(slots)

    def set_drops(self, units) -> None:
        """Skip these of this rank's units until the next call (ZERO-resizing)."""
        self.drops = checked_drops(units, self.units(), self.rank)
        self._refresh()

    def set_partition(self, partition: Partition) -> None:
        """After migration moved the slots: new ownership, no skips, fresh imputation."""
        self.partition, self.drops = partition, ()
        self.contrib.zero_()
        self._refresh()

    def unit_norms(self) -> list[float]:
        """Priority of each held unit: |its column rows| x |its row columns|."""
        n = len(self.units())
        with torch.no_grad():
            col = self.column.weight[:self.halves * n * self.col_rows].reshape(
                self.halves, n, -1).float().norm(dim=(0, 2))
            row = self.row.weight[:, :n * self.row_cols].reshape(self.hidden, n, -1)
            return (col * row.float().norm(dim=(0, 2))).tolist()

    def sharded(self):
        """(parameter, slot axis, entries per unit and half, halves) of every slotted tensor."""
        out = [(self.column.weight, 0, self.col_rows, self.halves),
               (self.row.weight, 1, self.row_cols, 1)]
        if self.column.bias is not None:
            out.append((self.column.bias, 0, self.col_rows, self.halves))
        return out

    def _rows(self, per: int, device, halves: int = 1) -> int | torch.Tensor:
        """The computed slots' entries along the slot axis: a leading count when nothing is
        skipped, else an index tensor."""
        if self._all:
            return halves * len(self.units()) * per
        return self.index_on(device, per, halves=halves)

    def index_on(self, device, per: int = 1, skipped: bool = False,
                 halves: int = 1) -> torch.Tensor:
        """The entries of the computed (or skipped) slots, `per` per slot (in each of `halves`
        halves of len(units) slots), as an index tensor on `device`, made once per set of
        skips (a host-to-device copy per forward would stall the host on a GPU)."""
        key = (skipped, per, device, halves)
        if key not in self._on_device:
            slots = self._skipped if skipped else self._index
            rows = (slots[:, None] * per + torch.arange(per)[None, :]).reshape(-1)
            span = len(self.units()) * per
            rows = torch.cat([rows + h * span for h in range(halves)])
            self._on_device[key] = rows.to(device)
        return self._on_device[key]

    def take(self, t: torch.Tensor, axis: int, per: int, halves: int = 1) -> torch.Tensor:
        """The computed slots of `t` (a view when nothing is skipped). For a parameter with a
        GradBuffer, while autograd records, through UsedSlots."""
        rows = self._rows(per, t.device, halves)
        if (getattr(t, "grad_buffer", None) is not None and t.requires_grad
                and torch.is_grad_enabled()):
            return UsedSlots.apply(t, axis, rows)
        return _select(t, axis, rows)

    # timer: the pair's compute (column input to row output) and its forward all-reduce, each
    # a SpanClock; under the modelled clock the work at a modelled rate instead
    def start(self, x: torch.Tensor) -> None:
        self._started = True
        if not self.modelled:
            self.clock.begin(x)

    def synced(self, partial: torch.Tensor, reduce):
        """`reduce(partial)`, the forward all-reduce, timed into sync_seconds (not under the
        modelled clock: its compute figures are not the machine's, so neither are its waits)."""
        if self.modelled:
            return reduce(partial)
        self.sync_clock.begin(partial)
        out = reduce(partial)
        self.sync_clock.end(partial)
        return out

    def stop(self, partial: torch.Tensor) -> None:
        if not self._started:
            return
        tokens = partial.numel() // partial.shape[-1]
        work = tokens * len(self.computed_slots()) * self.unit_macs()
        if self.modelled:
            self.clock.add(modelled_seconds(work, self.slowdown))
        else:
            self.clock.end(partial)
        self.tokens += tokens
        self.work += work
        self._started = False

    @property
    def seconds(self) -> float:
        """TP compute seconds since reset_timer (on CUDA this waits for the last span)."""
        return self.clock.seconds

    @property
    def sync_seconds(self) -> float:
        """Forward all-reduce seconds since reset_timer (0 under the modelled clock)."""
        return self.sync_clock.seconds

    def reset_timer(self) -> None:
        self.work = self.tokens = 0.0
        self.clock.reset()
        self.sync_clock.reset()


class HeadTimer:
    """Times the output head's final norm and output layer forward on this rank (pure compute:
    the first collective of the head is the cross-entropy's, after them). Outside the pairs,
    that is the largest work a straggler slowed as a whole does slower; the pairs' all-reduce
    figures do not see it, since the waits it causes fall in the cross-entropy's and the
    backward's all-reduces (see outside_seconds in megatron/flextp/stage_balance.py). Reports
    0 under the modelled clock."""

    def __init__(self, head, modelled: bool = False):
        self.modelled = modelled
        self.clock = SpanClock()
        head.final_norm.register_forward_pre_hook(self._begin)
        head.output_layer.register_forward_hook(self._end)

    def _begin(self, module, args) -> None:
        if not self.modelled:
            self.clock.begin(args[0])

    def _end(self, module, args, output) -> None:
        self.clock.end(output[0] if isinstance(output, tuple) else output)

    @property
    def seconds(self) -> float:
        """Seconds since reset_timer (on CUDA this waits for the last span)."""
        return self.clock.seconds

    def reset_timer(self) -> None:
        self.clock.reset()


def _select(t: torch.Tensor, axis: int, rows: int | torch.Tensor) -> torch.Tensor:
    """The first `rows` entries of `t` along `axis` (a view), or those an index tensor names."""
    return t.narrow(axis, 0, rows) if isinstance(rows, int) else t.index_select(axis, rows)


class UsedSlots(torch.autograd.Function):
    """The computed slots of a slotted parameter whose gradient goes straight into its fp32
    main_grad slice (GradBuffer.accumulate_part, which also marks it arrived for the DP
    overlap); autograd gets no gradient for the parameter itself. Through a plain slice,
    autograd would build a zero-padded gradient of the whole capacity, up to twice the used
    size, and the buffer's hook would add all of it, once per micro-batch (a 512 -> 1024 slot
    linear at 128 tokens, forward + backward on one CPU thread: 8.5-8.8 ms that way, 7.0-7.3
    ms this way, a plain linear 7.1-7.6 ms)."""

    @staticmethod
    def forward(ctx, param, axis, rows):
        ctx.param, ctx.axis, ctx.rows = param, axis, rows
        return _select(param, axis, rows)

    @staticmethod
    def backward(ctx, grad):
        ctx.param.grad_buffer.accumulate_part(ctx.param, grad, ctx.axis, ctx.rows)
        return None, None, None


class SlotColumn(torch.nn.Module):
    """Column-parallel linear over a pair's computed slots; returns (output, bias) like
    megatron-core's ColumnParallelLinear (bias added here unless `skip_bias_add`)."""

    def __init__(self, pair: FlexPair, weight, bias, skip_bias_add: bool):
        super().__init__()
        self.pair, self.skip_bias_add = pair, skip_bias_add
        self.weight = weight
        self.bias = bias

    def forward(self, x: torch.Tensor):
        pair = self.pair
        pair.start(x)
        x = copy_to_tensor_model_parallel_region(x)
        w = pair.take(self.weight, 0, pair.col_rows, pair.halves)
        b = None if self.bias is None else pair.take(self.bias, 0, pair.col_rows, pair.halves)
        out = F.linear(x, w, None if self.skip_bias_add else b)
        _burn(pair.burn, out, lambda: F.linear(x.detach(), w.detach()))
        return (out, b) if self.skip_bias_add else (out, None)


class SlotRow(torch.nn.Module):
    """Row-parallel linear over a pair's computed slots plus the imputed skipped units, then
    the TP all-reduce; the bias is replicated. Returns (output, bias) like RowParallelLinear."""

    def __init__(self, pair: FlexPair, weight, bias, skip_bias_add: bool):
        super().__init__()
        self.pair, self.skip_bias_add = pair, skip_bias_add
        self.weight = weight
        self.bias = bias

    def forward(self, inner: torch.Tensor):
        pair = self.pair
        w = pair.take(self.weight, 1, pair.row_cols)
        partial = F.linear(inner, w)
        _burn(pair.burn, partial, lambda: F.linear(inner.detach(), w.detach()))
        if pair.imputes and torch.is_grad_enabled():     # training forwards only
            with torch.no_grad():
                n = len(pair.computed_slots())
                mean = inner.detach().reshape(-1, n, pair.row_cols).float().mean(0)
                value = torch.einsum("kc,hkc->kh", mean, w.detach().float().reshape(
                    pair.hidden, n, pair.row_cols)).to(pair.contrib.device)
                if pair._all:
                    pair.contrib[:n] = value
                else:
                    pair.contrib.index_copy_(0, pair.index_on(pair.contrib.device), value)
        if not pair._all:
            skipped = pair.contrib.index_select(0, pair.index_on(pair.contrib.device,
                                                                 skipped=True))
            partial = partial + skipped.sum(0).to(partial.device, partial.dtype)
        pair.stop(partial)
        if COMM["shapes"] is not None:
            COMM["shapes"].append((tuple(inner.shape[:-1]), tuple(partial.shape)))
        out = pair.synced(partial, reduce_from_tensor_model_parallel_region)
        if self.skip_bias_add:
            return out, self.bias
        return (out if self.bias is None else out + self.bias), None


def _burn(factor: int, out: torch.Tensor, once) -> None:
    """The slow-down switch: redo a GEMM factor - 1 times now and 2 (factor - 1) times in
    backward (the extra results are discarded)."""
    if factor <= 1:
        return
    with torch.no_grad():
        for _ in range(factor - 1):
            once()

    def in_backward(grad):
        with torch.no_grad():
            for _ in range(2 * (factor - 1)):
                once()
    if out.requires_grad:
        out.register_hook(in_backward)


def _slotted(param: torch.nn.Parameter, axis: int, per: int, cap: int,
             halves: int = 1) -> torch.nn.Parameter:
    """A parameter of `cap` slots along `axis` holding `param` in its first slots, zeros after,
    with the attributes megatron set on `param` (tensor_model_parallel, partition_dim, ...) and
    `tp_shard_size`, the even shard's length, so checkpoints hold the even shard alone
    (megatron/model/full_state.py, "Spare capacity")."""
    if not (getattr(param, "tensor_model_parallel", False) and param.partition_dim == axis):
        raise ValueError(f"FlexTP: a slotted parameter must be TP-split along axis {axis}")
    shape = list(param.shape)
    shape[axis] = halves * cap * per
    data = torch.zeros(shape, dtype=param.dtype, device=param.device)
    # a gated fc1's even shard [gate_i; up_i] is already the slot layout of its units
    data.narrow(axis, 0, param.shape[axis]).copy_(param.detach())
    fresh = torch.nn.Parameter(data, requires_grad=param.requires_grad)
    for name, value in vars(param).items():
        setattr(fresh, name, value)
    fresh.tp_shard_size = param.shape[axis]
    return fresh


def convert_stages(stages, tp: int, tp_rank: int, ffn_unit: int, slowdown: int = 1,
                   imputes: bool = True,
                   max_share: float = MAX_SHARE) -> dict[str, list[FlexPair]]:
    """Swap the TP linears of every GPT layer (or half layer, --pipeline-split) of this rank's
    stage modules (stage index -> StageModule, weights already set) for slot linears; returns
    the pairs by kind. Call before the gradient buffer and optimizer are built. `imputes`:
    record the imputation values (needed where units may be skipped: resize, semi);
    `max_share`: slots per rank over the even share (capacity)."""
    pairs: dict[str, list[FlexPair]] = {k: [] for k in KINDS}
    modelled = modelled_clock()
    for s in sorted(stages):
        module = stages[s]
        if module.spec.model != "gpt":
            raise ValueError("--tp-balance: FlexTP's slot layers cover GPT layers only")
        if module.decoder is None:
            continue
        cfg = module.config
        hidden, heads, ffn = cfg.hidden_size, cfg.num_attention_heads, cfg.ffn_hidden_size
        groups = cfg.num_query_groups or heads
        if ffn % ffn_unit or (ffn // ffn_unit) % tp:
            raise ValueError(f"--flextp-ffn-unit {ffn_unit}: --ffn-hidden-size {ffn} must "
                             f"split into units of that many columns, a multiple of TP={tp}")
        head_dim, per_group = cfg.kv_channels, heads // groups
        halves = 2 if cfg.gated_linear_unit else 1
        for layer in module.decoder.layers:
            att, mlp = layer.self_attention, layer.mlp
            # an attention unit is one query group: its heads' q rows, its k and v rows, and
            # its heads' output columns (one head each without grouped-query attention)
            specs = (("attn", att, "linear_qkv", "linear_proj", groups,
                      (per_group + 2) * head_dim, per_group * head_dim, 1, att),
                     ("mlp", mlp, "linear_fc1", "linear_fc2", ffn // ffn_unit, ffn_unit,
                      ffn_unit, halves, None))
            for kind, owner, col_name, row_name, n_units, rows, cols, h, attention in specs:
                if not hasattr(owner, col_name):      # the half another stage runs
                    continue
                col, row = getattr(owner, col_name), getattr(owner, row_name)
                cap = capacity(n_units, tp, max_share)
                pair = FlexPair(kind, even_partition(n_units, tp), tp_rank, cap, rows, cols,
                                hidden, slowdown, attention, device=col.weight.device,
                                imputes=imputes, modelled=modelled, halves=h,
                                heads_per_unit=per_group)
                pair.column = SlotColumn(pair, _slotted(col.weight, 0, rows, cap, h),
                                         None if col.bias is None
                                         else _slotted(col.bias, 0, rows, cap, h),
                                         col.skip_bias_add)
                pair.row = SlotRow(pair, _slotted(row.weight, 1, cols, cap), row.bias,
                                   row.skip_bias_add)
                setattr(owner, col_name, pair.column)
                setattr(owner, row_name, pair.row)
                pairs[kind].append(pair)
    return pairs


# ---------------------------------------------------------------------------- migration

def optimizer_fields(optimizer, param) -> list[torch.Tensor]:
    """The tensors of `param` migration moves besides the weight: the fp32 main copy (when
    it is not the weight itself) and Adam's two moments (once the first step made them)."""
    if optimizer is None:
        return []
    i = next(k for k, p in enumerate(optimizer.model_params) if p is param)
    main = optimizer.main_params[i]
    out = [] if main.data_ptr() == param.data_ptr() else [main.detach()]
    state = optimizer.adam.state.get(main)
    if state:
        out += [state["exp_avg"], state["exp_avg_sq"]]
    return out


def _unit_major(t: torch.Tensor, axis: int, per: int, n: int, halves: int) -> torch.Tensor:
    """The leading `n` units of a slotted tensor with each unit's entries together: a gated
    fc1's [gate(n); up(n)] as [gate_0; up_0; gate_1; up_1; ...] (a copy); else a view."""
    used = t.narrow(axis, 0, halves * n * per)
    if halves == 1:
        return used
    moved = used.movedim(axis, 0)
    rest = moved.shape[1:]
    out = moved.reshape(halves, n, per, *rest).transpose(0, 1).reshape(n * halves * per, *rest)
    return out.movedim(0, axis)


def _halves_major(t: torch.Tensor, axis: int, per: int, n: int, halves: int) -> torch.Tensor:
    """The inverse of _unit_major: [gate(n); up(n)] from units side by side."""
    if halves == 1:
        return t
    moved = t.movedim(axis, 0)
    rest = moved.shape[1:]
    out = moved.reshape(n, halves, per, *rest).transpose(0, 1).reshape(n * halves * per, *rest)
    return out.movedim(0, axis)


def migrate_pairs(pairs: list[FlexPair], optimizer, new: Partition, group) -> int:
    """Move units between the TP ranks so `pairs` (one kind, one shared partition) follow
    `new`: every slotted tensor and its optimizer fields, in place (migrate.exchange_units).
    Returns the bytes this rank sent. Call on every rank of the TP group alike."""
    if not pairs:
        return 0
    old, rank = pairs[0].partition, pairs[0].rank
    if any(p.partition != old for p in pairs):
        raise ValueError("migrate_pairs: the pairs must share one partition")
    mine_old, mine_new = old.units_of(rank), new.units_of(rank)
    tensors = [(t, axis, per, halves) for p in pairs for param, axis, per, halves in p.sharded()
               for t in [param.detach()] + optimizer_fields(optimizer, param)]
    units = [(_unit_major(t, axis, per, len(mine_old), halves), axis, per * halves)
             for t, axis, per, halves in tensors]
    received, sent = exchange_units(units, old, new, rank, group)
    with torch.no_grad():
        filled = [new_layout(u, axis, per, mine_old, mine_new, received, k)
                  for k, (u, axis, per) in enumerate(units)]
        for (t, axis, per, halves), f in zip(tensors, filled):
            used = halves * len(mine_new) * per
            t.narrow(axis, 0, used).copy_(_halves_major(f, axis, per, len(mine_new), halves))
            t.narrow(axis, used, t.shape[axis] - used).zero_()
    for p in pairs:
        p.set_partition(new)
    return sent
