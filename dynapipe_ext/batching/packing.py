"""Sequence packing into fixed-length rows: greedy next-fit (the Megatron-style baseline) and the
histogram packers of Krell et al. (arXiv 2107.02027): SPFHP, LPFHP and NNLSHP. `spfhp` gives the
reference code's pack counts; `spfhp-grouped` lets a new pack take several sequences of the
length that opened it, which never made more packs on the public histograms.

Histogram packers work on `hist`, an int array where hist[L] is the number of sequences of
length L (hist[0] must be 0, len(hist) - 1 <= row_len). They return *strategies*: a pack (a tuple
of lengths, longest first) and how many packs of that kind to build. The sample-level functions
map strategies back to concrete sample ids deterministically.

T5 samples are (encoder, decoder) pairs: `pack_pairs` packs them with both row lengths held, as a
2-D bin problem (SPFHP / LPFHP) or by NNLS on the dominant side with a check on the other
(NNLSHP). `next_fit_order` orders packed rows so that next-fit over them rebuilds them (how
dataset-level packing hands its rows to the per-batch planner)."""
from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass

import numpy as np

ALGORITHMS = ("nextfit", "spfhp", "spfhp-grouped", "lpfhp", "nnlshp")
HISTOGRAM_ALGORITHMS = ALGORITHMS[1:]   # all but next-fit pack a length histogram
NNLS_MAX_STRATEGIES = 100_000   # beyond this the dense NNLS system gets too big to solve quickly
NNLS_MAX_ENTRIES = 30_000_000   # lengths x strategies of the dense NNLS matrix (240 MB)
NNLS_DEFAULT_DEPTH = 3          # Krell et al.'s depth for NNLSHP when none is given


@dataclass(frozen=True)
class HistogramPacking:
    """Result of packing a histogram: `strategies` = ((lengths of one pack), number of packs)."""

    strategies: tuple[tuple[tuple[int, ...], int], ...]
    row_len: int

    @property
    def packs(self) -> int:
        return sum(count for _, count in self.strategies)

    @property
    def sequences(self) -> int:
        return sum(len(pack) * count for pack, count in self.strategies)

    @property
    def tokens(self) -> int:
        return sum(sum(pack) * count for pack, count in self.strategies)

    @property
    def efficiency(self) -> float:
        """Real tokens / token slots (packs * row_len); 1.0 for an empty packing."""
        return self.tokens / (self.packs * self.row_len) if self.packs else 1.0

    def histogram(self) -> np.ndarray:
        """Counts per length of the packed sequences (index = length)."""
        hist = np.zeros(self.row_len + 1, dtype=np.int64)
        for pack, count in self.strategies:
            for length in pack:
                hist[length] += count
        return hist


# ---------------------------------------------------------------- validation helpers

def _check_depth(max_depth: int | None) -> int | None:
    if max_depth is not None and (not isinstance(max_depth, (int, np.integer)) or max_depth < 1):
        raise ValueError(f"max_depth must be a positive integer or None, got {max_depth!r}")
    return None if max_depth is None else int(max_depth)


def _check_row_len(row_len: int) -> int:
    if not isinstance(row_len, (int, np.integer)) or row_len < 1:
        raise ValueError(f"row_len must be a positive integer, got {row_len!r}")
    return int(row_len)


def _check_algorithm(algorithm: str, allowed: tuple[str, ...]) -> None:
    if algorithm not in allowed:
        raise ValueError(f"unknown packing algorithm {algorithm!r}; choose one of {allowed}")


