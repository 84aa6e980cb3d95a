"""Model FLOPs of real tokens and of what a micro-batch computes (dynapipe_ext/batching/model_flops.py),
checked against the formulas written out by hand."""
import pytest

from dynapipe_ext.batching.microbatch import MicroBatch
from dynapipe_ext.batching.model_flops import computed_flops, real_flops
from dynapipe_ext.costs.model_spec import ModelSpec

GPT = ModelSpec(model="gpt", num_layers=2, hidden_size=64, num_attention_heads=4,
                vocab_size=512)
T5 = ModelSpec(model="t5", num_layers=1, num_decoder_layers=1, hidden_size=64,
               num_attention_heads=4, vocab_size=512)
H, F, V = 64, 256, 512


def gpt_by_hand(n: int) -> float:
    linear = 2 * n * (4 * H * H + 2 * H * F)        # QKV + out projection + MLP
    attention = 4 * H * n * (n + 1) / 2            # scores and values over causal pairs
    head = 2 * n * H * V
    return 3 * (2 * (linear + attention) + head)   # forward + backward, 2 layers


def t5_by_hand(e: int, d: int) -> float:
    encoder = 2 * e * (4 * H * H + 2 * H * F) + 4 * H * e * e
    decoder = (2 * d * (4 * H * H + 2 * H * F)     # self-attention linears and MLP
               + 2 * d * 2 * H * H + 2 * e * 2 * H * H   # cross Q and output; K and V
               + 4 * H * d * (d + 1) / 2 + 4 * H * d * e)
    return 3 * (encoder + decoder + 2 * d * H * V)


def test_real_flops_follow_the_formulas():
    assert real_flops(GPT, [100]) == pytest.approx(gpt_by_hand(100))
    assert real_flops(GPT, [100, 30]) == pytest.approx(gpt_by_hand(100) + gpt_by_hand(30))
    assert real_flops(T5, [[80, 20], [10, 5]]) == pytest.approx(t5_by_hand(80, 20)
                                                                + t5_by_hand(10, 5))


def test_gated_mlp_counts_three_matrices():
    gated = ModelSpec(model="gpt", num_layers=2, hidden_size=64, num_attention_heads=4,
                      vocab_size=512, gated_linear_unit=True)
    extra = 3 * 2 * 2 * 100 * H * F     # one more h x f matrix, 2 layers, training
    assert real_flops(gated, [100]) == pytest.approx(gpt_by_hand(100) + extra)


def test_a_full_row_computes_its_real_flops_and_padding_adds_work():
    lengths = [100, 60]
    full = MicroBatch(rows=((0,),), seq_len=100)
    assert computed_flops(GPT, full, lengths) == pytest.approx(real_flops(GPT, [100]))
    padded = MicroBatch(rows=((0,), (1,)), seq_len=100)
    assert computed_flops(GPT, padded, lengths) == pytest.approx(2 * gpt_by_hand(100))
    assert computed_flops(GPT, padded, lengths) > real_flops(GPT, lengths)


def test_packed_rows_per_segment_or_with_a_dense_mask():
    lengths = [100, 60]
    packed = MicroBatch(rows=((0, 1),), seq_len=200)
    by_segment = computed_flops(GPT, packed, lengths, "segments")
    dense = computed_flops(GPT, packed, lengths, "mask")
    # linear and head work over all 200 slots; attention only within the samples ...
    pad_linear = 3 * (2 * 2 * 40 * (4 * H * H + 2 * H * F) + 2 * 40 * H * V)
    assert by_segment == pytest.approx(real_flops(GPT, lengths) + pad_linear)
    # ... or over every pair of the row
    segment_pairs = 100 * 101 / 2 + 60 * 61 / 2
    assert dense - by_segment == pytest.approx(3 * 2 * 4 * H * (200 * 200 - segment_pairs))
    with pytest.raises(ValueError, match="packed_attention"):
        computed_flops(GPT, packed, lengths, "flash")


def test_t5_padding_counts_both_sides():
    lengths = [[80, 20], [40, 10]]
    mb = MicroBatch(rows=((0,), (1,)), seq_len=80, dec_seq_len=20)
    assert computed_flops(T5, mb, lengths) == pytest.approx(2 * t5_by_hand(80, 20))
