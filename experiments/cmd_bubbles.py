"""``pipetwin bubbles``: bubble against N for every schedule (unit costs), table + figure."""
from __future__ import annotations

from pathlib import Path

from schedules import names
from schedules.analysis import bubble_vs_n

from .common import parse_schedules, print_json
from .tables import fmt_table

NAME = "bubbles"
HELP = "bubble time and ratio against the number of micro-batches N (unit costs), every schedule"


def add_arguments(p):
    p.add_argument("--devices", "-D", type=int, default=8)
    p.add_argument("--max-k", type=int, default=4, help="N = K*D for K = 1..max-k (default 4)")
    p.add_argument("--schedules", default="all")
    p.add_argument("--chunks", "-v", type=int, default=2)
    p.add_argument("--plot", metavar="FILE.png")
    p.add_argument("--json", action="store_true")


def table(D: int, max_k: int, scheds: list[str], chunks: int = 2):
    if D < 1 or max_k < 1:
        raise ValueError("--devices and --max-k must be >= 1")
    return bubble_vs_n(scheds, D, [k * D for k in range(1, max_k + 1)], chunks=chunks)


def plot(df, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ok = df.dropna(subset=["bubble"])
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for name, g in ok.groupby("schedule", sort=False):
        style = "-" if name in ("chimera", "bitpipe", "bitpipe-zb") else "--"
        axes[0].plot(g.N, g.bubble_ratio, "o" + style, label=name)
        axes[1].plot(g.N, g.bubble, "o" + style, label=name)
    D = int(df.D.iloc[0])
    axes[0].set_ylabel("bubble ratio")
    axes[1].set_ylabel("bubble time (units of F)")
    for ax in axes:
        ax.set_xlabel(f"micro-batches N (D = {D})")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7, ncol=2)
    fig.suptitle("Bubble against N under unit costs: Chimera's and BitPipe's bubble time grows with the number "
                 "of concatenated units; bitpipe-zb's stays flat", fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(args) -> int:
    df = table(args.devices, args.max_k, parse_schedules(args.schedules) if args.schedules != "all" else names(),
               args.chunks)
    if args.plot:
        plot(df, args.plot)
    if args.json:
        print_json(df.fillna({"error": ""}).to_dict(orient="records"))
        return 0
    rows = df.to_dict(orient="records")
    print(f"D={args.devices}, unit costs (F=1, B=2; split B=W=1); '-' = the schedule refuses that N")
    print(fmt_table(rows, ["schedule", "N", "makespan", "bubble", "bubble_ratio"],
                    {"makespan": "{:.4g}", "bubble": "{:.4g}", "bubble_ratio": "{:.4f}"}))
    if args.plot:
        print(f"wrote figure: {args.plot}")
    return 0
