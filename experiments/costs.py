"""Cost-model and simulator options shared by simulate / compare / demo."""
from __future__ import annotations

from cost_models import UnitCostModel
from sim import SimOptions


def add_cost_args(p):
    p.add_argument("--unit-costs", action="store_true",
                   help="closed-form unit costs: F=1, B=2 per full stage, no communication, memory in Ma")
    p.add_argument("--slowdown", action="append", default=[], metavar="RANK=FACTOR",
                   help="a straggler: compute on RANK takes FACTOR times longer (repeatable)")
    p.add_argument("--jitter", type=float, default=0.0, help="relative std-dev of per-op compute noise")
    p.add_argument("--seed", type=int, default=0, help="seed for --jitter")


def _pairs(items, what):
    out = {}
    for it in items:
        try:
            k, v = it.split("=")
            out[int(k)] = float(v)
        except ValueError:
            raise ValueError(f"{what} expects RANK=FACTOR, e.g. 3=1.5; got {it!r}") from None
    return out


def resolve_costs(args, low):
    """(StageCosts, network or None, extra report fields) for a lowered schedule."""
    return UnitCostModel().bind(low), None, {"cost_model": "unit"}


def sim_options(args, low) -> SimOptions:
    slow = _pairs(args.slowdown, "--slowdown")
    for r in slow:
        if not 0 <= r < low.num_ranks:
            raise ValueError(f"--slowdown names rank {r}, but the run has ranks 0..{low.num_ranks - 1}")
    if args.jitter < 0:
        raise ValueError("--jitter must be >= 0")
    return SimOptions(slowdown=slow, jitter=args.jitter, seed=args.seed)
