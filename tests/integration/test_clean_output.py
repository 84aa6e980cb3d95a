"""What a user sees on the terminal: a default run prints no Python warnings, and a bad set-up
prints one clear error line (the traceback only under --debug) and exits non-zero."""
import os
import subprocess
import sys

import pytest

from tests.multiproc import free_port
from tests.training.test_training import REPO, env_with_repo, sp_dataset  # noqa: F401

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
        "--seq-length", "128", "--tokens-per-global-batch", "1024",
        "--distributed-timeout-minutes", "0.5"]


def launch(args, nproc=1, timeout=240):
    """pretrain_gpt.py with python (one process) or torchrun (several)."""
    if nproc == 1:
        cmd = [sys.executable, "pretrain_gpt.py", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
               "pretrain_gpt.py", *args]
    return subprocess.run(cmd, cwd=REPO, env=env_with_repo(), capture_output=True, text=True,
                          timeout=timeout)


def error_lines(text):
    return [line for line in text.splitlines() if "pretrain_gpt.py: error:" in line]


@pytest.mark.slow
def test_wrong_data_path_is_one_line_and_a_traceback_only_with_debug(tmp_path):
    args = TINY + ["--data-path", str(tmp_path / "nowhere"), "--train-iters", "2"]
    done = launch(args)
    assert done.returncode != 0
    lines = error_lines(done.stderr)
    assert len(lines) == 1, done.stderr
    assert "nowhere_tasks.json is missing" in lines[0] and "tools/preprocess_flan.py" in lines[0]
    assert "Traceback" not in done.stderr and done.stderr.strip() == lines[0]
    debug = launch(args + ["--debug"])
    assert debug.returncode != 0
    assert "Traceback" in debug.stderr and len(error_lines(debug.stderr)) == 1


@pytest.mark.slow
def test_wrong_data_path_under_torchrun_prints_one_error_line_for_all_ranks(tmp_path):
    done = launch(TINY + ["--data-path", str(tmp_path / "nowhere"), "--train-iters", "2"],
                  nproc=2)
    assert done.returncode != 0
    lines = error_lines(done.stdout + done.stderr)
    assert len(lines) == 1 and "rank 0" in lines[0], done.stderr[-3000:]
    assert "Traceback (most recent call last):\n  File" not in done.stdout


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["--pipeline-model-parallel-size",
                                    "--tensor-model-parallel-size"])
def test_default_run_prints_no_warnings(sp_dataset, tmp_path, layout):  # noqa: F811
    """At TP=2 every rank printed megatron-core's CUDA_DEVICE_MAX_CONNECTIONS advice."""
    done = launch(sp_dataset + TINY + [layout, "2", "--train-iters", "2"], nproc=2)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "iter 2/2" in done.stdout
    assert "warning" not in done.stderr.lower(), done.stderr[-3000:]
    assert "warning" not in done.stdout.lower()


@pytest.mark.slow
def test_a_flag_error_under_torchrun_is_printed_once(tmp_path):
    """parse_args runs on every rank; before, each printed the same error (and usage)."""
    done = launch(TINY + ["--data-path", str(tmp_path / "nowhere"), "--train-iters", "2",
                          "--tokens-per-global-batch", "0"], nproc=2)
    assert done.returncode != 0
    lines = error_lines(done.stdout + done.stderr)
    assert lines == ["pretrain_gpt.py: error: --tokens-per-global-batch must be > 0, got 0 "
                     "(leave the flag out for its default)"], done.stderr[-3000:]


@pytest.mark.slow
def test_a_broken_tokenizer_file_under_torchrun_is_one_line_naming_it(sp_dataset,  # noqa: F811
                                                                      tmp_path):
    bad = tmp_path / "sp.model"
    bad.write_bytes(bytes(range(256)) * 8)
    args = list(sp_dataset)
    args[args.index("--tokenizer-model") + 1] = str(bad)
    done = launch(TINY + args + ["--train-iters", "2"], nproc=2)
    assert done.returncode != 0
    lines = error_lines(done.stdout + done.stderr)
    assert len(lines) == 1, done.stderr[-3000:]
    assert lines[0].startswith(f"pretrain_gpt.py: error: rank 0: --tokenizer-type "
                               f"SentencePieceTokenizer: {bad}: not a SentencePiece model")


def test_an_error_of_one_rank_is_one_write_naming_the_rank(capfd):
    """Lines of two ranks on one stderr must not run together: the whole line is one write,
    and it says which rank failed."""
    from megatron.training.pretrain import report_failure
    report_failure("pretrain_gpt.py", RuntimeError("bad\nthing"), False, False, rank=1)
    report_failure("pretrain_gpt.py", RuntimeError("rank 0 (tp 0): x"), False, False, rank=0)
    assert capfd.readouterr().err.splitlines() == [
        "pretrain_gpt.py: error: rank 1: RuntimeError: bad thing (--debug shows the traceback)",
        "pretrain_gpt.py: error: RuntimeError: rank 0 (tp 0): x (--debug shows the traceback)"]
