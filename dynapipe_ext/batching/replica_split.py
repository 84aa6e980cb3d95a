"""Split micro-batches over data-parallel replicas so that the slowest replica, which the
iteration waits for, is as fast as possible.

A replica running micro-batches of times t_k through P pipeline stages takes about
sum_k t_k + (P - 1) * max_k t_k (the makespan model of dp_split). The split minimises the
largest of these over replicas: Karmarkar-Karp's largest differencing method and LPT give two
starting points, a local search (moves and swaps of micro-batches between replicas) improves
both on the makespan model, and small instances are solved exactly by branch and bound."""
from __future__ import annotations

import heapq

import numpy as np

EXACT_MAX_ITEMS = 10     # branch and bound (complete search) up to this many micro-batches


def _check(times, num_replicas: int) -> np.ndarray:
    times = np.asarray(times, dtype=np.float64)
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    if len(times) < num_replicas:
        raise ValueError(f"{len(times)} micro-batches cannot be split over {num_replicas} "
                         "data-parallel replicas (each needs at least one)")
    if not np.all(np.isfinite(times)) or np.any(times < 0):
        raise ValueError("micro-batch times must be finite and >= 0")
    return times


def makespan(times: np.ndarray, members, num_stages: int) -> float:
    """sum + (P - 1) * max of the micro-batch times `times[members]` (0 for none)."""
    t = times[list(members)]
    return float(t.sum() + (num_stages - 1) * t.max()) if len(t) else 0.0


def replica_makespans(times, parts: list[list[int]], num_stages: int) -> list[float]:
    """Makespan model sum + (P - 1) * max of each replica's micro-batches."""
    times = np.asarray(times, dtype=np.float64)
    return [makespan(times, p, num_stages) for p in parts]


def imbalance(times, parts: list[list[int]], num_stages: int) -> float:
    """Slowest / mean predicted replica time (1.0 = perfectly balanced)."""
    spans = replica_makespans(times, parts, num_stages)
    mean = float(np.mean(spans))
    return max(spans) / mean if mean > 0 else 1.0


def lpt_partition(times, num_replicas: int) -> list[list[int]]:
    """LPT greedy on the sums: longest first (ties: lower index) to the least-loaded replica
    (ties: fewer micro-batches, then lower id). Every replica gets one micro-batch."""
    times = _check(times, num_replicas)
    heap = [(0.0, 0, r) for r in range(num_replicas)]
    parts: list[list[int]] = [[] for _ in range(num_replicas)]
    for m in np.lexsort((np.arange(len(times)), -times)):
        load, count, r = heapq.heappop(heap)
        parts[r].append(int(m))
        heapq.heappush(heap, (load + float(times[m]), count + 1, r))
    return [sorted(p) for p in parts]


def kk_partition(times, num_replicas: int) -> list[list[int]]:
    """Multi-way Karmarkar-Karp (largest differencing): every micro-batch starts as a
    partial partition with one non-empty replica; repeatedly the two partial partitions with
    the largest spread (max - min load) are merged, the heaviest subset of one joined with
    the lightest of the other. Deterministic (ties by creation order)."""
    times = _check(times, num_replicas)
    heap = []
    for i in np.lexsort((np.arange(len(times)), -times)):
        subsets = [(float(times[i]), [int(i)])] + [(0.0, []) for _ in range(num_replicas - 1)]
        heapq.heappush(heap, (-float(times[i]), len(heap), subsets))
    counter = len(heap)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        a = sorted(a, key=lambda s: -s[0])          # heaviest first
        b = sorted(b, key=lambda s: s[0])           # lightest first
        merged = [(la + lb, ma + mb) for (la, ma), (lb, mb) in zip(a, b)]
        loads = [s[0] for s in merged]
        heapq.heappush(heap, (-(max(loads) - min(loads)), counter, merged))
        counter += 1
    parts = [sorted(members) for _, members in heap[0][2]]
    return _non_empty(times, parts)


def _non_empty(times: np.ndarray, parts: list[list[int]]) -> list[list[int]]:
    """Give every empty replica the shortest micro-batch of a replica holding two or more
    (possible since there are at least as many micro-batches as replicas)."""
    parts = [list(p) for p in parts]
    for r, p in enumerate(parts):
        if p:
            continue
        donor = max((q for q in range(len(parts)) if len(parts[q]) > 1),
                    key=lambda q: (sum(times[parts[q]]), -q))
        pick = min(parts[donor], key=lambda i: (times[i], i))
        parts[donor].remove(pick)
        parts[r] = [pick]
    return [sorted(p) for p in parts]


