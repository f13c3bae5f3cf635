"""``pipetwin bubbles``: bubble against N for every schedule, table + figure.

Unit costs by default (the closed forms); with ``--profile FILE`` (``pipetwin calibrate``, e.g. of a
model file ``--model PATH.py:FUNC``) every point is simulated with the measured costs, on this
machine or, with ``--cluster``, scaled onto that cluster (:func:`cost_models.bind.calibrated`).
"""
from __future__ import annotations

from schedules import names
from schedules.analysis import bubble_vs_n
from schedules.registry import MAX_OPS, estimated_ops

from cost_models.job import check_run_size

from .checks import figure_file, input_file, positive_int
from .common import parse_schedules, print_json
from .tables import fmt_table, printable

NAME = "bubbles"
HELP = "bubble time and ratio against the number of micro-batches N (unit costs), every schedule"


def add_arguments(p):
    p.add_argument("--devices", "-D", type=positive_int, default=8)
    p.add_argument("--max-k", type=positive_int, default=4, help="N = K*D for K = 1..max-k (default 4)")
    p.add_argument("--schedules", default="all")
    p.add_argument("--chunks", "-v", type=positive_int, default=None,
                   help="chunks per device for the schedules that take them (default 2)")
    p.add_argument("--plot", metavar="FILE.png", type=figure_file)
    p.add_argument("--json", action="store_true")
    p.add_argument("--profile", metavar="FILE.yaml", type=input_file,
                   help="simulate with a calibration profile's measured costs")
    p.add_argument("--cluster", "-c", default=None,
                   help="with --profile: scale the measured times onto this cluster preset (default: this machine)")
    p.add_argument("--partition", metavar="COUNTS|time", help="with --profile: layers per stage, or 'time'")


def check_table_size(D: int, max_k: int, num_schedules: int, chunks: int = 2) -> None:
    """The whole table at most :data:`schedules.registry.MAX_OPS` estimated ops (every point's
    build and run together, about 20 s of work), refused in one line naming ``--max-k`` otherwise."""
    if D < 1 or max_k < 1:
        raise ValueError("--devices and --max-k must be >= 1")
    check_run_size(devices=D, microbatches=max_k * D, chunks=chunks)

    def ops(k):
        return num_schedules * sum(estimated_ops(D, j * D, 1, chunks) for j in range(1, k + 1))
    if ops(max_k) > MAX_OPS:
        top = max([k for k in range(1, max_k) if ops(k) <= MAX_OPS], default=0)
        raise ValueError(f"--max-k {max_k}: {num_schedules} schedule(s) at N = D..{max_k}D (D={D}) build about "
                         f"{ops(max_k):,} ops, beyond the table's limit of {MAX_OPS:,} (schedules.registry.MAX_OPS); "
                         f"use --max-k <= {top} or fewer --schedules")


def _points(D: int, max_k: int, scheds: list[str]):
    """(schedule, N) of the table, with a progress bar on a terminal."""
    from .progress import bar
    pts = [(name, k * D) for name in scheds for k in range(1, max_k + 1)]
    return bar(pts, "bubbles", total=len(pts))


def table(D: int, max_k: int, scheds: list[str], chunks: int = 2):
    import pandas as pd
    check_table_size(D, max_k, len(scheds), chunks)
    return pd.concat([bubble_vs_n([name], D, [N], chunks=chunks) for name, N in _points(D, max_k, scheds)],
                     ignore_index=True)


