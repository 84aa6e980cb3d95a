"""Training loop pieces: LR schedule, gradient clipping, mixed precision, logging; and the
slow end-to-end runs of pretrain_gpt.py / pretrain_t5.py under torchrun."""
import math

import pytest
import torch

from dynapipe_ext.batching.microbatch import MicroBatch
from megatron.training.arguments import parse_args
from megatron.training.optimizer import (TrainOptimizer, clip_by_norm, counts_toward_norm,
                                         global_grad_norm, learning_rate)
from megatron.training.train_logging import (IterationStats, progress_line, run_summary,
                                             shapes_summary)

torch.set_num_threads(1)


def test_learning_rate_warms_up_then_decays_to_min():
    lrs = [learning_rate(i, 1.0, 0.1, 4, 12, "cosine") for i in range(14)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:]))
    assert lrs[12] == pytest.approx(0.1) and lrs[13] == pytest.approx(0.1)
    assert learning_rate(8, 1.0, 0.0, 4, 12, "linear") == pytest.approx(0.5)
    assert learning_rate(8, 1.0, 0.0, 4, 12, "constant") == 1.0


@pytest.mark.parametrize("style", ["exponential", "linear", "cosine", "minus_sqrt"])
def test_wsd_matches_the_formula_and_megatron_cores_scheduler(style):
    """Warm-up 10, stable at lr, the last 20 of 100 decay iterations anneal to min_lr."""
    from types import SimpleNamespace

    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    lr, min_lr = 1.0, 0.1
    shape = {"exponential": lambda r: 2 * 0.5 ** r - 1, "linear": lambda r: 1 - r,
             "cosine": lambda r: 0.5 * (1 + math.cos(math.pi * r)),
             "minus_sqrt": lambda r: 1 - math.sqrt(r)}[style]

    def ours(it):
        return learning_rate(it, lr, min_lr, 10, 100, "WSD", 20, style)
    assert [ours(i) for i in (0, 4, 9)] == [0.1, 0.5, 1.0]          # warm-up
    assert ours(10) == ours(50) == ours(80) == lr                   # stable
    for it in (81, 85, 90, 99):                                     # annealing
        assert ours(it) == pytest.approx(min_lr + (lr - min_lr) * shape((it - 80) / 20))
    assert ours(100) == ours(150) == pytest.approx(min_lr)          # after the decay
    # megatron-core's own scheduler (its step count is our iteration after the warm-up)
    groups = [{"params": []}]
    megatron = OptimizerParamScheduler(
        SimpleNamespace(param_groups=groups), init_lr=0.0, max_lr=lr, min_lr=min_lr,
        lr_warmup_steps=10, lr_decay_steps=100, lr_decay_style="WSD", start_wd=0.0,
        end_wd=0.0, wd_incr_steps=100, wd_incr_style="constant", wsd_decay_steps=20,
        lr_wsd_decay_style=style)
    for it in (10, 40, 80, 81, 87, 95, 100, 120):
        megatron.num_steps = it
        assert ours(it) == pytest.approx(megatron.get_lr(groups[0])), it


