"""tools/evaluate.py: a GPT-2 converted from a random transformers model, evaluated on a
dataset, gives transformers' loss over the same batches and transformers' logits on the same
tokens; at TP=2 and at PP=2 the same loss; bad set-ups are one line."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.multiproc import free_port
from tests.integration.test_hf_convert import convert, random_gpt2
from tests.training.test_training import REPO, env_with_repo, sp_dataset  # noqa: F401 - a fixture

transformers = pytest.importorskip("transformers")

# 2 layers, hidden 24, 4 heads, the dataset's 1000-token vocabulary, 128 positions; the
# vocabulary is padded to a multiple of 4 x TP (none at TP 1 and 2), so the loss is
# transformers' exactly
SHAPE = (2, 24, 4, 1000, 128)
VOCAB_FLAGS = ["--make-vocab-size-divisible-by", "4"]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(transformers model, our checkpoint dir, the training flags convert_checkpoint printed)."""
    d = tmp_path_factory.mktemp("evaluate")
    model = random_gpt2(d / "hf", *SHAPE, seed=4)
    out = convert(d / "hf", d / "ours", *VOCAB_FLAGS)
    flags = out.split("train with: ", 1)[1].split()
    return model, str(d / "ours"), flags


def evaluate(args, nproc=1, timeout=300):
    cmd = [sys.executable, "tools/evaluate.py", *args] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "tools/evaluate.py",
        *args]
    return subprocess.run(cmd, cwd=REPO, env=env_with_repo(), capture_output=True, text=True,
                          timeout=timeout)


def base_args(converted, sp_dataset, stats_file):  # noqa: F811
    _, ckpt, flags = converted
    return ["--model", "gpt", "--load", ckpt, *sp_dataset, *flags, "--seq-length", "128",
            "--tokens-per-global-batch", "1024", "--eval-iters", "2", "--stats-file",
            str(stats_file)]


def transformers_loss(model, cfg) -> float:
    """Token-weighted loss of `model` over the batches tools/evaluate.py evaluates (the
    validation data's first --eval-iters global batches, GPT view: loss on the targets)."""
    from megatron.training.training import open_training_data
    data = open_training_data(cfg, 0, "valid")
    total = tokens = 0.0
    with torch.no_grad():
        for k in range(cfg.eval_iters):
            for ids, labels, mask in data.batch_samples(k).values():
                logits = model(torch.from_numpy(np.asarray(ids))[None]).logits[0].double()
                losses = torch.nn.functional.cross_entropy(
                    logits, torch.from_numpy(np.asarray(labels)), reduction="none")
                total += float((losses * torch.from_numpy(np.asarray(mask)).double()).sum())
                tokens += float(np.sum(mask))
    return total / tokens


def test_converted_gpt2_loss_and_logits_are_those_of_transformers(converted,
                                                                  sp_dataset,  # noqa: F811
                                                                  tmp_path):
    model = converted[0]
    args = base_args(converted, sp_dataset, tmp_path / "eval.jsonl")
    done = evaluate(args + ["--print-logits", "2", "--logits-top-k", "4"])
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines[0].startswith(f"[eval] --load {converted[1]} | loss ")
    record = json.loads((tmp_path / "eval.jsonl").read_text())
    assert record["batches"] == 2 and record["loss_tokens"] > 0
    assert record["ppl"] == pytest.approx(np.exp(record["loss"]), rel=1e-12)

    from megatron.training.evaluation import evaluation_config
    assert args[:2] == ["--model", "gpt"]      # the tool's own flag; the rest are the trainer's
    cfg = evaluation_config("gpt", args[2:])
    assert record["loss"] == pytest.approx(transformers_loss(model, cfg), rel=1e-5)

    printed = [json.loads(line) for line in lines[1:]]
    assert len(printed) == 2
    for p in printed:
        with torch.no_grad():
            theirs = model(torch.tensor([p["tokens"]])).logits[0]
        values, ids = theirs.topk(4, dim=-1)
        assert p["top_ids"] == ids.tolist()           # greedy next tokens first
        scale = float(theirs.abs().max())
        assert np.abs(np.array(p["top_logits"]) - values.numpy()).max() <= 1e-4 * scale


