"""Checkpoints: atomic per-rank files, compatibility checks, exact resume, safe loading,
fallback to an older checkpoint, disk-full and clean-up, retention, and the LR schedule."""
import errno
import os
import random
import warnings

import numpy as np
import pytest
import torch

from megatron.checkpoint import checkpointing as ckpt
from megatron.training.arguments import parse_args
from megatron.training.optimizer import TrainOptimizer, learning_rate

torch.set_num_threads(1)


def tiny_config(*extra):
    return parse_args("gpt", ["--train-iters", "10",
                              "--data-path", "unused", "--num-layers", "2", "--hidden-size", "8",
                              "--num-attention-heads", "2", "--lr", "0.01",
                              "--lr-warmup-iters", "2", *extra], has_cuda=False)


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 1))


def train_steps(model, opt, first, last):
    """Steps [first, last) on random data drawn from the global RNGs (so RNG state matters)."""
    losses = []
    for it in range(first, last):
        x = torch.randn(4, 8) + float(np.random.rand()) + random.random()
        loss = model(torch.nn.functional.dropout(x, 0.2)).pow(2).mean()
        loss.backward()
        opt.step(it)
        losses.append(loss.item())
    return losses


def test_resume_reproduces_uninterrupted_losses_exactly(tmp_path):
    cfg = tiny_config()
    torch.manual_seed(1); np.random.seed(1); random.seed(1)
    model = tiny_model()
    opt = TrainOptimizer(model.named_parameters(), cfg)
    straight = train_steps(model, opt, 0, 6)

    torch.manual_seed(1); np.random.seed(1); random.seed(1)
    model = tiny_model()
    opt = TrainOptimizer(model.named_parameters(), cfg)
    first = train_steps(model, opt, 0, 3)
    ckpt.save_checkpoint(str(tmp_path), 3, [model], opt, {"consumed": 3}, cfg, 0, 1)
    train_steps(model, opt, 3, 5)   # diverge: more steps and RNG draws after the save

    model = tiny_model(seed=99)
    opt = TrainOptimizer(model.named_parameters(), cfg)
    done, sampler_state = ckpt.load_checkpoint(str(tmp_path), [model], opt, cfg, 0, 1)
    assert done == 3 and sampler_state == {"consumed": 3}
    resumed = first + train_steps(model, opt, done, 6)
    assert resumed == straight   # bit-for-bit


def test_latest_marker_moves_only_after_a_complete_save(tmp_path):
    cfg = tiny_config()
    model = tiny_model()
    opt = TrainOptimizer(model.named_parameters(), cfg)
    path = ckpt.save_checkpoint(str(tmp_path), 2, [model], opt, None, cfg, 0, 1)
    assert ckpt.latest_iteration(str(tmp_path)) == 2
    assert os.path.basename(path) == "rank_00000.pt"
    # a later save that dies while writing leaves no file and does not move `latest`
    def dies(tmp):
        with open(tmp, "wb") as f:
            f.write(b"partial")
        raise KeyboardInterrupt
    target = ckpt.rank_file(str(tmp_path), 4, 0)
    os.makedirs(os.path.dirname(target))
    with pytest.raises(KeyboardInterrupt):
        ckpt.atomic_write(target, dies)
    assert os.listdir(os.path.dirname(target)) == []
    assert ckpt.latest_iteration(str(tmp_path)) == 2


def test_loading_from_an_empty_directory_is_a_clear_error(tmp_path):
    cfg = tiny_config()
    model = tiny_model()
    opt = TrainOptimizer(model.named_parameters(), cfg)
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        ckpt.load_checkpoint(str(tmp_path), [model], opt, cfg, 0, 1)


def adam_state(opt):
    return [{k: v.clone() for k, v in opt.adam.state[m].items()} for m in opt.main_params]


def test_loading_at_another_world_size_works_and_another_shape_is_named(tmp_path, capsys):
    cfg, model, opt = saved_run(tmp_path, [2])
    # loaded as rank 0 of a data-parallel world of 2: the layout may differ, the model not
    draws = []
    for _ in range(2):
        other, other_opt = fresh(cfg)
        with warnings.catch_warnings():
            warnings.simplefilter("error")       # no fallback: the checkpoint is readable
            assert ckpt.load_checkpoint(str(tmp_path), [other], other_opt, cfg, 0, 2)[0] == 2
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))
        for mine, theirs in zip(adam_state(other_opt), adam_state(opt)):
            assert mine.keys() == theirs.keys() == {"exp_avg", "exp_avg_sq", "step"}
            assert all(torch.equal(mine[k], theirs[k]) for k in mine)
        draws.append((random.random(), np.random.rand(), torch.rand(1).item()))
    assert draws[0] == draws[1]          # RNGs reseeded alike from --seed and the iteration
    out = capsys.readouterr().out
    assert "RNG states not restored (it was saved at TP=1 PP=1 DP=1 on 1 ranks, this run is " \
           "TP=1 PP=1 DP=2 on 2); every rank reseeds from --seed and iteration 2" in out
    wider = tiny_config("--hidden-size", "16")
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.load_checkpoint(str(tmp_path), [other], other_opt, wider, 0, 1)
    assert f"{ckpt.common_file(str(tmp_path), 2)}: checkpoint does not match this run's " \
           f"model (--hidden-size: saved 8, now 16" in str(err.value)


