"""Calibration: measure this machine with the executor's own code and write a profile.

The profile (format of :mod:`cost_models.calibration`) is what the simulator loads to predict
runs on this machine. What is measured, and how:

1. Layers (in this process, with the thread count one rank uses when ``ranks`` share the host):
   forward, full backward, and the split backward's input-grad and weight-grad parts of the
   embedding, one transformer block and the head (+ loss), built by :mod:`executor.model` and
   run exactly as :class:`executor.runtime.PipelineRuntime` runs them (saved-tensor hooks on,
   ``autograd.grad`` for the split parts). Activation bytes kept from F to B (and from B to W)
   per layer come from the same :class:`executor.device.SavedTensorMeter`.
2. Communication (``ranks`` spawned ranks, gloo): one-way P2P times by ping-pong over message
   sizes, fitted as latency + bytes / bandwidth; all-reduce times over sizes, fitted as a ring;
   and, with every rank doing it at once, the Adam step per parameter (the slower of this and the
   lone measurement is kept) and the gradient flatten + write-back per byte around an all-reduce.
3. The runtime: short executor runs (1F1B, 1F1B-interleaved, ZB-V at D = ``ranks``) are traced;
   per op kind, measured = scale x (layer model) is fitted over all their ops (inside a run the
   ranks share memory bandwidth and caches, and the runtime adds Python dispatch and hooks). SEND/OPTIM get their median duration, RECV the 20th percentile of its
   durations (a receive whose message is already there). See :func:`fit_runtime`.
4. The all-reduce inside a run: a traced Chimera run (one unit) shows how much longer the last
   gradient all-reduce takes there than alone (gloo's threads compete with the ranks for the
   cores); the fitted all-reduce is slowed by that factor (:func:`measure_allreduce_in_run`).

``calibrate(...)`` returns the profile; :func:`cost_models.save_profile` writes it.
"""
from __future__ import annotations

import os
import platform
import statistics
import time
from typing import Callable

import torch

from cost_models.calibration import (CalibrationProfile, LayerTiming, fit_allreduce, fit_latency_bandwidth)
from cost_models.cluster import LinkSpec
from cost_models.model_spec import ModelSpec, load_model
from cost_models.transformer import default_partition

from .device import SavedTensorMeter, cpu_threads
from .model import Block, Embedding, init_parameters

P2P_SIZES = (1 << 10, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22)
AR_SIZES = (1 << 12, 1 << 16, 1 << 18, 1 << 20, 1 << 22)


