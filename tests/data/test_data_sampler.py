"""GlobalBatchSampler: token budget, FLAN-style mixing rates, determinism and exact resume."""
import numpy as np
import pytest

from dynapipe_ext.batching.packing import pack_pairs, pack_sequences
from megatron.data.sampler import STREAM_BLOCK, GlobalBatchSampler, PackingWindow, mixing_rates


def make_data(seed=0, sizes=(3000, 400, 60, 5)):
    rng = np.random.default_rng(seed)
    task_ids = np.concatenate([np.full(n, t) for t, n in enumerate(sizes)])
    lengths = rng.integers(1, 300, size=len(task_ids))
    lengths[rng.choice(len(lengths), 20)] = 2000   # a long tail
    return lengths, task_ids


def test_every_batch_fits_the_budget_and_is_maximal():
    lengths, tasks = make_data()
    sampler = GlobalBatchSampler(lengths, tasks, tokens_per_global_batch=4096, seed=3)
    for it in range(40):
        batch = sampler.batch(it)
        assert lengths[batch].sum() <= 4096
        next_sample = sampler.stream(sampler.consumed_before(it + 1), 1)[0]
        assert lengths[batch].sum() + lengths[next_sample] > 4096
        assert sampler.batch_costs(it).tolist() == lengths[batch].tolist()


