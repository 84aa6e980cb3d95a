"""Layout-free checkpoints: save at one TP / PP / DP, load at any other.

`DIR/iter_NNNNNNN/` holds
  common.pt               (rank 0) format, iteration, the model's flags (shape, layer options,
                          vocabulary: model_signature), the saving layout, the LR schedule, the
                          sampler position, the tokenizer and datasets trained on ("data"), an index (which shard file holds which parameter)
                          and the SHA-256 of every other file;
  shards_ppPPP_tpTTT.pt   (data-parallel replica 0 only, one per (pp, tp) rank) this rank's
                          parameters and their optimizer state (Adam moments, step, fp32 main
                          weights of a bf16 model) as shards keyed by global parameter name
                          (megatron/model/full_state.py), each saying where it sits in the full
                          tensor; TP-replicated parameters are written by TP rank 0 only;
  rank_RRRRR.pt           (every rank) its RNG states and place in the layout;
and `DIR/latest_checkpointed_iteration.txt`. A loading rank reads common.pt, then only the shard
files the index names for its own parameters (each read once whole to verify its checksum, then
memory-mapped), assembles and slices them for its TP rank. The model (shape, and every flag that
changes its function: each ModelSpec option, e.g. norm, epsilon, softmax scale, positions,
gated MLP, biases, and the vocabulary) must match, naming the flag and both values; the layout
need not. Tensors must
be floating point and shaped like their parameter (Adam moments too). A FlexTP run
(--tp-balance) saves and loads in the even partition (training.checkpoint_layout; full_state.py,
"Spare capacity"), so its files are those of an ordinary TP run. RNG states are restored on the
same layout only; on another one rank 0 says so and every rank reseeds from --seed and the iteration. A checkpoint made by
`save_model_only_checkpoint` (e.g. tools/convert_checkpoint.py) holds weights only and is
loaded with --finetune (or --no-load-optim). Format 2 (per-rank, layout-bound) checkpoints
are refused with a message saying so.

Atomicity: files are written under a temporary name and renamed, and `latest` moves only after
every rank has written its files, so an interrupted save never looks complete. Resuming on the
same layout reproduces an uninterrupted run exactly.

Never backwards, never another run's: `latest` only moves forward (mark_latest refuses to name
an iteration older than the one it names while that one's folder is there); a tracker file
that is missing while complete iteration folders (with their common.pt) are there is read as
the newest of them (newest_checkpoint) and rewritten, never as "no checkpoint"; a run that
finds checkpoints in its --save without resuming them refuses to start (training.py) unless
--overwrite-checkpoints sets them aside (start_over); and rank 0 holds `save.lock` in --save
for the life of the run, so a second run writing there is refused, naming the first (a lock
left by a process that is gone is named and taken over).

Safety: a file holds only tensors and plain containers (dict, list, str, int, float, bool,
None) and is read with `torch.load(weights_only=True)`, with no allow-list: a file that holds
any other Python object (a crafted pickle, or a format-1 checkpoint with numpy RNG states) is
refused without running anything in it.

Fallback: `load_checkpoint` takes the newest iteration, at or below `latest`, that every rank
can read. Each rank reads only the files it needs; the ranks agree with an all-reduce over the
default group (no rank ever loads an iteration another rank skipped), so this also works where
ranks do not share a file system. An unreadable file (missing, truncated, corrupt, unsafe, or
bytes that do not have the checksum common.pt records) is skipped with a warning naming it; a
readable file that does not fit this run (format, model, LR schedule) is an error, never a reason
to go back. Every rank's save or load error is told to every rank, so each prints one line
naming the rank and the file.
"""
from __future__ import annotations

import errno
import hashlib
import os
import pickle
import random
import json
import re
import shutil
import socket
import time
import warnings
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from dynapipe_ext.costs.model_spec import MODEL_OPTIONS, option_arg
from megatron.base.collectives import gather_from_ranks, reduce_over_ranks
from megatron.base.distributed_setup import ParallelLayout
from megatron.data.flan_indexed import pid_alive
from megatron.model.full_state import (assemble, load_sharded_state, local_shards,
                                       saved_shape, state_problems, whole)