def check_lengths(lengths, row_len: int, what: str = "sample") -> np.ndarray:
    """Sample lengths as an int64 array; a length < 1 or > row_len is a ValueError naming the
    sample index, its length and the limit."""
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise ValueError(f"{what} lengths must be 1-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        if not np.all(np.equal(np.mod(arr, 1), 0)):
            bad = int(np.flatnonzero(np.mod(arr, 1))[0])
            raise ValueError(f"{what} {bad} has a non-integer length {arr[bad]!r}")
    arr = arr.astype(np.int64)
    too_short = np.flatnonzero(arr < 1)
    if too_short.size:
        i = int(too_short[0])
        raise ValueError(f"{what} {i} has length {arr[i]}; every sample needs at least 1 token")
    too_long = np.flatnonzero(arr > row_len)
    if too_long.size:
        i = int(too_long[0])
        raise ValueError(f"{what} {i} has length {arr[i]}, longer than the row length limit "
                         f"{row_len} ({too_long.size} sample(s) too long)")
    return arr


def check_histogram(hist, row_len: int) -> np.ndarray:
    """Histogram as int64 array of size row_len + 1 (index = length)."""
    arr = np.asarray(hist)
    if arr.ndim != 1:
        raise ValueError(f"histogram must be 1-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"histogram counts must be integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    if arr.size and arr.min() < 0:
        i = int(np.argmin(arr))
        raise ValueError(f"histogram count for length {i} is negative ({arr[i]})")
    if arr.size and arr[0]:
        raise ValueError(f"histogram holds {arr[0]} sequences of length 0")
    nonzero = np.flatnonzero(arr)
    if nonzero.size and nonzero[-1] > row_len:
        raise ValueError(f"histogram holds {arr[nonzero[-1]]} sequences of length {nonzero[-1]}, "
                         f"longer than the row length limit {row_len}")
    out = np.zeros(row_len + 1, dtype=np.int64)
    out[:min(arr.size, row_len + 1)] = arr[:row_len + 1]
    return out


def histogram_of(lengths, row_len: int) -> np.ndarray:
    """Histogram (index = length) of validated sample lengths."""
    row_len = _check_row_len(row_len)
    arr = check_lengths(lengths, row_len)
    return np.bincount(arr, minlength=row_len + 1).astype(np.int64)


# ---------------------------------------------------------------- histogram packers

def _fit_histogram(hist: np.ndarray, row_len: int, max_depth: int | None,
                   worst_fit: bool, group_new: bool = True) -> Counter:
    """Longest sequences first; each batch of equal-length sequences goes into the open pack
    group with the most (worst fit, SPFHP) or least (best fit, LPFHP) room that still fits, one
    sequence per pack of the group. Sequences that fit nowhere open new packs: one pack per
    sequence when `group_new` is False (Krell et al.'s SPFHP exactly: packs opened for a length
    take no more of that length), else as many per pack as fit, so equal lengths pair up as
    one-by-one worst fit does ("spfhp-grouped", never more packs on the public histograms).
    Groups of identical packs are one (count, pack) entry: O(S^2 + groups) work, independent of
    the number of sequences."""
    depth_cap = max_depth if max_depth is not None else row_len
    open_by_room: list[list[list]] = [[] for _ in range(row_len + 1)]  # room -> [[count, pack]]
    done: Counter = Counter()

    def add(pack: tuple[int, ...], count: int, room: int) -> None:
        if room == 0 or len(pack) >= depth_cap:
            done[pack] += count
        else:
            open_by_room[room].append([count, pack])

    top = 0  # highest room with an open group (upper bound)
    for length in range(row_len, 0, -1):
        todo = int(hist[length])
        room = top if worst_fit else length
        while todo > 0:
            # find a group that fits: scan down from the top (worst) or up from `length` (best)
            if worst_fit:
                while room >= length and not open_by_room[room]:
                    room -= 1
                found = room >= length
            else:
                while room <= top and not open_by_room[room]:
                    room += 1
                found = room <= top
            if not found:
                # new packs: one sequence each (reference), or as many of these as fit
                per_pack = min(row_len // length, depth_cap) if group_new else 1
                full, rest = divmod(todo, per_pack)
                if full:
                    add((length,) * per_pack, full, row_len - per_pack * length)
                if rest:
                    add((length,) * rest, 1, row_len - rest * length)
                top = max(top, row_len - length)
                break
            group = open_by_room[room][-1]
            take = min(group[0], todo)
            if take == group[0]:
                open_by_room[room].pop()
            else:
                group[0] -= take
            todo -= take
            add(group[1] + (length,), take, room - length)
            if not worst_fit and room - length >= length:
                room = room - length  # the packs just extended may be the best fit now
    for groups in open_by_room:
        for count, pack in groups:
            done[pack] += count
    return done


def _exact_fill_strategies(parts: list[int], row_len: int, max_depth: int) -> list[tuple[int, ...]]:
    """All packs (non-increasing tuples over `parts`) of at most `max_depth` sequences whose
    lengths sum to exactly `row_len`."""
    parts_desc = sorted(set(parts), reverse=True)
    present = set(parts_desc)
    out: list[tuple[int, ...]] = []

    def extend(prefix: tuple[int, ...], room: int, cap: int, depth_left: int) -> None:
        if room <= cap and room in present:
            out.append(prefix + (room,))
        if depth_left <= 1:
            return
        for part in parts_desc:
            if part > cap or part >= room:
                continue
            if part * depth_left < room:
                break  # even depth_left copies of the biggest allowed part cannot fill the room
            extend(prefix + (part,), room - part, part, depth_left - 1)
            if len(out) > NNLS_MAX_STRATEGIES:
                raise ValueError(f"NNLSHP: more than {NNLS_MAX_STRATEGIES} pack strategies at "
                                 f"depth {max_depth} for row length {row_len}; use a smaller "
                                 f"--max-pack-depth or SPFHP")

    extend((), row_len, row_len, max_depth)
    return out


def _nnls_exact_fill(hist: np.ndarray, row_len: int, depth: int) -> tuple[Counter, np.ndarray]:
    """NNLSHP's first step: repeat counts of exact-fill packs (lengths summing to `row_len`, at
    most `depth` of them) chosen by non-negative least squares against the histogram
    (residuals weighted by length, i.e. in tokens), rounded down, with packs taken back where
    rounding still over-uses a length. Returns (packs, histogram of what is left)."""
    from scipy.optimize import nnls

    present = [int(x) for x in np.flatnonzero(hist)]
    done: Counter = Counter()
    if not present:
        return done, hist.copy()
    strategies = _exact_fill_strategies(present, row_len, depth)
    if not strategies:
        return done, hist.copy()
    if len(present) * len(strategies) > NNLS_MAX_ENTRIES:
        raise ValueError(f"NNLSHP: {len(strategies)} pack strategies over {len(present)} "
                         f"lengths at depth {depth} for row length {row_len} make an NNLS "
                         f"system too big to solve here; use a smaller --max-pack-depth, or "
                         f"SPFHP / LPFHP")
    row_of = {length: i for i, length in enumerate(present)}
    uses = np.zeros((len(present), len(strategies)), dtype=np.float64)
    for j, pack in enumerate(strategies):
        for length in pack:
            uses[row_of[length], j] += 1
    weight = np.asarray(present, dtype=np.float64)
    target = hist[present].astype(np.float64)
    solution, _ = nnls(uses * weight[:, None], target * weight, maxiter=50 * len(strategies))
    counts = np.floor(solution + 1e-9).astype(np.int64)
    uses_int = uses.astype(np.int64)
    residual = hist[present] - uses_int @ counts
    # repair: where rounding left a length over-used, drop packs using it (biggest count first)
    for i in np.flatnonzero(residual < 0):
        users = [j for j in np.flatnonzero(uses_int[i]) if counts[j] > 0]
        users.sort(key=lambda j: (-counts[j], strategies[j]))
        for j in users:
            if residual[i] >= 0:
                break
            drop = min(int(counts[j]), -(int(residual[i]) // int(uses_int[i, j])))
            counts[j] -= drop
            residual += uses_int[:, j] * drop
    for j in np.flatnonzero(counts):
        done[strategies[j]] += int(counts[j])
    left = np.zeros_like(hist)
    left[present] = residual
    return done, left


def _nnls_histogram(hist: np.ndarray, row_len: int, max_depth: int | None) -> Counter:
    """NNLSHP: exact-fill packs by NNLS (_nnls_exact_fill), the rest packed with SPFHP."""
    depth = max_depth if max_depth is not None else NNLS_DEFAULT_DEPTH
    done, left = _nnls_exact_fill(hist, row_len, depth)
    done.update(_fit_histogram(left, row_len, max_depth, worst_fit=True))
    return done


def pack_histogram(hist, row_len: int, algorithm: str = "spfhp",
                   max_depth: int | None = None) -> HistogramPacking:
    """Pack a length histogram (hist[L] = number of sequences of length L) into rows of
    `row_len` tokens holding at most `max_depth` sequences each (None = no limit; NNLSHP then
    uses depth 3). `nextfit` is not a histogram algorithm: use pack_sequences for it."""
    _check_algorithm(algorithm, HISTOGRAM_ALGORITHMS)
    row_len = _check_row_len(row_len)
    max_depth = _check_depth(max_depth)
    hist = check_histogram(hist, row_len)
    if algorithm == "nnlshp":
        found = _nnls_histogram(hist, row_len, max_depth)
    else:
        found = _fit_histogram(hist, row_len, max_depth, worst_fit=algorithm.startswith("spfhp"),
                               group_new=(algorithm != "spfhp"))
    strategies = tuple(sorted(((tuple(sorted(p, reverse=True)), c) for p, c in found.items()
                               if c > 0), key=lambda pc: (-sum(pc[0]), pc[0])))
    return HistogramPacking(strategies=strategies, row_len=row_len)


# ---------------------------------------------------------------- sample-level packers

def _next_fit(lengths: np.ndarray, row_len: int, max_depth: int | None) -> list[list[int]]:
    rows: list[list[int]] = []
    current: list[int] = []
    used = 0
    cap = max_depth if max_depth is not None else len(lengths) + 1
    for i, length in enumerate(lengths.tolist()):
        if current and (used + length > row_len or len(current) >= cap):
            rows.append(current)
            current, used = [], 0
        current.append(i)
        used += length
    if current:
        rows.append(current)
    return rows


def assign_samples(packing: HistogramPacking, lengths: np.ndarray) -> list[list[int]]:
    """Concrete rows of sample ids for a histogram packing: within each length, samples are
    taken in index order, strategies in packing order; rows are sorted by their first id."""
    order = np.argsort(lengths, kind="stable")
    starts = np.searchsorted(lengths[order], np.arange(packing.row_len + 2))
    next_of = starts[:-1].copy()  # next unused position in `order` for each length
    rows: list[list[int]] = []
    for pack, count in packing.strategies:
        for _ in range(count):
            row = []
            for length in pack:
                pos = next_of[length]
                if pos >= starts[length + 1]:
                    raise AssertionError(f"packing uses more sequences of length {length} "
                                         f"than the input holds")
                row.append(int(order[pos]))
                next_of[length] = pos + 1
            rows.append(row)
    rows.sort(key=min)
    return rows


def pack_sequences(lengths: np.ndarray, row_len: int, algorithm: str = "nextfit",
                   max_depth: int | None = None) -> list[list[int]]:
    """Rows of sample indices, each row's lengths summing to <= row_len with <= max_depth samples;
    every sample appears exactly once. `nextfit` keeps the given order (a new row starts when the
    next sample does not fit); histogram algorithms map their strategies to ids deterministically."""
    _check_algorithm(algorithm, ALGORITHMS)
    row_len = _check_row_len(row_len)
    max_depth = _check_depth(max_depth)
    arr = check_lengths(lengths, row_len)
    if arr.size == 0:
        return []
    if algorithm == "nextfit":
        return _next_fit(arr, row_len, max_depth)
    hist = np.bincount(arr, minlength=row_len + 1)
    return assign_samples(pack_histogram(hist, row_len, algorithm, max_depth), arr)


def _pair_next_fit(enc: np.ndarray, dec: np.ndarray, enc_row_len: int, dec_row_len: int,
                   max_depth: int | None) -> list[list[int]]:
    rows: list[list[int]] = []
    current: list[int] = []
    used_enc = used_dec = 0
    cap = max_depth if max_depth is not None else enc.size + 1
    for i, (e, d) in enumerate(zip(enc.tolist(), dec.tolist())):
        if current and (used_enc + e > enc_row_len or used_dec + d > dec_row_len
                        or len(current) >= cap):
            rows.append(current)
            current, used_enc, used_dec = [], 0, 0
        current.append(i)
        used_enc += e
        used_dec += d
    if current:
        rows.append(current)
    return rows


def _pair_fit(enc: np.ndarray, dec: np.ndarray, ids: np.ndarray, enc_row_len: int,
              dec_row_len: int, max_depth: int | None, worst_fit: bool) -> list[list[int]]:
    """SPFHP (worst fit) / LPFHP (best fit) on (encoder, decoder) pairs, as 2-D bin packing.
    Sizes and rooms are measured on each side as a share of that side's row length. Samples
    `ids` go largest first (by their larger share; ties: longer encoder, longer decoder, lower
    id), each into an open row where both sides fit: worst fit takes the row whose tighter side
    keeps the most room (most room for what comes, as SPFHP), best fit the row with the least
    room left on both sides together (as LPFHP). A sample that fits no open row opens a new
    one; a row closes when it holds max_depth samples. Rows list their samples in placement
    order (the opener first). Of the variants tried on the FLAN-like sample (order by the sum
    or the larger share or the encoder; room by the sum, the tighter or the looser side or the
    encoder) these packed into the fewest rows."""
    if ids.size == 0:
        return []
    e_all, d_all = enc[ids], dec[ids]
    size = np.maximum(e_all * dec_row_len, d_all * enc_row_len)   # larger share x both limits
    order = ids[np.lexsort((ids, -d_all, -e_all, -size))]
    cap = max_depth if max_depth is not None else ids.size + 1
    # open rows, compacted now and then: room on each side, depth, row index
    room_e = np.empty(0, dtype=np.int64)
    room_d = np.empty(0, dtype=np.int64)
    depth = np.empty(0, dtype=np.int64)
    row_of = np.empty(0, dtype=np.int64)
    rows: list[list[int]] = []
    # the smallest encoder / decoder length still to come: rows with less room are done
    rest_e = np.minimum.accumulate(enc[order][::-1])[::-1]
    rest_d = np.minimum.accumulate(dec[order][::-1])[::-1]
    for k, i in enumerate(order.tolist()):
        e, d = int(enc[i]), int(dec[i])
        if k % 64 == 0 and row_of.size:
            keep = (room_e >= rest_e[k]) & (room_d >= rest_d[k]) & (depth < cap)
            room_e, room_d, depth, row_of = room_e[keep], room_d[keep], depth[keep], row_of[keep]
        fits = np.flatnonzero((room_e >= e) & (room_d >= d) & (depth < cap))
        if fits.size:
            left_e, left_d = (room_e[fits] - e) * dec_row_len, (room_d[fits] - d) * enc_row_len
            if worst_fit:
                j = int(fits[np.argmax(np.minimum(left_e, left_d))])
            else:
                j = int(fits[np.argmin(left_e + left_d)])
            room_e[j] -= e
            room_d[j] -= d
            depth[j] += 1
            rows[int(row_of[j])].append(i)
        else:
            rows.append([i])
            room_e = np.append(room_e, enc_row_len - e)
            room_d = np.append(room_d, dec_row_len - d)
            depth = np.append(depth, 1)
            row_of = np.append(row_of, len(rows) - 1)
    return rows


def _pair_nnls(enc: np.ndarray, dec: np.ndarray, enc_row_len: int, dec_row_len: int,
               max_depth: int | None) -> list[list[int]]:
    """NNLSHP on pairs: NNLS over the histogram of the dominant side (the one whose tokens fill
    more rows, sum / row length) picks exact-fill packs for that side (_nnls_exact_fill). Each
    pack is then filled with concrete samples of its lengths whose other sides fit their row
    (_fill_exact_pack); where even the shortest other sides do not fit, the packs of that kind
    still unbuilt are given up. Every sample not in an exact-fill pack is packed by the pair
    SPFHP (_pair_fit)."""
    depth = max_depth if max_depth is not None else NNLS_DEFAULT_DEPTH
    enc_side = enc.sum() * dec_row_len >= dec.sum() * enc_row_len
    main, other = (enc, dec) if enc_side else (dec, enc)
    main_len, other_len = (enc_row_len, dec_row_len) if enc_side else (dec_row_len, enc_row_len)
    packs, _ = _nnls_exact_fill(np.bincount(main, minlength=main_len + 1), main_len, depth)
    # per main length: sample ids sorted by (other length, id), as a list of (other, id)
    pools: dict[int, list[tuple[int, int]]] = {}
    for i in np.lexsort((np.arange(main.size), other, main)).tolist():
        pools.setdefault(int(main[i]), []).append((int(other[i]), i))
    rows: list[list[int]] = []
    for pack, count in sorted(packs.items(), key=lambda pc: (-pc[1], pc[0])):
        for _ in range(count):
            row = _fill_exact_pack(pack, pools, other_len)
            if row is None:
                break
            rows.append(row)
    placed = np.zeros(main.size, dtype=bool)
    for row in rows:
        placed[row] = True
    rows.extend(_pair_fit(enc, dec, np.flatnonzero(~placed), enc_row_len, dec_row_len,
                          max_depth, worst_fit=True))
    return rows


def _fill_exact_pack(pack: tuple[int, ...], pools: dict[int, list[tuple[int, int]]],
                     other_len: int) -> list[int] | None:
    """Sample ids for one exact-fill pack of main-side lengths `pack` whose other sides fit
    `other_len`, taken out of `pools` (per main length, (other length, id) ascending); None,
    pools unchanged, when even the shortest other sides do not fit. Starts from the shortest
    other sides, then lets each part in turn take the longest other side that still fits, so
    that long other sides are used here rather than left over."""
    need = Counter(pack)
    if any(len(pools.get(length, ())) < n for length, n in need.items()):
        return None
    chosen: list[tuple[int, int]] = []         # per part: (other, id)
    seen: Counter = Counter()
    for length in pack:
        chosen.append(pools[length][seen[length]])
        seen[length] += 1
    slack = other_len - sum(o for o, _ in chosen)
    if slack < 0:
        return None
    for k, length in enumerate(pack):
        pool, current = pools[length], chosen[k]
        in_use = {c for m, c in zip(pack, chosen) if m == length}
        pos = bisect.bisect_right(pool, (current[0] + slack, np.iinfo(np.int64).max)) - 1
        while pos >= 0 and pool[pos] in in_use and pool[pos] != current:
            pos -= 1
        if pos >= 0 and pool[pos][0] > current[0]:
            slack -= pool[pos][0] - current[0]
            chosen[k] = pool[pos]
    for length, item in zip(pack, chosen):
        pools[length].remove(item)
    return [i for _, i in chosen]


def pack_pairs(enc_lengths, dec_lengths, enc_row_len: int, dec_row_len: int,
               algorithm: str = "nextfit", max_depth: int | None = None) -> list[list[int]]:
    """T5 packing: rows of sample ids whose encoder lengths fit `enc_row_len` and decoder lengths
    fit `dec_row_len` (both sides, same samples), at most `max_depth` samples a row; every
    sample exactly once. `nextfit` keeps the given order. The others pack the pairs as a 2-D
    bin problem: `spfhp` worst fit and `lpfhp` best fit, longest pairs first (_pair_fit;
    `spfhp-grouped` is `spfhp` here: equal pairs are rare, so no grouping); `nnlshp` chooses
    exact-fill packs of the dominant side by NNLS and fills them with samples whose other side
    fits, the rest by pair SPFHP (_pair_nnls). Rows list their samples opener first."""
    _check_algorithm(algorithm, ALGORITHMS)
    enc_row_len, dec_row_len = _check_row_len(enc_row_len), _check_row_len(dec_row_len)
    max_depth = _check_depth(max_depth)
    enc = check_lengths(enc_lengths, enc_row_len, what="sample (encoder)")
    dec = check_lengths(dec_lengths, dec_row_len, what="sample (decoder)")
    if enc.shape != dec.shape:
        raise ValueError(f"{enc.size} encoder lengths but {dec.size} decoder lengths")
    if enc.size == 0:
        return []
    if algorithm == "nextfit":
        return _pair_next_fit(enc, dec, enc_row_len, dec_row_len, max_depth)
    if algorithm == "nnlshp":
        return _pair_nnls(enc, dec, enc_row_len, dec_row_len, max_depth)
    return _pair_fit(enc, dec, np.arange(enc.size), enc_row_len, dec_row_len, max_depth,
                     worst_fit=algorithm != "lpfhp")


def next_fit_order(rows: list[list[int]], lengths, row_lens, max_depth: int | None = None
                   ) -> list[list[int]]:
    """The rows reordered so that next-fit over their concatenation (pack_sequences /
    pack_pairs with "nextfit") rebuilds exactly these rows: row B may follow row A when A is
    at max_depth or B's first sample does not fit A's room on some side. `lengths`: (n,) or
    (n, sides); `row_lens`: the row length of each side. Rows of the histogram and pair packers
    list their opener first, and a row is opened only for a sample that fits no row open then,
    so of any two rows one may follow the other: a Hamiltonian path of that relation exists
    and is built by insertion (Redei's theorem). Where a pair allows neither order (reference
    SPFHP's new packs of one length, next-fit's own rows) the row is appended and next-fit may
    merge it with the one before: fewer rows, every limit still held."""
    arr = np.asarray(lengths, dtype=np.int64).reshape(len(lengths), -1)
    limits = np.asarray(row_lens, dtype=np.int64).reshape(-1)
    cap = max_depth if max_depth is not None else arr.shape[0] + 1
    room = [limits - arr[row].sum(axis=0) for row in rows]

    def may_follow(a: int, b: int) -> bool:
        return len(rows[a]) >= cap or bool((arr[rows[b][0]] > room[a]).any())

    path: list[int] = []
    for v in range(len(rows)):
        if not path or may_follow(v, path[0]):
            path.insert(0, v)
        elif may_follow(path[-1], v):
            path.append(v)
        else:
            at = next((k + 1 for k in range(len(path) - 1)
                       if may_follow(path[k], v) and may_follow(v, path[k + 1])), len(path))
            path.insert(at, v)
    return [rows[v] for v in path]


def rows_efficiency(rows: list[list[int]], lengths, row_len: int) -> float:
    """Real tokens / (rows * row_len) for sample-level packed rows."""
    arr = np.asarray(lengths, dtype=np.int64)
    return float(arr.sum() / (len(rows) * row_len)) if rows else 1.0


def count_next_fit_rows(lengths, row_len: int, max_depth: int | None = None) -> int:
    """Number of rows next-fit builds for `lengths` in the given order (no row lists kept, so it
    scales to millions of sequences)."""
    row_len = _check_row_len(row_len)
    max_depth = _check_depth(max_depth)
    arr = check_lengths(lengths, row_len)
    cap = max_depth if max_depth is not None else arr.size + 1
    rows = used = depth = 0
    for length in arr.tolist():
        if depth and (used + length > row_len or depth >= cap):
            used = depth = 0
        if depth == 0:
            rows += 1
        used += length
        depth += 1
    return rows
