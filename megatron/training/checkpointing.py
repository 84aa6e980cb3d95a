"""Layout-free checkpoints: save at one TP / PP / DP, load at any other.

`DIR/iter_NNNNNNN/` holds
  common.pt               (rank 0) format, iteration, model shape, the saving layout, the LR
                          schedule, the sampler position and an index: which shard file holds
                          which parameter;
  shards_ppPPP_tpTTT.pt   (data-parallel replica 0 only, one per (pp, tp) rank) this rank's
                          parameters and their optimizer state (Adam moments, step, fp32 main
                          weights of a bf16 model) as shards keyed by global parameter name
                          (megatron/model/full_state.py), each saying where it sits in the full
                          tensor; TP-replicated parameters are written by TP rank 0 only;
  rank_RRRRR.pt           (every rank) its RNG states and place in the layout;
and `DIR/latest_checkpointed_iteration.txt`. A loading rank reads common.pt, then only the shard
files the index names for its own parameters (memory-mapped: only the bytes it uses are read),
assembles and slices them for its TP rank. The model shape (layers, hidden size, heads, ...)
must match, the layout need not. A FlexTP run (--tp-balance) saves and loads in the even
partition (training.checkpoint_layout; full_state.py, "Spare capacity"), so its files are those
of an ordinary TP run. RNG states are restored on the same layout only; on another
one rank 0 says so and every rank reseeds from --seed and the iteration. A checkpoint made by
`save_model_only_checkpoint` (e.g. tools/convert_checkpoint.py) holds weights only and is
loaded with --finetune (or --no-load-optim). Format 2 (per-rank, layout-bound) checkpoints
are refused with a message saying so.

Atomicity: files are written under a temporary name and renamed, and `latest` moves only after
every rank has written its files, so an interrupted save never looks complete. Resuming on the
same layout reproduces an uninterrupted run exactly.

Safety: a file holds only tensors and plain containers (dict, list, str, int, float, bool,
None) and is read with `torch.load(weights_only=True)`, with no allow-list: a file that holds
any other Python object (a crafted pickle, or a format-1 checkpoint with numpy RNG states) is
refused without running anything in it.

Fallback: `load_checkpoint` takes the newest iteration, at or below `latest`, that every rank
can read. Each rank reads only the files it needs; the ranks agree with an all-reduce over the
default group (no rank ever loads an iteration another rank skipped), so this also works where
ranks do not share a file system. An unreadable file (missing, truncated, corrupt, unsafe) is
skipped with a warning naming it; a readable file that does not fit this run (format, model
shape, LR schedule) is an error, never a reason to go back.
"""
from __future__ import annotations

import errno
import os
import pickle
import random
import re
import shutil
import warnings
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from megatron.model.full_state import assemble, load_sharded_state, local_shards, whole

LATEST = "latest_checkpointed_iteration.txt"
COMMON = "common.pt"
FORMAT_VERSION = 3   # 3: layout-free shards by global name; 2: per-rank files (refused)
# Config fields that must match between the run that saved and the run that loads; the layout
# (TP, PP, DP, world size) and the precision may differ.
SHAPE_FIELDS = ("model", "num_layers", "decoder_num_layers", "hidden_size",
                "num_attention_heads", "ffn_hidden_size", "max_position_embeddings")
ITER_DIR = re.compile(r"iter_(\d{7})$")
STALE_TEMP = re.compile(r"(rank_\d{5}\.pt|shards_pp\d{3}_tp\d{3}\.pt|" + re.escape(COMMON) +
                        "|" + re.escape(LATEST) + r")\.tmp\d+$")


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


def shard_file_name(pp_rank: int, tp_rank: int) -> str:
    return f"shards_pp{pp_rank:03d}_tp{tp_rank:03d}.pt"


def common_file(directory: str, iteration: int) -> str:
    return os.path.join(iteration_dir(directory, iteration), COMMON)


@dataclass(frozen=True)
class Place:
    """Where a rank sits (the fields of distributed_setup.ParallelLayout that matter here)."""

    rank: int
    world_size: int
    tp: int = 1
    pp: int = 1
    dp: int = 1
    tp_rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0


def data_parallel_place(rank: int, world_size: int) -> Place:
    """A world of pure data parallelism (TP = PP = 1)."""
    return Place(rank, world_size, dp=world_size, dp_rank=rank)