LATEST = "latest_checkpointed_iteration.txt"
COMMON = "common.pt"
FORMAT_VERSION = 3   # 3: layout-free shards by global name; 2: per-rank files (refused)
# Config fields that must match between the run that saved and the run that loads: every
# ModelSpec option (dynapipe_ext/costs/model_spec.py MODEL_OPTIONS, the one declaration of a
# model's identity), under the name of the flag field it is read from; the layout (TP, PP, DP,
# world size) and the precision may differ. SHAPE_FIELDS are in every checkpoint;
# FUNCTION_FIELDS (the layer options, recorded since they existed) and the model's
# vocabulary (VOCAB_FIELD: tokens with a row of their own, before padding) are compared when the
# checkpoint records them (those written before they were recorded do not).
SHAPE_FIELDS = tuple(option_arg(f) for f in MODEL_OPTIONS if f.metadata["shape"])
FUNCTION_FIELDS = tuple(option_arg(f) for f in MODEL_OPTIONS if not f.metadata["shape"])
VOCAB_FIELD = "vocab_size"


def option_name(option) -> str:
    """How a difference names an option: its flag, with the field where the flag says
    otherwise ("--disable-bias-linear (add_bias_linear)")."""
    flag, arg = option.metadata["flag"], option_arg(option)
    if flag.startswith("--") and flag[2:].replace("-", "_") != arg:
        return f"{flag} ({arg})"
    return flag


FLAG_NAMES = {**{option_arg(f): option_name(f) for f in MODEL_OPTIONS},
              VOCAB_FIELD: "the vocabulary (tokens of the tokenizer, before padding)"}
ITER_DIR = re.compile(r"iter_(\d{7})$")
LOCK = "save.lock"
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

LOW_SPACE_BYTES = 1 << 20     # below this much free space, a failed write ran out of it


def free_bytes(path: str) -> int | None:
    """Free bytes for this user on the file system of `path`'s directory (None if unknown)."""
    try:
        return shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free
    except OSError:
        return None


def is_disk_full(err: BaseException, path: str | None = None) -> bool:
    """ENOSPC, or what torch.save's zip writer raises when a write comes up short; its bare
    C++ stream error (`basic_ios::clear: iostream error`) counts when the file system of `path`
    has (almost) no space left."""
    if isinstance(err, OSError) and err.errno == errno.ENOSPC:
        return True
    text = str(err)
    if not isinstance(err, RuntimeError):
        return False
    if "unexpected pos" in text or "PytorchStreamWriter failed" in text:
        return True
    free = free_bytes(path) if path else None
    return "iostream error" in text and free is not None and free < LOW_SPACE_BYTES


def atomic_write(path: str, write) -> None:
    """Call `write(tmp_path)`, then rename onto `path` (same directory, so the rename is
    atomic). On any failure the temporary file is removed and `path` is untouched; a full
    disk is an OSError(ENOSPC) that says so and names `path`."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException as err:
        full = is_disk_full(err, tmp)       # before the partial file frees its space
        if os.path.exists(tmp):
            os.remove(tmp)
        if full:
            raise OSError(errno.ENOSPC, f"cannot write {path}: the disk is full (no space left "
                                        f"on the device); nothing was left behind and the "
                                        f"previous checkpoint is intact") from err
        if isinstance(err, RuntimeError) and "iostream error" in str(err):
            raise OSError(errno.EIO, f"cannot write {path}: an I/O error ({err}); nothing was "
                                     f"left behind and the previous checkpoint is intact") from err
        raise


def file_digest(path: str) -> str:
    """The SHA-256 of a file's bytes, hex (a checkpoint records one per file it indexes)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


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


def prepare_save_dir(directory: str, rank: int, start_over_there: bool = False) -> None:
    """Before training: rank 0 creates `directory`, takes its lock (acquire_save_lock), sets
    its checkpoints aside if `start_over_there` (--overwrite-checkpoints) and clears stale
    temporary files from it; every rank waits, and all raise alike if it cannot be written or
    another run holds it."""
    problem = None
    if rank == 0:
        try:
            os.makedirs(directory, exist_ok=True)
            if not os.access(directory, os.W_OK | os.X_OK):
                raise PermissionError(errno.EACCES, "not writable", directory)
            acquire_save_lock(directory)
            if start_over_there:
                for moved in start_over(directory):
                    print(f"[checkpoint] --overwrite-checkpoints: set aside {moved}", flush=True)
            for path in clean_stale_temp_files(directory):
                print(f"[checkpoint] removed {path}, left by an interrupted save", flush=True)
        except (OSError, CheckpointError) as err:
            problem = err
    if count_over_ranks(problem is not None):
        if isinstance(problem, CheckpointError):
            raise problem
        raise CheckpointError(f"--save {directory}: cannot write checkpoints there "
                              f"({problem or 'see rank 0'})")


