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
   sizes (25th percentile), fitted as latency + bytes / bandwidth; all-reduce times over sizes as
   the runtime launches them (fresh flat buffer, own group, asynchronous; the median: gloo's
   times spread 3x between wake-ups), fitted as a ring; and, with every rank doing it at once,
   the Adam step per parameter (the slower of this and the lone measurement is kept) and the
   gradient flatten + write-back per byte around an all-reduce. In the simulator an all-reduce
   keeps a core of every member busy (gloo's threads copy and reduce), shared with compute.
3. The runtime, through the simulator: short executor runs (1F1B, 1F1B-interleaved, ZB-V at
   D = :func:`fit_ranks`, the best of 3 each) are traced and simulated with the profile; per op
   kind the compute gets a scale and all compute ops one per-op cost (least squares on measured
   vs simulated totals), OPTIM a scale, SEND the mean residual as a per-op cost, RECV the 20th
   percentile of its durations; repeated to a fixed point (:func:`fit_runtime`). Inside a run ops cost more than alone: the ranks share memory
   bandwidth and caches, the runtime adds hooks and Python dispatch.
4. More ranks than cores (``ranks`` > cores): the OS time-slices them in ~4 ms quanta, which
   costs more than ideal processor sharing. The same runs at D = ``ranks`` give one compute
   slowdown that makes the simulated step times match (:func:`fit_oversubscribed`).

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

    def timed(fn, divide=1, quantile=0.25, reps=repeats):
        # P2P: scheduling hiccups only ever add time, the 25th percentile is the stable statistic;
        # all-reduce: gloo's times spread 3x (thread wake-ups on every ring step), a run meets the
        # typical one, so the median
        ts = []
        for i in range(reps + 3):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            if i >= 3:
                ts.append((time.perf_counter() - t0) / divide)
        ts.sort()
        return ts[int(quantile * (len(ts) - 1))]

    def ping_pong(buf):
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        elif rank == 1:
            dist.recv(buf, 0)
            dist.send(buf, 0)

    p2p = [(size, timed(lambda b=torch.zeros(size // 4): ping_pong(b), divide=2)) for size in payload["p2p_sizes"]]
    # as the runtime does it: a fresh flat buffer, on a group of its own, asynchronous, then wait
    group = dist.new_group(list(range(world)))
    ar = [(size, timed(lambda n=size // 4: dist.all_reduce(torch.ones(n), group=group, async_op=True).wait(),
                       quantile=0.5, reps=2 * repeats))
          for size in payload["ar_sizes"]]
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


# ---------------------------------------------------------------------------- the runtime
RUNTIME_SCHEDULES = ("dapple", "interleaved", "zb-v")   # whole stages, inner chunks, split backward
PROBE = 20   # host speed probe repeats in traced runs (executor.worker.speed_probe)


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


def trace_runtime(model: str, ranks: int, steps: int = 12, repeats: int = 3, warmup_steps: int = 2) -> list:
    """Traced executor runs the runtime is fitted on: :data:`RUNTIME_SCHEDULES` at D = ``ranks``,
    N = 2D, the best of ``repeats`` runs each (:func:`executor.launch.run_best_of`; validation
    compares with the best of its runs too: the model predicts the host undisturbed)."""
    from .config import RunConfig
    from .launch import run_best_of
    cfgs = [RunConfig(schedule=s, devices=ranks, microbatches=2 * ranks, steps=steps, model=model, probe=PROBE)
            for s in RUNTIME_SCHEDULES]
    return [res for res, _ in run_best_of(cfgs, repeats, warmup_steps)]


COMPUTE_KINDS = ("F", "B", "Bi", "W")


def fit_runtime(runs: list, make_profile: Callable[[dict, dict], CalibrationProfile], *,
                warmup_steps: int = 2, iterations: int = 5) -> tuple[dict[str, float], dict[str, float]]:
    """Fit the runtime's costs so that the simulator reproduces the traced ``runs``.

    Inside a run ops cost more than the layers alone (ranks share memory bandwidth and caches)
    and every op pays a fixed cost (Python dispatch, hooks, the runtime's bookkeeping), while
    ranks that outnumber the cores also wait for one: the simulator models that part itself
    (processor sharing). So the fit goes through the simulator: simulate the runs with the
    current profile; per run and compute kind (F, B, split B "Bi", W) take the measured and
    simulated total time; fit measured = scale_kind x simulated + overhead x ops by least squares
    (one per-op overhead shared by the compute kinds: the runs differ in op size, 1F1B's stages
    against the chunks of 1F1B-interleaved and ZB-V, which tells the two apart); scale the
    optimizer step (OPTIM) by measured / simulated total and move SEND's per-op overhead by the
    mean residual; repeat. Totals, not medians: a run pays every op's time, the slow ones
    included. RECV keeps the 20th percentile of its measured durations (a receive whose message
    is already there).

    ``make_profile(scale, overhead)`` builds the profile to simulate with. Returns (scale, overhead).
    """
    from sim.host import simulate_with_profile

    from .config import plan
    scale = {k: 1.0 for k in COMPUTE_KINDS + ("OPTIM",)}
    recv = []
    for res in runs:
        t = res.trace[(res.trace["step"] >= warmup_steps) & (res.trace["kind"] == "RECV")]
        recv += (t["end"] - t["start"]).tolist()
    recv.sort()
    overhead = {"SEND": 0.0, "RECV": recv[int(0.2 * (len(recv) - 1))] if recv else 0.0, "F": 0.0, "B": 0.0, "W": 0.0}
    lows = [plan(res.config) for res in runs]
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
        alpha, c = {k: 1.0 for k in rows}, c_old
        for _ in range(50):   # alternate: per-kind scale for the overhead, overhead for the scales
            alpha = {k: max(1e-3, sum((m - c * n) * x for m, x, n in v) / sum(x * x for _, x, _ in v))
                     for k, v in rows.items()}
            num = sum((m - alpha[k] * x) * n for k, v in rows.items() for m, x, n in v)
            den = sum(n * n for v in rows.values() for _, _, n in v)
            c = max(0.0, num / den) if den else 0.0
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
    from schedules.trace import median_step, step_metrics
    from sim.host import simulate_with_profile

    from .config import plan
    measured = sum(median_step(res.iteration_times, warmup_steps)[0] for res in runs)
    lows = [plan(res.config) for res in runs]
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


def fit_ranks(ranks: int) -> int:
    """Ranks of the runs the runtime is fitted on: no more than the host's cores (at least 2);
    when ``ranks`` is larger, the cost of oversubscribed cores is fitted on runs at ``ranks``."""
    return max(2, min(ranks, os.cpu_count() or 1))


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
    cores = os.cpu_count() or 1
    base_ranks = fit_ranks(ranks)
    report("runtime (traced runs)")
    runs = trace_runtime(model, base_ranks)
    probes = {str(base_ranks): probe_seconds(runs)}
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
            meta=dict(meta, runtime_scale=dict(scale), runtime_fit_ranks=base_ranks, probe_seconds=dict(probes)))

    # the runtime is fitted with no more ranks than cores; what sharing the cores costs beyond
    # ideal processor sharing is fitted on runs with as many ranks as the runs to predict
    scale, overhead = fit_runtime(runs, make_profile)
    slowdown = 1.0
    if ranks > base_ranks:
        report("oversubscribed cores (traced runs)")
        over = trace_runtime(model, ranks)
        probes[str(ranks)] = probe_seconds(over)
        slowdown = fit_oversubscribed(over, lambda x: make_profile(scale, overhead, x))
    prof = make_profile(scale, overhead, slowdown)
    return prof
