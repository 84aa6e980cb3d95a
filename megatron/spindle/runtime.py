"""Spindle's runtime on torch.distributed: executes a WavePlan (dynapipe_ext/spindle) on the
components of a multi-task model. Device d of the plan is rank d.

Each rank builds only the components the plan places on it (`build(name)` is called for
those alone), so a component's parameters exist only on the ranks that run it. Per wave,
forward: inputs that sit on other ranks are handed over (point-to-point, one global order on
every rank, so the pairwise rendezvous cannot deadlock), then every MetaOp runs on its own
ranks, each rank on its contiguous share of the MetaOp's samples. A component with several
inputs receives one hand-over per input. A component whose loss couples the samples of a
batch (`couples_batch`, e.g. a contrastive head) gets the whole batch's rows through an
all-reduce over the MetaOp's ranks. Every hand-over piece is a leaf tensor, so each MetaOp's
backward is a separate autograd call. Backward replays the waves in reverse: gradients of a
wave's outputs come back from their consumers (local or sent back along the same pieces),
then its MetaOps run backward. Each component's gradients are all-reduced over the ranks that
hold it as soon as its last backward is done: after the backward of the first wave that runs
it (the same point on every rank, so every group sees its collectives in one order), an
asynchronous all-reduce of one flattened bucket starts and runs while the earlier waves'
backward computes; all of them are waited for at the end of `run`, before the optimizer step.
`events` records the order (("backward", op) / ("reduce", component)) of the last run."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import torch
import torch.distributed as dist

from dynapipe_ext.spindle.model import MTModel
from dynapipe_ext.spindle.scheduler import WavePlan, component_devices, sample_split


@dataclass(frozen=True)
class Piece:
    """Samples [lo, hi) of `task` handed from producer MetaOp `src_op` on rank `src` to
    input `slot` of consumer MetaOp `dst_op` on rank `dst`."""
    dst_op: int
    task: str
    slot: int
    src_op: int
    lo: int
    hi: int
    src: int
    dst: int


def task_ranges(op, devices) -> dict[int, dict[str, tuple[int, int]]]:
    """rank -> task -> [a, b) of that task's samples the rank holds for MetaOp `op`."""
    keys = op.sample_keys()
    out: dict[int, dict[str, tuple[int, int]]] = {}
    start = 0
    for dev, k in zip(devices, sample_split(op.samples, len(devices))):
        mine: dict[str, tuple[int, int]] = {}
        for task, i in keys[start:start + k]:
            a, b = mine.get(task, (i, i))
            mine[task] = (min(a, i), max(b, i + 1))
        out[dev] = mine
        start += k
    return out


class _GatherRows(torch.autograd.Function):
    """Rows [lo, lo + n) of a batch of `total` rows -> the whole batch (sum of every rank's
    rows over `group`); backward: the summed gradient's local rows."""

    @staticmethod
    def forward(ctx, x, lo, total, group):
        full = x.new_zeros((total,) + tuple(x.shape[1:]))
        full[lo:lo + x.shape[0]] = x
        dist.all_reduce(full, group=group)
        ctx.lo, ctx.n, ctx.group = lo, x.shape[0], group
        return full

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.lo:ctx.lo + ctx.n], None, None, None


