"""Crash safety of dataset writes: a crash at any step leaves the old or the new dataset at the
prefix, a full disk leaves nothing behind, leftovers of killed runs are removed, files that
break off are counted honestly, and failures read as one clear line."""
import errno
import gzip
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zlib

import numpy as np
import pytest

from megatron.data.flan_indexed import LEGACY_FORMAT, FlanDatasetWriter, dataset_paths
from megatron.data.flan_synthetic import synthetic_samples
from megatron.data.multitask_dataset import MultiTaskDataset
from megatron.data.tokenizers import build_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tools"))
import preprocess_flan  # noqa: E402

SAMPLES = list(synthetic_samples(60, seed=5, num_tasks=6))


@pytest.fixture(scope="module")
def gpt2():
    return build_tokenizer("GPT2BPETokenizer")


def rows(samples):
    return [json.dumps({"inputs": s["inputs"], "targets": s["targets"], "task": s["task"]})
            for s in samples]


def write_dump(path, samples):
    path.write_text("\n".join(rows(samples)) + "\n")
    return str(path)


def preprocess(*args):
    return preprocess_flan.main(["--no-progress", *[str(a) for a in args]])


def assert_holds(prefix, samples, tokenizer):
    """The dataset at prefix loads and holds exactly `samples`, in order."""
    ds = MultiTaskDataset(str(prefix))
    assert len(ds) == len(samples)
    for i, s in enumerate(samples):
        assert ds.input_ids(i).tolist() == tokenizer.encode(s["inputs"])
        assert ds.target_ids(i).tolist() == tokenizer.encode(s["targets"])


def holds(prefix, samples, tokenizer) -> bool:
    try:
        assert_holds(prefix, samples, tokenizer)
    except AssertionError:
        return False
    return True


def dead_pid() -> int:
    """The id of a process that has exited."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# ---------------------------------------------------------------------------- crash at any step

CRASH_SCRIPT = r"""
import os, shutil, sys
sys.path[:0] = [sys.argv[1], os.path.join(sys.argv[1], "tools")]
crash_at, calls = int(sys.argv[2]), [0]

def step(fn):
    def wrapped(*args, **kwargs):
        calls[0] += 1
        if calls[0] == crash_at:
            os._exit(137)          # like SIGKILL here: no clean-up, no finally blocks
        return fn(*args, **kwargs)
    return wrapped

