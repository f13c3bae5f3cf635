"""The runtime fitted through the simulator: traced executor runs, simulated with the profile,
costs moved until the simulated op totals equal the measured ones.

Inside a run ops cost more than the layers alone (ranks share memory bandwidth and caches) and
every op pays a fixed cost (Python dispatch, hooks, the runtime's bookkeeping), while ranks that
outnumber the cores also wait for one: the simulator models that part itself (processor
sharing). So the fit goes through the simulator (:func:`fit_runtime`), and the cost of
oversubscribed cores beyond ideal processor sharing gets a fit of its own
(:func:`fit_oversubscribed`).
"""
from __future__ import annotations

import os
import statistics
from typing import Callable

import numpy as np
from scipy.optimize import lsq_linear

from cost_models.calibration import CalibrationProfile
from executor.config import RunConfig, lowered_schedule
from executor.launch import run_best_of
from schedules.trace import median_step, step_metrics
from sim.host import simulate_with_profile

# the runs the runtime is fitted on: whole stages (1F1B), inner chunks (1F1B-interleaved) and a
# split backward (ZB-V): their op sizes differ, which tells a per-op cost from a scale
RUNTIME_SCHEDULES = ("dapple", "interleaved", "zb-v")
PROBE = 20   # host speed probe repeats in traced runs (executor.worker.speed_probe)
COMPUTE_KINDS = ("F", "B", "Bi", "W")


def fit_ranks(ranks: int) -> int:
    """Ranks of the runs the runtime is fitted on: no more than the host's cores (at least 2);
    when ``ranks`` is larger, the cost of oversubscribed cores is fitted on runs at ``ranks``."""
    return max(2, min(ranks, os.cpu_count() or 1))


def probe_seconds(runs: list) -> float:
    """The host speed the probe saw over ``runs`` (median of their medians)."""
    return float(statistics.median(r.extra["probe_seconds"] for r in runs))


def op_totals(trace, split: bool, warmup_steps: int) -> dict[str, list[float]]:
    """Per op kind: [total seconds, count] over the steps after the warm-up (B of a split
    backward is kind "Bi": it is the input-gradient half only)."""
    t = trace[trace["step"] >= warmup_steps]
    dur = (t["end"] - t["start"]).to_numpy()
    out: dict[str, list[float]] = {}
    for kind, d in zip(t["kind"], dur):
        k = "Bi" if (kind == "B" and split) else kind
        acc = out.setdefault(k, [0.0, 0])
        acc[0] += float(d)
        acc[1] += 1
    return out


def trace_runtime(model: str, ranks: int, steps: int = 12, repeats: int = 3, warmup_steps: int = 2,
                  micro_batch: int | None = None) -> list:
    """Traced executor runs the runtime is fitted on: :data:`RUNTIME_SCHEDULES` at D = ``ranks``,
    N = 2D, the best of ``repeats`` runs each (:func:`executor.launch.run_best_of`; validation
    compares with the best of its runs too: the model predicts the host undisturbed). Schedules
    with more stages than a model file has layers are left out (at least one must fit)."""
    cfgs, refused = [], []
    for s in RUNTIME_SCHEDULES:
        cfg = RunConfig(schedule=s, devices=ranks, microbatches=2 * ranks, steps=steps, model=model, probe=PROBE,
                        micro_batch=micro_batch)
        try:
            lowered_schedule(cfg)
        except ValueError as e:
            if not cfg.is_model_file:
                raise
            refused.append(str(e))
            continue
        cfgs.append(cfg)
    if not cfgs:
        raise ValueError(f"no runtime schedule fits model {model} at D = {ranks}: " + "; ".join(refused))
    return [res for res, _ in run_best_of(cfgs, repeats, warmup_steps)]


def scale_and_overhead(rows: dict[str, list[tuple[float, float, float]]]) -> tuple[dict[str, float], float]:
    """Least squares for ``measured = scale[kind] x simulated + overhead x ops`` over the rows
    ``{kind: [(measured, simulated, ops), ...]}``, with every scale >= 1e-3 and the one per-op
    overhead (shared by the kinds) >= 0 (``scipy.optimize.lsq_linear`` with bounds). Returns
    (scale per kind, overhead)."""
    kinds = sorted(rows)
    design, target = [], []
    for i, k in enumerate(kinds):
        for m, x, n in rows[k]:
            row = [0.0] * (len(kinds) + 1)
            row[i], row[-1] = x, n
            design.append(row)
            target.append(m)
    a, y = np.asarray(design), np.asarray(target)
    # columns differ by orders of magnitude (seconds vs op counts): scale them for the solver
    norm = np.linalg.norm(a, axis=0)
    norm[norm == 0] = 1.0
    lower = np.array([1e-3] * len(kinds) + [0.0]) * norm
    sol = lsq_linear(a / norm, y, bounds=(lower, np.full(len(kinds) + 1, np.inf))).x / norm
    return {k: float(v) for k, v in zip(kinds, sol)}, float(sol[-1])


