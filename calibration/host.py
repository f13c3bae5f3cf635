"""Measuring this host: the layers, the communication and the runtime of this machine, measured
with the executor's own code and fitted through the simulator into the profile
:mod:`cost_models.profile` loads.

What is measured, and how:

1. Layers (:mod:`calibration.measure`, in this process, with the thread count one rank uses when
   ``ranks`` share the host): forward, full backward, and the split backward's input-grad and
   weight-grad parts of the embedding, one transformer block and the head (+ loss), built by
   :mod:`executor.model` and run with the runtime's own backward calls (:mod:`executor.backward`)
   in the run's precision (``dtype``: fp32, or bf16 autocast; the profile's model then has
   ``dtype_bytes`` 2). Activation bytes kept from F to B (and from B to W) per layer come from
   the runtime's :class:`executor.device.SavedTensorMeter`, a block's also under each
   recomputation mode (:mod:`executor.recompute`). A model file (``PATH.py:FUNC``, see
   :mod:`executor.user_model`) is measured the same way (in fp32), every one of its layers on the
   output of the one before it (the last with the loss), at ``micro_batch`` samples; its profile
   also keeps per layer the parameters, the output bytes, the FLOPs of the timed calls and the
   kept bytes alone and after the previous layer (:class:`cost_models.stack.StackSpec`).
2. Communication (``ranks`` spawned ranks, gloo): one-way P2P times by ping-pong over message
   sizes (25th percentile), fitted as latency + bytes / bandwidth; all-reduce times over sizes as
   the runtime launches them (the median: gloo's times spread 3x between wake-ups), fitted as a
   ring; and, with every rank doing it at once, the Adam step per parameter (the slower of this
   and the lone measurement is kept) and the gradient flatten + write-back per byte around an
   all-reduce. In the simulator an all-reduce's bytes keep a core of every member busy (gloo's
   threads copy and reduce), shared with compute; its per-message latency, as a P2P message's,
   passes in wall time (where every rank has a core; time-sliced, the whole ring time is CPU work).
3. The runtime, through the simulator (:mod:`calibration.fit`): short executor runs (1F1B,
   1F1B-interleaved, ZB-V, ZB-H1 and BitPipe at D = :func:`calibration.fit.fit_ranks`, ranks pinned to
   cores, in interleaved rounds until three quiet runs of each agree:
   :func:`calibration.sitting.run_series`) are traced and simulated with the profile; per op kind
   the compute gets a scale and all compute ops one per-op cost (bounded least squares on
   measured vs simulated times per step, over the fast steps of the runs validation's statistic
   rests on), OPTIM a scale, SEND the mean residual as a per-op cost, RECV the 20th percentile of
   its durations; repeated to a fixed point (:func:`calibration.fit.fit_runtime`). Then the
   communication as it costs inside a run: the extra latency of a message over the ping-pong's
   and the slowdown of an all-reduce in the bubbles over its lone time, fitted on the step times
   (:func:`calibration.fit.fit_communication`; kept in ``meta["in_run"]``, the lone fits in
   ``meta["alone"]``).
4. More ranks than cores (``ranks`` > cores): the OS time-slices them, which is not processor
   sharing (an op runs at full speed once it has a core; a woken rank waits for one). The traced
   runs of 3. then have D = ``ranks``, the simulator time-slices the cores (:mod:`sim.slicing`)
   and the slice is chosen with the fit (:func:`calibration.fit.fit_time_slice`: the profile's
   ``time_slice``).

With tensor parallelism (``tp`` T > 1, a GPT spec) every rank of the runs to predict is a TP
group of T processes: 1. measures TP rank 0's layers at 1/T as the executor builds them
(:func:`calibration.measure.measure_tp_layers`), 2. also the group's all-reduce over T gloo
processes (fitted as a ring: the profile's ``tp_allreduce``, priced on every layer's collectives,
:meth:`cost_models.profile.CalibrationProfile.collective_times`), 3. traces runs at T, and a
simulated rank is the group on T cores (the profile's host has ``cores // T`` of them), so 4.
applies once the processes outnumber the cores.

:func:`calibrate` is :func:`measure_host` (1-2), the traced runs, then :func:`fit_profile`
(3-4); validation can run the traced runs beside its own
(:func:`calibration.compare.calibrate_and_compare`).

``calibrate(...)`` returns the profile; :func:`cost_models.save_profile` writes it. How the
traced runs' sitting went is kept in ``meta["sitting"]`` (per D: spread, other processes' load,
and the problems of configs that did not settle; :func:`calibration.sitting.sitting_problems` reads
them): a profile calibrated on a busy host is written, but validation refuses it.
"""
from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Callable

