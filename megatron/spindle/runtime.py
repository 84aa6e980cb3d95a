"""Spindle's runtime on torch.distributed: executes a WavePlan (dynapipe_ext/spindle) on the
components of a multi-task model. Device d of the plan is rank d.

Per wave, forward: inputs that sit on other ranks are handed over (point-to-point, one global
order on every rank, so the pairwise rendezvous cannot deadlock), then every MetaOp runs on
its own ranks, each rank on its contiguous share of the MetaOp's samples. Every hand-over
piece, local or received, is a leaf tensor, so each MetaOp's backward is a separate
autograd call. Backward replays the waves in reverse: gradients of a wave's outputs come back
from their consumers (local or sent back along the same pieces), then its MetaOps run
backward. Last, every component's gradients are all-reduced over the ranks that ran it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import torch
import torch.distributed as dist

from dynapipe_ext.spindle.model import MTModel
from dynapipe_ext.spindle.scheduler import WavePlan, sample_split


@dataclass(frozen=True)
class Piece:
    """Samples [lo, hi) of `task` handed from producer MetaOp `src_op` on rank `src` to
    consumer MetaOp `dst_op` on rank `dst`."""
    dst_op: int
    task: str
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


class WaveRuntime:
    """One rank's executor of a WavePlan. `components` maps component name -> module; a head
    is called as head(hidden, labels) and returns per-sample losses; `normaliser(task)` is what
    a task's summed losses are divided by; `data[task]` = (inputs [batch, ...], labels)."""

    def __init__(self, plan: WavePlan, model: MTModel, components: Mapping[str, torch.nn.Module],
                 normaliser: Callable[[str], int], rank: int):
        if plan.num_devices != dist.get_world_size():
            raise ValueError(f"plan is for {plan.num_devices} devices, the world has "
                             f"{dist.get_world_size()} ranks")
        self.plan, self.model, self.comps = plan, model, components
        self.normaliser, self.rank = normaliser, rank
        self.ops = {m.id: m for m in plan.metaops}
        self.devices = {p.op: p.devices for w in plan.waves for p in w.placed}
        self.ranges = {i: task_ranges(self.ops[i], self.devices[i]) for i in self.ops}
        self.op_of = {(t, c): m.id for m in plan.metaops for t in m.tasks for c in m.components}
        self.pieces = [self._pieces(w) for w in plan.waves]
        self.users = self._users()
        self.groups = {}
        for ranks in sorted({tuple(sorted(u)) for u in self.users.values() if len(u) > 1}):
            self.groups[ranks] = dist.new_group(list(ranks))    # every rank, same order

    def _users(self) -> dict[str, set[int]]:
        users: dict[str, set[int]] = {}
        for i, m in self.ops.items():
            for c in m.components:
                users.setdefault(c, set()).update(self.devices[i])
        return users

    def _step(self, task: str, component: str):
        for step in self.model.tasks[[t.name for t in self.model.tasks].index(task)].steps:
            if step.component == component:
                return step
        raise KeyError(f"task {task!r} does not use component {component!r}")

    def input_op(self, op: int, task: str) -> int | None:
        """The MetaOp whose output feeds `op` for `task` (None: it reads the task's data)."""
        step = self._step(task, self.ops[op].components[0])
        if len(step.inputs) > 1:
            raise NotImplementedError(f"task {task!r}: component {step.component!r} has "
                                      f"{len(step.inputs)} inputs; this runtime joins one")
        return self.op_of[(task, step.inputs[0])] if step.inputs else None

    def _pieces(self, wave) -> list[Piece]:
        out = []
        for placed in wave.placed:
            m = self.ops[placed.op]
            for task in m.tasks:
                src_op = self.input_op(m.id, task)
                if src_op is None:
                    continue
                for dst, tasks in self.ranges[m.id].items():
                    if task not in tasks:
                        continue
                    ca, cb = tasks[task]
                    for src, src_tasks in self.ranges[src_op].items():
                        pa, pb = src_tasks.get(task, (0, 0))
                        lo, hi = max(ca, pa), min(cb, pb)
                        if lo < hi:
                            out.append(Piece(m.id, task, src_op, lo, hi, src, dst))
        return out

    def _shape(self, piece: Piece) -> tuple[int, int, int]:
        comp = self.ops[piece.src_op].components[-1]
        return (self._step(piece.task, comp).seq_len, piece.hi - piece.lo,
                self.model.component(comp).hidden_size)

    def run(self, data) -> torch.Tensor:
        """Forward and backward of one iteration plus the gradient all-reduce; returns the
        iteration's loss (summed over ranks)."""
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
        for w in reversed(range(len(self.plan.waves))):
            self._hand_back(w, out, leaves, grads)
            for placed in sorted(self.plan.waves[w].placed, key=lambda p: -p.start_s):
                if self.rank in placed.devices:
                    self._backward(placed.op, out, grads)
        self._sync_gradients()
        total = local.detach().clone()
        dist.all_reduce(total)
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
                buf = torch.empty(self._shape(piece))
                dist.recv(buf, piece.src)
                leaves[piece] = buf.requires_grad_()

    def _forward(self, op: int, data, out, leaves) -> None:
        m = self.ops[op]
        for task, (a, b) in self.ranges[op][self.rank].items():
            x, labels = data[task]
            if self.input_op(op, task) is None:
                h = x[a:b]
            else:
                mine = sorted((p for p in leaves if p.dst_op == op and p.task == task
                               and p.dst == self.rank), key=lambda p: p.lo)
                h = torch.cat([leaves[p] for p in mine], dim=1)
            for comp in m.components:
                if self.model.component(comp).role == "head":
                    h = self.comps[comp](h, labels[a:b]).sum() / self.normaliser(task)
                else:
                    h = self.comps[comp](h)
            out[op, task] = h

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
                    g = torch.empty(self._shape(piece))
                    dist.recv(g, piece.dst)
                a = self.ranges[piece.src_op][self.rank][piece.task][0]
                acc = grads.setdefault((piece.src_op, piece.task),
                                       torch.zeros_like(out[piece.src_op, piece.task]))
                acc[:, piece.lo - a:piece.hi - a] += g

    def _backward(self, op: int, out, grads) -> None:
        for task in self.ranges[op][self.rank]:
            value = out[op, task]
            if value.dim() == 0:
                value.backward()
            elif (op, task) in grads:
                value.backward(grads[op, task])

    def _sync_gradients(self) -> None:
        """All-reduce each component's gradients over exactly the ranks that ran it, one
        flattened bucket per component."""
        for comp in sorted(self.users):
            ranks = tuple(sorted(self.users[comp]))
            if len(ranks) < 2 or self.rank not in ranks:
                continue
            params = list(self.comps[comp].parameters())
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            bucket = torch.cat([p.grad.reshape(-1) for p in params])
            dist.all_reduce(bucket, group=self.groups[ranks])
            offset = 0
            for p in params:
                p.grad.copy_(bucket[offset:offset + p.numel()].view_as(p.grad))
                offset += p.numel()