def test_a_parameter_of_another_shape_or_missing_is_named(tmp_path):
    cfg, _, _ = saved_run(tmp_path, [2])
    torch.manual_seed(0)
    odd = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2),
                              torch.nn.Linear(2, 1))
    opt = TrainOptimizer(odd.named_parameters(), cfg)
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.load_checkpoint(str(tmp_path), [odd], opt, cfg, 0, 1)
    msg = str(err.value)
    assert ckpt.iteration_dir(str(tmp_path), 2) in msg
    assert "2.weight: shape (1, 8), the model needs (2, 8)" in msg
    assert "3.weight: missing" in msg
    smaller = torch.nn.Sequential(torch.nn.Linear(8, 8))
    opt = TrainOptimizer(smaller.named_parameters(), cfg)
    with pytest.raises(ckpt.CheckpointError, match=r"common.pt: holds 4 parameters this model "
                                                   r"does not have \(1.bias, 1.weight, 2.bias, "
                                                   r"2.weight\)"):
        ckpt.load_checkpoint(str(tmp_path), [smaller], opt, cfg, 0, 1)


def test_a_differently_padded_vocabulary_is_explained(tmp_path):
    cfg = tiny_config()

    def with_vocab(rows):
        model = torch.nn.Module()
        model.embedding = torch.nn.Module()
        model.embedding.word_embeddings = torch.nn.Embedding(rows, 8)
        return model, TrainOptimizer(model.named_parameters(), cfg)
    model, opt = with_vocab(128)
    ckpt.save_checkpoint(str(tmp_path), 0, [model], opt, None, cfg, 0, 1)
    model, opt = with_vocab(256)
    with pytest.raises(ckpt.CheckpointError, match=r"embedding.word_embeddings.weight: shape "
                                                    r"\(128, 8\), the model needs \(256, 8\).* "
                                                    r"padded to a multiple of 128 x TP"):
        ckpt.load_checkpoint(str(tmp_path), [model], opt, cfg, 0, 1)


# ---------------------------------------------------------------------------- safe loading

def saved_run(directory, iterations, *extra):
    """A tiny model and optimizer, trained and saved after each of `iterations`."""
    cfg = tiny_config(*extra)
    torch.manual_seed(1); np.random.seed(1); random.seed(1)
    model = tiny_model()
    opt = TrainOptimizer(model.named_parameters(), cfg)
    done = 0
    for it in iterations:
        train_steps(model, opt, done, it)
        done = it
        ckpt.save_checkpoint(str(directory), it, [model], opt, {"consumed_samples": it}, cfg,
                             0, 1)
    return cfg, model, opt


def fresh(cfg):
    model = tiny_model(seed=99)
    return model, TrainOptimizer(model.named_parameters(), cfg)


