"""Calibration: measure this machine with the executor's own code, fit the runtime through the
simulator, and write the profile :mod:`cost_models.calibration` loads.

It sits above both engines (it runs the executor and the simulator; neither knows about it).
What is measured, and how:

1. Layers (:mod:`calibration.measure`, in this process, with the thread count one rank uses when
   ``ranks`` share the host): forward, full backward, and the split backward's input-grad and
   weight-grad parts of the embedding, one transformer block and the head (+ loss), built by
   :mod:`executor.model` and run with the runtime's own backward calls (:mod:`executor.backward`).
   Activation bytes kept from F to B (and from B to W) per layer come from the runtime's
   :class:`executor.device.SavedTensorMeter`.
2. Communication (``ranks`` spawned ranks, gloo): one-way P2P times by ping-pong over message
   sizes (25th percentile), fitted as latency + bytes / bandwidth; all-reduce times over sizes as
   the runtime launches them (the median: gloo's times spread 3x between wake-ups), fitted as a
   ring; and, with every rank doing it at once, the Adam step per parameter (the slower of this
   and the lone measurement is kept) and the gradient flatten + write-back per byte around an
   all-reduce. In the simulator an all-reduce keeps a core of every member busy (gloo's threads
   copy and reduce), shared with compute.
3. The runtime, through the simulator (:mod:`calibration.fit`): short executor runs (1F1B,
   1F1B-interleaved, ZB-V at D = :func:`calibration.fit.fit_ranks`, ranks pinned to cores, in
   interleaved rounds until three quiet runs of each agree: :func:`executor.sitting.run_series`)
   are traced and simulated with the profile; per op kind the compute gets a scale and all
   compute ops one per-op cost (bounded least squares on measured vs simulated times per step,
   over the steps around the low quantile validation compares), OPTIM a scale, SEND the mean
   residual as a per-op cost, RECV the 20th percentile of its durations; repeated to a fixed
   point (:func:`calibration.fit.fit_runtime`).
4. More ranks than cores (``ranks`` > cores): the OS time-slices them in ~4 ms quanta, which
   costs more than ideal processor sharing. The same runs at D = ``ranks`` give one compute
   slowdown that makes the simulated step times match (:func:`calibration.fit.fit_oversubscribed`).

``calibrate(...)`` returns the profile; :func:`cost_models.save_profile` writes it. How the
traced runs' sitting went is kept in ``meta["sitting"]`` (per D: spread, other processes' load,
and the problems of configs that did not settle; :func:`sitting_problems` reads them): a
profile calibrated on a busy host is written, but validation refuses it.
"""
from __future__ import annotations

import os
import platform
import time

import torch

from cost_models.calibration import CalibrationProfile, LayerTiming, fit_allreduce, fit_latency_bandwidth
from cost_models.cluster import LinkSpec
from cost_models.model_spec import load_model
from executor.device import cpu_threads

from executor.sitting import RunSeries, SittingRules

from .fit import (PROBE, RUNTIME_SCHEDULES, fit_oversubscribed, fit_ranks, fit_runtime, probe_seconds, scale_layer,
                  trace_runtime)
from .measure import measure_comm, measure_data, measure_layers, measure_optimizer

__all__ = ["PROBE", "RUNTIME_SCHEDULES", "calibrate", "fit_ranks", "fit_runtime", "fit_oversubscribed",
           "sitting_problems", "sitting_record"]


def sitting_record(series: list[RunSeries]) -> dict:
    """How a sitting's traced runs went, for the profile's meta: the largest spread of the kept
    runs, the most CPU other processes took in any run, runs per config, and every unsettled
    config's problem."""
    spreads = [x.spread for x in series if x.spread is not None]
    loads = [f for x in series for f in (x.foreign(i) for i in range(len(x.runs))) if f is not None]
    return {"spread_max": max(spreads) if spreads else None, "foreign_cores_max": max(loads) if loads else None,
            "runs": {x.config.schedule: len(x.runs) for x in series},
            "problems": [f"{x.config.schedule}: {x.problem}" for x in series if x.problem]}