def lock_holder(path: str) -> dict | None:
    """The {host, pid, started} a lock file records (None when it cannot be read as one)."""
    try:
        with open(path) as f:
            holder = json.load(f)
    except (OSError, ValueError):
        return None
    ok = isinstance(holder, dict) and isinstance(holder.get("pid"), int)
    return holder if ok else None


def acquire_save_lock(directory: str) -> None:
    """Create `directory`/save.lock recording this process (host, pid, start time), or raise a
    CheckpointError naming the run that holds it. A lock of this process is kept; one of a
    process on this host that is gone (killed, crashed) is named and taken over. A lock from
    another host cannot be checked: the error says how to clear it."""
    path = os.path.join(directory, LOCK)
    me = {"host": socket.gethostname(), "pid": os.getpid(),
          "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = lock_holder(path)
            if holder is None:
                raise CheckpointError(f"--save {directory}: {path} exists but is not a lock "
                                      f"this code wrote; remove it if no run writes there")
            if (holder.get("host"), holder["pid"]) == (me["host"], me["pid"]):
                return
            if holder.get("host") != me["host"] or pid_alive(holder["pid"]):
                raise CheckpointError(
                    f"--save {directory}: another run writes there (process {holder['pid']} "
                    f"on {holder.get('host')}, started {holder.get('started')}, holds {path}); "
                    f"save to another folder, or wait for it to end (remove {path} only if "
                    f"that process is gone)")
            print(f"[checkpoint] {path}: left by process {holder['pid']} on {holder['host']} "
                  f"(started {holder.get('started')}), which is gone; taking it over",
                  flush=True)
            os.remove(path)
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        return


def release_save_lock(directory: str) -> None:
    """Remove `directory`/save.lock if this process holds it."""
    path = os.path.join(directory, LOCK)
    holder = lock_holder(path)
    if holder and (holder.get("host"), holder["pid"]) == (socket.gethostname(), os.getpid()):
        os.remove(path)


def start_over(directory: str) -> list[str]:
    """Set every checkpoint of `directory` aside (iter_N -> iter_N.abandoned, kept) and remove
    its tracker file, so a run told to start over there (--overwrite-checkpoints) begins a
    history of its own; returns the new names."""
    moved = set_aside_newer(directory, -1)
    tracker = os.path.join(directory, LATEST)
    if os.path.isfile(tracker):
        os.remove(tracker)
    return moved


def saved_iterations(directory: str) -> list[int]:
    """Iterations whose folder holds a common.pt (written last by a save: a complete one),
    newest first; [] when `directory` does not exist."""
    if not os.path.isdir(directory):
        return []
    found = [int(m.group(1)) for m in map(ITER_DIR.match, os.listdir(directory)) if m]
    return sorted((i for i in found if os.path.isfile(common_file(directory, i))), reverse=True)


def newest_checkpoint(directory: str) -> int | None:
    """latest_iteration, or None when `directory` holds no checkpoint."""
    try:
        return latest_iteration(directory)
    except FileNotFoundError:
        return None


def rebuild_tracker(directory: str) -> int | None:
    """Rewrite a missing tracker file from the newest complete iteration folder; returns that
    iteration (None when the tracker is there or there is no checkpoint)."""
    if os.path.isfile(os.path.join(directory, LATEST)):
        return None
    found = saved_iterations(directory)
    if not found:
        return None
    atomic_write(os.path.join(directory, LATEST), lambda tmp: write_text(tmp, f"{found[0]}\n"))
    return found[0]


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
        from megatron.base.distributed_setup import seed_everything
        seed_everything(seed)
    else:
        torch.manual_seed(seed)


def model_vocab_size(modules) -> int | None:
    """The vocabulary of the model the stage modules build (tokens before padding), or None
    for modules that are not stages."""
    for module in modules:
        spec = getattr(module, "spec", None)
        if spec is not None:
            return spec.unpadded_vocab_size or spec.vocab_size
    return None


def model_signature(cfg, modules=()) -> dict:
    """The fields of `cfg` (and the vocabulary of `modules`) a checkpoint records and a load
    compares: SHAPE_FIELDS, FUNCTION_FIELDS, VOCAB_FIELD."""
    signature = {name: getattr(cfg, name) for name in SHAPE_FIELDS}
    signature.update({name: getattr(cfg, name) for name in FUNCTION_FIELDS if hasattr(cfg, name)})
    vocab = model_vocab_size(modules)
    if vocab is not None:
        signature[VOCAB_FIELD] = vocab
    return signature


def signature_differences(saved: dict, now: dict) -> list[str]:
    """'FLAG: saved X, now Y' for every field of `now` that differs from `saved` (fields the
    checkpoint does not record are not compared, except SHAPE_FIELDS); kv_channels 0 means
    hidden / heads, and the relative-bucket fields count only where either uses them."""
    def kv(config):
        return config.get("kv_channels") or config["hidden_size"] // config["num_attention_heads"]

    relative = "relative" in (saved.get("position_embedding_type"),
                              now.get("position_embedding_type"))
    diffs = []
    for name, value in now.items():
        if name not in saved and name not in SHAPE_FIELDS:
            continue
        old = saved.get(name)
        if name == "kv_channels":
            old, value = kv(saved), kv(now)
        if name.startswith("relative_attention") and not relative:
            continue
        if old != value:
            diffs.append(f"{FLAG_NAMES.get(name, '--' + name.replace('_', '-'))}: saved "
                         f"{old!r}, now {value!r}")
    return diffs


def is_split(param, tp_size: int) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False)) and tp_size > 1