class WritesMarker:
    """Unpickling this object creates the marker file (a stand-in for any code)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_checkpoint_files_load_with_weights_only(tmp_path):
    _, model, _ = saved_run(tmp_path, [2])
    folder = ckpt.iteration_dir(str(tmp_path), 2)
    common = torch.load(os.path.join(folder, ckpt.COMMON), weights_only=True)
    assert common["version"] == ckpt.FORMAT_VERSION == 3
    assert common["opt_param_scheduler"]["num_steps"] == 2
    assert common["layout"] == {"world_size": 1, "tp": 1, "pp": 1, "dp": 1}
    names = [n for n, _ in model.named_parameters()]
    assert common["index"] == {"shards_pp000_tp000.pt": names}
    shards = torch.load(os.path.join(folder, "shards_pp000_tp000.pt"), weights_only=True)
    assert sorted(shards["model"]) == sorted(names)
    assert torch.equal(shards["model"]["0.weight"]["tensor"], model[0].weight)
    assert set(shards["optimizer"]["0.weight"]) == {"exp_avg", "exp_avg_sq", "step"}
    rank = torch.load(ckpt.rank_file(str(tmp_path), 2, 0), weights_only=True)
    assert isinstance(rank["rng"]["numpy"]["keys"], torch.Tensor)


def test_rng_states_round_trip_through_the_weights_only_format():
    random.seed(5); np.random.seed(5); torch.manual_seed(5)
    random.gauss(0, 1); np.random.standard_normal()   # cached Gaussians are part of the state
    state = ckpt.capture_rng_state()
    expected = (random.random(), random.gauss(0, 1), np.random.rand(), np.random.standard_normal(),
                torch.rand(1).item())
    random.seed(0); np.random.seed(0); torch.manual_seed(0)
    ckpt.restore_rng_state(state)
    assert (random.random(), random.gauss(0, 1), np.random.rand(), np.random.standard_normal(),
            torch.rand(1).item()) == expected


def test_a_crafted_checkpoint_is_refused_without_running_its_code(tmp_path):
    marker = tmp_path / "pwned"
    os.makedirs(ckpt.iteration_dir(str(tmp_path), 3))
    path = ckpt.rank_file(str(tmp_path), 3, 0)
    torch.save({"version": ckpt.FORMAT_VERSION, "payload": WritesMarker(marker)}, path)
    (tmp_path / ckpt.LATEST).write_text("3\n")
    cfg = tiny_config()
    model, opt = fresh(cfg)
    with pytest.warns(ckpt.CheckpointFallbackWarning):
        with pytest.raises(ckpt.CheckpointError) as err:
            ckpt.load_checkpoint(str(tmp_path), [model], opt, cfg, 0, 1)
    assert not marker.exists()
    assert path in str(err.value) and "refused" in str(err.value)
    assert "no loadable checkpoint" in str(err.value)


def test_a_format_1_checkpoint_is_refused_naming_the_file(tmp_path):
    import megatron.core.tensor_parallel  # noqa: F401 - adds numpy to torch's allow-list
    assert np.ndarray in torch.serialization.get_safe_globals()
    os.makedirs(ckpt.iteration_dir(str(tmp_path), 1))
    path = ckpt.rank_file(str(tmp_path), 1, 0)
    torch.save({"version": 1, "rng": {"numpy": np.random.get_state()}}, path)
    with pytest.raises(ckpt.UnreadableCheckpoint, match="format 1") as err:
        ckpt.read_rank_file(path)
    assert path in str(err.value) and "numpy" in str(err.value)
    assert np.ndarray in torch.serialization.get_safe_globals()   # restored for megatron-core


def test_a_readable_checkpoint_of_another_format_is_an_error_not_a_fallback(tmp_path):
    cfg, _, _ = saved_run(tmp_path, [2, 4])
    path = ckpt.common_file(str(tmp_path), 4)
    state = torch.load(path, weights_only=True)
    torch.save(dict(state, version=4), path)
    model, opt = fresh(cfg)
    with pytest.raises(ckpt.CheckpointError, match="checkpoint format 4, this code reads 3"):
        ckpt.load_checkpoint(str(tmp_path), [model], opt, cfg, 0, 1)


def test_a_format_2_checkpoint_is_refused_with_a_clear_message(tmp_path):
    os.makedirs(ckpt.iteration_dir(str(tmp_path), 5))
    torch.save({"version": 2, "iteration": 5, "rank": 0, "model": []},
               ckpt.rank_file(str(tmp_path), 5, 0))
    (tmp_path / ckpt.LATEST).write_text("5\n")
    cfg = tiny_config()
    model, opt = fresh(cfg)
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.load_checkpoint(str(tmp_path), [model], opt, cfg, 0, 1)
    assert f"{ckpt.iteration_dir(str(tmp_path), 5)}: a format-2 checkpoint" in str(err.value)
    assert "this code reads format 3" in str(err.value)


def truncate(path, keep=0.5):
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[:int(len(data) * keep)])


def test_a_truncated_latest_checkpoint_falls_back_to_the_previous_one(tmp_path):
    cfg, _, _ = saved_run(tmp_path, [2, 4])
    bad = ckpt.rank_file(str(tmp_path), 4, 0)
    truncate(bad)
    model, opt = fresh(cfg)
    with pytest.warns(ckpt.CheckpointFallbackWarning) as caught:
        done, sampler = ckpt.load_checkpoint(str(tmp_path), [model], opt, cfg, 0, 1)
    assert done == 2 and sampler == {"consumed_samples": 2}
    text = " | ".join(str(w.message) for w in caught)
    assert bad in text and "truncated or corrupt" in text
    assert "resuming from iteration 2" in text
    # what was restored is iteration 2's state: training on repeats a run saved only at 2
    resumed = train_steps(model, opt, 2, 4)
    _, ref_model, ref_opt = saved_run(tmp_path / "ref", [2])
    assert resumed == train_steps(ref_model, ref_opt, 2, 4)


def test_a_truncated_shard_file_falls_back_too(tmp_path):
    cfg, _, _ = saved_run(tmp_path, [2, 4])
    bad = os.path.join(ckpt.iteration_dir(str(tmp_path), 4), ckpt.shard_file_name(0, 0))
    truncate(bad)
    model, opt = fresh(cfg)
    with pytest.warns(ckpt.CheckpointFallbackWarning) as caught:
        assert ckpt.load_checkpoint(str(tmp_path), [model], opt, cfg, 0, 1)[0] == 2
    assert bad in " | ".join(str(w.message) for w in caught)


def test_keep_last_after_a_fallback_keeps_the_checkpoint_resumed_from(tmp_path):
    cfg, _, _ = saved_run(tmp_path, [2, 4], "--save", str(tmp_path), "--keep-last", "2")
    truncate(ckpt.rank_file(str(tmp_path), 4, 0))
    model, opt = fresh(cfg)
    with pytest.warns(ckpt.CheckpointFallbackWarning, match="set aside"):
        assert ckpt.load_checkpoint(str(tmp_path), [model], opt, cfg, 0, 1)[0] == 2
    train_steps(model, opt, 2, 3)
    ckpt.save_checkpoint(str(tmp_path), 3, [model], opt, {"consumed_samples": 3}, cfg, 0, 1)
    # the unreadable iteration 4 neither counts as one of the newest two nor is deleted
    assert sorted(os.listdir(tmp_path)) == ["iter_0000002", "iter_0000003",
                                            "iter_0000004.abandoned", ckpt.LATEST]


def test_every_checkpoint_unreadable_is_a_clear_error_naming_each_file(tmp_path):
    cfg, _, _ = saved_run(tmp_path, [2, 4])
    truncate(ckpt.rank_file(str(tmp_path), 4, 0))
    os.remove(ckpt.rank_file(str(tmp_path), 2, 0))
    model, opt = fresh(cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ckpt.CheckpointFallbackWarning)
        with pytest.raises(ckpt.CheckpointError) as err:
            ckpt.load_checkpoint(str(tmp_path), [model], opt, cfg, 0, 1)
    msg = str(err.value)
    assert "no loadable checkpoint" in msg
    assert f"{ckpt.rank_file(str(tmp_path), 4, 0)}: truncated or corrupt" in msg
    assert f"{ckpt.rank_file(str(tmp_path), 2, 0)}: missing" in msg


def test_garbage_in_place_of_a_checkpoint_names_the_file():
    import tempfile
    with tempfile.NamedTemporaryFile(suffix=".pt") as f:
        f.write(b"not a checkpoint" * 10)
        f.flush()
        with pytest.raises(ckpt.UnreadableCheckpoint, match=f"{f.name}: unreadable"):
            ckpt.read_rank_file(f.name)


# ---------------------------------------------------------------------------- saving faults

@pytest.mark.parametrize("failure", [OSError(errno.ENOSPC, "No space left on device"),
                                     RuntimeError("[enforce fail at inline_container.cc:672] . "
                                                  "unexpected pos 4096 vs 1000")])
def test_a_full_disk_at_save_says_so_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch,
                                                                       failure):
    cfg, model, opt = saved_run(tmp_path, [2])
    real_save = torch.save

    def fills_the_disk(obj, path):
        with open(path, "wb") as f:
            f.write(b"partial")
        raise failure
    monkeypatch.setattr(torch, "save", fills_the_disk)
    with pytest.raises(OSError) as err:
        ckpt.save_checkpoint(str(tmp_path), 4, [model], opt, None, cfg, 0, 1)
    monkeypatch.setattr(torch, "save", real_save)
    assert err.value.errno == errno.ENOSPC
    assert "disk is full" in str(err.value)
    assert os.path.join(ckpt.iteration_dir(str(tmp_path), 4), ckpt.shard_file_name(0, 0)) \
        in str(err.value)
    assert os.listdir(ckpt.iteration_dir(str(tmp_path), 4)) == []     # no temporary file
    assert ckpt.latest_iteration(str(tmp_path)) == 2
    model, opt = fresh(cfg)
    assert ckpt.load_checkpoint(str(tmp_path), [model], opt, cfg, 0, 1)[0] == 2


def test_stale_temporary_files_are_removed_before_saving(tmp_path):
    saved_run(tmp_path, [2])
    stale = [os.path.join(ckpt.iteration_dir(str(tmp_path), 2), "rank_00001.pt.tmp4242"),
             os.path.join(str(tmp_path), ckpt.LATEST + ".tmp77")]
    kept = [os.path.join(str(tmp_path), "notes.tmp1"),
            os.path.join(ckpt.iteration_dir(str(tmp_path), 2), "rank_00000.pt")]
    for path in stale + kept[:1]:
        open(path, "w").close()
    ckpt.prepare_save_dir(str(tmp_path), rank=0)
    assert not any(os.path.exists(p) for p in stale)
    assert all(os.path.exists(p) for p in kept)
    ckpt.prepare_save_dir(str(tmp_path / "new"), rank=0)   # a new --save dir is created
    assert os.path.isdir(tmp_path / "new")


def test_a_save_directory_that_cannot_be_written_is_an_error_before_training(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ckpt.CheckpointError, match=f"--save {blocker}/ckpt: cannot write "
                                                   f"checkpoints there"):
        ckpt.prepare_save_dir(str(blocker / "ckpt"), rank=0)


def test_keep_last_keeps_only_the_newest_complete_checkpoints(tmp_path):
    os.makedirs(ckpt.iteration_dir(str(tmp_path), 9))      # a save in progress beyond latest
    saved_run(tmp_path, [1, 2, 3, 4], "--save", str(tmp_path), "--keep-last", "2")
    assert sorted(os.listdir(tmp_path)) == ["iter_0000003", "iter_0000004", "iter_0000009",
                                            ckpt.LATEST]
    saved_run(tmp_path / "all", [1, 2, 3])
    assert len([d for d in os.listdir(tmp_path / "all") if d.startswith("iter_")]) == 3


def test_keep_last_needs_a_save_directory_and_a_count(capsys):
    for flags, message in ((["--keep-last", "2"], "--keep-last needs --save"),
                           (["--save", "x", "--keep-last", "-1"], "--keep-last must be >= 0")):
        with pytest.raises(SystemExit):
            tiny_config(*flags)
        assert message in capsys.readouterr().err


def disk_full(obj, path):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


def _fallback_agreed_over_ranks(rank, world_size, directory):
    """Both ranks save at 2 and 4; rank 1's disk is full at 6; rank 1's file of 4 is then
    truncated. Returns each rank's save error at 6, what it loaded and the warnings it gave."""
    import torch.distributed as dist
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    cfg = tiny_config()
    torch.manual_seed(1)
    model = tiny_model()
    opt = TrainOptimizer(model.named_parameters(), cfg)
    for it in (2, 4):
        train_steps(model, opt, it - 2, it)
        ckpt.save_checkpoint(directory, it, [model], opt, {"consumed_samples": it}, cfg, rank,
                             world_size)
    real_save = torch.save
    if rank == 1:
        torch.save = disk_full
    try:
        ckpt.save_checkpoint(directory, 6, [model], opt, None, cfg, rank, world_size)
        save_error = None
    except (OSError, ckpt.CheckpointError) as err:
        save_error = str(err)
    torch.save = real_save
    if rank == 1:
        truncate(ckpt.rank_file(directory, 4, 1))
    dist.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        done, sampler = ckpt.load_checkpoint(directory, [model], opt, cfg, rank, world_size)
    return save_error, done, sampler, [str(w.message) for w in caught]