def test_wsd_flags_are_checked_and_reach_the_schedule(capsys):
    from megatron.training.optimizer import schedule_settings
    base = ["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2",
            "--train-iters", "100", "--data-path", "x", "--lr-warmup-iters", "10"]
    cfg = parse_args("gpt", base + ["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "20",
                                    "--lr-wsd-decay-style", "cosine"], has_cuda=False)
    assert schedule_settings(cfg)["lr_wsd_decay_iters"] == 20
    assert schedule_settings(cfg)["lr_wsd_decay_style"] == "cosine"
    assert parse_args("gpt", base, has_cuda=False).lr_wsd_decay_style == "exponential"
    for extra, message in ((["--lr-decay-style", "WSD"], "got 0"),
                           (["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "95"],
                            "- --lr-warmup-iters = 90")):
        with pytest.raises(SystemExit):
            parse_args("gpt", base + extra, has_cuda=False)
        err = capsys.readouterr().err
        assert "--lr-decay-style WSD needs 0 < --lr-wsd-decay-iters" in err and message in err


def test_a_checkpoint_records_the_wsd_settings():
    from megatron.training.optimizer import resolve_schedule
    older = {"lr": 1.0, "min_lr": 0.0, "lr_warmup_iters": 0, "lr_decay_iters": 10,
             "lr_decay_style": "cosine"}          # written before WSD existed
    now = dict(older, lr_wsd_decay_iters=0, lr_wsd_decay_style="exponential")
    assert resolve_schedule(older, now, "check", "ckpt") == now
    wsd = dict(now, lr_decay_style="WSD", lr_wsd_decay_iters=4)
    with pytest.raises(ValueError) as err:
        resolve_schedule(now, wsd, "check", "ckpt")
    assert "--lr-wsd-decay-iters: checkpoint 0, now 4" in str(err.value)


def test_norm_counts_tensor_parallel_duplicates_and_shared_copies_once():
    split = torch.nn.Parameter(torch.zeros(2))
    split.tensor_model_parallel = True
    replicated = torch.nn.Parameter(torch.zeros(2))
    tied_copy = torch.nn.Parameter(torch.zeros(2))
    tied_copy.shared = True
    assert counts_toward_norm(split, tp_rank=1)
    assert counts_toward_norm(replicated, tp_rank=0)
    assert not counts_toward_norm(replicated, tp_rank=1)
    assert not counts_toward_norm(tied_copy, tp_rank=0)
    grads = [torch.tensor([3.0, 0.0]), torch.tensor([0.0, 4.0]), torch.tensor([100.0, 0.0])]
    params = [split, replicated, tied_copy]
    assert global_grad_norm(params, grads, tp_rank=0) == pytest.approx(5.0)
    assert global_grad_norm(params, grads, tp_rank=1) == pytest.approx(3.0)


def test_clipping_scales_to_the_max_norm_and_leaves_small_gradients():
    grads = [torch.tensor([3.0, 4.0])]
    assert clip_by_norm(grads, 5.0, 1.0) == pytest.approx(1 / 5, rel=1e-5)
    assert grads[0].norm().item() == pytest.approx(1.0, rel=1e-5)
    small = [torch.tensor([0.3, 0.4])]
    assert clip_by_norm(small, 0.5, 1.0) == 1.0 and small[0].tolist() == pytest.approx([0.3, 0.4])


def test_bf16_model_steps_fp32_main_weights():
    cfg = parse_args("gpt", ["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads",
                             "2", "--train-iters", "1",
                             "--data-path", "x", "--lr", "1e-4", "--weight-decay", "0",
                             "--clip-grad", "0"], has_cuda=True)
    w = torch.nn.Parameter(torch.full((4, 4), 1.0, dtype=torch.bfloat16))
    opt = TrainOptimizer([("w", w)], cfg)
    main = opt.main_params[0]
    assert main.dtype == torch.float32 and main is not w
    for it in range(3):
        w.sum().backward()      # grad of ones, lands in the fp32 main_grad
        opt.step(it)
    # Adam moves each weight by ~lr per step: invisible in bf16 alone, kept in fp32 main weights
    assert main[0, 0].item() == pytest.approx(1.0 - 3e-4, rel=1e-3)
    assert w.dtype == torch.bfloat16 and w.grad is None


def test_progress_line_reports_real_tokens_and_padding():
    mbs = [MicroBatch(rows=((0,), (1,)), seq_len=64), MicroBatch(rows=((2,), (3,)), seq_len=64),
           MicroBatch(rows=((4,),), seq_len=200)]
    assert shapes_summary(mbs) == "2*2x64 1x200"
    stats = IterationStats(iteration=3, train_iters=10, loss=2.5, lr=1e-3, grad_norm=0.5,
                           real_tokens=300, token_slots=456, num_micro_batches=3,
                           shapes=shapes_summary(mbs), plan_wait_s=0.01, iteration_s=0.5,
                           peak_memory_bytes=2**30)
    line = progress_line(stats)
    assert "600 tokens/s" in line and "padding eff 0.66" in line and "loss 2.5000" in line
    assert math.isclose(stats.padding_efficiency, 300 / 456)


def test_run_summary_counts_plan_wait_after_the_first_iteration():
    def stats(i, wait, seconds):
        return IterationStats(iteration=i, train_iters=3, loss=1.0, lr=1e-3, grad_norm=1.0,
                              real_tokens=1000, token_slots=1000, num_micro_batches=1,
                              shapes="1x1000", plan_wait_s=wait, iteration_s=seconds,
                              peak_memory_bytes=0)
    line = run_summary([stats(1, 5.0, 6.0), stats(2, 0.02, 1.0), stats(3, 0.0, 1.0)])
    assert "plan wait 0.020s of 2.00s (1.00% of iteration time)" in line
    assert "1,000 tokens/s" in line and "3 iterations" in line


# ---------------------------------------------------------------------------- end to end

import json
import os
import signal
import subprocess
import sys
import time

from tests.multiproc import free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
              "--tokens-per-global-batch", "1024", "--lr", "5e-3", "--lr-decay-style",
              "constant", "--distributed-timeout-minutes", "0.5", "--num-planner-workers", "1"]


