"""tools/bench_pipeline_training.py renders each rank's measured busy time beside the cost
model's price of that rank's stages (run as a command on saved figures)."""
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def row(schedule, busy, predicted):
    return {"model": "t5", "schedule": schedule, "auto_layout": "", "measured_ms": [270.0, 280.0],
            "predicted_ms": [200.0, 200.0], "tokens": 8000, "orders": ["wave1"],
            "per_round_median_ms": [270.0, 280.0], "predicted_by_iteration": [200.0],
            "busy_ms": [237.0], "tokens_per_s": 14000.0, "measured_over_predicted": 1.38,
            **({"rank_busy_ms": busy, "predicted_rank_compute_ms": predicted} if busy else {})}


def test_per_rank_busy_beside_predicted_compute(tmp_path):
    saved = {"date": "d", "command": "c", "iters": 12, "skip": 2, "rounds": 2,
             "load_before": [1, 1, 1], "load_after": [1, 1, 1], "cost_model": "analytic",
             "rows": [row("wave W=1", [[230.0, 60.0], [244.0, 70.0], [237.0, 64.0]],
                          [207.4, 150.2]),
                      row("1f1b", None, None)]}
    path = tmp_path / "saved.json"
    path.write_text(json.dumps(saved))
    out = subprocess.run([sys.executable, "tools/bench_pipeline_training.py", "--reuse",
                          str(path), "--no-write"], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout
    wave = next(line for line in out.splitlines() if "| wave W=1 |" in line)
    assert "| r0 237 / 207, r1 64 / 150 |" in wave          # medians of the rounds
    old = next(line for line in out.splitlines() if "| 1f1b |" in line)
    assert "| 237 | - |" in old                             # saved without per-rank figures


def test_per_rank_figures_leave_the_first_iteration_out():
    """The trainer's closing shares cover the iterations after the first; so must the mean
    iteration time they are multiplied by, and the predicted compute beside them."""
    from megatron.bench.schedule_bench import predicted_rank_compute_ms, rank_busy_ms
    records = [{"iteration": 1, "iteration_s": 0.9}, {"iteration": 2, "iteration_s": 0.2},
               {"iteration": 3, "iteration_s": 0.3}]
    assert rank_busy_ms(records, {1: 0.4, 0: 0.8}) == [200.0, 100.0]
    assert predicted_rank_compute_ms([[500.0, 50.0], [100.0, 40.0], [200.0, 60.0]]) == \
        [150.0, 50.0]
