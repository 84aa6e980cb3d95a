"""What to do about a straggler each interval: nothing, ZERO-resize, or migrate (`--tp-balance`).

`semi` weighs four choices with a cost model over the horizon the current imbalance is expected
to last (as long as it has lasted so far, at least `min_horizon` iterations):
- even:    H * t(counts)
- resize:  H * (t(counts - drops) + accuracy_weight * dropped_share * t_even): skipped work is
           charged as lost training, `accuracy_weight` iterations per fraction of units skipped,
           t_even the step time of the even partition at full speed;
- migrate: transfer_s(moved units) + H * t(proportional counts), transfer_s from bytes per
           unit (weights, fp32 master, both Adam moments) over the measured link bandwidth;
- migrate+resize: the migration, then the straggler skips what it still lags by (the slot
           capacity clamps the migration, or whole units cannot split the work exactly),
           charged as resize is.
Migration needs a gain of `min_gain` of the step time (no moves for noise).
Every step time counts each rank's `offsets` too: its time outside the units being balanced
(norms, residuals, embedding, loss), which a rank slowed as a whole (another process on its
core) spends slower as well; the straggler then gets fewer units than its unit speed says.
Short or mild imbalance thus resizes; lasting or heavy imbalance migrates, and migrates back
once the ranks are even again and the cost of staying uneven outgrows the transfer."""
from __future__ import annotations

from dataclasses import dataclass

from dynapipe_ext.flextp.partition import MAX_SHARE, proportional_counts
from dynapipe_ext.flextp.resize import MAX_DROP_FRACTION, SKIP_ORDERS, drop_counts

MODES = ("off", "resize", "migrate", "semi")


@dataclass(frozen=True)
class Decision:
    action: str                 # "keep", "resize", "migrate" or "migrate+resize"
    counts: tuple[int, ...]     # units per rank after this decision
    drops: tuple[int, ...]      # units each rank skips this interval
    costs: dict                 # predicted seconds over the horizon, per action (semi only)


@dataclass
class BalanceCosts:
    unit_seconds: float          # one unit's compute per iteration at full speed
    bytes_per_unit: float        # what migrating one unit sends
    bandwidth: float             # bytes per second of the TP link
    latency: float = 1e-3        # seconds per migration round
    accuracy_weight: float = 1.0
    max_fraction: float = MAX_DROP_FRACTION   # resize bound
    min_horizon: int = 20        # iterations
    min_gain: float = 0.05       # migrate only for at least this share off the step time
    max_units: int | None = None  # slot capacity: the most units one rank may hold


def balance_flags() -> tuple[tuple[tuple[str, ...], dict], ...]:
    """The `--tp-balance` flags of pretrain_gpt.py, with the defaults of `BalanceCosts`:
    (names, add_argument keywords) each, declared here only."""
    d = BalanceCosts(unit_seconds=0.0, bytes_per_unit=0.0, bandwidth=1.0)
    return (
        (("--tp-balance",), dict(
            choices=MODES, default="off",
            help="balance tensor-parallel work when a TP rank is slower: resize (skip some of "
                 "its units, imputed), migrate (move units and their Adam state to faster "
                 "ranks), semi (a cost model picks per interval); off: even TP")),
        (("--tp-balance-max-share",), dict(
            type=float, default=MAX_SHARE,
            help="the largest share of a layer's heads (query groups) or MLP units one TP rank "
                 "may hold, over the even share: the slot layers allocate that much (weights, "
                 "gradients, Adam moments; the planner's memory model counts it) and a larger "
                 "imbalance is clamped to it")),
        (("--flextp-skip-order",), dict(
            choices=SKIP_ORDERS, default=SKIP_ORDERS[0],
            help="resize: which units a straggler skips at each decision: rotate (the "
                 "smallest-norm units among those computed in the last interval, so every "
                 "unit keeps getting gradients) or sticky (the smallest-norm units, the same "
                 "ones while the straggler lasts)")),
        (("--flextp-interval",), dict(type=int, default=10,
                                      help="iterations between balancing decisions")),
        (("--flextp-max-drop-fraction",), dict(
            type=float, default=d.max_fraction,
            help="resize bound: share of a rank's units it may skip")),
        (("--flextp-accuracy-weight",), dict(
            type=float, default=d.accuracy_weight,
            help="semi: iterations of cost charged per fraction of units skipped")),
        (("--flextp-min-horizon",), dict(
            type=int, default=d.min_horizon,
            help="semi: iterations an imbalance is assumed to last at least")),
    )


