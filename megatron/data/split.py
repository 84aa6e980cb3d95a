"""Megatron's `--split 969,30,1`: train, validation and test shares of one dataset, held apart
deterministically so that no sample is in two parts.

The part sizes are Megatron's (get_train_valid_test_split_: boundaries at round(cumulative
share * n)). Megatron then cuts its document order into contiguous ranges; a FLAN dump is
usually ordered by task, so that would hold out whole tasks. Here every part instead takes its
samples spread over the tasks (or a blend's (prefix, task) streams) in proportion to their sizes:
the samples are ordered by a seeded systematic sampling within each task, and that order is cut
at Megatron's boundaries. A task of n samples thus gets share * n samples of each part, give
or take one.
"""
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
    """Sorted sample indices of each part (train, valid, test) for samples in `groups` (one
    group id per sample, e.g. the task id). Sample j of a group of n, in a seeded permutation,
    sits at (j + offset) / n with a seeded offset in [0, 1) per group; all samples in that
    order are cut by split_counts, so each part holds every group's share."""
    groups = np.asarray(groups, dtype=np.int64)
    keys = np.empty(len(groups))
    for group in np.unique(groups):
        members = np.flatnonzero(groups == group)
        rng = np.random.default_rng([seed, 3, int(group)])
        keys[members[rng.permutation(len(members))]] = \
            (np.arange(len(members)) + rng.random()) / len(members)
    order = np.lexsort((np.random.default_rng([seed, 4]).permutation(len(groups)), keys))
    bounds = np.cumsum((0,) + split_counts(len(groups), shares))
    return tuple(np.sort(order[a:b]) for a, b in zip(bounds[:-1], bounds[1:]))
