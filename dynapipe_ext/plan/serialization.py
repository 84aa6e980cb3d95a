"""ExecutionPlan <-> compact bytes, safe to read from anywhere (no pickle, nothing executes).

Layout: a 24-byte header — magic b"DPXPLAN\\0", format version (u16), flags (u16, 0),
payload length before and after compression (u32 each), CRC-32 of header + compressed payload
(u32) — then the zlib-compressed payload: three counts (u32: strings, floats, integers), the
string table (u32 length + UTF-8 each), the floats (IEEE doubles) and one flat stream of int64
holding the plan: header fields, micro-batches and instructions as opcode + fields, strings as
table indices. Anything else (corrupt, truncated, foreign or another version) raises
PlanFormatError.
"""
from __future__ import annotations

import struct
import zlib

import numpy as np

from dynapipe_ext.plan.instructions import (Backward, ExecutionPlan, Forward, FreeBuffer, LoadInput,
                           RecvActivationFinish, RecvActivationStart, RecvGradFinish,
                           RecvGradStart, SendActivationFinish, SendActivationStart,
                           SendGradFinish, SendGradStart)
from dynapipe_ext.batching.microbatch import MicroBatch

MAGIC = b"DPXPLAN\0"
FORMAT_VERSION = 2
MAX_PAYLOAD_BYTES = 1 << 30
_HEADER = struct.Struct("<8sHHIII")
_COUNTS = struct.Struct("<III")
_LENGTH = struct.Struct("<I")
_OPCODES = (LoadInput, Forward, Backward, FreeBuffer,
            SendActivationStart, SendActivationFinish, RecvActivationStart, RecvActivationFinish,
            SendGradStart, SendGradFinish, RecvGradStart, RecvGradFinish)
_OPCODE_OF = {t: i for i, t in enumerate(_OPCODES)}
_FIRST_TRANSFER = _OPCODE_OF[SendActivationStart]


class PlanFormatError(ValueError):
    """Bytes that are not a readable execution plan of this format version."""


# ---- encoding ----

class _Writer:
    def __init__(self):
        self.ints: list[int] = []
        self.floats: list[float] = []
        self.strings: dict[str, int] = {}

    def text(self, value: str) -> int:
        if not isinstance(value, str):
            raise TypeError(f"expected a string, got {value!r}")
        return self.strings.setdefault(value, len(self.strings))

    def payload(self) -> bytes:
        parts = [_COUNTS.pack(len(self.strings), len(self.floats), len(self.ints))]
        for text in self.strings:
            data = text.encode("utf-8")
            parts += [_LENGTH.pack(len(data)), data]
        parts.append(np.asarray(self.floats, dtype="<f8").tobytes())
        try:
            parts.append(np.asarray(self.ints, dtype="<i8").tobytes())
        except (OverflowError, TypeError, ValueError) as exc:
            raise ValueError(f"plan holds a value that is not a 64-bit integer: {exc}") from None
        return b"".join(parts)


def _put_plan(w: _Writer, plan: ExecutionPlan) -> None:
    put, text = w.ints.extend, w.text
    put((plan.iteration, plan.dp_rank, plan.pp_rank, plan.loss_tokens, len(plan.stage_to_rank)))
    put(plan.stage_to_rank)
    put((text(plan.schedule), text(plan.dtype), len(plan.micro_batches)))
    for mb in plan.micro_batches:
        put((len(mb.rows),))
        for row in mb.rows:
            put((len(row),))
            put(row)
        put((mb.seq_len, mb.dec_seq_len, text(mb.recompute), int(mb.memory_bytes)))
        w.floats.append(float(mb.time_ms))
    put((len(plan.instructions),))
    for ins in plan.instructions:
        code = _OPCODE_OF.get(type(ins))
        if code is None:
            raise TypeError(f"cannot serialise instruction type {type(ins).__name__}")
        if code >= _FIRST_TRANSFER:
            put((code, ins.mb, ins.stage, ins.peer, ins.buffer, text(ins.dtype), len(ins.shapes)))
            for shape in ins.shapes:
                put((len(shape),))
                put(shape)
        elif code == 0:
            put((code, ins.mb))
        elif code == 1:
            put((code, ins.mb, ins.stage, text(ins.recompute)))
        elif code == 2:
            put((code, ins.mb, ins.stage))
        else:
            put((code, ins.mb, ins.buffer))


def plan_to_bytes(plan: ExecutionPlan) -> bytes:
    """Serialise one rank's plan (micro-batches included)."""
    w = _Writer()
    _put_plan(w, plan)
    raw = w.payload()
    if len(raw) > MAX_PAYLOAD_BYTES:
        raise ValueError(f"plan payload of {len(raw)} bytes exceeds {MAX_PAYLOAD_BYTES}")
    body = zlib.compress(raw, 6)
    head = _HEADER.pack(MAGIC, FORMAT_VERSION, 0, len(raw), len(body), 0)[:-4]
    return head + struct.pack("<I", zlib.crc32(body, zlib.crc32(head))) + body


plans_to_bytes = plan_to_bytes   # name used in the design notes


# ---- decoding ----

