"""The fits of calibration: the lone communication measurements as link costs, and the runtime
fitted through the simulator (traced executor runs, simulated with the profile, costs moved until
the simulated op totals equal the measured ones).

The lone measurements (:func:`calibration.measure.measure_comm`: ping-pong P2P times and
all-reduce times over message sizes) are fitted as latency + bytes / bandwidth
(:func:`fit_latency_bandwidth`) and as a ring (:func:`fit_allreduce`); the profile keeps the
results (:mod:`cost_models.profile` is its format).

Inside a run ops cost more than the layers alone (ranks share memory bandwidth and caches) and
every op pays a fixed cost (Python dispatch, hooks, the runtime's bookkeeping), while ranks that
outnumber the cores also wait for one: the simulator models that part itself (processor sharing
while every rank has a core; time slices beyond, :mod:`sim.slicing`). So the fit goes through
the simulator (:func:`fit_runtime`, then :func:`fit_communication`), on runs with as many ranks
as the runs to predict when those outnumber the cores, where the OS's time slice is chosen too
(:func:`fit_time_slice`).

The traced runs are a sitting (:func:`calibration.sitting.run_series`): interleaved rounds, runs
disturbed by other processes left out, and the statistic validation uses: the noise-free step
time, the fits reproducing the fast steps around it
(:meth:`calibration.sitting.RunSeries.typical_steps`), not the mean of all steps.
"""
from __future__ import annotations

import math
import os
from typing import Callable, Sequence

import numpy as np
from scipy.optimize import least_squares, lsq_linear

from cost_models import SpecError
from cost_models.profile import CalibrationProfile
from cost_models.job import Job, Layout
from cost_models.parallel import Parallel
from executor.config import RunConfig, lowered_schedule
from schedules.ir import ALLREDUCE
from schedules.trace import noise_free, step_metrics

from .simulate import simulate_with_profile
from .sitting import RunSeries

# the runs the runtime is fitted on: whole stages (1F1B), inner chunks (1F1B-interleaved) and a
# split backward on chunks (ZB-V) and on whole stages (ZB-H1): their op sizes differ, which tells
# a per-op cost from a scale; BitPipe's two model copies all-reduce their gradients in the bubbles,
# which tells the in-run all-reduce. ZB-H1 is there for the whole-stage schedules: with chunks in
# all runs but 1F1B's, the fit leaves them (GPipe, ZB-H1, Chimera) 5-11% short
RUNTIME_SCHEDULES = ("dapple", "interleaved", "zb-v", "zb-h1", "bitpipe")
PROBE = 20   # host speed probe repeats in traced runs (executor.worker.speed_probe)
COMPUTE_KINDS = ("F", "B", "Bi", "W")


def fit_latency_bandwidth(sizes, times, relative: bool = False) -> tuple[float, float]:
    """Least-squares fit of ``time = latency + bytes / bandwidth``; returns (latency s, bandwidth B/s).
    ``relative``: of the relative residuals (each time weighs by 1 / time^2), so that the small
    messages' latency counts as much as the large ones' bytes.

    The latency is clamped at 0 (a negative intercept is noise); raises SpecError when the times
    do not grow with the size (no bandwidth can be fitted)."""
    xs, ys = [float(x) for x in sizes], [float(y) for y in times]
    if len(xs) != len(ys) or len(set(xs)) < 2:
        raise SpecError("need timings at two or more message sizes to fit latency and bandwidth")
    if relative and min(ys) <= 0:
        raise SpecError("a relative fit needs times > 0")
    w = [1.0 / (y * y) if relative else 1.0 for y in ys]
    total = sum(w)
    mx, my = sum(a * x for a, x in zip(w, xs)) / total, sum(a * y for a, y in zip(w, ys)) / total
    sxx = sum(a * (x - mx) ** 2 for a, x in zip(w, xs))
    slope = sum(a * (x - mx) * (y - my) for a, x, y in zip(w, xs, ys)) / sxx
    if slope <= 0:
        raise SpecError("message times do not grow with size; cannot fit a bandwidth (measure larger messages)")
    lat = my - slope * mx
    if lat < 0:  # refit through the origin
        slope = sum(a * x * y for a, x, y in zip(w, xs, ys)) / sum(a * x * x for a, x in zip(w, xs))
        lat = 0.0
    return lat, 1.0 / slope


