"""Micro-batch tensors: padding, packed rows (segments, per-sample positions), T5; every tensor
O(rows x seq), never an S x S mask."""
import numpy as np
import pytest

from dynapipe_ext.batching.microbatch import MicroBatch
from megatron.model.attention import Segments
from megatron.model.batch_tensors import (
    build_micro_batch,
    count_loss_tokens,
    unsplit_micro_batch,
)

PAD = 0


def gpt_sample(n, start):
    tokens = np.arange(start, start + n)
    return tokens, tokens + 1, np.ones(n, np.float32)


def t5_sample(ne, nd, start):
    dec = np.arange(start, start + nd)
    return np.arange(start, start + ne), dec, dec + 1, np.ones(nd, np.float32)


def compact(batch, rows, seq_lens):
    """Every entry is O(rows x seq): [rows, seq] tensors and Segments, never a [.., S, S] mask."""
    for key, value in batch.items():
        tensor = value.ids if isinstance(value, Segments) else value
        assert tensor.dim() == 2 and tensor.shape[0] == rows, (key, tuple(tensor.shape))
        assert tensor.shape[1] in seq_lens, (key, tuple(tensor.shape))


def test_padded_rows_are_one_segment_each():
    samples = {0: gpt_sample(3, 10), 1: gpt_sample(5, 20)}
    b = build_micro_batch(MicroBatch(rows=((0,), (1,)), seq_len=5), samples, "gpt", PAD)
    compact(b, 2, {5})
    assert b["tokens"][0].tolist() == [10, 11, 12, PAD, PAD]
    assert b["loss_mask"][0].tolist() == [1, 1, 1, 0, 0]
    assert b["position_ids"][0].tolist() == [0, 1, 2, 0, 0]
    seg = b["segments"]
    assert seg.lengths == ((3,), (5,)) and seg.padded and not seg.packed
    assert seg.ids.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]


def test_packed_row_has_segments_and_restarted_positions():
    samples = {0: gpt_sample(2, 10), 1: gpt_sample(3, 20)}
    b = build_micro_batch(MicroBatch(rows=((0, 1),), seq_len=6), samples, "gpt", PAD)
    compact(b, 1, {6})
    assert b["tokens"][0].tolist() == [10, 11, 20, 21, 22, PAD]
    assert b["labels"][0].tolist()[:5] == [11, 12, 21, 22, 23]
    assert b["position_ids"][0].tolist() == [0, 1, 0, 1, 2, 0]
    assert b["segments"].lengths == ((2, 3),) and b["segments"].packed
    assert b["segments"].ids[0].tolist() == [1, 1, 2, 2, 2, 0]


def test_t5_segments_per_side():
    samples = {0: t5_sample(2, 1, 10), 1: t5_sample(3, 2, 20)}
    b = build_micro_batch(MicroBatch(rows=((0, 1),), seq_len=6, dec_seq_len=4),
                          samples, "t5", PAD)
    compact(b, 1, {6, 4})
    assert b["enc_segments"].ids[0].tolist() == [1, 1, 2, 2, 2, 0]
    assert b["dec_segments"].ids[0].tolist() == [1, 2, 2, 0]
    assert b["dec_position_ids"][0].tolist() == [0, 0, 1, 0]
    assert b["enc_position_ids"][0].tolist() == [0, 1, 0, 1, 2, 0]
    assert b["loss_mask"][0].tolist() == [1, 1, 1, 0]


