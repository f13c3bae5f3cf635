"""``pipetwin bubbles``: bubble against N for every schedule (unit costs), table + figure."""
from __future__ import annotations

from schedules import names
from schedules.analysis import bubble_vs_n

from .checks import check_run_size, output_file, positive_int
from .common import parse_schedules, print_json
from .tables import fmt_table

NAME = "bubbles"
HELP = "bubble time and ratio against the number of micro-batches N (unit costs), every schedule"


def add_arguments(p):
    p.add_argument("--devices", "-D", type=positive_int, default=8)
    p.add_argument("--max-k", type=positive_int, default=4, help="N = K*D for K = 1..max-k (default 4)")
    p.add_argument("--schedules", default="all")
    p.add_argument("--chunks", "-v", type=positive_int, default=2)
    p.add_argument("--plot", metavar="FILE.png", type=output_file)
    p.add_argument("--json", action="store_true")


def table(D: int, max_k: int, scheds: list[str], chunks: int = 2):
    if D < 1 or max_k < 1:
        raise ValueError("--devices and --max-k must be >= 1")
    check_run_size(devices=D, microbatches=max_k * D, chunks=chunks)
    return bubble_vs_n(scheds, D, [k * D for k in range(1, max_k + 1)], chunks=chunks)


def plot(df, path) -> None:
    from .plots import _save, plt, series_style
    ok = df.dropna(subset=["bubble"])
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.4))
    for i, (name, g) in enumerate(ok.groupby("schedule", sort=False)):
        style = series_style(i)
        axes[0].plot(g.N, g.bubble_ratio, label=name, **style)
        axes[1].plot(g.N, g.bubble, label=name, **style)
    D = int(df.D.iloc[0])
    axes[0].set_ylabel("bubble ratio")
    axes[1].set_ylabel("bubble time (units of F)")
    for ax in axes:
        ax.set_xlabel(f"micro-batches N (D = {D})")
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    # outside the axes, right of the second panel: the key never covers a line
    axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0,
                   title="schedule (equal lines overlap:\nlook for both markers)", title_fontsize=7)
    fig.suptitle("Bubble against N under unit costs: Chimera's and BitPipe's bubble time grows with the number "
                 "of concatenated units; bitpipe-zb's stays flat", fontsize=9)
    fig.tight_layout()
    _save(fig, path)


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
