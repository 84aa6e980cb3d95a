"""FlexTP's shared switches and helpers: the tensor-parallel all-reduce bookkeeping `COMM` the
slot layers (megatron/flextp/stage_layers.py, the only FlexTP layers) report to, the synthetic
straggler `FLEXTP_SLOWDOWN=RANK:FACTOR` (TP rank RANK redoes its slot GEMMs so they take FACTOR
times as long; the extra rounds are discarded: a reproducible straggler whose slowness follows its
share of work), the modelled clock `FLEXTP_CLOCK=modelled`, and the check of a skip set."""
from __future__ import annotations

import os

# a list under "shapes" (tests) collects each slot row linear's (input rows, all-reduced shape)
COMM = {"shapes": None}


def slowdown_factor(tp_rank: int, env: str | None = None) -> int:
    """FACTOR from FLEXTP_SLOWDOWN=RANK:FACTOR when RANK is this TP rank, else 1."""
    spec = os.environ.get("FLEXTP_SLOWDOWN", "") if env is None else env
    if not spec:
        return 1
    try:
        rank, factor = (int(x) for x in spec.split(":"))
    except ValueError:
        raise ValueError(f"FLEXTP_SLOWDOWN={spec!r}: expected RANK:FACTOR, e.g. 1:2") from None
    if factor < 1:
        raise ValueError(f"FLEXTP_SLOWDOWN={spec!r}: FACTOR must be >= 1")
    return factor if rank == tp_rank else 1


# FLEXTP_CLOCK=modelled: FlexTP's timings are modelled instead of measured (see modelled_clock)
CLOCK_ENV = "FLEXTP_CLOCK"
MODELLED_SECONDS_PER_MAC = 1e-9     # a rank of factor 1 computes 1 GMAC/s
MODELLED_BANDWIDTH = 1e9            # bytes/s of the TP link


def modelled_clock(env: str | None = None) -> bool:
    """True under FLEXTP_CLOCK=modelled: a rank's TP compute then takes work (MACs) x
    MODELLED_SECONDS_PER_MAC x its FLEXTP_SLOWDOWN factor, and the TP link moves
    MODELLED_BANDWIDTH, instead of what the machine measures; the slow-down switch then redoes
    no GEMM. The straggler detector and the policies see the same figures on any machine
    however loaded, which is what tests of them need. Default (unset or 'measured'): measured."""
    value = (os.environ.get(CLOCK_ENV, "") if env is None else env).strip().lower()
    if value not in ("", "measured", "modelled"):
        raise ValueError(f"{CLOCK_ENV}={value!r}: expected 'measured' or 'modelled'")
    return value == "modelled"


def modelled_seconds(macs: float, slowdown: int) -> float:
    """Seconds a rank of slow-down `slowdown` takes for `macs` multiply-adds (modelled clock)."""
    return macs * slowdown * MODELLED_SECONDS_PER_MAC


def checked_drops(units, mine, rank: int) -> tuple:
    """`units` as a sorted drop set, if all are this rank's and at least one unit stays."""
    bad = sorted(set(units) - set(mine))
    if bad:
        raise ValueError(f"set_drops: units {bad} are not on rank {rank} ({mine})")
    if len(set(units)) >= len(mine):
        raise ValueError(f"set_drops: rank {rank} must keep at least one unit")
    return tuple(sorted(set(units)))
