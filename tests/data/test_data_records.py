"""FLAN dump reading (field variants, bad lines), the FLAN-like generator and BIG-bench reader."""
import gzip
import json
import os
import sys
from collections import Counter

import numpy as np
import pytest

from megatron.data import flan_records as fr
from megatron.data.bigbench_tasks import (DEFAULT_INPUT_PREFIX, BigBenchError,
                                          bigbench_samples, find_task_files)
from megatron.data.flan_synthetic import TEMPLATE_TYPES, synthetic_samples
from megatron.data.tokenizers import build_tokenizer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools"))
import make_flan_sample  # noqa: E402


def write_lines(path, lines):
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return str(path)


def read_all(paths, skip_bad=False, task_field=None):
    counts = fr.ReadCounts()
    return list(fr.read_records(paths, counts, skip_bad, task_field)), counts


@pytest.mark.parametrize("task_key,source_key,template_key", [
    ("task", None, None),
    ("task_name", "task_source", "template_type"),
    ("_task_name", "_task_source", "_template_type"),
])
def test_each_public_field_style_is_read(tmp_path, task_key, source_key, template_key):
    row = {"inputs": "in", "targets": "out", task_key: "cola"}
    if source_key:
        row.update({source_key: "Flan2021", template_key: "fs_opt"})
    recs, counts = read_all([write_lines(tmp_path / "d.jsonl", [json.dumps(row)])])
    assert [(r.inputs, r.targets, r.task, r.line) for r in recs] == [("in", "out", "cola", 1)]
    assert recs[0].source == ("Flan2021" if source_key else "")
    assert recs[0].template_type == ("fs_opt" if source_key else "")
    assert counts.read == 1 and not counts.rejected


def test_task_name_field_wins_over_task_and_can_be_forced(tmp_path):
    row = {"inputs": "a", "targets": "b", "task": "mixture", "_task_name": "anli_r1"}
    path = write_lines(tmp_path / "d.jsonl", [json.dumps(row)])
    assert read_all([path])[0][0].task == "anli_r1"
    assert read_all([path], task_field="task")[0][0].task == "mixture"


BAD_LINES = [
    ("{not json", fr.MALFORMED_JSON),
    ("[1, 2]", fr.NOT_AN_OBJECT),
    (json.dumps({"inputs": "a", "task": "t"}), fr.MISSING_FIELD),
    (json.dumps({"inputs": "a", "targets": "b"}), fr.MISSING_FIELD),
    (json.dumps({"inputs": 3, "targets": "b", "task": "t"}), fr.NON_STRING_FIELD),
    (json.dumps({"inputs": "a", "targets": "b", "task": "t", "_task_source": 5}),
     fr.NON_STRING_FIELD),
    (json.dumps({"inputs": "a", "targets": "", "task": "t"}), fr.EMPTY_TARGET),
    pytest.param('{"inputs": "a\\ud800b", "targets": "b", "task": "t"}', fr.LONE_SURROGATE,
                 id="lone-surrogate-in-inputs"),
    pytest.param('{"inputs": "a", "targets": "b", "task": "t\\udfff"}', fr.LONE_SURROGATE,
                 id="lone-surrogate-in-task"),
    pytest.param("[" * 200_000 + "]" * 200_000, fr.NESTED_TOO_DEEP, id="nested-200k-deep"),
    pytest.param('{"inputs": "a", "targets": "b", "task": "t", "n": ' + "7" * 5000 + "}",
                 fr.MALFORMED_JSON, id="int-of-5000-digits"),
]
GOOD = json.dumps({"inputs": "a", "targets": "b", "task": "t"})


def test_empty_input_with_a_target_is_a_valid_zero_shot_sample(tmp_path):
    empty = json.dumps({"inputs": "", "targets": "b", "task": "t"})
    recs, counts = read_all([write_lines(tmp_path / "d.jsonl", [GOOD, empty, GOOD])])
    assert [(r.inputs, r.targets, r.line) for r in recs] == [("a", "b", 1), ("", "b", 2),
                                                              ("a", "b", 3)]
    assert counts.read == 3 and not counts.rejected


def test_lone_surrogate_is_named_with_its_field_and_position(tmp_path):
    path = write_lines(tmp_path / "d.jsonl", [GOOD, '{"inputs": "a\\ud800b", "targets": "b", '
                                              '"task": "t"}'])
    with pytest.raises(fr.BadInputError) as err:
        read_all([path])
    assert str(err.value) == f"{path}:2: lone surrogate: 'inputs' holds '\\ud800' at character 1"
    surrogate_pair = '{"inputs": "\\ud83d\\ude00", "targets": "b", "task": "t"}'   # an emoji
    recs, counts = read_all([write_lines(tmp_path / "e.jsonl", [surrogate_pair])])
    assert recs[0].inputs == "\U0001F600" and not counts.rejected


@pytest.mark.parametrize("empty", [{"inputs": "", "targets": ""},
                                   {"inputs": " ", "targets": "\n"}])