import torch

from cost_models.profile import CalibrationProfile, LayerTiming
from cost_models.cluster import LinkSpec
from cost_models.model_spec import load_model
from cost_models.stack import StackSpec, is_model_ref
from executor.config import RunConfig, lowered_schedule
from executor.device import cpu_threads
from executor.precision import Precision

from .fit import (fit_all_to_all, fit_allreduce, fit_communication, fit_latency_bandwidth, fit_ranks, fit_runtime,
                  fit_time_slice, probe_seconds, runtime_configs, scale_layer)
from .measure import (measure_a2a, measure_comm, measure_data, measure_layers, measure_moe_layers, measure_optimizer,
                      measure_stack_layers, measure_tp_layers)
from .sitting import RunSeries, SittingRules, run_series, sitting_record


def kept_bytes(per: list[dict]) -> dict:
    """The profile fields of measured activation bytes (``act_bytes``, ``act_w_bytes``,
    ``act_bytes_recompute``) from per-layer measurements (:func:`calibration.measure.measure_layer`,
    one per layer: embedding, blocks, head)."""
    return {"act_bytes": tuple(float(x["act"]) for x in per),
            "act_w_bytes": tuple(float(x["act_w"]) for x in per),
            "act_bytes_recompute": tuple((m, tuple(float(x["act_recompute"].get(m, x["act"])) for x in per))
                                         for m in ("selective", "full"))}


def measure_stack(ref: str, micro_batch: int, threads: int, repeats: int = 20, progress=None):
    """A model file's layers measured (:func:`calibration.measure.measure_stack_layers`): (rows,
    :class:`cost_models.stack.StackSpec`, bytes each layer adds after the one before it, the same
    until W). A split backward frees the graph in B and keeps only W's inputs (a layer's own input
    and the gradients B recorded, :mod:`executor.backward`): the same bytes after the previous layer
    as alone. Where B keeps the graph (an op W runs through the engine), what the layer keeps for W
    after the previous one is its chain bytes less what it frees alone at B."""
    from executor.user_model import build_stack, stack_layout
    stack_layout(ref, 1, micro_batch=micro_batch)        # the model's own checks, one line each
    rows = measure_stack_layers(build_stack(ref, 0), micro_batch, threads, repeats, progress=progress)
    spec = StackSpec(
        name=ref, micro_batch=micro_batch, layer_names=tuple(r["name"] for r in rows),
        params=tuple(float(r["params"]) for r in rows), out_bytes=tuple(float(r["out_bytes"]) for r in rows),
        act_first=tuple(float(r["act"]) for r in rows), act_w_first=tuple(float(r["act_w"]) for r in rows),
        flops=tuple(r["flops"] for r in rows), dtype_bytes=4)
    act = tuple(float(r["act_chain"]) for r in rows)
    act_w = tuple(max(0.0, float(r["act_chain"]) - (r["act"] - r["act_w"])) if r["graph_kept"] else float(r["act_w"])
                  for r in rows)
    return rows, spec, act, act_w


