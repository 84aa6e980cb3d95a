"""Layout-free model state: shards written at one TP size reassemble and load at another."""
import pytest
import torch
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

from megatron.model.full_state import assemble, load_full_state, local_shards


def make_params(tp_size, tp_rank, full):
    """Parameters as a TP rank holds them: `w` split on dim 0, `b` on dim 1, `n` unsplit."""
    params = {}
    for name, dim in (("w", 0), ("b", 1)):
        part = torch.chunk(full[name], tp_size, dim=dim)[tp_rank].clone()
        param = torch.nn.Parameter(part)
        set_tensor_model_parallel_attributes(param, True, dim, 1)
        params[name] = param
    params["n"] = torch.nn.Parameter(full["n"].clone())
    return params


@pytest.fixture
def full():
    gen = torch.Generator().manual_seed(0)
    return {"w": torch.randn(6, 4, generator=gen), "b": torch.randn(3, 8, generator=gen),
            "n": torch.randn(5, generator=gen)}


def test_shards_saved_at_tp2_load_at_tp1_and_back(full):
    saved = {}
    for rank in range(2):
        for name, shard in local_shards(make_params(2, rank, full).items(), rank, 2).items():
            saved.setdefault(name, []).append(shard)
    rebuilt = {name: assemble(name, shards) for name, shards in saved.items()}
    for name in full:
        assert torch.equal(rebuilt[name], full[name])
    blank = {n: torch.zeros_like(t) for n, t in full.items()}
    for rank in range(2):
        target = make_params(2, rank, blank)
        assert load_full_state(target.items(), rebuilt, rank, 2, "ckpt") == 3
        want = make_params(2, rank, full)
        for name in full:
            assert torch.equal(target[name], want[name])


def test_missing_chunk_and_wrong_shape_are_named(full):
    shard = local_shards(make_params(2, 0, full).items(), 0, 2)["w"]
    with pytest.raises(ValueError, match=r"parameter w: chunks \[1\] of 2 are missing"):
        assemble("w", [shard])
    bad = dict(full, b=torch.zeros(3, 7))
    del bad["n"]
    with pytest.raises(ValueError, match=r"ckpt: does not fit.*b: shape \(3, 7\).*n: missing"):
        load_full_state(make_params(1, 0, full).items(), bad, 0, 1, "ckpt")


def test_gated_fc1_shards_hold_a_chunk_of_each_half_and_reassemble():
    """A gated MLP's fc1 ([gate; up] rows, `gated_halves`): TP rank r holds chunk r of the gate
    rows and chunk r of the up rows; shards saved at TP=2 assemble to the full tensor and
    reslice for TP=4."""
    from megatron.model.full_state import assemble, local_part, shard_of
    from megatron.model.init_weights import tp_slice
    full = torch.arange(16.0).reshape(8, 2)           # gate rows 0-3, up rows 4-7
    like = torch.nn.Parameter(torch.empty(4, 2))
    like.tensor_model_parallel, like.partition_dim, like.gated_halves = True, 0, True
    parts = [tp_slice(full, like, r, 2) for r in range(2)]
    assert parts[0][:, 0].tolist() == [0, 2, 8, 10] and parts[1][:, 0].tolist() == [4, 6, 12, 14]
    shards = [shard_of(p, like, r, 2) for r, p in enumerate(parts)]
    assert all(s["halves"] == 2 for s in shards)
    assert torch.equal(assemble("fc1", shards), full)
    like4 = torch.nn.Parameter(torch.empty(2, 2))
    like4.tensor_model_parallel, like4.partition_dim, like4.gated_halves = True, 0, True
    assert local_part("fc1", shards, like4, 1, 4)[:, 0].tolist() == [2, 10]
