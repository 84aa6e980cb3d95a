"""Nothing lost, nothing silently wrong: token ids checked against the vocabulary at every TP,
indexes checked against their data at open, checkpoints that never go backwards nor get
overwritten by another run, a run bound to its data and tokenizer, and a clean stop on SIGTERM."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megatron.checkpoint import checkpointing as ckpt
from megatron.data.multitask_dataset import MultiTaskDataset
from tests.multiproc import free_port
from tests.training.test_checkpointing import saved_run
from tests.training.test_training import REPO, copy_dataset, env_with_repo, sp_dataset  # noqa: F401

RUN = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
       "--tokens-per-global-batch", "1024", "--seq-length", "128", "--lr", "5e-3",
       "--lr-decay-iters", "10", "--distributed-timeout-minutes", "0.5",
       "--num-planner-workers", "0"]


def launch(args, nproc: int = 1, script: str = "pretrain_gpt.py", timeout: float = 240):
    """`script` under torchrun on CPU: (exit status, stdout + stderr)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), script, *args]
    done = subprocess.run(cmd, cwd=REPO, env=env_with_repo(), capture_output=True, text=True,
                          timeout=timeout)
    return done.returncode, done.stdout + done.stderr


def data_folder_file(args, name):
    prefix = args[args.index("--data-path") + 1]
    table = json.load(open(prefix + "_tasks.json"))
    return os.path.join(os.path.dirname(prefix), table["data_dir"], name), prefix


# ---------------------------------------------------------------------------- token ids

def test_preprocessing_records_the_largest_token_id(sp_dataset):
    dataset = MultiTaskDataset(data_folder_file(sp_dataset, "inputs.bin")[1])
    largest = max(int(ids.max()) for i in range(len(dataset))
                  for ids in (dataset.input_ids(i), dataset.target_ids(i)) if ids.size)
    assert dataset.table["max_token_id"] == largest == dataset.max_token_id
    assert largest < dataset.vocab_size


def test_an_index_whose_lengths_disagree_with_its_data_is_named_at_open(sp_dataset, tmp_path):
    args, folder = copy_dataset(sp_dataset, str(tmp_path / "copy"))
    idx = os.path.join(folder, "inputs.idx")
    with open(idx, "r+b") as f:      # the lengths follow a 34-byte header
        f.seek(34 + 4 * 3)
        length = int(np.frombuffer(f.read(4), dtype=np.int32)[0])
        f.seek(34 + 4 * 3)
        f.write(np.int32(length + 7).tobytes())
    with pytest.raises(ValueError) as err:
        MultiTaskDataset(args[args.index("--data-path") + 1])
    assert str(err.value).startswith(f"{idx}: damaged: sample 3 of {length + 7} tokens would "
                                     f"end at byte")
    assert "inputs.bin, where sample 4 starts" in str(err.value)


@pytest.mark.slow
def test_token_ids_past_the_vocabulary_are_named_at_tp1_and_tp2(sp_dataset, tmp_path):
    """Bytes flipped in a .bin of the right size: at TP=1 the embedding raised an IndexError
    naming nothing, at TP=2 the vocab-parallel embedding masked the ids and the run trained on;
    now both stop at the first sample drawn, naming the file and the sample."""
    args, folder = copy_dataset(sp_dataset, str(tmp_path / "copy"))
    targets = os.path.join(folder, "targets.bin")
    size = os.path.getsize(targets)
    with open(targets, "r+b") as f:
        f.write(b"\xff" * size)        # uint16 ids of 65535, past the 1000-token vocabulary
    for tp in (1, 2):
        code, out = launch(args + RUN + ["--train-iters", "2", "--tensor-model-parallel-size",
                                         str(tp)], nproc=tp)
        assert code != 0, out[-3000:]
        assert f"{targets}: sample " in out and " holds token id 65535, outside 0..999" in out
        assert "Traceback" not in out.split("pretrain_gpt.py: error:")[0][-2000:]


# ---------------------------------------------------------------------------- checkpoints

def tracker(directory) -> str:
    return (directory / ckpt.LATEST).read_text().strip()


