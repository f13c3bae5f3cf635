"""``pipetwin demo``: the main job on built-in defaults (what ``make demo`` runs)."""
from __future__ import annotations

import argparse

from . import cmd_compare
from .checks import output_dir, positive_int

NAME = "demo"
HELP = ("compare every schedule at D=4, N=8 and write figure, Chrome traces and table under out/, plus the "
        "bubble-vs-N figure")


def add_arguments(p):
    p.add_argument("--out", default="out", type=output_dir, help="output folder (default: out)")
    p.add_argument("--devices", "-D", type=positive_int, default=4)
    p.add_argument("--microbatches", "-N", type=positive_int, default=8)


def main(args) -> int:
    ns = argparse.Namespace(schedules="all", devices=args.devices, microbatches=args.microbatches, chunks=2, dp=1,
                            no_eager=False, unit_costs=True, slowdown=[], slow_link=[], jitter=0.0, seed=0, json=False,
                            model=None, cluster=None, profile=None, device_map="sequential", recompute="none",
                            micro_batch=None, exact=False,
                            plot=None, out=args.out)
    rc = cmd_compare.main(ns)
    from . import cmd_bubbles
    path = f"{args.out}/bubbles.png"
    df = cmd_bubbles.table(args.devices, 4, cmd_bubbles.names())
    cmd_bubbles.plot(df, path)
    df.to_csv(f"{args.out}/bubbles.csv", index=False)
    print(f"wrote bubble-vs-N figure: {path}")
    return rc
