"""FlexTP end to end on TP=2 gloo: the slow-down switch makes rank 1 a straggler, the detector
finds it from the compute times the ranks report (modelled, so a loaded machine changes
nothing), and migration moves units to rank 0."""
import math

import pytest

from megatron.flextp.train import build_parser, train
from tests.multiproc import run_in_processes


def _rank(rank, world, argv):
    import torch.distributed as dist
    dist.init_process_group("gloo")
    return train(build_parser().parse_args(argv))


@pytest.mark.slow
def test_switch_straggler_is_detected_and_migrated_away(monkeypatch):
    monkeypatch.setenv("FLEXTP_SLOWDOWN", "1:4")
    monkeypatch.setenv("FLEXTP_CLOCK", "modelled")   # the same figures on a loaded machine
    argv = ["--tp-balance", "migrate", "--train-iters", "30", "--flextp-interval", "5",
            "--hidden-size", "128", "--ffn-hidden-size", "512", "--flextp-ffn-unit", "16",
            "--num-attention-heads", "8", "--seq-length", "64", "--micro-batch-size", "4"]
    r0, r1 = run_in_processes(_rank, 2, (argv,), timeout_s=300)
    last = r0[-1]
    assert last["stragglers"] == [1] and r1[-1]["stragglers"] == [1]
    assert last["counts_now"]["mlp"][0] > last["counts_now"]["mlp"][1]
    assert last["counts_now"]["attn"][0] > last["counts_now"]["attn"][1]
    assert all(math.isfinite(r["loss"]) for r in r0) and r0[-1]["loss"] < r0[0]["loss"]
    # both ranks saw the same losses (one TP group)
    assert [r["loss"] for r in r0] == pytest.approx([r["loss"] for r in r1], rel=1e-6)


def test_bad_mode_is_rejected_by_the_flag():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--tp-balance", "fast"])


def test_held_out_loss_computes_every_unit():
    """--eval-iters: the trained weights' loss on held-out batches with skips cleared, equal
    to the same model's loss with no unit ever skipped, and not the resized forward's."""
    import torch
    from dynapipe_ext.flextp.partition import even_partition
    from megatron.flextp.model import FlexGPT, FlexGPTConfig
    from megatron.flextp.train import EVAL_SEED, byte_batches, evaluate
    argv = ["--hidden-size", "64", "--ffn-hidden-size", "128", "--flextp-ffn-unit", "16",
            "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2",
            "--eval-iters", "2"]
    args = build_parser().parse_args(argv)
    cfg = FlexGPTConfig(hidden=64, ffn=128, ffn_unit=16, num_heads=4, seq_length=32)
    parts = {"attn": even_partition(4, 1), "mlp": even_partition(8, 1)}

    def held_out_batches():
        data = byte_batches(32, 2, EVAL_SEED)
        return [next(data) for _ in range(2)]
    full = FlexGPT(cfg, parts, 0, seed=7)
    with torch.no_grad():
        expected = sum(full(*b).item() for b in held_out_batches()) / 2
    resized = FlexGPT(cfg, parts, 0, seed=7)
    with torch.no_grad():
        resized(*held_out_batches()[0])          # the imputation's last computed values
        for block in resized.blocks("mlp") + resized.blocks("attn"):
            block.set_drops((0, 1))
        skipped = sum(resized(*b).item() for b in held_out_batches()) / 2
    assert evaluate(resized, args) == pytest.approx(expected, rel=1e-6)
    assert all(b.drops == () for b in resized.blocks("mlp") + resized.blocks("attn"))
    assert abs(skipped - expected) > 1e-4