def _payload(data: bytes) -> bytes:
    """Check the header and checksum; return the decompressed payload."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise PlanFormatError(f"expected bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) < _HEADER.size:
        raise PlanFormatError(f"{len(data)} bytes is shorter than the {_HEADER.size}-byte header")
    magic, version, flags, raw_len, comp_len, crc = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise PlanFormatError(f"not an execution plan: starts with {magic!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise PlanFormatError(f"plan format version {version}; this build reads version "
                              f"{FORMAT_VERSION}")
    if flags != 0:
        raise PlanFormatError(f"unknown header flags {flags:#x}")
    body = data[_HEADER.size:]
    if len(body) != comp_len:
        raise PlanFormatError(f"plan is {'truncated' if len(body) < comp_len else 'too long'}: "
                              f"header says {comp_len} payload bytes, got {len(body)}")
    if zlib.crc32(body, zlib.crc32(data[:_HEADER.size - 4])) != crc:
        raise PlanFormatError("checksum mismatch: the plan bytes are corrupt")
    if raw_len > MAX_PAYLOAD_BYTES:
        raise PlanFormatError(f"payload of {raw_len} bytes exceeds {MAX_PAYLOAD_BYTES}")
    try:
        inflater = zlib.decompressobj()
        raw = inflater.decompress(body, raw_len + 1)
    except zlib.error as exc:
        raise PlanFormatError(f"payload does not decompress: {exc}") from None
    if len(raw) != raw_len or not inflater.eof or inflater.unused_data:
        raise PlanFormatError(f"payload decompresses to {len(raw)} bytes, header says {raw_len}")
    return raw


def _sections(raw: bytes) -> tuple[list[str], list[float], list[int]]:
    """Split a payload into its string table, floats and integer stream."""
    if len(raw) < _COUNTS.size:
        raise PlanFormatError(f"payload of {len(raw)} bytes is shorter than its counts")
    n_str, n_float, n_int = _COUNTS.unpack_from(raw)
    pos, strings = _COUNTS.size, []
    for i in range(n_str):
        if pos + 4 > len(raw):
            raise PlanFormatError(f"payload ends inside string {i} of {n_str}")
        (n,) = _LENGTH.unpack_from(raw, pos)
        pos += 4
        if pos + n > len(raw):
            raise PlanFormatError(f"string {i} of {n} bytes runs past the payload end")
        try:
            strings.append(raw[pos:pos + n].decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise PlanFormatError(f"string {i} is not UTF-8: {exc}") from None
        pos += n
    if len(raw) != pos + 8 * (n_float + n_int):
        raise PlanFormatError(f"payload holds {len(raw) - pos} bytes after the strings; "
                              f"{n_float} floats and {n_int} integers need "
                              f"{8 * (n_float + n_int)}")
    floats = np.frombuffer(raw, dtype="<f8", count=n_float, offset=pos).tolist()
    ints = np.frombuffer(raw, dtype="<i8", count=n_int, offset=pos + 8 * n_float).tolist()
    return strings, floats, ints


def _get_plan(strings: list[str], floats: list[float], ints: list[int]) -> ExecutionPlan:
    nxt = iter(ints).__next__
    limit = len(ints)

    def count(what: str) -> int:
        n = nxt()
        if not 0 <= n <= limit:
            raise PlanFormatError(f"{what} count {n} is impossible for a plan of {limit} "
                                  f"integers")
        return n

    def text() -> str:
        i = nxt()
        if not 0 <= i < len(strings):
            raise PlanFormatError(f"string index {i} outside the table of {len(strings)}")
        return strings[i]

    iteration, dp_rank, pp_rank, loss_tokens = nxt(), nxt(), nxt(), nxt()
    stage_to_rank = tuple(nxt() for _ in range(count("stages")))
    schedule, dtype = text(), text()
    mbs = []
    for k in range(count("micro-batches")):
        rows = tuple(tuple(nxt() for _ in range(count("samples in row")))
                     for _ in range(count("rows")))
        seq_len, dec_seq_len, recompute, memory = nxt(), nxt(), text(), nxt()
        if k >= len(floats):
            raise PlanFormatError(f"micro-batch {k} has no time_ms among {len(floats)} floats")
        mbs.append(MicroBatch(rows, seq_len, dec_seq_len, recompute, floats[k], memory))
    if len(mbs) != len(floats):
        raise PlanFormatError(f"{len(floats)} floats for {len(mbs)} micro-batches")
    instructions = []
    add = instructions.append
    for _ in range(count("instructions")):
        code = nxt()
        if not 0 <= code < len(_OPCODES):
            raise PlanFormatError(f"unknown instruction opcode {code} (instruction "
                                  f"{len(instructions)})")
        if code >= _FIRST_TRANSFER:
            mb, stage, peer, buffer, dt = nxt(), nxt(), nxt(), nxt(), text()
            shapes = tuple(tuple(nxt() for _ in range(count("shape dims")))
                           for _ in range(count("shapes")))
            add(_OPCODES[code](mb, stage, peer, buffer, shapes, dt))
        elif code == 0:
            add(LoadInput(nxt()))
        elif code == 1:
            add(Forward(nxt(), nxt(), text()))
        elif code == 2:
            add(Backward(nxt(), nxt()))
        else:
            add(FreeBuffer(nxt(), nxt()))
    try:
        nxt()
    except StopIteration:
        return ExecutionPlan(iteration=iteration, dp_rank=dp_rank, pp_rank=pp_rank,
                             stage_to_rank=stage_to_rank, schedule=schedule,
                             micro_batches=tuple(mbs), instructions=tuple(instructions),
                             dtype=dtype, loss_tokens=loss_tokens)
    raise PlanFormatError("unexpected integers after the plan")


def plan_from_bytes(data: bytes) -> ExecutionPlan:
    """Read a plan written by plan_to_bytes; PlanFormatError for anything else."""
    raw = _payload(data)
    try:
        return _get_plan(*_sections(raw))
    except PlanFormatError:
        raise
    except StopIteration:
        raise PlanFormatError("plan payload ends early (integer stream too short)") from None
    except Exception as exc:   # any surprise in a payload that passed the checksum
        raise PlanFormatError(f"malformed plan payload: {type(exc).__name__}: {exc}") from None


__all__ = ["PlanFormatError", "plan_to_bytes", "plans_to_bytes", "plan_from_bytes",
           "FORMAT_VERSION", "MAGIC"]
