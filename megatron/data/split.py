"""Megatron's `--split 969,30,1`: train, validation and test shares of one dataset, held apart
deterministically so that no sample is in two parts.

Megatron cuts its document order into three contiguous ranges. A FLAN dump is usually ordered
by task, so contiguous ranges would hold out whole tasks; here the same cut is made within each
group of samples (a task, or a (prefix, task) stream of a blend) after a seeded shuffle, so
every task keeps its share in each part. The share of a group is Megatron's rounding:
boundaries at round(cumulative share * n), the last one at n."""
from __future__ import annotations

from typing import Sequence

import numpy as np

PARTS = ("train", "valid", "test")


def parse_split(text: str) -> tuple[float, float, float]:
    """'969,30,1' (or '969/30/1', or fewer numbers: the rest are 0) -> normalised shares."""
    sep = "/" if "/" in text else ","
    try:
        values = [float(v) for v in text.split(sep)]
    except ValueError:
        raise ValueError(f"--split {text!r}: expected up to three numbers like 969,30,1 "
                         f"(train, validation, test)") from None
    if not 1 <= len(values) <= 3 or any(v < 0 for v in values) or sum(values) <= 0:
        raise ValueError(f"--split {text!r}: expected up to three non-negative numbers, not "
                         f"all 0, like 969,30,1 (train, validation, test)")
    values += [0.0] * (3 - len(values))
    total = sum(values)
    return tuple(v / total for v in values)


def split_counts(n: int, shares: Sequence[float]) -> tuple[int, ...]:
    """How many of `n` samples go to each part (Megatron's get_train_valid_test_split_)."""
    bounds = [0]
    for share in shares:
        bounds.append(bounds[-1] + int(round(share * n)))
    excess = bounds[-1] - n
    bounds = [bounds[0]] + [b - excess for b in bounds[1:]]
    return tuple(b - a for a, b in zip(bounds, bounds[1:]))


def split_indices(groups: Sequence[int], shares: Sequence[float],
                  seed: int) -> tuple[np.ndarray, ...]:
    """Sorted sample indices of each part (train, valid, test): within every group of
    `groups` (one id per sample) a seeded permutation cut by split_counts."""
    groups = np.asarray(groups, dtype=np.int64)
    parts: list[list[np.ndarray]] = [[] for _ in shares]
    for group in np.unique(groups):
        members = np.flatnonzero(groups == group)
        order = members[np.random.default_rng([seed, 3, int(group)]).permutation(len(members))]
        start = 0
        for k, count in enumerate(split_counts(len(members), shares)):
            parts[k].append(order[start:start + count])
            start += count
    return tuple(np.sort(np.concatenate(p)) if p else np.empty(0, dtype=np.int64)
                 for p in parts)