os.rename, os.replace, os.remove = step(os.rename), step(os.replace), step(os.remove)
shutil.rmtree = step(shutil.rmtree)
import preprocess_flan
code = preprocess_flan.main(sys.argv[3:])
print("steps", calls[0])
sys.exit(code)
"""


def run_crashing(crash_at, *args):
    return subprocess.run([sys.executable, "-c", CRASH_SCRIPT, REPO, str(crash_at),
                           "--no-progress", *[str(a) for a in args]],
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))


@pytest.mark.slow
def test_kill_at_every_rename_or_removal_leaves_old_or_new_dataset(tmp_path, gpt2):
    """A process killed at each file-system step of a rewrite (rename, replace, removal)
    leaves a dataset at the prefix that is exactly the old or exactly the new one; the next
    run removes what the killed one left behind."""
    old, new = SAMPLES[:10], SAMPLES[10:30]
    old_dump, new_dump = write_dump(tmp_path / "old.jsonl", old), write_dump(tmp_path / "new.jsonl",
                                                                             new)
    out = tmp_path / "out"
    prefix = out / "flan"
    assert preprocess("--input", old_dump, "--output-prefix", prefix) == 0
    done = run_crashing(0, "--input", new_dump, "--output-prefix", prefix)   # count the steps
    assert done.returncode == 0, done.stderr
    steps = int(done.stdout.split("steps ")[-1])
    print("steps", steps)
    assert preprocess("--input", old_dump, "--output-prefix", prefix) == 0
    assert steps >= 3          # at least: folder rename, manifest replace, old folder removal
    outcomes = []
    for k in range(1, steps + 1):
        run = run_crashing(k, "--input", new_dump, "--output-prefix", prefix)
        assert run.returncode == 137, run.stderr
        if holds(prefix, new, gpt2):
            outcomes.append("new")
        else:
            assert_holds(prefix, old, gpt2)
            outcomes.append("old")
        # put the old dataset back, which also clears what the killed run left behind
        assert preprocess("--input", old_dump, "--output-prefix", prefix) == 0
        assert_holds(prefix, old, gpt2)
        names = sorted(os.listdir(out))
        assert len(names) == 2 and names[1] == "flan_tasks.json", names
    assert "old" in outcomes and "new" in outcomes and outcomes == sorted(outcomes,
                                                                           reverse=True)


@pytest.mark.parametrize("crash_at", [1, 2])
def test_failed_rename_in_finalize_keeps_the_previous_dataset(tmp_path, monkeypatch, crash_at):
    """os.rename / os.replace failing on the k-th call: the error names the path, the previous
    dataset loads unchanged and nothing of the failed write remains."""
    prefix = str(tmp_path / "mt")
    table = {"vocab_size": 100, "num_samples": 1, "tokenizer": {"type": "test", "eod": 9},
             "tasks": [{"id": 0, "name": "t", "count": 1}]}
    with FlanDatasetWriter(prefix, 100) as writer:
        writer.add([1, 2], [3], 0)
        writer.finalize(table, {})
    before = sorted(os.listdir(tmp_path))
    calls = []
    real = {"rename": os.rename, "replace": os.replace}

    def failing(name):
        def call(src, dst):
            calls.append(name)
            if len(calls) == crash_at:
                raise OSError(errno.EIO, "Input/output error", dst)
            return real[name](src, dst)
        return call

    monkeypatch.setattr(os, "rename", failing("rename"))
    monkeypatch.setattr(os, "replace", failing("replace"))
    with pytest.raises(Exception, match="cannot write .*Input/output error"):
        with FlanDatasetWriter(prefix, 100) as writer:
            writer.add([5, 6, 7], [8], 0)
            writer.finalize(dict(table, num_samples=1), {})
    assert calls == ["rename", "replace"][:crash_at]
    assert sorted(os.listdir(tmp_path)) == before
    ds = MultiTaskDataset(prefix)
    assert ds.input_ids(0).tolist() == [1, 2]


def test_rewrite_removes_the_previous_data_folder_and_legacy_files(tmp_path, gpt2):
    prefix = tmp_path / "flan"
    for suffix in ("_inputs.bin", "_inputs.idx", "_targets.bin", "_targets.idx",
                   "_task_ids.npy", "_summary.json"):
        (tmp_path / f"flan{suffix}").write_bytes(b"old")
    (tmp_path / "flan_tasks.json").write_text(json.dumps({"format": LEGACY_FORMAT}))
    with pytest.raises(ValueError, match="older tools/preprocess_flan.py.*fingerprint.*rebuild"):
        MultiTaskDataset(str(prefix))
    dump = write_dump(tmp_path / "d.jsonl", SAMPLES[:5])
    assert preprocess("--input", dump, "--output-prefix", prefix) == 0
    first = dataset_paths(str(prefix))[1]["inputs"]
    assert sorted(os.listdir(tmp_path)) == ["d.jsonl", os.path.basename(os.path.dirname(first)),
                                            "flan_tasks.json"]
    assert preprocess("--input", dump, "--output-prefix", prefix) == 0
    assert not os.path.exists(os.path.dirname(first))
    assert len(os.listdir(tmp_path)) == 3
    assert_holds(prefix, SAMPLES[:5], gpt2)


def test_old_folder_that_cannot_be_removed_is_a_warning_and_goes_next_time(tmp_path,
                                                                           monkeypatch, capsys,
                                                                           gpt2):
    prefix = tmp_path / "flan"
    assert preprocess("--input", write_dump(tmp_path / "a.jsonl", SAMPLES[:3]),
                      "--output-prefix", prefix) == 0
    old_dir = os.path.dirname(dataset_paths(str(prefix))[1]["inputs"])
    real_rmtree = shutil.rmtree

    def rmtree(path, *args, **kwargs):
        if path == old_dir:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", rmtree)
    capsys.readouterr()
    new_dump = write_dump(tmp_path / "b.jsonl", SAMPLES[3:9])
    assert preprocess("--input", new_dump, "--output-prefix", prefix) == 0
    assert capsys.readouterr().err.strip() == (
        f"warning: could not remove {old_dir} (Permission denied); delete it by hand")
    assert os.path.isdir(old_dir)
    assert_holds(prefix, SAMPLES[3:9], gpt2)
    monkeypatch.undo()
    assert preprocess("--input", new_dump, "--output-prefix", prefix) == 0
    assert f"{old_dir}" in capsys.readouterr().out        # "removed ... <old_dir>"
    assert not os.path.exists(old_dir)
    assert len([n for n in os.listdir(tmp_path) if n.startswith("flan")]) == 2


# ---------------------------------------------------------------------------- disk full

class FullDiskFile(io.FileIO):
    """A file on a disk with `room` bytes left: writes past it fail with ENOSPC."""

    room = 2000

    def write(self, data):
        if self.tell() + len(data) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.name)
        return super().write(data)


@pytest.mark.parametrize("where", ["samples", "finalize"])
def test_disk_full_leaves_nothing_behind_and_says_so(tmp_path, monkeypatch, capsys, gpt2,
                                                     where):
    out = tmp_path / "out"
    prefix = out / "flan"
    assert preprocess("--input", write_dump(tmp_path / "old.jsonl", SAMPLES[:5]),
                      "--output-prefix", prefix) == 0
    before = sorted(os.listdir(out))
    capsys.readouterr()
    if where == "samples":
        real_open = FlanDatasetWriter._open

        def open_on_full_disk(self):
            real_open(self)
            for builder in self._builders.values():    # buffered, as the real file is
                path = builder.data_file.name
                builder.data_file.close()
                builder.data_file = io.BufferedWriter(FullDiskFile(path, "wb"), 512)

        monkeypatch.setattr(FlanDatasetWriter, "_open", open_on_full_disk)
    else:
        def save_on_full_disk(path, arr):
            open(path, "wb").close()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

        monkeypatch.setattr(np, "save", save_on_full_disk)
    rc = preprocess("--input", write_dump(tmp_path / "new.jsonl", SAMPLES),
                    "--output-prefix", prefix)
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert err.startswith("error: the disk is full (no space left on device) while writing "
                          f"{out}/.flan.partial-{os.getpid()}/")
    assert sorted(os.listdir(out)) == before
    monkeypatch.undo()
    assert_holds(prefix, SAMPLES[:5], gpt2)


# ---------------------------------------------------------------------------- leftovers

def test_leftovers_of_killed_runs_are_removed_at_the_next_start(tmp_path, gpt2):
    gone = dead_pid()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        stale = [f".flan.partial-{gone}", f"flan.data-{gone}-0badc0de"]
        kept = [f".flan.partial-{alive.pid}", f".other.partial-{gone}"]
        for name in stale + kept:
            os.makedirs(tmp_path / name / "x")
        dump = write_dump(tmp_path / "d.jsonl", SAMPLES[:4])
        assert preprocess("--input", dump, "--output-prefix", tmp_path / "flan") == 0
        names = set(os.listdir(tmp_path))
        assert not names & set(stale)
        assert set(kept) <= names
    finally:
        alive.kill()
        alive.wait()
    assert_holds(tmp_path / "flan", SAMPLES[:4], gpt2)


# ---------------------------------------------------------------------------- bad input

def truncated_gzip(path, samples):
    """A gzip dump cut in half, and the number of complete lines before the cut."""
    data = gzip.compress(("\n".join(rows(samples)) + "\n").encode(), mtime=0)
    data = data[:len(data) // 2]
    path.write_bytes(data)
    partial = zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(data)
    return str(path), partial.count(b"\n")


def test_truncated_gzip_keeps_the_lines_before_the_break_and_counts_add_up(tmp_path, capsys,
                                                                            gpt2):
    bad, complete_lines = truncated_gzip(tmp_path / "cut.jsonl.gz", SAMPLES[:50])
    assert 0 < complete_lines < 50
    good = write_dump(tmp_path / "good.jsonl", SAMPLES[50:55])
    prefix = tmp_path / "flan"
    assert preprocess("--input", bad, good, "--output-prefix", prefix) == 2
    assert f"{bad}:{complete_lines + 1}: unreadable file" in capsys.readouterr().err
    assert preprocess("--input", bad, good, "--output-prefix", prefix, "--skip-bad") == 0
    out = capsys.readouterr().out
    summary = json.load(open(dataset_paths(str(prefix))[1]["summary"]))
    s = summary["samples"]
    assert s["read"] == s["written"] + s["rejected"] == complete_lines + 5
    assert s["rejected"] == 0
    assert summary["files"]["read"] == 1 and summary["files"]["rejected_by_reason"] == {}
    assert [w.split(": ")[0] for w in summary["files"]["partly_read"]] == [
        f"{bad}:{complete_lines + 1}"]
    assert f"file broke off: {bad}:{complete_lines + 1}: unreadable file" in out
    assert_holds(prefix, SAMPLES[:complete_lines] + SAMPLES[50:55], gpt2)


def test_all_input_bad_names_the_reasons(tmp_path, capsys):
    path = tmp_path / "d.jsonl"
    path.write_text('{bad\n"a string"\n\n{"inputs": "x", "targets": "y"}\n')
    missing = str(tmp_path / "gone.jsonl")
    assert preprocess("--input", str(path), missing, "--output-prefix", tmp_path / "flan",
                      "--skip-bad") == 2
    err = capsys.readouterr().err
    assert "see the rejections above" not in err
    assert "nothing valid to write; 4 line(s) read" in err
    assert f"malformed json: 1 line(s) (first at {path}:1)" in err
    assert f"not a JSON object: 1 line(s) (first at {path}:2)" in err
    assert f"blank line: 1 line(s) (first at {path}:3)" in err
    assert f"missing field: 1 line(s) (first at {path}:4)" in err
    assert f"unreadable file: 1 file(s) (first {missing})" in err
    assert sorted(os.listdir(tmp_path)) == ["d.jsonl"]


def test_read_only_output_folder_is_one_line_naming_it(tmp_path):
    """Run as an unprivileged user when the tests run as root (root may write anywhere)."""
    base = tempfile.mkdtemp(prefix="ro-test-")
    try:
        os.chmod(base, 0o755)
        dump = write_dump(__import__("pathlib").Path(base) / "d.jsonl", SAMPLES[:3])
        os.chmod(dump, 0o644)
        out = os.path.join(base, "readonly")
        os.mkdir(out, 0o555)
        os.chmod(out, 0o555)
        cmd = [sys.executable, os.path.join(REPO, "tools", "preprocess_flan.py"), "--no-progress",
               "--input", dump, "--output-prefix", os.path.join(out, "sub", "flan")]
        if os.geteuid() == 0:
            cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *cmd]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=base,
                             env=dict(os.environ, OMP_NUM_THREADS="1"))
    finally:
        os.chmod(os.path.join(base, "readonly"), 0o755)
        subprocess.run(["rm", "-rf", base], check=True)
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().splitlines() == [
        f"error: cannot write the dataset into {out}: Permission denied "
        "(pick a writable --output-prefix)"]


@pytest.mark.parametrize("bad,message", [
    ('{"inputs": "a\\ud800b", "targets": "b", "task": "t"}',
     "lone surrogate: 'inputs' holds '\\ud800' at character 1"),
    ("[" * 200_000 + "]" * 200_000, "json nested too deep"),
])
def test_text_python_cannot_hold_is_one_line_naming_file_and_line(tmp_path, bad, message):
    """A lone UTF-16 surrogate and JSON nested 200k deep were tracebacks naming no file; now
    one line naming FILE:LINE, and counted under --skip-bad (in a subprocess, as users run it)."""
    dump = tmp_path / "d.jsonl"
    dump.write_text("\n".join(rows(SAMPLES[:3]) + [bad] + rows(SAMPLES[3:5])) + "\n")
    cmd = [sys.executable, os.path.join(REPO, "tools", "preprocess_flan.py"), "--no-progress",
           "--input", str(dump), "--output-prefix", str(tmp_path / "flan")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert res.stderr.splitlines()[0].startswith(f"error: {dump}:4: {message}")
    assert "Traceback" not in res.stderr
    res = subprocess.run(cmd + ["--skip-bad"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert f"rejected ({message.split(':')[0]}): 1" in res.stdout
    assert len(MultiTaskDataset(str(tmp_path / "flan"))) == 5
