"""Reading FLANv2-style multi-task dumps (.jsonl, .jsonl.gz, .parquet) into validated records.

Every line (or parquet row) read is either a `FlanRecord` or a `Rejection` with a reason, so
callers can account for all of them: read = written + rejected. An empty `inputs` with a
non-empty target is a valid sample (real dumps hold zero-shot samples like that); an empty
target after a non-empty input is bad input, since there is nothing to train on. A sample with
nothing in it (input and target both blank; real BIG-bench dumps hold a few) is skipped and
counted, like a blank line. Every per-line failure (bytes, JSON, nesting depth, lone UTF-16
surrogates, a tokenizer error) is a rejection naming FILE:LINE, never a bare traceback."""
from __future__ import annotations

import gzip
import json
import os
import unicodedata
import zlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence, Union

# Field names of the public dumps, most specific first.
TASK_FIELDS = ("_task_name", "task_name", "task")
SOURCE_FIELDS = ("_task_source", "task_source")
TEMPLATE_FIELDS = ("_template_type", "template_type")
SUPPORTED_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".parquet")

# Per-record rejection reasons (fatal unless skip_bad, except SKIPPED_BY_DEFAULT).
BLANK_LINE = "blank line"
EMPTY_SAMPLE = "empty sample"   # input and target both blank: nothing in it, nothing lost
MALFORMED_JSON = "malformed json"
NESTED_TOO_DEEP = "json nested too deep"
INVALID_UTF8 = "invalid utf-8"
LONE_SURROGATE = "lone surrogate"   # a JSON "\ud800" escape: no text, no UTF-8 encoding
TOKENIZER_ERROR = "tokenizer error"
NOT_AN_OBJECT = "not a JSON object"
MISSING_FIELD = "missing field"
NON_STRING_FIELD = "non-string field"
EMPTY_TARGET = "empty target"   # nothing to train on; an empty input is a valid zero-shot sample
CONTROL_IN_NAME = "control character in a name"   # NUL, ESC, ...: echoed raw by every log line
# Per-file rejection reasons.
UNREADABLE_FILE = "unreadable file"
EMPTY_FILE = "empty file"
UNSUPPORTED_FORMAT = "unsupported format"
# Reasons counted and skipped even without skip_bad: they lose no data.
SKIPPED_BY_DEFAULT = frozenset((BLANK_LINE, EMPTY_SAMPLE))


class BadInputError(Exception):
    """Bad input that stops the run: names the file and line (1-based) and the reason."""

    def __init__(self, path: str, line: Optional[int], reason: str, detail: str = ""):
        self.path, self.line, self.reason, self.detail = path, line, reason, detail
        where = f"{path}:{line}" if line is not None else path
        super().__init__(f"{where}: {reason}" + (f": {detail}" if detail else ""))


@dataclass(frozen=True)
class FlanRecord:
    """One multi-task sample with where it came from."""

    inputs: str
    targets: str
    task: str
    source: str
    template_type: str
    path: str
    line: int


@dataclass(frozen=True)
class Rejection:
    """A line that did not become a sample, and why."""

    path: str
    line: int
    reason: str
    detail: str = ""

    def error(self) -> BadInputError:
        return BadInputError(self.path, self.line, self.reason, self.detail)


@dataclass
class ReadCounts:
    """What the reader saw: lines read, rejected per reason (with the first place each reason
    was met), files read whole, files that broke off after some lines (those lines are kept),
    files rejected per reason."""

    read: int = 0
    rejected: Counter = field(default_factory=Counter)
    files_read: int = 0
    files_partly_read: list = field(default_factory=list)   # "path:line: reason: detail"
    files_rejected: Counter = field(default_factory=Counter)
    first_seen: dict = field(default_factory=dict)

    def reject(self, reason: str, where: str, per_file: bool = False) -> None:
        """Count one rejected line (or file) under its reason."""
        (self.files_rejected if per_file else self.rejected)[reason] += 1
        self.first_seen.setdefault(reason, where)

    def reasons(self) -> str:
        """'reason: n (first at where), ...' over lines and files, for messages."""
        parts = [f"{reason}: {n} line(s) (first at {self.first_seen.get(reason, '?')})"
                 for reason, n in sorted(self.rejected.items())]
        parts += [f"{reason}: {n} file(s) (first {self.first_seen.get(reason, '?')})"
                  for reason, n in sorted(self.files_rejected.items())]
        parts += [f"broke off after some lines: {where}" for where in self.files_partly_read]
        return "; ".join(parts) or "no line or file was rejected"


