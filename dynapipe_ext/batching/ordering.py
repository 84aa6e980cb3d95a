"""Sample orders for the dynamic planner: contiguous runs of the order become micro-batches, so
neighbours must have similar shapes (a micro-batch is padded to its longest sample).

GPT: by length. T5 (two lengths): encoder lexsort, the 2-D snake, and clustering + TSP as in
the DynaPipe paper; `refine_groups` improves a split by moving samples between micro-batches
and `groups_order` turns the result back into an order (planners.plan_dynamic uses them all
and keeps the best DP objective)."""
from __future__ import annotations

import numpy as np

T5_ORDERS = ("snake", "enc", "cluster-tsp")


def length_order(lengths: np.ndarray) -> np.ndarray:
    """GPT: sample ids by increasing length (stable, so ties keep their input order)."""
    return np.argsort(np.asarray(lengths), kind="stable")


def enc_dec_order(enc: np.ndarray, dec: np.ndarray) -> np.ndarray:
    """T5, one key: by encoder length, ties by decoder length."""
    return np.lexsort((np.asarray(dec), np.asarray(enc)))


def snake_order(enc: np.ndarray, dec: np.ndarray, band_size: int | None = None) -> np.ndarray:
    """T5 2-D order: cut the encoder-length order into bands of `band_size` samples (default
    ~sqrt(n)), sort each band by decoder length, alternately up and down (boustrophedon).

    Why: a micro-batch is padded to the max encoder AND max decoder length of its samples.
    Within a band encoder lengths are close (bands are consecutive encoder quantiles) and
    decoder lengths rise monotonically, so any contiguous run has both maxima near its
    members; reversing every other band makes the seam between bands join samples of similar
    decoder length too. Unlike a space-filling curve it needs no grid and adapts to the
    (very skewed) length distribution through quantile bands."""
    enc = np.asarray(enc)
    dec = np.asarray(dec)
    n = len(enc)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    if band_size is None:
        band_size = max(1, int(round(np.sqrt(n))))
    by_enc = enc_dec_order(enc, dec)
    pieces = []
    for b, start in enumerate(range(0, n, band_size)):
        band = by_enc[start:start + band_size]
        # inside the band: by decoder length, ties by encoder length
        band = band[np.lexsort((enc[band], dec[band]))]
        pieces.append(band if b % 2 == 0 else band[::-1])
    return np.concatenate(pieces)


def t5_order(enc: np.ndarray, dec: np.ndarray, method: str = "snake",
             band_size: int | None = None) -> np.ndarray:
    """The named T5 order (see T5_ORDERS)."""
    if method == "snake":
        return snake_order(enc, dec, band_size)
    if method == "enc":
        return enc_dec_order(enc, dec)
    if method == "cluster-tsp":
        return cluster_tsp_order(enc, dec)
    raise ValueError(f"unknown T5 order {method!r}; choose one of {T5_ORDERS}")


# ------------------------------------------------------------------ clustering + TSP

