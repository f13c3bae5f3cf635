"""``pipetwin compare``: every schedule side by side, one table and one stacked figure."""
from __future__ import annotations

from pathlib import Path

from schedules import ScheduleError
from schedules.trace import write_chrome

from .checks import output_dir, output_file
from .cmd_simulate import run_one
from .common import (add_schedule_args, check_size_args, human_rows, metrics_record, parse_schedules, print_json,
                     units_note)
from .costs import add_cost_args, cost_inputs
from .tables import fmt_table

NAME = "compare"
HELP = "compare schedules at the same D and N: table + stacked timelines"


def add_arguments(p):
    add_schedule_args(p, schedule=False, many=True)
    add_cost_args(p)
    p.add_argument("--json", action="store_true")
    p.add_argument("--plot", metavar="FILE.png", type=output_file, help="stacked timelines of all schedules")
    p.add_argument("--out", metavar="DIR", type=output_dir,
                   help="also write table.csv, one Chrome trace per schedule and the figure here")


def compare(args):
    """Simulate each schedule; schedules whose requirements the D/N do not meet are listed as skipped."""
    rows, traces, skipped, crossing = [], {}, {}, {}
    want = bool(args.plot or args.out)
    inputs = cost_inputs(args)
    check_size_args(args, **inputs.limits())   # before building any schedule
    for name in parse_schedules(args.schedules):
        crossed: list = []
        try:
            low, res, extra = run_one(name, args, inputs, crossed=crossed, trace=want)
        except ScheduleError as e:
            skipped[name] = str(e)
            continue
        for link, _ in args.slow_link:
            if link not in crossed[0]:
                crossing.setdefault(link, []).append(name)
        rec = metrics_record(res, **extra)
        per = rec["per_device"]
        rec["peak_activation_max"] = max(p["peak_activation"] for p in per)
        rec["peak_memory_max"] = max(p["peak_memory"] for p in per)
        rows.append(rec)
        if want:
            traces[name] = res.trace()
    if not rows:
        raise ValueError("no schedule accepts these settings: " + "; ".join(skipped.values()))
    for link, names in crossing.items():
        if len(names) == len(rows):
            raise ValueError(f"--slow-link: no compared schedule crosses link {link!r}, so slowing it changes "
                             f"nothing")
        skipped[f"--slow-link {link}"] = f"not crossed by {', '.join(names)} (no effect on them)"
    return rows, traces, skipped


def main(args) -> int:
    rows, traces, skipped = compare(args)
    out = Path(args.out) if args.out else None
    plot = args.plot or (str(out / "compare.png") if out else None)
    if out:
        out.mkdir(parents=True, exist_ok=True)
        import pandas as pd
        table = pd.DataFrame([{k: v for k, v in r.items() if k != "per_device"} for r in rows])
        table.to_csv(out / "table.csv", index=False)
        for name, t in traces.items():
            write_chrome(t, out / f"{name}.chrome.json")
    if plot:
        from .plots import plot_stacked
        plot_stacked(traces, plot)
    if args.json:
        print_json({"schedules": rows, "skipped": skipped})
        return 0
    unit, mem = rows[0]["time_unit"], rows[0]["memory_unit"]
    shown_rows, shown = human_rows(rows, mem)
    print(f"D={args.devices} N={args.microbatches} R={args.dp}  {units_note(unit, mem, shown)}")
    cols = ["schedule", "iteration_time", "bubble_ratio", "peak_activation_max", "peak_memory_max"]
    if any("out_of_memory" in r for r in rows):
        cols.append("out_of_memory")
    print(fmt_table(shown_rows, cols,
                    {"iteration_time": "{:.6g}", "bubble_ratio": "{:.4f}", "peak_activation_max": "{:.6g}",
                     "peak_memory_max": "{:.6g}"}))
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    if plot:
        print(f"wrote figure: {plot}")
    if out:
        print(f"wrote table and Chrome traces under {out}/")
    return 0
