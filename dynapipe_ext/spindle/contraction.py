"""Graph contraction: the per-layer operator graph of all tasks becomes MetaOps (maximal chains
of operators of the same kind and the same workload) grouped into MetaLevels (dependency
depth). The scheduler then works on a handful of MetaOps instead of thousands of layers."""
from __future__ import annotations

from dataclasses import dataclass

from .model import MTModel


@dataclass(frozen=True)
class Operator:
    """One layer of one component run for one task's data."""
    task: str
    component: str
    layer: int
    kind: str
    samples: int
    tokens: int          # tokens of the whole iteration through this layer (samples x seq)


@dataclass(frozen=True)
class MetaOp:
    """A contracted chain: `layers` operators of kind `kind`, spanning whole `components` in
    order, on the samples of `tasks` (concatenated in that order, `task_samples` each; more
    than one task when the same components run the same-shaped data of several tasks as one
    batch); `preds` are MetaOp ids whose outputs it reads."""
    id: int
    tasks: tuple[str, ...]
    task_samples: tuple[int, ...]
    kind: str
    components: tuple[str, ...]
    layers: int
    samples: int
    tokens: int
    params: int
    out_width: int
    preds: tuple[int, ...]
    level: int

    @property
    def task(self) -> str:
        return "+".join(self.tasks)

    @property
    def name(self) -> str:
        return f"{self.task}:{'+'.join(self.components)}"

    def sample_keys(self) -> list[tuple[str, int]]:
        """(task, index) of every sample in the order the MetaOp holds them."""
        return [(t, i) for t, k in zip(self.tasks, self.task_samples) for i in range(k)]


def operator_graph(model: MTModel) -> tuple[list[Operator], list[tuple[int, int]]]:
    """Every (task, component, layer) operator and the data edges between them (indices)."""
    ops: list[Operator] = []
    edges: list[tuple[int, int]] = []
    for task in model.tasks:
        first_last: dict[str, tuple[int, int]] = {}
        for step in task.steps:
            comp = model.component(step.component)
            first = len(ops)
            for layer in range(comp.num_layers):
                ops.append(Operator(task.name, comp.name, layer, comp.layer_kind,
                                    task.batch_size, task.batch_size * step.seq_len))
                if layer:
                    edges.append((len(ops) - 2, len(ops) - 1))
            for src in step.inputs:
                edges.append((first_last[src][1], first))
            first_last[comp.name] = (first, len(ops) - 1)
    return ops, edges


def _chains(ops: list[Operator], edges: list[tuple[int, int]]) -> list[list[int]]:
    """Maximal chains u -> v where u has one successor, v one predecessor, and both have the
    same kind and workload; returned in topological order of their heads."""
    succ: dict[int, list[int]] = {i: [] for i in range(len(ops))}
    pred: dict[int, list[int]] = {i: [] for i in range(len(ops))}
    for u, v in edges:
        succ[u].append(v)
        pred[v].append(u)

    def joins(u: int, v: int) -> bool:
        a, b = ops[u], ops[v]
        return (len(succ[u]) == 1 and len(pred[v]) == 1 and a.kind == b.kind
                and (a.samples, a.tokens) == (b.samples, b.tokens))

    heads = [i for i in range(len(ops))
             if not (len(pred[i]) == 1 and joins(pred[i][0], i))]
    chains = []
    for head in heads:
        chain = [head]
        while len(succ[chain[-1]]) == 1 and joins(chain[-1], succ[chain[-1]][0]):
            chain.append(succ[chain[-1]][0])
        chains.append(chain)
    return chains


