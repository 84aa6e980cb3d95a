"""tools/preprocess_flan.py: text -> indexed datasets equal to direct tokenisation, bad input,
--skip-bad accounting, crash-safe outputs, summary."""
import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megatron.data.flan_indexed import dataset_paths, manifest_path
from megatron.data.flan_synthetic import synthetic_samples
from megatron.data.multitask_dataset import MultiTaskDataset
from megatron.data.tokenizers import build_tokenizer, train_sentencepiece

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tools"))
import make_flan_sample  # noqa: E402
import preprocess_flan  # noqa: E402

STYLES = sorted(make_flan_sample.FIELD_STYLES)


@pytest.fixture(scope="module")
def samples():
    return list(synthetic_samples(240, seed=21, num_tasks=25))


def write_dump(path, samples, style="_task_name"):
    return make_flan_sample.write_jsonl(
        (make_flan_sample.to_dump_row(s, style) for s in samples), str(path)) and str(path)


def assert_matches_direct_tokenisation(prefix, samples, tokenizer):
    ds = MultiTaskDataset(str(prefix))
    assert len(ds) == len(samples)
    for i, s in enumerate(samples):
        assert ds.input_ids(i).tolist() == tokenizer.encode(s["inputs"])
        assert ds.target_ids(i).tolist() == tokenizer.encode(s["targets"])
        assert ds.task_names[ds.task_id(i)] == s["task"]
    assert ds.vocab_size == tokenizer.vocab_size
    return ds