def test_latest_never_moves_back_while_the_newer_checkpoint_is_there(tmp_path):
    cfg, model, opt = saved_run(tmp_path, [2, 4])
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.save_checkpoint(str(tmp_path), 2, [model], opt, {"consumed_samples": 2}, cfg, 0, 1)
    assert str(err.value).endswith(f"{tmp_path / ckpt.LATEST} names iteration 4, newer than 2: "
                                   f"not moving it back (another run writes {tmp_path}?)")
    assert tracker(tmp_path) == "4"


def test_a_missing_tracker_is_read_as_the_newest_complete_checkpoint_and_rebuilt(tmp_path):
    saved_run(tmp_path, [2, 4])
    os.makedirs(ckpt.iteration_dir(str(tmp_path), 6))    # a save killed before its common.pt
    os.remove(tmp_path / ckpt.LATEST)
    assert ckpt.latest_iteration(str(tmp_path)) == 4
    assert ckpt.newest_checkpoint(str(tmp_path)) == 4
    assert ckpt.rebuild_tracker(str(tmp_path)) == 4 and tracker(tmp_path) == "4"
    assert ckpt.newest_checkpoint(str(tmp_path / "none")) is None


def test_a_second_writer_is_refused_naming_the_first_and_a_dead_ones_lock_is_taken_over(
        tmp_path, capsys):
    holder = subprocess.Popen([sys.executable, "-c", ACQUIRE_AND_WAIT, str(tmp_path)],
                              cwd=REPO, env=env_with_repo(), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ckpt.CheckpointError) as err:
            ckpt.prepare_save_dir(str(tmp_path), 0)
        assert f"--save {tmp_path}: another run writes there (process {holder.pid} on " in \
            str(err.value) and f"holds {tmp_path / ckpt.LOCK}" in str(err.value)
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    # the holder was killed before it released its lock: named and taken over
    assert json.loads((tmp_path / ckpt.LOCK).read_text())["pid"] == holder.pid
    ckpt.prepare_save_dir(str(tmp_path), 0)
    assert f"save.lock: left by process {holder.pid} on " in capsys.readouterr().out
    assert json.loads((tmp_path / ckpt.LOCK).read_text())["pid"] == os.getpid()
    ckpt.release_save_lock(str(tmp_path))
    assert not (tmp_path / ckpt.LOCK).exists()


# takes the lock, says so, waits for stdin to close, then dies without releasing it
ACQUIRE_AND_WAIT = """
import os, sys
from megatron.checkpoint.checkpointing import acquire_save_lock
acquire_save_lock(sys.argv[1])
print("locked", flush=True)
sys.stdin.read()
os._exit(0)
"""


