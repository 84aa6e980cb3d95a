"""Throughput benchmark: the harness runs real training iterations whose counted tokens are those
of the samples it consumed (the attention modes it compares are tested in test_attention.py)."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

torch.set_num_threads(1)


def run_tool(*args, timeout=120):
    """tools/<args[0]> with the rest of `args`, as a command; fails the test on a non-zero exit."""
    subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, check=True, timeout=timeout)


# ------------------------------------------------------------------ the harness

def test_speedups_are_taken_within_one_model_and_length():
    from dynapipe_ext.report.throughput import add_ratios
    rows = [{"model": "gpt", "max_len": 512, "strategy": "packing", "tokens_per_s": 100.0},
            {"model": "gpt", "max_len": 512, "strategy": "dynamic", "tokens_per_s": 250.0},
            {"model": "gpt", "max_len": 1024, "strategy": "packing", "tokens_per_s": 50.0},
            {"model": "gpt", "max_len": 1024, "strategy": "dynamic", "tokens_per_s": 200.0},
            {"model": "t5", "max_len": 512, "strategy": "dynamic", "tokens_per_s": 9.0}]
    add_ratios(rows)
    assert [r.get("speedup_vs_packing") for r in rows] == [1.0, 2.5, 1.0, 4.0, None]


def test_the_table_compares_with_the_fastest_packing_row():
    from dynapipe_ext.report.throughput import add_ratios, ratio_text
    rows = [{"model": "gpt", "max_len": 512, "strategy": "packing", "tokens_per_s": 100.0},
            {"model": "gpt", "max_len": 512, "strategy": "packing+segment-attn",
             "tokens_per_s": 200.0},
            {"model": "gpt", "max_len": 512, "strategy": "dynamic", "tokens_per_s": 250.0},
            {"model": "gpt", "max_len": 1024, "strategy": "packing+segment-attn",
             "tokens_per_s": 80.0},
            {"model": "gpt", "max_len": 1024, "strategy": "dynamic", "tokens_per_s": 60.0}]
    add_ratios(rows)
    assert [r.get("speedup_vs_best_packing") for r in rows] == [0.5, 1.0, 1.25, 1.0, 0.75]
    assert rows[2]["speedup_vs_packing"] == 2.5 and "speedup_vs_packing" not in rows[4]
    assert ratio_text(rows[2]) == "1.25x (packing+segment-attn)"
    assert ratio_text(rows[3]) == "1.00x"
    assert ratio_text({"strategy": "dynamic"}) == "n/a (no packing row)"


def test_the_waitless_ceiling_is_the_baseline_time_over_the_busiest_ranks_compute():
    """Packing takes 2 s per iteration; dynamic's busiest rank computes 1.6 s of every
    iteration (rank 1 here), so even with no waits dynamic could be at most 1.25x faster."""
    from dynapipe_ext.report.throughput import (busiest_rank_compute_s, padding_free_lines,
                                                waitless_ceilings)
    parts = [{"forward": 2.0, "backward": 4.0, "transfer_wait": 3.0},
             {"forward": 3.0, "backward": 5.0, "transfer_wait": 1.0}]
    rows = [{"model": "gpt", "max_len": 2048, "strategy": "packing+segment-attn",
             "tokens_per_s": 100.0, "elapsed_s": 10.0, "iterations": 5},
            {"model": "gpt", "max_len": 2048, "strategy": "dynamic", "tokens_per_s": 110.0,
             "elapsed_s": 9.0, "iterations": 5, "time_parts_per_rank": parts}]
    assert busiest_rank_compute_s(rows[1]) == pytest.approx(1.6)
    assert busiest_rank_compute_s(rows[0]) is None
    assert waitless_ceilings(rows, "gpt") == [(2048, pytest.approx(1.25))]
    assert waitless_ceilings(rows, "t5") == []
    assert any("2048: 1.25x; geometric mean 1.25x" in line
               for line in padding_free_lines(rows, "gpt"))


def test_ratios_are_also_taken_round_by_round():
    """Rounds interleave the strategies, so a slow spell hits both sides of a round's ratio:
    round 0 is slow for both (ratio 1.2), round 1 fast for both (ratio 0.9), round 2 in
    between (1.0). Round by round the median is 1.0x and the spread 0.9-1.2; one round alone
    gives no spread and no line."""
    from dynapipe_ext.report.throughput import merge_rounds, padding_free_lines, per_round_ratios
    raw = [{"model": "gpt", "max_len": 2048, "strategy": s, "tokens_per_s": t, "round": k}
           for k, (pack, dyn) in enumerate([(50.0, 60.0), (200.0, 180.0), (100.0, 100.0)])
           for s, t in (("packing+segment-attn", pack), ("dynamic", dyn))]
    rows = merge_rounds(raw)
    assert per_round_ratios(rows, "gpt") == [(2048, pytest.approx([1.2, 0.9, 1.0]))]
    assert per_round_ratios(merge_rounds(raw[:2]), "gpt") == []       # one round: no spread
    assert per_round_ratios(rows, "t5") == []
    assert any("round by round, median (min-max): 2048: 1.00x (0.90-1.20)" in line
               for line in padding_free_lines(rows, "gpt"))


def test_llama_rows_train_a_llama_style_gpt(tmp_path):
    """--models llama: the GPT trainer with rotary positions, SwiGLU, grouped-query attention,
    RMSNorm, no biases and an untied head, the same data flags as the GPT rows."""
    import tools.bench_throughput as bench
    from megatron.training.arguments import parse_args
    from megatron.training.training import model_spec
    job = {"model": "llama", "max_len": 256, "num_layers": 2, "hidden_size": 96,
           "num_attention_heads": 4, "max_position_embeddings": 256, "pp": 2, "tp": 1,
           "tokens_per_global_batch": 1024, "packing_algorithm": "nextfit",
           "window_packing_algorithm": "nextfit", "pipeline_schedule": "auto",
           "warmup_iters": 1, "iters": 1, "seed": 1, "data_path": "d", "timeout_minutes": 2,
           "packing_window": 0, "tokenizer_model": str(tmp_path / "sp.model")}
    (tmp_path / "sp.model").write_bytes(b"")
    flags = bench.train_flags(job, "dynamic")
    assert bench.trainer_model("llama") == "gpt"
    gpt = dict(job, model="gpt")
    assert set(bench.train_flags(gpt, "dynamic")) < set(flags)
    spec = model_spec(parse_args("gpt", flags, has_cuda=False), 600)
    assert spec.position_embedding_type == "rope" and spec.swiglu and spec.gated_mlp
    assert (spec.query_groups, spec.normalization, spec.add_bias_linear) == (2, "RMSNorm", False)
    assert not spec.tied_embeddings and spec.ffn_size == 256


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_data")
    run_tool("tools/make_flan_sample.py", "--output", out / "flan.jsonl", "--num-samples", "300",
             "--seed", "5")
    run_tool("tools/train_tokenizer.py", "--input", out / "flan.jsonl", "--model-prefix",
             out / "sp", "--vocab-size", "600")
    run_tool("tools/preprocess_flan.py", "--input", out / "flan.jsonl", "--output-prefix",
             out / "flan", "--tokenizer-type", "SentencePieceTokenizer",
             "--tokenizer-model", out / "sp.model", "--no-progress")
    return out


def gpt_tokens_from_files(prefix: str, ids, seq_length: int) -> int:
    """Model positions of GPT samples read straight from the indexed files:
    min(inputs + targets, seq_length) per sample (the trailing EOD is only a label)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.data.flan_indexed import dataset_paths
    paths = dataset_paths(prefix)[1]          # the files the manifest P_tasks.json names
    inputs_ds, targets_ds = IndexedDataset(paths["inputs"]), IndexedDataset(paths["targets"])
    inputs = np.array(inputs_ds.sequence_lengths, dtype=np.int64)   # copies: the index is an mmap
    targets = np.array(targets_ds.sequence_lengths, dtype=np.int64)
    return int(sum(min(int(inputs[i]) + int(targets[i]), seq_length) for i in ids))