@dataclass(frozen=True, kw_only=True)
class HostMeasurements:
    """What calibration measures before any traced run (steps 1-2 of the module docstring)."""

    model: str              # the model as given: preset / YAML file or model file PATH.py:FUNC
    label: str              # its name in the profile's name
    model_spec: object      # cost_models.model_spec.ModelSpec or, for a model file, cost_models.stack.StackSpec
    micro_batch: int | None  # the traced runs' micro-batch (None: the spec's own)
    ranks: int
    threads: int
    per: list               # per layer of the model (embedding, blocks, head; a model file's layers): times
    dtype: str              # precision of the runs to predict: fp32 | bf16 (executor.precision)
    tp: int = 1             # tensor-parallel size: ``per`` are one TP rank's shards, ``comm`` has the group's
    kept: dict              # measured activation bytes: the profile's act_bytes, act_w_bytes (and a
                            # GPT's act_bytes_recompute): :func:`kept_bytes`
    optimizer: float        # seconds per parameter of an Adam step
    data: float             # seconds per micro-batch from the data stream
    comm: dict              # measure_comm's samples and per-byte costs
    ep: int = 1             # expert-parallel size E of the runs to predict (a mixture of experts)
    moe: dict | None = None  # a MoE model's expert layers measured alone (measure_moe_layers), else None
    a2a: tuple = ()         # with E > 1: (bytes a rank sends, seconds) of the EP group's all-to-all
    per_ep1: list | None = None  # with E > 1: ``per`` at E = 1 (every expert local), as the traced runs run

    def traced(self) -> HostMeasurements:
        """The host as calibration's traced runs meet it (:func:`runtime_configs`: E = 1, every expert
        local, no all-to-all): ``per_ep1`` for ``per``, no EP group. The runtime fit simulates those
        runs on this (:func:`fit_profile`): priced at E = 2 instead, each MoE block's F would carry
        the counts', dispatch's and combine's fitted seconds and its B the two gradients' that the
        runs never spend, and the fitted scales would shrink the compute to make room for them
        (tiny-mixtral at E 2: F scaled 0.78 while its traced F ops ran about 3x their alone time,
        so a run's step came out mostly all-to-all). Itself at E = 1."""
        if self.ep == 1 or self.per_ep1 is None:
            return self
        return replace(self, per=list(self.per_ep1), kept=kept_bytes(self.per_ep1), ep=1, a2a=(), per_ep1=None)

    @cached_property
    def link_fits(self) -> dict[str, float]:
        """The lone communication fits, once per measurement: P2P latency + bandwidth (ping-pong) and
        the all-reduce ring's latency + bandwidth."""
        lat, bw = fit_latency_bandwidth(*zip(*self.comm["p2p"]))
        ar_lat, ar_bw = fit_allreduce(*zip(*self.comm["allreduce"]), n=max(2, self.ranks))
        out = {"p2p_latency": lat, "p2p_bandwidth": bw, "allreduce_latency": ar_lat, "allreduce_bandwidth": ar_bw}
        if self.tp > 1:
            # relative residuals: a layer's all-reduces are small (latency-bound), the fit must hold there
            out["tp_allreduce_latency"], out["tp_allreduce_bandwidth"] = fit_allreduce(
                *zip(*self.comm["tp_allreduce"]), n=self.tp, relative=True)
        if self.a2a:
            out["a2a_latency"], out["a2a_bandwidth"], out["a2a_residual"] = fit_all_to_all(*zip(*self.a2a))
        return out

    def runtime_configs(self, ranks: int, steps: int = 20) -> list:
        """The traced runs the runtime is fitted on, at ``ranks`` (:func:`calibration.fit.runtime_configs`)."""
        return runtime_configs(self.model, ranks, steps, micro_batch=self.micro_batch, dtype=self.dtype, tp=self.tp)


