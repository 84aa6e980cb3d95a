"""Nothing lost, nothing silently wrong: token ids checked against the vocabulary at every TP,
indexes checked against their data at open, checkpoints that never go backwards nor get
overwritten by another run, a run bound to its data and tokenizer, and a clean stop on SIGTERM."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megatron.data.multitask_dataset import MultiTaskDataset
from tests.multiproc import free_port
from tests.test_training import REPO, copy_dataset, env_with_repo, sp_dataset  # noqa: F401

RUN = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
       "--tokens-per-global-batch", "1024", "--seq-length", "128", "--lr", "5e-3",
       "--distributed-timeout-minutes", "0.5", "--num-planner-workers", "0"]


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