def cluster_tsp_order(enc: np.ndarray, dec: np.ndarray, num_clusters: int | None = None,
                      dec_weight: float = 1.0) -> np.ndarray:
    """T5 order of DynaPipe's paper: agglomerative clustering of the (encoder, decoder) length
    points, a short open tour over the cluster centroids, each cluster's samples in the
    tour's direction. Complete linkage with the city-block metric bounds every cluster's
    spread in both lengths, which is what a micro-batch padded to its maxima pays for;
    `dec_weight` scales decoder tokens against encoder tokens in that metric.

    The tour is our own nearest-neighbour start + 2-opt + Or-opt (`open_tour`) rather than
    LKH (elkai) or OR-Tools: no TSP package is in the requirements, and the instance (about
    sqrt(n), i.e. tens of centroids) is small enough that these local moves come within a few
    percent of the shortest path (tests compare with brute force) in a millisecond or two.
    The order is one candidate of the planner, which keeps whichever gives the best DP."""
    from scipy.cluster.hierarchy import fcluster, linkage

    enc = np.asarray(enc, dtype=np.float64)
    dec = np.asarray(dec, dtype=np.float64)
    n = len(enc)
    if n <= 2:
        return enc_dec_order(enc, dec)
    if num_clusters is None:
        num_clusters = max(1, int(round(np.sqrt(n))))
    num_clusters = min(num_clusters, n)
    points = np.stack([enc, dec_weight * dec], axis=1)
    labels = fcluster(linkage(points, method="complete", metric="cityblock"),
                      num_clusters, criterion="maxclust") - 1
    k = int(labels.max()) + 1
    counts = np.bincount(labels, minlength=k)
    centroids = np.stack([np.bincount(labels, points[:, c], minlength=k) / counts
                          for c in range(2)], axis=1)
    tour = open_tour(np.abs(centroids[:, None, :] - centroids[None, :, :]).sum(axis=2),
                     start=int(np.argmin(centroids.sum(axis=1))))
    pieces = []
    for pos, c in enumerate(tour):
        # direction of travel through this cluster: from the previous to the next centroid
        before = centroids[tour[pos - 1]] if pos > 0 else centroids[c]
        after = centroids[tour[pos + 1]] if pos + 1 < len(tour) else centroids[c]
        direction = after - before
        if not direction.any():
            direction = np.ones(2)
        members = np.flatnonzero(labels == c)
        key = points[members] @ direction
        pieces.append(members[np.lexsort((dec[members], enc[members], key))])
    return np.concatenate(pieces)


def open_tour(dist: np.ndarray, start: int = 0) -> np.ndarray:
    """A short Hamiltonian path over the nodes of the symmetric distance matrix `dist`:
    nearest neighbour from `start`, then best-improvement 2-opt and Or-opt (moving runs of 1-3
    nodes, either way round) until neither improves. Free ends: a dummy node at distance 0
    from every node closes the path into a cycle, so cycle moves optimise the path."""
    k = len(dist)
    if k <= 2:
        return np.arange(k) if start == 0 or k < 2 else np.array([start, 1 - start])
    d = np.zeros((k + 1, k + 1))
    d[:k, :k] = dist
    # nearest neighbour path, then the dummy closes it
    tour = [start]
    left = np.ones(k, dtype=bool)
    left[start] = False
    for _ in range(k - 1):
        row = np.where(left, dist[tour[-1]], np.inf)
        nxt = int(np.argmin(row))
        tour.append(nxt)
        left[nxt] = False
    tour = np.array(tour + [k])
    eps = 1e-9
    for _ in range(100 * k):
        tour, better = _two_opt_step(d, tour, eps)
        if better:
            continue
        tour, better = _or_opt_step(d, tour, eps)
        if not better:
            break
    cut = int(np.flatnonzero(tour == k)[0])
    path = np.concatenate([tour[cut + 1:], tour[:cut]])
    return path


def _two_opt_step(d: np.ndarray, tour: np.ndarray, eps: float) -> tuple[np.ndarray, bool]:
    """Apply the best 2-opt move (reverse tour[i+1..j]) if it shortens the cycle."""
    m = len(tour)
    a, b = tour, np.roll(tour, -1)               # edge i: a[i] -> b[i]
    gain = (d[a[:, None], b[:, None]] + d[a[None, :], b[None, :]]
            - d[a[:, None], a[None, :]] - d[b[:, None], b[None, :]])
    gain = np.triu(gain, 2)
    if m > 2:
        gain[0, m - 1] = 0.0                      # adjacent through the wrap-around
    i, j = np.unravel_index(np.argmax(gain), gain.shape)
    if gain[i, j] <= eps:
        return tour, False
    tour = tour.copy()
    tour[i + 1:j + 1] = tour[i + 1:j + 1][::-1]
    return tour, True


