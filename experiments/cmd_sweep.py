"""``pipetwin sweep``: simulate a grid of configurations on local workers or a Ray cluster.

Every point is ``pipetwin simulate --json`` of one job (a schedule, D, N, R, T, ZeRO stage,
recomputation and micro-batch over the options the grid does not vary); rows go to ``DIR/sweep.csv``
as they finish (points already there are skipped: rerun to resume; a folder of another experiment
is refused), the full records to ``DIR/sweep.jsonl``, figures to ``DIR/throughput.png`` and
``DIR/pareto.png``. See :mod:`experiments.sweep`.
"""
from __future__ import annotations

import sys

from .common import parse_schedules, stated_lines
from .jobs import job_from_args, layout_from_args
from .options import add_options
from .tables import fmt_table, printable

NAME = "sweep"
HELP = ("simulate a grid of schedules x devices x micro-batches x replicas x tensor-parallel sizes x ZeRO x recompute "
        "x micro-batch sizes")


def add_arguments(p):
    add_options(p, NAME)


def grid_of(args):
    """The sweep's (grid, base job): the axes come parsed and checked, as lists (the option table's
    list grammar); the base job is the grid's first point over the options the grid does not vary."""
    from .sweep import AXES, Grid
    axes = {axis: getattr(args, axis) for _, axis, _ in AXES[1:]}
    axes["micro_batch"] = axes["micro_batch"] or (None,)        # None: the model's own
    grid = Grid(schedules=tuple(parse_schedules(args.schedules)), **axes)
    first = {f: getattr(grid, axis)[0] for _, axis, f in AXES}
    layout_first = {k: first.pop(k) for k in ("schedule", "devices", "microbatches", "replicas")}
    base = job_from_args(args, layout=layout_from_args(args, schedules=grid.schedules, **layout_first), **first)
    return grid, base


def main(args) -> int:
    from .sweep import run_sweep
    if args.unit_costs and args.micro_batch is not None:
        raise ValueError("--micro-batch has no meaning with --unit-costs; drop one")
    if args.workers is not None and args.ray is not None:
        raise ValueError("--workers is for local processes; Ray places the points itself (drop one)")
    grid, base = grid_of(args)
    rows = run_sweep(grid, base, args.out, workers=args.workers, use_ray=args.ray is not None,
                     ray_address=args.ray, progress=not args.no_progress and sys.stderr.isatty(),
                     figures=not args.no_figures)
    ran = [r for r in rows if not r["error"]]
    print(f"sweep: {len(rows)} points ({len(ran)} ran, {len(rows) - len(ran)} impossible) -> "
          f"{printable(args.out)}/sweep.csv")
    from cost_models.bind import load_inputs, stated
    print("\n".join(stated_lines(stated(base, load_inputs(base)))))    # what every point assumes (sweep.json)
    short = {"devices": "D", "microbatches": "N", "dp": "R", "tp": "T"}
    show = [{**{short.get(k, k): v for k, v in r.items()},
             **{k: float(r[k]) for k in ("iteration_time", "throughput", "bubble_ratio")}}
            for r in sorted(ran, key=lambda r: -float(r["throughput"]))[:10]]
    if show:
        print("fastest points (throughput in samples per time unit; D x N x R x T: devices, micro-batches, data- and "
              "tensor-parallel sizes):")
        print(fmt_table(show, ["schedule", "D", "N", "R", "T", "zero", "recompute", "micro_batch", "iteration_time",
                               "throughput", "bubble_ratio", "out_of_memory"],
                        {"iteration_time": "{:.6g}", "throughput": "{:.6g}", "bubble_ratio": "{:.4f}"}))
    for r in rows:
        if r["error"]:
            b = f" b={r['micro_batch']}" if r["micro_batch"] else ""
            more = f" T={r['tp']} zero={r['zero']} recompute={r['recompute']}"
            print(f"impossible: {r['schedule']} D={r['devices']} N={r['microbatches']} R={r['dp']}{more}{b}: "
                  f"{r['error']}")
    if not ran:
        raise ValueError(f"none of the {len(rows)} points can run (each is listed above with its reason); "
                         "change the grid")
    if not args.no_figures:
        out = printable(args.out)
        print(f"wrote figures: {out}/throughput.png, {out}/pareto.png")
    return 0
