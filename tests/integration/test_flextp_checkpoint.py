"""FlexTP checkpoints (pretrain_gpt.py --tp-balance with --save / --load). A checkpoint written
while migration holds an uneven partition is an ordinary TP checkpoint (each TP rank's even
share of heads and ffn columns, its Adam moments included): it resumes without --tp-balance at
another layout, and an ordinary checkpoint resumes with --tp-balance into an uneven partition,
both continuing the losses of the run that saved within fp32 tolerance. The round trip to the
even layout and back leaves the partition, skips and imputation state exactly as they were."""
import math

import numpy as np
import pytest
import torch

from megatron.model.full_state import assemble
from megatron.checkpoint import checkpointing as ckpt
from tests.multiproc import run_in_processes
from tests.integration.test_flextp_integration import LAYOUT, MODEL, _train
from tests.training.test_training import sp_dataset  # noqa: F401

# migrate from the partition for speeds 1 : 0.5 (TP rank 0 holds 3 of 4 heads, 22 of 32 MLP
# units) and, deciding only every 100 iterations, keep it for the whole run
UNEVEN = ["--tp-balance", "migrate", "--flextp-interval", "100",
          "--flextp-initial-speeds", "1,0.5"]
UNEVEN_COUNTS = {"attn": [3, 1], "mlp": [22, 10]}


def full_state(directory, iteration) -> dict:
    """{global name (and " exp_avg" / " exp_avg_sq"): full tensor} of a checkpoint, at
    whatever layout it was saved."""
    common = ckpt.read_common(str(directory), iteration)
    names = {n for held in common["index"].values() for n in held}
    model, optim = ckpt.read_shards(str(directory), iteration, common, names, True)
    out = {n: assemble(n, model[n]) for n in model}
    out.update({f"{n} {k}": assemble(n, [e[k] for e in optim[n]])
                for n in optim for k in ("exp_avg", "exp_avg_sq")})
    return out


def assert_same_state(got: dict, want: dict) -> None:
    """Every tensor within 1e-3 of the other's norm: fp32 reduction order moves them by at most
    6e-5 (the key biases, whose gradient is rounding noise), a unit in the wrong place by
    far more."""
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert (got[name] - t).norm() <= 1e-3 * t.norm(), name


def saved_shards(directory, iteration, tp_rank):
    path = f"{ckpt.iteration_dir(str(directory), iteration)}/{ckpt.shard_file_name(0, tp_rank)}"
    return torch.load(path, weights_only=True)


@pytest.mark.slow
def test_checkpoints_of_an_uneven_partition_are_ordinary_tp_checkpoints(sp_dataset,  # noqa: F811
                                                                        tmp_path):
    argv = sp_dataset + ["--train-iters", "4"]
    flex_dir, plain_dir, again_dir = (tmp_path / d for d in ("flex", "plain", "again"))
    # 1. TP=2 x PP=2 with FlexTP, uneven all along, saving after iterations 2 and 4
    flex = run_in_processes(_train, 4, (argv + LAYOUT + UNEVEN + [
        "--save", str(flex_dir), "--save-interval", "2"],), timeout_s=400)
    for r in flex:
        assert all(h["counts"] == UNEVEN_COUNTS for h in r["history"]), r["history"]
    losses = flex[0]["losses"]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    # the files hold TP rank 1's even share (2 heads: 2 x 3 x 8 qkv rows; 16 MLP units of 4
    # columns), parameters and Adam moments alike, though it held 1 head and 10 units then
    shards = saved_shards(flex_dir, 2, 1)
    for name, shape in (("decoder.layers.0.self_attention.linear_qkv.weight", (48, 32)),
                        ("decoder.layers.0.mlp.linear_fc2.weight", (32, 64))):
        entries = [shards["model"][name]] + [shards["optimizer"][name][k]
                                             for k in ("exp_avg", "exp_avg_sq")]
        assert all(e["tensor"].shape == shape and (e["index"], e["count"]) == (1, 2)
                   for e in entries)
        # its last units are real ones (a slot copy would end in the empty slots' zeros)
        assert all(e["tensor"].narrow(e["dim"], shape[e["dim"]] - 8, 8).abs().sum() > 0
                   for e in entries)
    (flex_dir / ckpt.LATEST).write_text("2\n")

    # 2. without --tp-balance, in one process (TP=1, resharded): iterations 3 and 4 continue
    # the FlexTP run's (4 uses the Adam moments); saves after 3 and 4
    plain = run_in_processes(_train, 1, (argv + MODEL + [
        "--tensor-model-parallel-size", "1", "--load", str(flex_dir), "--save", str(plain_dir),
        "--save-interval", "1"],), timeout_s=400)
    assert plain[0]["losses"] == pytest.approx(losses[2:], rel=2e-5, abs=2e-5)
    # and their weights and Adam moments after iteration 4 (the FlexTP run's went to the even
    # layout for the save after 2 and came back exactly)
    assert_same_state(full_state(flex_dir, 4), full_state(plain_dir, 4))
    (plain_dir / ckpt.LATEST).write_text("3\n")

    # 3. that ordinary (TP=1) checkpoint into TP=2 x PP=2 with FlexTP: the units go from the
    # even layout they load into back to the uneven start, moments with them; iteration 4 as
    # before
    again = run_in_processes(_train, 4, (argv + LAYOUT + UNEVEN + [
        "--load", str(plain_dir), "--save", str(again_dir)],), timeout_s=400)
    for r in again:
        assert r["history"][0]["counts"] == UNEVEN_COUNTS
        assert r["losses"] == pytest.approx(plain[0]["losses"][1:], rel=2e-5, abs=2e-5)
    assert_same_state(full_state(again_dir, 4), full_state(plain_dir, 4))


