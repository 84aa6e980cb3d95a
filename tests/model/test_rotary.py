"""Rotary positions (--position-embedding-type rope): the queries and keys every attention path
receives are those transformers' Llama rotates, Llama 3.1 frequency scaling included, at each
token's position inside its own sample, in packed streams and padded rows alike."""

import dataclasses

import numpy as np
import pytest
import torch

from dynapipe_ext.batching.microbatch import MicroBatch
from dynapipe_ext.costs.model_spec import ModelSpec
from megatron.model.batch_tensors import build_micro_batch
from megatron.model.init_weights import initialize_stage_weights
from megatron.model.stages import build_rank_stages, build_transformer_config, run_stage_forward
from tests.multiproc import single_process_world

# head size 8, base 10000: wavelengths 6.3, 63, 628, 6283 tokens; with an original context of
# 64 and Llama 3.1's factors 1 and 4 the first is kept, the second smoothed, the others scaled
LLAMA = ModelSpec("gpt", 2, 32, 4, 64, max_position_embeddings=128, normalization="RMSNorm",
                  add_bias_linear=False, swiglu=True, ffn_hidden_size=48,
                  position_embedding_type="rope", use_rope_scaling=True,
                  rope_scaling_original_max_position_embeddings=64, num_query_groups=2)


@pytest.fixture(scope="module")
def world():
    torch.set_num_threads(1)
    with single_process_world(seed=5):
        yield


