"""Per-rank checkpoints: `DIR/iter_NNNNNNN/rank_RRRRR.pt` plus `DIR/latest_checkpointed_iteration.txt`.

Each rank saves its own model stages, optimizer state, the LR schedule's settings and position,
RNG states, the iteration count and the sampler position. Files are written under a temporary
name and renamed, and `latest` moves only after every rank has written its file, so an
interrupted save never looks complete. Resuming reproduces an uninterrupted run exactly.

Safety: a file holds only tensors and plain containers (dict, list, str, int, float, bool,
None) and is read with `torch.load(weights_only=True)`, with no allow-list: a file that holds
any other Python object (a crafted pickle, or a format-1 checkpoint with numpy RNG states) is
refused without running anything in it.

Fallback: `load_checkpoint` takes the newest iteration, at or below `latest`, that every rank
can read. Each rank reads only its own file; the ranks agree with an all-reduce over the
default group (no rank ever loads an iteration another rank skipped), so this also works where
ranks do not share a file system. An unreadable file (missing, truncated, corrupt, unsafe) is
skipped with a warning naming it; a readable file that does not fit this run (format, layout,
model shape, LR schedule) is an error, never a reason to go back.
"""
from __future__ import annotations

import errno
import os
import pickle
import random
import re
import shutil
import warnings

import numpy as np
import torch
import torch.distributed as dist

LATEST = "latest_checkpointed_iteration.txt"
FORMAT_VERSION = 2   # 2: weights-only files (RNG states as tensors), LR schedule recorded
# Config fields that must match between the run that saved and the run that loads.
SHAPE_FIELDS = ("model", "num_layers", "decoder_num_layers", "hidden_size",
                "num_attention_heads", "ffn_hidden_size", "max_position_embeddings",
                "tensor_model_parallel_size", "pipeline_model_parallel_size", "bf16")
