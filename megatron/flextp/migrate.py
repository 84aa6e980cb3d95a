"""FlexTP migration: move units (weights, fp32 master copies, both Adam moments) between TP ranks
so the partition becomes `new`; the math of the model does not change.

Each (sender, receiver) pair exchanges one flat fp32 buffer holding every moved unit's slices of
every field of every block, in an order both sides derive from the partitions; pairs go in a
fixed order with blocking send / recv, so no rank waits on a message sent later."""
from __future__ import annotations

import torch
import torch.distributed as dist

from dynapipe_ext.flextp.partition import Partition
from megatron.flextp.layers import FlexTPBlock, _take_units


def _fields(block: FlexTPBlock, optimizer):
    """(parameter, field index, axis, per) for the parameter itself (0) and its optimizer
    fields (1..3)."""
    for param, axis, per in block.sharded():
        for i in range(1 + len(optimizer.FIELDS)):
            yield param, i, axis, per


def _tensor(param, i, optimizer):
    return param.detach() if i == 0 else optimizer.fields(param)[i - 1]


def _local_index(units, wanted) -> torch.Tensor:
    pos = {u: i for i, u in enumerate(units)}
    return torch.tensor([pos[u] for u in wanted], dtype=torch.long)


def migrate_blocks(blocks: list[FlexTPBlock], optimizer, new: Partition, group=None) -> int:
    """Repartition `blocks` (all with the same partition) to `new`; returns the bytes this rank
    sent. Call on every TP rank with the same arguments."""
    if not blocks:
        return 0
    old, rank = blocks[0].partition, blocks[0].rank
    if any(b.partition != old for b in blocks):
        raise ValueError("migrate_blocks: blocks must share one partition")
    moves = old.moves_to(new)
    pairs = sorted({(a, b) for _, a, b in moves})
    mine_old, mine_new = old.units_of(rank), new.units_of(rank)
    received: dict[int, dict] = {}   # unit -> {(block idx, param idx, field): slice}
    sent = 0
    for src, dst in pairs:
        units = [u for u, a, b in moves if (a, b) == (src, dst)]
        slots = [(bi, pi, fi, axis, per, b.sharded()[pi][0])
                 for bi, b in enumerate(blocks)
                 for pi, (param, axis, per) in enumerate(b.sharded())
                 for fi in range(1 + len(optimizer.FIELDS))]
        if rank == src:
            idx = _local_index(mine_old, units)
            parts = [_take_units(_tensor(p, fi, optimizer), axis, per, idx).float()
                     .movedim(axis, 0).reshape(-1) for bi, pi, fi, axis, per, p in slots]
            buf = torch.cat(parts)
            dist.send(buf, dst=_global(dst, group), group=group)
            sent += buf.numel() * buf.element_size()
        elif rank == dst:
            sizes = [len(units) * _slice_numel(p, axis, per) for bi, pi, fi, axis, per, p in slots]
            buf = torch.empty(sum(sizes))
            dist.recv(buf, src=_global(src, group), group=group)
            for (bi, pi, fi, axis, per, p), chunk in zip(slots, buf.split(sizes)):
                shape = list(p.shape)
                shape[axis] = per
                shape = [shape[axis]] + shape[:axis] + shape[axis + 1:]
                per_unit = chunk.reshape(len(units), *shape)
                for k, u in enumerate(units):
                    received.setdefault(u, {})[(bi, pi, fi)] = per_unit[k].movedim(0, axis)
    for bi, block in enumerate(blocks):
        for pi, (param, axis, per) in enumerate(block.sharded()):
            new_tensors = []
            for fi in range(1 + len(optimizer.FIELDS)):
                src_t = _tensor(param, fi, optimizer)
                pieces = []
                for u in mine_new:
                    if u in mine_old:
                        pieces.append(_take_units(src_t, axis, per,
                                                  _local_index(mine_old, [u])))
                    else:
                        pieces.append(received[u][(bi, pi, fi)].to(src_t.dtype))
                new_tensors.append(torch.cat(pieces, dim=axis).contiguous())
            # a new Parameter: autograd caches a leaf's shape, so resizing .data would not do
            fresh = torch.nn.Parameter(new_tensors[0], requires_grad=param.requires_grad)
            setattr(block, block._name(param), fresh)
            optimizer.replace(param, fresh, new_tensors[1:])
        block.set_partition(new)
    return sent


def _slice_numel(p, axis, per) -> int:
    return p.numel() // p.shape[axis] * per


def _global(rank: int, group) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)
