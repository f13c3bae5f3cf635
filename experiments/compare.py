"""Schedules side by side: one job simulated under every schedule asked for (``pipetwin compare``,
``pipetwin demo``), and the table, traces and figure written from it."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from cost_models.bind import load_inputs
from cost_models.job import Job, Layout
from schedules import ScheduleError
from sim import simulate_job
from sim.job import crossed_links

from .common import human_rows, metrics_record, print_json, stated_lines, units_note, write_chrome, write_csv
from .tables import fmt_table, printable


@dataclass
class Comparison:
    """Per schedule that ran, its report (:func:`experiments.common.metrics_record`, with the
    largest peak activation and memory over the devices); the trace of each when asked; the
    schedules skipped, with why."""

    rows: list[dict]
    traces: dict = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)


def compare_schedules(job: Job, names: list, *, traces: bool = False) -> Comparison:
    """Simulate ``job`` under each schedule of ``names`` (its layout's other fields kept; an item
    that is a :class:`cost_models.job.Layout` replaces the layout: a schedule file's).
    Schedules whose requirements the layout does not meet, or with more stages than the model has
    layers, are listed as skipped; a slow link that no schedule crosses is refused, one that some
    do not cross is noted among the skipped."""
    inputs = load_inputs(job)
    limits = inputs.limits()
    job.layout.check_size(**limits)   # before building any schedule
    out = Comparison(rows=[])
    crossing: dict[str, list[str]] = {}
    for item in names:
        name = item.schedule if isinstance(item, Layout) else item
        try:
            one = replace(job, layout=item) if isinstance(item, Layout) else job.with_layout(schedule=name)
            stages = one.layout.num_stages()
            if limits.get("layers") is not None and stages > limits["layers"]:
                out.skipped[name] = (f"{name} has {stages} stages at D={one.layout.devices}; model "
                                     f"{limits['model_name']} has {limits['layers']} layers")
                continue
            bound, res = simulate_job(one, inputs=inputs, trace=traces, check_links=False)
        except ScheduleError as e:
            out.skipped[name] = str(e)
            continue
        used = crossed_links(bound) if job.faults.slow_links else set()
        for link, _ in job.faults.slow_links:
            if link not in used:
                crossing.setdefault(link, []).append(name)
        rec = metrics_record(res, **bound.report)
        per = rec["per_device"]
        rec["peak_activation_max"] = max(p["peak_activation"] for p in per)
        rec["peak_memory_max"] = max(p["peak_memory"] for p in per)
        out.rows.append(rec)
        if traces:
            out.traces[name] = res.trace()
    if not out.rows:
        raise ValueError("no schedule accepts these settings: " + "; ".join(out.skipped.values()))
    for link, missed in crossing.items():
        if len(missed) == len(out.rows):
            raise ValueError(f"--slow-link: no compared schedule crosses link {link!r}, so slowing it changes "
                             f"nothing")
        out.skipped[f"--slow-link {link}"] = f"not crossed by {', '.join(missed)} (no effect on them)"
    return out


def write_comparison(comp: Comparison, out: Path | None, plot: str | None, all_replicas: bool = False) -> None:
    """``out``: table.csv and one Chrome trace per schedule there; ``plot``: the stacked timelines
    (one data-parallel replica each unless ``all_replicas``)."""
    if out:
        out.mkdir(parents=True, exist_ok=True)
        import pandas as pd
        table = pd.DataFrame([{k: v for k, v in r.items() if k != "per_device"} for r in comp.rows])
        write_csv(table, out / "table.csv")
        for name, t in comp.traces.items():
            write_chrome(t, out / f"{name}.chrome.json")
    if plot:
        from .plots import plot_stacked
        plot_stacked(comp.traces, plot, all_replicas=all_replicas)


def report(comp, job, *, out: Path | None, plot: str | None, as_json: bool = False, all_replicas: bool = False) -> int:
    """Write the comparison's files and print its table (or one JSON object)."""
    rows, skipped = comp.rows, comp.skipped
    write_comparison(comp, out, plot, all_replicas)
    if as_json:
        print_json({"schedules": rows, "skipped": skipped})
        return 0
    lay = job.layout
    unit, mem = rows[0]["time_unit"], rows[0]["memory_unit"]
    shown_rows, shown = human_rows(rows, mem)
    tp = f"T={job.parallel.tp} " if job.parallel.tp > 1 else ""
    print(f"{tp}D={lay.devices} N={lay.microbatches} R={lay.replicas}  {units_note(unit, mem, shown)}")
    print("\n".join(stated_lines(rows[0])))        # every schedule's job assumes the same
    cols = ["schedule", "iteration_time", "bubble_ratio", "peak_activation_max", "peak_memory_max"]
    if any("out_of_memory" in r for r in rows):
        cols.append("out_of_memory")
    print(fmt_table(shown_rows, cols,
                    {"iteration_time": "{:.6g}", "bubble_ratio": "{:.4f}", "peak_activation_max": "{:.6g}",
                     "peak_memory_max": "{:.6g}"}))
    for r in rows:        # ZeRO-2/3: what each schedule's collectives cost (their bytes differ with N)
        if r.get("fsdp_collectives"):
            print(f"{r['schedule']}: {printable(r['fsdp_collectives'])}")
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    if plot:
        print(f"wrote figure: {printable(plot)}")
    if out:
        print(f"wrote table and Chrome traces under {printable(out)}/")
    return 0