def measure_host(model: str = "tiny", *, ranks: int = 2, repeats: int = 20, progress=None,
                 micro_batch: int | None = None, dtype: str = "fp32", tp: int = 1, ep: int = 1) -> HostMeasurements:
    """Layers, optimizer, data and communication of this machine, for ``ranks`` ranks on it, each
    a tensor-parallel group of ``tp`` processes (its layers measured as one TP rank's shards, the
    group's all-reduce measured; a GPT spec only).
    ``model``: a GPT preset / YAML file, or a model file ``PATH.py:FUNC`` measured at
    ``micro_batch`` samples (default :data:`executor.user_model.DEFAULT_MICRO_BATCH`). ``dtype``
    the precision of the runs to be predicted (fp32 | bf16; a model file: fp32). A mixture of
    experts (``tiny-mixtral``, ``tiny-deepseek``) also has its expert layers measured alone
    (:func:`calibration.measure.measure_moe_layers`) and, at ``ep`` E > 1, the executor's
    all-to-all over E gloo ranks (:func:`calibration.measure.measure_a2a`)."""
    precision = Precision(dtype)
    precision.check_run("cpu")          # fp8 needs a GPU with fp8: refused in one line
    stack_ref = model if is_model_ref(model) else None
    if stack_ref is None:
        spec = load_model(model)
        if spec.kind not in ("gpt", "llama"):
            raise ValueError(f"calibration runs the executor's GPT and Llama kinds; model {spec.name!r} is "
                             f"{spec.kind!r}")
        check_ep(spec, ep, tp)
        if micro_batch is not None:
            spec = spec.replace(micro_batch=int(micro_batch))
        spec = spec.replace(dtype_bytes=precision.dtype_bytes)
        if tp > 1:
            from executor.config import check_tensor_parallel
            check_tensor_parallel(spec, tp)
    elif tp > 1:
        raise ValueError(f"--tp {tp} splits the built-in GPT's layers; a model file's layers are not split "
                         f"(calibrate {stack_ref} with --tp 1)")
    elif ep > 1:
        raise ValueError(f"--ep {ep} splits a mixture of experts' routed experts; a model file's layers are not "
                         f"split (calibrate {stack_ref} with --ep 1)")
    elif precision.mixed:
        raise ValueError(f"calibrate --dtype {dtype} measures the GPT presets; calibrate model file {stack_ref} "
                         f"with --dtype fp32")
    threads = cpu_threads(ranks * tp)
    report = progress or (lambda msg: None)
    report("layers")
    if stack_ref is not None:
        from executor.user_model import DEFAULT_MICRO_BATCH, build_stack
        mb = int(micro_batch or DEFAULT_MICRO_BATCH)
        per, model_spec, act, act_w = measure_stack(stack_ref, mb, threads, repeats, progress=report)
        stack = build_stack(stack_ref, 0)
        opt_model, data = stack_ref, measure_data(None, stack, mb)
        label, run_mb = Path(stack_ref.rsplit(":", 1)[0]).stem, mb
        kept = {"act_bytes": act, "act_w_bytes": act_w}
    else:
        if tp > 1:
            layers = measure_tp_layers(spec, tp, threads, repeats, precision=precision)
            for kind in layers:
                report(f"layer {kind}")
        else:
            layers = measure_layers(spec, threads, repeats, progress=report, precision=precision)
        moe = measure_moe_layers(spec, ep, threads, repeats) if spec.is_moe else None
        if moe is not None:
            report("expert layers")
        moe_block = layers.get("moe_block", layers["block"])
        at_ep = block_at_ep(moe_block, moe, ep)
        per = [layers["embedding"]] + [at_ep if spec.is_moe and i >= spec.dense_layers else layers["block"]
                                       for i in range(spec.layers)] + [layers["head"]]
        per_ep1 = [layers["embedding"]] + [moe_block if spec.is_moe and i >= spec.dense_layers else layers["block"]
                                           for i in range(spec.layers)] + [layers["head"]] if ep > 1 else None
        model_spec, kept = spec, kept_bytes(per)
        opt_model, data = spec, measure_data(spec)
        label, run_mb = spec.name, micro_batch
    report("optimizer")
    opt = measure_optimizer(opt_model, threads)
    report("communication")
    comm = measure_comm(opt_model, max(2, ranks), max(12, repeats), tp=tp)
    a2a = ()
    if ep > 1:
        report("all-to-all")
        a2a = tuple(measure_a2a(model_spec, ep, max(12, repeats)))
    return HostMeasurements(model=model, label=label, model_spec=model_spec, micro_batch=run_mb, ranks=ranks,
                            threads=threads, per=per, dtype=dtype, kept=kept, tp=tp,
                            optimizer=max(opt, comm["optimizer_per_param"]), data=data, comm=comm,
                            ep=ep, moe=None if stack_ref is not None else moe, a2a=a2a,
                            per_ep1=None if stack_ref is not None else per_ep1)


