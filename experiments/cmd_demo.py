"""``pipetwin demo``: the main job on built-in defaults (what ``make demo`` runs)."""
from __future__ import annotations

from pathlib import Path

from cost_models.job import Job, Layout
from schedules import names

from .checks import output_dir, positive_int
from .common import write_csv
from .compare import compare_schedules, report

NAME = "demo"
HELP = ("compare every schedule at D=4, N=8 and write figure, Chrome traces and table under out/, plus the "
        "bubble-vs-N figure")


def add_arguments(p):
    p.add_argument("--out", default="out", type=output_dir, help="output folder (default: out)")
    p.add_argument("--devices", "-D", type=positive_int, default=4)
    p.add_argument("--microbatches", "-N", type=positive_int, default=8)


def main(args) -> int:
    every = names()
    job = Job(layout=Layout(schedule=every[0], devices=args.devices, microbatches=args.microbatches),
              unit_costs=True)
    out = Path(args.out)
    rc = report(compare_schedules(job, every, traces=True), job, out=out, plot=str(out / "compare.png"))
    from . import cmd_bubbles
    path = f"{args.out}/bubbles.png"
    df = cmd_bubbles.table(args.devices, 4, cmd_bubbles.names())
    cmd_bubbles.plot(df, path)
    write_csv(df, f"{args.out}/bubbles.csv")
    print(f"wrote bubble-vs-N figure: {path}")
    return rc
