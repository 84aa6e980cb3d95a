"""FlexTP migration transfers: move units (weights, fp32 main copies, both Adam moments) between
TP ranks so the partition becomes `new`; the math of the model does not change.

Each (sender, receiver) pair exchanges one flat fp32 buffer holding every moved unit's slices of
every tensor, in an order both sides derive from the partitions; pairs go in a fixed order with
blocking send / recv, so no rank waits on a message sent later. The slot layers
(stage_layers.migrate_pairs) copy the result into their fixed-size slots."""
from __future__ import annotations

import torch
import torch.distributed as dist

from dynapipe_ext.flextp.partition import Partition


def _take_units(t: torch.Tensor, axis: int, per: int, idx: torch.Tensor) -> torch.Tensor:
    """The slices of local units `idx` along `axis`, `per` entries each."""
    rows = (idx[:, None] * per + torch.arange(per)[None, :]).reshape(-1)
    return t.index_select(axis, rows.to(t.device))


def _local_index(units, wanted) -> torch.Tensor:
    pos = {u: i for i, u in enumerate(units)}
    return torch.tensor([pos[u] for u in wanted], dtype=torch.long)


def exchange_units(tensors, old: Partition, new: Partition, rank: int, group=None
                   ) -> tuple[dict, int]:
    """The transfers of a migration from `old` to `new`, for every (tensor, axis, per) of
    `tensors` (this rank's units of `old` side by side along `axis`, `per` entries each; the
    same list, in the same order, on every rank): this rank sends the slices of the units it
    gives away and receives those it gets. Returns ({unit: {index in tensors: its fp32
    slice}}, bytes sent)."""
    moves = old.moves_to(new)
    mine_old = old.units_of(rank)
    received: dict[int, dict] = {}
    sent = 0
    for src, dst in sorted({(a, b) for _, a, b in moves}):
        units = [u for u, a, b in moves if (a, b) == (src, dst)]
        if rank == src:
            idx = _local_index(mine_old, units)
            buf = torch.cat([_take_units(t, axis, per, idx).float().movedim(axis, 0).reshape(-1)
                             for t, axis, per in tensors])
            dist.send(buf, dst=_global(dst, group), group=group)
            sent += buf.numel() * buf.element_size()
        elif rank == dst:
            sizes = [len(units) * _slice_numel(t, axis, per) for t, axis, per in tensors]
            buf = torch.empty(sum(sizes), device=tensors[0][0].device)
            dist.recv(buf, src=_global(src, group), group=group)
            for k, ((t, axis, per), chunk) in enumerate(zip(tensors, buf.split(sizes))):
                shape = list(t.shape)
                shape[axis] = per
                shape.insert(0, shape.pop(axis))
                per_unit = chunk.reshape(len(units), *shape)
                for j, u in enumerate(units):
                    received.setdefault(u, {})[k] = per_unit[j].movedim(0, axis)
    return received, sent


def new_layout(t: torch.Tensor, axis: int, per: int, mine_old, mine_new, received: dict,
               k: int) -> torch.Tensor:
    """This rank's units of the new partition along `axis`: kept slices of `t` and received
    ones (tensor index `k` of exchange_units), in the new order, in `t`'s dtype."""
    pieces = [_take_units(t, axis, per, _local_index(mine_old, [u])) if u in mine_old
              else received[u][k].to(t.device, t.dtype) for u in mine_new]
    return torch.cat(pieces, dim=axis)


def _slice_numel(p, axis, per) -> int:
    return p.numel() // p.shape[axis] * per


def _global(rank: int, group) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)
