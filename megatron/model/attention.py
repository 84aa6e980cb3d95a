"""Core attention on torch's fused kernels, fed by the micro-batch description instead of masks.

`SDPAttention` replaces megatron-core's local `DotProductAttention` (same constructor, same
call `(query, key, value, attention_mask, attn_mask_type, ...)`, [s, b, heads, dim] layout,
heads already split by tensor parallelism). Its `attention_mask` is an `AttentionMask`: where the
samples sit on the query and key side (`Segments`: per-row sample lengths on the host, per-position
segment ids on the device). No S x S array is ever built on the host:

* right-padded rows (one sample per row; padding, token-budget, dynamic): causal attention is
  `is_causal` alone (pad keys come after every real query), bidirectional attention (T5 encoder,
  cross-attention) a [rows, 1, 1, S_k] key-padding mask from the segment ids;
* packed rows (several samples per row), by the module's `backend` (--attention-backend, which
  the trainer resolves once at start-up and hands every layer through its ModuleSpec):
  - "flex" (the module's default) and "sdpa": only the blocks of the block-diagonal mask are
    computed, so the work is sum(l_i^2) rather than S^2. "flex" is one document-masked
    FlexAttention kernel where that kernel runs (CUDA, no attention dropout); "sdpa", and "flex"
    elsewhere (torch 2.13 CPU: FlexAttention has no backward, nested-tensor SDPA no backend),
    groups the segments of all rows by length and runs each group as one batched SDPA call (a
    gather and a scatter of q/k/v, one kernel per distinct length instead of one per segment);
  - "dense-mask": one SDPA over the whole row with the block-diagonal mask built on the device
    from the segment ids; S^2 work and memory (bool mask), what Megatron-style packing without a
    varlen kernel does, kept as the throughput bench's "packing" baseline.
  Trade-off of the grouped fallback: work and memory follow the samples, at the price of one
  gather of q/k/v and one scatter of the output per layer and one kernel per distinct sample
  length; "dense-mask" is one kernel but S^2 (wasted) work and an S^2 mask on the device. The
  planner costs each backend's work (planners.ATTENTION_COSTING).

A position bias (T5's relative buckets, `AttentionMask.bias`, [1, heads, n, n]) depends on
the query's and key's positions inside their sample, counted from the sample's start: entry
[i, j] is the bias of query i and key j of a sample. Right-padded rows (n = the padded length)
run one SDPA call whose float mask is the bias where the segment mask allows and -inf elsewhere
(S^2, as the bias itself is). Packed rows (n = the longest sample) run per segment, grouped by
length like the "sdpa" backend, each group with the bias's top-left [lq, lk] block as its float
mask: work and memory follow the samples, never a packed row's S^2. With the "flex" backend on
CUDA both layouts are one document-masked kernel with the bias as its score_mod
(`position_score_mod`, self-attention only: T5's cross-attention has no bias), so neither S^2
float masks nor one call per length group remain.

Pad positions' outputs are don't-care (loss mask 0, never seen by a real query).
"""
from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from torch.nn.attention import SDPBackend, sdpa_kernel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec

from dynapipe_ext.batching.planners import ATTENTION_COSTING   # the backends the planner costs

# SDPA backends in the order tried. cuDNN's kernel (torch's first choice on an H100) builds
# an execution graph for every new input shape, ~100 ms of host time each time; dynamic
# micro-batches bring new shapes for hundreds of iterations, and the measured GPT run on an H100
# spent 60% of its host time there (docs/BENCHMARKS.md, "GPU"). Flash and memory-efficient
# attention need no per-shape set-up, so they come first; every backend stays enabled.
SDPA_PRIORITY = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH,
                 SDPBackend.CUDNN_ATTENTION]