@pytest.mark.parametrize("model", ["gpt", "t5"])
@pytest.mark.parametrize("strategy", ["padding", "token-budget", "packing", "dynamic"])
def test_each_strategy_builds_compact_tensors_matching_its_samples(model, strategy):
    rng = np.random.default_rng(4)
    lens = rng.integers(1, 40, size=12)
    samples = {i: (gpt_sample(int(n), 100 * i) if model == "gpt"
                   else t5_sample(int(n), int(n) // 2 + 1, 100 * i)) for i, n in enumerate(lens)}
    order = sorted(samples, key=lambda i: lens[i])
    if strategy == "padding":            # fixed rows per micro-batch, padded to the max length
        mbs = [MicroBatch(rows=tuple((s,) for s in order[i:i + 4]), seq_len=40, dec_seq_len=21)
               for i in range(0, 12, 4)]
    elif strategy == "token-budget":     # sorted, padded to each micro-batch's longest
        mbs = [MicroBatch(rows=tuple((s,) for s in order[i:i + 6]),
                          seq_len=int(lens[order[i + 5]]), dec_seq_len=21)
               for i in (0, 6)]
    elif strategy == "packing":          # rows of several samples up to the max length
        rows, row, used = [], [], 0
        for s in order:
            if used + lens[s] > 64:
                rows.append(tuple(row))
                row, used = [], 0
            row.append(s)
            used += lens[s]
        rows.append(tuple(row))
        mbs = [MicroBatch(rows=tuple(rows), seq_len=64, dec_seq_len=64)]
    else:                                # dynamic: variable (rows, length) per micro-batch
        mbs = [MicroBatch(rows=tuple((s,) for s in order[:8]), seq_len=int(lens[order[7]]),
                          dec_seq_len=int(lens[order[7]]) // 2 + 1),
               MicroBatch(rows=tuple((s,) for s in order[8:]), seq_len=40, dec_seq_len=21)]
    if model == "gpt":
        mbs = [MicroBatch(rows=mb.rows, seq_len=mb.seq_len) for mb in mbs]
    for mb in mbs:
        b = build_micro_batch(mb, samples, model, PAD)
        seq_lens = {mb.seq_len, mb.dec_seq_len}
        compact(b, len(mb.rows), seq_lens)
        tokens = b["tokens" if model == "gpt" else "enc_tokens"]
        segs = b["segments" if model == "gpt" else "enc_segments"]
        for r, row in enumerate(mb.rows):
            expected = np.concatenate([samples[s][0] for s in row])
            assert tokens[r, :len(expected)].tolist() == expected.tolist()
            assert segs.lengths[r] == tuple(len(samples[s][0]) for s in row)
            assert int((segs.ids[r] > 0).sum()) == len(expected)
        assert segs.packed == (strategy == "packing")


def test_only_the_requested_keys_are_built():
    samples = {0: gpt_sample(3, 10)}
    mb = MicroBatch(rows=((0,),), seq_len=4)
    assert sorted(build_micro_batch(mb, samples, "gpt", PAD, keys=("segments",))) == ["segments"]
    with pytest.raises(ValueError, match="unknown gpt batch keys"):
        build_micro_batch(mb, samples, "gpt", PAD, keys=("enc_tokens",))


def test_row_longer_than_padded_length_names_the_samples():
    samples = {3: gpt_sample(4, 1), 7: gpt_sample(4, 1)}
    with pytest.raises(ValueError, match=r"sample 3: 4, sample 7: 4"):
        build_micro_batch(MicroBatch(rows=((3, 7),), seq_len=6), samples, "gpt", PAD)


def test_missing_and_malformed_samples_are_errors():
    with pytest.raises(KeyError, match="5"):
        build_micro_batch(MicroBatch(rows=((5,),), seq_len=4), {}, "gpt", PAD)
    bad = {0: (np.arange(3), np.arange(2), np.ones(3))}
    with pytest.raises(ValueError, match="sample 0"):
        build_micro_batch(MicroBatch(rows=((0,),), seq_len=4), bad, "gpt", PAD)


def test_unsplit_micro_batch_and_loss_tokens():
    samples = {0: t5_sample(4, 2, 1), 1: t5_sample(2, 5, 1)}
    mb = unsplit_micro_batch([0, 1], samples, "t5")
    assert (mb.rows, mb.seq_len, mb.dec_seq_len) == (((0,), (1,)), 4, 5)
    assert count_loss_tokens(samples, [0, 1]) == 7
