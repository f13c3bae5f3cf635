"""Helpers shared by the subcommands: schedule arguments, cost models, output."""
from __future__ import annotations

import json
import sys

from schedules import build, families, get, lower, names, validate
from schedules.trace import step_metrics

from .checks import check_run_size, positive_int
from .tables import byte_unit, fmt_bytes

SCHEDULE_DEFAULTS = {"chunks": 2, "dp": 1}
PLAN_OPTIONS = ("schedule", "devices", "microbatches", "chunks", "variant", "dp")   # what a --plan file brings


def add_schedule_args(p, *, schedule=True, many=False, plan: str | None = None):
    """-s/-D/-N/--chunks/--dp/--no-eager. With ``plan`` (the help text of a ``--plan PLAN.json``
    option) a plan file may bring the schedule and layout instead: those options then default to
    None and :func:`check_schedule_args` requires them, after parsing, when no plan is given."""
    required = plan is None
    if schedule:
        p.add_argument("--schedule", "-s", required=required, help=f"one of: {', '.join(names())}")
    if many:
        p.add_argument("--schedules", default="all", help="comma-separated schedule names, or 'all'")
    p.add_argument("--devices", "-D", type=positive_int, required=required, help="pipeline devices D")
    p.add_argument("--microbatches", "-N", type=positive_int, required=required, help="micro-batches N per iteration")
    p.add_argument("--chunks", "-v", type=positive_int, default=SCHEDULE_DEFAULTS["chunks"] if required else None,
                   help="chunks per device for interleaved schedules (default 2)")
    p.add_argument("--variant", default=None,
                   help="a schedule's variant (default: its first); " +
                        "; ".join(f"{n}: {', '.join(f.variants)}" for n, f in families().items() if f.variants))
    p.add_argument("--dp", type=positive_int, default=SCHEDULE_DEFAULTS["dp"] if required else None,
                   help="data-parallel replicas R of the whole pipeline (default 1)")
    p.add_argument("--no-eager", action="store_true", help="all-reduce gradients at the end, not in bubbles")
    if plan is not None:
        p.add_argument("--plan", metavar="PLAN.json", help=plan)


def check_schedule_args(args, also_fixed: tuple[str, ...] = ()) -> None:
    """For commands with ``--plan``: a plan and -s/-D/-N/--chunks/--dp (and the options named in
    ``also_fixed``) exclude each other; without a plan -s/-D/-N are required and --chunks/--dp take
    their defaults (set on ``args``)."""
    if getattr(args, "plan", None):
        given = [f"--{d.replace('_', '-')}" for d in PLAN_OPTIONS + also_fixed if getattr(args, d, None) is not None]
        if given:
            what = "the schedule, layout and model" if "model" in also_fixed else "the schedule and layout"
            raise ValueError(f"--plan fixes {what}; drop {', '.join(given)}")
        return
    missing = [f"--{d}" for d in ("schedule", "devices", "microbatches") if getattr(args, d, 0) is None]
    if missing:
        raise ValueError(f"give {', '.join(missing)} (or --plan PLAN.json)")
    for dest, value in SCHEDULE_DEFAULTS.items():
        if getattr(args, dest) is None:
            setattr(args, dest, value)


def parse_schedules(text: str) -> list[str]:
    """Schedule names from a comma-separated list (or 'all'); an unknown one is the registry's error."""
    if text == "all":
        return names()
    out = [t.strip() for t in text.split(",") if t.strip()]
    for n in out:
        get(n)
    return out


def schedule_kwargs(args) -> dict:
    """Family options from the command line (passed to every family's build)."""
    kw = {"chunks": args.chunks}
    if getattr(args, "variant", None) is not None:
        kw["variant"] = args.variant
    return kw


def check_size_args(args, **limits) -> None:
    """The cheap feasibility checks of :func:`experiments.checks.check_run_size` for -D/-N/--dp/--chunks
    (``limits``: cluster_devices, cluster_name, layers, model_name), before anything is built."""
    check_run_size(devices=args.devices, microbatches=args.microbatches, replicas=args.dp,
                   chunks=args.chunks or 1, one_replica=True, **limits)


def build_lowered(name: str, args, **limits):
    """Build, lower and validate a schedule from CLI arguments (raises ScheduleError, a ValueError)
    after the cheap checks (:func:`check_size_args` with ``limits``)."""
    check_size_args(args, **limits)
    sched = build(name, args.devices, args.microbatches, **schedule_kwargs(args))
    low = lower(sched, replicas=args.dp, eager=not args.no_eager)
    validate(low)
    return low


def metrics_record(result, **extra) -> dict:
    """The report of one simulation or run: ``result`` is a trace (DataFrame) or a :class:`sim.SimResult`
    (then ``simulated_replicas`` says how many replicas were simulated and, when not just one,
    ``full_simulation`` why)."""
    if hasattr(result, "metrics"):
        m, a = result.metrics(), result.attrs
    else:
        m, a = step_metrics(result), result.attrs
    rec = {"schedule": a.get("schedule"), "devices": a.get("devices"), "microbatches": a.get("microbatches"),
           "replicas": a.get("replicas", 1), "iteration_time": m.iteration_time, "bubble_ratio": m.bubble_ratio,
           "time_unit": a.get("time_unit"), "memory_unit": a.get("mem_unit")}
    rec.update(extra)
    if hasattr(result, "simulated_replicas"):
        rec["simulated_replicas"] = result.simulated_replicas
        if result.full_reason is not None:
            rec["full_simulation"] = result.full_reason
    cap = extra.get("memory_capacity")
    if cap:
        worst = max(m.per_device, key=lambda p: p.peak_memory)
        rec["out_of_memory"] = worst.peak_memory > cap
        rec["memory_verdict"] = (f"{'OUT OF MEMORY' if rec['out_of_memory'] else 'fits'}: peak "
                                 f"{fmt_bytes(worst.peak_memory)} on device {worst.device} "
                                 f"(static {fmt_bytes(worst.static_memory)} + activations "
                                 f"{fmt_bytes(worst.peak_activation)}) vs {fmt_bytes(cap)}")
    rec["per_device"] = [{"device": p.device, "busy": p.busy, "bubble_ratio": p.bubble_ratio,
                          "peak_activation": p.peak_activation, "peak_memory": p.peak_memory,
                          "static_memory": p.static_memory}
                         for p in m.per_device]
    return rec


def print_json(obj) -> None:
    json.dump(obj, sys.stdout, indent=2)
    sys.stdout.write("\n")


MEMORY_KEYS = ("peak_activation", "peak_memory", "static_memory", "peak_activation_max", "peak_memory_max")


def units_note(time_unit: str, mem_unit: str, shown: str = "GiB") -> str:
    """The units line under a table; ``shown``: the unit :func:`human_rows` picked for bytes."""
    if mem_unit == "Ma":
        return ("(time in F = one full-stage forward; activations in Ma; peak_memory adds weights+grads+optimizer "
                "in Mw, one full stage = 1)")
    return f"(time in {time_unit}, memory in {shown})"


def human_rows(rows: list[dict], mem_unit: str, keys=MEMORY_KEYS) -> tuple[list[dict], str]:
    """Rows for printing and the unit of their memory columns: bytes shown in the binary unit that
    fits the largest (KiB for a tiny model, GiB for a large one; :func:`experiments.tables.byte_unit`).
    The JSON output keeps bytes."""
    if mem_unit != "B":
        return rows, mem_unit
    unit, div = byte_unit([v for r in rows for k, v in r.items() if k in keys])
    return [{k: (v / div if k in keys and v is not None else v) for k, v in r.items()} for r in rows], unit