def hf_rotated(spec: ModelSpec, q, k, positions):
    """transformers' Llama rotation of q, k [s, b, heads, dim] at positions [b, s]."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
    rope = {"rope_type": "default", "rope_theta": spec.rotary_base}
    if spec.use_rope_scaling:
        rope.update(rope_type="llama3", factor=spec.rope_scaling_factor,
                    low_freq_factor=spec.rope_scaling_low_freq_factor,
                    high_freq_factor=spec.rope_scaling_high_freq_factor,
                    original_max_position_embeddings=(
                        spec.rope_scaling_original_max_position_embeddings))
    config = LlamaConfig(hidden_size=spec.hidden_size, num_attention_heads=spec.num_attention_heads,
                         num_key_value_heads=spec.query_groups,
                         max_position_embeddings=spec.max_position_embeddings,
                         rope_parameters=rope)
    bhsd = [t.permute(1, 2, 0, 3) for t in (q, k)]
    cos, sin = LlamaRotaryEmbedding(config)(bhsd[0], positions)
    return [t.permute(2, 0, 1, 3) for t in apply_rotary_pos_emb(*bhsd, cos, sin)]


def attention_inputs(spec, batch, recompute="none"):
    """(pre-rotation q, k of layer 0; the q, k its core attention received), one forward of
    the whole model on `batch` under `recompute`."""
    stage = build_rank_stages(spec, (0,), 0, build_transformer_config(spec))[0]
    initialize_stage_weights({0: stage}, 3)
    attention = stage.decoder.layers[0].self_attention
    seen = []
    attention.core_attention.register_forward_pre_hook(
        lambda module, args: seen.append(args[:2]))
    hidden = stage.embedding(batch["tokens"], batch["position_ids"])
    norm = stage.decoder.layers[0].input_layernorm(hidden)
    q, k, _ = attention.get_query_key_value_tensors(norm)
    losses = run_stage_forward(stage, (), batch, recompute)
    if recompute != "none":
        losses.sum().backward()      # the recomputed forward rotates alike
    return (q.detach(), k.detach()), seen


@pytest.mark.parametrize("rows, recompute", [
    (((0, 1, 2),), "none"),           # one packed stream
    (((0, 1), (2,)), "selective"),    # packed rows of different depths
    (((0,), (1,), (2,)), "full"),     # one sample per row, right-padded
])
def test_queries_and_keys_turn_by_position_inside_each_sample(world, rows, recompute):
    lengths = (13, 7, 20)
    rng = np.random.default_rng(0)
    samples = {i: (rng.integers(1, 64, n), rng.integers(1, 64, n), np.ones(n, np.float32))
               for i, n in enumerate(lengths)}
    seq = max(sum(lengths[s] for s in row) for row in rows) + 3
    batch = build_micro_batch(MicroBatch(rows=rows, seq_len=seq), samples, "gpt", 0)
    (q, k), seen = attention_inputs(LLAMA, batch, recompute)
    expected = hf_rotated(LLAMA, q, k, batch["position_ids"])
    assert len(seen) == (2 if recompute == "full" else 1)     # full: replayed in backward
    for got in seen:
        for mine, theirs in zip(got, expected):
            torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-6)
    # positions counted along the stream instead would turn every later sample otherwise
    stream = torch.arange(seq).expand(len(rows), seq)
    if any(len(row) > 1 for row in rows):
        assert not torch.allclose(hf_rotated(LLAMA, q, k, stream)[0], seen[0][0], atol=1e-3)


def test_rope_scaling_and_percent_change_the_rotation(world):
    """Every rotary option reaches the angles: scaling, its factors, base and percent."""
    from megatron.model.stages import RotaryPositions
    positions = torch.arange(40)[None]
    base = RotaryPositions(LLAMA)(positions)
    assert base.shape == (40, 1, 1, 8)
    unscaled = dict(use_rope_scaling=False, rope_scaling_original_max_position_embeddings=8192)
    for change in (unscaled, dict(rope_scaling_factor=4.0),
                   dict(rope_scaling_low_freq_factor=2.0),
                   dict(rope_scaling_high_freq_factor=8.0),
                   dict(rope_scaling_original_max_position_embeddings=32),
                   dict(rotary_base=500000.0)):
        other = RotaryPositions(dataclasses.replace(LLAMA, **change))(positions)
        assert not torch.equal(other, base), change
    half = RotaryPositions(dataclasses.replace(LLAMA, rotary_percent=0.5))(positions)
    assert half.shape == (40, 1, 1, 4)


def test_packed_attention_modes_agree_with_rope(world):
    """The per-segment and the block-mask attention of a packed row give each sample what it
    computes alone (stages' other tests check the padded path)."""
    from megatron.model.batch_tensors import unsplit_micro_batch
    rng = np.random.default_rng(1)
    samples = {i: (rng.integers(1, 64, n), rng.integers(1, 64, n), np.ones(n, np.float32))
               for i, n in enumerate((9, 17, 4))}
    alone = build_micro_batch(unsplit_micro_batch([0, 1, 2], samples, "gpt"), samples, "gpt", 0)
    packed = build_micro_batch(MicroBatch(rows=((0, 1, 2),), seq_len=32), samples, "gpt", 0)
    for backend in ("sdpa", "dense-mask"):
        stage = build_rank_stages(LLAMA, (0,), 0, build_transformer_config(LLAMA),
                                  attention_backend=backend)[0]
        initialize_stage_weights({0: stage}, 3)
        with torch.no_grad():
            expected = torch.cat([stage((), alone)[i, :len(samples[i][0])] for i in range(3)])
            torch.testing.assert_close(stage((), packed)[0, :30], expected, rtol=1e-5,
                                       atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (FlexAttention path)")
def test_packed_stream_through_flex_attention_equals_samples_alone_on_cuda(world):
    """On CUDA a packed stream's attention is one FlexAttention call: with rotary positions
    each sample's losses equal those of the sample alone in a padded row."""
    from megatron.model.batch_tensors import unsplit_micro_batch
    rng = np.random.default_rng(2)
    samples = {i: (rng.integers(1, 64, n), rng.integers(1, 64, n), np.ones(n, np.float32))
               for i, n in enumerate((40, 77, 9))}
    stage = build_rank_stages(LLAMA, (0,), 0, build_transformer_config(LLAMA),
                              device="cuda")[0]
    initialize_stage_weights({0: stage}, 3)
    alone = build_micro_batch(unsplit_micro_batch([0, 1, 2], samples, "gpt"), samples, "gpt", 0)
    packed = build_micro_batch(MicroBatch(rows=((0, 1, 2),), seq_len=128), samples, "gpt", 0)

    def on_cuda(batch):
        return {k: v.to("cuda") for k, v in batch.items()}
    with torch.no_grad():
        expected = torch.cat([stage((), on_cuda(alone))[i, :len(samples[i][0])]
                              for i in range(3)])
        got = stage((), on_cuda(packed))[0, :126]
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3)   # TF32 and Flex kernels