def contract(model: MTModel, batch_tasks: bool = True, ragged: bool = False) -> list[MetaOp]:
    """MetaOps of `model` with their dependencies and MetaLevels (0 = reads only data). With
    `batch_tasks`, MetaOps of one MetaLevel running the same components on samples of the same
    length (different tasks) become one MetaOp over their concatenated samples; `ragged`
    merges further (see batch_same_shape)."""
    ops, edges = operator_graph(model)
    chains = _chains(ops, edges)
    owner = {op: cid for cid, chain in enumerate(chains) for op in chain}
    preds: dict[int, set[int]] = {cid: set() for cid in range(len(chains))}
    for u, v in edges:
        if owner[u] != owner[v]:
            preds[owner[v]].add(owner[u])
    order = _topological(preds)
    level: dict[int, int] = {}
    for cid in order:
        level[cid] = 1 + max((level[p] for p in preds[cid]), default=-1)
    renumber = {cid: i for i, cid in enumerate(order)}
    metaops = []
    for cid in order:
        chain = [ops[i] for i in chains[cid]]
        comps = tuple(dict.fromkeys(op.component for op in chain))
        params = sum(model.component(op.component).params_per_layer for op in chain)
        metaops.append(MetaOp(
            id=renumber[cid], tasks=(chain[0].task,), task_samples=(chain[0].samples,), kind=chain[0].kind, components=comps,
            layers=len(chain), samples=chain[0].samples, tokens=chain[0].tokens,
            params=params, out_width=model.component(comps[-1]).hidden_size,
            preds=tuple(sorted(renumber[p] for p in preds[cid])), level=level[cid]))
    return batch_same_shape(metaops, ragged) if batch_tasks else metaops


def batch_same_shape(metaops: list[MetaOp], ragged: bool = False) -> list[MetaOp]:
    """Merge MetaOps of one level with the same components and tokens per sample into one
    batch. With `ragged`, MetaOps running the same components merge whatever their level and
    sample length (each task's samples keep their own length; the merged MetaOp waits for all
    inputs, as the uniform layout does); a merge that would close a cycle is skipped."""
    groups: dict[tuple, list[MetaOp]] = {}
    for m in metaops:
        key = (m.components,) if ragged else (m.level, m.components, m.tokens / m.samples)
        groups.setdefault(key, []).append(m)
    merged = [[m.id] for m in metaops]
    for g in groups.values():
        if len(g) < 2:
            continue
        ids = {m.id for m in g}
        trial = [grp for grp in merged if not ids & set(grp)] + [sorted(ids)]
        if _merge(metaops, trial) is not None:
            merged = trial
    return _merge(metaops, merged)


def _merge(metaops: list[MetaOp], groups: list[list[int]]) -> list[MetaOp] | None:
    """MetaOps merged by `groups` (lists of ids), renumbered topologically with fresh
    MetaLevels; None if the merged graph has a cycle."""
    by_id = {m.id: m for m in metaops}
    group_of = {i: g for g, ids in enumerate(groups) for i in ids}
    preds = {g: {group_of[p] for i in ids for p in by_id[i].preds} - {g}
             for g, ids in enumerate(groups)}
    try:
        order = _topological(preds)
    except ValueError:
        return None
    level: dict[int, int] = {}
    for g in order:
        level[g] = 1 + max((level[p] for p in preds[g]), default=-1)
    new_id = {g: i for i, g in enumerate(order)}
    out = []
    for g in order:
        ms = [by_id[i] for i in groups[g]]
        out.append(MetaOp(
            id=new_id[g], tasks=tuple(t for m in ms for t in m.tasks),
            task_samples=tuple(k for m in ms for k in m.task_samples), kind=ms[0].kind,
            components=ms[0].components, layers=ms[0].layers,
            samples=sum(m.samples for m in ms), tokens=sum(m.tokens for m in ms),
            params=ms[0].params, out_width=ms[0].out_width,
            preds=tuple(sorted(new_id[p] for p in preds[g])), level=level[g]))
    return out


def _topological(preds: dict[int, set[int]]) -> list[int]:
    """Kahn's order, smallest id first among the ready ones (deterministic)."""
    remaining = {k: set(v) for k, v in preds.items()}
    order: list[int] = []
    while remaining:
        ready = sorted(k for k, v in remaining.items() if not v)
        if not ready:
            raise ValueError(f"operator graph has a cycle among {sorted(remaining)}")
        for k in ready:
            order.append(k)
            del remaining[k]
        for v in remaining.values():
            v.difference_update(ready)
    return order


def metalevels(metaops: list[MetaOp]) -> list[list[MetaOp]]:
    """MetaOps grouped by MetaLevel (dependency depth)."""
    depth = 1 + max(m.level for m in metaops)
    return [[m for m in metaops if m.level == d] for d in range(depth)]