@pytest.mark.slow
def test_the_same_loss_and_logits_at_tp2_and_at_pp2(converted, sp_dataset,  # noqa: F811
                                                    tmp_path):
    one = base_args(converted, sp_dataset, tmp_path / "one.jsonl")
    single = evaluate(one + ["--print-logits", "1"])
    assert single.returncode == 0, single.stderr[-3000:]
    tp2 = evaluate(base_args(converted, sp_dataset, tmp_path / "tp2.jsonl")
                   + ["--print-logits", "1", "--tensor-model-parallel-size", "2"], nproc=2)
    assert tp2.returncode == 0, tp2.stderr[-3000:]
    pp2 = evaluate(base_args(converted, sp_dataset, tmp_path / "pp2.jsonl")
                   + ["--pipeline-model-parallel-size", "2"], nproc=2)
    assert pp2.returncode == 0, pp2.stderr[-3000:]
    loss = json.loads((tmp_path / "one.jsonl").read_text())["loss"]
    for name in ("tp2", "pp2"):
        assert json.loads((tmp_path / f"{name}.jsonl").read_text())["loss"] == pytest.approx(
            loss, rel=1e-5)
    a, b = (json.loads(r.stdout.strip().splitlines()[1]) for r in (single, tp2))
    assert a["tokens"] == b["tokens"] and a["top_ids"] == b["top_ids"]
    assert np.allclose(a["top_logits"], b["top_logits"], rtol=1e-5, atol=1e-5)


def test_evaluate_needs_a_checkpoint_and_pp1_for_logits(converted, sp_dataset,  # noqa: F811
                                                        tmp_path):
    args = base_args(converted, sp_dataset, tmp_path / "x.jsonl")
    at = args.index("--load")
    done = evaluate(args[:at] + args[at + 2:])
    assert done.returncode == 2
    assert done.stderr.strip().startswith("tools/evaluate.py: error: --load DIR is required: "
                                          "the checkpoint to evaluate")
    assert len(done.stderr.strip().splitlines()) == 1
    done = evaluate(args + ["--print-logits", "1", "--pipeline-model-parallel-size", "2"])
    assert done.returncode == 2
    assert "--print-logits needs --pipeline-model-parallel-size 1" in done.stderr
    done = evaluate(args + ["--seq-length", "0"])
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "tools/evaluate.py: error: --seq-length must be > 0, got 0 (leave the flag out for its "
        "default)"]
    done = evaluate(args[:at + 1] + [str(tmp_path / "nothing")] + args[at + 2:])
    assert done.returncode == 2 and "nothing" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.slow
def test_a_trained_t5_checkpoint_evaluates_to_the_validation_loss_of_its_run(
        sp_dataset, tmp_path):  # noqa: F811
    """pretrain_t5.py validates after its last iteration and saves that checkpoint; the tool
    on the checkpoint, with the same validation data and batches, gives the same loss."""
    from tests.training.test_training import TINY_MODEL, torchrun
    prefix = sp_dataset[sp_dataset.index("--data-path") + 1]
    model = TINY_MODEL + ["--num-layers", "1", "--encoder-seq-length", "128",
                          "--decoder-seq-length", "32", "--valid-data-path", prefix,
                          "--eval-iters", "2"]
    ckpt = tmp_path / "ckpt"
    torchrun("pretrain_t5.py", sp_dataset + model + ["--train-iters", "2", "--eval-interval",
                                                     "2", "--save", str(ckpt)],
             tmp_path / "train.jsonl", nproc=1)
    records = [json.loads(line) for line in open(tmp_path / "train.jsonl")]
    trained = [r["validation"]["loss"] for r in records if "validation" in r]
    done = evaluate(["--model", "t5", "--load", str(ckpt), *sp_dataset, *model,
                     "--stats-file", str(tmp_path / "eval.jsonl"), "--print-logits", "1"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((tmp_path / "eval.jsonl").read_text())["loss"] == pytest.approx(
        trained[-1], rel=1e-6)
    printed = json.loads(done.stdout.strip().splitlines()[1])
    assert printed["encoder_tokens"] and len(printed["top_ids"]) == len(printed["tokens"])
