"""On-disk layout of a tokenised multi-task dataset, and its crash-safe writer.

For an output prefix P (folder D = dirname(P), name B = basename(P)):
  P_tasks.json        the manifest: task table + tokenizer (with its fingerprint) + the largest
                      token id written (`max_token_id`) + the name of the data folder and the
                      sizes of its files; replaced in one atomic step
  D/B.data-<id>/      the data of one write, never changed once the manifest names it:
      inputs.bin/.idx, targets.bin/.idx   Megatron indexed datasets, one sequence per sample
      task_ids.npy                        task id of every sample (int32)
      summary.json                        the preprocessing summary (counts, length percentiles)

A write goes into a hidden `D/.B.partial-<pid>/` folder, which is renamed to `B.data-<pid>-<hex>`
and then switched in by `os.replace` of the manifest: a crash at any moment leaves either the
previous dataset or the new one at P. The previous data folder is removed after the switch.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import secrets
import shutil
from typing import Optional, Sequence

import numpy as np

TABLE_FORMAT = "megatron-dynapipe-flan/2"
LEGACY_FORMAT = "megatron-dynapipe-flan/1"
# role -> file name inside a data folder (inputs/targets: Megatron path prefixes)
DATA_FILES = {"inputs": "inputs", "targets": "targets", "task_ids": "task_ids.npy",
              "summary": "summary.json"}
DATA_FILE_NAMES = ("inputs.bin", "inputs.idx", "targets.bin", "targets.idx", "task_ids.npy",
                   "summary.json")
_LEGACY_SUFFIXES = ("_inputs.bin", "_inputs.idx", "_targets.bin", "_targets.idx",
                    "_task_ids.npy", "_summary.json")
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_NO_PERMISSION = (errno.EACCES, errno.EPERM, errno.EROFS)


class DatasetWriteError(RuntimeError):
    """The dataset could not be written (disk full, no permission, ...); names the path."""


def import_indexed_dataset():
    """megatron.core.datasets.indexed_dataset, without megatron-core's warnings about the
    optional TransformerEngine / apex it does not need here."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
        from megatron.core.datasets import indexed_dataset
    return indexed_dataset


def manifest_path(prefix: str) -> str:
    """The manifest (task table) of the dataset at `prefix`; its presence marks completion."""
    return prefix + "_tasks.json"


def data_paths(data_dir: str) -> dict[str, str]:
    """Role -> path of a data folder's files (inputs/targets without .bin/.idx)."""
    return {role: os.path.join(data_dir, name) for role, name in DATA_FILES.items()}


def token_dtype(vocab_size: int):
    """Smallest token dtype for the vocabulary (the same rule as Megatron's preprocess_data)."""
    return np.uint16 if vocab_size < 65500 else np.int32