def file_format(path: str) -> str:
    """'jsonl', 'jsonl.gz' or 'parquet' from the file name."""
    lower = path.lower()
    if lower.endswith((".jsonl.gz", ".json.gz")):
        return "jsonl.gz"
    if lower.endswith((".jsonl", ".json")):
        return "jsonl"
    if lower.endswith(".parquet"):
        return "parquet"
    raise BadInputError(path, None, UNSUPPORTED_FORMAT,
                        f"expected one of {', '.join(SUPPORTED_SUFFIXES)}")


def _first_present(row: dict, names: Sequence[str]) -> Optional[str]:
    return next((n for n in names if n in row), None)


def lone_surrogate(text: str) -> Optional[str]:
    """Where `text` holds a UTF-16 surrogate without its pair (JSON can escape one; no
    encoding, hence no tokenizer, accepts it), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"{text[exc.start]!r} at character {exc.start}"
    return None


def parse_row(row: object, path: str, line: int,
              task_field: Optional[str] = None) -> Union[FlanRecord, Rejection]:
    """Validate one decoded JSON value / parquet row into a record, or say why not."""
    if not isinstance(row, dict):
        return Rejection(path, line, NOT_AN_OBJECT, f"got {type(row).__name__}")
    task_key = task_field or _first_present(row, TASK_FIELDS)
    for key, label in (("inputs", "inputs"), ("targets", "targets"),
                       (task_key, task_field or "task (task | task_name | _task_name)")):
        if key is None or key not in row:
            return Rejection(path, line, MISSING_FIELD, f"no {label!r}")
        if not isinstance(row[key], str):
            return Rejection(path, line, NON_STRING_FIELD,
                             f"{key!r} is {type(row[key]).__name__}, not a string")
    optional, texts = {}, {key: row[key] for key in ("inputs", "targets", task_key)}
    for names in (SOURCE_FIELDS, TEMPLATE_FIELDS):
        key = _first_present(row, names)
        value = row.get(key, "") if key else ""
        if value is None:
            value = ""
        if not isinstance(value, str):
            return Rejection(path, line, NON_STRING_FIELD,
                             f"{key!r} is {type(value).__name__}, not a string")
        optional[names[0]] = texts[key or names[0]] = value
    for key, value in texts.items():
        where = lone_surrogate(value)
        if where:
            return Rejection(path, line, LONE_SURROGATE, f"{key!r} holds {where}")
    for key in (task_key, *(k for k in texts if k not in ("inputs", "targets", task_key))):
        bad = next((c for c in texts[key] if unicodedata.category(c) == "Cc"), None)
        if bad is not None:
            return Rejection(path, line, CONTROL_IN_NAME,
                             f"{key!r} holds {bad!r} (a task, source or template name is "
                             f"printed in logs and summaries)")
    if not row["inputs"].strip() and not row["targets"].strip():
        return Rejection(path, line, EMPTY_SAMPLE)
    if row["targets"] == "":   # an empty "inputs" is valid (a zero-shot sample: target only)
        return Rejection(path, line, EMPTY_TARGET)
    return FlanRecord(row["inputs"], row["targets"], row[task_key],
                      optional["_task_source"], optional["_template_type"], path, line)


def json_error_text(exc: json.JSONDecodeError) -> str:
    """'<what> at column N' (some of json's messages already end in 'at')."""
    what = exc.msg[:-3] if exc.msg.endswith(" at") else exc.msg
    return f"{what} at column {exc.colno}"


def _jsonl_rows(path: str, opener) -> Iterator[tuple[int, object]]:
    """(line number, decoded value or Rejection) for every line of a JSON-lines file."""
    line = 0
    try:
        with opener(path, "rb") as f:
            for line, raw in enumerate(f, start=1):
                if not raw.strip():
                    yield line, Rejection(path, line, BLANK_LINE)
                    continue
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    yield line, Rejection(path, line, INVALID_UTF8, str(exc))
                    continue
                try:
                    value = json.loads(text)
                except json.JSONDecodeError as exc:
                    yield line, Rejection(path, line, MALFORMED_JSON, json_error_text(exc))
                    continue
                except RecursionError:
                    yield line, Rejection(path, line, NESTED_TOO_DEEP,
                                          "more levels of [ or { than Python's json decodes")
                    continue
                except ValueError as exc:   # e.g. an integer of more digits than int() takes
                    yield line, Rejection(path, line, MALFORMED_JSON, str(exc))
                    continue
                yield line, value
    except (OSError, EOFError, zlib.error) as exc:   # also gzip.BadGzipFile, an OSError
        raise BadInputError(path, line + 1 if line else None, UNREADABLE_FILE, str(exc)) from exc


def _parquet_rows(path: str) -> Iterator[tuple[int, object]]:
    try:
        import pyarrow
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise BadInputError(path, None, UNSUPPORTED_FORMAT,
                            "reading .parquet needs pyarrow (pip install pyarrow), "
                            "or convert the dump to .jsonl / .jsonl.gz") from exc
    row_no = 0
    try:
        parquet = pq.ParquetFile(path)
        for batch in parquet.iter_batches(batch_size=4096):
            for row in batch.to_pylist():
                row_no += 1
                yield row_no, row
    except (OSError, pyarrow.ArrowException) as exc:   # ArrowInvalid: truncated, not parquet
        raise BadInputError(path, row_no + 1 if row_no else None, UNREADABLE_FILE,
                            str(exc)) from exc


def iter_file(path: str, task_field: Optional[str] = None
              ) -> Iterator[Union[FlanRecord, Rejection]]:
    """Every line/row of one dump file as a record or a rejection (BadInputError for the file)."""
    fmt = file_format(path)
    if not os.path.isfile(path) or not os.access(path, os.R_OK):
        raise BadInputError(path, None, UNREADABLE_FILE,
                            "no such file" if not os.path.exists(path) else "cannot read it")
    if fmt == "parquet":
        rows = _parquet_rows(path)
    else:
        rows = _jsonl_rows(path, gzip.open if fmt == "jsonl.gz" else open)
    for line, row in rows:
        yield row if isinstance(row, Rejection) else parse_row(row, path, line, task_field)


def read_records(paths: Sequence[str], counts: ReadCounts, skip_bad: bool = False,
                 task_field: Optional[str] = None) -> Iterator[FlanRecord]:
    """Valid records of all files in order. Bad lines raise BadInputError unless skip_bad, in
    which case they (and unreadable or empty files) are counted in `counts` and skipped.
    Blank lines and empty samples are always counted and skipped. A file without a non-blank line is empty."""
    for path in paths:
        non_blank = lines_before = 0
        try:
            for item in iter_file(path, task_field):
                counts.read += 1
                lines_before += 1
                if isinstance(item, Rejection):
                    non_blank += item.reason != BLANK_LINE
                    if item.reason not in SKIPPED_BY_DEFAULT and not skip_bad:
                        raise item.error()
                    counts.reject(item.reason, f"{path}:{item.line}")
                    continue
                non_blank += 1
                yield item
        except BadInputError as exc:
            if not skip_bad or exc.reason not in (UNREADABLE_FILE, UNSUPPORTED_FORMAT):
                raise
            if lines_before:   # the lines read before the break are kept and counted
                counts.files_partly_read.append(str(exc))
            else:
                counts.reject(exc.reason, path, per_file=True)
            continue
        if non_blank == 0:
            if not skip_bad:
                raise BadInputError(path, None, EMPTY_FILE, "it holds no records")
            counts.reject(EMPTY_FILE, path, per_file=True)
            continue
        counts.files_read += 1