def _or_opt_step(d: np.ndarray, tour: np.ndarray, eps: float) -> tuple[np.ndarray, bool]:
    """Apply the best Or-opt move (a run of 1-3 nodes moved between two other neighbours,
    possibly reversed) if it shortens the cycle. Vectorised over (run start, insertion edge)."""
    m = len(tour)
    dt = d[np.ix_(tour, tour)]                   # distances by tour position
    pos = np.arange(m)
    nxt = (pos + 1) % m
    best = (eps, None)
    for run in (1, 2, 3):
        if run + 2 > m:
            break
        last = (pos + run - 1) % m                # run = positions i .. last[i]
        before, after = (pos - 1) % m, (pos + run) % m
        removed = dt[before, pos] + dt[last, after] - dt[before, after]
        edge = dt[pos, nxt]                       # insertion edge j -> j + 1
        fwd = dt[pos[None, :], pos[:, None]] + dt[last[:, None], nxt[None, :]] - edge[None, :]
        rev = dt[pos[None, :], last[:, None]] + dt[pos[:, None], nxt[None, :]] - edge[None, :]
        # edge j must lie outside the run and not be one of the two edges it leaves
        offset = (pos[None, :] - pos[:, None] + 1) % m  # j - i + 1 (mod m)
        bad = offset <= run
        for cost, flip in ((fwd, False), (rev, True)):
            gain = np.where(bad, -np.inf, removed[:, None] - cost)
            i, j = np.unravel_index(np.argmax(gain), gain.shape)
            if gain[i, j] > best[0]:
                best = (float(gain[i, j]), (int(i), int(j), run, flip))
    if best[1] is None:
        return tour, False
    i, j, run, flip = best[1]
    seg = tour[(i + np.arange(run)) % m]
    rest = tour[(i + run + np.arange(m - run)) % m]    # starts right after the run
    e = (j - (i + run)) % m                            # position of edge j's start in rest
    return np.concatenate([rest[:e + 1], seg[::-1] if flip else seg, rest[e + 1:]]), True


# ------------------------------------------------------------------ partition local search

