"""``pipetwin simulate``: simulate one iteration of a schedule and report its metrics."""
from __future__ import annotations

from cost_models.comm import links_used
from schedules.trace import write_chrome
from sim import run

from schedules.registry import MAX_OPS

from .checks import output_file
from .common import (add_schedule_args, build_lowered, check_schedule_args, human_rows, metrics_record, print_json,
                     units_note)
from .costs import add_cost_args, bind_costs, cost_inputs, sim_options
from .tables import fmt_table

NAME = "simulate"
HELP = "simulate one training iteration of a schedule"


def add_arguments(p):
    add_schedule_args(p, plan="simulate a plan written by 'pipetwin plan --out' (replaces -s/-D/-N/--chunks/"
                              "--dp/--model/--cluster/--micro-batch/--device-map)")
    add_cost_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", metavar="FILE.png", type=output_file, help="write the timeline figure")
    p.add_argument("--chrome-trace", metavar="FILE.json", type=output_file, help="write a Chrome/Perfetto trace")
    p.add_argument("--trace", metavar="FILE.csv", type=output_file, help="write the trace as CSV")


def run_one(name: str, args, inputs=None, *, crossed: list | None = None, trace: bool = True):
    """Simulate schedule ``name`` as the options say: ``(lowered, sim.SimResult, report fields)``, the
    per-op trace kept only with ``trace``. ``inputs``: the loaded cost options
    (:func:`experiments.costs.cost_inputs`; loaded here when None). With ``crossed`` (a list) the
    ``--slow-link`` links are not required to be crossed; the set of links this run crosses is
    appended to it instead."""
    check_links = crossed is None
    if getattr(args, "plan", None):
        given = [f for f, v in (("--unit-costs", args.unit_costs), ("--profile", args.profile),
                                ("--model", args.model), ("--cluster", args.cluster),
                                ("--micro-batch", args.micro_batch),
                                ("--partition", getattr(args, "partition", None))) if v]
        if given:
            raise ValueError(f"--plan brings its own model, cluster and costs; drop {', '.join(given)}")
        from .plan_files import simulation_from_plan
        low, costs, network, extra = simulation_from_plan(args.plan, eager=not args.no_eager)
        opts = sim_options(args, low, network, check_links=check_links)
        _note_links(crossed, low, network)
        return low, run(low, costs, network, opts, trace=trace, max_ops=MAX_OPS), extra
    inputs = inputs or cost_inputs(args)
    low = build_lowered(name, args, **inputs.limits())
    costs, network, extra = bind_costs(args, inputs, low)
    opts = sim_options(args, low, network, extra.get("host"), check_links=check_links)
    _note_links(crossed, low, network)
    return low, run(low, costs, network, opts, trace=trace, max_ops=MAX_OPS), extra


def _note_links(crossed, low, network) -> None:
    if crossed is not None:
        crossed.append(links_used(low, network) if network is not None and hasattr(network, "links") else set())


def main(args) -> int:
    check_schedule_args(args)
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
        k, R = rec["simulated_replicas"], rec["replicas"]
        print("  replicas: " + ("identical, one simulated for all" if k == 1 else
                                f"{'all' if k == R else f'{k} of'} {R} simulated ({rec.get('full_simulation')})"))
    for k, v in extra.items():
        if not isinstance(v, (dict, list)) and k != "memory_capacity":
            print(f"  {k}: {v}")
    if "memory_verdict" in rec:
        print(f"  memory: {rec['memory_verdict']}")
    cols = ["device", "busy", "bubble_ratio", "peak_activation", "peak_memory"]
    rows, shown = human_rows(rec["per_device"], mem)
    print(fmt_table(rows, cols, {"busy": "{:.6g}", "bubble_ratio": "{:.4f}", "peak_activation": "{:.6g}",
                                 "peak_memory": "{:.6g}"}))
    print(units_note(unit, mem, shown))
    for what, path in (("figure", args.plot), ("chrome trace", args.chrome_trace), ("trace", args.trace)):
        if path:
            print(f"wrote {what}: {path}")
    return 0
