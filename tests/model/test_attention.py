"""SDPAttention: the same numbers as megatron-core's local DotProductAttention given the
equivalent dense mask (causal, key padding, cross-attention, packed segments), in forward and
backward, built from the micro-batch description alone; and the stage-level modes around it."""
import numpy as np
import pytest
import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from dynapipe_ext.batching.microbatch import MicroBatch
from dynapipe_ext.costs.model_spec import ModelSpec
from megatron.model.attention import (
    SEGMENT_GRANULE,
    AttentionMask,
    PositionBias,
    SDPAttention,
    Segments,
    flex_block_mask,
    length_groups,
    position_score_mod,
    sdpa_layer_spec,
    segment_bucket,
)
from megatron.model.batch_tensors import build_micro_batch
from megatron.model.init_weights import initialize_stage_weights
from megatron.model.stages import (
    HAVE_TE,
    build_rank_stages,
    build_transformer_config,
    layer_spec,
    run_stage_forward,
)
from tests.multiproc import single_process_world

HEADS, DIM = 4, 8
SPEC = ModelSpec("gpt", 2, HEADS * DIM, HEADS, 64, max_position_embeddings=64)


@pytest.fixture(scope="module")
def world():
    torch.set_num_threads(1)
    with single_process_world(seed=7):
        yield


def core(cls, mask_type):
    return cls(build_transformer_config(SPEC), layer_number=1, attn_mask_type=mask_type,
               attention_type="self")


def dense_mask(q: Segments, k: Segments, causal: bool) -> torch.Tensor:
    """The megatron-style mask (True = masked out) the layout stands for; pad queries see
    every key so no row is fully masked (their outputs are not compared)."""
    qi, ki = q.ids[:, :, None], k.ids[:, None, :]
    allowed = (qi == ki) & (ki > 0)
    if causal:
        allowed &= torch.ones(q.seq_len, k.seq_len, dtype=torch.bool).tril()
    allowed |= qi == 0
    return ~allowed[:, None]