@pytest.mark.slow
def test_ranks_agree_on_the_newest_checkpoint_every_rank_can_read(tmp_path):
    from tests.multiproc import run_in_processes
    results = run_in_processes(_fallback_agreed_over_ranks, 2, args=(str(tmp_path),),
                               timeout_s=120)
    (error0, *_), (error1, *_) = results
    # one line on each rank naming the full disk and the file (rank 0's says it is rank 1's)
    assert "checkpoint not saved" in error0 and "rank 1: " in error0 and "disk is full" in \
        error0 and ckpt.rank_file(str(tmp_path), 6, 1) in error0 and "\n" not in error0
    assert "disk is full" in error1 and ckpt.rank_file(str(tmp_path), 6, 1) in error1
    assert ckpt.latest_iteration(str(tmp_path)) == 4
    assert [(done, sampler) for _, done, sampler, _ in results] == \
        [(2, {"consumed_samples": 2}), (2, {"consumed_samples": 2})]
    rank0, rank1 = (" | ".join(w) for *_, w in results)
    assert "iteration 4 is unreadable on some rank; resuming from iteration 2" in rank0
    assert ckpt.rank_file(str(tmp_path), 4, 1) in rank1 and "truncated or corrupt" in rank1


# ---------------------------------------------------------------------------- LR schedule