def parse_speeds(text: str | None, tp: int) -> tuple[float, ...] | None:
    """--flextp-initial-speeds "1,0.5": one positive relative speed per TP rank (None: none)."""
    if not text:
        return None
    try:
        speeds = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--flextp-initial-speeds {text!r}: expected comma-separated "
                         f"numbers, e.g. 1,0.5") from None
    if len(speeds) != tp or any(not s > 0 for s in speeds):
        raise ValueError(f"--flextp-initial-speeds {text!r}: need {tp} positive numbers, one "
                         f"per TP rank")
    return speeds


def step_time(counts, drops, speeds, unit_seconds: float, offsets=None) -> float:
    """The slowest rank's time: (units computed / speed + offset) x unit_seconds."""
    offsets = (0.0,) * len(counts) if offsets is None else offsets
    return max(((c - d) / s + o) * unit_seconds
               for c, d, s, o in zip(counts, drops, speeds, offsets))


def decide(mode: str, counts, speeds, lasted: int, costs: BalanceCosts,
           offsets=None) -> Decision:
    """The decision for one interval given the current units per rank, the relative speeds
    (fastest 1), how many iterations the current straggler set has lasted and each rank's
    time outside the units (`offsets`, in units of one unit's time at full speed; None: 0)."""
    if mode not in MODES:
        raise ValueError(f"--tp-balance: unknown mode {mode!r}, expected one of {MODES}")
    counts = tuple(counts)
    none = (0,) * len(counts)
    offsets = (0.0,) * len(counts) if offsets is None else tuple(offsets)
    keep = Decision("keep", counts, none, {})
    if mode == "off":
        return keep
    target = proportional_counts(sum(counts), speeds, max_units=costs.max_units,
                                 offsets=offsets)
    if (step_time(target, none, speeds, 1.0, offsets)
            > (1 - costs.min_gain) * step_time(counts, none, speeds, 1.0, offsets)):
        target = counts      # a unit or so of noise in the speeds: not worth a move
    drops = drop_counts(counts, speeds, costs.max_fraction, offsets)
    resize = Decision("resize", counts, drops, {}) if any(drops) else keep
    migrate = Decision("migrate", target, none, {}) if target != counts else keep
    if mode == "resize":
        return resize
    if mode == "migrate":
        return migrate
    after = drop_counts(target, speeds, costs.max_fraction, offsets) if target != counts else none
    both = Decision("migrate+resize", target, after, {}) if any(after) else migrate
    horizon = max(lasted, costs.min_horizon)
    t_even = sum(counts) / len(counts) * costs.unit_seconds
    moved = sum(max(0, c - t) for c, t in zip(counts, target))
    transfer = moved * costs.bytes_per_unit / costs.bandwidth + (costs.latency if moved else 0)

    def per_step(d: Decision) -> float:
        return (step_time(d.counts, d.drops, speeds, costs.unit_seconds, offsets)
                + costs.accuracy_weight * sum(d.drops) / sum(counts) * t_even)

    predicted = {"keep": horizon * per_step(keep), "resize": horizon * per_step(resize),
                 "migrate": transfer + horizon * per_step(migrate),
                 "migrate+resize": transfer + horizon * per_step(both)}
    choices = (("keep", keep), ("resize", resize), ("migrate", migrate),
               ("migrate+resize", both))
    best = min(choices, key=lambda kv: (predicted[kv[0]], kv[0] != "keep"))[1]
    return Decision(best.action, best.counts, best.drops, predicted)
