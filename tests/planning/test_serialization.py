"""Plan serialisation: exact round trips; corrupt, truncated, foreign or other-version bytes
raise PlanFormatError and nothing else."""
import pickle
import random
import struct
import zlib

import pytest
from hypothesis import given, settings, strategies as st

from dynapipe_ext.plan.instructions import ExecutionPlan, Forward
from dynapipe_ext.plan.lowering import lower
from dynapipe_ext.plan.serialization import (FORMAT_VERSION, MAGIC, PlanFormatError, plan_from_bytes,
                                        plan_to_bytes, plans_to_bytes)
from dynapipe_ext.schedule.schedule_ir import wave_layout
from tests.planning.test_lowering import gpt_spec, micro_batches, one_f_one_b, random_schedule, t5_spec


def t5_plans(num_ranks=3, num_mbs=5, seed=0):
    rng = random.Random(seed)
    return lower(one_f_one_b(num_ranks, num_mbs), micro_batches(num_mbs, rng, t5=True),
                 t5_spec(num_ranks), dtype="bfloat16", iteration=12, dp_rank=1)


def test_round_trip_is_exact_for_every_rank():
    for plan in t5_plans():
        again = plan_from_bytes(plan_to_bytes(plan))
        assert again == plan
        assert again.micro_batches == plan.micro_batches
        assert plans_to_bytes(plan) == plan_to_bytes(plan)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), num_ranks=st.integers(1, 4), num_mbs=st.integers(1, 8),
       t5=st.booleans())
def test_round_trip_of_random_plans(seed, num_ranks, num_mbs, t5):
    rng = random.Random(seed)
    layout = wave_layout(num_ranks, 1)
    spec = (t5_spec if t5 else gpt_spec)(len(layout))
    plans = lower(random_schedule(layout, num_mbs, rng), micro_batches(num_mbs, rng, t5=t5), spec)
    for plan in plans:
        assert plan_from_bytes(plan_to_bytes(plan)) == plan


def test_odd_values_round_trip():
    plan = t5_plans()[1]
    plan = ExecutionPlan(iteration=2**40, dp_rank=0, pp_rank=1, stage_to_rank=plan.stage_to_rank,
                         schedule="adaptive[cost-asc,+2,BFA] ✓", micro_batches=plan.micro_batches,
                         instructions=plan.instructions + (Forward(mb=-1, stage=-7),),
                         dtype="float32", loss_tokens=2**33 + 5)
    assert plan_from_bytes(plan_to_bytes(plan)) == plan
    assert plan_from_bytes(plan_to_bytes(plan)).loss_tokens == 2**33 + 5


def test_encoding_is_compact():
    plan = lower(one_f_one_b(8, 64), micro_batches(64, random.Random(1)), gpt_spec(8))[3]
    data = plan_to_bytes(plan)
    assert len(data) < 8 * len(plan.instructions)
    assert len(data) < len(pickle.dumps(plan)) / 4


def test_foreign_bytes_are_rejected_without_unpickling():
    plan = t5_plans()[0]
    with pytest.raises(PlanFormatError, match="not an execution plan"):
        plan_from_bytes(pickle.dumps(plan))
    with pytest.raises(PlanFormatError, match="shorter than the 24-byte header"):
        plan_from_bytes(b"")
    with pytest.raises(PlanFormatError, match="expected bytes"):
        plan_from_bytes("a string")


def test_other_format_version_is_named():
    data = bytearray(plan_to_bytes(t5_plans()[0]))
    struct.pack_into("<H", data, len(MAGIC), FORMAT_VERSION + 1)
    with pytest.raises(PlanFormatError, match=f"version {FORMAT_VERSION + 1}.*reads version "
                                              f"{FORMAT_VERSION}"):
        plan_from_bytes(bytes(data))


def test_truncated_and_extended_bytes_are_rejected():
    data = plan_to_bytes(t5_plans()[0])
    with pytest.raises(PlanFormatError, match="truncated"):
        plan_from_bytes(data[:-1])
    with pytest.raises(PlanFormatError, match="too long"):
        plan_from_bytes(data + b"\0")
    for cut in range(0, len(data), max(1, len(data) // 50)):
        with pytest.raises(PlanFormatError):
            plan_from_bytes(data[:cut])


def rebuilt(payload: bytes) -> bytes:
    """Valid header + checksum around an arbitrary payload (to reach the payload parser)."""
    body = zlib.compress(payload)
    head = struct.pack("<8sHHII", MAGIC, FORMAT_VERSION, 0, len(payload), len(body))
    return head + struct.pack("<I", zlib.crc32(body, zlib.crc32(head))) + body


def payload_of(ints, strings=(), floats=()):
    """A payload in the plan's layout (counts, string table, floats, int64 stream)."""
    out = struct.pack("<III", len(strings), len(floats), len(ints))
    for text in strings:
        out += struct.pack("<I", len(text.encode())) + text.encode()
    return out + struct.pack(f"<{len(floats)}d", *floats) + struct.pack(f"<{len(ints)}q", *ints)


def test_payload_garbage_behind_a_valid_checksum_is_rejected():
    plan = t5_plans()[0]
    raw = zlib.decompress(plan_to_bytes(plan)[24:])
    assert plan_from_bytes(rebuilt(raw)) == plan
    with pytest.raises(PlanFormatError, match="bytes after the strings"):
        plan_from_bytes(rebuilt(raw + b"\0"))
    n_str, n_float, n_int = struct.unpack_from("<III", raw)
    longer = struct.pack("<III", n_str, n_float, n_int + 1) + raw[12:] + struct.pack("<q", 0)
    with pytest.raises(PlanFormatError, match="unexpected integers after the plan"):
        plan_from_bytes(rebuilt(longer))
    shorter = struct.pack("<III", n_str, n_float, n_int - 1) + raw[12:-8]
    with pytest.raises(PlanFormatError):
        plan_from_bytes(rebuilt(shorter))
    with pytest.raises(PlanFormatError, match="stages count 1000000000 is impossible"):
        plan_from_bytes(rebuilt(payload_of([0, 0, 0, 0, 10**9])))
    with pytest.raises(PlanFormatError, match="string index 5 outside the table of 1"):
        plan_from_bytes(rebuilt(payload_of([0, 0, 0, 0, 1, 0, 5, 0], strings=["1f1b"])))
    with pytest.raises(PlanFormatError, match="unknown instruction opcode 99"):
        plan_from_bytes(rebuilt(payload_of([0, 0, 0, 0, 0, 0, 0, 0, 1, 99], strings=["x"])))
    with pytest.raises(PlanFormatError, match="not UTF-8"):
        plan_from_bytes(rebuilt(struct.pack("<IIII", 1, 0, 0, 1) + b"\xff"))


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_random_byte_flips_raise_plan_format_error_only(data):
    blob = bytearray(plan_to_bytes(t5_plans(2, 3)[0]))
    positions = data.draw(st.sets(st.integers(0, len(blob) - 1), min_size=1, max_size=4))
    for pos in positions:
        blob[pos] ^= data.draw(st.integers(1, 255))
    with pytest.raises(PlanFormatError):
        plan_from_bytes(bytes(blob))


@settings(max_examples=200, deadline=None)
@given(payload=st.one_of(st.binary(max_size=200),
                         st.lists(st.integers(-3, 40), max_size=60).map(
                             lambda ints: payload_of(ints, strings=["a", "float32"]))))
def test_random_payloads_behind_a_valid_checksum_never_crash(payload):
    try:
        plan = plan_from_bytes(rebuilt(payload))
    except PlanFormatError:
        return
    assert isinstance(plan, ExecutionPlan)