@pytest.mark.slow
def test_harness_counts_exactly_the_tokens_of_the_samples_it_trained_on(tiny_data, tmp_path):
    out = tmp_path / "bench.json"
    run_tool("tools/bench_throughput.py", "--data-path", tiny_data / "flan",
             "--tokenizer-model", tiny_data / "sp.model", "--models", "gpt",
             "--max-lengths", "128", "--tokens-per-global-batch", "512",
             "--strategies", "packing+segment-attn", "packing+window", "dynamic",
             "--packing-window", "250", "--warmup-iters", "1", "--iters", "1", "--num-layers", "2",
             "--hidden-size", "32", "--num-attention-heads", "2", "--nproc", "2",
             "--pp", "2", "--device", "cpu", "--timeout-minutes", "4",
             "--work-dir", tmp_path / "work", "--output", out, timeout=600)
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [r["strategy"] for r in rows] == ["packing+segment-attn", "packing+window", "dynamic"]
    # provenance: what ran, where, when and under what load
    assert result["complete"] and result["groups_done"] == [["gpt", 128]]
    assert result["command"].startswith("python tools/bench_throughput.py --data-path ")
    assert len(result["commit"]) >= 7 and result["date"].endswith(" UTC")
    assert result["machine_fields"]["torch"] == torch.__version__
    assert result["machine_fields"]["logical_cpus"] >= 1
    assert len(result["load_average_before"]) == len(result["load_average_after"]) == 3
    for row in rows:
        assert "error" not in row, row.get("error")
        assert row["iterations"] == 1 and row["tokens_per_s"] > 0
        # the sampler's global batches, read back from the files, hold the counted tokens
        expected = sum(gpt_tokens_from_files(str(tiny_data / "flan"), ids, 128)
                       for ids in row["batch_ids"])
        assert row["real_tokens"] == expected
        # every sample of the batch was planned into exactly one micro-batch
        for ids, planned in zip(row["batch_ids"], row["sample_positions_planned"]):
            assert planned == list(range(len(ids)))
        assert 0 < row["padding_efficiency_enc"] <= 1
        assert all(p > 0 for p in row["peak_memory_bytes"])
        # MFU on the real tokens, and where the rest of the two ranks' time went
        assert row["sgemm_flops"] > 1e9 and 0 < row["mfu"] < 1
        assert row["computed_flops"] >= row["real_flops"] > 0
        shares = row["mfu_breakdown"]
        assert shares["mfu"] == row["mfu"] and sum(shares.values()) == pytest.approx(1.0)
        assert len(row["time_parts_per_rank"]) == 2
        assert all(p["forward"] > 0 and p["backward"] > 0 for p in row["time_parts_per_rank"])
    # the same global batches for every strategy but the one packed ahead, whose batches
    # are whole rows of its window
    assert rows[0]["batch_ids"] == rows[2]["batch_ids"] != rows[1]["batch_ids"]
    # both packing rows train the rows their packer made, the one chosen for the most real
    # tokens per slot (per batch; for the window, of the window packed ahead)
    for row, window in zip(rows[:2], (0, 250)):
        share = row["packer_real_per_slot"]
        assert row["packing_window"] == window and max(share, key=share.get) == \
            row["packing_algorithm"]
        assert row["padding_efficiency_enc"] == pytest.approx(share[row["packing_algorithm"]])
    # per-segment attention (--attention-backend auto on CPU) for both packings and for
    # dynamic's packed streams alike
    assert [row["attention_backend"] for row in rows] == ["sdpa", "sdpa", "sdpa"]
    assert all(row["compiles_in_timed_iterations"] == 0 for row in rows)