def layout_record(place) -> dict:
    return {"world_size": place.world_size, "tp": place.tp, "pp": place.pp, "dp": place.dp}


def describe_layout(record: dict) -> str:
    return f"TP={record['tp']} PP={record['pp']} DP={record['dp']}"


def global_parameters(modules):
    """(global name, parameter) of every module: stages name theirs layout-free
    (StageModule.named_global_parameters); any other module's own names are used as they are."""
    for m in modules:
        yield from (m.named_global_parameters() if hasattr(m, "named_global_parameters")
                    else m.named_parameters())


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


def reseed(seed: int, iteration: int) -> None:
    """Deterministic RNG states for a run that cannot restore the saved ones (another layout,
    --no-load-rng): every RNG seeded from --seed and the iteration, as a fresh run seeds them
    from --seed (megatron's tracker keeps its per-TP-rank offsets)."""
    from megatron.core import parallel_state
    seed = seed + 100_003 * iteration
    random.seed(seed)
    np.random.seed(seed % 2 ** 32)
    if parallel_state.model_parallel_is_initialized():
        from megatron.training.distributed_setup import seed_everything
        seed_everything(seed)
    else:
        torch.manual_seed(seed)


def shape_signature(cfg) -> dict:
    """The model-shape fields of `cfg` a checkpoint records and a load compares."""
    return {name: getattr(cfg, name) for name in SHAPE_FIELDS}


def is_split(param, tp_size: int) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False)) and tp_size > 1


def gather_names(mine):
    """Every rank's `mine` (file and parameter names): an object all-gather between the ranks
    of this run, never read from a file."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [mine]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def gather_index(file_name: str | None, names: list[str]) -> dict[str, list[str]]:
    """{shard file: the global names in it} over all ranks."""
    return {f: n for f, n in gather_names((file_name, names)) if f is not None}


def save_checkpoint(directory: str, iteration: int, modules, optimizer, sampler_state,
                    cfg, rank: int, world_size: int, layout=None) -> str:
    """Write this rank's part of the state after `iteration` completed iterations; every rank
    must call it. `layout` (a ParallelLayout or Place) says where the rank sits; without it the
    world is pure data parallelism. If any rank fails to write (a full disk, ...), every rank
    raises and `latest` stays where it was. Returns the path of this rank's own file."""
    place = layout or data_parallel_place(rank, world_size)
    folder = iteration_dir(directory, iteration)
    # data-parallel replica 0 writes the model and optimizer shards; TP rank 0 alone the
    # parameters every TP rank holds whole
    named = [(n, p) for n, p in global_parameters(modules)
             if place.tp_rank == 0 or is_split(p, place.tp)]
    shard_name = shard_file_name(place.pp_rank, place.tp_rank) if place.dp_rank == 0 else None
    index = gather_index(shard_name, [n for n, _ in named] if shard_name else [])
    path = rank_file(directory, iteration, place.rank)
    head = {"version": FORMAT_VERSION, "iteration": iteration}
    failure = None
    try:
        os.makedirs(folder, exist_ok=True)
        if shard_name:
            keep = {n for n, _ in named}
            shards = dict(head, model=local_shards(named, place.tp_rank, place.tp),
                          optimizer={n: e for n, e in optimizer.sharded_state_dict(
                              place.tp_rank, place.tp).items() if n in keep})
            atomic_write(os.path.join(folder, shard_name), lambda tmp: torch.save(shards, tmp))
        own = dict(head, rank=place.rank, layout=layout_record(place), rng=capture_rng_state())
        atomic_write(path, lambda tmp: torch.save(own, tmp))
        if place.rank == 0:
            common = dict(head, config=shape_signature(cfg), layout=layout_record(place),
                          index=index, model_only=False,
                          opt_param_scheduler=optimizer.scheduler_state_dict(),
                          sampler=sampler_state)
            atomic_write(common_file(directory, iteration),
                         lambda tmp: torch.save(common, tmp))
    except Exception as err:  # noqa: BLE001 - re-raised below, after the ranks agree
        failure = err
    agree_or_raise(failure, f"iteration {iteration}: another rank could not write its "
                            f"checkpoint files (see its error); {LATEST} in {directory} still "
                            f"names the previous checkpoint")
    if place.rank == 0:
        try:
            mark_latest(directory, iteration, cfg.keep_last)
        except Exception as err:  # noqa: BLE001 - re-raised below, after the ranks agree
            failure = err
    agree_or_raise(failure, f"iteration {iteration}: rank 0 could not update {LATEST} in "
                            f"{directory} (see its error)")
    return path