def test_schedule_flags_that_differ_from_the_checkpoint_are_named(tmp_path):
    saved_run(tmp_path, [3], "--train-iters", "10")
    cfg = tiny_config("--train-iters", "20", "--min-lr", "0.001")
    model, opt = fresh(cfg)
    with pytest.raises(ValueError) as err:
        ckpt.load_checkpoint(str(tmp_path), [model], opt, cfg, 0, 1)
    msg = str(err.value)
    assert "--lr-decay-iters: checkpoint 10, now 20" in msg
    assert "--min-lr: checkpoint 0.0, now 0.001" in msg
    assert "--lr:" not in msg and "--use-checkpoint-opt-param-scheduler" in msg
    assert "defaults to --train-iters" in msg
    same_decay = tiny_config("--train-iters", "20", "--lr-decay-iters", "10", "--lr", "0.02")
    model, opt = fresh(same_decay)
    with pytest.raises(ValueError) as err:
        ckpt.load_checkpoint(str(tmp_path), [model], opt, same_decay, 0, 1)
    assert "--lr: checkpoint 0.01, now 0.02" in str(err.value)
    assert "defaults to --train-iters" not in str(err.value)
    longer = tiny_config("--train-iters", "20", "--lr-decay-iters", "10")  # same schedule
    model, opt = fresh(longer)
    assert ckpt.load_checkpoint(str(tmp_path), [model], opt, longer, 0, 1)[0] == 3


def test_scheduler_flags_pick_the_checkpoint_or_this_run(tmp_path):
    saved_run(tmp_path, [3], "--train-iters", "10")
    for flags, decay_iters in ((["--use-checkpoint-opt-param-scheduler"], 10),
                               (["--use-checkpoint-opt_param-scheduler"], 10),
                               (["--override-opt-param-scheduler"], 20),
                               (["--override-opt_param-scheduler"], 20)):
        cfg = tiny_config("--train-iters", "20", *flags)
        model, opt = fresh(cfg)
        assert ckpt.load_checkpoint(str(tmp_path), [model], opt, cfg, 0, 1)[0] == 3
        assert opt.schedule["lr_decay_iters"] == decay_iters
        assert opt.lr_at(15) == learning_rate(15, 0.01, 0.0, 2, decay_iters, "cosine")
        assert opt.num_steps == 3


def test_both_scheduler_flags_at_once_are_rejected(capsys):
    with pytest.raises(SystemExit):
        tiny_config("--override-opt-param-scheduler", "--use-checkpoint-opt-param-scheduler")
    assert "mutually exclusive" in capsys.readouterr().err


# ---------------------------------------------------------------------------- load flags

def test_finetune_loads_the_weights_alone_and_starts_at_iteration_0(tmp_path):
    _, model, _ = saved_run(tmp_path, [3])
    cfg = tiny_config("--load", str(tmp_path), "--finetune", "--lr", "0.5")   # any schedule
    other, opt = fresh(cfg)
    torch.manual_seed(7)
    expected_draw = torch.rand(1).item()
    torch.manual_seed(7)
    assert ckpt.load_checkpoint(str(tmp_path), [other], opt, cfg, 0, 1) == (0, None)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))
    assert opt.adam.state == {} and opt.num_steps == 0 and opt.schedule["lr"] == 0.5
    assert torch.rand(1).item() == expected_draw      # RNG left as this run seeded it


def test_no_load_optim_keeps_a_fresh_optimizer_and_this_runs_schedule(tmp_path):
    _, model, _ = saved_run(tmp_path, [3])
    cfg = tiny_config("--load", str(tmp_path), "--no-load-optim", "--lr", "0.5")
    other, opt = fresh(cfg)
    assert ckpt.load_checkpoint(str(tmp_path), [other], opt, cfg, 0, 1) == \
        (3, {"consumed_samples": 3})
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))
    assert opt.adam.state == {} and opt.num_steps == 3 and opt.schedule["lr"] == 0.5


def test_no_load_rng_reseeds_from_the_seed_and_iteration(tmp_path, capsys):
    saved_run(tmp_path, [3])
    draws = []
    for flags in (["--no-load-rng"], ["--no-load-rng", "--no-load-optim"]):
        cfg = tiny_config("--load", str(tmp_path), *flags)
        other, opt = fresh(cfg)
        ckpt.load_checkpoint(str(tmp_path), [other], opt, cfg, 0, 1)
        draws.append((random.random(), np.random.rand(), torch.rand(1).item()))
    ckpt.reseed(tiny_config().seed, 3)
    assert draws == [(random.random(), np.random.rand(), torch.rand(1).item())] * 2
    assert "RNG states not restored (--no-load-rng)" in capsys.readouterr().out


def test_load_flags_need_a_load_directory(capsys):
    for name in ("--finetune", "--no-load-optim", "--no-load-rng"):
        with pytest.raises(SystemExit):
            tiny_config(name)
        assert f"{name} needs --load DIR" in capsys.readouterr().err