def block_at_ep(t: dict, moe: dict | None, ep: int) -> dict:
    """A MoE block's times and kept bytes ``t`` (measured at EP 1: every expert local) as an EP rank
    of ``ep`` runs it: its routed experts' part exchanged for EP rank 0's experts on the rows its
    EP peers route to them (``moe["experts"]`` in place of ``moe["experts_ep1"]``, both measured
    alone, :func:`calibration.measure.measure_moe_layers`), for F, B, B_input, W and the bytes kept
    without recomputation and with selective recomputation (which keeps the MLP's tensors; full
    recomputation keeps the block's input only: unchanged). The all-to-alls are priced apart (the
    profile's ``all_to_all``). At EP 1 (or no ``moe``): ``t``."""
    if moe is None or ep == 1:
        return t
    at, one = moe["experts"], moe["experts_ep1"]
    out = dict(t, **{k: t[k] + at[k] - one[k] for k in ("f", "b", "b_input", "w")})
    out["act"] = t["act"] + at["act"] - one["act"]
    out["act_w"] = t["act_w"] + at["act_w"] - one["act_w"]
    out["act_recompute"] = {m: v + (at["act"] - one["act"] if m in ("none", "selective") else 0)
                            for m, v in t["act_recompute"].items()}
    return out


def check_ep(spec, ep: int, tp: int = 1) -> None:
    """What calibrate / validate --ep can measure, one line each: a mixture of experts whose experts
    E divides, at T = 1 (the executor folds the experts over the data-parallel replicas only)."""
    if ep == 1:
        return
    if not spec.is_moe:
        raise ValueError(f"--ep {ep} splits a mixture of experts' routed experts; model {spec.name} is dense "
                         f"(e.g. --model tiny-mixtral)")
    if spec.experts % ep:
        raise ValueError(f"--ep {ep} does not divide the {spec.experts} experts of {spec.name}; pick a divisor")
    if tp > 1:
        raise ValueError(f"--ep {ep} with --tp {tp}: the executor folds the experts over the data-parallel "
                         f"replicas only; calibrate with --tp 1")


def host_profile(host: HostMeasurements, scale: dict | None = None, overhead: dict | None = None, *,
                 time_slice: float | None = None, p2p_extra: float = 0.0, ar_slowdown: float = 1.0,
                 meta: dict | None = None) -> CalibrationProfile:
    """The profile of ``host``'s measurements on this host's cores: the layers' alone times times
    the runtime's ``scale`` per kind (F, B, Bi, W, OPTIM; default 1), ``overhead`` per op kind (s;
    default none), the OS ``time_slice``, and the in-run communication (extra P2P latency,
    all-reduce slowdown over the lone fits). ``meta`` is kept, with the scale and the fits added.

    With an EP group, one synchronous all-to-all round's in-run cost (``a2a_round``, what the
    simulator prices each counts' round of a MoE block's F at, on the op's compute stream:
    :meth:`cost_models.profile.CalibrationProfile.a2a_forward_parts`) is the in-run P2P message
    latency (ping-pong latency + the fitted extra), not a fit of its own: an E = 2 traced run (the
    one that would fit it, as the extra P2P latency is fitted on E = 1 runs) is not in the sitting
    yet, and on tiny-mixtral D 1 N 8 E 2 under --dp 2 --ep 2 the segments holding such a round
    carried 1.8-2.4 ms a round in the run against a 1.87 ms in-run P2P latency that sitting, while
    the all-to-all fit (alone, after a barrier) allows ~0.4 ms: a gloo round in a run costs what a
    message does, not what it costs alone."""
    scale, overhead, comm = dict(scale or {}), dict(overhead or {}), host.comm
    fits = host.link_fits
    lat, bw, ar_lat, ar_bw = (fits[k] for k in ("p2p_latency", "p2p_bandwidth", "allreduce_latency",
                                                "allreduce_bandwidth"))
    timing = [scale_layer(x, scale) for x in host.per]
    tp_ar = LinkSpec("calibrated-tp-allreduce", fits["tp_allreduce_bandwidth"], fits["tp_allreduce_latency"]) \
        if host.tp > 1 else None
    a2a = LinkSpec("calibrated-all-to-all", fits["a2a_bandwidth"], fits["a2a_latency"]) if host.a2a else None
    experts = tuple((k, LayerTiming(v["f"], v["b_input"], v["w"], v["b"])) for k, v in (host.moe or {}).items())
    a2a_meta = {"a2a_samples": [list(x) for x in host.a2a]} if host.a2a else {}
    return CalibrationProfile(
        name=f"{platform.node() or 'host'}-{host.label}" + (f"-tp{host.tp}" if host.tp > 1 else "")
        + (f"-ep{host.ep}" if host.ep > 1 else ""),
        model=host.model_spec, tp=host.tp, tp_allreduce=tp_ar, ep=host.ep, all_to_all=a2a,
        a2a_residual=fits.get("a2a_residual"), a2a_round=lat + p2p_extra if a2a else None, expert_layers=experts,
        layers=tuple(LayerTiming(x["f"], x["b_input"], x["w"], x["b"]) for x in timing),
        p2p=LinkSpec("calibrated-p2p", bw, lat + p2p_extra),
        allreduce=LinkSpec("calibrated-allreduce", ar_bw / ar_slowdown, ar_lat * ar_slowdown),
        optimizer_seconds_per_param=host.optimizer * scale.get("OPTIM", 1.0), copy_time=0.0, memory_bytes=None,
        overhead=tuple(sorted(overhead.items())), cores=os.cpu_count() or 1, data_time=host.data,
        grad_copy_per_byte=comm["grad_copy_per_byte"], time_slice=time_slice, precision=host.dtype, **host.kept,
        meta=dict(meta or {}, **a2a_meta, runtime_scale=scale, alone={"p2p_latency": lat, "allreduce_latency": ar_lat,
                                                          "allreduce_bandwidth": ar_bw},
                  in_run={"p2p_latency_extra": p2p_extra, "allreduce_slowdown": ar_slowdown}))