def mark_latest(directory: str, iteration: int, keep_last: int = 0) -> None:
    """Point `latest` at `iteration` (a complete save), then apply --keep-last."""
    atomic_write(os.path.join(directory, LATEST), lambda tmp: write_text(tmp, f"{iteration}\n"))
    for old in prune_checkpoints(directory, iteration, keep_last):
        print(f"[checkpoint] --keep-last {keep_last}: removed "
              f"{iteration_dir(directory, old)}", flush=True)


def save_model_only_checkpoint(directory: str, iteration: int, full_state: dict,
                               config_signature: dict) -> str:
    """Write model weights alone, {global name: full tensor}, as a checkpoint that `--load DIR
    --finetune` reads at any layout (one process, no collective; e.g. weights converted from
    Hugging Face). `config_signature` holds every SHAPE_FIELDS entry (see shape_signature).
    Atomic like save_checkpoint: `latest` moves last. Returns the iteration directory."""
    missing = [k for k in SHAPE_FIELDS if k not in config_signature]
    if missing:
        raise ValueError(f"config_signature lacks {', '.join(missing)} (needs all of "
                         f"{', '.join(SHAPE_FIELDS)})")
    bad = [n for n, t in full_state.items() if not isinstance(t, torch.Tensor)]
    if bad:
        raise ValueError(f"full_state: not tensors: {', '.join(bad[:5])}")
    folder = iteration_dir(directory, iteration)
    os.makedirs(folder, exist_ok=True)
    for path in clean_stale_temp_files(directory):
        print(f"[checkpoint] removed {path}, left by an interrupted save", flush=True)
    name = shard_file_name(0, 0)
    head = {"version": FORMAT_VERSION, "iteration": iteration}
    shards = dict(head, model={n: whole(t) for n, t in full_state.items()}, optimizer={})
    atomic_write(os.path.join(folder, name), lambda tmp: torch.save(shards, tmp))
    common = dict(head, config={k: config_signature[k] for k in SHAPE_FIELDS}, layout=None,
                  index={name: sorted(full_state)}, model_only=True, opt_param_scheduler=None,
                  sampler=None)
    atomic_write(common_file(directory, iteration), lambda tmp: torch.save(common, tmp))
    mark_latest(directory, iteration)
    return folder


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


def load_weights_only(path: str, mmap: bool = False):
    """torch.load(weights_only=True) with no allow-list at all: megatron-core adds numpy
    arrays, argparse.Namespace, BytesIO and more to torch's process-wide allow-list when it is
    imported, and our files need none of them, so that list is set aside for this one load."""
    extra = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    finally:
        torch.serialization.add_safe_globals(extra)


def read_rank_file(path: str, mmap: bool = False) -> dict:
    """Load one checkpoint file with weights_only=True (memory-mapped if `mmap`: tensors are
    read when used); UnreadableCheckpoint naming it otherwise."""
    if not os.path.isfile(path):
        raise UnreadableCheckpoint(f"{path}: missing")
    try:
        state = load_weights_only(path, mmap)
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


FORMAT_2 = ("a format-2 checkpoint (per-rank files bound to one layout); this code reads "
            "format 3 (layout-free). Resume it with the code that wrote it, or start again")


def check_version(state: dict, path: str, iteration: int) -> None:
    """A file of this format and iteration, or CheckpointError / UnreadableCheckpoint."""
    if state.get("version") == 2:
        raise CheckpointError(f"{path}: {FORMAT_2}")
    if state.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: checkpoint format {state.get('version')}, "
                              f"this code reads {FORMAT_VERSION}")
    if state.get("iteration") != iteration:
        raise UnreadableCheckpoint(f"{path}: records iteration {state.get('iteration')}, its "
                                   f"directory says {iteration}")


def check_shape(common: dict, path: str, cfg) -> None:
    """Raise naming the file and every model-shape field that differs from this run's."""
    diffs = [f"{k}: saved {common['config'].get(k)!r}, now {v!r}"
             for k, v in shape_signature(cfg).items() if common["config"].get(k) != v]
    if diffs:
        raise CheckpointError(f"{path}: checkpoint does not match this run's model (" +
                              "; ".join(diffs) + ")")


