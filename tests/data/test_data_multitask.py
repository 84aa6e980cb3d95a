"""MultiTaskDataset: reading the preprocessed files, GPT and T5 views, truncation reports."""
import os

import numpy as np
import pytest

from megatron.data.flan_indexed import TABLE_FORMAT, FlanDatasetWriter, dataset_paths
from megatron.data.multitask_dataset import MultiTaskDataset, gpt_input_keep

EOD, BOS, EOS, PAD = 99, 98, 97, 96
# (input ids, target ids, task id)
SAMPLES = [
    ([1, 2, 3], [4, 5], 0),
    (list(range(10, 30)), [31], 1),          # long input, short target
    ([7], list(range(40, 60)), 0),           # short input, long target
    (list(range(60, 90)), list(range(1, 20)), 2),
]


def write_dataset(prefix, samples=SAMPLES, vocab_size=100):
    table = {"format": TABLE_FORMAT, "vocab_size": vocab_size, "num_samples": len(samples),
             "tokenizer": {"type": "test", "vocab_size": vocab_size, "eod": EOD, "bos": BOS,
                           "eos": EOS, "pad": PAD},
             "tasks": [{"id": t, "name": f"task{t}", "count": 0} for t in range(3)]}
    with FlanDatasetWriter(str(prefix), vocab_size) as writer:
        for inp, tgt, task in samples:
            writer.add(inp, tgt, task)
        writer.finalize(table, {})
    return str(prefix)


@pytest.fixture()
def ds(tmp_path):
    return MultiTaskDataset(write_dataset(tmp_path / "mt"))


def test_reads_ids_tasks_and_lengths(ds):
    assert len(ds) == 4 and ds.vocab_size == 100
    for i, (inp, tgt, task) in enumerate(SAMPLES):
        assert ds.input_ids(i).tolist() == inp and ds.target_ids(i).tolist() == tgt
        assert ds.input_ids(i).dtype == np.int64
        assert ds.task_id(i) == task
    assert ds.input_lengths.tolist() == [len(s[0]) for s in SAMPLES]
    assert ds.target_lengths.tolist() == [len(s[1]) for s in SAMPLES]
    assert ds.task_names == ["task0", "task1", "task2"]
    with pytest.raises(IndexError, match="sample 4 out of range"):
        ds.input_ids(4)


def test_gpt_sample_without_truncation_trains_on_target_and_eod(ds):
    s = ds.gpt_sample(0, seq_length=16)
    full = [1, 2, 3, 4, 5, EOD]
    assert s.tokens.tolist() == full[:-1] and s.labels.tolist() == full[1:]
    # labels 2, 3 are input tokens; 4, 5, EOD are trained on
    assert s.loss_mask.tolist() == [0, 0, 1, 1, 1]
    assert not s.truncated and s.task_id == 0
    assert ds.gpt_sample(0, 16, loss_on_all_tokens=True).loss_mask.tolist() == [1] * 5


def test_gpt_lengths_match_samples_and_never_exceed_seq_length(ds):
    for seq_length in (4, 8, 21, 64):
        lengths = ds.gpt_lengths(seq_length)
        for i in range(len(ds)):
            s = ds.gpt_sample(i, seq_length)
            assert len(s.tokens) == len(s.labels) == len(s.loss_mask) == lengths[i]
            assert lengths[i] <= seq_length


def test_gpt_truncation_cuts_the_input_first_and_keeps_target_loss(ds):
    s = ds.gpt_sample(1, seq_length=8)   # 20 input tokens, 1 target + eod
    assert s.truncated
    seq = np.concatenate([s.tokens, s.labels[-1:]]).tolist()
    assert seq[-2:] == [31, EOD] and seq[:-2] == list(range(10, 17))
    assert s.loss_mask.sum() == 2


def test_gpt_truncation_keeps_half_the_budget_for_a_long_input(ds):
    s = ds.gpt_sample(3, seq_length=9)   # 30 input, 19 target tokens; budget 10 tokens
    seq = np.concatenate([s.tokens, s.labels[-1:]]).tolist()
    assert seq[:5] == list(range(60, 65)) and seq[5:] == list(range(1, 6))
    assert s.loss_mask.tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 1]


@pytest.mark.parametrize("inp,tgt,seq", [(3, 2, 16), (20, 1, 8), (1, 20, 8), (30, 19, 9),
                                         (5, 5, 10), (1, 1, 1), (2, 50, 3)])
def test_gpt_input_keep_fills_the_budget(inp, tgt, seq):
    keep = gpt_input_keep(inp, tgt, seq)
    assert 1 <= keep <= inp
    assert min(inp + tgt + 1, seq + 1) == keep + min(tgt + 1, seq + 1 - keep)


def test_gpt_truncation_report_counts_per_task(ds):
    rep = ds.gpt_truncation(seq_length=20)
    # full lengths (input + target): 5, 21, 21, 49
    assert rep["truncated"] == 3 and rep["samples"] == 4
    assert rep["truncated_by_task"] == {"task0": 1, "task1": 1, "task2": 1}
    assert rep["dropped"]["tokens"] == 1 + 1 + 29