def env_with_repo() -> dict:
    path = os.environ.get("PYTHONPATH")     # kept: it may be where megatron-core lives
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=REPO + (os.pathsep + path if path else ""))
    env.pop("RANK", None)
    return env


def run_tool(*args):
    subprocess.run([sys.executable, *args], cwd=REPO, env=env_with_repo(), check=True,
                   capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def sp_dataset(tmp_path_factory):
    """A small FLAN-like dump, a SentencePiece tokenizer trained on it, and its dataset."""
    d = tmp_path_factory.mktemp("flan")
    run_tool("tools/make_flan_sample.py", "--output", str(d / "flan.jsonl"),
             "--num-samples", "300", "--seed", "7")
    run_tool("tools/train_tokenizer.py", "--input", str(d / "flan.jsonl"),
             "--model-prefix", str(d / "sp"), "--vocab-size", "1000")
    run_tool("tools/preprocess_flan.py", "--input", str(d / "flan.jsonl"), "--output-prefix",
             str(d / "flan"), "--tokenizer-type", "SentencePieceTokenizer",
             "--tokenizer-model", str(d / "sp.model"), "--no-progress")
    return ["--data-path", str(d / "flan"), "--tokenizer-type", "SentencePieceTokenizer",
            "--tokenizer-model", str(d / "sp.model")]


def torchrun(script: str, args, stats_file, nproc: int = 2, timeout: float = 240):
    """Run `script` under torchrun on CPU; returns the per-iteration stats of rank 0."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           script, *args, "--stats-file", str(stats_file)]
    done = subprocess.run(cmd, cwd=REPO, env=env_with_repo(), capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"{script} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    assert "tokens/s" in done.stdout and "padding eff" in done.stdout
    return [json.loads(line) for line in open(stats_file)]


@pytest.mark.slow
def test_gpt_pp2_dynamic_trains_and_resumes_exactly(sp_dataset, tmp_path):
    args = sp_dataset + TINY_MODEL + ["--pipeline-model-parallel-size", "2",
                                      "--micro-batching", "dynamic", "--seq-length", "128"]
    ckpt = tmp_path / "ckpt"
    straight = torchrun("pretrain_gpt.py", args + ["--train-iters", "6", "--save", str(ckpt),
                                                   "--save-interval", "3"],
                        tmp_path / "straight.jsonl")
    losses = [s["loss"] for s in straight]
    assert [s["iteration"] for s in straight] == [1, 2, 3, 4, 5, 6]
    assert all(math.isfinite(x) for x in losses)
    assert max(losses[-2:]) < losses[0], f"loss did not decrease: {losses}"
    assert all(s["num_micro_batches"] >= 1 and s["real_tokens"] <= 1024 for s in straight)
    for s in straight:      # where rank 0's iteration time went (step_timing)
        parts = s["time_parts"]
        assert parts["forward"] > 0 and parts["backward"] > 0
        assert sum(parts.values()) == pytest.approx(s["iteration_s"], rel=0.05, abs=0.01)

    # A run stopped after the save at iteration 3 (the save at 6 never happened) and resumed.
    (ckpt / "latest_checkpointed_iteration.txt").write_text("3\n")
    resumed = torchrun("pretrain_gpt.py", args + ["--train-iters", "6", "--load", str(ckpt)],
                       tmp_path / "resumed.jsonl")
    assert [s["iteration"] for s in resumed] == [4, 5, 6]
    assert [s["loss"] for s in resumed] == losses[3:]          # bit-for-bit on CPU
    assert [s["grad_norm"] for s in resumed] == [s["grad_norm"] for s in straight[3:]]


def start_ranks(script: str, args, out_dir, nproc: int = 2) -> list:
    """`script` as `nproc` rank processes (env:// rendezvous, as torchrun sets it up), each
    writing to out_dir/rank<R>.out; returns the Popen objects."""
    port = free_port()
    procs = []
    for rank in range(nproc):
        env = dict(env_with_repo(), RANK=str(rank), LOCAL_RANK=str(rank),
                   WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        with open(out_dir / f"rank{rank}.out", "w") as out:
            procs.append(subprocess.Popen([sys.executable, script, *args], cwd=REPO, env=env,
                                          stdout=out, stderr=subprocess.STDOUT))
    return procs


@pytest.mark.slow
def test_resuming_a_finished_run_exits_at_once_on_every_rank(sp_dataset, tmp_path):
    args = sp_dataset + TINY_MODEL + ["--pipeline-model-parallel-size", "2", "--seq-length",
                                      "128", "--train-iters", "2"]
    ckpt = tmp_path / "ckpt"
    torchrun("pretrain_gpt.py", args + ["--save", str(ckpt)], tmp_path / "first.jsonl")
    procs = start_ranks("pretrain_gpt.py", args + ["--load", str(ckpt), "--save", str(ckpt)],
                        tmp_path)
    exited = {}
    try:
        deadline = time.monotonic() + 180
        while len(exited) < len(procs) and time.monotonic() < deadline:
            for rank, proc in enumerate(procs):
                if rank not in exited and proc.poll() is not None:
                    exited[rank] = time.monotonic()
            time.sleep(0.1)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    outs = [(tmp_path / f"rank{r}.out").read_text() for r in range(len(procs))]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)
    line = "[train] checkpoint at iteration 2 of --train-iters 2: nothing left to train"
    assert outs[0].count(line) == 1 and line not in outs[1], outs
    assert not any("iter " in o or "saved checkpoint" in o for o in outs), outs
    # no rank waits for plans or peers: they end together, not a 30 s distributed timeout
    # apart (start-up itself is slow on a loaded machine, so it is not what is timed)
    assert max(exited.values()) - min(exited.values()) < 15, exited


@pytest.mark.slow
def test_gpt_cut_in_half_layers_trains_as_the_uncut_model(sp_dataset, tmp_path):
    """3 layers over 2 stages (--pipeline-split balanced cuts inside a layer), and over the 4
    stages of Hanayo's wave layout (--pipeline-split 2,1,2,1: stage 1 is layer 1's
    attention, stage 2 its MLP and layer 2's attention): the same losses as one process
    running the whole model, and the 2-stage run's checkpoint loads into the uncut model."""
    args = sp_dataset + TINY_MODEL + ["--num-layers", "3", "--micro-batching", "dynamic",
                                      "--seq-length", "128", "--hidden-dropout", "0",
                                      "--attention-dropout", "0"]   # masks differ by layout
    whole = torchrun("pretrain_gpt.py", args + ["--train-iters", "3"], tmp_path / "whole.jsonl",
                     nproc=1)
    ckpt = tmp_path / "ckpt"
    cut = torchrun("pretrain_gpt.py", args + ["--train-iters", "3", "--pipeline-split",
                                              "balanced", "--pipeline-model-parallel-size", "2",
                                              "--save", str(ckpt), "--save-interval", "2"],
                   tmp_path / "cut.jsonl")
    wave = torchrun("pretrain_gpt.py", args + ["--train-iters", "3", "--pipeline-split",
                                               "2,1,2,1", "--pipeline-schedule", "wave",
                                               "--pipeline-model-parallel-size", "2"],
                    tmp_path / "wave.jsonl")
    assert len(cut) == len(wave) == len(whole) == 3
    for a, w, b in zip(cut, wave, whole):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (cut, whole)
        assert w["loss"] == pytest.approx(b["loss"], rel=1e-5), (wave, whole)
    # the cut run's iteration-2 checkpoint, resumed by one process running the uncut model
    (ckpt / "latest_checkpointed_iteration.txt").write_text("2\n")
    resumed = torchrun("pretrain_gpt.py", args + ["--train-iters", "3", "--load", str(ckpt)],
                       tmp_path / "resumed.jsonl", nproc=1)
    assert [s["iteration"] for s in resumed] == [3]
    assert resumed[0]["loss"] == pytest.approx(cut[2]["loss"], rel=1e-5)


@pytest.mark.slow
def test_t5_pp2_dynamic_trains(sp_dataset, tmp_path):
    """T5 at PP=2 interleaved, its layers from --encoder-num-layers / --decoder-num-layers and
    the virtual stages from Megatron's --num-layers-per-virtual-pipeline-stage (4 layers / (2
    ranks x 1) = 2 stages per rank)."""
    args = sp_dataset + TINY_MODEL + ["--pipeline-model-parallel-size", "2",
                                      "--encoder-num-layers", "2", "--decoder-num-layers", "2",
                                      "--pipeline-schedule", "interleaved",
                                      "--num-layers-per-virtual-pipeline-stage", "1",
                                      "--micro-batching", "dynamic",
                                      "--encoder-seq-length", "128", "--decoder-seq-length",
                                      "32", "--train-iters", "6"]
    stats = torchrun("pretrain_t5.py", args, tmp_path / "t5.jsonl")
    losses = [s["loss"] for s in stats]
    assert max(losses[-2:]) < losses[0], f"loss did not decrease: {losses}"
    assert all("/" in s["shapes"] for s in stats)   # T5 shapes carry encoder/decoder lengths


@pytest.mark.slow
def test_gpt_packing_window_trains_on_whole_rows_and_resumes_exactly(sp_dataset, tmp_path):
    """--packing-window: rows packed ahead by the sampler reach the planner whole (every
    micro-batch row is one of them), and a resumed run sees the same batches and losses."""
    args = sp_dataset + TINY_MODEL + ["--pipeline-model-parallel-size", "2",
                                      "--micro-batching", "packing", "--packing-algorithm",
                                      "lpfhp", "--packing-window", "150", "--seq-length", "128"]
    ckpt = tmp_path / "ckpt"
    straight = torchrun("pretrain_gpt.py", args + ["--train-iters", "4", "--save", str(ckpt),
                                                   "--save-interval", "2"],
                        tmp_path / "straight.jsonl")
    assert all(math.isfinite(s["loss"]) and s["real_tokens"] <= 1024 for s in straight)
    # lpfhp over 150 samples fills 128-token rows far better than next-fit per batch does
    assert sum(s["real_tokens"] for s in straight) / sum(
        s["token_slots"] for s in straight) > 0.9
    (ckpt / "latest_checkpointed_iteration.txt").write_text("2\n")
    resumed = torchrun("pretrain_gpt.py", args + ["--train-iters", "4", "--load", str(ckpt)],
                       tmp_path / "resumed.jsonl")
    assert [s["iteration"] for s in resumed] == [3, 4]
    assert [s["loss"] for s in resumed] == [s["loss"] for s in straight[2:]]
    assert [s["real_tokens"] for s in resumed] == [s["real_tokens"] for s in straight[2:]]


def _samples_built(rank, world_size, argv, iterations):
    """Train `iterations` in-process; what this rank built and what it was planned to train."""
    from megatron.model.batch_tensors import count_loss_tokens
    from megatron.training.training import build_run, train
    run = build_run(parse_args("gpt", argv, has_cuda=False), verbose=False)
    ids = [run.data.sample_ids(it) for it in range(iterations)]
    before = [count_loss_tokens(run.data.batch_samples(it), range(len(ids[it])))
              for it in range(iterations)]    # the denominator as every rank counted it
    built, planned, fetch, arrays = [], [], run.plans.fetch, run.data.sample_arrays
    run.data.sample_arrays = lambda index: built.append(index) or arrays(index)

    def fetch_and_keep(iteration):
        delivered = fetch(iteration)
        planned.append(delivered.plan)
        return delivered
    run.plans.fetch = fetch_and_keep
    history = train(run)
    return {"built": sorted(built), "before": before, "losses": [h.loss for h in history],
            "batch": [sorted(int(i) for i in x) for x in ids],
            "replica": [sorted(int(ids[p.iteration][s]) for mb in p.micro_batches
                               for s in mb.sample_ids) for p in planned],
            "loss_tokens": [p.loss_tokens for p in planned], "dp_rank": planned[0].dp_rank}


@pytest.mark.slow
def test_at_dp2_each_rank_builds_only_its_replicas_samples(sp_dataset):
    """At DP=2 a rank builds the samples its replica trains on and no other, and the global
    loss-token count its plan carries is the one counted over every sample of the batch."""
    from tests.multiproc import run_in_processes
    argv = sp_dataset + TINY_MODEL + ["--micro-batching", "dynamic", "--seq-length", "128",
                                      "--train-iters", "2", "--num-planner-workers", "0"]
    ranks = run_in_processes(_samples_built, 2, args=(argv, 2), timeout_s=600)
    assert sorted(r["dp_rank"] for r in ranks) == [0, 1]
    for r in ranks:
        assert r["built"] == sorted(i for ids in r["replica"] for i in ids)
        assert r["loss_tokens"] == r["before"]
        assert 0 < len(r["built"]) < sum(len(ids) for ids in r["batch"])
    for it in range(2):   # the replicas share the batch out, each sample once
        assert sorted(ranks[0]["replica"][it] + ranks[1]["replica"][it]) == \
            ranks[0]["batch"][it]
    assert ranks[0]["losses"] == ranks[1]["losses"]


@pytest.mark.slow
def test_t5_trains_with_a_pair_packer(sp_dataset, tmp_path):
    args = sp_dataset + TINY_MODEL + ["--pipeline-model-parallel-size", "2", "--num-layers",
                                      "1", "--micro-batching", "packing",
                                      "--packing-algorithm", "lpfhp", "--max-pack-depth", "8",
                                      "--encoder-seq-length", "128", "--decoder-seq-length",
                                      "32", "--train-iters", "3"]
    stats = torchrun("pretrain_t5.py", args, tmp_path / "t5.jsonl")
    assert [s["iteration"] for s in stats] == [1, 2, 3]
    assert all(math.isfinite(s["loss"]) for s in stats)


@pytest.mark.slow
def test_a_dead_rank_makes_the_other_exit_with_an_error(sp_dataset, tmp_path):
    port = free_port()
    args = sp_dataset + TINY_MODEL + ["--pipeline-model-parallel-size", "2", "--seq-length",
                                      "128", "--train-iters", "500"]
    procs, outs = [], []
    for rank in range(2):
        env = dict(env_with_repo(), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        out = open(tmp_path / f"rank{rank}.out", "w+")
        procs.append(subprocess.Popen([sys.executable, "pretrain_gpt.py", *args], cwd=REPO,
                                      env=env, stdout=out, stderr=subprocess.STDOUT))
        outs.append(out)
    try:
        deadline = time.monotonic() + 120
        while "iter 2/500" not in (tmp_path / "rank0.out").read_text():
            assert procs[0].poll() is None, (tmp_path / "rank0.out").read_text()[-3000:]
            assert time.monotonic() < deadline, "training did not start"
            time.sleep(0.5)
        procs[1].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        code = procs[0].wait(timeout=0.5 * 60 + 30)   # the distributed timeout, plus slack
        took = time.monotonic() - killed_at
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for out in outs:
            out.close()
    text = (tmp_path / "rank0.out").read_text()
    assert code != 0
    assert "TrainingFailed: rank 0" in text and "failed" in text, text[-3000:]
    assert "another rank's process ended (its own error line says why)" in text, text[-3000:]
    assert took < 0.5 * 60 + 30


# ---------------------------------------------------------------------------- setup faults

from dynapipe_ext.plan.instructions import ExecutionPlan
from megatron.training.arguments import ConfigError
from megatron.base.distributed_setup import ParallelLayout
from megatron.training.training import (RunSetupError, agree_or_raise, build_run,
                                        plan_problems)


def setup_error(monkeypatch, model, argv, world_size=2, rank=1):
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    model_flags = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "2",
                   "--train-iters", "2"]
    cfg = parse_args(model, model_flags + argv, has_cuda=False)
    with pytest.raises((RunSetupError, ConfigError, ValueError)) as err:
        build_run(cfg)
    return str(err.value)


def test_missing_dataset_files_are_named_before_any_collective(monkeypatch, tmp_path):
    msg = setup_error(monkeypatch, "gpt", ["--data-path", str(tmp_path / "nothing")])
    assert "rank 1" in msg and "missing" in msg and "nothing_tasks.json" in msg
    assert "tools/preprocess_flan.py" in msg


def test_dataset_of_another_tokenizer_is_rejected(monkeypatch, sp_dataset, tmp_path):
    data_path = sp_dataset[1]
    msg = setup_error(monkeypatch, "gpt", ["--data-path", data_path])   # GPT-2 BPE by default
    assert "tokenised with SentencePieceTokenizer" in msg and "GPT2BPETokenizer" in msg
    run_tool("tools/train_tokenizer.py", "--input",
             os.path.join(os.path.dirname(data_path), "flan.jsonl"), "--model-prefix", str(tmp_path / "other"), "--vocab-size", "800")
    msg = setup_error(monkeypatch, "gpt", ["--data-path", data_path, "--tokenizer-type",
                                           "SentencePieceTokenizer", "--tokenizer-model",
                                           str(tmp_path / "other.model")])
    assert "vocabulary of 1000 tokens" in msg and "has 800" in msg


def copy_dataset(data_path_args, to):
    """A copy of sp_dataset's dataset (manifest and data folder) under `to`; its files."""
    import glob
    import shutil
    prefix = data_path_args[data_path_args.index("--data-path") + 1]
    os.makedirs(to)
    for path in glob.glob(prefix + "*"):
        (shutil.copytree if os.path.isdir(path) else shutil.copy)(
            path, os.path.join(to, os.path.basename(path)))
    args = list(data_path_args)
    args[args.index("--data-path") + 1] = os.path.join(to, "flan")
    folder = glob.glob(os.path.join(to, "flan.data-*"))[0]
    return args, folder


@pytest.mark.parametrize("damage,named", [
    ("inputs.idx", "inputs.idx: cannot read it (ValueError: not a Megatron indexed dataset "
                   "index (bad header))"),
    ("task_ids.npy", "task_ids.npy: cannot read it"),
])
def test_a_damaged_dataset_file_of_the_right_size_is_named(monkeypatch, sp_dataset, tmp_path,
                                                          damage, named):
    """Same size as the manifest says, other bytes: megatron-core's assert or numpy's error
    named no file (and the assert was printed by every rank); now a set-up error naming it."""
    args, folder = copy_dataset(sp_dataset, str(tmp_path / "copy"))
    with open(os.path.join(folder, damage), "r+b") as f:
        f.write(b"XXXXXXXXXX")
    msg = setup_error(monkeypatch, "gpt", args)
    assert f"rank 1: --data-path {tmp_path}/copy/flan: {folder}/{named}" in msg


def test_a_damaged_manifest_is_named(monkeypatch, sp_dataset, tmp_path):
    args, _ = copy_dataset(sp_dataset, str(tmp_path / "copy"))
    manifest = tmp_path / "copy" / "flan_tasks.json"
    table = json.loads(manifest.read_text())
    del table["files"]
    manifest.write_text(json.dumps(table))
    msg = setup_error(monkeypatch, "gpt", args)
    assert f"{manifest}: a damaged manifest (its data_dir / files entries: KeyError" in msg


def test_a_tokenizer_file_that_is_no_tokenizer_is_a_set_up_error_naming_it(monkeypatch,
                                                                            sp_dataset,
                                                                            tmp_path):
    bad = tmp_path / "sp.model"
    bad.write_bytes(bytes(range(256)) * 8)
    args = list(sp_dataset)
    args[args.index("--tokenizer-model") + 1] = str(bad)
    msg = setup_error(monkeypatch, "gpt", args)
    assert msg.startswith(f"rank 1: --tokenizer-type SentencePieceTokenizer: {bad}: not a "
                          f"SentencePiece model")


def test_world_size_not_divisible_by_tp_times_pp_fails_before_any_collective(monkeypatch,
                                                                             sp_dataset):
    msg = setup_error(monkeypatch, "gpt", sp_dataset + ["--pipeline-model-parallel-size", "2"],
                      world_size=3)
    assert "world size 3 is not divisible" in msg


def make_plan(**overrides):
    fields = dict(iteration=4, dp_rank=0, pp_rank=1, stage_to_rank=(0, 1), schedule="1f1b",
                  micro_batches=(MicroBatch(rows=((0,), (1,)), seq_len=16),), instructions=(),
                  dtype="float32", loss_tokens=7)
    fields.update(overrides)
    return ExecutionPlan(**fields)


def test_plan_for_another_rank_or_layout_is_described():
    layout = ParallelLayout(tp=1, pp=2, dp=1, tp_rank=0, pp_rank=1, dp_rank=0, rank=1,
                            world_size=2, device=torch.device("cpu"))
    assert plan_problems(make_plan(), 4, layout, (0, 1), "float32", 2) == []
    problems = plan_problems(make_plan(pp_rank=0, iteration=5, stage_to_rank=(0, 1, 1, 0),
                                       micro_batches=(MicroBatch(rows=((7,),), seq_len=8),)),
                             4, layout, (0, 1), "float32", 2)
    text = " | ".join(problems)
    assert "iteration 5, expected 4" in text
    assert "(dp 0, pp 0), this rank is (dp 0, pp 1)" in text
    assert "(0, 1, 1, 0)" in text and "samples [7] outside the global batch of 2" in text
    assert "plan carries 0 loss tokens" in " ".join(
        plan_problems(make_plan(loss_tokens=0), 4, layout, (0, 1), "float32", 2))


def _agree(rank, world_size):
    import torch.distributed as dist
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    problems = ["plan is for pp 0"] if rank == 1 else []
    try:
        agree_or_raise(problems, "iteration 3: the plan does not match this rank")
    except RunSetupError as err:
        return str(err)
    return "no error"


@pytest.mark.slow
def test_a_bad_plan_on_one_rank_is_an_error_on_every_rank():
    from tests.multiproc import run_in_processes
    messages = run_in_processes(_agree, 2, timeout_s=120)
    for msg in messages:
        assert "iteration 3: the plan does not match this rank" in msg
        assert "rank 1: plan is for pp 0" in msg


def _resume_from(rank, world_size, iterations):
    import torch.distributed as dist
    from megatron.training.training import agree_on_start
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    layout = ParallelLayout(tp=1, pp=2, dp=1, tp_rank=0, pp_rank=rank, dp_rank=0, rank=rank,
                            world_size=2, device=torch.device("cpu"))
    try:
        return agree_on_start(iterations[rank], "ckpt", layout)
    except RunSetupError as err:
        return str(err)


@pytest.mark.slow
def test_ranks_resuming_from_different_checkpoints_is_an_error_on_every_rank():
    from tests.multiproc import run_in_processes
    for msg in run_in_processes(_resume_from, 2, args=((20, 10),), timeout_s=120):
        assert "--load ckpt: the ranks resume from different checkpoints (rank 0: iteration " \
               "20, rank 1: iteration 10)" in msg


def test_wave_layout_that_does_not_split_the_model_fails_before_any_collective(capsys,
                                                                              sp_dataset):
    with pytest.raises(SystemExit):      # at parsing, before any process group exists
        parse_args("gpt", sp_dataset + ["--num-layers", "2", "--hidden-size", "32",
                                        "--num-attention-heads", "2", "--train-iters", "2",
                                        "--pipeline-model-parallel-size", "2",
                                        "--pipeline-schedule", "wave"], has_cuda=False)
    msg = capsys.readouterr().err
    assert "2 transformer layers do not split evenly over 4 pipeline stages" in msg


@pytest.mark.parametrize("given", ["auto", "sdpa", "dense-mask"])
def test_planner_costs_attention_as_the_built_layers_compute_it(given):
    """--attention-backend is resolved once (auto: sdpa on CPU) and both the layers' core
    attention and the planner's costing of packed rows derive from that one value."""
    from dynapipe_ext.batching.planners import ATTENTION_COSTING
    from megatron.model.attention import SDPAttention
    from megatron.training.training import build_stages, model_spec, planner_config
    cfg = parse_args("t5", ["--data-path", "d", "--num-layers", "2", "--hidden-size", "32",
                            "--num-attention-heads", "2", "--train-iters", "2",
                            "--micro-batching", "packing", "--attention-backend", given],
                     has_cuda=False)
    assert cfg.attention_backend == ("sdpa" if given == "auto" else given)
    spec = model_spec(cfg, 100)
    from tests.multiproc import single_process_world
    with single_process_world(seed=1):
        stages = build_stages(cfg, spec, ParallelLayout.data_parallel(0, 1), (0,))
    cores = [m for module in stages.values() for m in module.modules()
             if isinstance(m, SDPAttention)]
    assert len(cores) == 2 + 2 * 2      # encoder self, decoder self + cross, per layer
    assert {m.backend for m in cores} == {cfg.attention_backend}
    costed = planner_config(cfg, spec, 1).planner.packed_attention
    assert costed == ATTENTION_COSTING[cfg.attention_backend] == \
        ("mask" if given == "dense-mask" else "segments")


def test_attention_backend_resolves_from_the_device_and_dropout(monkeypatch):
    from megatron.training.arguments import resolve_attention_backend
    monkeypatch.delenv("DYNAPIPE_DEVICE", raising=False)
    assert resolve_attention_backend("auto", True, 0.0) == "flex"
    assert resolve_attention_backend("auto", True, 0.1) == "sdpa"    # flex has no dropout
    assert resolve_attention_backend("auto", False, 0.0) == "sdpa"
    assert resolve_attention_backend("dense-mask", True, 0.1) == "dense-mask"
    with pytest.raises(ConfigError, match="--attention-backend flex runs on CUDA only"):
        resolve_attention_backend("flex", False, 0.0)
    with pytest.raises(ConfigError, match="flex has no attention dropout"):
        resolve_attention_backend("flex", True, 0.1)
    monkeypatch.setenv("DYNAPIPE_DEVICE", "cpu")
    assert resolve_attention_backend("auto", True, 0.0) == "sdpa"


@pytest.mark.parametrize("flags,stages", [
    (["--pipeline-schedule", "wave"], 4),
    (["--pipeline-schedule", "wave", "--pipeline-waves", "2"], 8),
    (["--pipeline-schedule", "interleaved", "--num-virtual-stages-per-pipeline-rank", "3"], 6),
    (["--pipeline-schedule", "1f1b"], 2)])
def test_balanced_split_cuts_every_virtual_stage(flags, stages):
    """--pipeline-split balanced cuts the model into all 2*W*P (wave) or v*P (interleaved)
    stages in half layers, so each stage of each rank gets its share (the start-up
    measurement then moves the cut; this is the even spread it starts from)."""
    from megatron.training.training import given_cut, model_spec
    cfg = parse_args("gpt", ["--data-path", "d", "--num-layers", "6", "--hidden-size", "32",
                             "--num-attention-heads", "2", "--train-iters", "2",
                             "--pipeline-model-parallel-size", "2",
                             "--pipeline-split", "balanced"] + flags, has_cuda=False)
    cut = given_cut(cfg, model_spec(cfg, 128))
    assert len(cut) == stages and sum(cut) == 12 and max(cut) - min(cut) <= 1
