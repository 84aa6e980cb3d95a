"""FlexTP uneven partitions: any assignment of heads / ffn column groups to the TP ranks gives the
loss and gradients of the even partition (TP=2 on gloo, fp32) and of one process (TP=1)."""
import numpy as np
import pytest
import torch

from dynapipe_ext.flextp.partition import Partition, even_partition
from megatron.flextp.layers import slowdown_factor
from megatron.flextp.model import FlexGPT, FlexGPTConfig
from tests.multiproc import run_in_processes

CFG = FlexGPTConfig(vocab_size=64, seq_length=16, hidden=32, num_layers=2, num_heads=4, ffn=64,
                    ffn_unit=8)
UNEVEN = {"attn": Partition((1, 0, 1, 1), 2), "mlp": Partition((0, 1, 1, 1, 0, 1, 1, 1), 2)}


def batch():
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, CFG.vocab_size, (3, CFG.seq_length + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def loss_and_grads(model, group_size):
    tokens, labels = batch()
    loss = model(tokens, labels)
    loss.backward()
    out = {"loss": loss.item()}
    for i, layer in enumerate(model.layers):
        for kind in ("attn", "mlp"):
            block = getattr(layer, kind)
            for name, t in block.gather_full(grads=True).items():
                out[f"{i}.{kind}.{name}"] = t.numpy()
    out["embed"] = model.embed.weight.grad.numpy()
    return out


def _rank(rank, world, parts):
    import torch.distributed as dist
    dist.init_process_group("gloo")
    group = dist.new_group([0, 1])
    model = FlexGPT(CFG, parts, rank, group)
    return loss_and_grads(model, world)


def reference():
    parts = {"attn": even_partition(CFG.num_heads, 1), "mlp": even_partition(CFG.mlp_units, 1)}
    return loss_and_grads(FlexGPT(CFG, parts, 0, None), 1)


@pytest.mark.slow
def test_uneven_partition_matches_even_and_single_process():
    even = {"attn": even_partition(CFG.num_heads, 2), "mlp": even_partition(CFG.mlp_units, 2)}
    ref = reference()
    for parts in (even, UNEVEN):
        ranks = run_in_processes(_rank, 2, (parts,))
        for r in ranks:
            assert set(r) == set(ref)
            for key, value in ref.items():
                np.testing.assert_allclose(r[key], value, rtol=1e-5, atol=1e-6, err_msg=key)
    # the grads are not all zero (the comparison means something)
    assert np.abs(ref["0.mlp.col_weight"]).max() > 1e-4 and np.abs(ref["1.attn.row_weight"]).max() > 1e-4


def test_partition_bookkeeping_and_errors():
    p = Partition((1, 0, 1, 1), 2)
    assert p.units_of(0) == (1,) and p.units_of(1) == (0, 2, 3) and p.counts() == (1, 3)
    assert even_partition(4, 2).moves_to(p) == [(0, 0, 1)]
    with pytest.raises(ValueError, match="own no unit"):
        Partition((0, 0), 2)
    with pytest.raises(ValueError, match="do not split evenly"):
        even_partition(5, 2)


def test_slowdown_switch_parses_and_names_bad_values():
    assert slowdown_factor(1, "1:3") == 3 and slowdown_factor(0, "1:3") == 1
    assert slowdown_factor(0, "") == 1
    with pytest.raises(ValueError, match="FLEXTP_SLOWDOWN"):
        slowdown_factor(0, "fast")