def fit_runtime(runs: list, make_profile: Callable[[dict, dict], CalibrationProfile], *,
                warmup_steps: int = 2, iterations: int = 5) -> tuple[dict[str, float], dict[str, float]]:
    """Fit the runtime's costs so that the simulator reproduces the traced ``runs``.

    Simulate the runs with the current profile; per run and compute kind (F, B, split B "Bi", W)
    take the measured and simulated total time; fit measured = scale_kind x simulated + overhead
    x ops (:func:`scale_and_overhead`: one per-op overhead shared by the compute kinds; the runs
    differ in op size, 1F1B's stages against the chunks of 1F1B-interleaved and ZB-V, which tells
    the two apart); scale the optimizer step (OPTIM) by measured / simulated total and move
    SEND's per-op overhead by the mean residual; repeat. Totals, not medians: a run pays every
    op's time, the slow ones included. RECV keeps the 20th percentile of its measured durations
    (a receive whose message is already there).

    ``make_profile(scale, overhead)`` builds the profile to simulate with. Returns (scale, overhead).
    """
    scale = {k: 1.0 for k in (*COMPUTE_KINDS, "OPTIM")}
    recv = []
    for res in runs:
        t = res.trace[(res.trace["step"] >= warmup_steps) & (res.trace["kind"] == "RECV")]
        recv += (t["end"] - t["start"]).tolist()
    recv.sort()
    overhead = {"SEND": 0.0, "RECV": recv[int(0.2 * (len(recv) - 1))] if recv else 0.0, "F": 0.0, "B": 0.0, "W": 0.0}
    lows = [lowered_schedule(res.config) for res in runs]
    measured = [op_totals(res.trace, low.split_backward, warmup_steps) for res, low in zip(runs, lows)]

    def total(per_run, kind):
        return sum(t.get(kind, [0.0, 0])[0] for t in per_run), sum(t.get(kind, [0.0, 0])[1] for t in per_run)

    for _ in range(iterations):
        prof = make_profile(scale, overhead)
        simulated = [op_totals(simulate_with_profile(low, prof, steps=len(res.iteration_times)), low.split_backward,
                               warmup_steps) for res, low in zip(runs, lows)]
        c_old = overhead["F"]
        # (measured, scalable simulated part, ops) per run and compute kind
        rows = {k: [(m[k][0], s[k][0] - c_old * s[k][1], m[k][1]) for m, s in zip(measured, simulated)
                    if k in m and k in s and s[k][0] > 0] for k in COMPUTE_KINDS}
        rows = {k: v for k, v in rows.items() if v}
        alpha, c = scale_and_overhead(rows) if rows else ({}, c_old)
        for k, a in alpha.items():
            scale[k] *= a
        overhead.update(F=c, B=c, W=c)
        mo, so = total(measured, "OPTIM"), total(simulated, "OPTIM")
        if so[0] > 0:
            scale["OPTIM"] *= mo[0] / so[0]
        ms, ss = total(measured, "SEND"), total(simulated, "SEND")
        if ms[1]:
            overhead["SEND"] = max(0.0, overhead["SEND"] + (ms[0] - ss[0]) / ms[1])
    return scale, overhead


def fit_oversubscribed(runs: list, make_profile: Callable[[float], CalibrationProfile], *,
                       warmup_steps: int = 2, iterations: int = 6) -> float:
    """How much slower compute runs while the ranks outnumber the host's cores, beyond ideal
    processor sharing: on traced ``runs`` with more ranks than cores, the slowdown that makes the
    simulated median step times add up to the measured ones (fixed point). Measured on this
    machine: time slicing costs every op about the same, not only the ops that overlap (all
    ranks' threads, gloo's included, wake up and take slices; caches are refilled after each
    switch), so one factor on all compute, not a loss of capacity under overlap.
    ``make_profile(slowdown)`` builds the profile to simulate with. Returns a number in [1, 10]."""
    measured = sum(median_step(res.iteration_times, warmup_steps)[0] for res in runs)
    lows = [lowered_schedule(res.config) for res in runs]
    slowdown = 1.0
    for _ in range(iterations):
        prof = make_profile(slowdown)
        simulated = sum(median_step(step_metrics(simulate_with_profile(low, prof, len(res.iteration_times)))
                                    .iteration_times, warmup_steps)[0] for res, low in zip(runs, lows))
        slowdown = min(10.0, max(1.0, slowdown * measured / simulated))
    return slowdown


def scale_layer(t: dict, scale: dict[str, float]) -> dict:
    """One layer's times as it runs inside a training run: alone times the fitted scale."""
    return dict(t, f=t["f"] * scale.get("F", 1.0), b=t["b"] * scale.get("B", 1.0),
                b_input=t["b_input"] * scale.get("Bi", 1.0), w=t["w"] * scale.get("W", 1.0))