def refine_groups(enc: np.ndarray, dec: np.ndarray, groups: list[np.ndarray], segment_time,
                  num_stages: int, dp_degree: int = 1, max_rounds: int | None = None
                  ) -> tuple[list[np.ndarray], float]:
    """Local search on a set partition of the samples into micro-batches, on the DP's own
    objective sum_g t_g / dp_degree + (num_stages - 1) * max_g t_g, where
    t_g = segment_time(rows, max encoder length, max decoder length) (vectorised; inf where a
    shape does not fit). Returns the groups (empty ones dropped) and their objective.

    Why: the DP is exact for a given order, but a contiguous split of any one order can miss
    a better grouping (a long sample stranded among short ones). Concatenating the refined
    groups gives an order in which that grouping is contiguous, so the DP on it is at least as
    good as the refined groups.

    Each round applies the best single-sample move to another group (an emptied group may
    take a sample back alone), plus every other move that lowers the sum of times without
    touching a group already changed this round and without raising any time above the
    maximum the first move leaves: the objective strictly falls every round. Rounds stop when
    no move improves or after `max_rounds` (default n): deterministic, no clock. Costs of
    (sample, group) insertions and of removals are cached; a round re-costs only the groups
    it changed, in one segment_time call."""
    enc = np.asarray(enc)
    dec = np.asarray(dec)
    n = len(enc)
    m = len(groups)
    label = np.empty(n, dtype=np.int64)
    for g, members in enumerate(groups):
        label[members] = g
    slope = num_stages - 1
    max_rounds = n if max_rounds is None else max_rounds
    ids = np.arange(n)
    rows = np.zeros(m, dtype=np.int64)
    e1, e2, d1, d2 = (np.zeros(m, dtype=np.int64) for _ in range(4))

    def restat(gs):
        for g in gs:
            members = np.flatnonzero(label == g)
            e = np.sort(enc[members])[::-1]
            d = np.sort(dec[members])[::-1]
            rows[g] = len(members)
            e1[g], e2[g] = (e[0] if len(e) else 0), (e[1] if len(e) > 1 else 0)
            d1[g], d2[g] = (d[0] if len(d) else 0), (d[1] if len(d) > 1 else 0)

    def recost(gs, who):
        """Times of groups gs, insertion costs of every sample into gs, removal costs of
        samples `who` from their groups: one segment_time call."""
        gs = np.asarray(gs, dtype=np.int64)
        g_of = label[who]
        keep = rows[g_of] > 1                    # leaving a group of one costs nothing after
        ins_rows = np.repeat(rows[gs][None, :] + 1, n, 0)
        ins_e = np.maximum(e1[gs][None, :], enc[:, None])
        ins_d = np.maximum(d1[gs][None, :], dec[:, None])
        # neighbourhood: no insertion that makes a group bigger in padded tokens than the
        # biggest one now (such moves would rarely pay, and costing them is the slow part)
        small = (ins_rows * (ins_e + ins_d) <= (rows * (e1 + d1)).max()).ravel()
        r = np.concatenate([rows[gs], ins_rows.ravel()[small], rows[g_of][keep] - 1])
        em = np.concatenate([e1[gs], ins_e.ravel()[small],
                             np.where(enc[who] < e1[g_of], e1[g_of], e2[g_of])[keep]])
        dm = np.concatenate([d1[gs], ins_d.ravel()[small],
                             np.where(dec[who] < d1[g_of], d1[g_of], d2[g_of])[keep]])
        out = np.asarray(segment_time(r, em, dm), dtype=np.float64)
        k = len(gs)
        t[gs] = np.where(rows[gs] > 0, out[:k], 0.0)
        inserted = np.full(n * k, np.inf)
        inserted[small] = out[k:k + int(small.sum())]
        ins[:, gs] = inserted.reshape(n, k)
        removal = np.zeros(len(who))
        removal[keep] = out[k + int(small.sum()):]
        rem[who] = removal

    t = np.zeros(m)
    ins = np.zeros((n, m))
    rem = np.zeros(n)
    restat(range(m))
    recost(np.arange(m), ids)
    objective = float(t.sum() / dp_degree + slope * t.max()) if m else 0.0
    for _ in range(max_rounds):
        a = label
        # max over groups other than a = label[i] and b, from the three largest times
        top = np.argsort(-t, kind="stable")[:3]
        others = np.zeros((n, m))
        for g in top[::-1]:
            others = np.where((a[:, None] != g) & (np.arange(m)[None, :] != g), t[g], others)
        delta_sum = rem[:, None] + ins - t[a][:, None] - t[None, :]
        new_max = np.maximum(np.maximum(others, rem[:, None]), ins)
        bubble = slope * new_max if slope else 0.0          # no 0 * inf with one stage
        gain = objective - ((t.sum() + delta_sum) / dp_degree + bubble)
        gain[ids, a] = -np.inf
        i, b = np.unravel_index(np.argmax(gain), gain.shape)
        if not gain[i, b] > 1e-9 * max(objective, 1.0):
            break
        moves = [(int(i), int(b))]
        touched = {int(a[i]), int(b)}
        ceiling = new_max[i, b]
        # more moves in the same round: disjoint groups, lower sum, no time above the ceiling
        ok = (delta_sum < 0) & (ins <= ceiling) & (rem[:, None] <= ceiling)
        ok[ids, a] = False
        cand_b = np.argmin(np.where(ok, delta_sum, np.inf), axis=1)
        cand_gain = -delta_sum[ids, cand_b]
        for j in np.argsort(-np.where(ok[ids, cand_b], cand_gain, -np.inf), kind="stable"):
            if not ok[j, cand_b[j]]:
                break
            src, dst = int(a[j]), int(cand_b[j])
            if src in touched or dst in touched:
                continue
            moves.append((int(j), dst))
            touched.update((src, dst))
        for j, dst in moves:
            label[j] = dst
        gs = np.array(sorted(touched))
        restat(gs)
        recost(gs, np.flatnonzero(np.isin(label, gs)))
        objective = float(t.sum() / dp_degree + slope * t.max())
    out = [np.flatnonzero(label == g) for g in range(m)]
    return [g for g in out if len(g)], objective


def groups_order(enc: np.ndarray, dec: np.ndarray, groups: list[np.ndarray]) -> np.ndarray:
    """Concatenate groups by (max encoder, max decoder) length, each by (encoder, decoder)."""
    enc = np.asarray(enc)
    dec = np.asarray(dec)
    keys = [(int(enc[g].max()), int(dec[g].max())) for g in groups]
    pieces = [groups[k][np.lexsort((dec[groups[k]], enc[groups[k]]))]
              for k in sorted(range(len(groups)), key=lambda k: keys[k])]
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