def gather_index(file_name: str | None, names: list[str]) -> dict[str, list[str]]:
    """{shard file: the global names in it} over all ranks."""
    return {f: n for f, n in gather_from_ranks((file_name, names)) if f is not None}


def save_checkpoint(directory: str, iteration: int, modules, optimizer, sampler_state,
                    cfg, rank: int, world_size: int, layout=None,
                    data_identity: dict | None = None) -> str:
    """Write this rank's part of the state after `iteration` completed iterations; every rank
    must call it. `layout` (a ParallelLayout) says where the rank sits; without it the
    world is pure data parallelism. `data_identity` (the tokenizer and datasets trained on,
    training.data_identity) is recorded in common.pt as "data". If any rank fails to write (a full disk, ...), every rank
    raises and `latest` stays where it was. Returns the path of this rank's own file."""
    place = layout or ParallelLayout.data_parallel(rank, world_size)
    folder = iteration_dir(directory, iteration)
    # data-parallel replica 0 writes the model and optimizer shards; TP rank 0 alone the
    # parameters every TP rank holds whole
    named = [(n, p) for n, p in global_parameters(modules)
             if place.tp_rank == 0 or is_split(p, place.tp)]
    shard_name = shard_file_name(place.pp_rank, place.tp_rank) if place.dp_rank == 0 else None
    index = gather_index(shard_name, [n for n, _ in named] if shard_name else [])
    path = rank_file(directory, iteration, place.rank)
    head = {"version": FORMAT_VERSION, "iteration": iteration}
    # on every rank: a sharded optimizer (--use-distributed-optimizer) gathers its state
    optimizer_state = optimizer.sharded_state_dict(place.tp_rank, place.tp)
    failure, digests = None, {}
    try:
        os.makedirs(folder, exist_ok=True)
        if shard_name:
            keep = {n for n, _ in named}
            shards = dict(head, model=local_shards(named, place.tp_rank, place.tp),
                          optimizer={n: e for n, e in optimizer_state.items() if n in keep})
            shard_path = os.path.join(folder, shard_name)
            atomic_write(shard_path, lambda tmp: torch.save(shards, tmp))
            digests[shard_name] = file_digest(shard_path)
        own = dict(head, rank=place.rank, layout=layout_record(place), rng=capture_rng_state())
        atomic_write(path, lambda tmp: torch.save(own, tmp))
        digests[os.path.basename(path)] = file_digest(path)
    except Exception as err:  # noqa: BLE001 - re-raised below, after the ranks agree
        failure = err
    checksums = {n: d for files in gather_from_ranks(digests) for n, d in files.items()}
    raise_if_any_rank_failed(failure, f"iteration {iteration}: checkpoint not saved ({LATEST} in "
                            f"{directory} still names the previous checkpoint)")
    if place.rank == 0:
        try:
            common = dict(head, config=model_signature(cfg, modules),
                          layout=layout_record(place), index=index, model_only=False,
                          opt_param_scheduler=optimizer.scheduler_state_dict(),
                          sampler=sampler_state, checksums=checksums, data=data_identity)
            atomic_write(common_file(directory, iteration),
                         lambda tmp: torch.save(common, tmp))
            mark_latest(directory, iteration, cfg.keep_last)
        except Exception as err:  # noqa: BLE001 - re-raised below, after the ranks agree
            failure = err
    raise_if_any_rank_failed(failure, f"iteration {iteration}: checkpoint not saved (rank 0 could not "
                            f"write {COMMON} or update {LATEST} in {directory})")
    return path