@dataclass(frozen=True, eq=False)
class Segments:
    """One sequence dimension of a micro-batch: `lengths[r]` the lengths of row r's samples in
    order (host ints from the micro-batch description), `seq_len` the padded length, `ids`
    [rows, seq_len] int32 segment number per position (1-based, 0 = pad)."""

    lengths: tuple[tuple[int, ...], ...]
    seq_len: int
    ids: torch.Tensor
    cache: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_lengths(cls, lengths, seq_len: int) -> "Segments":
        """Segments of rows holding samples of these lengths (O(rows x seq_len) host work)."""
        lengths = tuple(tuple(int(n) for n in row) for row in lengths)
        ids = np.zeros((len(lengths), seq_len), dtype=np.int32)
        for r, row in enumerate(lengths):
            if sum(row) > seq_len:
                raise ValueError(f"row {r}: samples of lengths {row} do not fit {seq_len}")
            ids[r, :sum(row)] = np.repeat(np.arange(1, len(row) + 1, dtype=np.int32), row)
        return cls(lengths, seq_len, torch.from_numpy(ids))

    @classmethod
    def full(cls, rows: int, seq_len: int, device=None) -> "Segments":
        """Rows of one sample filling the whole length (no padding)."""
        return cls(((seq_len,),) * rows, seq_len,
                   torch.ones(rows, seq_len, dtype=torch.int32, device=device))

    @property
    def packed(self) -> bool:
        return any(len(row) > 1 for row in self.lengths)

    @property
    def padded(self) -> bool:
        return any(sum(row) < self.seq_len for row in self.lengths)

    def to(self, device, non_blocking: bool = False) -> "Segments":
        return Segments(self.lengths, self.seq_len, self.ids.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> "Segments":
        return Segments(self.lengths, self.seq_len, self.ids.pin_memory())


@dataclass(frozen=True, eq=False)
class PositionBias:
    """A bias on the scores that depends on j - i only (T5's relative position buckets):
    `values[h, n - 1 + j - i]` is head h's bias of key j for query i, |j - i| < n. Each use
    takes the block it needs from `values` (`block`), so a batched call's gradient flows into
    `values` through its own [heads, lq, lk] block; slicing one materialised [heads, n, n]
    bias per call instead makes every call's backward fill and add a whole n x n gradient."""

    values: torch.Tensor        # [heads, 2n - 1]
    n: int

    def block(self, lq: int, lk: int) -> torch.Tensor:
        """[1, heads, lq, lk]: the bias of queries 0..lq-1 over keys 0..lk-1."""
        if not (0 < lq <= self.n and 0 < lk <= self.n):
            raise ValueError(f"PositionBias.block({lq}, {lk}): lengths must be in 1..{self.n}")
        # window k of the unfold starts at values[n - lq + k]; query i needs n - 1 - i
        window = self.values[:, self.n - lq: self.n - 1 + lk].unfold(1, lk, 1)
        return window.flip(1).unsqueeze(0)


def bias_block(bias, lq: int, lk: int) -> torch.Tensor:
    """[1, heads, lq, lk] top-left block of a PositionBias or a [1, heads, sq, sk] tensor."""
    return bias.block(lq, lk) if isinstance(bias, PositionBias) else bias[:, :, :lq, :lk]


@dataclass(frozen=True, eq=False)
class AttentionMask:
    """What one attention call may see: queries laid out as `q`, keys as `k` (the same object
    for self-attention). Causality comes from the attention module's mask type. Things derived
    from it (FlexAttention block masks, gather indices) are cached here, because every layer of
    a stage forward (and its recompute) passes the same object."""

    q: Segments
    k: Segments
    # added to the scores (T5 buckets): a PositionBias, or any [1, heads, sq, sk] tensor
    bias: "PositionBias | torch.Tensor | None" = None
    cache: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        if len(self.q.lengths) != len(self.k.lengths):
            raise ValueError(f"queries have {len(self.q.lengths)} rows, keys "
                             f"{len(self.k.lengths)}")
        if [len(r) for r in self.q.lengths] != [len(r) for r in self.k.lengths]:
            raise ValueError("queries and keys differ in samples per row: "
                             f"{self.q.lengths} vs {self.k.lengths}")

    @classmethod
    def of(cls, q: Segments, k: Segments | None = None) -> "AttentionMask":
        """The mask of queries `q` over keys `k` (self-attention when None), one object per
        pair, so every layer and every recompute shares its cache."""
        k = q if k is None else k
        key = ("mask", id(k))
        if key not in q.cache:
            q.cache[key] = cls(q, k)
        return q.cache[key]

    def dense(self, causal: bool) -> torch.Tensor:
        """[rows, 1, sq, sk] bool, True = may attend, built on the segment ids' device: same
        sample and real key (and not a later key when causal); pad queries see every key, so no
        row is fully masked."""
        q, k = self.q.ids, self.k.ids
        allowed = (q[:, :, None] == k[:, None, :]) & (k[:, None, :] > 0)
        if causal:
            allowed &= torch.ones(q.shape[1], k.shape[1], dtype=torch.bool,
                                  device=q.device).tril()
        allowed |= (q == 0)[:, :, None]
        return allowed[:, None]


# segments are grouped for one batched attention call by their lengths rounded up to a multiple
# of SEGMENT_GRANULE tokens and to one of this many steps per doubling (segment_bucket): fewer,
# larger calls for at most 1/STEPS (or granule - 1) more tokens per segment. On this project's CPU
# a group costs about 0.15 ms of forward + backward per attention call whatever its size below
# ~100 tokens; exact short lengths made every T5 decoder length and every (encoder, decoder)
# length pair a call of its own (granule 8: 16 mixed-length samples of 24-39 / 3-13 tokens
# through T5 2 + 2 layers, hidden 128, 60 -> 52 ms)
BUCKET_STEPS_PER_DOUBLING = 8
SEGMENT_GRANULE = 8


def segment_bucket(length: int, steps: int = BUCKET_STEPS_PER_DOUBLING,
                   granule: int = SEGMENT_GRANULE) -> int:
    """The length a segment is padded to in its group: rounded up to a multiple of `granule`,
    and past 2 * steps tokens to a multiple of 1/steps of its power of two (at most 1/steps
    more)."""
    length = -(-length // granule) * granule
    if length <= 2 * steps:
        return length
    unit = 1 << max(0, length.bit_length() - steps.bit_length())
    return -(-length // unit) * unit


def length_groups(mask: AttentionMask, bucket=lambda n: n
                  ) -> dict[tuple[int, int], tuple[list, list, list, list, list]]:
    """(query bucket, key bucket) -> (rows, query starts, key starts, query lengths, key
    lengths) of every sample segment, so that segments of one padded shape run as one batched
    call; `bucket` maps a length to the length it is padded to (default: exact lengths),
    never past the row's length."""
    groups: dict[tuple[int, int], tuple[list, list, list, list, list]] = {}
    for r, (q_row, k_row) in enumerate(zip(mask.q.lengths, mask.k.lengths)):
        q0 = k0 = 0
        for lq, lk in zip(q_row, k_row):
            shape = (min(bucket(lq), mask.q.seq_len), min(bucket(lk), mask.k.seq_len))
            group = groups.setdefault(shape, ([], [], [], [], []))
            for values, value in zip(group, (r, q0, k0, lq, lk)):
                values.append(value)
            q0, k0 = q0 + lq, k0 + lk
    return groups


def _flex_available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


_FLEX = {}


def _flex_attention():
    """FlexAttention compiled once (uncompiled it materialises the scores)."""
    if "fn" not in _FLEX:
        from torch.nn.attention.flex_attention import flex_attention
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=True)
    return _FLEX["fn"]


FLEX_BLOCK = 128     # FlexAttention's block size (queries and keys)


def document_blocks(q_lengths, k_lengths, sq: int, sk: int, causal: bool,
                    block: int = FLEX_BLOCK):
    """Which (query block, key block) pairs of each row a document mask touches, from the
    samples' lengths alone (host ints: no device sync, no compile): returns (partial, full),
    bool arrays [rows, query blocks, key blocks]. A pair is touched when a sample has queries
    in the one and keys in the other (keys not after queries when causal); full when both
    blocks lie wholly inside one sample with no pad (and every key before every query when
    causal), so its mask need not be evaluated. Samples are numbered alike on both sides
    (T5 cross-attention: encoder sample i against decoder sample i)."""
    rows = len(q_lengths)
    nq, nk = -(-sq // block), -(-sk // block)
    partial = np.zeros((rows, nq, nk), dtype=bool)
    full = np.zeros((rows, nq, nk), dtype=bool)

    def ranges(lengths, seq, count):
        """Per block: lowest and highest sample number, and whether it is one pad-free
        sample filling the whole block."""
        ids = np.zeros(count * block, dtype=np.int64)
        total = sum(lengths)
        ids[:total] = np.repeat(np.arange(1, len(lengths) + 1), lengths)
        per = ids.reshape(count, block)
        real = per > 0
        low = np.where(real, per, np.iinfo(np.int64).max).min(axis=1)
        high = per.max(axis=1)
        whole = real.all(axis=1) & (low == high)
        whole[(np.arange(count) + 1) * block > seq] = False
        return low, high, real.any(axis=1), whole

    qi, kj = np.arange(nq)[:, None], np.arange(nk)[None, :]
    for r in range(rows):
        q_low, q_high, q_any, q_whole = ranges(q_lengths[r], sq, nq)
        k_low, k_high, k_any, k_whole = ranges(k_lengths[r], sk, nk)
        touched = (q_any[:, None] & k_any[None, :] & (q_low[:, None] <= k_high[None, :])
                   & (k_low[None, :] <= q_high[:, None]))
        whole = (q_whole[:, None] & k_whole[None, :] & (q_low[:, None] == k_low[None, :]))
        if causal:
            touched &= kj <= qi
            whole &= kj < qi
        full[r] = touched & whole
        partial[r] = touched & ~whole
    return partial, full


def flex_block_mask(mask: AttentionMask, causal: bool, device):
    """FlexAttention block mask of the document (block-diagonal) mask: its block lists come
    from the samples' lengths on the host (document_blocks), so building it needs neither a
    compile nor a device sync; only partial blocks evaluate the mask function on the
    segment ids."""
    from torch.nn.attention.flex_attention import BlockMask
    q_ids, k_ids = mask.q.ids, mask.k.ids

    def document(b, h, q_idx, kv_idx):
        seen = (q_ids[b, q_idx] == k_ids[b, kv_idx]) & (k_ids[b, kv_idx] > 0)
        return (seen & (q_idx >= kv_idx)) if causal else seen

    partial, full = document_blocks(mask.q.lengths, mask.k.lengths, mask.q.seq_len,
                                    mask.k.seq_len, causal)

    def as_lists(blocks):
        counts = blocks.sum(axis=-1).astype(np.int32)[:, None]          # [rows, 1, nq]
        # touched key blocks first, in order (argsort is stable on the negated flags)
        order = np.argsort(~blocks, axis=-1, kind="stable").astype(np.int32)[:, None]
        return (torch.from_numpy(counts).to(device, non_blocking=True),
                torch.from_numpy(order).to(device, non_blocking=True))

    kv_num, kv_idx = as_lists(partial)
    full_num, full_idx = as_lists(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=FLEX_BLOCK,
                                    mask_mod=document,
                                    seq_lengths=(mask.q.seq_len, mask.k.seq_len))


def position_score_mod(bias: PositionBias):
    """FlexAttention score_mod adding `bias` to self-attention scores: queries and keys share
    one layout, so inside a sample j - i = kv_idx - q_idx. Pairs across samples, which a
    partial block still scores before its mask drops them, are clamped into the table. The
    table's length is read from its shape, so a new longest sample is a new size for the
    dynamic-shape compile rather than a new constant (a recompile)."""
    values = bias.values

    def score_mod(score, b, h, q_idx, kv_idx):
        last = values.shape[1] - 1                      # 2n - 2
        return score + values[h, (kv_idx - q_idx + last // 2).clamp(0, last)]
    return score_mod


class SDPAttention(DotProductAttention):
    """megatron-core core attention on scaled_dot_product_attention (see module docstring).
    Same constructor and forward signature as DotProductAttention; `attention_mask` is an
    AttentionMask, a megatron bool mask tensor (True = masked out) or None. `backend`
    (ATTENTION_COSTING's keys) says how packed and biased rows are computed."""

    def __init__(self, *args, backend: str = "flex", **kwargs):
        if backend not in ATTENTION_COSTING:
            raise ValueError(f"attention backend must be one of {tuple(ATTENTION_COSTING)}, "
                             f"got {backend!r}")
        super().__init__(*args, **kwargs)
        self.backend = backend

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("SDPAttention reads sample boundaries from its AttentionMask; "
                             "attention_bias and packed_seq_params are not supported")
        if self.softmax_offset is not None or self.scale_mask_softmax.window_size is not None:
            raise ValueError("SDPAttention supports the vanilla softmax without a window only")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        causal = mask_type == AttnMaskType.causal
        sq, batch = query.shape[0], query.shape[1]
        # [s, b, heads, dim] -> [b, heads, s, dim] (views; SDPA takes strided inputs)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if attention_mask is None or isinstance(attention_mask, torch.Tensor):
            out = self._sdpa(q, k, v, None if attention_mask is None else ~attention_mask,
                             causal and attention_mask is None)
        elif not isinstance(attention_mask, AttentionMask):
            raise TypeError(f"attention_mask must be an AttentionMask, a bool tensor or None, "
                            f"got {type(attention_mask).__name__}")
        elif self._flex_takes(q, attention_mask):
            out = self._flex(q, k, v, attention_mask, causal)
        elif attention_mask.bias is not None and not (attention_mask.q.packed
                                                       or attention_mask.k.packed):
            out = self._biased(q, k, v, attention_mask, causal)
        elif attention_mask.bias is not None:
            out = self._by_length(query, key, value, attention_mask, causal,
                                  attention_mask.bias)
            return out.reshape(sq, batch, -1)
        elif not (attention_mask.q.packed or attention_mask.k.packed):
            out = self._padded(q, k, v, attention_mask, causal)
        elif self.backend == "dense-mask":
            if ("dense", causal) not in attention_mask.cache:    # built once per micro-batch
                attention_mask.cache[("dense", causal)] = attention_mask.dense(causal)
            out = self._sdpa(q, k, v, attention_mask.cache[("dense", causal)], False)
        else:
            out = self._by_length(query, key, value, attention_mask, causal)
            return out.reshape(sq, batch, -1)
        return out.permute(2, 0, 1, 3).reshape(sq, batch, -1)

    # ---- the kernels ----
    @property
    def effective_scale(self) -> float:
        """The score scale of megatron's dense path: its softmax multiplies the layer-number
        coefficient back in when apply_query_key_layer_scaling is on."""
        coeff = self.layer_number if self.config.apply_query_key_layer_scaling else 1
        return self.softmax_scale * coeff

    def _dropout_p(self) -> float:
        return self.attention_dropout.p if self.training else 0.0

    def _dropout_rng(self):
        """Attention dropout draws from megatron's model-parallel RNG, as the local path does."""
        if self._dropout_p() > 0 and not self.config.sequence_parallel:
            return tensor_parallel.get_cuda_rng_tracker().fork()
        return contextlib.nullcontext()

    def _sdpa(self, q, k, v, allowed, causal):
        """[b, heads, sq, dim] output; `allowed` broadcastable bool, True = may attend."""
        # CPU has no cuDNN backend: the priority context (~40 us) is only worth it on CUDA
        order = (sdpa_kernel(SDPA_PRIORITY, set_priority=True) if q.is_cuda
                 else contextlib.nullcontext())
        with self._dropout_rng(), order:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=allowed, is_causal=causal, dropout_p=self._dropout_p(),
                scale=self.effective_scale, enable_gqa=q.shape[1] != k.shape[1])

    def _padded(self, q, k, v, mask: AttentionMask, causal: bool):
        """One sample per row, right-padded: causal needs nothing else; bidirectional needs the
        keys' padding, a [rows, 1, 1, sk] mask."""
        if causal:
            return self._sdpa(q, k, v, None, True)
        allowed = (mask.k.ids > 0)[:, None, None, :] if mask.k.padded else None
        return self._sdpa(q, k, v, allowed, False)

    def _biased(self, q, k, v, mask: AttentionMask, causal: bool):
        """Scores plus the mask's position bias: one SDPA call with a float mask, the bias
        where the segment mask allows and -inf elsewhere ([rows, heads, sq, sk]: S^2, as the
        bias itself is)."""
        if ("dense", causal) not in mask.cache:
            mask.cache[("dense", causal)] = mask.dense(causal)
        allowed = mask.cache[("dense", causal)]
        bias = bias_block(mask.bias, q.shape[2], k.shape[2]).to(q.dtype)
        scores = torch.where(allowed, bias, torch.tensor(float("-inf"), dtype=q.dtype,
                                                         device=q.device))
        return self._sdpa(q, k, v, scores, False)

    def _flex_takes(self, q, mask: AttentionMask) -> bool:
        """Whether FlexAttention runs this call: with the "flex" backend where its kernel runs
        (CUDA, no dropout: it has none), for packed rows and for any layout with a position
        bias (a score_mod), as long as the bias is a PositionBias over one layout
        (self-attention)."""
        if self.backend != "flex" or not _flex_available(q.device) or self._dropout_p():
            return False
        if mask.bias is not None:
            return isinstance(mask.bias, PositionBias) and mask.q is mask.k
        return mask.q.packed or mask.k.packed

    def _flex(self, q, k, v, mask: AttentionMask, causal: bool):
        """One document-masked FlexAttention call, the position bias as its score_mod. The
        block mask depends on the layouts alone, so it is kept with the query layout: built
        once per micro-batch even where each stage call brings a fresh biased mask."""
        key = ("flex", causal, q.device, id(mask.k))
        if key not in mask.q.cache:
            mask.q.cache[key] = flex_block_mask(mask, causal, q.device)
        score_mod = None if mask.bias is None else position_score_mod(mask.bias)
        return _flex_attention()(q, k, v, score_mod=score_mod, block_mask=mask.q.cache[key],
                                 scale=self.effective_scale, enable_gqa=q.shape[1] != k.shape[1])

    def _by_length(self, query, key, value, mask: AttentionMask, causal: bool, bias=None):
        """Per-segment attention, segments of one padded shape (segment_bucket) batched in
        one call; returns [sq, b, heads, dim] with zeros at pad positions. A segment shorter
        than its group's shape is read on past its end, and what that adds is never seen:
        causal queries do not reach later keys, other keys are masked out, and queries past
        the end are not written back (so no gradient reaches what was read). `bias` ([1,
        heads, n, n] tensor or a PositionBias, positions from each sample's start) adds its
        top-left block. Every group's queries, keys and values are taken in one gather each
        and the outputs put back in one copy, so that a group costs its attention call and
        two views, whatever the number of groups (a gather and a scatter per group and
        tensor cost about as much as a short segment's attention on a CPU)."""
        sq, rows = query.shape[:2]
        q_index, k_index, groups, written = self._gather_indices(mask, query.device)
        # one split per tensor: its backward is one concatenation, where a slice per group
        # would each make a zero gradient of the whole tensor (groups x tokens of work)
        q_sizes = [n * lq for lq, _, n, _ in groups]
        k_sizes = [n * lk for _, lk, n, _ in groups]
        q_parts = query.flatten(0, 1).index_select(0, q_index).split(q_sizes)
        k_parts = key.flatten(0, 1).index_select(0, k_index).split(k_sizes)
        v_parts = value.flatten(0, 1).index_select(0, k_index).split(k_sizes)
        outs = []
        for (lq, lk, n, real_k), *parts in zip(groups, q_parts, k_parts, v_parts):
            qg, kg, vg = (t.view(n, length, *t.shape[1:]).transpose(1, 2)
                          for t, length in zip(parts, (lq, lk, lk)))
            keys = None if real_k is None or causal else real_k[:, None, None, :]
            if bias is None:
                og = self._sdpa(qg, kg, vg, keys, causal)
            else:
                scores = bias_block(bias, lq, lk).to(qg.dtype)
                if causal:
                    later = torch.ones(lq, lk, dtype=torch.bool, device=qg.device).triu(1)
                    scores = scores.masked_fill(later, float("-inf"))
                if keys is not None:
                    scores = scores.masked_fill(~keys, float("-inf"))
                og = self._sdpa(qg, kg, vg, scores, False)
            outs.append(og.transpose(1, 2).flatten(0, 1))                # [n * lq, heads, dim]
        found = torch.cat(outs) if len(outs) > 1 else outs[0]
        kept, positions = written
        if kept is not None:            # only the queries inside their segment
            found = found.index_select(0, kept)
        out = found.new_zeros((sq * rows,) + found.shape[1:]).index_copy(0, positions, found)
        return out.view(sq, rows, *found.shape[1:])

    @staticmethod
    def _gather_indices(mask: AttentionMask, device):
        """The groups' layout as flat indices into [s * rows] (position * rows + row): every
        group's padded query positions back to back, the same for keys, the groups (query
        length, key length, segments, [n, lk] bool of keys inside their segment or None when
        all are) in that order, and the write-back (which of the gathered queries are inside
        their segment, None when all are; their flat positions). Positions past a row's end
        are clamped into it (read, never used). Built on the host once per micro-batch and
        mask, in numpy: the three masks of a T5 micro-batch of 20 samples take 0.8 ms, against
        2.5 ms with torch calls per group, paid for every micro-batch on every rank. The device
        never has to report a count."""
        key = ("gather", device)
        if key not in mask.cache:
            num_rows = len(mask.q.lengths)
            q_parts, k_parts, real_q_parts, groups = [], [], [], []
            for (lq, lk), (rows, q0, k0, q_len, k_len) in length_groups(
                    mask, segment_bucket).items():
                row = np.asarray(rows)[:, None]
                q_pos, real_q = _padded_positions(q0, q_len, lq, mask.q.seq_len)
                k_pos, real_k = _padded_positions(k0, k_len, lk, mask.k.seq_len)
                q_parts.append((q_pos * num_rows + row).ravel())
                k_parts.append((k_pos * num_rows + row).ravel())
                real_q_parts.append(real_q.ravel())
                groups.append((lq, lk, len(rows),
                               None if real_k.all() else _from_numpy(real_k, device)))
            q_index, real_q = np.concatenate(q_parts), np.concatenate(real_q_parts)
            kept = None if real_q.all() else np.flatnonzero(real_q)
            positions = q_index if kept is None else q_index[kept]
            mask.cache[key] = (_from_numpy(q_index, device),
                               _from_numpy(np.concatenate(k_parts), device), groups,
                               (_from_numpy(kept, device), _from_numpy(positions, device)))
        return mask.cache[key]


def _from_numpy(array, device):
    """A numpy array (or None) as a tensor on `device`, copied without waiting."""
    return None if array is None else torch.from_numpy(array).to(device, non_blocking=True)


def _padded_positions(starts, lengths, width: int, seq_len: int):
    """[n, width] positions (numpy int64) of segments starting at `starts`, clamped into the
    row, and the [n, width] bool of those inside their segment."""
    offset = np.arange(width)
    positions = np.minimum(np.asarray(starts)[:, None] + offset, seq_len - 1)
    return positions, offset < np.asarray(lengths)[:, None]


def sdpa_layer_spec(layer_spec, backend: str = "flex"):
    """A copy of a layer ModuleSpec whose self- and cross-attention use SDPAttention with
    attention backend `backend`."""
    spec = copy.deepcopy(layer_spec)
    for name in ("self_attention", "cross_attention"):
        attention = getattr(spec.submodules, name, None)
        submodules = getattr(attention, "submodules", None)
        if submodules is not None and getattr(submodules, "core_attention", None) is not None:
            submodules.core_attention = ModuleSpec(module=SDPAttention,
                                                   params={"backend": backend})
    return spec
