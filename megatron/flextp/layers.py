"""FlexTP parallel layers: megatron-core-style column / row parallel linears whose shards are any
set of units (attention heads, groups of MLP ffn columns) given by a `Partition`.

A block's column-parallel weight holds the rows of its rank's units in ascending unit order, the
row-parallel weight the matching columns; the partial sums meet in one all-reduce (gloo or NCCL)
exactly as in megatron's equal shards, so any partition computes the same function. A rank may
skip some of its units for a while (ZERO-resizing, `set_drops`): the skipped units' last computed
token-mean contributions are added to the partial sum (imputation), so the all-reduce keeps its
shape. `FLEXTP_SLOWDOWN=RANK:FACTOR` makes TP rank RANK do its block GEMMs FACTOR times (the
extra rounds are discarded): a reproducible straggler whose slowness follows its share of work."""
from __future__ import annotations

import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dynapipe_ext.flextp.partition import Partition

# seconds spent in TP all-reduces since the last reset (compute time = the rest); a list under
# "shapes" (tests) collects each all-reduced shape
COMM = {"seconds": 0.0, "shapes": None}


def _all_reduce(tensor: torch.Tensor, group) -> torch.Tensor:
    if group is None:
        return tensor
    if COMM["shapes"] is not None:
        COMM["shapes"].append(tuple(tensor.shape))
    start = time.perf_counter()
    dist.all_reduce(tensor, group=group)
    COMM["seconds"] += time.perf_counter() - start
    return tensor