def read_common(directory: str, iteration: int | None = None) -> dict:
    """The common.pt of `iteration` (default: latest), checked for format and iteration."""
    iteration = latest_iteration(directory) if iteration is None else iteration
    path = common_file(directory, iteration)
    if not os.path.isfile(path) and os.path.isfile(rank_file(directory, iteration, 0)):
        old = read_rank_file(rank_file(directory, iteration, 0))
        if old.get("version") == 2:
            raise CheckpointError(f"{iteration_dir(directory, iteration)}: {FORMAT_2}")
    common = read_rank_file(path)
    check_version(common, path, iteration)
    missing = [k for k in ("config", "layout", "index", "model_only", "opt_param_scheduler",
                           "sampler") if k not in common]
    if missing:
        raise UnreadableCheckpoint(f"{path}: incomplete, lacks {', '.join(missing)}")
    return common


@dataclass
class Loaded:
    """What one rank read of one iteration: the common record, its parameters' shards and
    optimizer entries ({global name: [one per saved shard]}), its RNG states (None when not
    restored)."""

    common: dict
    model: dict
    optimizer: dict | None
    rng: dict | None


def read_shards(directory: str, iteration: int, common: dict, names: set[str],
                with_optimizer: bool) -> tuple[dict, dict | None]:
    """The saved shards (and optimizer entries) of `names`, from the files the index names for
    them only, memory-mapped."""
    model: dict = {}
    optimizer: dict | None = {} if with_optimizer else None
    for file_name, held in sorted(common["index"].items()):
        wanted = names.intersection(held)
        if not wanted:
            continue
        path = os.path.join(iteration_dir(directory, iteration), file_name)
        state = read_rank_file(path, mmap=True)
        check_version(state, path, iteration)
        if not isinstance(state.get("model"), dict) or not isinstance(state.get("optimizer"),
                                                                      dict):
            raise UnreadableCheckpoint(f"{path}: incomplete, lacks its model or optimizer shards")
        for name in wanted:
            if name not in state["model"]:
                raise UnreadableCheckpoint(f"{path}: lacks {name}, which {COMMON} says it holds")
            model.setdefault(name, []).append(state["model"][name])
            if optimizer is not None and name in state["optimizer"]:
                optimizer.setdefault(name, []).append(state["optimizer"][name])
    return model, optimizer


def what_to_load(cfg) -> tuple[bool, bool]:
    """(optimizer and LR schedule, RNG states) under --finetune / --no-load-optim /
    --no-load-rng (Megatron's flags; --finetune loads the weights alone)."""
    finetune = getattr(cfg, "finetune", False)
    return (not (finetune or getattr(cfg, "no_load_optim", False)),
            not (finetune or getattr(cfg, "no_load_rng", False)))


def read_checked(directory: str, iteration: int, cfg, place, names: set[str]) -> Loaded:
    """What this rank needs of `iteration`, read and checked against this run."""
    common = read_common(directory, iteration)
    path = common_file(directory, iteration)
    check_shape(common, path, cfg)
    load_optim, load_rng = what_to_load(cfg)
    if common["model_only"] and load_optim:
        raise CheckpointError(f"{path}: holds model weights only (no optimizer or LR schedule "
                              f"state); load it with --finetune (or --no-load-optim)")
    model, optimizer = read_shards(directory, iteration, common, names, load_optim)
    rng = None
    if load_rng and common["layout"] == layout_record(place):
        own_path = rank_file(directory, iteration, place.rank)
        own = read_rank_file(own_path)
        check_version(own, own_path, iteration)
        if own.get("rank") != place.rank or "rng" not in own:
            raise UnreadableCheckpoint(f"{own_path}: not rank {place.rank}'s file with RNG "
                                       f"states")
        rng = own["rng"]
    return Loaded(common, model, optimizer, rng)


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


def choose_checkpoint(directory: str, cfg, place, names: set[str]):
    """(iteration, what this rank read of it: Loaded) of the newest complete checkpoint that
    every rank can read; a collective over the default group. Warns naming each file this
    rank skipped."""
    rank = place.rank
    latest = latest_iteration(directory)
    candidates = complete_iterations(directory, latest)
    skipped: list[str] = []
    bound, iteration, state, fatal = latest, -1, None, None

    while True:
        if state is None or iteration > bound:
            iteration, state = -1, None
            for candidate in (c for c in candidates if c <= bound):
                try:
                    state = read_checked(directory, candidate, cfg, place, names)
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