def compare(q_lengths, k_lengths, sq, sk, causal, backend="flex", gqa=1, device="cpu",
            tol=(1e-5, 1e-5, 1e-4, 1e-5)):
    """Forward and backward of SDPAttention vs DotProductAttention on random q/k/v; only real
    query positions carry output gradient (pad outputs are don't-care)."""
    q_seg, k_seg = Segments.from_lengths(q_lengths, sq), Segments.from_lengths(k_lengths, sk)
    rows = len(q_lengths)
    gen = torch.Generator().manual_seed(sq * 31 + sk)
    q = torch.randn(sq, rows, HEADS, DIM, generator=gen).to(device)
    k = torch.randn(sk, rows, HEADS // gqa, DIM, generator=gen).to(device)
    v = torch.randn(sk, rows, HEADS // gqa, DIM, generator=gen).to(device)
    upstream = torch.randn(sq, rows, HEADS * DIM, generator=gen).to(device) \
        * (q_seg.ids.T > 0)[:, :, None].to(device)
    dense = dense_mask(q_seg, k_seg, causal).to(device)
    q_seg, k_seg = q_seg.to(device), (q_seg.to(device) if k_seg is q_seg else k_seg.to(device))
    mask_type = AttnMaskType.causal if causal else AttnMaskType.padding
    results = []
    for module, mask in ((core(DotProductAttention, mask_type), dense),
                         (core(SDPAttention, mask_type),
                          AttentionMask.of(q_seg, None if q_seg is k_seg else k_seg))):
        module.backend = backend
        if gqa > 1:
            module.num_query_groups_per_partition = HEADS // gqa
        xs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = module(*xs, mask)
        (out * upstream).sum().backward()
        results.append((out * (upstream != 0), [x.grad for x in xs]))
    (ref, ref_grads), (got, got_grads) = results
    torch.testing.assert_close(got, ref, rtol=tol[0], atol=tol[1])
    for name, g, r in zip("qkv", got_grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=tol[2], atol=tol[3], msg=name)


def test_gpt_causal_right_padded_rows(world):
    compare([(9,), (5,), (12,)], [(9,), (5,), (12,)], 12, 12, causal=True)


def test_t5_encoder_key_padding(world):
    compare([(7,), (3,)], [(7,), (3,)], 8, 8, causal=False)


def test_cross_attention_key_padding(world):
    compare([(4,), (6,)], [(7,), (3,)], 6, 9, causal=False)


@pytest.mark.parametrize("backend", ["sdpa", "dense-mask"])
@pytest.mark.parametrize("causal", [True, False])
def test_packed_segments(world, backend, causal):
    lengths = [(3, 5, 2), (4, 4), (10,)]
    compare(lengths, lengths, 12, 12, causal=causal, backend=backend)


@pytest.mark.parametrize("backend", ["sdpa", "dense-mask"])
def test_packed_cross_attention(world, backend):
    compare([(2, 3), (4, 1)], [(5, 2), (3, 6)], 6, 10, causal=False, backend=backend)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (FlexAttention path)")
@pytest.mark.parametrize("causal", [True, False])
def test_flex_document_attention_on_cuda(world, causal):
    # TF32 matmuls in the local path and FlexAttention's own kernels: GPU-level tolerance
    lengths = [(300, 500, 200), (400, 400, 100), (1000,)]
    compare(lengths, lengths, 1024, 1024, causal=causal, device="cuda",
            tol=(2e-3, 2e-3, 2e-3, 2e-3))
    compare([(3, 5, 2), (4, 4), (10,)], [(3, 5, 2), (4, 4), (10,)], 12, 12, causal=causal,
            device="cuda", tol=(2e-3, 2e-3, 2e-3, 2e-3))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (FlexAttention path)")
def test_flex_cross_attention_of_packed_streams_on_cuda(world):
    """T5's cross-attention of a packed decoder stream over its encoder stream (decoder sample
    i sees encoder sample i only) through FlexAttention, against the dense-mask reference."""
    compare([(50, 700, 9)], [(20, 90, 300)], 760, 410, causal=False, device="cuda",
            tol=(2e-3, 2e-3, 2e-3, 2e-3))
    compare([(129, 1), (60, 3)], [(5, 250), (300, 44)], 130, 350, causal=False,
            device="cuda", tol=(2e-3, 2e-3, 2e-3, 2e-3))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("q_lengths,k_lengths,sq,sk", [
    ([(300, 500, 200), (1000,)], [(300, 500, 200), (1000,)], 1024, 1024),
    ([(100, 28, 140, 3)], [(100, 28, 140, 3)], 300, 300),           # pad tail, partial block
    ([(50, 700), (129, 1)], [(20, 90), (5, 250)], 760, 260)])        # cross-attention shapes
def test_document_block_mask_from_lengths_equals_torch_from_the_mask(world, q_lengths,
                                                                     k_lengths, sq, sk, causal):
    """The FlexAttention block mask built from lengths on the host selects the same partial
    and full blocks as torch's create_block_mask evaluating the mask everywhere, and flex
    attention under it computes the dense-masked attention (eager, on CPU)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    if causal and q_lengths != k_lengths:
        pytest.skip("causal attention is self-attention")
    q_seg, k_seg = Segments.from_lengths(q_lengths, sq), Segments.from_lengths(k_lengths, sk)
    mask = AttentionMask(q_seg, k_seg)
    ours = flex_block_mask(mask, causal, "cpu")

    def document(b, h, q, k):
        seen = (q_seg.ids[b, q] == k_seg.ids[b, k]) & (k_seg.ids[b, k] > 0)
        return (seen & (q >= k)) if causal else seen

    theirs = create_block_mask(document, B=len(q_lengths), H=None, Q_LEN=sq, KV_LEN=sk,
                               device="cpu", _compile=False)
    assert torch.equal(ours.to_dense(), theirs.to_dense())
    for name in ("kv_num_blocks", "full_kv_num_blocks"):
        assert torch.equal(getattr(ours, name), getattr(theirs, name)), name
    gen = torch.Generator().manual_seed(sq + sk)
    q = torch.randn(len(q_lengths), 2, sq, 8, generator=gen)
    k, v = (torch.randn(len(q_lengths), 2, sk, 8, generator=gen) for _ in range(2))
    got = flex_attention(q, k, v, block_mask=ours)
    allowed = ~dense_mask(q_seg, k_seg, causal)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    real = (q_seg.ids > 0)[:, None, :, None].expand_as(got)
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)


def test_grouped_query_attention(world):
    compare([(3, 5), (8,)], [(3, 5), (8,)], 9, 9, causal=True, gqa=2)


def test_segments_of_equal_shape_run_together():
    mask = AttentionMask.of(Segments.from_lengths([(3, 5, 3), (5, 3)], 12))
    groups = length_groups(mask)
    assert groups == {(3, 3): ([0, 0, 1], [0, 8, 5], [0, 8, 5], [3, 3, 3], [3, 3, 3]),
                      (5, 5): ([0, 1], [3, 0], [3, 0], [5, 5], [5, 5])}
    # grouped by padded shape: 100 and 97 share 104, 40 stays apart
    bucketed = length_groups(AttentionMask.of(Segments.from_lengths([(100, 40, 97)], 240)),
                             segment_bucket)
    assert bucketed == {(104, 104): ([0, 0], [0, 140], [0, 140], [100, 97], [100, 97]),
                        (40, 40): ([0], [100], [100], [40], [40])}


def test_segment_buckets_pad_at_most_one_eighth_or_to_the_granule():
    for n in range(1, 5000):
        b = segment_bucket(n)
        assert n <= b <= max(n * 9 / 8, n + SEGMENT_GRANULE - 1) and b % SEGMENT_GRANULE == 0
    assert len({segment_bucket(n) for n in range(1025, 2049)}) == 8
    # short samples share a handful of shapes: 1-64 tokens run as 8 calls at most
    assert len({segment_bucket(n) for n in range(1, 65)}) == 8


def test_segment_groups_are_split_so_their_backward_is_one_concatenation(world):
    """Each of q, k and v is gathered once and split into its groups: a slice per group
    would give each group a zero gradient of the whole gathered tensor in backward (groups x
    tokens of work: 15-25% of one call's time on an 8192-token stream of 25 samples)."""
    mask = AttentionMask.of(Segments.from_lengths([(100, 40, 97, 7, 300, 12)], 600))
    assert len(length_groups(mask, segment_bucket)) == 5          # five segment shapes
    q, k, v = (torch.randn(600, 1, HEADS, DIM, requires_grad=True) for _ in range(3))
    out = core(SDPAttention, AttnMaskType.causal)(q, k, v, mask)
    names, seen, todo = [], set(), [out.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        todo += [nxt for nxt, _ in node.next_functions]
    assert names.count("SplitWithSizesBackward0") == 3
    assert not [n for n in names if n.startswith("SliceBackward")]
    assert len([n for n in names if n.startswith("ScaledDotProduct")]) == 5   # one per shape


@pytest.mark.parametrize("causal", [True, False])
def test_segments_padded_to_a_shared_shape_compute_each_sample_alone(world, causal):
    """Samples of 100 and 97 tokens run as one call padded to 104 (reading into the next
    sample and past the row's end): the same outputs and gradients as the dense mask."""
    compare([(100, 40, 97), (99, 5)], [(100, 40, 97), (99, 5)], 240, 240, causal=causal)
    if not causal:      # cross-attention: queries and keys of other lengths
        compare([(100, 40, 97), (99, 5)], [(30, 61, 58), (57, 9)], 240, 150, causal=False)


def test_layout_errors_are_clear():
    with pytest.raises(ValueError, match="do not fit 4"):
        Segments.from_lengths([(3, 2)], 4)
    with pytest.raises(ValueError, match="samples per row"):
        AttentionMask(Segments.from_lengths([(2, 2)], 4), Segments.from_lengths([(4,)], 4))


def test_layer_specs_use_sdpa_attention():
    from megatron.core.models.T5.t5_spec import decoder_model_with_local_spec
    base = decoder_model_with_local_spec()
    spec = sdpa_layer_spec(base, "dense-mask")
    for name in ("self_attention", "cross_attention"):
        core = getattr(spec.submodules, name).submodules.core_attention
        assert core.module is SDPAttention and core.params == {"backend": "dense-mask"}
    assert base.submodules.self_attention.submodules.core_attention is DotProductAttention
    core = layer_spec("enc_layer", use_te=False).submodules.self_attention.submodules \
        .core_attention
    assert core.module is SDPAttention and core.params == {"backend": "flex"}
    with pytest.raises(ValueError, match="attention backend must be one of"):
        SDPAttention(None, backend="zigzag")


# ------------------------------------------------------------------ whole stages

def random_samples(model, n, seed):
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(n):
        le, ld = int(rng.integers(2, 15)), int(rng.integers(1, 9))
        if model == "gpt":
            out[i] = (rng.integers(1, 60, le), rng.integers(1, 60, le), np.ones(le, np.float32))
        else:
            out[i] = (rng.integers(1, 60, le), rng.integers(1, 60, ld), rng.integers(1, 60, ld),
                      np.ones(ld, np.float32))
    return out


def loss_and_grads(spec, batch, backend="flex", recompute="none"):
    stages = build_rank_stages(spec, (0,), 0, build_transformer_config(spec),
                               attention_backend=backend)
    initialize_stage_weights(stages, 9)
    count = sum(isinstance(m, SDPAttention) and m.backend == backend
                for m in stages[0].modules())
    losses = run_stage_forward(stages[0], (), batch, recompute)
    (losses * batch["loss_mask"]).sum().backward()
    return losses.detach(), {n: p.grad.clone() for n, p in stages[0].named_parameters()}, count


def test_t5_relative_bias_of_a_packed_stream_equals_padded_rows(world):
    """T5 with relative position buckets: the same samples as one packed token stream (bias
    per segment) and one per row (the dense float-mask path) give the same per-token losses
    and gradients."""
    spec = ModelSpec("t5", 2, 32, 4, 64, num_decoder_layers=2, max_position_embeddings=64,
                     position_embedding_type="relative", relative_attention_num_buckets=8,
                     relative_attention_max_distance=16)
    # lengths past 16 share padded shapes (segment_bucket): 37 and 38 both run at 40
    rng = np.random.default_rng(3)
    enc, dec = [37, 38, 21, 5, 44, 19], [18, 17, 9, 3, 21, 2]
    samples = {i: (rng.integers(1, 60, e), rng.integers(1, 60, d), rng.integers(1, 60, d),
                   np.ones(d, np.float32)) for i, (e, d) in enumerate(zip(enc, dec))}
    padded = build_micro_batch(MicroBatch(tuple((i,) for i in range(6)), max(enc), max(dec)),
                               samples, "t5", 0)
    packed = build_micro_batch(MicroBatch((tuple(range(6)),), sum(enc), sum(dec)),
                               samples, "t5", 0)
    ref, ref_grads, _ = loss_and_grads(spec, padded)
    got, grads, _ = loss_and_grads(spec, packed)
    # per-token losses of the stream, in sample order, against each padded row's
    want = torch.cat([ref[i, :dec[i]] for i in range(6)])
    torch.testing.assert_close(got[0, :sum(dec)], want, rtol=1e-5, atol=1e-5)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)
    # the stream's bias covers the longest sample, not the stream's length squared
    from megatron.model.stages import _relative, _self_mask
    relative = _relative(build_transformer_config(spec), spec, bidirectional=True)
    assert _self_mask(packed["enc_segments"], relative).bias.n == segment_bucket(max(enc))


@pytest.mark.parametrize("model", ["gpt", "t5"])
def test_packed_modes_and_recompute_agree_on_a_whole_stage(world, model):
    spec = ModelSpec(model, 2, 32, 4, 64, num_decoder_layers=2 if model == "t5" else 0,
                     max_position_embeddings=64)
    samples = random_samples(model, 7, seed=1)
    mb = MicroBatch(rows=((0, 1, 2), (3, 4), (5, 6)), seq_len=40,
                    dec_seq_len=24 if model == "t5" else 0)
    batch = build_micro_batch(mb, samples, model, 0)
    ref, ref_grads, count = loss_and_grads(spec, batch, "dense-mask")
    # GPT: one self-attention per layer; T5: encoder self, decoder self + cross
    assert count == (2 if model == "gpt" else 2 + 2 * 2)
    real = batch["loss_mask"] > 0
    for mode, recompute in (("sdpa", "none"), ("sdpa", "selective"), ("sdpa", "full")):
        got, grads, _ = loss_and_grads(spec, batch, mode, recompute)
        torch.testing.assert_close(got[real], ref[real], rtol=1e-5, atol=1e-5)
        for name, grad in ref_grads.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-5,
                                       msg=f"{mode}/{recompute}: {name}")


@pytest.mark.skipif(not HAVE_TE, reason="TransformerEngine is not installed")
def test_transformer_engine_layers_train(world):
    spec = ModelSpec("gpt", 2, 32, 4, 64, max_position_embeddings=64)
    samples = random_samples("gpt", 3, seed=2)
    batch = build_micro_batch(MicroBatch(rows=((0, 1), (2,)), seq_len=30), samples, "gpt", 0)
    losses, grads, count = loss_and_grads(spec, batch)
    assert count == 2 and torch.isfinite(losses).all()
    assert all(torch.isfinite(g).all() for g in grads.values())


def test_bench_tool_times_both_builders_and_the_new_one_is_compact():
    from pathlib import Path

    from megatron.bench.tensor_bench import bench_tensors
    path = Path(__file__).resolve().parents[2] / "megatron" / "model" / "batch_tensors.py"
    rows = bench_tensors(str(path), repeats=1)
    assert [r["case"] for r in rows][:2] == ["GPT 4x2048", "GPT 1x8192"]
    for r in rows:
        assert r["before_ms"] > 0 and r["after_ms"] > 0
        assert r["after_bytes"] < 1 << 20          # O(rows x S): under 1 MiB at 8192


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fusions are on with CUDA only")
def test_fused_stage_on_cuda_matches_unfused(world):
    spec = ModelSpec("gpt", 2, 32, 4, 64, max_position_embeddings=64)
    samples = random_samples("gpt", 3, seed=2)
    batch = build_micro_batch(MicroBatch(rows=((0, 1), (2,)), seq_len=30), samples, "gpt", 0)
    batch = {k: v.to("cuda") for k, v in batch.items()}
    losses = []
    for fused in (False, True):
        config = build_transformer_config(spec, fused=fused)
        assert config.bias_activation_fusion is fused and config.bias_dropout_fusion is fused
        stages = build_rank_stages(spec, (0,), 0, config, device="cuda")
        initialize_stage_weights(stages, 9)
        losses.append(run_stage_forward(stages[0], (), batch).detach())
    # the fused GELU is the tanh approximation (as Megatron-LM trains), the unfused one erf
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("lengths,causal", [([(5,), (3,)], False), ([(2, 3), (4,)], False),
                                            ([(2, 3), (4,)], True), ([(6,), (1, 4)], True)])
def test_position_bias_is_added_per_sample_with_padding_and_packing(world, lengths, causal):
    """A mask with a bias (T5's relative positions): each real query's output is
    softmax(scale q.k + bias) v over the keys of its own sample (earlier ones when causal),
    the bias indexed by positions from the sample's start (packed rows: each segment's
    top-left block, not its place in the row); gradients reach the bias."""
    seg = Segments.from_lengths(lengths, 6)
    rows = len(lengths)
    q, k, v = (torch.randn(6, rows, HEADS, DIM, requires_grad=True) for _ in range(3))
    bias = torch.randn(1, HEADS, 6, 6, requires_grad=True)
    attn = core(SDPAttention, AttnMaskType.causal if causal else AttnMaskType.padding)
    out = attn(q, k, v, AttentionMask(seg, seg, bias=bias), None)
    out.sum().backward()
    assert bias.grad is not None and bias.grad.abs().sum() > 0
    scale = attn.effective_scale
    out = out.reshape(6, rows, HEADS, DIM)
    for r, row in enumerate(lengths):
        start = 0
        for n in row:
            span = slice(start, start + n)
            qs, ks, vs = (t[span, r].transpose(0, 1) for t in (q, k, v))   # [heads, n, dim]
            own = slice(0, n) if len(row) > 1 else span      # packed: from the sample's start
            scores = scale * qs @ ks.transpose(1, 2) + bias[0, :, own, own]
            if causal:
                scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(),
                                            float("-inf"))
            want = (scores.softmax(-1) @ vs).transpose(0, 1)
            torch.testing.assert_close(out[span, r], want, rtol=1e-5, atol=1e-5)
            start += n


# (row lengths, padded length): packed streams past one 128-token block, and padded rows
BIAS_LAYOUTS = [([(100, 60, 90), (250,)], 256), ([(3, 140, 37), (129, 1, 60)], 200),
                ([(200,), (130,)], 200)]


def biased_self_attention(lengths, seq_len, causal, seed, device="cpu"):
    """An SDPAttention module and a T5-style self-attention mask with a random PositionBias
    over the longest sample (packed streams) or the padded length (padded rows), as
    megatron.model.stages builds it; q/k/v [s, rows, heads, dim]."""
    seg = Segments.from_lengths(lengths, seq_len)
    n = segment_bucket(max(map(max, lengths))) if seg.packed else seq_len
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(HEADS, 2 * n - 1, generator=gen)
    qkv = [torch.randn(seq_len, len(lengths), HEADS, DIM, generator=gen) for _ in range(3)]
    attn = core(SDPAttention, AttnMaskType.causal if causal else AttnMaskType.padding)
    return attn.to(device), seg.to(device), values.to(device), [t.to(device) for t in qkv]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("lengths,seq_len", BIAS_LAYOUTS)
def test_position_bias_as_a_flex_score_mod_equals_the_cpu_path(world, lengths, seq_len, causal):
    """The CUDA path of a biased mask, FlexAttention with position_score_mod over the block
    mask built from lengths, gives the CPU path's output (per-segment groups, or the dense
    float mask of padded rows) at every real query. Eager and forward only: torch's CPU
    FlexAttention has no backward, and its compiler rejects a score_mod that reads a table
    (gradients and the compiled kernel: the CUDA tests below)."""
    from torch.nn.attention.flex_attention import flex_attention
    attn, seg, values, (q, k, v) = biased_self_attention(lengths, seq_len, causal, seed=seq_len)
    bias = PositionBias(values, values.shape[1] // 2 + 1)
    mask = AttentionMask(seg, seg, bias=bias)
    with torch.no_grad():
        want = attn(q, k, v, mask).view(seq_len, len(lengths), HEADS, DIM)
        got = flex_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)),
                             score_mod=position_score_mod(bias),
                             block_mask=flex_block_mask(mask, causal, "cpu"),
                             scale=attn.effective_scale).permute(2, 0, 1, 3)
    real = seg.ids.T > 0
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)
    # the bias is really there: without it the outputs differ
    with torch.no_grad():
        plain = flex_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)),
                               block_mask=flex_block_mask(mask, causal, "cpu"),
                               scale=attn.effective_scale).permute(2, 0, 1, 3)
    assert (plain[real] - want[real]).abs().max() > 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (FlexAttention path)")
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("lengths,seq_len", BIAS_LAYOUTS)
def test_flex_position_bias_on_cuda(world, lengths, seq_len, causal):
    """On CUDA a biased self-attention runs FlexAttention (score_mod + block mask) and gives
    the CPU path's outputs and gradients, the bias table's included."""
    results = []
    for device in ("cpu", "cuda"):
        attn, seg, values, qkv = biased_self_attention(lengths, seq_len, causal, seed=seq_len,
                                                       device=device)
        values.requires_grad_()
        xs = [t.clone().requires_grad_() for t in qkv]
        mask = AttentionMask(seg, seg, bias=PositionBias(values, values.shape[1] // 2 + 1))
        out = attn(*xs, mask)
        real = (seg.ids.T > 0)[:, :, None]
        (out * real).square().sum().backward()
        assert (("flex", causal, values.device, id(seg)) in seg.cache) == (device == "cuda")
        results.append([(out * real).cpu()] + [t.grad.cpu() for t in xs + [values]])
    for name, got, want in zip(("out", "q", "k", "v", "bias"), results[1], results[0]):
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (FlexAttention path)")
def test_flex_position_bias_compiles_no_more_after_warm_up(world):
    """New stream lengths and a new longest sample (a new bias table size) reuse the compiled
    FlexAttention: after the first layouts of each kind, no further graphs."""
    from torch._dynamo.utils import counters
    rng = np.random.default_rng(0)

    def step(causal):
        lengths = [tuple(int(x) for x in rng.integers(20, 300, rng.integers(1, 5)))]
        seq_len = -(-sum(lengths[0]) // 128) * 128
        attn, seg, values, qkv = biased_self_attention(lengths, seq_len, causal,
                                                       seed=int(rng.integers(1 << 30)),
                                                       device="cuda")
        values.requires_grad_()
        xs = [t.requires_grad_() for t in qkv]
        mask = AttentionMask(seg, seg, bias=PositionBias(values, values.shape[1] // 2 + 1))
        attn(*xs, mask).float().sum().backward()

    for _ in range(3):
        step(True), step(False)
    graphs = counters["stats"]["unique_graphs"]
    for _ in range(6):
        step(True), step(False)
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device is visible")
def test_padded_rows_on_cuda_use_no_per_shape_cudnn_graph(world):
    """Dynamic micro-batches bring a new shape almost every time; SDPAttention puts flash and
    memory-efficient attention before cuDNN, whose kernel builds a graph per shape (measured
    ~100 ms of host time each on an H100)."""
    from torch.profiler import ProfilerActivity, profile
    module = core(SDPAttention, AttnMaskType.causal).cuda().to(torch.bfloat16)
    seg = Segments.from_lengths([[40], [33], [17]], 40).to("cuda")
    q, k, v = (torch.randn(40, 3, HEADS, DIM, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        module(q, k, v, AttentionMask.of(seg)).float().sum().backward()
        torch.cuda.synchronize()
    names = [e.key for e in prof.key_averages()]
    assert not [n for n in names if "cudnn" in n.lower()], names
    assert [n for n in names if "flash" in n.lower() or "efficient" in n.lower()], names