def write_error(exc: OSError, path: str) -> DatasetWriteError:
    """A one-line error for an OSError met while writing `path` (or the file the error
    names), saying a full disk plainly."""
    path = exc.filename if isinstance(exc.filename, str) else path
    if exc.errno in _NO_SPACE:
        return DatasetWriteError(f"the disk is full (no space left on device) while writing "
                                 f"{path}; the partial output was removed")
    if exc.errno in _NO_PERMISSION:
        folder = path if os.path.isdir(path) else os.path.dirname(path)
        return DatasetWriteError(f"cannot write the dataset into {folder}: "
                                 f"{exc.strerror or exc} (pick a writable --output-prefix)")
    return DatasetWriteError(f"cannot write {path}: {exc.strerror or exc}")


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists (another user's process counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(path: str, report: dict) -> None:
    """Remove a file or folder, never raising (clean-up must work on a full disk); counted."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        elif os.path.lexists(path):
            os.remove(path)
        else:
            return
        report["removed"].append(path)
    except OSError as exc:
        report["not_removed"].append(f"{path} ({exc.strerror or exc})")


def _fsync(path: str) -> None:
    """Flush a file or folder to disk, so a power cut cannot reorder it after the switch."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_manifest(prefix: str) -> Optional[dict]:
    """The manifest at `prefix` as JSON, or None when there is none or it does not parse."""
    try:
        with open(manifest_path(prefix)) as f:
            table = json.load(f)
    except (OSError, ValueError):
        return None
    return table if isinstance(table, dict) else None


class FlanDatasetWriter:
    """Writes a dataset into a hidden folder next to the output and switches it in with one
    atomic manifest replace in `finalize` (see the module docstring). Use as a context manager:
    an exception removes everything this writer created and leaves P as it was."""

    def __init__(self, prefix: str, vocab_size: int):
        self.prefix = prefix
        self.vocab_size = vocab_size
        self.out_dir = os.path.dirname(os.path.abspath(prefix))
        self.name = os.path.basename(prefix)
        self.work_dir = os.path.join(self.out_dir, f".{self.name}.partial-{os.getpid()}")
        self.data_dir: Optional[str] = None      # set when renamed, until switched in
        self.cleanup: dict = {"removed": [], "not_removed": []}
        self._builders: dict = {}
        self._task_ids: list[int] = []
        self.max_token_id = -1      # recorded in the manifest; a reader checks ids against it

    def _prepare(self) -> None:
        """Create the hidden folder (after removing stale ones of dead runs for this prefix)."""
        try:
            os.makedirs(self.out_dir, exist_ok=True)
            self.remove_stale()
            shutil.rmtree(self.work_dir, ignore_errors=True)   # ours, from an earlier attempt
            os.mkdir(self.work_dir)
        except OSError as exc:
            raise write_error(exc, self.out_dir) from exc

    def _leftover_pid(self, name: str) -> Optional[int]:
        """The writer's PID if `name` is a partial or data folder of this prefix, else None."""
        match = re.fullmatch(rf"\.{re.escape(self.name)}\.partial-(\d+)"
                             rf"|{re.escape(self.name)}\.data-(\d+)-[0-9a-f]+", name)
        return int(match.group(1) or match.group(2)) if match else None

    def remove_stale(self, keep: Sequence[str] = ()) -> None:
        """Remove this prefix's leftovers: hidden partial folders and data folders that no
        manifest names, whose writing process is gone (killed with SIGKILL, power cut) or is
        this one (one writer per prefix at a time). Never raises."""
        current = read_manifest(self.prefix) or {}
        keep_names = {*keep, current.get("data_dir")}
        try:
            names = os.listdir(self.out_dir)
        except OSError:
            return
        for name in names:
            pid = self._leftover_pid(name)
            if pid is None or name in keep_names or (pid != os.getpid() and pid_alive(pid)):
                continue
            _remove(os.path.join(self.out_dir, name), self.cleanup)

    def _open(self) -> None:
        """Create the builders (megatron-core is imported only now, so input errors found
        before the first sample fail fast)."""
        builder = import_indexed_dataset().IndexedDatasetBuilder
        tmp = data_paths(self.work_dir)
        dtype = token_dtype(self.vocab_size)
        try:
            self._builders = {side: builder(tmp[side] + ".bin", dtype=dtype)
                              for side in ("inputs", "targets")}
        except OSError as exc:
            raise write_error(exc, self.work_dir) from exc

    def add(self, input_ids: Sequence[int], target_ids: Sequence[int], task_id: int) -> None:
        if not self._builders:
            self._open()
        arrays = {}
        for side, ids in (("inputs", input_ids), ("targets", target_ids)):
            arr = np.asarray(ids, dtype=np.int64)
            if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
                raise ValueError(f"token id out of range [0, {self.vocab_size}) in {side}")
            arrays[side] = arr
            if arr.size:
                self.max_token_id = max(self.max_token_id, int(arr.max()))
        for side, arr in arrays.items():
            try:
                self._builders[side].add_document(arr, [arr.size])
            except OSError as exc:
                raise write_error(exc, self._builders[side].data_file.name) from exc
        self._task_ids.append(task_id)

    def __len__(self) -> int:
        return len(self._task_ids)

    def _write_data(self, summary: dict) -> dict:
        """Close the indexed files, write task ids and summary; returns file name -> size."""
        tmp = data_paths(self.work_dir)
        for side, builder in self._builders.items():
            builder.finalize(tmp[side] + ".idx")
        np.save(tmp["task_ids"], np.asarray(self._task_ids, dtype=np.int32))
        with open(tmp["summary"], "w") as f:
            json.dump(summary, f, indent=1)
        sizes = {}
        for name in DATA_FILE_NAMES:
            path = os.path.join(self.work_dir, name)
            _fsync(path)
            sizes[name] = os.path.getsize(path)
        _fsync(self.work_dir)
        return sizes

    def finalize(self, task_table: dict, summary: dict) -> None:
        """Write the data, rename its folder to its final name, then switch the manifest in
        with one os.replace; afterwards remove the previous dataset's files (best effort,
        listed in `self.cleanup`)."""
        if not self._builders:
            raise ValueError(f"no samples were added to the dataset at {self.prefix!r}")
        path = self.work_dir
        try:
            sizes = self._write_data(summary)
            data_name = f"{self.name}.data-{os.getpid()}-{secrets.token_hex(4)}"
            path = os.path.join(self.out_dir, data_name)
            os.rename(self.work_dir, path)
            self.data_dir = path
            manifest = dict(task_table, format=TABLE_FORMAT, data_dir=data_name, files=sizes,
                            max_token_id=self.max_token_id)
            path = os.path.join(self.data_dir, "manifest.json.tmp")
            with open(path, "w") as f:
                json.dump(manifest, f, indent=1)
            _fsync(path)
            previous = read_manifest(self.prefix)
            path = manifest_path(self.prefix)
            os.replace(os.path.join(self.data_dir, "manifest.json.tmp"), path)
        except OSError as exc:
            raise write_error(exc, path) from exc
        switched, self.data_dir = self.data_dir, None
        try:
            _fsync(self.out_dir)
        except OSError:
            pass   # the switch happened; durability of the folder entry is best effort
        self._remove_previous(previous, new=os.path.basename(switched))

    def _remove_previous(self, previous: Optional[dict], new: str) -> None:
        """Remove what the previous manifest named (data folder or format-1 files) and stale
        leftovers; never raises."""
        if previous and previous.get("format") == LEGACY_FORMAT:
            for suffix in _LEGACY_SUFFIXES:
                _remove(self.prefix + suffix, self.cleanup)
        elif previous and isinstance(previous.get("data_dir"), str):
            old = previous["data_dir"]
            if old != new and self._leftover_pid(old) is not None:
                _remove(os.path.join(self.out_dir, old), self.cleanup)
        self.remove_stale(keep=(new, (previous or {}).get("data_dir")))

    def abort(self) -> None:
        """Remove what this writer created; never raises and writes nothing (a full disk
        cannot flush buffered bytes, so they are dropped)."""
        for builder in self._builders.values():
            try:
                builder.data_file.close()
            except OSError:
                pass
        for path in (self.work_dir, self.data_dir):
            if path:
                shutil.rmtree(path, ignore_errors=True)
        self.data_dir = None

    def __enter__(self) -> "FlanDatasetWriter":
        self._prepare()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None or os.path.isdir(self.work_dir) or self.data_dir:
            self.abort()


def dataset_paths(prefix: str) -> tuple[dict, dict[str, str]]:
    """(task table, role -> path) of the complete dataset at `prefix`, read via its manifest;
    a clear error naming what is missing, truncated or of an older format."""
    manifest = manifest_path(prefix)
    build = f"build it with tools/preprocess_flan.py --output-prefix {prefix}"
    if not os.path.exists(manifest):
        raise FileNotFoundError(f"no multi-task dataset at prefix {prefix!r}: {manifest} is "
                                f"missing; {build}")
    with open(manifest) as f:
        try:
            table = json.load(f)
        except ValueError as exc:
            raise ValueError(f"{manifest}: not valid JSON ({exc}); {build}") from exc
    if not isinstance(table, dict):
        raise ValueError(f"{manifest}: not a dataset manifest (a JSON object); {build}")
    if table.get("format") == LEGACY_FORMAT:
        raise ValueError(f"{manifest} was written by an older tools/preprocess_flan.py (format "
                         f"{LEGACY_FORMAT}, without a tokenizer fingerprint); rebuild it with "
                         f"tools/preprocess_flan.py --output-prefix {prefix}")
    if table.get("format") != TABLE_FORMAT:
        raise ValueError(f"{manifest}: format {table.get('format')!r}, expected "
                         f"{TABLE_FORMAT!r}")
    try:
        data_dir = os.path.join(os.path.dirname(os.path.abspath(prefix)), str(table["data_dir"]))
        files = {str(name): int(size) for name, size in table["files"].items()}
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"{manifest}: a damaged manifest (its data_dir / files entries: "
                         f"{type(exc).__name__}: {exc}); {build}") from exc
    problems = []
    for name, size in files.items():
        path = os.path.join(data_dir, name)
        if not os.path.exists(path):
            problems.append(f"{path} is missing")
        elif os.path.getsize(path) != size:
            problems.append(f"{path} has {os.path.getsize(path)} bytes, the manifest says {size}")
    if problems:
        raise FileNotFoundError(f"the dataset at prefix {prefix!r} is damaged: "
                                f"{'; '.join(problems)}; {build}")
    return table, data_paths(data_dir)


def manifest_digest(prefix: str) -> str:
    """The SHA-256 of the dataset's manifest (hex): it names the data folder (new for every
    write) and every file's size, so it identifies one written dataset wherever it is moved."""
    with open(manifest_path(prefix), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def dataset_files(prefix: str) -> list[str]:
    """The files the complete dataset at `prefix` consists of (manifest first)."""
    table, paths = dataset_paths(prefix)
    folder = os.path.dirname(paths["inputs"])
    return [manifest_path(prefix)] + [os.path.join(folder, name) for name in table["files"]]
