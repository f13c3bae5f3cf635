"""Helpers shared by the subcommands: schedule arguments, cost models, output."""
from __future__ import annotations

import json
import sys

from schedules import build, families, lower, names, validate
from schedules.trace import step_metrics


def add_schedule_args(p, *, schedule=True, many=False):
    if schedule:
        p.add_argument("--schedule", "-s", required=True, help=f"one of: {', '.join(names())}")
    if many:
        p.add_argument("--schedules", default="all", help="comma-separated schedule names, or 'all'")
    p.add_argument("--devices", "-D", type=int, required=True, help="pipeline devices D")
    p.add_argument("--microbatches", "-N", type=int, required=True, help="micro-batches N per iteration")
    p.add_argument("--chunks", "-v", type=int, default=2, help="chunks per device for interleaved schedules")
    p.add_argument("--variant", default=None,
                   help="a schedule's variant (default: its first); " +
                        "; ".join(f"{n}: {', '.join(f.variants)}" for n, f in families().items() if f.variants))
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas R of the whole pipeline")
    p.add_argument("--no-eager", action="store_true", help="all-reduce gradients at the end, not in bubbles")


def parse_schedules(text: str) -> list[str]:
    if text == "all":
        return names()
    out = [t.strip() for t in text.split(",") if t.strip()]
    known = names()
    for n in out:
        if n not in known:
            raise ValueError(f"unknown schedule {n!r}; choose from {', '.join(known)}")
    return out


def schedule_kwargs(name: str, args) -> dict:
    kw = {"chunks": args.chunks}
    if getattr(args, "variant", None) is not None:
        kw["variant"] = args.variant
    return kw


def build_lowered(name: str, args):
    """Build, lower and validate a schedule from CLI arguments (raises ScheduleError, a ValueError)."""
    if args.dp < 1:
        raise ValueError(f"--dp must be >= 1; got {args.dp}")
    sched = build(name, args.devices, args.microbatches, **schedule_kwargs(name, args))
    low = lower(sched, replicas=args.dp, eager=not args.no_eager)
    validate(low)
    return low


def metrics_record(trace, **extra) -> dict:
    m = step_metrics(trace)
    a = trace.attrs
    rec = {"schedule": a.get("schedule"), "devices": a.get("devices"), "microbatches": a.get("microbatches"),
           "replicas": a.get("replicas", 1), "iteration_time": m.iteration_time, "bubble_ratio": m.bubble_ratio,
           "time_unit": a.get("time_unit"), "memory_unit": a.get("mem_unit")}
    rec.update(extra)
    cap = extra.get("memory_capacity")
    if cap:
        worst = max(m.per_device, key=lambda p: p.peak_memory)
        rec["out_of_memory"] = worst.peak_memory > cap
        rec["memory_verdict"] = (f"{'OUT OF MEMORY' if rec['out_of_memory'] else 'fits'}: peak "
                                 f"{worst.peak_memory / 2**30:.2f} GiB on device {worst.device} "
                                 f"(static {worst.static_memory / 2**30:.2f} + activations "
                                 f"{worst.peak_activation / 2**30:.2f}) vs {cap / 2**30:.0f} GiB")
    rec["per_device"] = [{"device": p.device, "busy": p.busy, "bubble_ratio": p.bubble_ratio,
                          "peak_activation": p.peak_activation, "peak_memory": p.peak_memory,
                          "static_memory": p.static_memory}
                         for p in m.per_device]
    return rec


def print_json(obj) -> None:
    json.dump(obj, sys.stdout, indent=2)
    sys.stdout.write("\n")


def fmt_table(rows: list[dict], cols: list[str], fmts: dict | None = None) -> str:
    fmts = fmts or {}
    def cell(r, c):
        v = r.get(c)
        if v is None or (isinstance(v, float) and v != v):
            return "-"
        return fmts.get(c, "{}").format(v)
    cells = [[cell(r, c) for c in cols] for r in rows]
    widths = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(cols)]
    line = "  ".join(c.ljust(w) for c, w in zip(cols, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(x.ljust(w) for x, w in zip(row, widths)) for row in cells]
    return "\n".join(out)


def units_note(time_unit: str, mem_unit: str) -> str:
    if mem_unit == "Ma":
        return ("(time in F = one full-stage forward; activations in Ma; peak_memory adds weights+grads+optimizer "
                "in Mw, one full stage = 1)")
    return f"(time in {time_unit}, memory in GiB)"


def human_rows(rows: list[dict], mem_unit: str, keys=("peak_activation", "peak_memory", "static_memory",
                                                      "peak_activation_max", "peak_memory_max")) -> list[dict]:
    """Rows for printing: bytes shown in GiB (the JSON output keeps bytes)."""
    if mem_unit != "B":
        return rows
    return [{k: (v / 2**30 if k in keys and v is not None else v) for k, v in r.items()} for r in rows]
