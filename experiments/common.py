"""Helpers shared by the subcommands: schedule lists and the report of a simulation or run."""
from __future__ import annotations

import json
import sys

from cost_models.files import output_file, write_output
from cost_models.memory import memory_verdict, usable_memory
from schedules import get, names
from schedules.trace import step_metrics, to_chrome

from .tables import WIDTH, byte_unit, printable, wrap_cell

def parse_schedules(text: str) -> list[str]:
    """Schedule names from a comma-separated list (or 'all'); an unknown one is the registry's error."""
    if text == "all":
        return names()
    out = [t.strip() for t in text.split(",") if t.strip()]
    if not out:
        raise ValueError(f"--schedules {text!r} names no schedule; give comma-separated names or 'all' "
                         f"(one of: {', '.join(names())})")
    for n in out:
        get(n)
    return out


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
    caps = extra.get("memory_capacity_by_rank")       # a mixed cluster: each rank's own device
    if caps and all(caps):
        def verdict(p):
            return memory_verdict(p.static_memory, p.peak_activation, caps[p.device],
                                  transient=extra.get("memory_transient") or 0.0, reserve=extra.get("memory_reserve"),
                                  where=f"device {p.device}")
        worst = max(m.per_device, key=lambda p: (p.peak_memory + (extra.get("memory_transient") or 0.0))
                    / usable_memory(caps[p.device], extra.get("memory_reserve")))
        v = verdict(worst)
        rec["out_of_memory"] = not v.fits
        rec["near_memory_limit"] = v.near
        rec["memory_verdict"] = v.text
    elif cap:
        worst = max(m.per_device, key=lambda p: p.peak_memory)
        v = memory_verdict(worst.static_memory, worst.peak_activation, cap,
                           transient=extra.get("memory_transient") or 0.0, reserve=extra.get("memory_reserve"),
                           where=f"device {worst.device}")
        rec["out_of_memory"] = not v.fits
        rec["near_memory_limit"] = v.near
        rec["memory_verdict"] = v.text
    rec["per_device"] = [{"device": p.device, "busy": p.busy, "bubble_ratio": p.bubble_ratio,
                          "peak_activation": p.peak_activation, "peak_memory": p.peak_memory,
                          "static_memory": p.static_memory}
                         for p in m.per_device]
    if extra.get("pools"):
        rec["pools"] = pool_metrics(extra["pools"], m, extra.get("gpus", 0) // max(1, len(m.per_device)))
        pool_of = {r: p["name"] for p in extra["pools"] for r in p["ranks"]}
        for row in rec["per_device"]:
            row["pool"] = pool_of.get(row["device"])
    a2a, hidden = getattr(result, "a2a_time", None), getattr(result, "a2a_hidden", None)
    if a2a and any(a2a):      # phased costs (--overlap-fb): the expert all-to-alls of a step, and what hid
        rec["a2a_time"], rec["a2a_hidden"] = sum(a2a) / len(a2a), sum(hidden) / len(hidden)
        for row, t, h in zip(rec["per_device"], a2a, hidden):
            row.update(a2a_time=t, a2a_hidden=h)
    return rec


def pool_metrics(pools: list[dict], m, gpus_per_rank: int) -> list[dict]:
    """Per pool of a mixed cluster (``pools``: the report's name, device, gpus, ranks): the GPUs the run
    uses there, their mean busy share of the iteration (busy compute time / iteration time, a rank's T
    GPUs run in lockstep) and its bubble (1 - that share: the schedule's bubble ratio over that pool's
    devices alone)."""
    busy = {p.device: p.busy for p in m.per_device}
    out = []
    for pool in pools:
        ranks = [r for r in pool["ranks"] if r in busy]
        share = sum(busy[r] for r in ranks) / len(ranks) / m.iteration_time if ranks and m.iteration_time else None
        out.append({"name": pool["name"], "device": pool["device"], "gpus": pool["gpus"],
                    "gpus_used": len(pool["ranks"]) * max(1, gpus_per_rank), "ranks": len(pool["ranks"]),
                    "busy": share, "bubble_ratio": None if share is None else 1 - share})
    return out


def pools_line(pools: list[dict]) -> str:
    """``pools: a100 x16 busy 71.2% bubble 28.8% | h100 x16 ...`` (x the GPUs the run uses in the pool)."""
    def one(p):
        if p["busy"] is None:
            return f"{p['name']} x0 of {p['gpus']} (unused)"
        of = f" of {p['gpus']}" if p["gpus_used"] != p["gpus"] else ""
        return f"{p['name']} x{p['gpus_used']}{of} busy {p['busy']:.1%} bubble {p['bubble_ratio']:.1%}"
    return "pools: " + " | ".join(one(p) for p in pools)


# the report fields that state what the numbers assume (cost_models.bind.stated), printed by stated_lines
STATED = ("cost_model", "seq_len", "precision", "device_fitted", "assumptions")


def stated_lines(rec: dict, indent: str = "  ") -> list[str]:
    """The lines under a summary that state what its numbers assume (``rec``: a report with the
    fields of :func:`cost_models.bind.stated`): ``assumed:`` the sequence, the precision and the
    cost model; where the device's constants come from; one ``note:`` per approximation. Each
    wrapped within :data:`~experiments.tables.WIDTH` columns (continuations indented twice)."""
    parts = [f"sequence {rec['seq_len']:,} tokens" if rec.get("seq_len") else None,
             f"precision {rec['precision']}" if rec.get("precision") else None,
             f"cost model {rec['cost_model']}" if rec.get("cost_model") else None]
    said = [f"assumed: {', '.join(p for p in parts if p)}"] if any(parts) else []
    if rec.get("device_fitted"):
        said.append(f"device {rec['device_fitted']}")
    said += [f"note: {a}" for a in rec.get("assumptions") or ()]
    out = []
    for text in said:
        lines = wrap_cell(printable(text), WIDTH - 2 * len(indent))
        out += [indent + lines[0]] + [2 * indent + ln for ln in lines[1:]]
    return out


def check_all_replicas(args, plot) -> None:
    """``--all-replicas`` chooses what a timeline draws: refused without one (``plot``: the figure's path)."""
    if getattr(args, "all_replicas", False) and not plot:
        raise ValueError("--all-replicas chooses the rows of the --plot timeline; give --plot FILE.png (or drop it)")


def write_csv(frame, path, what: str = "CSV file") -> None:
    """A DataFrame as CSV, written atomically (:func:`cost_models.files.output_file`)."""
    with output_file(path, what, newline="") as fh:
        frame.to_csv(fh, index=False)


def write_chrome(trace, path) -> None:
    """A trace as a Chrome/Perfetto trace (JSON), written atomically."""
    write_output(path, json.dumps(to_chrome(trace)), "Chrome trace")


def print_json(obj) -> None:
    from .jobs import import_notes
    notes = import_notes()      # --from-megatron / --from-torchtitan: what the file gave that is not modelled
    if notes is not None and isinstance(obj, dict):
        obj = {**obj, "imported": notes}
    json.dump(obj, sys.stdout, indent=2)
    sys.stdout.write("\n")


MEMORY_KEYS = ("peak_activation", "peak_memory", "static_memory", "peak_activation_max", "peak_memory_max")


def units_note(time_unit: str, mem_unit: str, shown: str = "GiB") -> str:
    """The units line under a table; ``shown``: the unit :func:`human_rows` picked for bytes."""
    if mem_unit == "Ma" and time_unit != "F":
        return f"(time in {time_unit}; activations in Ma = one full stage's per micro-batch)"
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