def profile_table(D: int, max_k: int, scheds: list[str], profile: str, *, chunks: int = 2, cluster=None,
                  partition=None):
    """The table of :func:`table` with every point simulated from calibration profile ``profile``
    (a path; seconds), on its host or scaled onto ``cluster`` (a :class:`cost_models.job.ClusterChoice`):
    makespan = the iteration time, bubble = makespan - mean busy time; points a schedule refuses
    (or whose stages outnumber the model's layers) are NaN with the reason."""
    import pandas as pd

    from cost_models.bind import load_inputs
    from cost_models.job import ClusterChoice, Job, Layout
    from schedules import ScheduleError
    from schedules.trace import step_metrics
    from sim import simulate_job

    check_table_size(D, max_k, len(scheds), chunks)
    base = Job(layout=Layout(schedule=scheds[0], devices=D, microbatches=D, chunks=chunks), profile=profile,
               cluster=cluster or ClusterChoice(), partition=partition)
    inputs = load_inputs(base)
    rows = []
    for name, N in _points(D, max_k, scheds):
        row = {"schedule": name, "D": D, "N": N}
        try:
            _, res = simulate_job(base.with_layout(schedule=name, microbatches=N), inputs=inputs, trace=True)
        except (ScheduleError, ValueError) as e:
            rows.append({**row, "makespan": float("nan"), "mean_busy": float("nan"), "bubble": float("nan"),
                         "bubble_ratio": float("nan"), "error": str(e)})
            continue
        m = step_metrics(res.trace())
        busy = sum(p.busy for p in m.per_device) / len(m.per_device)
        rows.append({**row, "makespan": m.iteration_time, "mean_busy": busy, "bubble": m.iteration_time - busy,
                     "bubble_ratio": m.bubble_ratio, "error": ""})
    return pd.DataFrame(rows, columns=["schedule", "D", "N", "makespan", "mean_busy", "bubble", "bubble_ratio",
                                       "error"])


def plot(df, path, unit: str = "units of F") -> None:
    from .plots import plt, save_figure, series_style
    ok = df.dropna(subset=["bubble"])
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.4))
    for i, (name, g) in enumerate(ok.groupby("schedule", sort=False)):
        style = series_style(i)
        axes[0].plot(g.N, g.bubble_ratio, label=name, **style)
        axes[1].plot(g.N, g.bubble, label=name, **style)
    D = int(df.D.iloc[0])
    axes[0].set_ylabel("bubble ratio")
    axes[1].set_ylabel(f"bubble time ({unit})")
    for ax in axes:
        ax.set_xlabel(f"micro-batches N (D = {D})")
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    # outside the axes, right of the second panel: the key never covers a line
    axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0,
                   title="schedule (equal lines overlap:\nlook for both markers)", title_fontsize=7)
    fig.suptitle("Bubble against N under unit costs: Chimera's and BitPipe's bubble time grows with the number "
                 "of concatenated units; bitpipe-zb's stays flat" if unit == "units of F" else
                 f"Bubble against N, simulated with measured costs ({unit})", fontsize=9)
    save_figure(fig, path)


def main(args) -> int:
    from .jobs import SCHEDULE_DEFAULTS, check_chunks
    scheds = parse_schedules(args.schedules) if args.schedules != "all" else names()
    check_chunks(args.chunks, scheds)
    args.chunks = args.chunks or SCHEDULE_DEFAULTS["chunks"]
    if args.profile:
        from cost_models import load_profile
        from cost_models.job import ClusterChoice

        from .jobs import parse_partition
        prof = load_profile(args.profile)
        df = profile_table(args.devices, args.max_k, scheds, args.profile, chunks=args.chunks,
                           cluster=ClusterChoice(name=args.cluster), partition=parse_partition(args.partition))
        where = f"scaled onto {args.cluster}" if args.cluster else "this machine"
        head = f"D={args.devices}, simulated with profile {args.profile} ({prof.model_name}, {where}); time in s"
    else:
        if args.cluster or args.partition:
            raise ValueError("--cluster and --partition go with --profile (unit costs have neither)")
        df = table(args.devices, args.max_k, scheds, args.chunks)
        head = f"D={args.devices}, unit costs (F=1, B=2; split B=W=1)"
    if args.plot:
        plot(df, args.plot, "s" if args.profile else "units of F")
    if args.json:
        print_json(df.fillna({"error": ""}).to_dict(orient="records"))
        return 0
    rows = df.to_dict(orient="records")
    print(f"{head}; '-' = the schedule refuses that N")
    print(fmt_table(rows, ["schedule", "N", "makespan", "bubble", "bubble_ratio"],
                    {"makespan": "{:.4g}", "bubble": "{:.4g}", "bubble_ratio": "{:.4f}"}))
    if args.plot:
        print(f"wrote figure: {printable(args.plot)}")
    return 0