def speed_yardstick(profile: CalibrationProfile) -> Callable[[RunConfig], object | None]:
    """The yardstick of a traced step's speed (:mod:`calibration.sitting`: one host state for every
    config of a sitting): ``yardstick(config)`` is the config's compute op costs as measured alone
    (``StageCosts``), the profile's layer times divided by the scale its runtime fit applied
    (``meta["runtime_scale"]``), no per-op overheads; None where the config's ranks outnumber the
    profile's cores (an op's duration then includes its waits for a core; a rank is ``tp`` processes)."""
    sc = profile.meta.get("runtime_scale") or {}
    alone = replace(profile, overhead=(), layers=tuple(
        LayerTiming(t.f / sc.get("F", 1.0), t.b_input / sc.get("Bi", 1.0), t.w / sc.get("W", 1.0),
                    None if t.b is None else t.b / sc.get("B", 1.0)) for t in profile.layers))
    cores = profile.cores or os.cpu_count() or 1

    def of(config: RunConfig):
        low = lowered_schedule(config)
        if low.num_ranks * profile.tp > cores:
            return None
        return alone.cost_model(low.num_stages, config.stage_layers, recompute=config.parallel.recompute).bind(low)
    return of


def host_yardstick(host: HostMeasurements) -> Callable[[RunConfig], object | None]:
    """:func:`speed_yardstick` before the runtime fit, for a sitting of ``host``'s traced runs (E = 1)
    and runs at the host's E: each config on the host as it runs it (:meth:`HostMeasurements.traced`
    at E = 1, else ``host``, the all-to-alls' fitted seconds in its MoE blocks' ops)."""
    at_ep, traced = speed_yardstick(host_profile(host)), speed_yardstick(host_profile(host.traced()))
    return lambda config: (traced if config.parallel.ep == 1 else at_ep)(config)


