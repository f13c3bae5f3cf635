"""``pipetwin reproduce NAME``: reproduce a paper's tables and figures in simulation."""
from __future__ import annotations

from pathlib import Path

from .checks import output_dir
from .reproduce import TARGETS, run

NAME = "reproduce"
HELP = "reproduce a paper's results in simulation (CSV + PNG + markdown report)"


def add_arguments(p):
    p.add_argument("target", choices=list(TARGETS), help=f"one of: {', '.join(TARGETS)}")
    p.add_argument("--out", default="out/reproduce", type=output_dir, help="output folder (default out/reproduce)")
    p.add_argument("--quick", action="store_true", help="fewer configurations (used by the tests)")


def main(args) -> int:
    out = Path(args.out) / args.target
    report = run(args.target, out, quick=args.quick)
    print(report)
    print(f"\nwrote {out}/report.md and its CSV / PNG files")
    return 0
