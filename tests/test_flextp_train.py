"""FlexTP end to end on TP=2 gloo: the slow-down switch makes rank 1 a straggler, the detector
finds it from the compute times the ranks measure, and migration moves units to rank 0."""
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