def test_a_model_only_checkpoint_round_trips_and_needs_finetune(tmp_path):
    torch.manual_seed(3)
    source = tiny_model(seed=5)
    full = {n: p.detach().clone() for n, p in source.named_parameters()}
    signature = ckpt.model_signature(tiny_config())
    folder = ckpt.save_model_only_checkpoint(str(tmp_path), 0, full, signature)
    assert folder == ckpt.iteration_dir(str(tmp_path), 0)
    assert ckpt.latest_iteration(str(tmp_path)) == 0
    back = ckpt.read_full_model_state(str(tmp_path))
    assert back.keys() == full.keys() and all(torch.equal(back[n], full[n]) for n in full)

    cfg = tiny_config("--load", str(tmp_path))
    model, opt = fresh(cfg)
    with pytest.raises(ckpt.CheckpointError, match="holds model weights only .* --finetune"):
        ckpt.load_checkpoint(str(tmp_path), [model], opt, cfg, 0, 1)
    cfg = tiny_config("--load", str(tmp_path), "--finetune")
    assert ckpt.load_checkpoint(str(tmp_path), [model], opt, cfg, 0, 1) == (0, None)
    assert all(torch.equal(p, full[n]) for n, p in model.named_parameters())
    with pytest.raises(ValueError, match="config_signature lacks hidden_size"):
        ckpt.save_model_only_checkpoint(str(tmp_path / "x"), 0, full,
                                        {k: v for k, v in signature.items()
                                         if k != "hidden_size"})


def test_bf16_main_weights_and_moments_survive_a_checkpoint(tmp_path):
    cfg = tiny_config()
    torch.manual_seed(1)
    model = tiny_model().to(torch.bfloat16)
    opt = TrainOptimizer(model.named_parameters(), cfg)
    for it in range(2):
        model(torch.randn(4, 8, dtype=torch.bfloat16)).float().pow(2).mean().backward()
        opt.step(it)
    ckpt.save_checkpoint(str(tmp_path), 2, [model], opt, None, cfg, 0, 1)
    other = tiny_model(seed=99).to(torch.bfloat16)
    other_opt = TrainOptimizer(other.named_parameters(), cfg)
    ckpt.load_checkpoint(str(tmp_path), [other], other_opt, cfg, 0, 1)
    assert all(torch.equal(a, b) for a, b in zip(opt.main_params, other_opt.main_params))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))
    for mine, theirs in zip(adam_state(other_opt), adam_state(opt)):
        assert all(torch.equal(mine[k], theirs[k]) for k in mine)


# ---------------------------------------------------------------------------- real runs

import json
import subprocess
import sys

from tests.multiproc import free_port
from tests.training.test_training import REPO, env_with_repo, sp_dataset  # noqa: F401

RUN = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
       "--tokens-per-global-batch", "1024", "--seq-length", "128", "--lr", "5e-3",
       "--lr-warmup-iters", "2", "--lr-decay-style", "cosine", "--min-lr", "5e-4",
       "--distributed-timeout-minutes", "0.5", "--num-planner-workers", "0"]