ITER_DIR = re.compile(r"iter_(\d{7})$")
STALE_TEMP = re.compile(r"(rank_\d{5}\.pt|" + re.escape(LATEST) + r")\.tmp\d+$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used by this run; the message names the file."""


class UnreadableCheckpoint(CheckpointError):
    """A rank file that is missing, truncated, corrupt or unsafe: `--load` goes back."""


class CheckpointFallbackWarning(UserWarning):
    """`--load` skipped an unreadable checkpoint and resumes from an older one."""


def iteration_dir(directory: str, iteration: int) -> str:
    return os.path.join(directory, f"iter_{iteration:07d}")


def rank_file(directory: str, iteration: int, rank: int) -> str:
    return os.path.join(iteration_dir(directory, iteration), f"rank_{rank:05d}.pt")


# ---------------------------------------------------------------------------- saving

def is_disk_full(err: BaseException) -> bool:
    """ENOSPC, or what torch.save's zip writer raises when a write comes up short."""
    if isinstance(err, OSError) and err.errno == errno.ENOSPC:
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and ("unexpected pos" in text
                                              or "PytorchStreamWriter failed" in text)


def atomic_write(path: str, write) -> None:
    """Call `write(tmp_path)`, then rename onto `path` (same directory, so the rename is
    atomic). On any failure the temporary file is removed and `path` is untouched; a full
    disk is an OSError(ENOSPC) that says so and names `path`."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException as err:
        if os.path.exists(tmp):
            os.remove(tmp)
        if is_disk_full(err):
            raise OSError(errno.ENOSPC, f"cannot write {path}: the disk is full (no space left "
                                        f"on the device); nothing was left behind and the "
                                        f"previous checkpoint is intact") from err
        raise


def write_text(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def clean_stale_temp_files(directory: str) -> list[str]:
    """Remove the temporary files of saves that were killed (`*.tmpPID`); returns their paths.
    Call before any rank of this run saves."""
    removed = []
    if not os.path.isdir(directory):
        return removed
    folders = [directory] + [os.path.join(directory, d) for d in os.listdir(directory)
                             if ITER_DIR.match(d)]
    for folder in folders:
        for name in os.listdir(folder):
            if STALE_TEMP.match(name):
                path = os.path.join(folder, name)
                os.remove(path)
                removed.append(path)
    return removed


def prepare_save_dir(directory: str, rank: int) -> None:
    """Before training: rank 0 creates `directory` and clears stale temporary files from it;
    every rank waits, and all raise alike if it cannot be written."""
    problem = None
    if rank == 0:
        try:
            os.makedirs(directory, exist_ok=True)
            if not os.access(directory, os.W_OK | os.X_OK):
                raise PermissionError(errno.EACCES, "not writable", directory)
            for path in clean_stale_temp_files(directory):
                print(f"[checkpoint] removed {path}, left by an interrupted save", flush=True)
        except OSError as err:
            problem = err
    if count_over_ranks(problem is not None):
        raise CheckpointError(f"--save {directory}: cannot write checkpoints there "
                              f"({problem or 'see rank 0'})")


def complete_iterations(directory: str, latest: int) -> list[int]:
    """Iterations with a directory at or below `latest` (complete saves), newest first."""
    found = [int(m.group(1)) for m in map(ITER_DIR.match, os.listdir(directory)) if m]
    return sorted((i for i in found if i <= latest), reverse=True)


def prune_checkpoints(directory: str, latest: int, keep_last: int) -> list[int]:
    """Delete all but the newest `keep_last` complete checkpoints (0 keeps all); returns the
    deleted iterations. Saves newer than `latest` (in progress) are left alone."""
    if keep_last <= 0:
        return []
    old = complete_iterations(directory, latest)[keep_last:]
    for iteration in old:
        shutil.rmtree(iteration_dir(directory, iteration))
    return old


ABANDONED_SUFFIX = ".abandoned"


def set_aside_newer(directory: str, iteration: int) -> list[str]:
    """Rename the iteration directories newer than `iteration` (the one a run fell back to) to
    `iter_N.abandoned`: they belong to a history this run does not continue. Kept, never deleted,
    but no longer loaded or counted by --keep-last (which would otherwise keep an unreadable
    newer checkpoint and delete the good one this run resumed from). Returns the new names."""
    moved = []
    for newer in (i for i in complete_iterations(directory, 10 ** 9) if i > iteration):
        src = iteration_dir(directory, newer)
        dst, n = src + ABANDONED_SUFFIX, 1
        while os.path.exists(dst):
            dst, n = f"{src}{ABANDONED_SUFFIX}{n}", n + 1
        try:
            os.rename(src, dst)
        except FileNotFoundError:
            continue    # another rank on the same file system renamed it first
        moved.append(dst)
    return moved


def python_rng_state() -> dict:
    version, internal, gauss_next = random.getstate()
    return {"version": version, "internal": torch.tensor(internal, dtype=torch.int64),
            "gauss_next": gauss_next}


def numpy_rng_state() -> dict:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"bit_generator": name, "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}


def capture_rng_state() -> dict:
    """Every RNG the run draws from (Python, numpy, torch CPU, CUDA, megatron's tracker), as
    tensors and plain values so the file loads with weights_only=True."""
    from megatron.core import tensor_parallel
    state = {"python": python_rng_state(), "numpy": numpy_rng_state(),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    tracker = tensor_parallel.get_cuda_rng_tracker().get_states()   # CPU or CUDA states
    if tracker:
        state["tracker"] = {k: v.clone() for k, v in tracker.items()}
    return state


def restore_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["internal"].tolist()),
                     py["gauss_next"]))
    npy = state["numpy"]
    np.random.set_state((npy["bit_generator"], npy["keys"].numpy().astype(np.uint32),
                         npy["pos"], npy["has_gauss"], npy["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tracker = tensor_parallel.get_cuda_rng_tracker()
    now = tracker.get_states()
    saved = state.get("tracker") or {}
    # the dropout streams go on where they were, when saved for this kind of generator (a
    # checkpoint from a GPU run resumed on CPU, or back, keeps this run's fresh seeding)
    if now and sorted(saved) == sorted(now) and all(
            saved[k].shape == now[k].shape for k in now):
        tracker.set_states(dict(saved))


def shape_signature(cfg) -> dict:
    return {name: getattr(cfg, name) for name in SHAPE_FIELDS}


def save_checkpoint(directory: str, iteration: int, modules, optimizer, sampler_state,
                    cfg, rank: int, world_size: int) -> str:
    """Write this rank's state after `iteration` completed iterations; every rank must call it.
    If any rank fails to write (a full disk, ...), every rank raises and `latest` stays where
    it was. Returns the path of this rank's file."""
    path = rank_file(directory, iteration, rank)
    state = {"version": FORMAT_VERSION, "iteration": iteration, "rank": rank,
             "world_size": world_size, "config": shape_signature(cfg),
             "model": [m.state_dict() for m in modules], "optimizer": optimizer.state_dict(),
             "opt_param_scheduler": optimizer.scheduler_state_dict(),
             "rng": capture_rng_state(), "sampler": sampler_state}
    failure = None
    try:
        os.makedirs(iteration_dir(directory, iteration), exist_ok=True)
        atomic_write(path, lambda tmp: torch.save(state, tmp))
    except Exception as err:  # noqa: BLE001 - re-raised below, after the ranks agree
        failure = err
    agree_or_raise(failure, f"iteration {iteration}: another rank could not write its "
                            f"checkpoint file (see its error); {LATEST} in {directory} still "
                            f"names the previous checkpoint")
    if rank == 0:
        try:
            atomic_write(os.path.join(directory, LATEST),
                         lambda tmp: write_text(tmp, f"{iteration}\n"))
            for old in prune_checkpoints(directory, iteration, cfg.keep_last):
                print(f"[checkpoint] --keep-last {cfg.keep_last}: removed "
                      f"{iteration_dir(directory, old)}", flush=True)
        except Exception as err:  # noqa: BLE001 - re-raised below, after the ranks agree
            failure = err
    agree_or_raise(failure, f"iteration {iteration}: rank 0 could not update {LATEST} in "
                            f"{directory} (see its error)")
    return path


# ---------------------------------------------------------------------------- loading

def latest_iteration(directory: str) -> int:
    """The iteration of the last complete checkpoint in `directory`, with a clear error if none."""
    marker = os.path.join(directory, LATEST)
    if not os.path.isfile(marker):
        raise FileNotFoundError(f"--load {directory}: no {LATEST} (no complete checkpoint there)")
    text = open(marker).read().strip()
    if not text.isdigit():
        raise ValueError(f"{marker}: expected an iteration number, found {text!r}")
    return int(text)


def refused_global(err: BaseException) -> str | None:
    """The Python object a weights-only load refused to build, if that is why it failed."""
    found = re.search(r"GLOBAL ([\w.]+)", str(err))
    return found.group(1) if isinstance(err, pickle.UnpicklingError) and found else None


def error_detail(err: BaseException) -> str:
    """A one-line reason from torch's (often multi-paragraph) load errors."""
    inner = err.__context__ if isinstance(err, pickle.UnpicklingError) else None
    lines = str(inner or err).strip().splitlines()
    return f"{type(inner or err).__name__} {lines[0] if lines else ''}".rstrip()


def load_weights_only(path: str):
    """torch.load(weights_only=True) with no allow-list at all: megatron-core adds numpy
    arrays, argparse.Namespace, BytesIO and more to torch's process-wide allow-list when it is
    imported, and our files need none of them, so that list is set aside for this one load."""
    extra = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    finally:
        torch.serialization.add_safe_globals(extra)


def read_rank_file(path: str) -> dict:
    """Load one rank file with weights_only=True; UnreadableCheckpoint naming it otherwise."""
    if not os.path.isfile(path):
        raise UnreadableCheckpoint(f"{path}: missing")
    try:
        state = load_weights_only(path)
    except Exception as err:  # noqa: BLE001 - torch raises many types for a bad file
        name = refused_global(err)
        if name:
            raise UnreadableCheckpoint(
                f"{path}: refused: it holds the Python object {name}, not only tensors and "
                f"plain containers; nothing in it was run (a checkpoint of format 1, with "
                f"numpy RNG states, is refused this way: this code reads format "
                f"{FORMAT_VERSION})") from None
        raise UnreadableCheckpoint(f"{path}: unreadable (truncated or corrupt): "
                                   f"{error_detail(err)}") from None
    if not isinstance(state, dict) or "version" not in state:
        raise UnreadableCheckpoint(f"{path}: not a checkpoint (no format version)")
    return state


def check_compatible(state: dict, path: str, cfg, rank: int, world_size: int) -> None:
    """Raise when the checkpoint was written by another format, model shape or layout."""
    if state.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: checkpoint format {state.get('version')}, "
                              f"this code reads {FORMAT_VERSION}")
    if state["world_size"] != world_size or state["rank"] != rank:
        raise CheckpointError(f"{path}: written by rank {state['rank']} of "
                              f"{state['world_size']}, loading on rank {rank} of {world_size}")
    mine = shape_signature(cfg)
    diffs = [f"{k}: saved {state['config'].get(k)!r}, now {v!r}"
             for k, v in mine.items() if state["config"].get(k) != v]
    if diffs:
        raise CheckpointError(f"{path}: checkpoint does not match this run (" +
                              "; ".join(diffs) + ")")


def read_checked(directory: str, iteration: int, cfg, rank: int, world_size: int) -> dict:
    """This rank's state of `iteration`, read and checked against this run."""
    path = rank_file(directory, iteration, rank)
    state = read_rank_file(path)
    check_compatible(state, path, cfg, rank, world_size)
    keys = ("iteration", "model", "optimizer", "opt_param_scheduler", "rng", "sampler")
    missing = [k for k in keys if k not in state]
    if missing:
        raise UnreadableCheckpoint(f"{path}: incomplete, lacks {', '.join(missing)}")
    if state["iteration"] != iteration:
        raise UnreadableCheckpoint(f"{path}: records iteration {state['iteration']}, its "
                                   f"directory says {iteration}")
    return state


def agree_or_raise(failure: Exception | None, others: str) -> None:
    """Every rank learns whether any rank failed: the failed ones raise their own error, the
    rest a CheckpointError saying `others`, so no rank waits in a collective for a dead one."""
    if count_over_ranks(failure is not None):
        if failure is not None:
            raise failure
        raise CheckpointError(others)


def reduce_over_ranks(values: list[int], op) -> list[int]:
    """All-reduce small integers over the default group (as they are without one)."""
    tensor = torch.tensor(values, dtype=torch.int64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        if dist.get_backend() == "nccl":
            tensor = tensor.cuda()
        dist.all_reduce(tensor, op=op)
    return [int(v) for v in tensor.tolist()]


def count_over_ranks(flag: bool) -> int:
    """How many ranks pass a true `flag`."""
    return reduce_over_ranks([int(flag)], dist.ReduceOp.SUM)[0]


def lowest_and_highest(value: int) -> tuple[int, int]:
    """Min and max of `value` over the ranks."""
    high, minus_low = reduce_over_ranks([value, -value], dist.ReduceOp.MAX)
    return -minus_low, high


def choose_checkpoint(directory: str, cfg, rank: int, world_size: int):
    """(iteration, this rank's state) of the newest complete checkpoint that every rank can
    read; a collective over the default group. Warns naming each file this rank skipped."""
    latest = latest_iteration(directory)
    candidates = complete_iterations(directory, latest)
    skipped: list[str] = []
    bound, iteration, state, fatal = latest, -1, None, None

    while True:
        if state is None or iteration > bound:
            iteration, state = -1, None
            for candidate in (c for c in candidates if c <= bound):
                try:
                    state = read_checked(directory, candidate, cfg, rank, world_size)
                except UnreadableCheckpoint as err:
                    skipped.append(str(err))
                    continue
                except CheckpointError as err:
                    fatal = err
                iteration = candidate
                break
        agree_or_raise(fatal, f"--load {directory}: another rank refused its checkpoint file "
                              f"(see its error)")
        low, high = lowest_and_highest(iteration)
        if low == high:
            break
        bound = low      # some rank cannot read `iteration`: everyone goes back as far

    for reason in skipped:
        warnings.warn(f"rank {rank}: skipping {reason}", CheckpointFallbackWarning, stacklevel=3)
    if iteration < 0:
        mine = "; ".join(skipped) or "no iter_* directory at or below it"
        raise CheckpointError(f"--load {directory}: no loadable checkpoint ({LATEST} says "
                              f"{latest}); rank {rank}: {mine}")
    if iteration != latest:
        warnings.warn(f"rank {rank}: --load {directory}: the checkpoint of iteration {latest} "
                      f"is unreadable on some rank; resuming from iteration {iteration}",
                      CheckpointFallbackWarning, stacklevel=3)
    return iteration, state


def scheduler_policy(cfg) -> str:
    """How a resumed run treats LR schedule settings that differ from the checkpoint's."""
    if cfg.override_opt_param_scheduler:
        return "override"
    if cfg.use_checkpoint_opt_param_scheduler:
        return "use-checkpoint"
    return "check"


def load_checkpoint(directory: str, modules, optimizer, cfg, rank: int, world_size: int):
    """Restore this rank's state from the newest checkpoint in `directory` that every rank can
    read (all ranks must call it). Returns (completed iterations, sampler state)."""
    iteration, state = choose_checkpoint(directory, cfg, rank, world_size)
    path = rank_file(directory, iteration, rank)
    if cfg.save and iteration < latest_iteration(directory) and \
            os.path.realpath(cfg.save) == os.path.realpath(directory):
        for moved in set_aside_newer(directory, iteration):
            warnings.warn(f"rank {rank}: set aside {moved} (newer than the checkpoint this run "
                          f"resumes from)", CheckpointFallbackWarning, stacklevel=2)
    if len(state["model"]) != len(modules):
        raise CheckpointError(f"{path}: holds {len(state['model'])} stage modules, this rank "
                              f"builds {len(modules)}")
    scheduler = state["opt_param_scheduler"]
    if scheduler.get("num_steps") != iteration:
        raise CheckpointError(f"{path}: the LR scheduler took {scheduler.get('num_steps')} "
                              f"steps in {iteration} iterations")
    optimizer.load_scheduler_state_dict(scheduler, scheduler_policy(cfg), where=path)
    for module, saved in zip(modules, state["model"]):
        module.load_state_dict(saved)
    optimizer.load_state_dict(state["optimizer"])
    restore_rng_state(state["rng"])
    return iteration, state["sampler"]