def run_cli(*args):
    return subprocess.run([sys.executable, os.path.join(REPO, "tools", "preprocess_flan.py"),
                           "--no-progress", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_cli_gpt2_two_workers_equals_direct_tokenisation(tmp_path, samples):
    dump = write_dump(tmp_path / "d.jsonl.gz", samples)
    prefix = tmp_path / "out" / "flan"
    res = run_cli("--input", dump, "--output-prefix", str(prefix),
                  "--tokenizer-type", "GPT2BPETokenizer", "--workers", "2", "--chunk-size", "16")
    assert res.returncode == 0, res.stderr
    ds = assert_matches_direct_tokenisation(prefix, samples, build_tokenizer("GPT2BPETokenizer"))
    table = json.load(open(manifest_path(str(prefix))))
    assert table["tokenizer"]["type"] == "GPT2BPETokenizer" and table["vocab_size"] == 50257
    assert sum(t["count"] for t in table["tasks"]) == len(ds)
    assert "written 240" in res.stdout


@pytest.mark.slow
def test_sentencepiece_two_workers_equals_direct_tokenisation(tmp_path, samples):
    model = train_sentencepiece([t for s in samples for t in (s["inputs"], s["targets"])],
                                str(tmp_path / "sp"), vocab_size=800)["model"]
    dump = write_dump(tmp_path / "d.jsonl", samples, "task")
    prefix = tmp_path / "sp_flan"
    rc = preprocess_flan.main(["--input", dump, "--output-prefix", str(prefix), "--no-progress",
                               "--tokenizer-type", "SentencePieceTokenizer",
                               "--tokenizer-model", model, "--workers", "2", "--chunk-size", "7"])
    assert rc == 0
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=model)
    assert_matches_direct_tokenisation(prefix, samples, tok)


@pytest.mark.parametrize("style", STYLES)
def test_each_field_style_round_trips(tmp_path, samples, style):
    dump = write_dump(tmp_path / "d.jsonl", samples[:60], style)
    prefix = tmp_path / "flan"
    assert preprocess_flan.main(["--input", dump, "--output-prefix", str(prefix),
                                 "--no-progress"]) == 0
    ds = assert_matches_direct_tokenisation(prefix, samples[:60],
                                            build_tokenizer("GPT2BPETokenizer"))
    table = ds.table["tasks"]
    by_name = {t["name"]: t for t in table}
    for s in samples[:60]:
        assert s["source"] in by_name[s["task"]]["sources"]
        assert s["template_type"] in by_name[s["task"]]["template_types"]


def test_several_inputs_are_concatenated_in_order(tmp_path, samples):
    a = write_dump(tmp_path / "a.jsonl", samples[:30], "task")
    b = write_dump(tmp_path / "b.jsonl.gz", samples[30:50], "task_name")
    prefix = tmp_path / "flan"
    assert preprocess_flan.main(["--input", a, b, "--output-prefix", str(prefix),
                                 "--no-progress"]) == 0
    assert_matches_direct_tokenisation(prefix, samples[:50], build_tokenizer("GPT2BPETokenizer"))


def test_summary_counts_tokens_and_percentiles(tmp_path, samples):
    dump = write_dump(tmp_path / "d.jsonl", samples)
    prefix = tmp_path / "flan"
    assert preprocess_flan.main(["--input", dump, "--output-prefix", str(prefix),
                                 "--no-progress"]) == 0
    summary = json.load(open(dataset_paths(str(prefix))[1]["summary"]))
    tok = build_tokenizer("GPT2BPETokenizer")
    in_lens = np.array([len(tok.encode(s["inputs"])) for s in samples])
    tgt_lens = np.array([len(tok.encode(s["targets"])) for s in samples])
    assert summary["samples"] == {"read": 240, "written": 240, "rejected": 0,
                                  "rejected_by_reason": {}}
    assert summary["tokens"] == {"inputs": int(in_lens.sum()), "targets": int(tgt_lens.sum())}
    assert summary["lengths"]["inputs"]["p90"] == pytest.approx(np.percentile(in_lens, 90))
    assert summary["lengths"]["targets"]["max"] == tgt_lens.max()
    task = samples[0]["task"]
    sel = np.array([s["task"] == task for s in samples])
    assert summary["per_task"][task]["inputs"]["count"] == sel.sum()
    assert summary["per_task"][task]["targets"]["p50"] == pytest.approx(
        np.percentile(tgt_lens[sel], 50))


def dump_with_bad_line(tmp_path, samples, bad):
    rows = [json.dumps(make_flan_sample.to_dump_row(s, "task")) for s in samples[:20]]
    rows.insert(12, bad)   # becomes line 13
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return str(path)


@pytest.mark.slow
def test_cli_corrupt_line_exits_nonzero_naming_the_line_and_skip_bad_reports_it(tmp_path,
                                                                               samples, capsys):
    dump = dump_with_bad_line(tmp_path, samples, '{"inputs": "a", "targets": ')
    prefix = tmp_path / "flan"
    res = run_cli("--input", dump, "--output-prefix", str(prefix), "--workers", "2")
    assert res.returncode != 0
    assert f"{dump}:13: malformed json" in res.stderr
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl"]     # no dataset, no partial folder
    assert preprocess_flan.main(["--input", dump, "--output-prefix", str(prefix),
                                 "--skip-bad", "--no-progress"]) == 0
    assert "rejected (malformed json): 1" in capsys.readouterr().out
    summary = json.load(open(dataset_paths(str(prefix))[1]["summary"]))
    assert summary["samples"]["read"] == 21 == summary["samples"]["written"] + 1
    assert summary["samples"]["rejected_by_reason"] == {"malformed json": 1}


@pytest.mark.parametrize("bad,reason", [
    ('{"inputs": "a", "task": "t"}', "missing field"),
    ('{"inputs": "a", "targets": ["b"], "task": "t"}', "non-string field"),
    ('{"inputs": "a", "targets": "", "task": "t"}', "empty target"),
    ('"just a string"', "not a JSON object"),
    ('{"inputs": "a\\ud800b", "targets": "b", "task": "t"}', "lone surrogate"),
    pytest.param("[" * 200_000, "json nested too deep", id="nested-200k-deep"),
])
def test_bad_lines_fail_by_default_and_are_counted_with_skip_bad(tmp_path, samples, capsys,
                                                                  bad, reason):
    dump = dump_with_bad_line(tmp_path, samples, bad)
    prefix = str(tmp_path / "flan")
    assert preprocess_flan.main(["--input", dump, "--output-prefix", prefix,
                                 "--no-progress"]) == 2
    assert f"{dump}:13: {reason}" in capsys.readouterr().err
    assert not os.path.exists(manifest_path(prefix))
    assert preprocess_flan.main(["--input", dump, "--output-prefix", prefix, "--no-progress",
                                 "--skip-bad"]) == 0
    assert f"rejected ({reason}): 1" in capsys.readouterr().out
    assert MultiTaskDataset(prefix).__len__() == 20


def test_a_record_the_tokenizer_fails_on_is_a_rejection_naming_file_and_line():
    """The reader refuses lone surrogates before tokenising; a record that reaches the tokenizer
    with one anyway (the real GPT-2 tokenizer raises TypeError on it) still comes back as a
    rejection naming its file and line, and the records around it are tokenised."""
    from megatron.data.flan_preprocess import tokenize_records
    from megatron.data.flan_records import TOKENIZER_ERROR, FlanRecord, Rejection
    recs = [FlanRecord(text, "b", "t", "", "", "dump.jsonl", line)
            for line, text in enumerate(["hello", "a\ud800b", "world"], start=1)]
    out = list(tokenize_records(recs, {"tokenizer_type": "GPT2BPETokenizer"}, chunk_size=8))
    assert isinstance(out[1], Rejection)
    assert (out[1].path, out[1].line, out[1].reason) == ("dump.jsonl", 2, TOKENIZER_ERROR)
    assert str(out[1].error()).startswith("dump.jsonl:2: tokenizer error: TypeError")
    tokenizer = build_tokenizer("GPT2BPETokenizer")
    assert [(r.line, i.tolist(), t.tolist()) for r, i, t in (out[0], out[2])] == [
        (1, tokenizer.encode("hello"), tokenizer.encode("b")),
        (3, tokenizer.encode("world"), tokenizer.encode("b"))]


def test_a_bigbench_dump_with_an_empty_sample_preprocesses_by_default(tmp_path, capsys):
    """A real BIG-bench dump holds a sample whose input and target are both empty (one in
    8,040): the default run writes every other sample and counts it in the summary."""
    task = {"name": "arith", "examples": [{"input": f"{i}+{i}", "target": str(2 * i)}
                                          for i in range(12)]}
    os.makedirs(tmp_path / "bb" / "arith")
    (tmp_path / "bb" / "arith" / "task.json").write_text(json.dumps(task))
    made = tmp_path / "made.jsonl"
    assert make_flan_sample.main(["--output", str(made), "--bigbench-dir", str(tmp_path / "bb"),
                                  "--num-samples", "0"]) == 0
    lines = made.read_text().splitlines()
    empty = dict(json.loads(lines[0]), inputs="", targets="")
    lines.insert(5, json.dumps(empty))   # line 6
    dump = tmp_path / "bigbench.jsonl"
    dump.write_text("\n".join(lines) + "\n")
    prefix = str(tmp_path / "flan")
    capsys.readouterr()
    assert preprocess_flan.main(["--input", str(dump), "--output-prefix", prefix,
                                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "rejected (empty sample): 1" in out
    summary = json.load(open(dataset_paths(prefix)[1]["summary"]))
    assert summary["samples"] == {"read": len(lines), "written": len(lines) - 1, "rejected": 1,
                                  "rejected_by_reason": {"empty sample": 1}}
    kept = [json.loads(line) for i, line in enumerate(lines) if i != 5]
    assert_matches_direct_tokenisation(prefix, [dict(r, task=r["_task_name"]) for r in kept],
                                       build_tokenizer("GPT2BPETokenizer"))


def test_a_sample_that_tokenises_to_nothing_at_all_is_skipped_by_default(tmp_path, samples,
                                                                         capsys):
    model = train_sentencepiece([s["inputs"] for s in samples[:50]], str(tmp_path / "sp"),
                                vocab_size=500)["model"]
    dump = dump_with_bad_line(tmp_path, samples, '{"inputs": "", "targets": "\\u200b", '
                                                 '"task": "t"}')
    assert preprocess_flan.main(["--input", dump, "--output-prefix", str(tmp_path / "flan"),
                                 "--no-progress", "--tokenizer-type", "SentencePieceTokenizer",
                                 "--tokenizer-model", model]) == 0
    summary = json.load(open(dataset_paths(str(tmp_path / "flan"))[1]["summary"]))
    assert summary["samples"]["rejected_by_reason"] == {"empty sample": 1}
    assert len(MultiTaskDataset(str(tmp_path / "flan"))) == 20


def test_target_that_tokenises_to_nothing_is_rejected(tmp_path, samples, capsys):
    model = train_sentencepiece([s["inputs"] for s in samples[:50]], str(tmp_path / "sp"),
                                vocab_size=500)["model"]
    dump = dump_with_bad_line(tmp_path, samples, '{"inputs": "a", "targets": "  ", "task": "t"}')
    args = ["--input", dump, "--output-prefix", str(tmp_path / "flan"), "--no-progress",
            "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", model]
    assert preprocess_flan.main(args) == 2
    assert f"{dump}:13: empty target: it tokenises to no tokens" in capsys.readouterr().err
    assert preprocess_flan.main(args + ["--skip-bad"]) == 0
    summary = json.load(open(dataset_paths(str(tmp_path / "flan"))[1]["summary"]))
    assert summary["samples"]["rejected_by_reason"] == {"empty target": 1}


def test_empty_inputs_are_written_by_default_and_empty_targets_stay_rejected(tmp_path, samples,
                                                                            capsys):
    rows = [make_flan_sample.to_dump_row(s, "_task_name") for s in samples[:30]]
    for row in rows[::3]:   # zero-shot samples of real dumps: no inputs, a normal target
        row["inputs"] = ""
    rows[4]["inputs"] = "   "   # tokenises to no tokens, still valid
    dump = tmp_path / "zs.jsonl"
    dump.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prefix = str(tmp_path / "flan")
    assert preprocess_flan.main(["--input", str(dump), "--output-prefix", prefix,
                                 "--no-progress"]) == 0
    ds = MultiTaskDataset(prefix)
    tokenizer = build_tokenizer("GPT2BPETokenizer")
    assert len(ds) == 30
    for i, row in enumerate(rows):
        assert ds.input_ids(i).tolist() == tokenizer.encode(row["inputs"])
        assert ds.target_ids(i).tolist() == tokenizer.encode(row["targets"])
    assert (ds.input_lengths == 0).sum() >= 10
    summary = json.load(open(dataset_paths(prefix)[1]["summary"]))
    assert summary["samples"] == {"read": 30, "written": 30, "rejected": 0,
                                  "rejected_by_reason": {}}
    capsys.readouterr()
    rows[7]["targets"] = ""
    dump.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert preprocess_flan.main(["--input", str(dump), "--output-prefix", prefix,
                                 "--no-progress"]) == 2
    assert f"{dump}:8: empty target" in capsys.readouterr().err


def test_a_flan_parquet_dump_with_empty_inputs_writes_every_valid_sample(tmp_path, samples,
                                                                         capsys):
    """Public FLAN dumps ship as parquet (columns inputs, targets, _task_name, _task_source,
    _template_type, plus others such as _template_idx): read for real with pyarrow, across
    row groups, with null optional columns; zero-shot rows (empty inputs) are all written."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = [make_flan_sample.to_dump_row(s, "_task_name") for s in samples[:50]]
    for i, row in enumerate(rows):
        row["_template_idx"] = i % 10          # a column the reader does not need
        if i % 4 == 0:
            row["inputs"] = ""                 # zero-shot: target only
    rows[5]["_task_source"] = None             # a null optional field reads as ""
    dump = tmp_path / "flan.parquet"
    pq.write_table(pa.Table.from_pylist(rows), dump, row_group_size=7)
    assert pq.ParquetFile(dump).num_row_groups == 8
    prefix = str(tmp_path / "flan")
    assert preprocess_flan.main(["--input", str(dump), "--output-prefix", prefix,
                                 "--no-progress"]) == 0
    ds = MultiTaskDataset(prefix)
    tokenizer = build_tokenizer("GPT2BPETokenizer")
    assert len(ds) == 50 and (ds.input_lengths == 0).sum() == 13
    for i, row in enumerate(rows):
        assert ds.input_ids(i).tolist() == tokenizer.encode(row["inputs"])
        assert ds.target_ids(i).tolist() == tokenizer.encode(row["targets"])
        assert ds.task_names[ds.task_id(i)] == row["_task_name"]
    summary = json.load(open(dataset_paths(prefix)[1]["summary"]))
    assert summary["samples"] == {"read": 50, "written": 50, "rejected": 0,
                                  "rejected_by_reason": {}}
    # a null target is a bad row named by its row number; --skip-bad counts and drops it
    rows[9]["targets"] = None
    pq.write_table(pa.Table.from_pylist(rows), dump, row_group_size=7)
    capsys.readouterr()
    assert preprocess_flan.main(["--input", str(dump), "--output-prefix", prefix,
                                 "--no-progress"]) == 2
    assert f"{dump}:10: " in capsys.readouterr().err
    assert preprocess_flan.main(["--input", str(dump), "--output-prefix", prefix,
                                 "--no-progress", "--skip-bad"]) == 0
    assert len(MultiTaskDataset(prefix)) == 49


def test_bigbench_samples_with_empty_inputs_are_all_written(tmp_path, capsys):
    from megatron.data.bigbench_tasks import bigbench_samples
    task = {"name": "bare", "example_input_prefix": "", "example_output_prefix": "",
            "examples": [{"input": "", "target": f"answer {i}"} for i in range(3)]
            + [{"input": "2+2", "target": "4"}]}
    os.makedirs(tmp_path / "bb" / "bare")
    (tmp_path / "bb" / "bare" / "task.json").write_text(json.dumps(task))
    out = tmp_path / "bb.jsonl"
    assert make_flan_sample.main(["--output", str(out), "--bigbench-dir", str(tmp_path / "bb"),
                                  "--num-samples", "0"]) == 0
    rows = list(bigbench_samples(str(tmp_path / "bb")))
    assert sum(r["inputs"] == "" for r in rows) >= 3
    prefix = str(tmp_path / "flan")
    assert preprocess_flan.main(["--input", str(out), "--output-prefix", prefix,
                                 "--no-progress"]) == 0
    assert len(MultiTaskDataset(prefix)) == len(rows)


def test_empty_file_and_unreadable_path(tmp_path, samples, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    good = write_dump(tmp_path / "good.jsonl", samples[:5])
    missing = str(tmp_path / "nope.jsonl.gz")
    prefix = str(tmp_path / "flan")
    for path, msg in ((str(empty), "empty file"), (missing, "unreadable file")):
        assert preprocess_flan.main(["--input", good, path, "--output-prefix", prefix,
                                     "--no-progress"]) == 2
        assert f"{path}: {msg}" in capsys.readouterr().err
    assert preprocess_flan.main(["--input", good, str(empty), missing, "--output-prefix",
                                 prefix, "--no-progress", "--skip-bad"]) == 0
    summary = json.load(open(dataset_paths(prefix)[1]["summary"]))
    assert summary["files"] == {"read": 1, "partly_read": [],
                                "rejected_by_reason": {"empty file": 1, "unreadable file": 1}}


def test_nothing_valid_is_an_error(tmp_path, capsys):
    path = tmp_path / "d.jsonl"
    path.write_text("{bad\n")
    assert preprocess_flan.main(["--input", str(path), "--output-prefix",
                                 str(tmp_path / "flan"), "--no-progress", "--skip-bad"]) == 2
    assert "no samples" in capsys.readouterr().err


def test_failed_rerun_keeps_no_partial_files_and_a_rerun_replaces_output(tmp_path, samples):
    prefix = str(tmp_path / "flan")
    first = write_dump(tmp_path / "a.jsonl", samples[:10])
    assert preprocess_flan.main(["--input", first, "--output-prefix", prefix,
                                 "--no-progress"]) == 0
    bad = dump_with_bad_line(tmp_path, samples, "{oops")
    assert preprocess_flan.main(["--input", bad, "--output-prefix", prefix,
                                 "--no-progress"]) == 2
    assert not [n for n in os.listdir(tmp_path) if ".partial" in n]
    assert len(MultiTaskDataset(prefix)) == 10          # the earlier complete output is intact
    second = write_dump(tmp_path / "b.jsonl", samples[10:40])
    assert preprocess_flan.main(["--input", second, "--output-prefix", prefix,
                                 "--no-progress"]) == 0
    assert_matches_direct_tokenisation(prefix, samples[10:40],
                                       build_tokenizer("GPT2BPETokenizer"))


def test_gzip_dump_written_by_hand_is_read(tmp_path):
    rows = [{"inputs": f"question {i}?", "targets": f"answer {i}", "_task_name": f"t{i % 3}"}
            for i in range(9)]
    path = tmp_path / "hand.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    prefix = str(tmp_path / "flan")
    assert preprocess_flan.main(["--input", str(path), "--output-prefix", prefix,
                                 "--no-progress"]) == 0
    ds = MultiTaskDataset(prefix)
    assert ds.task_names == ["t0", "t1", "t2"]
    assert ds.task_ids.tolist() == [i % 3 for i in range(9)]
