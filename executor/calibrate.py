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
   sizes, fitted as latency + bytes / bandwidth; all-reduce times over sizes, fitted as a ring.
3. Runtime overheads: a short executor run (gpipe, D = ``ranks``) is traced; per op kind, the
   median of (measured duration - the layer model's prediction) is the overhead the runtime
   adds to every op (Python dispatch, hooks, contention with the other ranks and the transport's
   threads). SEND/OPTIM get their median duration, RECV the 20th percentile of its durations
   (a receive whose message is already there).

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
        ts = []
        for i in range(repeats + 3):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            if i >= 3:
                ts.append((time.perf_counter() - t0) / divide)
        return statistics.median(ts)

    def ping_pong(buf):
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        elif rank == 1:
            dist.recv(buf, 0)
            dist.send(buf, 0)

    p2p = [(size, timed(lambda b=torch.zeros(size // 4): ping_pong(b), divide=2)) for size in payload["p2p_sizes"]]
    ar = [(size, timed(lambda b=torch.ones(size // 4): dist.all_reduce(b))) for size in payload["ar_sizes"]]
    dist.barrier()
    dist.destroy_process_group()
    return {"p2p": p2p, "allreduce": ar}


def measure_comm(ranks: int, repeats: int = 10) -> dict:
    from .launch import launch
    return launch("executor.calibrate:_comm_worker",
                  {"repeats": repeats, "p2p_sizes": P2P_SIZES, "ar_sizes": AR_SIZES}, ranks)


# ---------------------------------------------------------------------------- overheads
def fit_overheads(trace, predicted: dict[tuple[str, int], float], optim_predicted: dict[int, float],
                  warmup_steps: int = 1) -> dict[str, float]:
    """Runtime overhead per op kind from an executor trace and the layer model's predictions
    ``predicted[(kind, stage)]`` (seconds) and ``optim_predicted[rank]``."""
    t = trace[trace["step"] >= warmup_steps]
    dur = (t["end"] - t["start"]).to_numpy()
    res: dict[str, list[float]] = {}
    for kind, stage, dev, d in zip(t["kind"], t["stage"], t["device"], dur):
        if kind in ("F", "B", "W"):
            res.setdefault(kind, []).append(d - predicted[(kind, int(stage))])
        elif kind == "OPTIM":
            res.setdefault(kind, []).append(d - optim_predicted.get(int(dev), 0.0))
        elif kind in ("SEND", "RECV"):
            res.setdefault(kind, []).append(d)
    out = {}
    for kind, vals in res.items():
        vals.sort()
        if kind == "RECV":
            v = vals[int(0.2 * (len(vals) - 1))]
        else:
            v = statistics.median(vals)
        out[kind] = max(0.0, float(v))
    return out


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
                      steps: int = 6) -> dict[str, float]:
    """Fit runtime overheads from a traced executor run (1F1B and its split-backward twin)."""
    from .config import RunConfig
    from .launch import run_many
    from .model import stage_module
    cfgs = [RunConfig(schedule="dapple", devices=ranks, microbatches=2 * ranks, steps=steps, model=model),
            RunConfig(schedule="zb-h1", devices=ranks, microbatches=2 * ranks, steps=steps, model=model)]
    results = run_many(cfgs)
    out: dict[str, list[float]] = {}
    for cfg, res in zip(cfgs, results):
        split = cfg.schedule == "zb-h1"
        pred = _stage_prediction(spec, layers, ranks, split)
        optim = {}
        for r in range(ranks):
            n = sum(p.numel() for p in stage_module(spec, ranks, r).parameters())
            optim[r] = n * opt_per_param
        for k, v in fit_overheads(res.trace, pred, optim).items():
            if k == "W" or not split:
                out.setdefault(k, []).append(v)
    return {k: statistics.median(v) for k, v in out.items()}


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
    steps = [("layers", None), ("optimizer", None), ("communication", None), ("runtime overheads", None)]
    report = progress or (lambda msg: None)
    report(steps[0][0])
    layers = measure_layers(spec, threads, repeats, progress=report)
    report(steps[1][0])
    opt = measure_optimizer(spec, threads)
    report(steps[2][0])
    comm = measure_comm(max(2, ranks), max(5, repeats // 2))
    lat, bw = fit_latency_bandwidth(*zip(*comm["p2p"]))
    ar_lat, ar_bw = fit_allreduce(*zip(*comm["allreduce"]), n=max(2, ranks))
    report(steps[3][0])
    overhead = measure_overheads(model, spec, layers, max(2, ranks), opt)
    per = [layers["embedding"]] + [layers["block"]] * spec.layers + [layers["head"]]
    return CalibrationProfile(
        name=f"{platform.node() or 'host'}-{model}", model=spec,
        layers=tuple(LayerTiming(x["f"], x["b_input"], x["w"], x["b"]) for x in per),
        p2p=LinkSpec("calibrated-p2p", bw, lat), allreduce=LinkSpec("calibrated-allreduce", ar_bw, ar_lat),
        optimizer_seconds_per_param=opt, copy_time=0.0, memory_bytes=None,
        act_bytes=tuple(float(x["act"]) for x in per), act_w_bytes=tuple(float(x["act_w"]) for x in per),
        overhead=tuple(sorted(overhead.items())), cores=os.cpu_count() or 1,
        meta={"host": platform.node(), "torch": str(torch.__version__), "threads_per_rank": threads, "ranks": ranks,
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "p2p_samples": [list(x) for x in comm["p2p"]],
              "allreduce_samples": [list(x) for x in comm["allreduce"]]})
