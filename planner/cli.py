"""Command-line glue for other subcommands: ``pipetwin simulate --plan plan.json``.

``experiments/cmd_simulate.py`` carries these lines (see :func:`add_plan_option` and
:func:`built_from_args`)::

    # in add_arguments(p), after add_cost_args(p):
        from planner.cli import add_plan_option
        add_plan_option(p)
    # first lines of run_one(name, args):
        from planner.cli import built_from_args
        built = built_from_args(args)
        if built is not None:
            low, costs, network, extra = built
            return low, simulate(low, costs, network, sim_options(args, low, network)), extra

With ``--plan`` the schedule, D, N, --dp, model, cluster, micro-batch and device map come from the
plan file; --slowdown / --jitter / --seed and the output options still apply.
"""
from __future__ import annotations

SCHEDULE_DESTS = ("schedule", "devices", "microbatches")


def add_plan_option(p) -> None:
    """Add ``--plan FILE`` and make --schedule/--devices/--microbatches optional (required without it)."""
    p.add_argument("--plan", metavar="PLAN.json",
                   help="simulate a plan written by 'pipetwin plan --out' (replaces -s/-D/-N/--dp/--model/--cluster)")
    for a in p._actions:
        if a.dest in SCHEDULE_DESTS:
            a.required = False


def built_from_args(args):
    """``(lowered, costs, placed cluster, report fields)`` from ``args.plan``; None without --plan.
    Without --plan, a missing --schedule / --devices / --microbatches is a user error."""
    path = getattr(args, "plan", None)
    if not path:
        missing = [f"--{d}" for d in SCHEDULE_DESTS if getattr(args, d, 0) is None]
        if missing:
            raise ValueError(f"give {', '.join(missing)} (or --plan PLAN.json)")
        return None
    if getattr(args, "unit_costs", False) or getattr(args, "profile", None):
        raise ValueError("--plan brings its own costs; drop --unit-costs / --profile")
    from .planfile import load_plan
    lp = load_plan(path)
    bt = lp.build(eager=not getattr(args, "no_eager", False))
    extra = dict(bt.extra)
    extra["plan_file"] = str(path)
    return bt.lowered, bt.costs, bt.network, extra