def test_a_sample_with_nothing_in_it_is_skipped_and_counted_by_default(tmp_path, empty):
    line = json.dumps({**empty, "task": "t"})
    recs, counts = read_all([write_lines(tmp_path / "d.jsonl", [GOOD, line, GOOD])])
    assert [r.line for r in recs] == [1, 3]
    assert counts.rejected == Counter({fr.EMPTY_SAMPLE: 1})
    assert counts.first_seen[fr.EMPTY_SAMPLE] == f"{tmp_path / 'd.jsonl'}:2"
    assert counts.files_read == 1


@pytest.mark.parametrize("bad,reason", BAD_LINES)
def test_bad_line_is_an_error_naming_file_and_line(tmp_path, bad, reason):
    path = write_lines(tmp_path / "d.jsonl", [GOOD, GOOD, bad, GOOD])
    with pytest.raises(fr.BadInputError) as err:
        read_all([path])
    assert (err.value.path, err.value.line, err.value.reason) == (path, 3, reason)
    assert f"{path}:3" in str(err.value)


@pytest.mark.parametrize("bad,reason", BAD_LINES)
def test_skip_bad_counts_the_line_under_its_reason(tmp_path, bad, reason):
    path = write_lines(tmp_path / "d.jsonl", [GOOD, bad, GOOD])
    recs, counts = read_all([path], skip_bad=True)
    assert [r.line for r in recs] == [1, 3]
    assert counts.rejected == Counter({reason: 1})
    assert counts.read == len(recs) + sum(counts.rejected.values())