def fit_allreduce(sizes, times, n: int, relative: bool = False) -> tuple[float, float]:
    """Fit a ring all-reduce over n ranks, ``time = 2(n-1) latency + 2(n-1)/n bytes / bandwidth``
    (``relative``: see :func:`fit_latency_bandwidth`); returns (latency, bandwidth) of one ring step."""
    if n < 2:
        raise SpecError("an all-reduce fit needs at least 2 ranks")
    lat, bw = fit_latency_bandwidth(sizes, times, relative)
    return lat / (2 * (n - 1)), bw * 2 * (n - 1) / n


def fit_all_to_all(sizes, times) -> tuple[float, float, float]:
    """The executor's all-to-all over an EP group (:func:`calibration.measure.measure_a2a`: bytes
    each rank sends, seconds) fitted as ``time = latency + bytes / bandwidth`` on the relative
    residuals (:func:`fit_latency_bandwidth`: the small exchanges' latency counts as much as the
    large ones' bytes). Returns (latency s, bandwidth B/s, residual): the residual is the fit's
    largest relative miss on its own points, max |fit / measured - 1|, the figure the profile
    states beside the fit (``all_to_all.residual``)."""
    lat, bw = fit_latency_bandwidth(sizes, times, relative=True)
    res = max(abs((lat + float(x) / bw) / float(t) - 1.0) for x, t in zip(sizes, times))
    return lat, bw, res