class _CopyToTP(torch.autograd.Function):
    """Identity forward; all-reduce of the input gradient backward (megatron's f)."""
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.contiguous().clone(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce of the partial sums forward; identity backward (megatron's g)."""
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.contiguous().clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def slowdown_factor(tp_rank: int, env: str | None = None) -> int:
    """FACTOR from FLEXTP_SLOWDOWN=RANK:FACTOR when RANK is this TP rank, else 1."""
    spec = os.environ.get("FLEXTP_SLOWDOWN", "") if env is None else env
    if not spec:
        return 1
    try:
        rank, factor = (int(x) for x in spec.split(":"))
    except ValueError:
        raise ValueError(f"FLEXTP_SLOWDOWN={spec!r}: expected RANK:FACTOR, e.g. 1:2") from None
    if factor < 1:
        raise ValueError(f"FLEXTP_SLOWDOWN={spec!r}: FACTOR must be >= 1")
    return factor if rank == tp_rank else 1


# FLEXTP_CLOCK=modelled: FlexTP's timings are modelled instead of measured (see modelled_clock)
CLOCK_ENV = "FLEXTP_CLOCK"
MODELLED_SECONDS_PER_MAC = 1e-9     # a rank of factor 1 computes 1 GMAC/s
MODELLED_BANDWIDTH = 1e9            # bytes/s of the TP link


def modelled_clock(env: str | None = None) -> bool:
    """True under FLEXTP_CLOCK=modelled: a rank's TP compute then takes work (MACs) x
    MODELLED_SECONDS_PER_MAC x its FLEXTP_SLOWDOWN factor, and the TP link moves
    MODELLED_BANDWIDTH, instead of what the machine measures; the slow-down switch then redoes
    no GEMM. The straggler detector and the policies see the same figures on any machine
    however loaded, which is what tests of them need. Default (unset or 'measured'): measured."""
    value = (os.environ.get(CLOCK_ENV, "") if env is None else env).strip().lower()
    if value not in ("", "measured", "modelled"):
        raise ValueError(f"{CLOCK_ENV}={value!r}: expected 'measured' or 'modelled'")
    return value == "modelled"


def modelled_seconds(macs: float, slowdown: int) -> float:
    """Seconds a rank of slow-down `slowdown` takes for `macs` multiply-adds (modelled clock)."""
    return macs * slowdown * MODELLED_SECONDS_PER_MAC


class FlexTPBlock(torch.nn.Module):
    """Column-parallel weight (`col_rows` rows per unit) + bias, row-parallel weight
    (`row_cols` columns per unit) + replicated bias; subclasses give the unit's local math."""

    def __init__(self, hidden: int, partition: Partition, rank: int, col_rows: int,
                 row_cols: int, group=None, slowdown: int = 1):
        super().__init__()
        self.hidden, self.rank, self.group = hidden, rank, group
        self.col_rows, self.row_cols, self.slowdown = col_rows, row_cols, slowdown
        n = len(partition.units_of(rank))
        self.col_weight = torch.nn.Parameter(torch.empty(n * col_rows, hidden))
        self.col_bias = torch.nn.Parameter(torch.zeros(n * col_rows))
        self.row_weight = torch.nn.Parameter(torch.empty(hidden, n * row_cols))
        self.row_bias = torch.nn.Parameter(torch.zeros(hidden))
        self.partition = partition
        self.drops: tuple[int, ...] = ()
        self.register_buffer("contrib", torch.zeros(n, hidden), persistent=False)

    # bookkeeping -------------------------------------------------------------------------
    def units(self) -> tuple[int, ...]:
        return self.partition.units_of(self.rank)

    def sharded(self):
        """(parameter, unit axis, slices per unit) of every unit-sharded tensor."""
        return [(self.col_weight, 0, self.col_rows), (self.col_bias, 0, self.col_rows),
                (self.row_weight, 1, self.row_cols)]

    def unit_norms(self) -> list[float]:
        """Priority of each local unit: |column rows| * |row columns| (a bound on its output)."""
        n = len(self.units())
        col = self.col_weight.detach().reshape(n, -1).norm(dim=1)
        row = self.row_weight.detach().reshape(self.hidden, n, -1).norm(dim=(0, 2))
        return (col * row).tolist()

    def set_drops(self, units) -> None:
        """Skip these local units until the next call (ZERO-resizing); () computes all."""
        self.drops = checked_drops(units, self.units(), self.rank)

    def set_partition(self, partition: Partition) -> None:
        """After migration moved the tensors: new ownership, no drops, fresh imputation state."""
        self.partition, self.drops = partition, ()
        self.contrib = torch.zeros(len(self.units()), self.hidden, dtype=self.contrib.dtype)

    def load_full(self, full: dict) -> None:
        """Take this rank's units from full-size tensors col_weight/col_bias/row_weight/row_bias."""
        idx = torch.tensor(self.units())
        with torch.no_grad():
            for param, axis, per in self.sharded():
                name = self._name(param)
                src = full[name]
                param.copy_(_take_units(src, axis, per, idx))
            self.row_bias.copy_(full["row_bias"])

    def gather_full(self, grads: bool = False) -> dict:
        """Full-size tensors (or gradients) assembled from every rank's units (all-reduce)."""
        out = {}
        idx = torch.tensor(self.units())
        for param, axis, per in self.sharded():
            src = param.grad if grads else param.detach()
            shape = list(src.shape)
            shape[axis] = self.partition.num_units * per
            full = torch.zeros(shape, dtype=src.dtype)
            _put_units(full, axis, per, idx, src)
            if self.group is not None:
                dist.all_reduce(full, group=self.group)
            out[self._name(param)] = full
        bias = self.row_bias.grad if grads else self.row_bias.detach()
        out["row_bias"] = bias.clone()
        return out

    def _name(self, param) -> str:
        return next(n for n, p in self.named_parameters() if p is param)

    # compute -----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _CopyToTP.apply(x, self.group)
        mine = self.units()
        keep = [i for i, u in enumerate(mine) if u not in self.drops]
        if len(keep) == len(mine):
            cw, cb, rw = self.col_weight, self.col_bias, self.row_weight
        else:
            k = torch.tensor(keep)
            cw = _take_units(self.col_weight, 0, self.col_rows, k)
            cb = _take_units(self.col_bias, 0, self.col_rows, k)
            rw = _take_units(self.row_weight, 1, self.row_cols, k)
        inner = self.unit_math(F.linear(x, cw, cb), len(keep))
        partial = F.linear(inner, rw)
        with torch.no_grad():
            # token-mean contribution of each computed unit: the imputation for later skips
            mean = inner.detach().reshape(-1, len(keep), self.row_cols).mean(0)
            self.contrib[keep] = torch.einsum(
                "kc,hkc->kh", mean, rw.detach().reshape(self.hidden, len(keep), self.row_cols))
        if len(keep) < len(mine):
            skipped = [i for i in range(len(mine)) if i not in keep]
            partial = partial + self.contrib[skipped].sum(0)
        if self.slowdown > 1:
            self._burn(x.detach(), cw.detach(), cb.detach(), rw.detach(), len(keep), partial)
        return _ReduceFromTP.apply(partial, self.group) + self.row_bias

    def _burn(self, x, cw, cb, rw, n_keep, partial) -> None:
        """The slow-down switch: redo the local GEMMs (forward now, 2x that in backward)."""
        def once():
            with torch.no_grad():
                F.linear(self.unit_math(F.linear(x, cw, cb), n_keep), rw)
        for _ in range(self.slowdown - 1):
            once()
        def in_backward(grad):
            for _ in range(2 * (self.slowdown - 1)):
                once()
        if partial.requires_grad:
            partial.register_hook(in_backward)

    def unit_math(self, col_out: torch.Tensor, n_units: int) -> torch.Tensor:
        raise NotImplementedError


class FlexMLP(FlexTPBlock):
    """h -> ffn -> h; a unit is `unit_cols` consecutive ffn columns."""

    def __init__(self, hidden: int, ffn: int, unit_cols: int, partition: Partition, rank: int,
                 group=None, slowdown: int = 1):
        if ffn != unit_cols * partition.num_units:
            raise ValueError(f"FlexMLP: ffn {ffn} != {partition.num_units} units x {unit_cols}")
        super().__init__(hidden, partition, rank, unit_cols, unit_cols, group, slowdown)

    def unit_math(self, col_out, n_units):
        return F.gelu(col_out)


class FlexAttention(FlexTPBlock):
    """Causal self-attention; a unit is one head (its q, k, v rows and its output columns)."""

    def __init__(self, hidden: int, head_dim: int, partition: Partition, rank: int, group=None,
                 slowdown: int = 1):
        super().__init__(hidden, partition, rank, 3 * head_dim, head_dim, group, slowdown)
        self.head_dim = head_dim

    def unit_math(self, col_out, n_units):
        b, s, _ = col_out.shape
        qkv = col_out.reshape(b, s, n_units, 3, self.head_dim).permute(3, 0, 2, 1, 4)
        ctx = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
        return ctx.transpose(1, 2).reshape(b, s, n_units * self.head_dim)


def _take_units(t: torch.Tensor, axis: int, per: int, idx: torch.Tensor) -> torch.Tensor:
    """The slices of local (or global) units `idx` along `axis`, `per` entries each."""
    rows = (idx[:, None] * per + torch.arange(per)[None, :]).reshape(-1)
    return t.index_select(axis, rows.to(t.device))


def _put_units(t: torch.Tensor, axis: int, per: int, idx: torch.Tensor, src) -> None:
    rows = (idx[:, None] * per + torch.arange(per)[None, :]).reshape(-1)
    t.index_copy_(axis, rows, src)


def init_full(hidden: int, num_units: int, per_col: int, per_row: int,
              generator: torch.Generator, num_layers: int) -> dict:
    """Full-size initial tensors (normal 0.02; the row weight scaled by 1/sqrt(2 L) as in GPT-2),
    identical on every rank for the same generator state."""
    std = 0.02
    return {"col_weight": torch.randn(num_units * per_col, hidden, generator=generator) * std,
            "col_bias": torch.zeros(num_units * per_col),
            "row_weight": torch.randn(hidden, num_units * per_row, generator=generator)
            * std / math.sqrt(2 * num_layers),
            "row_bias": torch.zeros(hidden)}


def checked_drops(units, mine, rank: int) -> tuple:
    """`units` as a sorted drop set, if all are this rank's and at least one unit stays."""
    bad = sorted(set(units) - set(mine))
    if bad:
        raise ValueError(f"set_drops: units {bad} are not on rank {rank} ({mine})")
    if len(set(units)) >= len(mine):
        raise ValueError(f"set_drops: rank {rank} must keep at least one unit")
    return tuple(sorted(set(units)))
