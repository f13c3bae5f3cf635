"""``pipetwin compare``: every schedule side by side, one table and one stacked figure."""
from __future__ import annotations

from pathlib import Path

from .common import check_all_replicas, parse_schedules
from .compare import compare_schedules, report
from .jobs import file_layout, job_from_args, layout_from_args, schedule_file_arg
from .options import add_options

NAME = "compare"
HELP = "compare schedules at the same D and N: table + stacked timelines"


def add_arguments(p):
    add_options(p, NAME)


def main(args) -> int:
    names = parse_schedules(args.schedules)
    check_all_replicas(args, args.plot or args.out)
    job = job_from_args(args, layout=layout_from_args(args, schedule=names[0], schedules=names))
    sf = schedule_file_arg(args)
    if sf is not None:      # one more schedule beside the named ones, at their D and N (checked)
        names = [*names, file_layout(args, sf, chunks=False)]
        if not args.json:
            print(f"schedule file {sf.describe()}")
    out = Path(args.out) if args.out else None
    plot = args.plot or (str(out / "compare.png") if out else None)
    comp = compare_schedules(job, names, traces=bool(plot or out))
    return report(comp, job, out=out, plot=plot, as_json=args.json, all_replicas=args.all_replicas)
