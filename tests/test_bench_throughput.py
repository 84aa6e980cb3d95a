"""Throughput benchmark: per-segment attention computes what the dense masked attention computes,
and the harness runs real training iterations whose counted tokens are those of the samples
it consumed."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dynapipe_ext.microbatch import MicroBatch
from dynapipe_ext.model_spec import ModelSpec
from megatron.model.batch_tensors import build_micro_batch, segment_mask
from megatron.model.init_weights import initialize_stage_weights
from megatron.model.segment_attention import (CAUSAL, FULL, MASKED, SELF, SegmentAttention,
                                              install_segment_attention, mask_blocks,
                                              segment_attention_spec)
from megatron.model.stages import build_rank_stages, build_transformer_config
from multiproc import single_process_world

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

torch.set_num_threads(1)


def segments_of(lengths, total):
    """Per position: 1-based segment number, 0 for pad."""
    seg = np.zeros(total, dtype=np.int64)
    start = 0
    for i, n in enumerate(lengths, start=1):
        seg[start:start + n] = i
        start += n
    return seg


# ------------------------------------------------------------------ blocks read off masks

def test_causal_packed_row_gives_one_causal_block_per_sample_and_pads_see_themselves():
    lengths, total = [5, 3, 4], 15
    seg = segments_of(lengths, total)
    blocks = mask_blocks(segment_mask(seg, seg, causal=True))
    starts = np.cumsum([0] + lengths)
    expected = [(int(a), int(b), int(a), int(b), CAUSAL) for a, b in zip(starts, starts[1:])]
    assert [(b.q0, b.q1, b.k0, b.k1, b.kind) for b in blocks[:3]] == expected
    assert [(b.q0, b.q1, b.k0, b.k1, b.kind) for b in blocks[3:]] == [(12, 15, 12, 15, SELF)]


def test_bidirectional_and_cross_masks_give_full_blocks():
    enc, dec = segments_of([4, 6], 12), segments_of([2, 3], 6)
    enc_blocks = mask_blocks(segment_mask(enc, enc, causal=False))
    assert [(b.q0, b.q1, b.kind) for b in enc_blocks] == [(0, 4, FULL), (4, 10, FULL),
                                                         (10, 12, SELF)]
    cross = mask_blocks(segment_mask(dec, enc, causal=False))
    assert [(b.q0, b.q1, b.k0, b.k1) for b in cross[:2]] == [(0, 2, 0, 4), (2, 5, 4, 10)]
    # the pad query sees key 0 only
    assert (cross[2].q0, cross[2].q1, cross[2].k0, cross[2].k1) == (5, 6, 0, 1)


def test_non_block_mask_falls_back_to_one_dense_block():
    mask = np.zeros((6, 6), dtype=bool)
    mask[2, 1] = True                        # query 2 sees keys 0 and 2.. but not 1
    assert [b.kind for b in mask_blocks(mask)] == [MASKED]


# ------------------------------------------------------------------ numerics vs dense attention

@pytest.fixture(scope="module")
def world():
    with single_process_world(seed=3):
        yield


def random_samples(model, n, seed):
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(n):
        le, ld = int(rng.integers(2, 15)), int(rng.integers(1, 9))
        if model == "gpt":
            out[i] = (rng.integers(1, 90, le), rng.integers(1, 90, le), np.ones(le, np.float32))
        else:
            out[i] = (rng.integers(1, 90, le), rng.integers(1, 90, ld), rng.integers(1, 90, ld),
                      np.ones(ld, np.float32))
    return out


def loss_and_grads(spec, batch, segment: bool):
    stages = build_rank_stages(spec, (0,), 0, build_transformer_config(spec))
    initialize_stage_weights(stages, 9)
    replaced = install_segment_attention(stages[0]) if segment else 0
    losses = stages[0]((), batch)
    (losses * batch["loss_mask"]).sum().backward()
    return losses.detach(), {n: p.grad.clone() for n, p in stages[0].named_parameters()}, replaced


@pytest.mark.parametrize("model", ["gpt", "t5"])
def test_segment_attention_matches_dense_masked_attention(world, model):
    spec = ModelSpec(model, 2, 64, 4, 96, num_decoder_layers=2 if model == "t5" else 0,
                     max_position_embeddings=64)
    samples = random_samples(model, 7, seed=1)
    mb = MicroBatch(rows=((0, 1, 2), (3, 4), (5, 6)), seq_len=40,
                    dec_seq_len=24 if model == "t5" else 0)
    batch = build_micro_batch(mb, samples, model, 0)
    dense, dense_grads, _ = loss_and_grads(spec, batch, segment=False)
    seg, seg_grads, replaced = loss_and_grads(spec, batch, segment=True)
    # GPT: one self-attention per layer; T5: encoder self, decoder self + cross
    assert replaced == (2 if model == "gpt" else 2 + 2 * 2)
    torch.testing.assert_close(seg, dense, rtol=1e-5, atol=1e-5)
    for name, grad in dense_grads.items():
        torch.testing.assert_close(seg_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_segment_attention_spec_swaps_core_attention_only():
    from megatron.core.models.T5.t5_spec import decoder_model_with_local_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    base = decoder_model_with_local_spec()
    spec = segment_attention_spec(base)
    assert spec.submodules.self_attention.submodules.core_attention is SegmentAttention
    assert spec.submodules.cross_attention.submodules.core_attention is SegmentAttention
    assert base.submodules.self_attention.submodules.core_attention is DotProductAttention


# ------------------------------------------------------------------ the harness

def test_speedups_are_taken_within_one_model_and_length():
    from tools.bench_throughput import add_ratios
    rows = [{"model": "gpt", "max_len": 512, "strategy": "packing", "tokens_per_s": 100.0},
            {"model": "gpt", "max_len": 512, "strategy": "dynamic", "tokens_per_s": 250.0},
            {"model": "gpt", "max_len": 1024, "strategy": "packing", "tokens_per_s": 50.0},
            {"model": "gpt", "max_len": 1024, "strategy": "dynamic", "tokens_per_s": 200.0},
            {"model": "t5", "max_len": 512, "strategy": "dynamic", "tokens_per_s": 9.0}]
    add_ratios(rows)
    assert [r.get("speedup_vs_packing") for r in rows] == [1.0, 2.5, 1.0, 4.0, None]


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    from tools import make_flan_sample, preprocess_flan, train_tokenizer
    out = tmp_path_factory.mktemp("bench_data")
    assert make_flan_sample.main(["--output", str(out / "flan.jsonl"), "--num-samples", "300",
                                  "--seed", "5"]) == 0
    assert train_tokenizer.main(["--input", str(out / "flan.jsonl"), "--model-prefix",
                                 str(out / "sp"), "--vocab-size", "600"]) == 0
    assert preprocess_flan.main(["--input", str(out / "flan.jsonl"), "--output-prefix",
                                 str(out / "flan"), "--tokenizer-type", "SentencePieceTokenizer",
                                 "--tokenizer-model", str(out / "sp.model"),
                                 "--no-progress"]) == 0
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
    from tools.bench_throughput import main
    out = tmp_path / "bench.json"
    assert main(["--data-path", str(tiny_data / "flan"),
                 "--tokenizer-model", str(tiny_data / "sp.model"), "--models", "gpt",
                 "--max-lengths", "128", "--tokens-per-global-batch", "512",
                 "--strategies", "packing+segment-attn", "dynamic",
                 "--warmup-iters", "1", "--iters", "1", "--num-layers", "2",
                 "--hidden-size", "32", "--num-attention-heads", "2", "--nproc", "2",
                 "--pp", "2", "--device", "cpu", "--timeout-minutes", "4",
                 "--work-dir", str(tmp_path / "work"), "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [r["strategy"] for r in rows] == ["packing+segment-attn", "dynamic"]
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
    # the same global batches for every strategy
    assert rows[0]["batch_ids"] == rows[1]["batch_ids"]
    assert rows[0]["segment_attention_modules"] == 1       # one GPT layer on rank 0's stage
    assert rows[1]["segment_attention_modules"] == 0