def local_search(times, parts: list[list[int]], num_stages: int,
                 max_steps: int = 1000) -> list[list[int]]:
    """Best-improvement moves and swaps of micro-batches between the slowest replica and the
    others, while the score (slowest makespan, then the sum of squared makespans, so that
    equally slow replicas get fixed one by one) falls. Replicas stay non-empty. Each
    candidate is scored in O(1) from its replicas' sum and two largest times."""
    times = np.asarray(times, dtype=np.float64)
    parts = [list(p) for p in parts]
    slope = num_stages - 1

    def stats(p):
        top = sorted(p, key=lambda x: (-times[x], x))[:2]
        return (float(times[p].sum()), top[0], float(times[top[1]]) if len(top) > 1 else 0.0)

    def span_without(st, i, add=None):
        total, top_id, second = st
        rest_max = second if i == top_id else float(times[top_id])
        total -= times[i]
        if add is not None:
            total += times[add]
            rest_max = max(rest_max, float(times[add]))
        return total + slope * rest_max

    def span_with(st, j, remove=None):
        total, top_id, second = st
        if remove is None:
            return total + times[j] + slope * max(float(times[top_id]), float(times[j]))
        return span_without(st, remove, add=j)

    info = [stats(p) for p in parts]
    spans = [st[0] + slope * times[st[1]] for st in info]
    for _ in range(max_steps):
        slow = int(np.argmax(spans))
        current = (spans[slow], sum(x * x for x in spans))
        best = None
        for other in range(len(parts)):
            if other == slow:
                continue
            base = current[1] - spans[slow] ** 2 - spans[other] ** 2
            rest_max = max((spans[r] for r in range(len(parts)) if r not in (slow, other)),
                           default=0.0)
            for i in parts[slow]:
                options = [(None, span_without(info[slow], i), span_with(info[other], i))] \
                    if len(parts[slow]) > 1 else []
                options += [(j, span_without(info[slow], i, add=j),
                             span_with(info[other], i, remove=j))
                            for j in parts[other] if times[j] < times[i]]
                for j, s_slow, s_other in options:
                    key = (max(rest_max, s_slow, s_other), base + s_slow ** 2 + s_other ** 2)
                    if key < (best[0] if best else current):
                        best = (key, other, i, j)
        if best is None or not best[0][0] <= current[0] + 1e-12:
            break
        _, other, i, j = best
        parts[slow].remove(i)
        parts[other].append(i)
        if j is not None:
            parts[other].remove(j)
            parts[slow].append(j)
        for r in (slow, other):
            info[r] = stats(parts[r])
            spans[r] = info[r][0] + slope * times[info[r][1]]
    return [sorted(p) for p in parts]


def exact_partition(times, num_replicas: int, num_stages: int) -> list[list[int]]:
    """Branch and bound over all assignments (longest first; a micro-batch goes to a replica
    already used or to the first empty one, which removes replica-order symmetry): the split
    minimising the slowest makespan, ties by the sum of squared makespans. For small inputs."""
    times = _check(times, num_replicas)
    order = [int(i) for i in np.lexsort((np.arange(len(times)), -times))]
    slope = num_stages - 1
    sums = [0.0] * num_replicas
    tops = [0.0] * num_replicas
    members: list[list[int]] = [[] for _ in range(num_replicas)]
    start = local_search(times, kk_partition(times, num_replicas), num_stages)
    spans0 = replica_makespans(times, start, num_stages)
    best = [(max(spans0), sum(s * s for s in spans0)), [list(p) for p in start]]

    def visit(pos: int, used: int) -> None:
        left = len(order) - pos
        if num_replicas - used > left:
            return                                      # some replica would stay empty
        if pos == len(order):
            spans = [sums[r] + slope * tops[r] for r in range(num_replicas)]
            key = (max(spans), sum(s * s for s in spans))
            if key < best[0]:
                best[0], best[1] = key, [list(p) for p in members]
            return
        i = order[pos]
        t = float(times[i])
        for r in range(min(used + 1, num_replicas)):
            # longest first: the first micro-batch of a replica is its longest
            new_top = tops[r] if members[r] else t
            if sums[r] + t + slope * new_top > best[0][0] + 1e-12:
                continue
            sums[r] += t
            old_top, tops[r] = tops[r], new_top
            members[r].append(i)
            visit(pos + 1, max(used, r + 1))
            members[r].pop()
            tops[r] = old_top
            sums[r] -= t

    visit(0, 0)
    return [sorted(p) for p in best[1]]


def balanced_partition(times, num_replicas: int, num_stages: int = 1) -> list[list[int]]:
    """Micro-batch indices of each replica (increasing: the planner's order is kept inside a
    replica) minimising the slowest replica's makespan sum + (P - 1) * max. Exact for up to
    EXACT_MAX_ITEMS micro-batches; otherwise the better of KK and LPT, each improved by
    `local_search`. Deterministic; every replica gets at least one micro-batch. Raises
    ValueError when there are fewer micro-batches than replicas."""
    times = _check(times, num_replicas)
    if num_replicas == 1:
        return [list(range(len(times)))]
    if len(times) <= EXACT_MAX_ITEMS:
        return exact_partition(times, num_replicas, num_stages)
    best = None
    for start in (kk_partition(times, num_replicas), lpt_partition(times, num_replicas)):
        parts = local_search(times, start, num_stages)
        spans = replica_makespans(times, parts, num_stages)
        key = (max(spans), sum(s * s for s in spans))
        if best is None or key < best[0]:
            best = (key, parts)
    return best[1]


def deal_samples(lengths, num_replicas: int) -> list[np.ndarray]:
    """Samples of each data-parallel replica, dealt before any micro-batching (the cheap global
    decision of planning per replica): longest first (GPT length, T5 encoder + decoder; ties
    by lower index), dealt in snake order 0..D-1, D-1..0, ... so every replica gets the same
    count (+-1) and nearly the same length mix. Indices ascending (draw order kept inside a
    replica). Deterministic, O(n log n). ValueError when a replica would get no sample."""
    arr = np.asarray(lengths)
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    if arr.ndim not in (1, 2) or len(arr) < num_replicas:
        raise ValueError(f"{len(arr)} samples cannot be dealt to {num_replicas} data-parallel "
                         "replicas (each needs at least one); use a bigger global batch")
    key = arr if arr.ndim == 1 else arr.sum(axis=1)
    n = len(arr)
    order = np.lexsort((np.arange(n), -key.astype(np.int64)))
    lap, pos = np.divmod(np.arange(n), num_replicas)
    owner = np.where(lap % 2 == 0, pos, num_replicas - 1 - pos)
    return [np.sort(order[owner == r]) for r in range(num_replicas)]
