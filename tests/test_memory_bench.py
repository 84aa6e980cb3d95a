"""Predicted vs measured activation memory (megatron/training/memory_bench.py,
tools/bench_memory.py): the measurement follows the plan, and the cost model is close to it."""
import numpy as np
import pytest
import torch

from dynapipe_ext.model_spec import ModelSpec
from multiproc import single_process_world

torch.set_num_threads(1)
GPT = ModelSpec("gpt", 4, 128, 4, 512, max_position_embeddings=256)


@pytest.fixture(scope="module")
def gpt_rows():
    from megatron.training.memory_bench import predicted_vs_measured
    lengths = np.random.default_rng(3).integers(16, 257, size=24)
    with single_process_world(seed=1):
        return {mode: predicted_vs_measured(GPT, lengths, 256, 0, mode)
                for mode in ("none", "full")}


def test_measured_memory_follows_the_schedule_and_recompute(gpt_rows):
    none, full = gpt_rows["none"], gpt_rows["full"]
    assert all(r.measured_bytes > 0 for r in none + full)
    # under 1F1B rank 0 keeps two micro-batches in flight, the last rank one
    assert none[0].measured_bytes > none[1].measured_bytes
    # recomputing whole layers keeps far less from forward to backward
    assert full[0].measured_bytes < 0.8 * none[0].measured_bytes


def test_cost_model_predicts_activation_memory_without_recompute_within_20_percent(gpt_rows):
    for r in gpt_rows["none"]:
        assert r.ratio == pytest.approx(1.0, abs=0.2), (r.rank, r.predicted_bytes,
                                                        r.measured_bytes)


def test_the_table_flags_rows_outside_the_target():
    import sys
    sys.path.insert(0, "tools")
    from bench_memory import summary, table
    rows = [{"model": "gpt", "max_len": 256, "recompute": "none", "rank": 0,
             "predicted_mib": 10.0, "measured_mib": 9.5, "ratio": 10 / 9.5},
            {"model": "gpt", "max_len": 256, "recompute": "full", "rank": 0,
             "predicted_mib": 7.0, "measured_mib": 10.0, "ratio": 0.7}]
    lines = table(rows).splitlines()
    assert lines[2].endswith("| 1.05 |") and lines[3].endswith("| 0.70 * |")
    assert summary(rows) == pytest.approx({"none": 0.5 / 9.5, "full": 0.3})