def fit_profile(host: HostMeasurements, base: list[RunSeries]) -> CalibrationProfile:
    """The profile: ``host``'s measurements with the runtime fitted on the traced ``base`` runs
    (:func:`runtime_configs` at :func:`fit_ranks` ranks). When ``host.ranks`` outnumber the cores,
    those runs have that many ranks, the simulator time-slices the cores, and the slice is
    fitted with the rest (:func:`calibration.fit.fit_time_slice`)."""
    ranks, comm = host.ranks, host.comm
    cores = os.cpu_count() or 1
    base_ranks = fit_ranks(ranks, host.tp)
    probes = {str(base_ranks): probe_seconds(base)}
    sitting = {str(base_ranks): sitting_record(base)}
    meta = {"host": platform.node(), "torch": str(torch.__version__), "threads_per_rank": host.threads,
            "ranks": ranks, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "p2p_samples": [list(x) for x in comm["p2p"]], "allreduce_samples": [list(x) for x in comm["allreduce"]],
            "runtime_schedules": [x.config.layout.schedule for x in base]}
    if host.tp > 1:
        meta["tp_allreduce_samples"] = [list(x) for x in comm["tp_allreduce"]]

    def make_profile(scale: dict, overhead: dict, time_slice: float | None = None, p2p_extra: float = 0.0,
                     ar_slowdown: float = 1.0, of: HostMeasurements = host) -> CalibrationProfile:
        return host_profile(of, scale, overhead, time_slice=time_slice, p2p_extra=p2p_extra, ar_slowdown=ar_slowdown,
                            meta=dict(meta, runtime_fit_ranks=base_ranks, probe_seconds=dict(probes),
                                      sitting=dict(sitting)))

    traced = host.traced()      # what the traced runs run (E = 1): the fits simulate them on it

    def fit(time_slice: float | None) -> CalibrationProfile:
        # the op costs first (op totals), then the in-run communication on the step times
        scale, overhead = fit_runtime(base, lambda sc, ov: make_profile(sc, ov, time_slice, of=traced))
        p2p_extra, ar_slowdown = fit_communication(
            base, lambda p, a: make_profile(scale, overhead, time_slice, p, a, of=traced))
        return make_profile(scale, overhead, time_slice, p2p_extra, ar_slowdown)

    if base_ranks * host.tp > cores:
        return fit_time_slice(base, fit)[1]
    return fit(None)


def runtime_rules(runtime_steps: int = 20, runtime_repeats: int = 3) -> SittingRules:
    """The sitting rules of calibration's traced runs: ``runtime_repeats`` quiet runs per config at
    least (twice as many rounds at most), the first 2 of ``runtime_steps`` steps dropped."""
    if runtime_steps < 3 or runtime_repeats < 1:
        raise ValueError(f"the traced runs need >= 3 steps (2 are dropped) and >= 1 repeat; got {runtime_steps} "
                         f"steps, {runtime_repeats} repeats")
    return SittingRules(runs=runtime_repeats, max_runs=2 * runtime_repeats, warmup=2)


def calibrate(model: str = "tiny", *, ranks: int = 2, repeats: int = 20, progress=None, micro_batch: int | None = None,
              runtime_steps: int = 20, runtime_repeats: int = 3, rules: SittingRules | None = None,
              dtype: str = "fp32", tp: int = 1, ep: int = 1) -> CalibrationProfile:
    """Measure this machine (see the module docstring); ``ranks`` is how many ranks the runs to be
    predicted put on this host (it sets the thread count per rank, like the executor does).
    ``model``: a GPT preset / YAML file, or a model file ``PATH.py:FUNC`` measured at
    ``micro_batch`` samples (default :data:`executor.user_model.DEFAULT_MICRO_BATCH`).
    ``runtime_steps`` / ``runtime_repeats``: the traced runs the runtime is fitted on (steps each,
    quiet runs per config at least: :func:`runtime_rules`); ``rules`` replaces those rules
    (:class:`calibration.sitting.SittingRules`). All traced runs share one sitting (interleaved
    rounds, both world sizes). ``dtype``: the precision of the runs to be predicted (fp32 | bf16; a
    model file: fp32). ``tp``: each rank a tensor-parallel group of that many processes (the
    profile's layers are one TP rank's shards; its ``tp_allreduce`` the group's all-reduce). ``ep``:
    a mixture of experts' expert-parallel size (its expert layers at E's routed counts, the EP
    group's all-to-all; the traced runs stay at E = 1: the all-to-alls are priced on their fit)."""
    rules = rules or runtime_rules(runtime_steps, runtime_repeats)
    report = progress or (lambda msg: None)
    host = measure_host(model, ranks=ranks, repeats=repeats, progress=report, micro_batch=micro_batch,
                        dtype=dtype, tp=tp, ep=ep)
    report("runtime (traced runs)")
    series = run_series(host.runtime_configs(fit_ranks(ranks, tp), runtime_steps), rules, progress=report,
                        yardstick=host_yardstick(host))
    return fit_profile(host, series)
