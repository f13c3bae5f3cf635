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
   costs more than ideal processor sharing. The same runs at D = ``ranks`` (in the same rounds
   as those of 3.) give one compute slowdown that makes the simulated step times match
   (:func:`calibration.fit.fit_oversubscribed`).

:func:`calibrate` is :func:`measure_host` (1-2), the traced runs, then :func:`fit_profile`
(3-4); validation can run the traced runs beside its own (:func:`experiments.crossval.calibrate_and_compare`).

``calibrate(...)`` returns the profile; :func:`cost_models.save_profile` writes it. How the
traced runs' sitting went is kept in ``meta["sitting"]`` (per D: spread, other processes' load,
and the problems of configs that did not settle; :func:`sitting_problems` reads them): a
profile calibrated on a busy host is written, but validation refuses it.
"""
from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass

import torch

from cost_models.calibration import CalibrationProfile, LayerTiming, fit_allreduce, fit_latency_bandwidth
from cost_models.cluster import LinkSpec
from cost_models.model_spec import ModelSpec, load_model
from executor.device import cpu_threads

from executor.sitting import RunSeries, SittingRules, run_series

from .fit import (PROBE, RUNTIME_SCHEDULES, fit_oversubscribed, fit_ranks, fit_runtime, probe_seconds,
                  runtime_configs, scale_layer)
from .measure import measure_comm, measure_data, measure_layers, measure_optimizer

__all__ = ["PROBE", "RUNTIME_SCHEDULES", "HostMeasurements", "calibrate", "fit_oversubscribed", "fit_profile",
           "fit_ranks", "fit_runtime", "measure_host", "runtime_configs", "sitting_problems", "sitting_record"]


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


@dataclass(frozen=True, kw_only=True)
class HostMeasurements:
    """What calibration measures before any traced run (steps 1-2 of the module docstring)."""

    model: str
    spec: ModelSpec
    ranks: int
    threads: int
    layers: dict            # per kind (embedding, block, head): times and kept bytes
    optimizer: float        # seconds per parameter of an Adam step
    data: float             # seconds per micro-batch from the data stream
    comm: dict              # measure_comm's samples and per-byte costs


def measure_host(model: str = "tiny", *, ranks: int = 2, repeats: int = 20, progress=None) -> HostMeasurements:
    """Layers, optimizer, data and communication of this machine, for ``ranks`` ranks on it."""
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
    return HostMeasurements(model=model, spec=spec, ranks=ranks, threads=threads, layers=layers,
                            optimizer=max(opt, comm["optimizer_per_param"]), data=data, comm=comm)


def fit_profile(host: HostMeasurements, base: list[RunSeries],
                over: list[RunSeries] | None = None) -> CalibrationProfile:
    """The profile: ``host``'s measurements with the runtime fitted on the traced ``base`` runs
    (:func:`runtime_configs` at :func:`fit_ranks` ranks) and, when ``host.ranks`` outnumber the
    cores, the oversubscribed slowdown fitted on ``over`` (the same configs at ``host.ranks``;
    None there: not measured, the profile is marked unusable)."""
    spec, ranks, comm = host.spec, host.ranks, host.comm
    lat, bw = fit_latency_bandwidth(*zip(*comm["p2p"]))
    ar_lat, ar_bw = fit_allreduce(*zip(*comm["allreduce"]), n=max(2, ranks))
    cores = os.cpu_count() or 1
    base_ranks = fit_ranks(ranks)
    probes = {str(base_ranks): probe_seconds(base)}
    sitting = {str(base_ranks): sitting_record(base)}
    per = [host.layers["embedding"]] + [host.layers["block"]] * spec.layers + [host.layers["head"]]
    meta = {"host": platform.node(), "torch": str(torch.__version__), "threads_per_rank": host.threads,
            "ranks": ranks, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "p2p_samples": [list(x) for x in comm["p2p"]], "allreduce_samples": [list(x) for x in comm["allreduce"]]}

    def make_profile(scale: dict, overhead: dict, oversubscribed: float = 1.0) -> CalibrationProfile:
        timing = [scale_layer(x, scale) for x in per]
        return CalibrationProfile(
            name=f"{platform.node() or 'host'}-{host.model}", model=spec,
            layers=tuple(LayerTiming(x["f"], x["b_input"], x["w"], x["b"]) for x in timing),
            p2p=LinkSpec("calibrated-p2p", bw, lat), allreduce=LinkSpec("calibrated-allreduce", ar_bw, ar_lat),
            optimizer_seconds_per_param=host.optimizer * scale.get("OPTIM", 1.0), copy_time=0.0, memory_bytes=None,
            act_bytes=tuple(float(x["act"]) for x in per), act_w_bytes=tuple(float(x["act_w"]) for x in per),
            overhead=tuple(sorted(overhead.items())), cores=cores, data_time=host.data,
            grad_copy_per_byte=comm["grad_copy_per_byte"], oversubscribed_slowdown=oversubscribed,
            meta=dict(meta, runtime_scale=dict(scale), runtime_fit_ranks=base_ranks, probe_seconds=dict(probes),
                      sitting=dict(sitting)))

    # the runtime is fitted with no more ranks than cores; what sharing the cores costs beyond
    # ideal processor sharing is fitted on runs with as many ranks as the runs to predict
    scale, overhead = fit_runtime(base, make_profile)
    slowdown = 1.0
    if ranks > base_ranks and over is None:
        sitting[str(ranks)] = {"problems": [f"no traced runs at D={ranks}"]}
    elif ranks > base_ranks:
        probes[str(ranks)] = probe_seconds(over)
        sitting[str(ranks)] = sitting_record(over)
        slowdown = fit_oversubscribed(over, lambda x: make_profile(scale, overhead, x))
    return make_profile(scale, overhead, slowdown)


def calibrate(model: str = "tiny", *, ranks: int = 2, repeats: int = 20, progress=None,
              rules: SittingRules | None = None) -> CalibrationProfile:
    """Measure this machine (see the module docstring); ``ranks`` is how many ranks the runs to be
    predicted put on this host (it sets the thread count per rank, like the executor does);
    ``rules``: how the traced runs are repeated and judged (:class:`executor.sitting.SittingRules`).
    All traced runs share one sitting (interleaved rounds, both world sizes)."""
    report = progress or (lambda msg: None)
    host = measure_host(model, ranks=ranks, repeats=repeats, progress=report)
    base_ranks = fit_ranks(ranks)
    report("runtime (traced runs)")
    base_cfgs = runtime_configs(model, base_ranks)
    over_cfgs = runtime_configs(model, ranks) if ranks > base_ranks else []
    series = run_series(base_cfgs + over_cfgs, rules or SittingRules(), progress=report)
    return fit_profile(host, series[:len(base_cfgs)], series[len(base_cfgs):] or None)
