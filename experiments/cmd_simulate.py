"""``pipetwin simulate``: simulate one iteration of a schedule and report its metrics."""
from __future__ import annotations

from schedules.trace import write_chrome
from sim import run

from .common import (
    add_schedule_args,
    build_lowered,
    check_schedule_args,
    check_writable,
    human_rows,
    metrics_record,
    print_json,
    units_note,
)
from .costs import add_cost_args, resolve_costs, sim_options
from .tables import fmt_table

NAME = "simulate"
HELP = "simulate one training iteration of a schedule"


def add_arguments(p):
    add_schedule_args(p, plan="simulate a plan written by 'pipetwin plan --out' (replaces -s/-D/-N/--chunks/"
                              "--dp/--model/--cluster/--micro-batch/--device-map)")
    add_cost_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", metavar="FILE.png", help="write the timeline figure")
    p.add_argument("--chrome-trace", metavar="FILE.json", help="write a Chrome/Perfetto trace")
    p.add_argument("--trace", metavar="FILE.csv", help="write the trace as CSV")


def run_one(name: str, args, trace: bool = True):
    """(lowered schedule, :class:`sim.SimResult`, extra report fields) of one simulation from the
    command line; the per-op trace is kept only with ``trace``."""
    if getattr(args, "plan", None):
        if args.unit_costs or args.profile:
            raise ValueError("--plan brings its own costs; drop --unit-costs / --profile")
        from .plan_files import simulation_from_plan
        low, costs, network, extra = simulation_from_plan(args.plan, eager=not args.no_eager)
        return low, run(low, costs, network, sim_options(args, low, network), trace=trace), extra
    low = build_lowered(name, args)
    costs, network, extra = resolve_costs(args, low)
    res = run(low, costs, network, sim_options(args, low, network, extra.get("host")), trace=trace)
    return low, res, extra


def main(args) -> int:
    check_schedule_args(args)
    for opt in ("plot", "chrome_trace", "trace"):
        if getattr(args, opt):
            check_writable(getattr(args, opt), "--" + opt.replace("_", "-"))
    want_trace = bool(args.plot or args.chrome_trace or args.trace)
    low, res, extra = run_one(args.schedule, args, trace=want_trace)
    rec = metrics_record(res, **extra)
    trace = res.trace() if want_trace else None
    if args.plot:
        from .plots import plot_timeline
        plot_timeline(trace, args.plot)
    if args.chrome_trace:
        write_chrome(trace, args.chrome_trace)
    if args.trace:
        trace.to_csv(args.trace, index=False)
    if args.json:
        print_json(rec)
        return 0
    unit, mem = rec["time_unit"], rec["memory_unit"]
    print(f"{rec['schedule']}: D={rec['devices']} N={rec['microbatches']} R={rec['replicas']}  "
          f"iteration {rec['iteration_time']:.6g} {unit}  bubble {rec['bubble_ratio']:.4f}")
    if rec["replicas"] > 1:
        print("  replicas: " + ("identical, one simulated for all" if rec["simulated_replicas"] == 1 else
                                f"all {rec['replicas']} simulated ({rec.get('full_simulation')})"))
    for k, v in extra.items():
        if not isinstance(v, (dict, list)) and k != "memory_capacity":
            print(f"  {k}: {v}")
    if "memory_verdict" in rec:
        print(f"  memory: {rec['memory_verdict']}")
    cols = ["device", "busy", "bubble_ratio", "peak_activation", "peak_memory"]
    print(fmt_table(human_rows(rec["per_device"], mem), cols,
                    {"busy": "{:.6g}", "bubble_ratio": "{:.4f}", "peak_activation": "{:.6g}",
                     "peak_memory": "{:.6g}"}))
    print(units_note(unit, mem))
    for what, path in (("figure", args.plot), ("chrome trace", args.chrome_trace), ("trace", args.trace)):
        if path:
            print(f"wrote {what}: {path}")
    return 0