def test_t5_budget_counts_encoder_and_decoder_tokens():
    lengths, tasks = make_data()
    pairs = np.stack([lengths, lengths // 3 + 1], axis=1)
    sampler = GlobalBatchSampler(pairs, tasks, tokens_per_global_batch=5000, seed=3)
    for it in range(20):
        assert pairs[sampler.batch(it)].sum() <= 5000
    assert sampler.costs.tolist() == pairs.sum(axis=1).tolist()


def test_sample_longer_than_budget_is_an_error_naming_it():
    lengths, tasks = make_data()
    with pytest.raises(ValueError, match=r"20 samples exceed tokens_per_global_batch=1999.*2000"):
        GlobalBatchSampler(lengths, tasks, tokens_per_global_batch=1999,
                           task_names=["a", "b", "c", "d"])


def test_max_samples_per_batch():
    lengths, tasks = make_data()
    sampler = GlobalBatchSampler(lengths, tasks, 10**6, max_samples_per_batch=32)
    assert all(len(sampler.batch(i)) == 32 for i in range(5))


def test_mixing_rates_are_examples_proportional_with_a_cap():
    tasks = np.repeat([0, 1, 2, 3], [1000, 100, 10, 0])
    rates = mixing_rates(tasks, num_tasks=4, cap=200)
    assert rates == pytest.approx(np.array([200, 100, 10, 0]) / 310)
    assert mixing_rates(tasks) == pytest.approx(np.array([1000, 100, 10]) / 1110)
    # temperature 2 flattens: rate ~ sqrt(min(n, cap))
    flat = np.sqrt([200, 100, 10])
    assert mixing_rates(tasks, cap=200, temperature=2.0) == pytest.approx(flat / flat.sum())


def test_stream_follows_the_mixing_rates():
    lengths, tasks = make_data()
    sampler = GlobalBatchSampler(lengths, tasks, 4096, seed=7, mixing_cap=500)
    n = 40_000
    drawn = np.bincount(tasks[sampler.stream(0, n)], minlength=4) / n
    expected = np.array([500, 400, 60, 5]) / 965
    assert np.all(np.abs(drawn - expected) < 4 * np.sqrt(expected * (1 - expected) / n))


def test_each_task_is_seen_once_per_pass_before_repeating():
    lengths, tasks = make_data()
    sampler = GlobalBatchSampler(lengths, tasks, 4096, seed=7, mixing_cap=500)
    stream = sampler.stream(0, 30_000)
    for t, n in enumerate([3000, 400, 60, 5]):
        mine = stream[tasks[stream] == t]
        assert len(mine) >= n
        assert sorted(mine[:n].tolist()) == np.flatnonzero(tasks == t).tolist()


def test_stream_is_the_same_however_it_is_read():
    lengths, tasks = make_data()
    a = GlobalBatchSampler(lengths, tasks, 4096, seed=5)
    b = GlobalBatchSampler(lengths, tasks, 4096, seed=5)
    whole = a.stream(0, 2 * STREAM_BLOCK + 100)
    assert b.stream(2 * STREAM_BLOCK - 3, 50).tolist() == whole[2 * STREAM_BLOCK - 3:
                                                                 2 * STREAM_BLOCK + 47].tolist()
    assert b.stream(STREAM_BLOCK - 2, 4).tolist() == whole[STREAM_BLOCK - 2:STREAM_BLOCK + 2]\
        .tolist()


def test_deterministic_by_seed():
    lengths, tasks = make_data()
    a = GlobalBatchSampler(lengths, tasks, 4096, seed=11, mixing_cap=300)
    b = GlobalBatchSampler(lengths, tasks, 4096, seed=11, mixing_cap=300)
    c = GlobalBatchSampler(lengths, tasks, 4096, seed=12, mixing_cap=300)
    assert all(np.array_equal(a.batch(i), b.batch(i)) for i in range(30))
    assert not all(np.array_equal(a.batch(i), c.batch(i)) for i in range(30))


def test_resume_from_consumed_samples_gives_the_same_batches():
    lengths, tasks = make_data()
    run = GlobalBatchSampler(lengths, tasks, 4096, seed=9, mixing_cap=800)
    batches, consumed, state = [], 0, None
    for it, batch in zip(range(60), run.batches()):
        if it == 25:
            state = run.state_dict(consumed)
        batches.append(batch)
        consumed += len(batch)
    resumed = GlobalBatchSampler(lengths, tasks, 4096, seed=9, mixing_cap=800)
    after = [b for _, b in zip(range(35), resumed.resume_from(state))]
    assert all(np.array_equal(x, y) for x, y in zip(after, batches[25:]))
    fresh = GlobalBatchSampler(lengths, tasks, 4096, seed=9, mixing_cap=800)
    assert np.array_equal(fresh.batch(40), batches[40])        # random access by iteration
    assert fresh.iteration_of(state["consumed_samples"]) == 25
    assert fresh.consumed_before(25) == state["consumed_samples"]


def test_resume_with_other_settings_or_off_boundary_is_an_error():
    lengths, tasks = make_data()
    run = GlobalBatchSampler(lengths, tasks, 4096, seed=9)
    other = GlobalBatchSampler(lengths, tasks, 4096, seed=10)
    with pytest.raises(ValueError, match="seed was 9 when the checkpoint was written, this "
                                         "run has 10"):
        next(other.resume_from(run.state_dict(100)))
    with pytest.raises(ValueError, match="not a batch boundary"):
        run.iteration_of(run.consumed_before(3) + 1)


def test_the_state_records_the_settings_and_a_resume_names_the_first_that_differs():
    lengths, tasks = make_data()
    flags = {"--mixing-cap": None, "--global-batch-size": 8, "--data-path weights": [0.3, 0.7]}
    run = GlobalBatchSampler(lengths, tasks, 4096, seed=9, settings=flags)
    state = run.state_dict(0)
    assert state["settings"] == flags
    GlobalBatchSampler(lengths, tasks, 4096, seed=9, settings=dict(flags)).check_resume(state)
    for name, now, shown in (("--mixing-cap", 500, "was unset when the checkpoint was written, "
                                                   "this run has 500"),
                             ("--global-batch-size", 16, "was 8 when"),
                             ("--data-path weights", (0.5, 0.5), "was 0.3 0.7 when the "
                                                                 "checkpoint was written, this "
                                                                 "run has 0.5 0.5")):
        other = GlobalBatchSampler(lengths, tasks, 4096, seed=9, settings={**flags, name: now})
        with pytest.raises(ValueError) as err:
            other.check_resume(state)
        assert str(err.value).startswith(f"{name} {shown}") and "\n" not in str(err.value)
    # a setting the checkpoint did not record yet is not compared
    newer = GlobalBatchSampler(lengths, tasks, 4096, seed=9,
                               settings={**flags, "--mixing-temperature": 2.0})
    newer.check_resume(state)


def test_bad_arguments():
    lengths, tasks = make_data()
    with pytest.raises(ValueError, match="disagree"):
        GlobalBatchSampler(lengths[:-1], tasks, 4096)
    with pytest.raises(ValueError, match="cap"):
        GlobalBatchSampler(lengths, tasks, 4096, mixing_cap=0)


# ---- dataset-level packing (--packing-window) -------------------------------------------------

def flan_like_lengths(n, seed=0, sides=1):
    """Lengths shaped like the FLAN-like sample: log-normal with a few long documents, cut at
    2048 (T5: decoder lengths 1..512, a third of them single-token answers)."""
    rng = np.random.default_rng(seed)
    gpt = rng.lognormal(np.log(90), 1.0, size=n)
    gpt[rng.random(n) < 0.03] *= 12
    gpt = np.clip(gpt.astype(np.int64), 1, 2048)
    if sides == 1:
        return gpt
    dec = np.where(rng.random(n) < 0.33, 1, rng.lognormal(np.log(25), 1.0, size=n))
    return np.stack([gpt, np.clip(dec.astype(np.int64), 1, 512)], axis=1)


def packed_sampler(lengths, tasks, algorithm="lpfhp", window=3000, budget=8192, seed=4,
                   max_depth=None):
    rows = (2048,) if lengths.ndim == 1 else (2048, 512)
    return GlobalBatchSampler(lengths, tasks, budget, seed=seed,
                              packing=PackingWindow(window, algorithm, rows, max_depth))


def next_fit_rows(lengths, batch, max_depth=None):
    """The rows `--micro-batching packing` makes of a batch in window mode (next-fit)."""
    if lengths.ndim == 1:
        return pack_sequences(lengths[batch], 2048, "nextfit", max_depth)
    return pack_pairs(lengths[batch, 0], lengths[batch, 1], 2048, 512, "nextfit", max_depth)


@pytest.mark.parametrize("algorithm", ["nextfit", "spfhp", "lpfhp", "nnlshp"])
def test_packing_window_batches_are_whole_rows_of_every_window_sample(algorithm):
    lengths = flan_like_lengths(5000)
    tasks = np.arange(5000) % 7
    depth = 3 if algorithm == "nnlshp" else 12
    sampler = packed_sampler(lengths, tasks, algorithm, window=1500, max_depth=depth)
    window_rows = sampler.packing.pack(lengths[sampler.stream(0, 1500)])
    seen, it = [], 0
    while sampler.consumed_before(it) < 1500:    # the batches of window 0
        batch = sampler.batch(it)
        assert lengths[batch].sum() <= 8192
        rows = next_fit_rows(lengths, batch, depth)
        assert all(len(r) <= depth and lengths[batch[r]].sum() <= 2048 for r in rows)
        seen.extend(sorted(batch[r].tolist()) for r in rows)
        it += 1
    assert sampler.consumed_before(it) == 1500, "batches end at the window's end"
    # every stream position of the window once, in exactly the packer's rows
    stream = sampler.stream(0, 1500)
    expected = sorted(sorted(stream[r].tolist()) for r in window_rows)
    if algorithm in ("lpfhp", "nnlshp"):
        assert sorted(seen) == expected
    else:   # next-fit's rows and reference SPFHP's equal-length new packs may merge
        assert len(seen) <= len(expected)
    assert sorted(i for r in seen for i in r) == sorted(stream.tolist())


def test_packing_window_reaches_097_real_over_slots_at_2048():
    lengths = flan_like_lengths(20000, seed=1)
    tasks = np.arange(20000) % 11
    per_batch = GlobalBatchSampler(lengths, tasks, 8192, seed=4)
    windowed = {}
    for algorithm, low in (("lpfhp", 0.97), ("spfhp", 0.95)):
        sampler = packed_sampler(lengths, tasks, algorithm, window=10000)
        real = slots = 0
        for it in range(150):
            batch = sampler.batch(it)
            real += int(lengths[batch].sum())
            slots += 2048 * len(next_fit_rows(lengths, batch))
        windowed[algorithm] = real / slots
        assert real / slots >= low, (algorithm, real / slots)
    real = slots = 0
    for it in range(150):   # the same packer on each global batch alone
        batch = per_batch.batch(it)
        real += int(lengths[batch].sum())
        slots += 2048 * len(pack_sequences(lengths[batch], 2048, "lpfhp"))
    assert real / slots < windowed["lpfhp"] - 0.02, (real / slots, windowed)


def test_packing_window_t5_pairs_hold_both_limits():
    pairs = flan_like_lengths(3000, seed=2, sides=2)
    tasks = np.arange(3000) % 5
    for algorithm in ("spfhp", "lpfhp", "nnlshp"):
        sampler = packed_sampler(pairs, tasks, algorithm, window=1000, budget=8192 + 2048)
        for it in range(30):
            batch = sampler.batch(it)
            assert pairs[batch].sum() <= 8192 + 2048
            for row in next_fit_rows(pairs, batch):
                assert pairs[batch[row], 0].sum() <= 2048 and pairs[batch[row], 1].sum() <= 512


def test_packing_window_is_deterministic_and_resumes_exactly():
    lengths = flan_like_lengths(4000, seed=3)
    tasks = np.arange(4000) % 9
    run = packed_sampler(lengths, tasks, "spfhp", window=400)
    straight = [run.batch(it).tolist() for it in range(40)]      # crosses several windows
    assert run.consumed_before(40) > 3 * 400
    again = packed_sampler(lengths, tasks, "spfhp", window=400)
    assert [again.batch(it).tolist() for it in range(40)] == straight
    for stop in (1, 17, 23):
        state = run.state_dict(run.consumed_before(stop))
        resumed = packed_sampler(lengths, tasks, "spfhp", window=400)
        batches = resumed.resume_from(state)
        assert [next(batches).tolist() for _ in range(40 - stop)] == straight[stop:]
        assert resumed.iteration_of(state["consumed_samples"]) == stop
    other_seed = packed_sampler(lengths, tasks, "spfhp", window=400, seed=5)
    assert other_seed.batch(0).tolist() != straight[0]
    with pytest.raises(ValueError, match="not a batch boundary of packing window"):
        run.batch_at(run.consumed_before(3) + 1)


def test_packing_window_settings_are_checked():
    lengths = flan_like_lengths(500)
    tasks = np.zeros(500, dtype=np.int64)
    with pytest.raises(ValueError, match="whole packed rows.*token budget"):
        GlobalBatchSampler(lengths, tasks, 8192, max_samples_per_batch=8,
                           packing=PackingWindow(100, "spfhp", (2048,)))
    with pytest.raises(ValueError, match="up to 2048 tokens, more than tokens_per_global_batch"
                                         "=2000"):
        GlobalBatchSampler(np.minimum(lengths, 1500), tasks, 2000,
                           packing=PackingWindow(100, "spfhp", (2048,)))
    with pytest.raises(ValueError, match="sample 3 has length 900, over the packed row"):
        GlobalBatchSampler(np.array([1, 2, 3, 900]), np.zeros(4, dtype=np.int64), 8192,
                           packing=PackingWindow(100, "spfhp", (512,)))
    with pytest.raises(ValueError, match="packing window must be a positive"):
        PackingWindow(0, "spfhp", (2048,))
    with pytest.raises(ValueError, match="packing algorithm must be one of"):
        PackingWindow(10, "ffd", (2048,))