class _Head(torch.nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.norm = torch.nn.LayerNorm(spec.hidden)
        self.head = torch.nn.Linear(spec.hidden, spec.vocab, bias=False)

    def forward(self, x, targets):
        logits = self.head(self.norm(x))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _median_time(fn: Callable[[], None], repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def measure_layer(module: torch.nn.Module, make_input: Callable, kind: str, repeats: int) -> dict:
    """Times (s) and kept bytes of one layer, run as the runtime runs a stage.

    ``make_input()`` returns (input, extra args); the input is a leaf that requires grad unless it
    is token ids (embedding)."""
    params = [p for p in module.parameters()]
    meter = SavedTensorMeter(params)
    needs_input_grad = kind != "embedding"

    def forward():
        x, extra = make_input()
        with meter.capture():
            out = module(x, *extra)
        return x, out

    def grad_out(out):
        return None if out.dim() == 0 else torch.ones_like(out) * 1e-3

    def kept(after_input_grad: bool) -> int:
        nonlocal meter
        meter = SavedTensorMeter(params)   # a fresh count for this one micro-batch
        x, out = forward()
        if after_input_grad and needs_input_grad:
            torch.autograd.grad(out, (x,), grad_out(out), retain_graph=True)
        n = meter.current()
        del x, out
        return n

    act = kept(False)
    act_w = kept(True)   # the runtime keeps the graph from B to W
    for p in params:
        p.grad = None

    f = _median_time(lambda: forward(), repeats)
    state = {}

    def prep():
        state["x"], state["out"] = forward()

    def timed(body):
        ts = []
        for i in range(repeats + 3):
            prep()
            t0 = time.perf_counter()
            body()
            if i >= 3:
                ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    b = timed(lambda: torch.autograd.backward(state["out"], grad_out(state["out"])))

    def split_input():
        if needs_input_grad:
            torch.autograd.grad(state["out"], (state["x"],), grad_out(state["out"]), retain_graph=True)

    b_input = timed(split_input) if needs_input_grad else 0.0

    def split_weight():
        split_input()
        t0 = time.perf_counter()
        torch.autograd.grad(state["out"], params, grad_out(state["out"]), allow_unused=True)
        state["w"] = time.perf_counter() - t0

    ws = []
    for i in range(repeats + 3):
        prep()
        split_weight()
        if i >= 3:
            ws.append(state["w"])
    return {"f": f, "b": b, "b_input": b_input, "w": statistics.median(ws), "act": act, "act_w": act_w}


def measure_layers(spec: ModelSpec, threads: int, repeats: int = 20, progress=None) -> dict[str, dict]:
    """Per kind (embedding, block, head): times and kept bytes for one micro-batch."""
    torch.set_num_threads(threads)
    b, s, h = spec.micro_batch, spec.seq_len, spec.hidden
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, spec.vocab, (b, s), generator=g)
    targets = torch.randint(0, spec.vocab, (b, s), generator=g)
    emb, blk, head = Embedding(spec), Block(spec), _Head(spec)
    for m in (emb, blk, head):
        init_parameters(m, 0, spec.layers)
    hidden = torch.randn(b, s, h, generator=g)
    cases = {
        "embedding": (emb, lambda: (tokens, ())),
        "block": (blk, lambda: (hidden.clone().requires_grad_(True), ())),
        "head": (head, lambda: (hidden.clone().requires_grad_(True), (targets,))),
    }
    out = {}
    for kind, (mod, mk) in cases.items():
        if progress:
            progress(f"layer {kind}")
        out[kind] = measure_layer(mod, mk, kind, repeats)
    return out


# ---------------------------------------------------------------------------- communication
def _comm_worker(payload, rank, world, local_rank, local_world):
    """Spawned rank: ping-pong P2P sizes with rank 0 <-> 1, then all-reduce sizes over all ranks."""
    import torch.distributed as dist
    from .worker import init_world
    init_world("cpu", rank, world, local_rank, local_world)
    repeats = payload["repeats"]

    def timed(fn, divide=1):
        # scheduling hiccups only ever add time: the 25th percentile is the stable statistic
        ts = []
        for i in range(repeats + 3):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            if i >= 3:
                ts.append((time.perf_counter() - t0) / divide)
        ts.sort()
        return ts[len(ts) // 4]

    def ping_pong(buf):
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        elif rank == 1:
            dist.recv(buf, 0)
            dist.send(buf, 0)

    p2p = [(size, timed(lambda b=torch.zeros(size // 4): ping_pong(b), divide=2)) for size in payload["p2p_sizes"]]
    ar = [(size, timed(lambda b=torch.ones(size // 4): dist.all_reduce(b))) for size in payload["ar_sizes"]]
    # the optimizer step and the gradient flatten/write-back as every rank does them at once (the
    # ranks of a bidirectional or data-parallel run step together and share memory bandwidth)
    from .model import full_model, make_optimizer
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
    m = full_model(payload["spec"])
    params = list(m.parameters())
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = make_optimizer(params, "adam", 1e-3)
    grads = [p.grad for p in params]
    nparams = sum(p.numel() for p in params)
    t_opt = timed(opt.step)

    def flatten_and_write_back():
        flat = _flatten_dense_tensors(grads)
        for g, v in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(v)
    t_flat = timed(flatten_and_write_back)
    dist.barrier()
    dist.destroy_process_group()
    return {"p2p": p2p, "allreduce": ar, "optimizer_per_param": t_opt / nparams,
            "grad_copy_per_byte": t_flat / (4 * nparams)}


def measure_comm(spec: ModelSpec, ranks: int, repeats: int = 10) -> dict:
    from .launch import launch
    return launch("executor.calibrate:_comm_worker",
                  {"repeats": repeats, "p2p_sizes": P2P_SIZES, "ar_sizes": AR_SIZES, "spec": spec}, ranks)


# ---------------------------------------------------------------------------- overheads
def op_samples(trace, predicted: dict[tuple[str, int], float], optim_predicted: dict[int, float],
               split: bool, warmup_steps: int = 1) -> dict[str, list[tuple[float, float]]]:
    """(predicted, measured) seconds of every op after the warm-up, by kind (B of a split
    backward is kind "Bi"); SEND/RECV are predicted 0 (their whole duration is overhead)."""
    t = trace[trace["step"] >= warmup_steps]
    dur = (t["end"] - t["start"]).to_numpy()
    out: dict[str, list[tuple[float, float]]] = {}
    for kind, stage, dev, d in zip(t["kind"], t["stage"], t["device"], dur):
        if kind in ("F", "B", "W"):
            k = "Bi" if (kind == "B" and split) else kind
            out.setdefault(k, []).append((predicted[(kind, int(stage))], float(d)))
        elif kind == "OPTIM":
            out.setdefault(kind, []).append((optim_predicted.get(int(dev), 0.0), float(d)))
        elif kind in ("SEND", "RECV"):
            out.setdefault(kind, []).append((0.0, float(d)))
    return out


def fit_scale(samples: list[tuple[float, float]]) -> float:
    """measured = scale x predicted, with scale the median ratio over the ops (robust to the odd
    descheduled op; a two-parameter fit with an overhead term proved unstable on a busy host)."""
    ratios = sorted(m / p for p, m in samples if p > 0)
    return float(statistics.median(ratios)) if ratios else 1.0


def fit_runtime(samples: dict[str, list[tuple[float, float]]]) -> tuple[dict[str, float], dict[str, float]]:
    """Per op kind: (scale, overhead) of the runtime against the layer model. Compute ops get a
    scale (in a run, ranks share memory bandwidth and caches, and the runtime adds hooks and
    dispatch, so ops run slower than alone); SEND and OPTIM an overhead, their median duration /
    residual, RECV the 20th percentile of its durations (a message that is already there)."""
    scale: dict[str, float] = {}
    overhead: dict[str, float] = {}
    for kind, v in samples.items():
        if kind in ("F", "B", "Bi", "W"):
            scale[kind] = fit_scale(v)
        elif kind == "RECV":
            d = sorted(m for _, m in v)
            overhead[kind] = d[int(0.2 * (len(d) - 1))]
        else:
            overhead[kind] = max(0.0, float(statistics.median(m - p for p, m in v)))
    return scale, overhead


def _stage_prediction(spec, layers: dict, num_stages: int, split: bool):
    timing = [layers["embedding"]] + [layers["block"]] * spec.layers + [layers["head"]]
    parts = default_partition(spec.layers, num_stages)
    pred, start = {}, 0
    for s, n in enumerate(parts):
        sl = timing[start:start + n]
        start += n
        pred[("F", s)] = sum(x["f"] for x in sl)
        pred[("B", s)] = sum(x["b_input"] for x in sl) if split else sum(x["b"] for x in sl)
        pred[("W", s)] = sum(x["w"] for x in sl)
    return pred


def measure_overheads(model: str, spec: ModelSpec, layers: dict, ranks: int, opt_per_param: float,
                      data_time: float, steps: int = 6) -> tuple[dict[str, float], dict[str, float]]:
    """Fit the runtime against the layer model on traced executor runs: 1F1B (whole stages with
    embedding and head), 1F1B-interleaved (inner chunks of blocks only too) and ZB-V (split
    backward). Returns (scale, overhead) per op kind (see :func:`fit_runtime`)."""
    from .config import RunConfig, plan
    from .launch import run_many
    from .model import stage_module
    cfgs = [RunConfig(schedule=s, devices=ranks, microbatches=2 * ranks, steps=steps, model=model)
            for s in ("dapple", "interleaved", "zb-v")]
    results = run_many(cfgs)
    pooled: dict[str, list[tuple[float, float]]] = {}
    for cfg, res in zip(cfgs, results):
        sched = plan(cfg)
        split, S = sched.split_backward, sched.num_stages
        pred = _stage_prediction(spec, layers, S, split)
        pred[("F", 0)] += data_time
        pred[("F", S - 1)] += data_time
        optim = {}
        for r in range(ranks):
            n = sum(p.numel() for _, st in sched.stages_on(r) for p in stage_module(spec, S, st).parameters())
            optim[r] = n * opt_per_param
        if split:   # stage 0: B has no input gradient to produce, W does the whole backward
            pred[("B", 0)] = 0.0
            pred[("W", 0)] = _stage_prediction(spec, layers, S, False)[("B", 0)]
        for k, v in op_samples(res.trace, pred, optim, split).items():
            pooled.setdefault(k, []).extend(v)
    return fit_runtime(pooled)


def measure_allreduce_in_run(model: str, spec: ModelSpec, ranks: int, opt_per_param: float,
                             optim_overhead: float, grad_copy_per_byte: float, fit: LinkSpec,
                             steps: int = 8) -> float:
    """How much slower a gradient all-reduce is inside a run than alone, on a traced Chimera run
    with one unit of micro-batches (both copies of every stage all-reduce at the end). The
    optimizer op waits for the last all-reduce: its duration minus the optimizer step and the
    gradient write-back is that all-reduce's in-run time, compared with the fitted ring time.
    Returns the factor (>= 1) applied to the fitted all-reduce."""
    from cost_models.comm import ring_allreduce_time

    from .config import RunConfig, plan
    from .launch import run
    from .model import stage_module
    D = ranks if ranks % 2 == 0 else ranks + 1
    cfg = RunConfig(schedule="chimera", devices=D, microbatches=D, steps=steps, model=model)
    res = run(cfg)
    sched = plan(cfg)
    S = sched.num_stages
    t = res.trace[res.trace["step"] >= 2]
    ratios = []
    for (dev, step), g in t.groupby(["device", "step"]):
        ars = g[g["kind"] == "ALLREDUCE"].sort_values("seq")
        opt = g[g["kind"] == "OPTIM"]
        if ars.empty or opt.empty:
            continue
        nparams = sum(p.numel() for _, st in sched.stages_on(int(dev)) for p in stage_module(spec, S, st).parameters())
        local = (opt["end"] - opt["start"]).iloc[0] - nparams * opt_per_param - optim_overhead \
            - grad_copy_per_byte * float(ars["bytes"].sum())
        ring = ring_allreduce_time(float(ars["bytes"].iloc[-1]), len(sched.stage_group(int(ars["stage"].iloc[-1]))),
                                   fit.bandwidth, fit.latency)
        if ring > 0:
            ratios.append(local / ring)
    return max(1.0, float(statistics.median(ratios))) if ratios else 1.0


def scale_layers(layers: dict, scale: dict[str, float]) -> dict:
    """Layer times as they run inside a training run: microbenchmarks times the fitted scale."""
    out = {}
    for kind, t in layers.items():
        out[kind] = dict(t, f=t["f"] * scale.get("F", 1.0), b=t["b"] * scale.get("B", 1.0),
                         b_input=t["b_input"] * scale.get("Bi", 1.0), w=t["w"] * scale.get("W", 1.0))
    return out


def measure_data(spec: ModelSpec, repeats: int = 20) -> float:
    """Seconds to produce one micro-batch (inputs and targets) from the synthetic stream."""
    from .data import TokenSource
    src = TokenSource(spec, 0)
    it = iter(range(10 ** 9))
    return _median_time(lambda: src.batch(0, next(it), 1 << 20), repeats)


def measure_optimizer(spec: ModelSpec, threads: int, repeats: int = 10) -> float:
    """Seconds per parameter of an Adam step (the executor's default optimizer) on this host."""
    from .model import full_model, make_optimizer
    torch.set_num_threads(threads)
    m = full_model(spec)
    for p in m.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt = make_optimizer(m.parameters(), "adam", 1e-3)
    t = _median_time(opt.step, repeats)
    return t / sum(p.numel() for p in m.parameters())


def calibrate(model: str = "tiny", *, ranks: int = 2, repeats: int = 20, progress=None) -> CalibrationProfile:
    """Measure this machine (see the module docstring); ``ranks`` is how many ranks the runs to be
    predicted put on this host (it sets the thread count per rank, like the executor does)."""
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
    report("runtime overheads")
    # fitted on runs with as many ranks as the runs to predict: when ranks outnumber the cores,
    # the OS's time slicing costs more than ideal processor sharing, and the fit absorbs that
    scale, overhead = measure_overheads(model, spec, layers, max(2, ranks), opt, data)
    layers = scale_layers(layers, scale)
    overhead.pop("Bi", None)   # one B overhead in the profile: the full backward's
    per = [layers["embedding"]] + [layers["block"]] * spec.layers + [layers["head"]]
    report("all-reduce inside a run")
    ar_fit = LinkSpec("calibrated-allreduce", ar_bw, ar_lat)
    ar_scale = measure_allreduce_in_run(model, spec, max(2, ranks), opt, overhead.get("OPTIM", 0.0),
                                        comm["grad_copy_per_byte"], ar_fit)
    prof = CalibrationProfile(
        name=f"{platform.node() or 'host'}-{model}", model=spec,
        layers=tuple(LayerTiming(x["f"], x["b_input"], x["w"], x["b"]) for x in per),
        p2p=LinkSpec("calibrated-p2p", bw, lat),
        # the all-reduce as it runs inside training: slower than alone by the measured factor
        allreduce=LinkSpec("calibrated-allreduce", ar_bw / ar_scale, ar_lat * ar_scale),
        optimizer_seconds_per_param=opt, copy_time=0.0, memory_bytes=None,
        act_bytes=tuple(float(x["act"]) for x in per), act_w_bytes=tuple(float(x["act_w"]) for x in per),
        overhead=tuple(sorted(overhead.items())), cores=os.cpu_count() or 1, data_time=data,
        grad_copy_per_byte=comm["grad_copy_per_byte"],
        meta={"host": platform.node(), "torch": str(torch.__version__), "threads_per_rank": threads, "ranks": ranks,
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "p2p_samples": [list(x) for x in comm["p2p"]],
              "allreduce_samples": [list(x) for x in comm["allreduce"]],
              "allreduce_in_run_factor": ar_scale})
    return prof
