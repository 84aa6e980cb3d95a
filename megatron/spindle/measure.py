"""Measurements behind Spindle's real run: per-layer profiles of the real components on this
device (fitted into the estimator) and an alpha-beta fit of the point-to-point link between
two ranks, plus timed iterations of a plan."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from dynapipe_ext.spindle.estimator import CommModel, Estimator, LayerFit, fit_layer
from dynapipe_ext.spindle.model import MTModel

from .mt_model import HEAD_OF, TASKS, TinyMTConfig, describe


def _fwd_bwd_s(fn, repeats: int) -> float:
    """Fastest of `repeats` forward+backward runs after one warm-up (the least disturbed by
    other load on a shared machine)."""
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        fn().sum().backward()
        times.append(time.perf_counter() - start)
    return min(times[1:])


def profile_layer_fits(comps, cfg: TinyMTConfig, model: MTModel, data,
                       sample_counts=(1, 2, 4, 8), repeats: int = 5) -> dict[str, LayerFit]:
    """Per-layer forward+backward seconds of each component at a few sample counts (one
    device), fitted to overhead + per-token cost per layer kind (tokens: the step's)."""
    points: dict[str, list] = {}
    for task in TASKS:
        x, labels = data[task]
        for k in sample_counts:
            k = min(k, model.tasks[TASKS.index(task)].batch_size)
            outs: dict[str, torch.Tensor] = {}
            for step in model.tasks[TASKS.index(task)].steps:
                module = comps[step.component]
                args = [outs[i].detach().requires_grad_() for i in step.inputs] or \
                    [(x[step.component] if isinstance(x, dict) else x)[:k]]
                if step.component == HEAD_OF[task]:
                    def fn(module=module, args=args):
                        return module(*args, labels[:k])
                else:
                    def fn(module=module, args=args):
                        return module(*args)
                    with torch.no_grad():
                        outs[step.component] = fn()
                comp = model.component(step.component)
                secs = _fwd_bwd_s(fn, repeats) / comp.num_layers
                points.setdefault(comp.layer_kind, []).append((k * step.seq_len, secs))
    return {kind: fit_layer(pts, where=f"profile of {kind}") for kind, pts in points.items()}


def fit_link(peer: int, rank: int, sizes=(256, 1 << 20, 1 << 22), repeats: int = 8
             ) -> CommModel:
    """Ping-pong between `rank` and `peer`: half the fastest round trip per size (the least
    disturbed by other load); beta is the slope between the smallest and largest size, alpha
    what is left of the smallest message (both ranks call this with each other as peer)."""
    points = []
    for n in sizes:
        buf = torch.zeros(n // 4)
        times = []
        for _ in range(repeats + 1):
            dist.barrier()
            start = time.perf_counter()
            if rank < peer:
                dist.send(buf, peer)
                dist.recv(buf, peer)
            else:
                dist.recv(buf, peer)
                dist.send(buf, peer)
            times.append((time.perf_counter() - start) / 2)
        points.append((n, min(times[1:])))
    (n0, t0), (n1, t1) = points[0], points[-1]
    beta = max((t1 - t0) / (n1 - n0), 1e-12)
    return CommModel(max(t0 - beta * n0, 0.0), beta)


def shared_estimator(model: MTModel, fits: dict[str, LayerFit] | None, comm: CommModel,
                     src: int = 0) -> Estimator:
    """Rank `src`'s fits (None elsewhere) and link fit on every rank (a float tensor
    broadcast), so every rank plans alike."""
    kinds = sorted({c.layer_kind for c in model.components})
    if fits is None:
        values = torch.zeros(2 * len(kinds) + 2, dtype=torch.float64)
    else:
        values = torch.tensor([v for k in kinds for v in (fits[k].overhead_s,
                                                          fits[k].per_token_s)]
                              + [comm.alpha_s, comm.beta_s_per_byte], dtype=torch.float64)
    dist.broadcast(values, src)
    v = values.tolist()
    shared = {k: LayerFit(max(v[2 * i], 0.0), v[2 * i + 1]) for i, k in enumerate(kinds)}
    return Estimator(shared, CommModel(v[-2], v[-1]), dtype_bytes=4)


def iteration_tokens(cfg: TinyMTConfig) -> int:
    """Input tokens of one iteration, all tasks (text bytes, image patches, audio frames;
    both inputs of a paired task)."""
    return sum(s.seq_len * t.batch_size for t in describe(cfg).tasks for s in t.steps
               if not s.inputs)


def timed_iteration(runtime, comps, optimizer, data) -> float:
    """One iteration (forward, backward, gradient sync, SGD step); the slowest rank's time."""
    dist.barrier()
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    runtime.run(data)
    optimizer.step()
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)