def mark_latest(directory: str, iteration: int, keep_last: int = 0) -> None:
    """Point `latest` at `iteration` (a complete save), then apply --keep-last. Never back: a
    CheckpointError when `latest` names a newer iteration whose folder is still there."""
    tracker = os.path.join(directory, LATEST)
    current = latest_iteration(directory) if os.path.isfile(tracker) else None
    if current is not None and current > iteration and os.path.isdir(
            iteration_dir(directory, current)):
        raise CheckpointError(f"{tracker} names iteration {current}, newer than {iteration}: "
                              f"not moving it back (another run writes {directory}?)")
    atomic_write(os.path.join(directory, LATEST), lambda tmp: write_text(tmp, f"{iteration}\n"))
    for old in prune_checkpoints(directory, iteration, keep_last):
        print(f"[checkpoint] --keep-last {keep_last}: removed "
              f"{iteration_dir(directory, old)}", flush=True)


def save_model_only_checkpoint(directory: str, iteration: int, full_state: dict,
                               config_signature: dict) -> str:
    """Write model weights alone, {global name: full tensor}, as a checkpoint that `--load DIR
    --finetune` reads at any layout (one process, no collective; e.g. weights converted from
    Hugging Face). `config_signature` holds every SHAPE_FIELDS entry and any of
    FUNCTION_FIELDS and VOCAB_FIELD (see model_signature).
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
    checksums = {name: file_digest(os.path.join(folder, name))}
    recorded = SHAPE_FIELDS + FUNCTION_FIELDS + (VOCAB_FIELD,)
    common = dict(head, config={k: v for k, v in config_signature.items() if k in recorded},
                  layout=None,
                  index={name: sorted(full_state)}, model_only=True, opt_param_scheduler=None,
                  sampler=None, checksums=checksums)
    atomic_write(common_file(directory, iteration), lambda tmp: torch.save(common, tmp))
    mark_latest(directory, iteration)
    return folder


# ---------------------------------------------------------------------------- loading

def latest_iteration(directory: str) -> int:
    """The iteration of the last complete checkpoint in `directory` (without a tracker file,
    the newest complete iteration folder), with a clear error if none."""
    marker = os.path.join(directory, LATEST)
    if not os.path.isfile(marker):
        found = saved_iterations(directory)
        if found:
            return found[0]
        raise FileNotFoundError(f"--load {directory}: no {LATEST} (no complete checkpoint there)")
    with open(marker, "rb") as f:
        raw = f.read(64)
    text = raw.decode("ascii", errors="replace").strip()
    if not text.isdigit():
        raise CheckpointError(f"{marker}: expected an iteration number, found {raw[:32]!r} "
                              f"(not a checkpoint tracker file, or a corrupt one)")
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


def read_rank_file(path: str, mmap: bool = False, checksum: str | None = None) -> dict:
    """Load one checkpoint file with weights_only=True (memory-mapped if `mmap`: tensors are
    read when used); UnreadableCheckpoint naming it otherwise, or when its bytes do not have
    the SHA-256 `checksum` (the one common.pt records for it: a bit flip anywhere in it)."""
    if not os.path.isfile(path):
        raise UnreadableCheckpoint(f"{path}: missing")
    if checksum is not None:
        try:
            found = file_digest(path)
        except OSError as err:
            raise UnreadableCheckpoint(f"{path}: unreadable: {err}") from None
        if found != checksum:
            raise UnreadableCheckpoint(f"{path}: truncated or corrupt: its SHA-256 is "
                                       f"{found[:16]}..., "
                                       f"{COMMON} records {checksum[:16]}... for it")
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


def check_model(common: dict, path: str, signature: dict) -> None:
    """Raise naming the file and every model field (flag, both values) that differs from this
    run's `signature` (model_signature)."""
    diffs = signature_differences(common["config"], signature)
    if diffs:
        raise CheckpointError(f"{path}: checkpoint does not match this run's model (" +
                              "; ".join(diffs) + ")")


