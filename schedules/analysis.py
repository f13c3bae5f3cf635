"""Unit-cost analysis of schedules: makespan, bubble, bubble-vs-N tables, activation peaks.

Everything here times the compute programs with :func:`schedules.timing.time_programs` under
the unit cost model of DESIGN.md (F of a full stage = 1, B = 2, or B = W = 1 when split; a
device holding v chunks of a copy runs F/v per chunk) and no communication cost.

- ``bubble = makespan - mean busy``, ``bubble_ratio = 1 - mean busy / makespan`` (DESIGN.md).
- Activation peaks count, per device, the chunk-activations alive between a chunk's F start
  and its B end ("F..B"), those whose W is still pending ("pending W", the W-retained part),
  and both together ("F..W"), in units of Ma (one full stage's activations for one
  micro-batch; a chunk of L/S layers holds D/S Ma).
"""
from __future__ import annotations

from typing import Iterable, Sequence

import pandas as pd

from .ir import B, F, Schedule, ScheduleError, W, activation_change
from .timing import compute_deps, key, time_programs, unit_duration


def unit_times(sched: Schedule) -> dict:
    """``{(kind, copy, stage, mb): (device, start, end)}`` under unit costs."""
    return time_programs(sched.programs, sched.num_stages,
                         unit_duration(sched.num_devices, sched.num_stages, sched.split_backward))


def unit_summary(sched: Schedule) -> dict:
    """Makespan, per-device busy time, bubble and bubble ratio under unit costs."""
    t = unit_times(sched)
    busy = [0.0] * sched.num_devices
    first = [float("inf")] * sched.num_devices
    last = [0.0] * sched.num_devices
    for d, s, e in t.values():
        busy[d] += e - s
        first[d] = min(first[d], s)
        last[d] = max(last[d], e)
    makespan = max(last)
    mean_busy = sum(busy) / len(busy)
    return {"makespan": makespan, "busy": busy, "mean_busy": mean_busy,
            "bubble": makespan - mean_busy, "bubble_ratio": 1 - mean_busy / makespan,
            # the zero-bubble papers' metric: idle time inside each device's own first..last op
            "span_bubble": [last[d] - first[d] - busy[d] for d in range(sched.num_devices)]}


def bubble_vs_n(names: Iterable[str], D: int, Ns: Sequence[int], **kw) -> pd.DataFrame:
    """Unit-cost bubble of each named schedule on D devices for each N.

    One row per (schedule, N): ``schedule, D, N, makespan, mean_busy, bubble, bubble_ratio,
    error``. Combinations a family refuses (e.g. N not a multiple of D) get NaN numbers and the
    family's message in ``error`` (empty otherwise), so ``df.dropna()`` keeps the plottable rows.
    ``kw`` is passed to every family's build (e.g. ``chunks=2``).
    """
    from .registry import build  # late import: registry imports every family

    rows = []
    for name in names:
        for N in Ns:
            row = {"schedule": name, "D": D, "N": N}
            try:
                s = unit_summary(build(name, D, N, **kw))
            except ScheduleError as e:
                row.update(makespan=float("nan"), mean_busy=float("nan"), bubble=float("nan"),
                           bubble_ratio=float("nan"), error=str(e))
            else:
                row.update(makespan=s["makespan"], mean_busy=s["mean_busy"], bubble=s["bubble"],
                           bubble_ratio=s["bubble_ratio"], error="")
            rows.append(row)
    return pd.DataFrame(rows, columns=["schedule", "D", "N", "makespan", "mean_busy", "bubble",
                                       "bubble_ratio", "error"])


def activation_peaks(sched: Schedule) -> pd.DataFrame:
    """Per device: peak F..B, pending-W and F..W activations in chunks and in Ma (unit timing;
    memory is freed at an op's end before an op starting at the same instant allocates).

    Each count is the one activation rule (:func:`schedules.ir.activation_change`) with a chunk
    keeping ``act`` from F to B and ``act_w`` from B to W: F..B counts (act, act_w) = (1, 0),
    pending W (0, 1) and F..W (1, 1)."""
    t = unit_times(sched)
    split = sched.split_backward
    ma = sched.num_devices / sched.num_stages
    counts = {"fb": (1.0, 0.0), "pw": (0.0, 1.0 if split else 0.0), "fw": (1.0, 1.0 if split else 0.0)}
    rows = []
    for d in range(sched.num_devices):
        peak = {}
        for name, (act, act_w) in counts.items():
            ev = []
            for (kind, _c, _s, _m), (dev, start, end) in t.items():
                if dev == d:
                    alloc, free = activation_change(kind, act, act_w, split)
                    ev += [(start, alloc), (end, -free)]
            ev.sort()
            level = best = 0.0
            for _, delta in ev:
                level += delta
                best = max(best, level)
            peak[name] = int(round(best))
        rows.append({"device": d, "fb_chunks": peak["fb"], "pending_w_chunks": peak["pw"], "fw_chunks": peak["fw"],
                     "fb_ma": peak["fb"] * ma, "fw_ma": peak["fw"] * ma})
    return pd.DataFrame(rows)


def fused_overlap_timing(sched: Schedule, f: float, b: float, w: float, fb: float) -> dict:
    """Time a schedule whose ``meta["overlapped"]`` pairs run as one fused op of length ``fb``
    (DualPipe's F&B), every other op taking ``f`` / ``b`` / ``w`` (per chunk; ``b`` is the
    input-gradient part, a full backward is its B and W back to back). A fused pair's outputs
    exist only at its end. Returns makespan and per-device idle time (makespan - busy).
    """
    pairs = {tuple(a): tuple(bb) for a, bb in sched.meta.get("overlapped", ())}
    cost = {F: f, B: b, W: w}
    S = sched.num_stages
    progs = []
    for d, prog in enumerate(sched.compute_programs()):
        items, i = [], 0
        while i < len(prog):
            op = prog[i]
            k = (op.kind, op.stage, op.mb)
            if k in pairs:
                grp = [prog[i], prog[i + 1]]
                if (grp[1].kind, grp[1].stage, grp[1].mb) != pairs[k]:
                    raise ScheduleError(f"device {d}: overlapped pair {k} is not followed by {pairs[k]}")
                j = i + 2
                if j < len(prog) and prog[j].kind == W and (prog[j].stage, prog[j].mb) == (grp[1].stage, grp[1].mb):
                    grp.append(prog[j])
                    j += 1
                items.append((grp, fb))
                i = j
            else:
                items.append(([op], cost[op.kind]))
                i += 1
        progs.append(items)
    done: dict = {}
    pos = [0] * len(progs)
    clock = [0.0] * len(progs)
    busy = [0.0] * len(progs)
    remaining = sum(len(p) for p in progs)
    while remaining:
        progressed = False
        for d, items in enumerate(progs):
            while pos[d] < len(items):
                grp, dur = items[pos[d]]
                inner = {key(o) for o in grp}
                deps = [x for o in grp for x in compute_deps(o.kind, o.copy, o.stage, o.mb, S) if x not in inner]
                if any(x not in done for x in deps):
                    break
                start = max([clock[d]] + [done[x] for x in deps])
                for o in grp:
                    done[key(o)] = start + dur
                clock[d] = start + dur
                busy[d] += dur
                pos[d] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ScheduleError("fused-overlap timing deadlocks")
    makespan = max(clock)
    return {"makespan": makespan, "idle": [makespan - x for x in busy]}
