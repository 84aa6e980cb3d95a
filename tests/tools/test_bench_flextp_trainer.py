"""tools/bench_flextp_trainer.py's pure parts (megatron/flextp/run_summary.py): it reads the stats
file the real TrainLogger writes and the change lines the real balancer prints, computes the
ideal like the standalone bench, and renders one table row per configuration (the runs
themselves are the benchmark, not a test)."""
import io
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

from megatron.flextp import run_summary as bench  # noqa: E402
from megatron.flextp.stage_balance import change_line  # noqa: E402
from megatron.training.train_logging import (IterationStats, TrainLogger,  # noqa: E402
                                             ValidationStats)


def _stats(i, seconds, loss):
    return IterationStats(iteration=i, train_iters=6, loss=loss, lr=1e-3, grad_norm=1.0,
                          real_tokens=100, token_slots=120, num_micro_batches=1, shapes="1x120",
                          plan_wait_s=0.0, iteration_s=seconds, peak_memory_bytes=0)


def test_stats_file_of_the_trainer_gives_times_and_losses(tmp_path):
    path = tmp_path / "stats.jsonl"
    logger = TrainLogger(100, stream=io.StringIO(), stats_file=str(path))
    seconds = [5.0, 1.0, 2.0, 3.0, 4.0, 6.0]
    for i, s in enumerate(seconds, 1):
        logger.log(_stats(i, s, 10.0 - i))
        if i == 3:   # a validation record in between is not an iteration
            logger.log_validation(ValidationStats(iteration=3, loss=1.0, loss_tokens=5,
                                                  samples=1, batches=1, tasks={}, families={},
                                                  eval_s=0.1, plan_s=0.0))
    records = bench.iteration_records(path.read_text().splitlines())
    assert [r["iteration"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert bench.mean_seconds(records, skip=2) == pytest.approx((2 + 3 + 4 + 6) / 4)
    assert bench.final_loss(records, window=2) == pytest.approx((5.0 + 4.0) / 2)
    with pytest.raises(ValueError, match="no iterations after the 6"):
        bench.mean_seconds(records, skip=6)


def test_bad_stats_lines_name_the_file_and_line():
    with pytest.raises(ValueError, match="s.jsonl, line 2: not JSON"):
        bench.iteration_records([json.dumps({"iteration": 1, "iteration_s": 1, "loss": 2}),
                                 "{oops"], "s.jsonl")
    with pytest.raises(ValueError, match="line 1: no iteration"):
        bench.iteration_records([json.dumps({"iteration": 1})], "s.jsonl")


def test_balancer_change_lines_give_the_final_partition():
    first = {"action": None, "counts": {"attn": [4, 4], "mlp": [16, 16]},
             "skips": {"attn": [0, 1], "mlp": [0, 4]}, "stragglers": [1]}
    last = {"action": {"attn": "migrate", "mlp": "migrate"},
            "counts": {"attn": [5, 3], "mlp": [21, 11]},
            "skips": {"attn": [0, 0], "mlp": [0, 1]}, "stragglers": [1]}
    log = "\n".join(["iter 10/50 | loss 7.9", change_line(10, 0, first), "noise",
                     change_line(20, 0, last), "[train] done"])
    changes = bench.balance_changes(log)
    assert [c["iteration"] for c in changes] == [10, 20]
    assert changes[0]["skips"] == first["skips"]
    even = {"attn": [4, 4], "mlp": [16, 16]}
    assert bench.final_partition(changes, even) == {"counts": last["counts"],
                                                    "skips": last["skips"]}
    assert bench.final_partition([], even) == {"counts": even,
                                               "skips": {"attn": [0, 0], "mlp": [0, 0]}}


def test_ideal_splits_the_straggler_block_share_by_speed():
    # block share t on the even rank: the straggler needs f t, so even = none + (f - 1) t;
    # both ranks' block work 2t split by speeds 1 and 1/f takes 2t / (1 + 1/f)
    none, t, f = 0.4, 0.3, 3.0
    ideal, share = bench.ideal_seconds(none, none + (f - 1) * t, f)
    assert share == pytest.approx(t)
    assert ideal == pytest.approx(none - t + 2 * t / (1 + 1 / f))
    assert none < ideal < none + (f - 1) * t
    assert bench.ideal_seconds(0.5, 0.45, 2) == (0.5, 0.0)   # noise: even faster than none


def test_table_has_a_row_per_configuration_and_the_ideal():
    def run(seconds, loss, partition, n_changes):
        return {"records": [{"iteration": i, "seconds": s, "loss": loss}
                            for i, s in enumerate(seconds, 1)],
                "partition": partition, "changes": [{}] * n_changes}
    even = {"counts": {"attn": [4, 4], "mlp": [16, 16]}, "skips": {"attn": [0, 0],
                                                                   "mlp": [0, 0]}}
    moved = {"counts": {"attn": [5, 3], "mlp": [21, 11]}, "skips": {"attn": [0, 0],
                                                                   "mlp": [0, 1]}}
    runs = {"no straggler": [run([9, 1.0, 1.0], 3.0, even, 0), run([9, 1.2, 1.2], 3.0, even, 0)],
            "even": [run([9, 2.0, 2.0], 3.5, even, 0), run([9, 1.8, 1.8], 3.5, even, 0)],
            "semi": [run([9, 1.5, 1.5], 3.1, moved, 3), run([9, 1.3, 1.3], 3.1, moved, 2)]}
    summary = bench.summarize(runs, skip=1)
    assert summary["configs"]["semi"]["times"] == [1.5, 1.3]
    assert summary["configs"]["semi"]["changes"] == [3, 2]
    ideal = bench.ideal_seconds(1.1, 1.9, bench.FACTOR)[0]
    assert summary["ideal"] == pytest.approx(ideal)
    rows = bench.render_table(summary).splitlines()
    assert len(rows) == 2 + 3 + 1
    semi = next(r for r in rows if r.startswith("| semi |"))
    assert f"| 1.400 | 1.500, 1.300 | {1.4 / ideal:.2f}x | 3.1000 |" in semi
    assert "[21, 11] / [5, 3] (skipping [0, 1] / [0, 0])" in semi
    assert rows[-1].startswith(f"| ideal (work split by speed) | {ideal:.3f} |")


def test_whole_rank_straggler_ideal_splits_all_work_by_measured_speed():
    """A busy process on the straggler's core slows all its rank runs: f = even / none, and
    the ideal is the whole iteration split by speeds 1 and 1/f; the TP block share (what
    FlexTP can move) comes from the synthetic 2x reference run."""
    def run(seconds):
        return {"records": [{"iteration": 1, "seconds": 9.0, "loss": 1.0},
                            {"iteration": 2, "seconds": seconds, "loss": 1.0}],
                "partition": {}, "changes": []}
    runs = {"no straggler": [run(0.4)], "even": [run(0.8)], "reference": [run(0.6)],
            "semi": [run(0.6)]}
    summary = bench.summarize(runs, skip=1, reference="reference")
    assert summary["factor"] == pytest.approx(2.0)
    assert summary["ideal"] == pytest.approx(0.4 * 4 / 3)
    assert summary["block_share_s"] == pytest.approx(0.2)
    assert bench.whole_rank_ideal(0.5, 0.45) == (0.5, 1.0)      # noise: even below none


def test_held_out_loss_is_the_last_validation_record(tmp_path):
    path = tmp_path / "stats.jsonl"
    logger = TrainLogger(100, stream=io.StringIO(), stats_file=str(path))
    for i, loss in ((1, 2.5), (2, 2.0)):
        logger.log(_stats(i, 1.0, 9.0))
        logger.log_validation(ValidationStats(iteration=i, loss=loss, loss_tokens=5, samples=1,
                                              batches=1, tasks={}, families={}, eval_s=0.1,
                                              plan_s=0.0))
    assert bench.held_out_loss(path.read_text().splitlines()) == 2.0
    logger.log(_stats(3, 1.0, 9.0))
    with pytest.raises(ValueError, match="x.jsonl: no validation record"):
        bench.held_out_loss([json.dumps({"iteration": 1, "iteration_s": 1, "loss": 2})],
                            "x.jsonl")


def test_loss_study_pairs_each_seed_with_its_no_straggler_run():
    runs = {"no straggler": {"1": 2.0, "2": 4.0},
            "resize": {"1": 2.02, "2": 3.96}, "semi": {"1": 2.0, "2": 4.08}}
    summary = bench.summarize_losses(runs)
    assert summary["resize"]["relative"] == pytest.approx({"1": 0.01, "2": -0.01})
    assert summary["resize"]["mean_relative"] == pytest.approx(0.0)
    assert summary["semi"]["worst_relative"] == pytest.approx(0.02)
    assert summary["no straggler"]["mean_relative"] == 0.0
    rows = bench.render_loss_table(summary).splitlines()
    assert len(rows) == 2 + 3
    assert rows[0].startswith("| run | held-out loss per seed (1, 2) |")
    resize = next(r for r in rows if r.startswith("| resize |"))
    assert "| 2.0200, 3.9600 | 2.9900 | +1.00%, -1.00% | +0.00% |" in resize