def load_checkpoint(directory: str, modules, optimizer, cfg, rank: int, world_size: int,
                    layout=None):
    """Restore this rank's state from the newest checkpoint in `directory` that every rank can
    read, saved at any layout (all ranks must call it; `layout` as in save_checkpoint).
    --finetune loads the weights alone and starts at iteration 0; --no-load-optim keeps a fresh
    optimizer and this run's LR schedule flags; --no-load-rng (or another layout) reseeds.
    Returns (completed iterations, sampler state or None)."""
    place = layout or data_parallel_place(rank, world_size)
    named = list(global_parameters(modules))
    iteration, loaded = choose_checkpoint(directory, cfg, place, {n for n, _ in named})
    common, path = loaded.common, common_file(directory, iteration)
    used = set().union(*gather_names(sorted(n for n, _ in named)))
    unused = sorted({n for held in common["index"].values() for n in held} - used)
    if unused:      # the same on every rank
        raise CheckpointError(f"{path}: holds {len(unused)} parameters this model does not have "
                              f"({', '.join(unused[:5])}); was it saved with another model "
                              f"configuration?")
    if cfg.save and iteration < latest_iteration(directory) and \
            os.path.realpath(cfg.save) == os.path.realpath(directory):
        for moved in set_aside_newer(directory, iteration):
            warnings.warn(f"rank {rank}: set aside {moved} (newer than the checkpoint this run "
                          f"resumes from)", CheckpointFallbackWarning, stacklevel=2)
    try:
        load_sharded_state(named, loaded.model, place.tp_rank, place.tp,
                           f"{iteration_dir(directory, iteration)}")
    except ValueError as err:
        divisor = getattr(cfg, "make_vocab_size_divisible_by", 128)
        hint = (f" (the vocabulary is padded to a multiple of {divisor} x TP, "
                f"--make-vocab-size-divisible-by {divisor}, so some TP sizes pad it "
                f"differently; pick a value that pads both alike)"
                if "word_embeddings.weight: shape" in str(err) else "")
        raise CheckpointError(f"{err}{hint}") from None
    optimizer.main_from_model()
    finetune = getattr(cfg, "finetune", False)
    start = 0 if finetune else iteration
    if loaded.optimizer is not None:
        scheduler = common["opt_param_scheduler"]
        if scheduler.get("num_steps") != iteration:
            raise CheckpointError(f"{path}: the LR scheduler took {scheduler.get('num_steps')} "
                                  f"steps in {iteration} iterations")
        optimizer.load_scheduler_state_dict(scheduler, scheduler_policy(cfg), where=path)
        try:
            optimizer.load_sharded_state_dict(loaded.optimizer, place.tp_rank, place.tp,
                                              where=iteration_dir(directory, iteration))
        except ValueError as err:
            raise CheckpointError(str(err)) from None
    else:
        optimizer.num_steps = start     # a fresh optimizer; the LR follows this run's flags
    if loaded.rng is not None:
        restore_rng_state(loaded.rng)
    elif not finetune:
        if rank == 0:
            saved = common["layout"]
            why = ("--no-load-rng" if getattr(cfg, "no_load_rng", False) else
                   "it holds no RNG states" if saved is None else
                   f"it was saved at {describe_layout(saved)} on {saved['world_size']} ranks, "
                   f"this run is {describe_layout(layout_record(place))} on "
                   f"{place.world_size}")
            print(f"[checkpoint] --load {directory}: RNG states not restored ({why}); every "
                  f"rank reseeds from --seed and iteration {iteration}", flush=True)
        reseed(cfg.seed, iteration)
    return start, (None if finetune else common["sampler"])


def read_full_model_state(directory: str, iteration: int | None = None) -> dict:
    """{global name: full tensor} of a checkpoint's model (default: the latest iteration), from
    one process at any saved layout (for export). Tensors of unsplit parameters stay
    memory-mapped from the file."""
    iteration = latest_iteration(directory) if iteration is None else iteration
    common = read_common(directory, iteration)
    names = {n for held in common["index"].values() for n in held}
    model, _ = read_shards(directory, iteration, common, names, with_optimizer=False)
    return {name: assemble(name, model[name]) for name in sorted(model)}
