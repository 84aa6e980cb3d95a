"""Micro-batch tensors: a MicroBatch (rows of sample ids) plus the samples' token arrays become
the tensors the stage modules read, all O(rows x seq) — never an S x S mask.

Samples (already shifted, so labels[t] is the token after tokens[t]):
* GPT: (tokens[L], labels[L], loss_mask[L])
* T5:  (enc_tokens[Le], dec_tokens[Ld], labels[Ld], loss_mask[Ld])

Batch keys ([rows, seq] tensors unless said otherwise):
* GPT: tokens, position_ids, labels, loss_mask, segments (attention.Segments);
* T5: enc_tokens, enc_position_ids, dec_tokens, dec_position_ids, labels, loss_mask,
  enc_segments, dec_segments.
A packed row's samples restart their positions at 0 and its Segments say where each sample sits,
so the attention computes exactly what the samples would compute alone. Pad positions have
loss_mask 0 and position 0.
"""
from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import numpy as np
import torch

from dynapipe_ext.batching.microbatch import MicroBatch
from megatron.model.attention import Segments

GPT_KEYS = ("tokens", "position_ids", "labels", "loss_mask", "segments")
T5_KEYS = ("enc_tokens", "enc_position_ids", "dec_tokens", "dec_position_ids", "labels",
           "loss_mask", "enc_segments", "dec_segments")


def _row_lengths(mb: MicroBatch, lengths: Mapping[int, int], seq_len: int, what: str):
    """Per row, its samples' lengths; a row longer than seq_len is an error naming it."""
    out = []
    for row in mb.rows:
        row_lengths = tuple(lengths[s] for s in row)
        if sum(row_lengths) > seq_len:
            detail = ", ".join(f"sample {s}: {lengths[s]}" for s in row)
            raise ValueError(f"{what} tokens of row {tuple(row)} add up to {sum(row_lengths)} > "
                             f"padded length {seq_len} ({detail})")
        out.append(row_lengths)
    return tuple(out)


def _fill(rows: Sequence[Sequence[int]], arrays: Mapping[int, np.ndarray], seq_len: int, pad,
          dtype) -> torch.Tensor:
    """[rows, seq_len]: each row's samples' arrays one after the other, padded with `pad`."""
    out = np.full((len(rows), seq_len), pad, dtype=dtype)
    for r, row in enumerate(rows):
        if row:
            joined = np.concatenate([np.asarray(arrays[s]) for s in row])
            out[r, :len(joined)] = joined
    return torch.from_numpy(out)


def _positions(row_lengths, seq_len: int) -> torch.Tensor:
    """[rows, seq_len] position of each token inside its sample (0 at pads)."""
    out = np.zeros((len(row_lengths), seq_len), dtype=np.int64)
    for r, lens in enumerate(row_lengths):
        if lens:
            total = sum(lens)
            starts = np.repeat(np.cumsum((0,) + lens[:-1]), lens)
            out[r, :total] = np.arange(total) - starts
    return torch.from_numpy(out)


def _check_sample(sid: int, parts: Sequence[np.ndarray], names: Sequence[str]) -> None:
    lens = {name: len(p) for name, p in zip(names, parts)}
    if len(set(lens.values())) != 1:
        raise ValueError(f"sample {sid}: arrays differ in length {lens}")
    if next(iter(lens.values())) == 0:
        raise ValueError(f"sample {sid}: empty {names[0]}")


def build_micro_batch(mb: MicroBatch, samples: Mapping[int, tuple], spec_model: str,
                      pad_id: int, keys: Iterable[str] | None = None) -> dict:
    """Tensors of one micro-batch (see the module docstring); `keys` limits them to what this
    rank's stages read (stages.batch_keys), None builds them all."""
    missing = [s for s in mb.sample_ids if s not in samples]
    if missing:
        raise KeyError(f"micro-batch needs samples {missing[:10]} that were not provided")
    if spec_model not in ("gpt", "t5"):
        raise ValueError(f"spec_model must be 'gpt' or 't5', got {spec_model!r}")
    all_keys = GPT_KEYS if spec_model == "gpt" else T5_KEYS
    wanted = set(all_keys if keys is None else keys)
    if wanted - set(all_keys):
        raise ValueError(f"unknown {spec_model} batch keys {sorted(wanted - set(all_keys))}")
    if spec_model == "gpt":
        return _build_gpt(mb, samples, pad_id, wanted)
    return _build_t5(mb, samples, pad_id, wanted)


