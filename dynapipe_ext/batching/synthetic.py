"""Seeded synthetic workloads of the benchmarks and tests: FLAN-like sample lengths, global
batches of them, multi-task T5 batches, and the model shapes and A100-like device figures the
planner benchmarks cost them with."""
from __future__ import annotations

import numpy as np

from dynapipe_ext.costs.model_spec import ModelSpec

# Model shapes used for costing (a ~1.3B GPT and a T5-large-like encoder-decoder); layer counts
# divide evenly by 1, 2, 4 and 8 stages.
GPT_SPEC = ModelSpec("gpt", num_layers=24, hidden_size=2048, num_attention_heads=16,
                     vocab_size=50257, max_position_embeddings=8192)
T5_SPEC = ModelSpec("t5", num_layers=12, hidden_size=1024, num_attention_heads=16,
                    vocab_size=32128, num_decoder_layers=12, max_position_embeddings=8192)
DEVICE = dict(device_flops=120e12, device_mem_bytes=40 * 2**30, dtype_bytes=2,
              bytes_per_param_state=16)


def flan_like_lengths(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Seeded stand-in for FLANv2 token lengths: (input, target) pairs. Inputs: a lognormal
    body (median ~180 tokens) plus 4% long-document tasks (median ~1,600, tail past 8k);
    targets: lognormal, median ~20 tokens, a few hundred at most in practice."""
    rng = np.random.default_rng(seed)
    body = np.exp(rng.normal(np.log(180), 0.9, n))
    long_doc = np.exp(rng.normal(np.log(1600), 0.7, n))
    inputs = np.where(rng.random(n) < 0.04, long_doc, body).astype(np.int64) + 4
    targets = np.exp(rng.normal(np.log(20), 1.1, n)).astype(np.int64) + 1
    return inputs, targets


def global_batch(model: str, tokens: int, max_len: int, max_dec: int, seed: int) -> np.ndarray:
    """Samples in draw order until the (truncated) tokens reach `tokens`: GPT lengths
    input + target + EOD, T5 (input, target + 1) pairs."""
    inputs, targets = flan_like_lengths(4 * tokens // 50 + 100, seed)
    if model == "gpt":
        lengths = np.minimum(inputs + targets + 1, max_len)
        take = int(np.searchsorted(np.cumsum(lengths), tokens, side="right"))
        return lengths[:take]
    enc, dec = np.minimum(inputs, max_len), np.minimum(targets + 1, max_dec)
    take = int(np.searchsorted(np.cumsum(enc), tokens, side="right"))
    return np.stack([enc[:take], dec[:take]], axis=1)


def multitask_t5_batch(seed: int, tokens: int = 65536, num_tasks: int = 40, max_len: int = 2048,
                       max_dec: int = 512) -> np.ndarray:
    """Seeded FLAN-like multi-task T5 global batch, (encoder, decoder) lengths: each task has
    its own lognormal input and target lengths (medians spread over ~20-2,000 and ~2-200
    tokens, narrow or wide per task) and mixing weight; samples are drawn until the encoder
    tokens reach `tokens`. Clusters of tasks with different shapes are what makes the T5
    order matter."""
    rng = np.random.default_rng(seed)
    enc_med = np.exp(rng.normal(np.log(200), 1.0, num_tasks))
    dec_med = np.exp(rng.normal(np.log(20), 1.1, num_tasks))
    enc_sig, dec_sig = rng.uniform(0.1, 0.7, num_tasks), rng.uniform(0.1, 0.9, num_tasks)
    weights = rng.dirichlet(np.ones(num_tasks))
    n = 4 * tokens // 20 + 100
    task = rng.choice(num_tasks, size=n, p=weights)
    enc = np.clip(np.exp(rng.normal(np.log(enc_med[task]), enc_sig[task])), 4, max_len)
    dec = np.clip(np.exp(rng.normal(np.log(dec_med[task]), dec_sig[task])), 1, max_dec)
    enc, dec = enc.astype(np.int64), dec.astype(np.int64)
    take = int(np.searchsorted(np.cumsum(enc), tokens, side="right"))
    return np.stack([enc[:take], dec[:take]], axis=1)
