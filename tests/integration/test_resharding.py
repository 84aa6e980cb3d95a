"""Reshardable checkpoints end to end: a GPT run saved at TP=2 x PP=2 resumes at TP=1 x PP=4,
at PP=1 x DP=2 and as a single process, and its next iterations' losses equal the uninterrupted
TP=2 x PP=2 run's (fp32, within 1e-6 relative). Iteration 3's loss checks the weights, iteration
4's also the Adam moments (its step is the first that uses them)."""
import json
import subprocess
import sys

import pytest
import torch

from megatron.checkpoint import checkpointing as ckpt
from tests.multiproc import free_port
from tests.training.test_training import REPO, env_with_repo, sp_dataset  # noqa: F401

COMMON = ["--hidden-size", "32", "--num-attention-heads", "2", "--tokens-per-global-batch",
          "1024", "--lr", "5e-3", "--lr-warmup-iters", "1", "--lr-decay-style", "cosine",
          "--min-lr", "5e-4", "--train-iters", "4", "--distributed-timeout-minutes", "1",
          "--num-planner-workers", "0",
          # dropout masks depend on the layout (streams per TP / PP rank), so losses compare
          # across layouts only without it
          "--hidden-dropout", "0", "--attention-dropout", "0"]
RUN = COMMON + ["--num-layers", "4", "--seq-length", "128"]
T5_RUN = COMMON + ["--encoder-num-layers", "3", "--decoder-num-layers", "1",
                   "--encoder-seq-length", "128", "--decoder-seq-length", "32"]
SAVED_AT = 2