def pretrain(args, timeout: float = 240):
    """pretrain_gpt.py as a world of one: (exit status, stdout + stderr)."""
    env = dict(env_with_repo(), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    done = subprocess.run([sys.executable, "pretrain_gpt.py", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    return done.returncode, done.stdout + done.stderr


@pytest.mark.slow
def test_a_run_never_writes_over_checkpoints_it_does_not_resume(sp_dataset, tmp_path):
    """A fresh run into another run's --save was let write iter_0000002 over it and move
    `latest` from 4 back to 2; a lost tracker file read as "no checkpoint there yet"."""
    save = tmp_path / "ckpt"
    args = sp_dataset + RUN + ["--save", str(save), "--save-interval", "2"]
    code, out = pretrain(args + ["--train-iters", "4"])
    assert code == 0, out[-3000:]
    before = (save / "iter_0000002" / ckpt.COMMON).read_bytes()

    code, out = pretrain(args + ["--train-iters", "2"])
    assert code == 1 and out.count("error:") == 1
    assert (f"--save {save} holds checkpoints of another run (newest: iteration 4); resume "
            f"them with --load {save}, save to a new folder, or start over there with "
            f"--overwrite-checkpoints") in out
    assert tracker(save) == "4" and (save / "iter_0000002" / ckpt.COMMON).read_bytes() == before

    os.remove(save / ckpt.LATEST)
    code, out = pretrain(args + ["--train-iters", "6", "--load", str(save)])
    assert code == 0, out[-3000:]
    assert f"{ckpt.LATEST} was missing; rebuilt it from the newest complete checkpoint, " \
           f"iteration 4" in out and "iterations 4..6" in out
    assert tracker(save) == "6"

    code, out = pretrain(args + ["--train-iters", "2", "--overwrite-checkpoints"])
    assert code == 0, out[-3000:]
    assert f"--overwrite-checkpoints: set aside {save / 'iter_0000006'}" in out
    assert tracker(save) == "2" and (save / "iter_0000004.abandoned" / ckpt.COMMON).exists()
    assert not (save / ckpt.LOCK).exists()


def convert(*args):
    done = subprocess.run([sys.executable, os.path.join("tools", "convert_checkpoint.py"),
                           *map(str, args)], cwd=REPO, env=env_with_repo(),
                          capture_output=True, text=True, timeout=300)
    return done.returncode, done.stdout + done.stderr


def test_the_converter_refuses_a_destination_that_is_not_empty(tmp_path):
    """--to-hf onto an existing Hugging Face folder and --from-hf --to a run's folder wrote
    over what was there (the latter moved `latest` back to 0)."""
    from tests.integration.test_hf_convert import GPT_CONFIGS, random_gpt2
    random_gpt2(tmp_path / "hf", *GPT_CONFIGS[0])
    hf_bytes = (tmp_path / "hf" / "model.safetensors").read_bytes()
    saved_run(tmp_path / "run", [2, 4])
    ours = tmp_path / "ours"
    assert convert("--from-hf", tmp_path / "hf", "--to", ours)[0] == 0

    for args, target in ((["--from-hf", tmp_path / "hf", "--to", tmp_path / "run"], "run"),
                         (["--to-hf", ours, "--to", tmp_path / "hf"], "hf")):
        code, out = convert(*args)
        assert code == 2 and f"--to {tmp_path / target} is not empty (" in out
        assert "pick a new folder, or pass --overwrite to replace what is there" in out
    assert tracker(tmp_path / "run") == "4"
    assert (tmp_path / "hf" / "model.safetensors").read_bytes() == hf_bytes

    code, out = convert("--from-hf", tmp_path / "hf", "--to", tmp_path / "run", "--overwrite")
    assert code == 0, out
    assert f"--overwrite: set aside {tmp_path / 'run' / 'iter_0000004'}" in out
    assert tracker(tmp_path / "run") == "0"
    assert (tmp_path / "run" / "iter_0000004.abandoned" / ckpt.COMMON).exists()


# ---------------------------------------------------------------------------- data identity

@pytest.mark.slow
def test_resuming_with_another_tokenizer_of_the_same_size_is_refused_naming_both(sp_dataset,
                                                                               tmp_path):
    """With --global-batch-size the sample counts agree, so the swap resumed silently,
    optimizer state and all."""
    from megatron.training.arguments import parse_args
    from megatron.training.training import check_data_identity, open_training_data
    from tests.training.test_training import run_tool
    prefix = sp_dataset[sp_dataset.index("--data-path") + 1]
    folder = os.path.dirname(prefix)
    run_tool("tools/make_flan_sample.py", "--output", str(tmp_path / "other.jsonl"),
             "--num-samples", "300", "--seed", "8")
    run_tool("tools/train_tokenizer.py", "--input", str(tmp_path / "other.jsonl"),
             "--model-prefix", str(tmp_path / "sp"), "--vocab-size", "1000")
    run_tool("tools/preprocess_flan.py", "--input", os.path.join(folder, "flan.jsonl"),
             "--output-prefix", str(tmp_path / "flan"), "--tokenizer-type",
             "SentencePieceTokenizer", "--tokenizer-model", str(tmp_path / "sp.model"),
             "--no-progress")
    other = ["--data-path", str(tmp_path / "flan"), "--tokenizer-type",
             "SentencePieceTokenizer", "--tokenizer-model", str(tmp_path / "sp.model")]
    save = tmp_path / "ckpt"
    at = RUN.index("--tokens-per-global-batch")
    batch = RUN[:at] + RUN[at + 2:] + ["--global-batch-size", "4", "--save", str(save),
                                       "--load", str(save)]
    code, out = pretrain(sp_dataset + batch + ["--train-iters", "1"])
    assert code == 0, out[-3000:]

    code, out = pretrain(other + batch + ["--train-iters", "2"])
    assert code == 1 and out.count("error:") == 1, out[-3000:]
    assert (f"--load {save}: the checkpoint was trained on tokenizer SentencePieceTokenizer "
            f"{folder}/sp.model") in out
    assert (f"this run has tokenizer SentencePieceTokenizer {tmp_path}/sp.model") in out
    assert f"data {prefix} (manifest " in out and f"data {tmp_path}/flan (manifest " in out
    assert "--override-data-identity if the change is meant, or --finetune" in out
    assert tracker(save) == "1"

    code, out = pretrain(other + batch + ["--train-iters", "2", "--override-data-identity"])
    assert code == 0, out[-3000:]
    assert tracker(save) == "2"
    cfg = parse_args("gpt", other + RUN + ["--train-iters", "2", "--load", str(save),
                                           "--finetune"], has_cuda=False)
    check_data_identity(cfg, open_training_data(cfg).identity)    # weights alone: not bound


# ---------------------------------------------------------------------------- signals

def torchrun_stats(args, stats_file, nproc: int = 2):
    code, out = launch(args + ["--stats-file", str(stats_file)], nproc=nproc)
    assert code == 0, out[-3000:]
    return [json.loads(line) for line in open(stats_file)]


@pytest.mark.slow
def test_sigterm_to_torchrun_saves_the_iteration_and_resume_repeats_the_straight_run(
        sp_dataset, tmp_path):
    """SIGTERM ended a run in about a second with no checkpoint and no word from the trainer.
    Now both ranks finish the iteration, save it, rank 0 says so in one line, and each rank
    exits 0; resuming gives the losses the uninterrupted run has (dropout off, so nothing
    but the saved state decides them)."""
    import signal
    import time
    args = sp_dataset + RUN + ["--hidden-dropout", "0", "--attention-dropout", "0"]
    save, stats = tmp_path / "ckpt", tmp_path / "stopped.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "pretrain_gpt.py",
           *args, "--train-iters", "1000", "--save", str(save), "--stats-file", str(stats)]
    with open(tmp_path / "stopped.out", "w") as out:
        launcher = subprocess.Popen(cmd, cwd=REPO, env=env_with_repo(), stdout=out,
                                    stderr=subprocess.STDOUT)
        try:      # wait (for as long as it takes) until two iterations are logged
            while not (stats.exists() and len(stats.read_text().splitlines()) >= 2):
                assert launcher.poll() is None, (tmp_path / "stopped.out").read_text()[-3000:]
                time.sleep(0.2)
            launcher.send_signal(signal.SIGTERM)
            launcher.wait(timeout=120)
        finally:
            launcher.kill()
    text = (tmp_path / "stopped.out").read_text()
    stopped = tracker(save)
    assert int(stopped) >= 2 and f"iter_{int(stopped):07d}" in os.listdir(save), text[-3000:]
    assert text.count("[train] SIGTERM: stopped after iteration") == 1, text[-3000:]
    assert (f"[train] SIGTERM: stopped after iteration {stopped} of 1000; saved checkpoint of "
            f"iteration {stopped} to {save} (resume with --load {save})") in text
    assert "exitcode  : -" not in text and "pretrain_gpt.py: error" not in text
    assert not (save / ckpt.LOCK).exists()
    done = int(stopped)
    straight = torchrun_stats(args + ["--train-iters", str(done + 2)], tmp_path / "straight")
    resumed = torchrun_stats(args + ["--train-iters", str(done + 2), "--load", str(save)],
                             tmp_path / "resumed")
    assert [s["iteration"] for s in resumed] == [done + 1, done + 2]
    assert [s["loss"] for s in resumed] == [s["loss"] for s in straight[done:]]


def test_the_first_signal_is_remembered_and_a_second_exits_at_once():
    script = ("import os, signal\n"
              "from megatron.training.exit_signals import ExitSignals\n"
              "with ExitSignals() as signals:\n"
              "    os.kill(os.getpid(), signal.SIGINT)\n"
              "    print('after the first:', signals.agreed(), flush=True)\n"
              "    os.kill(os.getpid(), signal.SIGTERM)\n"
              "    print('not reached', flush=True)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env_with_repo(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 128 + 15
    assert done.stdout == "after the first: SIGINT\n"
    assert done.stderr.endswith("[train] a second SIGTERM: exiting at once, without a "
                                "checkpoint\n")


# ---------------------------------------------------------------------------- one-line errors

def test_the_vocabulary_padding_error_names_the_divisor_that_pads_both_layouts_alike():
    """GPT-2 BPE's 50,257 tokens: 50,304 rows at TP=1 and 50,432 at TP=2 with the default 128;
    64 pads them to 50,304 at TP=2 too."""
    hint = ckpt.vocab_padding_hint(50257, 50304, 2, 128)
    assert hint.endswith("; --make-vocab-size-divisible-by 64 pads its 50257 tokens to the "
                         "checkpoint's 50304 rows at TP=2)")
    assert "--make-vocab-size-divisible-by 128 pads its 50257 tokens to the checkpoint's " \
           "50304 rows at TP=1" in ckpt.vocab_padding_hint(50257, 50304, 1, 128)
    assert "no value pads its 50257 tokens to the checkpoint's 50305 rows at TP=2" in \
        ckpt.vocab_padding_hint(50257, 50305, 2, 128)


@pytest.mark.parametrize("weight", ["inf", "nan", "-1"])
def test_a_blend_weight_that_is_not_a_finite_positive_number_is_one_line(weight):
    from megatron.data.blend import parse_data_path
    with pytest.raises(ValueError) as err:
        parse_data_path([weight, "a", "1", "b"])
    assert str(err.value) == f"--data-path: weight {weight} of a must be > 0 and finite"


def test_a_hugging_face_folder_that_is_empty_lacks_its_config_or_is_truncated_is_one_line(
        tmp_path):
    """transformers spoke of model types ("Unrecognized model"), hub repo ids or a
    deserialising error, with a traceback."""
    from safetensors.torch import save_file
    import torch
    whole = tmp_path / "whole"
    whole.mkdir()
    (whole / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    save_file({"w": torch.zeros(64, 64)}, str(whole / "model.safetensors"))
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    data = (whole / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[:len(data) // 2])
    no_config = tmp_path / "no_config"
    no_config.mkdir()
    (no_config / "model.safetensors").write_bytes(data)
    (tmp_path / "empty").mkdir()
    for folder, said in ((tmp_path / "empty", "no config.json there"),
                         (no_config, "no config.json there"),
                         (cut, f"{cut / 'model.safetensors'}: truncated or damaged (")):
        code, out = convert("--from-hf", folder, "--to", tmp_path / "out")
        assert code == 1 and "Traceback" not in out, out
        assert out.startswith("convert_checkpoint: ") and said in out and out.count("\n") == 1


def test_a_stats_file_that_is_a_folder_is_a_flag_error_before_training(tmp_path, capsys):
    """It failed after iteration 1, naming neither the flag nor the path."""
    from tests.training.test_checkpointing import tiny_config
    with pytest.raises(SystemExit):
        tiny_config("--stats-file", str(tmp_path))
    assert f"--stats-file {tmp_path} is a folder; give the path of a file" in \
        capsys.readouterr().err


def test_a_failed_run_never_says_done():
    import io
    from megatron.training.train_logging import IterationStats, TrainLogger
    for finished in (True, False):
        stream = io.StringIO()
        logger = TrainLogger(1, stream=stream)
        logger.log(IterationStats(iteration=1, train_iters=6, loss=1.0, lr=1e-3, grad_norm=1.0,
                                  real_tokens=100, token_slots=120, num_micro_batches=1,
                                  shapes="1x120", plan_wait_s=0.0, iteration_s=1.0,
                                  peak_memory_bytes=0))
        logger.close(finished)
        assert ("[train] done: 1 iterations" in stream.getvalue()) == finished


def test_validation_says_when_eval_iters_repeat_samples_and_perplexity_is_not_capped(
        sp_dataset):
    import math
    from megatron.training.arguments import parse_args
    from megatron.training.evaluation import Evaluator
    from megatron.training.train_logging import ValidationStats, validation_line
    from megatron.training.training import open_training_data
    for iters, repeated in (("1", False), ("60", True)):
        cfg = parse_args("gpt", sp_dataset + RUN + ["--train-iters", "2", "--split", "90,10,0",
                                                    "--eval-interval", "1", "--eval-iters",
                                                    iters], has_cuda=False)
        line = Evaluator.describe(cfg, open_training_data(cfg, part="valid"))
        assert ("samples repeat)" in line) == repeated, line
        if repeated:
            assert "samples, more than the 30 validation samples (--eval-iters past" in line

    def stats(loss):
        return ValidationStats(iteration=1, loss=loss, loss_tokens=5, samples=1, batches=1,
                               tasks={}, families={}, eval_s=0.1, plan_s=0.0)
    assert stats(25.0).ppl == math.exp(25.0)       # was capped at exp(20)
    assert stats(800.0).ppl == math.inf and "ppl inf" in validation_line(stats(800.0))


@pytest.mark.slow
def test_evaluate_on_a_checkpoint_of_another_padded_vocabulary_is_one_line(sp_dataset,
                                                                          tmp_path):
    save = tmp_path / "ckpt"
    code, out = pretrain(sp_dataset + RUN + ["--train-iters", "1", "--save", str(save)])
    assert code == 0, out[-3000:]
    env = dict(env_with_repo(), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    done = subprocess.run([sys.executable, "tools/evaluate.py", *sp_dataset, *RUN,
                           "--load", str(save), "--split", "90,10,0", "--eval-iters", "1",
                           "--make-vocab-size-divisible-by", "600"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=240)
    out = done.stdout + done.stderr
    assert done.returncode == 1 and "Traceback" not in out, out[-3000:]
    assert "tools/evaluate.py: error: CheckpointError: " in out
    assert "word_embeddings.weight: shape (1024, 32), the model needs (1200, 32)" in out
    assert "--make-vocab-size-divisible-by 512 pads its 1000 tokens to the checkpoint's 1024 " \
           "rows at TP=1" in out


def test_a_truncated_parquet_file_is_one_line_naming_it(sp_dataset, tmp_path):
    """pyarrow's ArrowInvalid went up as a traceback, with --skip-bad too."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    whole = tmp_path / "whole.parquet"
    pq.write_table(pa.table({"inputs": ["a b c"] * 50, "targets": ["d e"] * 50,
                             "task": ["t1"] * 50}), str(whole))
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(whole.read_bytes()[:whole.stat().st_size // 2])
    model = sp_dataset[sp_dataset.index("--tokenizer-model") + 1]
    for extra, said in (([], f"error: {cut}: unreadable file: Parquet magic bytes not found"),
                        (["--skip-bad"], f"unreadable file: 1 file(s) (first {cut})")):
        done = subprocess.run([sys.executable, "tools/preprocess_flan.py", "--input", str(cut),
                               "--output-prefix", str(tmp_path / "out"), "--tokenizer-type",
                               "SentencePieceTokenizer", "--tokenizer-model", model,
                               "--no-progress", *extra], cwd=REPO, env=env_with_repo(),
                              capture_output=True, text=True, timeout=120)
        out = done.stdout + done.stderr
        assert done.returncode == 2 and "Traceback" not in out and said in out, out


@pytest.mark.parametrize("name", ["sum\x00mary", "\x1b[2Jwipe"])
def test_a_task_name_with_a_control_character_is_refused_naming_file_and_line(name):
    """NUL and ESC in a task name were echoed raw by every log line and summary."""
    from megatron.data.flan_records import CONTROL_IN_NAME, Rejection, parse_row
    got = parse_row({"inputs": "a", "targets": "b", "task": name}, "dump.jsonl", 7)
    assert isinstance(got, Rejection) and got.reason == CONTROL_IN_NAME
    assert str(got.error()).startswith(f"dump.jsonl:7: {CONTROL_IN_NAME}: 'task' holds "
                                       f"{name[name.index(chr(0)) if chr(0) in name else 0]!r}")
    assert parse_row({"inputs": "a\x00", "targets": "b", "task": "t"}, "d", 1).task == "t"
