"""Megatron's weighted --data-path blends and FLAN's mixing flags (--mixing-cap,
--mixing-temperature): parsing, merged task names, the share each prefix gets, the cap's
examples-proportional semantics, determinism, and a blended training run."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megatron.data.blend import BlendedMultiTaskDataset, parse_data_path, stream_rates
from megatron.data.sampler import GlobalBatchSampler, mixing_rates
from megatron.training.arguments import parse_args
from tests.data.test_data_multitask import write_dataset
from tests.multiproc import free_port
from tests.training.test_training import REPO, env_with_repo, run_tool, sp_dataset  # noqa: F401

MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
         "--train-iters", "2", "--seq-length", "128"]


def test_data_path_forms():
    assert parse_data_path(["a"]) == [(None, "a")]
    assert parse_data_path(["a", "b"]) == [(None, "a"), (None, "b")]
    assert parse_data_path(["0.3", "a", "0.7", "b"]) == [(0.3, "a"), (0.7, "b")]
    assert parse_data_path(["3", "a", "7", "b"]) == [(3.0, "a"), (7.0, "b")]
    for bad, message in ((["0.3", "a", "b"], "in pairs"), (["a", "0.5", "b"], "a weight"),
                         (["0.3", "a", "0.7", "0.1"], "expected a weight then a prefix"),
                         (["0", "a", "1", "b"], "must be > 0"), ([], "at least one")):
        with pytest.raises(ValueError, match=message):
            parse_data_path(bad)


def test_flags_reach_the_config(capsys):
    cfg = parse_args("gpt", MODEL + ["--data-path", "0.3", "A", "0.7", "B", "--mixing-cap",
                                     "3000", "--mixing-temperature", "2"], has_cuda=False)
    assert cfg.data_path == ("0.3", "A", "0.7", "B")
    assert (cfg.mixing_cap, cfg.mixing_temperature) == (3000, 2.0)
    assert parse_args("gpt", MODEL + ["--data-path", "A"], has_cuda=False).mixing_cap is None
    for argv, message in ((["--data-path", "0.3", "A", "B"], "in pairs"),
                          (["--data-path", "A", "--mixing-cap", "0"], "--mixing-cap must be"),
                          (["--data-path", "A", "--mixing-temperature", "0"],
                           "--mixing-temperature must be > 0")):
        with pytest.raises(SystemExit):
            parse_args("gpt", MODEL + argv, has_cuda=False)
        assert message in capsys.readouterr().err


def test_blend_reads_every_prefix_and_merges_task_names(tmp_path):
    a = write_dataset(tmp_path / "a")                       # tasks task0..task2
    b_samples = [([5, 6], [7], 1), ([8], [9, 10], 0), ([11], [12], 1)]
    b = write_dataset(tmp_path / "b", b_samples)
    table = json.load(open(b + "_tasks.json"))
    table["tasks"] = [{"id": 0, "name": "task2", "count": 1}, {"id": 1, "name": "new", "count": 2}]
    with open(b + "_tasks.json", "w") as f:
        json.dump(table, f)
    ds = BlendedMultiTaskDataset([a, b])
    assert len(ds) == 7 and ds.task_names == ["task0", "task1", "task2", "new"]
    assert [ds.task_names[ds.task_id(i)] for i in range(4, 7)] == ["new", "task2", "new"]
    assert ds.input_ids(4).tolist() == [5, 6] and ds.target_ids(5).tolist() == [9, 10]
    assert ds.stream_ids.tolist() == [0, 1, 0, 2, 4, 3, 4]   # (prefix, task) streams
    assert ds.gpt_sample(6, 16).tokens.tolist() == [11, 12]
    rates = stream_rates(ds, [0.25, 0.75])
    assert rates[:3].sum() == pytest.approx(0.25) and rates[3:].sum() == pytest.approx(0.75)
    assert rates[3:].tolist() == pytest.approx([0.25, 0.5])   # examples-proportional inside b


def test_mixing_cap_is_examples_proportional_up_to_the_cap():
    task_ids = np.repeat([0, 1, 2], [1000, 100, 10])
    assert mixing_rates(task_ids).tolist() == pytest.approx([1000 / 1110, 100 / 1110, 10 / 1110])
    assert mixing_rates(task_ids, cap=100).tolist() == pytest.approx([100 / 210, 100 / 210,
                                                                      10 / 210])
    flat = mixing_rates(task_ids, cap=100, temperature=2.0)
    assert flat.tolist() == pytest.approx(np.array([10, 10, 10 ** 0.5]) / (20 + 10 ** 0.5))
    # the sampler draws with those rates: shares over 20,000 stream samples
    sampler = GlobalBatchSampler(np.ones(len(task_ids)), task_ids, 64, seed=3, mixing_cap=100)
    drawn = np.bincount(task_ids[sampler.stream(0, 20000)], minlength=3) / 20000
    assert np.abs(drawn - np.array([100, 100, 10]) / 210).max() < 0.01
    # a capped task's samples are still all seen (a new permutation per pass)
    small = sampler.stream(0, 20000)[task_ids[sampler.stream(0, 20000)] == 2]
    assert set(small[:10].tolist()) == set(range(1100, 1110))


@pytest.fixture(scope="module")
def two_prefixes(sp_dataset, tmp_path_factory):  # noqa: F811
    """The SentencePiece dataset of test_training and a second one with the same tokenizer."""
    d = tmp_path_factory.mktemp("blend")
    model = sp_dataset[sp_dataset.index("--tokenizer-model") + 1]
    run_tool("tools/make_flan_sample.py", "--output", str(d / "b.jsonl"), "--num-samples",
             "120", "--seed", "11")
    run_tool("tools/preprocess_flan.py", "--input", str(d / "b.jsonl"), "--output-prefix",
             str(d / "b"), "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
             model, "--no-progress")
    return sp_dataset[1], str(d / "b"), sp_dataset[2:]


def test_weighted_blend_shares_over_1000_iterations_and_is_deterministic(two_prefixes):
    from megatron.training.training import open_training_data
    a, b, tokenizer = two_prefixes
    argv = MODEL + tokenizer + ["--tokens-per-global-batch", "1024", "--data-path", "0.3", a,
                                "0.7", b]
    data = open_training_data(parse_args("gpt", argv, has_cuda=False))
    n_a = len(data.dataset.parts[0])
    batches = [data.sampler.batch(i) for i in range(1000)]
    picked = np.concatenate(batches)
    share_a = float((picked < n_a).mean())
    assert abs(share_a - 0.3) < 0.02 and len(picked) > 5000, (share_a, len(picked))
    # the same flags give the same batches, and batch(i) needs no earlier batch
    again = open_training_data(parse_args("gpt", argv, has_cuda=False))
    assert again.sampler.batch(777).tolist() == batches[777].tolist()
    # each prefix keeps its task ids; names are merged
    names = data.dataset.task_names
    for k, part in enumerate(data.dataset.parts):
        for i in (0, len(part) - 1):
            j = i + int(data.dataset.starts[k])
            assert names[data.dataset.task_id(j)] == part.task_names[part.task_id(i)]
    # a cap inside the weighted blend keeps the prefix shares
    capped = open_training_data(parse_args("gpt", argv + ["--mixing-cap", "2"], has_cuda=False))
    rates = capped.sampler.rates
    assert rates[:len(data.dataset.parts[0].task_names)].sum() == pytest.approx(0.3)


@pytest.mark.slow
def test_blended_run_trains(two_prefixes, tmp_path):
    a, b, tokenizer = two_prefixes
    stats = tmp_path / "stats.jsonl"
    env = dict(env_with_repo(), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    done = subprocess.run([sys.executable, "pretrain_gpt.py", *MODEL, *tokenizer,
                           "--data-path", "0.3", a, "0.7", b, "--mixing-cap", "20",
                           "--global-batch-size", "6", "--num-planner-workers", "0",
                           "--stats-file", str(stats), "--save", str(tmp_path / "ckpt")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in open(stats)]
    assert [r["iteration"] for r in rows] == [1, 2]
    assert all(np.isfinite(r["loss"]) for r in rows)
    assert os.path.exists(stats)
    # resuming with another mixing cap would draw other batches: one line naming the flag
    env["MASTER_PORT"] = str(free_port())
    resumed = subprocess.run([sys.executable, "pretrain_gpt.py", *MODEL[:-4], *tokenizer,
                              "--train-iters", "3", "--lr-decay-iters", "2",
                              "--seq-length", "128",
                              "--data-path", "0.3", a, "0.7", b, "--mixing-cap", "10",
                              "--global-batch-size", "6", "--num-planner-workers", "0",
                              "--load", str(tmp_path / "ckpt")], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=240)
    assert resumed.returncode != 0
    lines = [line for line in resumed.stderr.splitlines() if "--mixing-cap" in line]
    assert len(lines) == 1 and "--mixing-cap was 20 when the checkpoint was written, this " \
        "run has 10" in lines[0], resumed.stderr[-3000:]