def saved_vocab_size(directory: str) -> int | None:
    """The vocabulary recorded by the latest checkpoint in `directory` (None when there is
    none, it records none or cannot be read: the load says why). A run builds its model with
    at least this many token rows: a checkpoint may have more rows than the run's tokenizer has
    tokens (FLAN-T5: 32,128 rows, 32,100 tokens), and those rows keep their part in the
    softmax."""
    try:
        vocab = read_common(directory)["config"].get(VOCAB_FIELD)
    except (OSError, ValueError):
        return None
    return vocab if isinstance(vocab, int) else None


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


def checksum_of(common: dict, file_name: str) -> str | None:
    """The SHA-256 common.pt records for `file_name` (None: checkpoints written before they
    were recorded are read unverified)."""
    checksums = common.get("checksums")
    return checksums.get(file_name) if isinstance(checksums, dict) else None


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
        state = read_rank_file(path, mmap=True, checksum=checksum_of(common, file_name))
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


def read_checked(directory: str, iteration: int, cfg, place, names: set[str],
                 signature: dict) -> Loaded:
    """What this rank needs of `iteration`, read and checked against this run (`signature`:
    model_signature)."""
    common = read_common(directory, iteration)
    path = common_file(directory, iteration)
    check_model(common, path, signature)
    load_optim, load_rng = what_to_load(cfg)
    if common["model_only"] and load_optim:
        raise CheckpointError(f"{path}: holds model weights only (no optimizer or LR schedule "
                              f"state); load it with --finetune (or --no-load-optim)")
    model, optimizer = read_shards(directory, iteration, common, names, load_optim)
    rng = None
    if load_rng and common["layout"] == layout_record(place):
        own_path = rank_file(directory, iteration, place.rank)
        own = read_rank_file(own_path, checksum=checksum_of(common, os.path.basename(own_path)))
        check_version(own, own_path, iteration)
        if own.get("rank") != place.rank or "rng" not in own:
            raise UnreadableCheckpoint(f"{own_path}: not rank {place.rank}'s file with RNG "
                                       f"states")
        rng = own["rng"]
    return Loaded(common, model, optimizer, rng)


def raise_if_any_rank_failed(failure: Exception | None, others: str) -> None:
    """Every rank learns whether any rank failed, and why: the failed ones raise their own
    error, the rest a CheckpointError saying `others` and each failed rank's error (one line
    on every rank: a full disk on one rank is named on all), so no rank waits in a collective
    for a dead one."""
    reasons = gather_from_ranks(None if failure is None else str(failure).replace("\n", " "))
    if any(reasons):
        if failure is not None:
            raise failure
        raise CheckpointError(f"{others}: " + "; ".join(
            f"rank {r}: {why}" for r, why in enumerate(reasons) if why))


def count_over_ranks(flag: bool) -> int:
    """How many ranks pass a true `flag`."""
    return reduce_over_ranks([int(flag)], dist.ReduceOp.SUM)[0]


def lowest_and_highest(value: int) -> tuple[int, int]:
    """Min and max of `value` over the ranks."""
    high, minus_low = reduce_over_ranks([value, -value], dist.ReduceOp.MAX)
    return -minus_low, high