class WaveRuntime:
    """One rank's executor of a WavePlan. `build(name)` makes component `name` (called only
    for the components placed on this rank); a head is called as head(*inputs, labels) and
    returns per-sample losses; `normaliser(task)` is what a task's summed losses are divided
    by; `data[task]` = (inputs [batch, ...] or {component: inputs}, labels)."""

    def __init__(self, plan: WavePlan, model: MTModel, build: Callable[[str], torch.nn.Module],
                 normaliser: Callable[[str], int], rank: int):
        if plan.num_devices != dist.get_world_size():
            raise ValueError(f"plan is for {plan.num_devices} devices, the world has "
                             f"{dist.get_world_size()} ranks")
        if isinstance(build, Mapping):
            raise TypeError("WaveRuntime builds its own components: pass build(name) -> "
                            "module, not a dict of modules")
        self.plan, self.model = plan, model
        self.normaliser, self.rank = normaliser, rank
        self.ops = {m.id: m for m in plan.metaops}
        self.devices = {p.op: p.devices for w in plan.waves for p in w.placed}
        self.ranges = {i: task_ranges(self.ops[i], self.devices[i]) for i in self.ops}
        self.op_of = {(t, c): m.id for m in plan.metaops for t in m.tasks for c in m.components}
        self.pieces = [self._pieces(w) for w in plan.waves]
        self.users = {c: set(d) for c, d in component_devices(plan).items()}
        self.modules = torch.nn.ModuleDict(
            {c: build(c) for c in sorted(self.users) if rank in self.users[c]})
        self.first_wave = {}
        for w, wave in enumerate(plan.waves):
            for p in wave.placed:
                for comp in self.ops[p.op].components:
                    self.first_wave.setdefault(comp, w)
        self.events: list[tuple[str, object]] = []
        self.groups = {}
        sets = {tuple(sorted(u)) for u in self.users.values()} | set(
            tuple(sorted(d)) for d in self.devices.values())
        for ranks in sorted(s for s in sets if len(s) > 1):
            self.groups[ranks] = dist.new_group(list(ranks))    # every rank, same order

    def parameters(self):
        """This rank's parameters (those of its placed components), for its optimizer."""
        return self.modules.parameters()

    def _step(self, task: str, component: str):
        for step in self.model.tasks[[t.name for t in self.model.tasks].index(task)].steps:
            if step.component == component:
                return step
        raise KeyError(f"task {task!r} does not use component {component!r}")

    def input_ops(self, op: int, task: str) -> tuple[int, ...]:
        """The MetaOps whose outputs feed `op` for `task`, one per input of its first
        component (none: it reads the task's data)."""
        step = self._step(task, self.ops[op].components[0])
        return tuple(self.op_of[(task, src)] for src in step.inputs)

    def _pieces(self, wave) -> list[Piece]:
        out = []
        for placed in wave.placed:
            m = self.ops[placed.op]
            for task in m.tasks:
                for slot, src_op in enumerate(self.input_ops(m.id, task)):
                    for dst, tasks in self.ranges[m.id].items():
                        if task not in tasks:
                            continue
                        ca, cb = tasks[task]
                        for src, src_tasks in self.ranges[src_op].items():
                            pa, pb = src_tasks.get(task, (0, 0))
                            lo, hi = max(ca, pa), min(cb, pb)
                            if lo < hi:
                                out.append(Piece(m.id, task, slot, src_op, lo, hi, src, dst))
        return out

    def _out_shape(self, src_op: int, task: str, samples: int) -> tuple[int, int, int]:
        comp = self.ops[src_op].components[-1]
        return (self._step(task, comp).seq_len, samples, self.model.component(comp).hidden_size)

    def _check_data(self, data) -> None:
        for task in self.model.tasks:
            if task.name not in data:
                raise ValueError(f"no data for task {task.name!r} (got {sorted(data)})")
            x, labels = data[task.name]
            for name, value in (x.items() if isinstance(x, Mapping) else [("inputs", x)]):
                if value.shape[0] != task.batch_size:
                    raise ValueError(f"task {task.name!r}: {name} has {value.shape[0]} samples, "
                                     f"the plan is for {task.batch_size}")

    def run(self, data) -> torch.Tensor:
        """Forward and backward of one iteration plus the gradient all-reduce; returns the
        iteration's loss (summed over ranks)."""
        self._check_data(data)
        out: dict[tuple[int, str], torch.Tensor] = {}
        leaves: dict[Piece, torch.Tensor] = {}
        for w, wave in enumerate(self.plan.waves):
            self._hand_over(w, out, leaves)
            for placed in sorted(wave.placed, key=lambda p: p.start_s):
                if self.rank in placed.devices:
                    self._forward(placed.op, data, out, leaves)
        local = sum((v for (i, _), v in out.items()
                     if self.model.component(self.ops[i].components[-1]).role == "head"),
                    torch.zeros(()))
        grads: dict[tuple[int, str], torch.Tensor] = {}
        self.events = []
        pending = []
        for w in reversed(range(len(self.plan.waves))):
            self._hand_back(w, out, leaves, grads)
            for placed in sorted(self.plan.waves[w].placed, key=lambda p: -p.start_s):
                if self.rank in placed.devices:
                    self._backward(placed.op, out, grads)
                    self.events.append(("backward", placed.op))
            pending += self._start_reductions(w)
        total = local.detach().clone()
        dist.all_reduce(total)
        self._finish_reductions(pending)
        return total

    def _hand_over(self, w: int, out, leaves) -> None:
        for piece in self.pieces[w]:
            if self.rank not in (piece.src, piece.dst):
                continue
            if piece.src == piece.dst:
                a = self.ranges[piece.src_op][self.rank][piece.task][0]
                value = out[piece.src_op, piece.task][:, piece.lo - a:piece.hi - a]
                leaves[piece] = value.detach().requires_grad_()
            elif self.rank == piece.src:
                a = self.ranges[piece.src_op][self.rank][piece.task][0]
                dist.send(out[piece.src_op, piece.task][:, piece.lo - a:piece.hi - a]
                          .detach().contiguous(), piece.dst)
            else:
                buf = torch.empty(self._out_shape(piece.src_op, piece.task,
                                                  piece.hi - piece.lo))
                dist.recv(buf, piece.src)
                leaves[piece] = buf.requires_grad_()

    def _inputs(self, op: int, task: str, data, leaves, a: int, b: int) -> list[torch.Tensor]:
        srcs = self.input_ops(op, task)
        if not srcs:
            x = data[task][0]
            return [(x[self.ops[op].components[0]] if isinstance(x, Mapping) else x)[a:b]]
        hs = []
        for slot, src_op in enumerate(srcs):
            mine = sorted((p for p in leaves if p.dst_op == op and p.task == task
                           and p.slot == slot and p.dst == self.rank), key=lambda p: p.lo)
            hs.append(torch.cat([leaves[p] for p in mine], dim=1) if mine else
                      torch.zeros(self._out_shape(src_op, task, 0), requires_grad=True))
        return hs

    def _gather(self, op: int, task: str):
        """The whole batch's rows of `task` at MetaOp `op` from this rank's rows."""
        devices = self.devices[op]
        if len(devices) == 1:
            return None
        lo = self.ranges[op][self.rank].get(task, (0, 0))[0]
        total = dict(zip(self.ops[op].tasks, self.ops[op].task_samples))[task]
        group = self.groups[tuple(sorted(devices))]
        return lambda rows: _GatherRows.apply(rows, lo, total, group)

    def _forward(self, op: int, data, out, leaves) -> None:
        m = self.ops[op]
        coupled = getattr(self.modules[m.components[0]], "couples_batch", False)
        mine = self.ranges[op][self.rank]
        # a batch-coupled component joins every task's gather, even with no samples here
        for task in (m.tasks if coupled else list(mine)):
            a, b = mine.get(task, (0, 0))
            labels = data[task][1]
            hs = self._inputs(op, task, data, leaves, a, b)
            for comp in m.components:
                module = self.modules[comp]
                if self.model.component(comp).role == "head":
                    extra = {"gather": self._gather(op, task)} if coupled else {}
                    h = module(*hs, labels[a:b], **extra).sum() / self.normaliser(task)
                else:
                    h = module(*hs)
                hs = [h]
            out[op, task] = hs[0]

    def _hand_back(self, w: int, out, leaves, grads) -> None:
        """Gradients of wave w's outputs from their consumers (same pieces, reversed)."""
        mine = {p.op for p in self.plan.waves[w].placed}
        for pieces in self.pieces[w + 1:]:
            for piece in pieces:
                if piece.src_op not in mine or self.rank not in (piece.src, piece.dst):
                    continue
                if self.rank == piece.dst:
                    g = leaves[piece].grad
                    g = torch.zeros_like(leaves[piece]) if g is None else g
                    if piece.src != piece.dst:
                        dist.send(g.contiguous(), piece.src)
                        continue
                else:
                    g = torch.empty(self._out_shape(piece.src_op, piece.task,
                                                    piece.hi - piece.lo))
                    dist.recv(g, piece.dst)
                a = self.ranges[piece.src_op][self.rank][piece.task][0]
                acc = grads.setdefault((piece.src_op, piece.task),
                                       torch.zeros_like(out[piece.src_op, piece.task]))
                acc[:, piece.lo - a:piece.hi - a] += g

    def _backward(self, op: int, out, grads) -> None:
        for task in self.ops[op].tasks:          # plan order: collectives in backward agree
            value = out.get((op, task))
            if value is None:
                continue
            if value.dim() == 0:
                value.backward()
            elif (op, task) in grads:
                value.backward(grads[op, task])

    def _start_reductions(self, w: int) -> list:
        """Start the all-reduce of every component whose first wave is w (its backward is now
        complete on every rank), over exactly the ranks that hold it, one flattened bucket
        per component; returns (work, component, bucket) to finish."""
        started = []
        for comp in sorted(c for c, first in self.first_wave.items() if first == w):
            ranks = tuple(sorted(self.users[comp]))
            if len(ranks) < 2 or self.rank not in ranks:
                continue
            params = list(self.modules[comp].parameters())
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            bucket = torch.cat([p.grad.reshape(-1) for p in params])
            work = dist.all_reduce(bucket, group=self.groups[ranks], async_op=True)
            self.events.append(("reduce", comp))
            started.append((work, comp, bucket))
        return started

    def _finish_reductions(self, started) -> None:
        """Wait for the reductions and copy the summed buckets back into the gradients."""
        for work, comp, bucket in started:
            work.wait()
            offset = 0
            for p in self.modules[comp].parameters():
                p.grad.copy_(bucket[offset:offset + p.numel()].view_as(p.grad))
                offset += p.numel()