def sitting_problems(profile: CalibrationProfile) -> list[str]:
    """Why the profile's calibration sitting is unusable (empty: it is usable)."""
    return [f"D={d}: {p}" for d, rec in sorted((profile.meta.get("sitting") or {}).items())
            for p in rec.get("problems", [])]


def calibrate(model: str = "tiny", *, ranks: int = 2, repeats: int = 20, progress=None,
              rules: SittingRules | None = None) -> CalibrationProfile:
    """Measure this machine (see the module docstring); ``ranks`` is how many ranks the runs to be
    predicted put on this host (it sets the thread count per rank, like the executor does);
    ``rules``: how the traced runs are repeated and judged (:class:`executor.sitting.SittingRules`)."""
    spec = load_model(model)
    if spec.kind != "gpt":
        raise ValueError(f"calibration runs the executor's GPT; model {spec.name!r} is {spec.kind!r}")
    threads = cpu_threads(ranks)
    report = progress or (lambda msg: None)
    report("layers")
    layers = measure_layers(spec, threads, repeats, progress=report)
    report("optimizer")
    opt = measure_optimizer(spec, threads)
    data = measure_data(spec)
    report("communication")
    comm = measure_comm(spec, max(2, ranks), max(12, repeats))
    opt = max(opt, comm["optimizer_per_param"])
    lat, bw = fit_latency_bandwidth(*zip(*comm["p2p"]))
    ar_lat, ar_bw = fit_allreduce(*zip(*comm["allreduce"]), n=max(2, ranks))
    cores = os.cpu_count() or 1
    base_ranks = fit_ranks(ranks)
    report("runtime (traced runs)")
    runs = trace_runtime(model, base_ranks, rules=rules, progress=report)
    probes = {str(base_ranks): probe_seconds(runs)}
    sitting = {str(base_ranks): sitting_record(runs)}
    per = [layers["embedding"]] + [layers["block"]] * spec.layers + [layers["head"]]
    meta = {"host": platform.node(), "torch": str(torch.__version__), "threads_per_rank": threads, "ranks": ranks,
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "p2p_samples": [list(x) for x in comm["p2p"]],
            "allreduce_samples": [list(x) for x in comm["allreduce"]]}

    def make_profile(scale: dict, overhead: dict, oversubscribed: float = 1.0) -> CalibrationProfile:
        timing = [scale_layer(x, scale) for x in per]
        return CalibrationProfile(
            name=f"{platform.node() or 'host'}-{model}", model=spec,
            layers=tuple(LayerTiming(x["f"], x["b_input"], x["w"], x["b"]) for x in timing),
            p2p=LinkSpec("calibrated-p2p", bw, lat), allreduce=LinkSpec("calibrated-allreduce", ar_bw, ar_lat),
            optimizer_seconds_per_param=opt * scale.get("OPTIM", 1.0), copy_time=0.0, memory_bytes=None,
            act_bytes=tuple(float(x["act"]) for x in per), act_w_bytes=tuple(float(x["act_w"]) for x in per),
            overhead=tuple(sorted(overhead.items())), cores=cores, data_time=data,
            grad_copy_per_byte=comm["grad_copy_per_byte"], oversubscribed_slowdown=oversubscribed,
            meta=dict(meta, runtime_scale=dict(scale), runtime_fit_ranks=base_ranks, probe_seconds=dict(probes),
                      sitting=dict(sitting)))

    # the runtime is fitted with no more ranks than cores; what sharing the cores costs beyond
    # ideal processor sharing is fitted on runs with as many ranks as the runs to predict
    scale, overhead = fit_runtime(runs, make_profile)
    slowdown = 1.0
    if ranks > base_ranks:
        report("oversubscribed cores (traced runs)")
        over = trace_runtime(model, ranks, rules=rules, progress=report)
        probes[str(ranks)] = probe_seconds(over)
        sitting[str(ranks)] = sitting_record(over)
        slowdown = fit_oversubscribed(over, lambda x: make_profile(scale, overhead, x))
    return make_profile(scale, overhead, slowdown)
