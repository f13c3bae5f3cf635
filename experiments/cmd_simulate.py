"""``pipetwin simulate``: simulate one iteration of a schedule and report its metrics."""
from __future__ import annotations

from sim import simulate_job

from .common import (STATED, check_all_replicas, human_rows, metrics_record, pools_line, print_json, stated_lines,
                     units_note, write_chrome, write_csv)
from .jobs import check_plan_args, job_from_args
from .options import add_options
from .tables import WIDTH, fmt_table, group_rows, printable, wrap_cell

NAME = "simulate"
HELP = "simulate one training iteration of a schedule"


def add_arguments(p):
    add_options(p, NAME)


def cp_line(rec: dict, unit: str) -> str:
    """The summary's line of context parallelism: the K/V exchange of a step on the busiest pipeline
    device, and what of it hides behind the attention compute (the rest adds to F and B)."""
    t, hidden = rec["cp_time"], rec["cp_hidden"]
    share = f" ({hidden / t:.0%})" if t else ""
    how = "a ring of P2P steps" if rec["cp_comm"] == "ring" else "all-gathers of K/V and reduce-scatters of dK/dV"
    return (f"context parallel: C={rec['cp']}, {how}: {t:.6g} {unit} per device in the step, {hidden:.6g} {unit}"
            f"{share} hidden behind the attention compute, {t - hidden:.6g} {unit} exposed")


def main(args) -> int:
    check_all_replicas(args, args.plot)
    job = job_from_args(args, plan=check_plan_args(args))
    want_trace = bool(args.plot or args.chrome_trace or args.trace)
    bound, res = simulate_job(job, trace=want_trace)
    extra = bound.report
    rec = metrics_record(res, **extra)
    trace = res.trace() if want_trace else None
    if args.plot:
        from .plots import plot_timeline
        plot_timeline(trace, args.plot, all_replicas=args.all_replicas)
    if args.chrome_trace:
        write_chrome(trace, args.chrome_trace)
    if args.trace:
        write_csv(trace, args.trace, "trace")
    if args.json:
        print_json(rec)
        return 0
    unit, mem = rec["time_unit"], rec["memory_unit"]
    tp = f"T={rec['tp']} " if rec.get("tp", 1) > 1 else ""
    tp += f"C={rec['cp']} " if rec.get("cp", 1) > 1 else ""
    print(f"{rec['schedule']}: {tp}D={rec['devices']} N={rec['microbatches']} R={rec['replicas']}  "
          f"iteration {rec['iteration_time']:.6g} {unit}  bubble {rec['bubble_ratio']:.4f}")
    print("\n".join(stated_lines(rec)))
    if rec["replicas"] > 1:
        k, R = rec["simulated_replicas"], rec["replicas"]
        print("  replicas: " + ("identical, one simulated for all" if k == 1 else
                                f"{'all' if k == R else f'{k} of'} {R} simulated ({rec.get('full_simulation')})"))
    for k, v in extra.items():
        if not isinstance(v, (dict, list)) and not k.startswith(("memory_", "cp_")) and v is not None \
                and k not in STATED:
            print(f"  {k}: {printable(v)}")
    if rec.get("pools"):
        lines = wrap_cell(pools_line(rec["pools"]), WIDTH - 4)
        print("\n".join(("  " if i == 0 else "    ") + ln for i, ln in enumerate(lines)))
    if "a2a_time" in rec:
        print(f"  all-to-all: {rec['a2a_time']:.6g} {unit} per device in the step, {rec['a2a_hidden']:.6g} {unit} "
              f"({rec['a2a_hidden'] / rec['a2a_time']:.0%}) hidden behind the other op's compute in overlapped F&B "
              f"pairs")
    if rec.get("cp", 1) > 1:
        lines = wrap_cell(cp_line(rec, unit), WIDTH - 4)
        print("\n".join(("  " if i == 0 else "    ") + ln for i, ln in enumerate(lines)))
    if "memory_verdict" in rec:
        lines = wrap_cell(f"memory: {rec['memory_verdict']}", WIDTH - 4)
        print("\n".join(("  " if i == 0 else "    ") + ln for i, ln in enumerate(lines)))
    cols = ["device", *(["pool"] if rec.get("pools") else []), "busy", "bubble_ratio", "peak_activation",
            "peak_memory"]
    fmts = {"busy": "{:.6g}", "bubble_ratio": "{:.4f}", "peak_activation": "{:.6g}", "peak_memory": "{:.6g}"}
    rows, shown = human_rows(rec["per_device"], mem)
    rows = group_rows(rows, "device", cols, fmts)      # identical replicas: one row each (--json keeps all)
    print(fmt_table(rows, cols + (["count"] if len(rows) < len(rec["per_device"]) else []), fmts))
    print(units_note(unit, mem, shown))
    for what, path in (("figure", args.plot), ("chrome trace", args.chrome_trace), ("trace", args.trace)):
        if path:
            print(f"wrote {what}: {printable(path)}")
    return 0