def pretrain_gpt(args, stats_file):
    """pretrain_gpt.py as a world of one; returns (exit code, output, rank 0's stats)."""
    env = dict(env_with_repo(), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    done = subprocess.run([sys.executable, "pretrain_gpt.py", *args, "--stats-file",
                           str(stats_file)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=240)
    stats = [json.loads(line) for line in open(stats_file)] if os.path.exists(stats_file) else []
    return done.returncode, done.stdout + done.stderr, stats


def losses_and_lrs(stats):
    return [(s["iteration"], s["loss"], s["lr"]) for s in stats]


@pytest.mark.slow
def test_resume_to_more_iterations_is_refused_or_exact_as_documented(sp_dataset, tmp_path):
    """10 iterations, then resume to 20 with only --train-iters changed: refused, since the
    defaulted --lr-decay-iters moved from 10 to 20. A checkpoint made with --lr-decay-iters 20
    resumes to exactly the straight 20-iteration run (with or without
    --use-checkpoint-opt-param-scheduler; with it, the flags given now do not matter)."""
    args = sp_dataset + RUN
    code, out, straight = pretrain_gpt(args + ["--train-iters", "20"], tmp_path / "straight")
    assert code == 0, out[-3000:]
    assert [s["iteration"] for s in straight] == list(range(1, 21))

    short = tmp_path / "short"
    code, out, _ = pretrain_gpt(args + ["--train-iters", "10", "--save", str(short)],
                                tmp_path / "short.jsonl")
    assert code == 0, out[-3000:]
    code, out, stats = pretrain_gpt(args + ["--train-iters", "20", "--load", str(short)],
                                    tmp_path / "refused.jsonl")
    assert code != 0 and stats == []
    assert "--lr-decay-iters: checkpoint 10, now 20" in out
    assert "--override-opt-param-scheduler" in out

    planned = tmp_path / "planned"
    code, out, first = pretrain_gpt(args + ["--train-iters", "10", "--lr-decay-iters", "20",
                                            "--save", str(planned)], tmp_path / "first.jsonl")
    assert code == 0, out[-3000:]
    assert losses_and_lrs(first) == losses_and_lrs(straight[:10])
    for name, extra in (("same", []),
                        ("checkpoint", ["--use-checkpoint-opt-param-scheduler", "--lr", "1e-2",
                                        "--lr-decay-iters", "50"])):
        code, out, rest = pretrain_gpt(args + ["--train-iters", "20", "--load", str(planned),
                                               *extra], tmp_path / f"{name}.jsonl")
        assert code == 0, out[-3000:]
        assert losses_and_lrs(rest) == losses_and_lrs(straight[10:])   # bit for bit


# ---------------------------------------------------------------------------- what a load trusts

def shard_path(directory, iteration):
    return os.path.join(ckpt.iteration_dir(str(directory), iteration), ckpt.shard_file_name(0, 0))


def rewrite_shard(directory, iteration, change):
    """Change the shard file's contents with `change(state)` and record its new checksum, as a
    checkpoint written that way would have it (so only what `change` did is under test)."""
    path = shard_path(directory, iteration)
    state = torch.load(path, weights_only=True)
    change(state)
    torch.save(state, path)
    common_path = ckpt.common_file(str(directory), iteration)
    common = torch.load(common_path, weights_only=True)
    common["checksums"][os.path.basename(path)] = ckpt.file_digest(path)
    torch.save(common, common_path)


def test_a_load_with_other_layer_flags_is_refused_naming_each_flag_and_both_values(tmp_path):
    """Flags that change the function but no tensor's shape (issue 26: a T5 loaded without
    --softmax-scale 1.0 trained silently at another loss)."""
    flags = ("--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--softmax-scale", "1.0",
             "--disable-bias-linear")
    saved_run(tmp_path, [2], *flags)
    cfg = tiny_config()
    model, opt = fresh(cfg)
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.load_checkpoint(str(tmp_path), [model], opt, cfg, 0, 1)
    msg = str(err.value)
    assert msg.startswith(f"{ckpt.common_file(str(tmp_path), 2)}: checkpoint does not match")
    for part in ("--normalization: saved 'RMSNorm', now 'LayerNorm'",
                 "--norm-epsilon: saved 1e-06, now 1e-05", "--softmax-scale: saved 1.0, now None",
                 "--disable-bias-linear (add_bias_linear): saved False, now True"):
        assert part in msg, (part, msg)
    cfg = tiny_config(*flags, "--gated-gelu")
    with pytest.raises(ckpt.CheckpointError, match=r"--gated-gelu \(gated_linear_unit\): "
                                                   r"saved False, now True"):
        ckpt.load_checkpoint(str(tmp_path), [model], opt, cfg, 0, 1)
    cfg = tiny_config(*flags)
    assert ckpt.load_checkpoint(str(tmp_path), [model], opt, cfg, 0, 1)[0] == 2


def test_a_rope_checkpoint_loaded_without_rope_is_refused_naming_the_flags(tmp_path):
    """Rotary positions and SwiGLU change no tensor a learned-position GeLU model lacks (a
    learned table is the only difference, and a --finetune load may leave it fresh): the
    recorded model identity refuses the load."""
    llama = ("--position-embedding-type", "rope", "--rotary-base", "500000", "--swiglu")
    saved_run(tmp_path, [2], *llama)
    model, opt = fresh(tiny_config())
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.load_checkpoint(str(tmp_path), [model], opt, tiny_config(), 0, 1)
    for part in ("--position-embedding-type: saved 'rope', now 'learned_absolute'",
                 "--swiglu: saved True, now False"):
        assert part in str(err.value), (part, str(err.value))
    with pytest.raises(ckpt.CheckpointError, match="--rotary-base: saved 500000.0, now 10000.0"):
        ckpt.load_checkpoint(str(tmp_path), [model], opt, tiny_config(*llama[:2], "--swiglu"),
                             0, 1)
    assert ckpt.load_checkpoint(str(tmp_path), [model], opt, tiny_config(*llama), 0, 1)[0] == 2


def test_signature_compares_vocabulary_kv_channels_and_relative_buckets():
    t5 = parse_args("t5", ["--train-iters", "10", "--data-path", "unused", "--num-layers", "2",
                           "--decoder-num-layers", "2", "--hidden-size", "8",
                           "--num-attention-heads", "2", "--position-embedding-type",
                           "relative", "--relative-attention-max-distance", "32"],
                    has_cuda=False)
    saved = ckpt.model_signature(t5)
    saved["vocab_size"] = 3990
    now = dict(saved, vocab_size=4000, relative_attention_max_distance=128, kv_channels=4)
    diffs = ckpt.signature_differences(saved, now)
    assert diffs == ["--relative-attention-max-distance: saved 32, now 128",
                     "the vocabulary (tokens of the tokenizer, before padding): saved 3990, "
                     "now 4000"]
    # kv_channels 4 is hidden / heads, what 0 means; buckets do not matter without them
    gpt = ckpt.model_signature(tiny_config())
    assert ckpt.signature_differences(gpt, dict(gpt, relative_attention_num_buckets=8)) == []
    # a checkpoint that predates a field is not compared on it; SHAPE_FIELDS always are
    old = {k: v for k, v in gpt.items() if k in ckpt.SHAPE_FIELDS}
    assert ckpt.signature_differences(old, dict(gpt, softmax_scale=1.0)) == []


class StageLike(torch.nn.Sequential):
    """A module that carries a ModelSpec, as StageModule does (its vocabulary is recorded)."""

    def __init__(self, vocab, seed=0):
        from dynapipe_ext.costs.model_spec import ModelSpec
        torch.manual_seed(seed)
        super().__init__(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 1))
        self.spec = ModelSpec("gpt", 2, 8, 2, 4096, unpadded_vocab_size=vocab)


def test_a_checkpoint_of_fewer_tokens_than_the_tokenizer_is_refused(tmp_path):
    """A model imported with 3990 tokens must not fine-tune on 4000-token data: tokens
    3990-3999 would train rows the checkpoint holds for no token (both pad to 4096 rows)."""
    cfg = tiny_config()
    model = StageLike(3990)
    opt = TrainOptimizer(model.named_parameters(), cfg)
    ckpt.save_checkpoint(str(tmp_path), 2, [model], opt, None, cfg, 0, 1)
    assert ckpt.saved_vocab_size(str(tmp_path)) == 3990
    other = StageLike(4000, seed=1)
    with pytest.raises(ckpt.CheckpointError, match="the vocabulary .*: saved 3990, now 4000"):
        ckpt.load_checkpoint(str(tmp_path), [other], TrainOptimizer(other.named_parameters(),
                                                                    cfg), cfg, 0, 1)


def test_a_shard_tensor_that_is_not_floating_point_is_refused(tmp_path):
    cfg, _, _ = saved_run(tmp_path, [2])

    def to_int(state):
        shard = state["model"]["0.weight"]
        shard["tensor"] = shard["tensor"].to(torch.int32)
    rewrite_shard(tmp_path, 2, to_int)
    model, opt = fresh(cfg)
    with pytest.raises(ckpt.CheckpointError, match=r"0\.weight: dtype torch\.int32, the model "
                                                   r"needs a floating-point tensor"):
        ckpt.load_checkpoint(str(tmp_path), [model], opt, cfg, 0, 1)


def test_a_wrong_shaped_adam_moment_is_an_error_naming_file_and_tensor(tmp_path):
    cfg, _, _ = saved_run(tmp_path, [2])

    def bad_moment(state):
        entry = state["optimizer"]["2.weight"]["exp_avg_sq"]
        entry["tensor"] = torch.zeros(3, 8)
    rewrite_shard(tmp_path, 2, bad_moment)
    model, opt = fresh(cfg)
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.load_checkpoint(str(tmp_path), [model], opt, cfg, 0, 1)
    assert f"2.weight (exp_avg_sq): shape (3, 8), the model needs (1, 8) in " \
           f"{shard_path(tmp_path, 2)}" in str(err.value)
    model, opt = fresh(cfg)       # the weights alone still load
    assert ckpt.load_checkpoint(str(tmp_path), [model], opt,
                                tiny_config("--load", str(tmp_path), "--no-load-optim"),
                                0, 1)[0] == 2


def flip_weight_bytes(path, tensor, count=64):
    """XOR `count` bytes in the middle of `tensor`'s data inside the file (found by content)."""
    data = bytearray(open(path, "rb").read())
    raw = tensor.detach().contiguous().numpy().tobytes()
    at = data.find(raw)
    assert at >= 0 and data.find(raw, at + 1) < 0
    start = at + (len(raw) - count) // 2
    for i in range(start, start + count):
        data[i] ^= 0x5A
    with open(path, "wb") as f:
        f.write(data)


def test_a_bit_flip_inside_a_weight_falls_back_naming_the_file(tmp_path):
    """The zip format would load a flipped weight silently (issue 26: XOR of 64 bytes trained
    on); the SHA-256 common.pt records for each file catches it like an unreadable file."""
    cfg, model, _ = saved_run(tmp_path, [2, 4])
    bad = shard_path(tmp_path, 4)
    flip_weight_bytes(bad, model[0].weight)
    fresh_model, opt = fresh(cfg)
    with pytest.warns(ckpt.CheckpointFallbackWarning) as caught:
        assert ckpt.load_checkpoint(str(tmp_path), [fresh_model], opt, cfg, 0, 1)[0] == 2
    text = " | ".join(str(w.message) for w in caught)
    assert f"{bad}: truncated or corrupt: its SHA-256 is" in text
    assert "resuming from iteration 2" in text
    # with no older checkpoint to go back to, the load is refused naming the file
    flip_weight_bytes(shard_path(tmp_path, 2), torch.load(shard_path(tmp_path, 2),
                      weights_only=True)["model"]["0.weight"]["tensor"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ckpt.CheckpointFallbackWarning)
        with pytest.raises(ckpt.CheckpointError, match="no loadable checkpoint") as err:
            ckpt.load_checkpoint(str(tmp_path), [fresh_model], opt, cfg, 0, 1)
    assert shard_path(tmp_path, 2) in str(err.value)


def test_a_tracker_file_with_binary_content_is_an_error_naming_it(tmp_path):
    saved_run(tmp_path, [2])
    marker = os.path.join(str(tmp_path), ckpt.LATEST)
    with open(marker, "wb") as f:
        f.write(b"\xff\xfe\x00\x89garbage")
    with pytest.raises(ckpt.CheckpointError, match=f"{marker}: expected an iteration number"):
        ckpt.latest_iteration(str(tmp_path))


@pytest.mark.parametrize("free,expected", [(0, "the disk is full"), (10 ** 12, "an I/O error")])
def test_a_bare_stream_error_at_save_is_one_line_naming_the_file(tmp_path, monkeypatch, free,
                                                                 expected):
    """torch.save's C++ writer once reported a full disk only as `basic_ios::clear: iostream
    error`: with (almost) no space left that is a full disk, otherwise an I/O error; either
    way the message names the file."""
    cfg, model, opt = saved_run(tmp_path, [2])

    def stream_error(obj, path):
        raise RuntimeError("basic_ios::clear: iostream error")
    monkeypatch.setattr(torch, "save", stream_error)
    monkeypatch.setattr(ckpt, "free_bytes", lambda path: free)
    with pytest.raises(OSError) as err:
        ckpt.save_checkpoint(str(tmp_path), 4, [model], opt, None, cfg, 0, 1)
    assert expected in str(err.value) and shard_path(tmp_path, 4) in str(err.value)
    assert "\n" not in str(err.value)
    assert ckpt.latest_iteration(str(tmp_path)) == 2