def test_loss_tokens_from_the_lengths_are_the_loss_masks_sums(tmp_path):
    """The planner's loss-token counts (from the lengths alone) are what the samples' loss
    masks add up to, truncated or not, zero-shot included."""
    ds = MultiTaskDataset(write_dataset(tmp_path / "lt", SAMPLES + [([], [4, 5, 6], 1),
                                                                   ([], [8], 2)]))
    for seq_length in (1, 2, 4, 8, 21, 64):
        counts = ds.gpt_loss_tokens(seq_length)
        assert counts.tolist() == [int(ds.gpt_sample(i, seq_length).loss_mask.sum())
                                   for i in range(len(ds))]
    for dec in (1, 3, 8, 32):
        counts = ds.t5_loss_tokens(dec)
        assert counts.tolist() == [int(ds.t5_sample(i, 8, dec).loss_mask.sum())
                                   for i in range(len(ds))]


def test_t5_view(ds):
    s = ds.t5_sample(0, encoder_seq_length=8, decoder_seq_length=8)
    assert s.encoder_ids.tolist() == [1, 2, 3]
    assert s.decoder_ids.tolist() == [BOS, 4, 5] and s.labels.tolist() == [4, 5, EOS]
    assert s.loss_mask.tolist() == [1, 1, 1] and not s.truncated
    cut = ds.t5_sample(3, encoder_seq_length=8, decoder_seq_length=4)
    assert cut.encoder_ids.tolist() == list(range(60, 68))
    assert cut.decoder_ids.tolist() == [BOS, 1, 2, 3] and cut.labels.tolist() == [1, 2, 3, 4]
    assert cut.truncated
    lengths = ds.t5_lengths(8, 4)
    assert lengths.shape == (4, 2)
    for i in range(len(ds)):
        t = ds.t5_sample(i, 8, 4)
        assert lengths[i].tolist() == [len(t.encoder_ids), len(t.decoder_ids)]


def test_empty_input_gpt_sees_the_target_only_and_t5_an_end_token(tmp_path):
    ds = MultiTaskDataset(write_dataset(tmp_path / "zs", SAMPLES + [([], [4, 5, 6], 1),
                                                                   ([], [8], 2)]))
    s = ds.gpt_sample(4, seq_length=16)
    assert s.tokens.tolist() == [4, 5, 6] and s.labels.tolist() == [5, 6, EOD]
    assert s.loss_mask.tolist() == [1, 1, 1] and not s.truncated
    one = ds.gpt_sample(5, seq_length=16)
    assert (one.tokens.tolist(), one.labels.tolist(), one.loss_mask.tolist()) == ([8], [EOD],
                                                                                  [1])
    assert ds.gpt_lengths(16)[4:].tolist() == [3, 1]
    t = ds.t5_sample(4, encoder_seq_length=8, decoder_seq_length=8)
    assert t.encoder_ids.tolist() == [EOS]
    assert t.decoder_ids.tolist() == [BOS, 4, 5, 6] and t.labels.tolist() == [4, 5, 6, EOS]
    assert ds.t5_lengths(8, 8)[4:].tolist() == [[1, 4], [1, 2]]


def test_t5_truncation_report_counts_each_side(ds):
    rep = ds.t5_truncation(encoder_seq_length=10, decoder_seq_length=5)
    assert rep["inputs_truncated"] == 2 and rep["targets_truncated"] == 2
    assert rep["truncated"] == 3
    assert rep["dropped"] == {"encoder_tokens": 10 + 20, "decoder_tokens": 16 + 15}


def test_vocab_check(ds):
    ds.check_vocab_size(128)
    with pytest.raises(ValueError, match="vocab size 100"):
        ds.check_vocab_size(64)


def test_missing_files_are_named(tmp_path):
    prefix = write_dataset(tmp_path / "mt")
    idx = dataset_paths(prefix)[1]["targets"] + ".idx"
    with open(idx, "r+b") as f:
        f.truncate(10)
    with pytest.raises(FileNotFoundError, match=f"{idx} has 10 bytes, the manifest says"):
        MultiTaskDataset(prefix)
    os.remove(idx)
    with pytest.raises(FileNotFoundError, match=f"damaged: {idx} is missing"):
        MultiTaskDataset(prefix)
    with pytest.raises(FileNotFoundError, match="nothing_tasks.json is missing.*preprocess_flan"):
        MultiTaskDataset(str(tmp_path / "nothing"))


def test_interrupted_write_leaves_no_dataset(tmp_path):
    prefix = str(tmp_path / "mt")
    with pytest.raises(RuntimeError):
        with FlanDatasetWriter(prefix, 100) as writer:
            writer.add([1], [2], 0)
            raise RuntimeError("killed")
    assert os.listdir(tmp_path) == []
    with pytest.raises(FileNotFoundError):
        MultiTaskDataset(prefix)


def test_out_of_range_ids_are_refused(tmp_path):
    with FlanDatasetWriter(str(tmp_path / "mt"), 100) as writer:
        with pytest.raises(ValueError, match="out of range"):
            writer.add([100], [1], 0)