def fit_ranks(ranks: int, tp: int = 1) -> int:
    """Ranks of the runs the runtime is fitted on for runs of ``ranks`` ranks (each a TP group of
    ``tp`` processes) on this host: as many when their processes outnumber the cores (what time
    slicing costs shows only there), else no more than the cores hold (at least 2: the runs pass
    messages)."""
    cores = os.cpu_count() or 1
    return ranks if ranks * tp > cores else max(2, min(ranks, cores // tp))


def probe_seconds(series: list[RunSeries]) -> float | None:
    """The host speed the probe saw over ``series`` (median over the configs)."""
    p = [x.probe_seconds for x in series if x.probe_seconds is not None]
    return float(np.median(p)) if p else None


def op_means(rows, split: bool) -> dict[str, list[float]]:
    """Per op kind: [seconds per step, ops per step] over the trace ``rows`` of the steps they
    hold (B of a split backward is kind "Bi": it is the input-gradient half only)."""
    nsteps = max(1, rows["step"].nunique())
    dur = (rows["end"] - rows["start"]).to_numpy()
    out: dict[str, list[float]] = {}
    for kind, d in zip(rows["kind"], dur):
        k = "Bi" if (kind == "B" and split) else kind
        acc = out.setdefault(k, [0.0, 0.0])
        acc[0] += float(d) / nsteps
        acc[1] += 1.0 / nsteps
    return out


def typical_rows(series: RunSeries):
    """The trace rows of the series' typical steps (its fast steps around their median), steps renumbered
    so that each (run, step) pair is one step."""
    import pandas as pd
    parts = []
    for k, (res, step) in enumerate(series.typical_steps()):
        t = res.trace[res.trace["step"] == step]
        parts.append(t.assign(step=k))
    return pd.concat(parts, ignore_index=True)


def measured_run(job: Job, steps: int, dtype: str = "fp32") -> RunConfig:
    """The executor's run of ``job`` as a sitting measures it: ``steps`` steps in precision
    ``dtype``, the host speed probe on, ranks pinned to cores where the host allows."""
    return RunConfig.from_job(job, steps=steps, probe=PROBE, pin_cores=True, dtype=dtype)


def runtime_configs(model: str, ranks: int, steps: int = 20, micro_batch: int | None = None,
                    dtype: str = "fp32", tp: int = 1) -> list[RunConfig]:
    """The traced runs the runtime is fitted on: the jobs of :data:`RUNTIME_SCHEDULES` at
    D = ``ranks``, N = 2D, T = ``tp``, as :func:`measured_run` runs them; run them in a sitting
    (:func:`calibration.sitting.run_series`), alone (calibration) or beside the runs to predict
    (validation: then both meet the same host; the ones equal to a validation's config are
    shared). Schedules with more stages than the model (a spec or a model file) has layers are
    left out (at least one must fit: tiny-mixtral's 4 blocks at D = 4 keep 1F1B, ZB-H1 and BitPipe)."""
    cfgs, refused = [], []
    for s in RUNTIME_SCHEDULES:
        job = Job(layout=Layout(schedule=s, devices=ranks, microbatches=2 * ranks), model=model,
                  parallel=Parallel(tp=tp, micro_batch=micro_batch))
        cfg = measured_run(job, steps, dtype)
        try:
            lowered_schedule(cfg)
        except ValueError as e:
            if "layers" not in str(e) or "stages" not in str(e):
                raise
            refused.append(str(e))
            continue
        cfgs.append(cfg)
    if not cfgs:
        raise ValueError(f"no runtime schedule fits model {model} at D = {ranks}: " + "; ".join(refused))
    return cfgs


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


def fit_runtime(series: list[RunSeries], make_profile: Callable[[dict, dict], CalibrationProfile], *,
                iterations: int = 5) -> tuple[dict[str, float], dict[str, float]]:
    """Fit the runtime's costs so that the simulator reproduces the traced ``series``.

    Simulate each config with the current profile; per config and compute kind (F, B, split B
    "Bi", W) take the measured time per step (over the typical steps: the fast steps around
    the noise-free time, the statistic validation compares) and the simulated one; fit measured = scale_kind
    x simulated + overhead x ops (:func:`scale_and_overhead`: one per-op overhead shared by the
    compute kinds; the configs differ in op size, 1F1B's stages against the chunks of
    1F1B-interleaved and ZB-V, which tells the two apart); scale the optimizer step (OPTIM) by
    measured / simulated time and move SEND's per-op overhead by the mean residual; repeat. Sums
    over a step, not op medians: a step pays every op's time, the slow ones included. RECV keeps
    the 20th percentile of its measured durations (a receive whose message is already there).

    ``make_profile(scale, overhead)`` builds the profile to simulate with. Returns (scale, overhead).
    """
    scale = {k: 1.0 for k in (*COMPUTE_KINDS, "OPTIM")}
    rows = [typical_rows(x) for x in series]
    recv = []
    for t in rows:
        t = t[t["kind"] == "RECV"]
        recv += (t["end"] - t["start"]).tolist()
    recv.sort()
    overhead = {"SEND": 0.0, "RECV": recv[int(0.2 * (len(recv) - 1))] if recv else 0.0, "F": 0.0, "B": 0.0, "W": 0.0}
    lows = [lowered_schedule(x.config) for x in series]
    measured = [op_means(t, low.split_backward) for t, low in zip(rows, lows)]
    warm = series[0].rules.warmup if series else 0
    steps = warm + 2

    def total(per_run, kind):
        return sum(t.get(kind, [0.0, 0])[0] for t in per_run), sum(t.get(kind, [0.0, 0])[1] for t in per_run)

    for _ in range(iterations):
        prof = make_profile(scale, overhead)
        simulated = []
        for low in lows:   # the simulator's steps after the warm-up are all alike
            tr = simulate_with_profile(low, prof, steps=steps)
            simulated.append(op_means(tr[tr["step"] >= warm], low.split_backward))
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


MAX_P2P_EXTRA = 5e-3     # s: the in-run message latency may exceed the ping-pong's by at most this
AR_FACTOR = (0.1, 10.0)  # an all-reduce inside a run within these multiples of its lone time


def simulated_step(low, profile: CalibrationProfile, warmup: int) -> float:
    """The simulator's noise-free step time of lowered schedule ``low`` (its steps after the
    warm-up are all alike; the statistic the measured side uses)."""
    return noise_free(step_metrics(simulate_with_profile(low, profile, warmup + 2)).iteration_times[warmup:])


def fit_communication(series: list[RunSeries], make_profile: Callable[[float, float], CalibrationProfile]
                      ) -> tuple[float, float]:
    """Communication as it costs inside a run, fitted on step times: (extra P2P latency in
    seconds, all-reduce slowdown).

    The ping-pong and the lone all-reduces of calibration time idle ranks. Inside a run a
    message arrives later (0.2-0.9 ms more per message on a 2-core host: the receiving rank's
    gloo thread shares its pinned core with compute) and an all-reduce launched in the bubbles
    takes 0.6-3.4x its lone time (its copies and sums compete with compute). The op totals
    :func:`fit_runtime` matches cannot show either: a receive's wait is the other rank's time.
    So, with the runtime's op costs fixed, the two are moved until the simulated noise-free step
    times of the traced ``series`` equal the measured ones (relative residuals, bounded least
    squares: ``scipy.optimize.least_squares``; the latency within [0, :data:`MAX_P2P_EXTRA`], the
    slowdown within :data:`AR_FACTOR` and only fitted when some run all-reduces, else 1). The
    slowdown may come out below 1: the lone all-reduce times spread 3x between wake-ups and their
    median can sit above what the runs show. ``make_profile(p2p_extra, ar_slowdown)``
    builds the profile to simulate with."""
    if not series:
        return 0.0, 1.0
    lows = [lowered_schedule(x.config) for x in series]
    measured = np.array([x.step_time for x in series])
    warm = series[0].rules.warmup
    reduces = any(op.kind == ALLREDUCE for low in lows for r in range(low.num_ranks) for op in low.program(r))

    def residuals(x):   # x: the latency in ms (both unknowns of order one for the finite differences)
        prof = make_profile(float(x[0]) * 1e-3, float(x[1]) if reduces else 1.0)
        return np.array([simulated_step(low, prof, warm) for low in lows]) / measured - 1.0

    n = 2 if reduces else 1
    lower, upper = [0.0, AR_FACTOR[0]][:n], [MAX_P2P_EXTRA * 1e3, AR_FACTOR[1]][:n]
    # started inside the bounds: trust-region reflective scales its steps by the distance to a bound
    sol = least_squares(residuals, x0=[0.2, 1.2][:n], bounds=(lower, upper), diff_step=0.02, xtol=1e-4, ftol=1e-4)
    return float(sol.x[0]) * 1e-3, float(sol.x[1]) if reduces else 1.0


TIME_SLICES = (2e-3, 4e-3, 6e-3, 10e-3)   # s: the OS time slices tried (Linux's are a few ms)


def fit_time_slice(series: list[RunSeries], fit: Callable[[float], CalibrationProfile],
                   slices: Sequence[float] = TIME_SLICES) -> tuple[float, CalibrationProfile]:
    """The time slice that best explains runs with more ranks than cores: for each candidate,
    ``fit(slice)`` fits the profile with it (the runtime and the in-run communication, through the
    simulator with time-sliced cores); the one whose simulated step times come closest to the
    measured ones (root mean square of the relative errors over ``series``) wins. With 4 ranks on
    2 cores the fits land on 2-10 ms (with ops of 1-3 ms the fit hardly tells the slices apart);
    processor sharing instead leaves the 1-stage-per-rank schedules (GPipe, ZB-H1, Chimera) 17-22%
    short while the runtime fit reproduces the op totals. Returns (slice, its profile)."""
    lows = [lowered_schedule(x.config) for x in series]
    warm = series[0].rules.warmup if series else 0
    best = None
    for q in slices:
        prof = fit(q)
        err = math.sqrt(sum((simulated_step(low, prof, warm) / x.step_time - 1) ** 2 for low, x in zip(lows, series))
                        / max(1, len(series)))
        if best is None or err < best[0]:
            best = (err, q, prof)
    return best[1], best[2]


def scale_layer(t: dict, scale: dict[str, float]) -> dict:
    """One layer's times as it runs inside a training run: alone times the fitted scale."""
    return dict(t, f=t["f"] * scale.get("F", 1.0), b=t["b"] * scale.get("B", 1.0),
                b_input=t["b_input"] * scale.get("Bi", 1.0), w=t["w"] * scale.get("W", 1.0))