def choose_checkpoint(directory: str, cfg, place, names: set[str], signature: dict):
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
                    state = read_checked(directory, candidate, cfg, place, names, signature)
                except UnreadableCheckpoint as err:
                    skipped.append(str(err))
                    continue
                except CheckpointError as err:
                    fatal = err
                iteration = candidate
                break
        raise_if_any_rank_failed(fatal, f"--load {directory}: another rank refused its checkpoint file")
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
    place = layout or ParallelLayout.data_parallel(rank, world_size)
    named = list(global_parameters(modules))
    iteration, loaded = choose_checkpoint(directory, cfg, place, {n for n, _ in named},
                                          model_signature(cfg, modules))
    common, path = loaded.common, common_file(directory, iteration)
    used = set().union(*gather_from_ranks(sorted(n for n, _ in named)))
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
        hint = ""
        rows = [saved_shape(shards)[0] for name, shards in loaded.model.items()
                if name.endswith("word_embeddings.weight")]
        if "word_embeddings.weight: shape" in str(err) and rows:
            hint = vocab_padding_hint(model_vocab_size(modules), rows[0], place.tp,
                                      getattr(cfg, "make_vocab_size_divisible_by", 128))
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
        check_optimizer_state(named, loaded.optimizer, place.tp, common["index"],
                              iteration_dir(directory, iteration))
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


def vocab_padding_hint(vocab: int | None, saved_rows: int, tp: int, divisor: int) -> str:
    """A clause saying how the vocabulary is padded and which --make-vocab-size-divisible-by
    pads `vocab` tokens to the checkpoint's `saved_rows` at this TP (a power of two if one
    does, the largest such)."""
    def rows(d: int) -> int:
        return -(-vocab // (d * tp)) * d * tp

    head = (f" (the vocabulary is padded to a multiple of {divisor} x TP, "
            f"--make-vocab-size-divisible-by {divisor}, so some TP sizes pad it differently")
    if vocab is None:
        return head + "; pick a value that pads both alike)"
    candidates = sorted(range(1, max(divisor, 128) + 1), key=lambda d: (d & (d - 1) != 0, -d))
    fits = [d for d in candidates if rows(d) == saved_rows]
    if not fits:
        return head + (f"; no value pads its {vocab} tokens to the checkpoint's {saved_rows} "
                       f"rows at TP={tp})")
    return head + (f"; --make-vocab-size-divisible-by {fits[0]} pads its {vocab} tokens to the "
                   f"checkpoint's {saved_rows} rows at TP={tp})")


OPTIMIZER_TENSORS = ("exp_avg", "exp_avg_sq", "main")   # shaped like the parameter


def check_optimizer_state(named, optimizer_shards: dict, tp_size: int, index: dict,
                          folder: str) -> None:
    """CheckpointError naming the shard file and the tensor when a saved Adam moment or main
    weight is not shaped like its parameter or not floating point (instead of an assert deep
    in the first optimizer step)."""
    problems = []
    for name, param in named:
        entries = optimizer_shards.get(name) or []
        for key in OPTIMIZER_TENSORS:
            if not entries or not all(key in e for e in entries):
                continue
            found = state_problems(f"{name} ({key})", [e[key] for e in entries], param, tp_size)
            if found:
                files = [os.path.join(folder, f) for f, held in sorted(index.items())
                         if name in held]
                problems += [f"{p} in {' / '.join(files)}" for p in found]
        step = entries[0].get("step") if entries else None
        if entries and not (isinstance(step, torch.Tensor) and step.numel() == 1):
            problems.append(f"{name} (step): not a one-element tensor")
    if problems:
        raise CheckpointError(f"{folder}: optimizer state does not fit this model: "
                              + "; ".join(problems[:8])
                              + (f"; and {len(problems) - 8} more" if len(problems) > 8 else ""))


def read_full_model_state(directory: str, iteration: int | None = None) -> dict:
    """{global name: full tensor} of a checkpoint's model (default: the latest iteration), from
    one process at any saved layout (for export). Tensors of unsplit parameters stay
    memory-mapped from the file."""
    iteration = latest_iteration(directory) if iteration is None else iteration
    common = read_common(directory, iteration)
    names = {n for held in common["index"].values() for n in held}
    model, _ = read_shards(directory, iteration, common, names, with_optimizer=False)
    return {name: assemble(name, model[name]) for name in sorted(model)}