def torchrun(args, nproc: int, stats_file, script: str = "pretrain_gpt.py"
             ) -> tuple[list[dict], str]:
    """`script` under torchrun on CPU: (rank 0's per-iteration stats, output)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           script, *args, "--stats-file", str(stats_file)]
    done = subprocess.run(cmd, cwd=REPO, env=env_with_repo(), capture_output=True, text=True,
                          timeout=400)
    out = done.stdout + done.stderr
    assert done.returncode == 0, f"{script} failed:\n{out[-6000:]}"
    return [json.loads(line) for line in open(stats_file)], out


@pytest.fixture(scope="module")
def tp2_pp2_run(sp_dataset, tmp_path_factory):  # noqa: F811 - the fixture imported above
    """The uninterrupted TP=2 x PP=2 run (4 iterations, saving after 2 and 4) and its
    checkpoint directory with `latest` moved back to iteration 2 (as if it stopped there)."""
    d = tmp_path_factory.mktemp("reshard")
    stats, _ = torchrun(sp_dataset + RUN + ["--tensor-model-parallel-size", "2",
                                            "--pipeline-model-parallel-size", "2",
                                            "--save", str(d / "ckpt"),
                                            "--save-interval", str(SAVED_AT)],
                        4, d / "straight.jsonl")
    assert [s["iteration"] for s in stats] == [1, 2, 3, 4]
    (d / "ckpt" / ckpt.LATEST).write_text(f"{SAVED_AT}\n")
    return sp_dataset, stats, d


def close(a: float, b: float, rel: float = 1e-6) -> bool:
    return abs(a - b) <= rel * abs(b)


def check_resume(tp2_pp2_run, layout_flags, nproc, name):
    data, straight, d = tp2_pp2_run
    resumed, out = torchrun(data + RUN + layout_flags + ["--load", str(d / "ckpt")], nproc,
                            d / f"{name}.jsonl")
    assert [s["iteration"] for s in resumed] == [3, 4]
    for got, want in zip(resumed, straight[SAVED_AT:]):
        assert close(got["loss"], want["loss"]), (name, got["loss"], want["loss"])
        assert got["lr"] == want["lr"]
    assert close(resumed[0]["grad_norm"], straight[SAVED_AT]["grad_norm"], 1e-5)
    assert "saved at TP=2 PP=2 DP=1 on 4 ranks" in out
    assert out.count("RNG states not restored") == 1          # rank 0 says it, once


@pytest.mark.slow
def test_tp2_pp2_checkpoint_resumes_at_tp1_pp4(tp2_pp2_run):
    check_resume(tp2_pp2_run, ["--pipeline-model-parallel-size", "4"], 4, "tp1_pp4")


@pytest.mark.slow
def test_tp2_pp2_checkpoint_resumes_at_pp1_dp2(tp2_pp2_run):
    check_resume(tp2_pp2_run, [], 2, "dp2")


@pytest.mark.slow
def test_tp2_pp2_checkpoint_resumes_in_one_process(tp2_pp2_run):
    check_resume(tp2_pp2_run, [], 1, "single")


@pytest.mark.slow
def test_tp2_pp2_checkpoint_exports_the_full_model_from_one_process(tp2_pp2_run):
    """read_full_model_state reassembles the TP-split parameters from all four files in one
    process, and save_model_only_checkpoint writes them back unchanged (export / import);
    --finetune trains on from either checkpoint alike: iteration 1 with the weights of
    iteration 2, a fresh optimizer and the sampler from the start."""
    data, straight, d = tp2_pp2_run
    full = ckpt.read_full_model_state(str(d / "ckpt"))
    assert full["embedding.word_embeddings.weight"].shape == (1024, 32)
    assert "output_layer.weight" not in full      # tied to the word embedding (the default)
    assert full["decoder.layers.3.mlp.linear_fc1.weight"].shape == (128, 32)
    assert {int(n.split(".")[2]) for n in full if n.startswith("decoder.layers.")} == \
        {0, 1, 2, 3}
    common = ckpt.read_common(str(d / "ckpt"))
    assert common["layout"] == {"world_size": 4, "tp": 2, "pp": 2, "dp": 1}
    assert sorted(common["index"]) == [ckpt.shard_file_name(p, t) for p in (0, 1)
                                       for t in (0, 1)]
    ckpt.save_model_only_checkpoint(str(d / "model_only"), 0, full, common["config"])
    again = ckpt.read_full_model_state(str(d / "model_only"))
    assert again.keys() == full.keys()
    assert all(torch.equal(again[n], full[n]) for n in full)
    runs = []
    for source in ("ckpt", "model_only"):
        stats, _ = torchrun(data + RUN + ["--load", str(d / source), "--finetune",
                                          "--train-iters", "2"], 1, d / f"ft_{source}.jsonl")
        runs.append([(s["iteration"], s["loss"], s["lr"]) for s in stats])
    assert runs[0] == runs[1] and [it for it, _, _ in runs[0]] == [1, 2]
    assert not close(runs[0][0][1], straight[0]["loss"], 1e-3)   # not the initial weights


@pytest.mark.slow
def test_t5_tp2_pp2_checkpoint_resumes_at_tp1_pp4(sp_dataset, tmp_path):  # noqa: F811
    """T5 with 3 encoder and 1 decoder layers: at PP=2 the second stage holds the end of the
    encoder, the encoder norm, the decoder embedding and the decoder; at PP=4 those sit on
    the last two stages. The global names put every weight back where it belongs."""
    args = sp_dataset + T5_RUN
    straight, _ = torchrun(args + ["--tensor-model-parallel-size", "2",
                                   "--pipeline-model-parallel-size", "2",
                                   "--save", str(tmp_path / "ckpt"),
                                   "--save-interval", str(SAVED_AT)],
                           4, tmp_path / "straight.jsonl", "pretrain_t5.py")
    (tmp_path / "ckpt" / ckpt.LATEST).write_text(f"{SAVED_AT}\n")
    resumed, out = torchrun(args + ["--pipeline-model-parallel-size", "4",
                                    "--load", str(tmp_path / "ckpt")],
                            4, tmp_path / "resumed.jsonl", "pretrain_t5.py")
    assert [s["iteration"] for s in resumed] == [3, 4]
    for got, want in zip(resumed, straight[SAVED_AT:]):
        assert close(got["loss"], want["loss"]), (got["loss"], want["loss"])
    assert "saved at TP=2 PP=2 DP=1 on 4 ranks" in out
