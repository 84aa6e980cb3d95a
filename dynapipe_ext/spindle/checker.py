"""Wave-plan checker: proves a Spindle (or baseline) WavePlan well formed before it runs.

Checks, each failure a PlanError naming the wave, MetaOp and what is wrong:
* every MetaOp of the plan runs exactly once, on 1..samples distinct devices in range;
* dependencies: every input of a MetaOp was produced in an earlier wave;
* device exclusivity: within a wave, MetaOps sharing a device never overlap in time;
* memory: the per-device bytes the plan records fit the device memory.
"""
from __future__ import annotations

from dynapipe_ext.plan.plan_checker import PlanError
from .scheduler import WavePlan

_EPS = 1e-12


def check_wave_plan(plan: WavePlan) -> None:
    """Raise PlanError unless `plan` satisfies every check in the module docstring."""
    by_id = {m.id: m for m in plan.metaops}
    if len(by_id) != len(plan.metaops):
        raise PlanError("MetaOp ids are not unique")
    wave_of: dict[int, int] = {}
    for w, wave in enumerate(plan.waves):
        if not wave.placed:
            raise PlanError(f"wave {w}: empty")
        for p in wave.placed:
            where = f"wave {w}, MetaOp {p.op}"
            if p.op not in by_id:
                raise PlanError(f"{where}: not a MetaOp of the plan")
            if p.op in wave_of:
                raise PlanError(f"{where}: already ran in wave {wave_of[p.op]}")
            wave_of[p.op] = w
            _check_devices(plan, by_id[p.op], p.devices, where)
            if p.start_s < 0 or p.compute_s <= 0 or p.handover_s < 0:
                raise PlanError(f"{where}: negative or zero times {p}")
    missing = sorted(set(by_id) - set(wave_of))
    if missing:
        raise PlanError(f"MetaOps {missing} never run")
    for op, w in wave_of.items():
        for pred in by_id[op].preds:
            if wave_of[pred] >= w:
                raise PlanError(f"wave {w}, MetaOp {op} ({by_id[op].name}): input MetaOp "
                                f"{pred} runs in wave {wave_of[pred]}, not before")
    for w, wave in enumerate(plan.waves):
        _check_exclusive(w, wave.placed)
    _check_memory(plan)


def _check_devices(plan: WavePlan, m, devices, where: str) -> None:
    if not devices:
        raise PlanError(f"{where}: no devices")
    if len(set(devices)) != len(devices):
        raise PlanError(f"{where}: a device is listed twice in {devices}")
    bad = [d for d in devices if not 0 <= d < plan.num_devices]
    if bad:
        raise PlanError(f"{where}: devices {bad} outside 0..{plan.num_devices - 1}")
    if len(devices) > m.samples:
        raise PlanError(f"{where}: {len(devices)} devices for {m.samples} samples")


def _check_exclusive(w: int, placed) -> None:
    busy: dict[int, list] = {}
    for p in placed:
        for d in p.devices:
            busy.setdefault(d, []).append(p)
    for d, items in busy.items():
        items = sorted(items, key=lambda p: p.start_s)
        for a, b in zip(items, items[1:]):
            if b.start_s < a.end_s - _EPS:
                raise PlanError(f"wave {w}, device {d}: MetaOps {a.op} and {b.op} overlap "
                                f"({a.start_s:.6g}-{a.end_s:.6g} s and {b.start_s:.6g} s on)")


def _check_memory(plan: WavePlan) -> None:
    if len(plan.device_memory) != plan.num_devices:
        raise PlanError(f"plan records memory for {len(plan.device_memory)} devices, has "
                        f"{plan.num_devices}")
    for d, used in enumerate(plan.device_memory):
        if used > plan.memory_bytes:
            raise PlanError(f"device {d}: needs {used / 2**30:.2f} GiB, has "
                            f"{plan.memory_bytes / 2**30:.2f} GiB")