def _build_gpt(mb: MicroBatch, samples, pad_id: int, wanted) -> dict:
    for s in mb.sample_ids:
        _check_sample(s, samples[s], ("tokens", "labels", "loss_mask"))
    lens = _row_lengths(mb, {s: len(samples[s][0]) for s in mb.sample_ids}, mb.seq_len, "GPT")
    build = {
        "tokens": lambda: _fill(mb.rows, {s: samples[s][0] for s in mb.sample_ids},
                                mb.seq_len, pad_id, np.int64),
        "labels": lambda: _fill(mb.rows, {s: samples[s][1] for s in mb.sample_ids},
                                mb.seq_len, pad_id, np.int64),
        "loss_mask": lambda: _fill(mb.rows, {s: samples[s][2] for s in mb.sample_ids},
                                   mb.seq_len, 0.0, np.float32),
        "position_ids": lambda: _positions(lens, mb.seq_len),
        "segments": lambda: Segments.from_lengths(lens, mb.seq_len),
    }
    return {k: build[k]() for k in GPT_KEYS if k in wanted}


def _build_t5(mb: MicroBatch, samples, pad_id: int, wanted) -> dict:
    ids = mb.sample_ids
    if mb.dec_seq_len <= 0:
        raise ValueError("a T5 micro-batch needs dec_seq_len > 0")
    for s in ids:
        if len(samples[s]) != 4:
            raise ValueError(f"sample {s}: a T5 sample is (enc_tokens, dec_tokens, labels, "
                             f"loss_mask), got {len(samples[s])} arrays")
        if len(samples[s][0]) == 0:
            raise ValueError(f"sample {s}: empty encoder input")
        _check_sample(s, samples[s][1:], ("dec_tokens", "labels", "loss_mask"))
    enc = _row_lengths(mb, {s: len(samples[s][0]) for s in ids}, mb.seq_len, "T5 encoder")
    dec = _row_lengths(mb, {s: len(samples[s][1]) for s in ids}, mb.dec_seq_len, "T5 decoder")

    def fill(i, seq_len, pad, dtype):
        return lambda: _fill(mb.rows, {s: samples[s][i] for s in ids}, seq_len, pad, dtype)

    build = {
        "enc_tokens": fill(0, mb.seq_len, pad_id, np.int64),
        "dec_tokens": fill(1, mb.dec_seq_len, pad_id, np.int64),
        "labels": fill(2, mb.dec_seq_len, pad_id, np.int64),
        "loss_mask": fill(3, mb.dec_seq_len, 0.0, np.float32),
        "enc_position_ids": lambda: _positions(enc, mb.seq_len),
        "dec_position_ids": lambda: _positions(dec, mb.dec_seq_len),
        "enc_segments": lambda: Segments.from_lengths(enc, mb.seq_len),
        "dec_segments": lambda: Segments.from_lengths(dec, mb.dec_seq_len),
    }
    return {k: build[k]() for k in T5_KEYS if k in wanted}


def batch_to(batch: Mapping, device, pin: bool = False) -> dict:
    """The batch on `device` (pinned host memory first when `pin`, so the copies can be
    non-blocking); tensors and Segments alike."""
    def move(value):
        if pin:
            value = value.pin_memory()
        return value.to(device, non_blocking=pin)
    return {k: move(v) for k, v in batch.items()}


def count_loss_tokens(samples: Mapping[int, tuple], sample_ids: Sequence[int]) -> int:
    """Loss tokens of a set of samples (the denominator of the token-weighted loss)."""
    return int(sum(float(np.asarray(samples[s][-1]).sum()) for s in sample_ids))


def unsplit_micro_batch(sample_ids: Sequence[int], samples: Mapping[int, tuple],
                        spec_model: str) -> MicroBatch:
    """One micro-batch holding every sample in its own row, padded to the longest: the
    single-process reference's view of a global batch."""
    ids = tuple(sample_ids)
    if spec_model == "gpt":
        return MicroBatch(rows=tuple((s,) for s in ids),
                          seq_len=max(len(samples[s][0]) for s in ids))
    return MicroBatch(rows=tuple((s,) for s in ids),
                      seq_len=max(len(samples[s][0]) for s in ids),
                      dec_seq_len=max(len(samples[s][1]) for s in ids))