def test_invalid_utf8_and_blank_lines_are_counted(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(GOOD.encode() + b"\n\n" + b'{"inputs": "\xff"}\n' + GOOD.encode() + b"\n")
    with pytest.raises(fr.BadInputError, match=r"d.jsonl:3: invalid utf-8"):
        read_all([str(path)])
    recs, counts = read_all([str(path)], skip_bad=True)
    assert len(recs) == 2
    assert counts.rejected == Counter({fr.BLANK_LINE: 1, fr.INVALID_UTF8: 1})


@pytest.mark.parametrize("text,message", [
    ('{"inputs": "abc\n', "Invalid control character at column 16"),   # json: "... at"
    ('{"inputs": "abc', "Unterminated string starting at column 12"),   # json: "... at"
    ('{"inputs": "a" "targets": "b"}\n', "Expecting ',' delimiter at column 16"),
])
def test_malformed_json_message_names_the_column_once(tmp_path, text, message):
    path = tmp_path / "d.jsonl"
    path.write_text(text)
    with pytest.raises(fr.BadInputError) as err:
        read_all([str(path)])
    assert str(err.value) == f"{path}:1: malformed json: {message}"


def test_empty_and_unreadable_files(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    missing = str(tmp_path / "missing.jsonl")
    good = write_lines(tmp_path / "good.jsonl", [GOOD])
    with pytest.raises(fr.BadInputError, match="empty.jsonl: empty file"):
        read_all([str(empty), good])
    with pytest.raises(fr.BadInputError, match="missing.jsonl: unreadable file: no such file"):
        read_all([missing, good])
    recs, counts = read_all([str(empty), missing, good], skip_bad=True)
    assert len(recs) == 1 and counts.files_read == 1
    assert counts.files_rejected == Counter({fr.EMPTY_FILE: 1, fr.UNREADABLE_FILE: 1})


def test_gzip_is_read_and_a_corrupt_gzip_names_the_file(tmp_path):
    path = tmp_path / "d.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write(GOOD + "\n" + GOOD + "\n")
    assert len(read_all([str(path)])[0]) == 2
    bad = tmp_path / "bad.jsonl.gz"
    bad.write_bytes(path.read_bytes()[:-12])
    with pytest.raises(fr.BadInputError, match="bad.jsonl.gz.*unreadable file"):
        read_all([str(bad)])


def test_unsupported_suffix_and_parquet_without_pyarrow(tmp_path, monkeypatch):
    with pytest.raises(fr.BadInputError, match="unsupported format"):
        read_all([write_lines(tmp_path / "d.csv", ["a,b"])])
    parquet = tmp_path / "d.parquet"
    parquet.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(fr.BadInputError, match="needs pyarrow"):
        read_all([str(parquet)])


def test_parquet_rows_are_read_with_pyarrow(tmp_path):
    import pyarrow as pa      # requirements.txt installs it: no skip
    import pyarrow.parquet as pq
    table = pa.table({"inputs": ["a", "c"], "targets": ["b", ""], "_task_name": ["t", "t"]})
    pq.write_table(table, tmp_path / "d.parquet")
    with pytest.raises(fr.BadInputError, match="d.parquet:2: empty target"):
        read_all([str(tmp_path / "d.parquet")])


# ---- the FLAN-like generator -------------------------------------------------------------
@pytest.fixture(scope="module")
def sample_2000():
    return list(synthetic_samples(2000, seed=11))


def test_generator_is_deterministic_by_seed(sample_2000):
    assert list(synthetic_samples(50, seed=11)) == sample_2000[:50]
    assert list(synthetic_samples(50, seed=12)) != sample_2000[:50]


def test_generator_mixes_many_tasks_templates_and_options(sample_2000):
    assert len({s["task"] for s in sample_2000}) >= 20
    assert {s["template_type"] for s in sample_2000} == set(TEMPLATE_TYPES)
    assert len({s["source"] for s in sample_2000}) >= 4
    assert any("OPTIONS:\n- " in s["inputs"] for s in sample_2000)
    assert all(s["inputs"] and s["targets"] for s in sample_2000)
    few_shot = [s for s in sample_2000 if s["template_type"].startswith("fs")]
    assert all(s["inputs"].count("Answer:") >= 2 for s in few_shot)


def test_generator_lengths_are_long_tailed(sample_2000):
    tok = build_tokenizer("GPT2BPETokenizer")
    inputs = np.array([len(x) for x in tok.encode_batch([s["inputs"] for s in sample_2000])])
    targets = np.array([len(x) for x in tok.encode_batch([s["targets"] for s in sample_2000])])
    assert np.median(inputs) < 100          # most inputs: tens of tokens
    assert (inputs > 2048).sum() >= 3       # a tail beyond 2,048 tokens
    assert np.median(targets) < 20 and targets.max() > 300


@pytest.mark.parametrize("style", sorted(make_flan_sample.FIELD_STYLES))
def test_make_flan_sample_writes_each_field_style(tmp_path, style):
    out = tmp_path / "s.jsonl.gz"
    assert make_flan_sample.main(["--output", str(out), "--num-samples", "30",
                                  "--field-style", style, "--seed", "5"]) == 0
    with gzip.open(out, "rt") as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == 30 and all(style in r for r in rows)
    recs, counts = read_all([str(out)])
    assert [r.task for r in recs] == [r[style] for r in rows]
    first = out.read_bytes()
    make_flan_sample.main(["--output", str(out), "--num-samples", "30",
                           "--field-style", style, "--seed", "5"])
    assert out.read_bytes() == first


# ---- BIG-bench ---------------------------------------------------------------------------
def write_bigbench(root):
    mc = {"name": "colors", "task_prefix": "Name the color.\n",
          "example_input_prefix": "\nQuestion: ", "example_output_prefix": "\nAnswer: ",
          "examples": [{"input": f"sky {i}", "target_scores": {"blue": 1, "red": 0}}
                       for i in range(5)]}
    free = {"name": "sums", "examples": [{"input": f"{i}+1", "target": [str(i + 1), "x"]}
                                         for i in range(4)] + [{"input": "skip", "target": []}]}
    for rel, task in (("colors", mc), ("arith/sums", free)):
        os.makedirs(root / rel, exist_ok=True)
        (root / rel / "task.json").write_text(json.dumps(task))
    os.makedirs(root / "programmatic")
    (root / "programmatic" / "task.py").write_text("# no json\n")


def test_bigbench_reader_finds_json_tasks_and_subtasks(tmp_path):
    write_bigbench(tmp_path)
    assert [n for n, _ in find_task_files(str(tmp_path))] == ["arith:sums", "colors"]


def test_bigbench_samples_render_zero_and_few_shot(tmp_path):
    write_bigbench(tmp_path)
    rows = list(bigbench_samples(str(tmp_path), seed=1, few_shot=2))
    assert len(rows) == 2 * (4 + 5)   # the example with an empty target list is left out
    colors = [r for r in rows if r["task"] == "colors"]
    zs = [r for r in colors if r["template_type"] == "zs_opt"]
    fs = [r for r in colors if r["template_type"] == "fs_opt"]
    assert len(zs) == len(fs) == 5
    assert all(r["targets"] == "blue" and r["inputs"].startswith("Name the color.") for r in zs)
    assert all("choice: red" in r["inputs"] and r["inputs"].endswith("Answer:") for r in zs)
    assert all(r["inputs"].count("Question: ") == 3 for r in fs)
    sums = [r for r in rows if r["task"] == "arith:sums"]
    assert {r["template_type"] for r in sums} == {"zs_noopt", "fs_noopt"}
    zs_sums = [r for r in sums if r["template_type"] == "zs_noopt"]
    assert all(r["inputs"] == (DEFAULT_INPUT_PREFIX + f"{int(r['targets']) - 1}+1\nA:").strip()
               for r in zs_sums)
    assert rows == list(bigbench_samples(str(tmp_path), seed=1, few_shot=2))


def test_make_flan_sample_from_bigbench_dir(tmp_path):
    write_bigbench(tmp_path / "bb")
    out = tmp_path / "bb.jsonl"
    assert make_flan_sample.main(["--output", str(out), "--bigbench-dir", str(tmp_path / "bb"),
                                  "--num-samples", "0"]) == 0
    recs, _ = read_all([str(out)])
    assert len(recs) == 18 and {r.source for r in recs} == {"BIG-bench"}


def test_bigbench_dir_without_tasks_is_an_error(tmp_path):
    with pytest.raises(BigBenchError, match="no task.json"):
        list(bigbench_samples(str(tmp_path)))
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "task.json").write_text("{broken")
    with pytest.raises(BigBenchError, match="task.json: cannot read task"):
        list(bigbench_samples(str(tmp_path)))