def _round_trip(rank, world):
    """One FlexPair (8 MLP units of 2 columns, hidden 3) at the uneven start for speeds 1 : 0.5,
    skipping a unit, with imputation state: its slots inside and after even_layout."""
    from types import SimpleNamespace

    import torch.distributed as dist
    from dynapipe_ext.flextp.partition import even_partition
    from megatron.flextp.stage_balance import StageBalancer
    from megatron.flextp.stage_layers import FlexPair, _slotted, capacity
    from megatron.model.full_state import shard_view
    dist.init_process_group("gloo")
    group = dist.new_group([0, 1])
    units, per, hidden = 8, 2, 3
    full = {0: torch.arange(1.0, 1 + units * per * hidden).reshape(units * per, hidden),
            1: -torch.arange(1.0, 1 + units * per * hidden).reshape(hidden, units * per)}
    cap = capacity(units, 2)
    pair = FlexPair("mlp", even_partition(units, 2), rank, cap, per, per, hidden)

    def slotted(axis):
        param = torch.nn.Parameter(full[axis].chunk(2, dim=axis)[rank].clone())
        param.tensor_model_parallel, param.partition_dim = True, axis
        return _slotted(param, axis, per, cap)
    pair.column = SimpleNamespace(weight=slotted(0), bias=None)
    pair.row = SimpleNamespace(weight=slotted(1), bias=None)
    layout = SimpleNamespace(tp=2, tp_rank=rank, pp_rank=0, rank=rank, world_size=2)
    balancer = StageBalancer({"mlp": [pair], "attn": []}, "migrate", layout, group)
    balancer.start_uneven([1.0, 0.5])
    pair.set_drops(pair.units()[-1:])
    pair.contrib.copy_(torch.randn(cap, hidden))
    weights = [pair.column.weight, pair.row.weight]

    def state():      # numpy: what comes back through the result queue
        return (pair.partition, pair.drops, pair.contrib.numpy().copy(),
                [w.detach().numpy().copy() for w in weights])
    before = state()
    with balancer.even_layout():
        inside = [(shard_view(w, w).detach().numpy().copy(), w.detach().numpy().copy())
                  for w in weights]
    return {"before": before, "after": state(), "inside": inside,
            "even_shards": [full[axis].chunk(2, dim=axis)[rank].numpy() for axis in (0, 1)]}


@pytest.mark.slow
def test_even_layout_holds_the_even_shards_then_restores_everything_exactly():
    for rank, r in enumerate(run_in_processes(_round_trip, 2, timeout_s=120)):
        partition, drops, contrib, weights = r["before"]
        assert partition.counts() == (6, 2) and len(drops) == 1 and abs(contrib).sum() > 0
        # inside: this rank's even shard leads, the spare slots are zero
        for (shard, whole), even, axis in zip(r["inside"], r["even_shards"], (0, 1)):
            assert np.array_equal(shard, even)
            assert not np.take(whole, range(shard.shape[axis], whole.shape[axis]), axis).any()
        # after: the uneven partition, its skip, imputation state and slots, bit for bit
        partition2, drops2, contrib2, weights2 = r["after"]
        assert (partition2, drops2) == (partition, drops) and np.array_equal(contrib2, contrib)
        assert all(np.array_equal(a, b) for a, b in zip(weights2, weights))


@pytest.mark.slow
def test_an_uneven_checkpoint_resumes_at_even_tp2_and_at_tp1(sp_dataset, tmp_path):  # noqa: F811
    """Saved by --tp-balance migrate while TP rank 0 holds 3 of 4 heads and 22 of 32 MLP units
    (TP=2, dropout off): the files are layout-free, so an even TP=2 run without FlexTP and a
    TP=1 run both resume from them with the next losses of the run that saved, within 1e-6
    relative (a unit in the wrong slot, a moment left behind, or a spare slot saved in place
    of a real one moves them by far more)."""
    argv = sp_dataset + MODEL + ["--train-iters", "4"]
    flex_dir = tmp_path / "flex"
    flex = run_in_processes(_train, 2, (argv + UNEVEN + [
        "--save", str(flex_dir), "--save-interval", "2"],), timeout_s=400)
    for r in flex:
        assert all(h["counts"] == UNEVEN_COUNTS for h in r["history"]), r["history"]
    losses = flex[0]["losses"]
    (flex_dir / ckpt.LATEST).write_text("2\n")
    even = run_in_processes(_train, 2, (argv + ["--load", str(flex_dir)],), timeout_s=400)
    assert even[0]["history"] is None                     # no FlexTP in the resumed run
    assert even[0]["losses"] == pytest.approx(losses[2:], rel=1e-6)
    one = run_in_processes(_train, 1, (argv + ["--tensor-model-parallel-size", "1",
                                               "--load", str(flex_dir)],), timeout_s=400)
    assert one[0]["losses"] == pytest.approx(losses[2:], rel=1e-6)
