"""pretrain_spindle.py's training loop on 2 gloo processes: FLAN text through a SentencePiece
tokenizer and the project's indexed datasets, synthetic image and audio inputs, a contrastive
head; a run saved after 2 iterations and resumed gives the same losses for iterations 3-4 as
an uninterrupted run; checkpoints hold one weights-only file per component."""
import json

import pytest

from tests.multiproc import run_in_processes


@pytest.fixture(scope="module")
def flan(tmp_path_factory):
    from megatron.data.flan_preprocess import preprocess_flan
    from megatron.data.flan_synthetic import synthetic_samples
    from megatron.data.tokenizers import train_sentencepiece
    root = tmp_path_factory.mktemp("flan")
    samples = list(synthetic_samples(120, seed=5))
    dump = root / "flan.jsonl"
    dump.write_text("".join(json.dumps({"inputs": s["inputs"], "targets": s["targets"],
                                        "task": s["task"]}) + "\n" for s in samples))
    model = train_sentencepiece([t for s in samples for t in (s["inputs"], s["targets"])],
                                str(root / "sp"), vocab_size=600)["model"]
    prefix = str(root / "flan")
    preprocess_flan([str(dump)], prefix, {"tokenizer_type": "SentencePieceTokenizer",
                                          "tokenizer_model": model}, progress=False)
    return prefix, model, root


def _three_runs(rank, world_size, prefix, model, root):
    from megatron.spindle.train import train
    common = ["--data-path", prefix, "--tokenizer-type", "SentencePieceTokenizer",
              "--tokenizer-model", model, "--num-layers", "1", "--hidden-size", "32",
              "--num-attention-heads", "2", "--seq-length", "24", "--lr", "3e-3",
              "--seed", "7", "--log-interval", "100"]
    whole = train(common + ["--train-iters", "4"])
    first = train(common + ["--train-iters", "2", "--save", str(root / "ckpt")])
    resumed = train(common + ["--train-iters", "4", "--load", str(root / "ckpt")])
    return whole, first, resumed


@pytest.mark.slow
def test_two_process_flan_training_resumes_to_the_uninterrupted_losses(flan):
    import torch
    prefix, model, root = flan
    results = run_in_processes(_three_runs, 2, args=(prefix, model, root), timeout_s=300)
    for whole, first, resumed in results:
        assert len(whole) == 4 and len(first) == 2 and len(resumed) == 2
        assert first == whole[:2]
        assert resumed == whole[2:]                 # bit for bit: same plan, restored Adam
        assert whole[3] < whole[0]                  # it learns
    assert results[0] == results[1]                 # every rank reports the summed loss
    folder = root / "ckpt" / "iter_0000002"
    record = json.loads((folder / "record.json").read_text())
    assert record["iteration"] == 2 and any("wave 0" in line for line in record["plan"])
    from megatron.spindle.mt_model import COMPONENTS
    assert sorted(record["components"]) == sorted(COMPONENTS)
    for comp in COMPONENTS:          # plain tensors and containers: loads with weights_only
        state = torch.load(folder / f"{comp}.pt", weights_only=True)
        assert set(state) == {"model", "optimizer"} and state["optimizer"]["state"]


def test_load_names_a_missing_checkpoint(tmp_path):
    from megatron.spindle.train import load_checkpoint
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        load_checkpoint(str(tmp_path), None, {})


def test_the_distributed_optimizer_is_refused_naming_why(capsys):
    from megatron.spindle.train import train
    with pytest.raises(SystemExit) as exc:
        train(["--data-path", "unused", "--hidden-size", "32", "--num-attention-heads", "2",
               "--use-distributed-optimizer"])
    assert exc.value.code == 2
    assert ("--use-distributed-optimizer is not supported here: each Spindle component "
            "steps its own torch Adam") in capsys.readouterr().err
