"""Measurements with the executor's own code: layers, communication, data, the optimizer step.

Layers run in this process exactly as :class:`executor.runtime.PipelineRuntime` runs a stage:
the executor's modules (:mod:`executor.model`, or the user's layers of a model file,
:mod:`executor.user_model`), its precision (:mod:`executor.precision`: the forward under bf16
autocast with ``dtype="bf16"``), its saved-tensor meter (:class:`executor.device.SavedTensorMeter`,
with the gradients a split backward keeps from B to W held as the runtime holds them), its backward
calls (:class:`executor.backward.SplitBackward`, one per layer: its graph template warms up in the
untimed runs) and, for the bytes a block keeps under each recomputation mode, its recomputation
hooks (:mod:`executor.recompute`). A user's layer stack is measured layer by
layer (:func:`measure_stack_layers`), each on the output of the layer before it, plus what the
cost models need that no formula gives: parameters and output bytes per layer, FLOPs of each
timed call (``torch.utils.flop_counter.FlopCounterMode``) and the bytes each layer keeps when it
runs after the one before it in one graph (:func:`chain_kept_bytes`) as well as alone.
Timing uses ``torch.utils.benchmark``: a statement that can simply be repeated (a forward, an
optimizer step) is timed by ``Timer.blocked_autorange``; a backward needs a fresh graph before
every run, which ``Timer`` cannot set up untimed, so each run is timed on its own and the runs
are summarised by ``torch.utils.benchmark.Measurement`` (its median); a layer's full backward, its
B_input and its W take turns run by run (:func:`fresh_state_medians`), so that their ratio is not
the host's drift between three separate loops.

With tensor parallelism (T > 1) the layers measured are TP rank 0's shards, the executor's own
layers at 1/T (:mod:`executor.tensor_parallel`: column- and row-parallel linears, the
vocabulary-parallel embedding and loss), in a spawned process that is a process group of its own
(:func:`measure_tp_layers`): their collectives run over that one process (a copy), the group's
all-reduces are measured apart.

Communication runs on spawned gloo ranks (:func:`executor.launch.launch`): one-way P2P times by
ping-pong over message sizes (25th percentile), all-reduces as the runtime launches them (fresh
flat buffer, own group, asynchronous; the median), and, with every rank doing it at once, the
Adam step per parameter and the gradient flatten + write-back per byte. With T > 1, the first T
ranks also all-reduce tensors over a TP group as a layer does (:func:`executor.tensor_parallel.reduce`,
synchronous, over :data:`TP_SIZES`; the median).
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable

import torch
from torch.utils.benchmark import Measurement, TaskSpec, Timer

from cost_models.model_spec import ModelSpec
from executor.backward import SplitBackward, full_backward, weight_backward
from executor.device import SavedTensorMeter, clock
from executor.model import Embedding, block, final_norm, full_model, init_parameters, make_optimizer
from executor.precision import Precision
from executor.recompute import MODES, Recompute
from executor.tensor_parallel import SINGLE, ColumnParallelLinear, TensorParallel, vocab_parallel_cross_entropy

P2P_SIZES = (1 << 10, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22)
AR_SIZES = (1 << 12, 1 << 16, 1 << 18, 1 << 20, 1 << 22)
# a TP group's all-reduces: the loss's statistics (a few KiB) up to the activations of larger models;
# the largest (as AR_SIZES') make the bytes' time stand out of the wake-up noise of the small ones
TP_SIZES = (1 << 10, 1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22)
CPU = torch.device("cpu")
MIN_RUN_TIME = 0.05   # seconds Timer.blocked_autorange spends per statement (at least)


class _Head(torch.nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.norm = final_norm(spec)       # LayerNorm (GPT), RMSNorm (the Llama kind), as the stage's
        self.head = torch.nn.Linear(spec.hidden, spec.vocab, bias=False)

    def forward(self, x, targets):
        logits = self.head(self.norm(x))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class _TPHead(torch.nn.Module):
    """The last stage's head as the executor runs it on a TP rank (:class:`executor.model.StageModule`):
    the final norm, the column-parallel projection onto its vocabulary slice, the vocabulary-parallel loss."""

    def __init__(self, spec: ModelSpec, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.norm = final_norm(spec)
        self.head = ColumnParallelLinear(spec.hidden, spec.vocab, tp, bias=False)

    def forward(self, x, targets):
        return vocab_parallel_cross_entropy(self.head(self.norm(x)), targets, self.tp)


def timer_median(fn: Callable[[], object], label: str) -> float:
    """Median seconds of ``fn()`` by ``torch.utils.benchmark.Timer.blocked_autorange``."""
    return Timer(stmt="fn()", globals={"fn": fn}, label=label,
                 num_threads=torch.get_num_threads()).blocked_autorange(min_run_time=MIN_RUN_TIME).median


def fresh_state_medians(prepare: Callable[[], object], bodies: dict[str, Callable[[object], float | None]],
                        repeats: int, label: str, warmup: int = 3, device: torch.device = CPU) -> dict[str, float]:
    """Median seconds of each ``body(prepare())``, ``prepare`` untimed before every run (a backward
    needs a fresh graph each time): ``repeats`` timed runs of every body after ``warmup`` untimed
    ones, the bodies taking turns run by run (which goes first rotates), so that a slow spell of
    the host hits them alike and their ratios -- (B_input + W) / B -- compare the same moments. A
    body that returns a number returns the seconds of the part that counts (W after an untimed B).
    Times are taken once ``device``'s queued work has finished (:func:`executor.device.clock`)."""
    names = list(bodies)
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(warmup + repeats):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            state = prepare()
            t0 = clock(device)
            part = bodies[name](state)
            dt = clock(device) - t0 if part is None else part
            if i >= warmup:
                times[name].append(dt)
    return {n: Measurement(number_per_run=1, raw_times=t, task_spec=TaskSpec(
        stmt=f"{label} {n}", setup="", num_threads=torch.get_num_threads())).median for n, t in times.items()}


def measure_layer(module: torch.nn.Module, make_input: Callable, kind: str, repeats: int, *,
                  needs_input_grad: bool | None = None, precision: Precision | None = None,
                  recompute: tuple[str, ...] = ("none",), bytes_only: bool = False) -> dict:
    """Times (s) and kept bytes of one layer, run as the runtime runs a stage.

    ``make_input()`` returns (input, extra args); the input is a leaf that requires grad unless it
    is token ids (the embedding; ``needs_input_grad=False``: a first layer). Returns ``f``, ``b``
    (full backward), ``b_input`` and ``w`` (split backward), ``act`` (bytes kept from F to B),
    ``act_w`` (kept from B to W: the retained graph and the gradients B recorded) and
    ``act_recompute`` (``act`` per mode in ``recompute``), ``graph_kept`` (B kept the graph for W:
    an op without a direct weight-gradient recipe, :mod:`executor.backward`). A layer whose output carries no gradient
    (integer outputs, nothing to train before it) has no backward: 0. ``bytes_only``: the bytes, no
    timing (times 0)."""
    precision = precision or Precision()
    params = [p for p in module.parameters()]
    if needs_input_grad is None:
        needs_input_grad = kind != "embedding"
    split = SplitBackward(params)

    parked = []   # what a timed B keeps for W, freed untimed before the next run
    graph_kept = [False]   # whether B kept the graph for W (an op W runs through the engine)

    def forward(meter=None):
        parked.clear()
        x, extra = make_input()
        with precision.autocast(x.device), (meter.capture() if meter is not None else contextlib.nullcontext()):
            return [x, module(x, *extra)]

    def grad_out(out):
        return None if out.dim() == 0 else torch.ones_like(out) * 1e-3

    def kept(mode: str, after_input_grad: bool) -> int:
        meter = SavedTensorMeter(params)   # a fresh count for this one micro-batch
        hooks = Recompute(mode, meter, params).install(module)
        try:
            x, out = forward(meter)
            held = None
            if after_input_grad:            # the runtime keeps the graph and the recorded gradients to W
                _, pending = split.input(out, x if needs_input_grad else None, grad_out(out))
                held = meter.hold(pending.tensors())
                graph_kept[0] = pending.full is not None or any(node is not None for _, node, _, _ in pending.ops)
                out = None                  # and lets go of the output: what B did not run (a first layer's
                                            # lookups) is freed unless W needs it (then pending holds it)
            n = meter.current()
            del x, out, held
            return n
        finally:
            for h in hooks:
                h.remove()

    _, probe_out = forward()
    device = probe_out.device    # where the layer runs: times wait for its queued work
    if not (probe_out.requires_grad and probe_out.is_floating_point()):
        f = 0.0 if bytes_only else timer_median(lambda: forward(), f"{kind} F")
        return {"f": f, "b": 0.0, "b_input": 0.0, "w": 0.0, "act": 0, "act_w": 0,
                "act_recompute": {m: 0 for m in recompute}, "graph_kept": False}
    del probe_out
    act, act_w = kept("none", False), kept("none", True)
    act_recompute = {m: kept(m, False) for m in recompute}
    for p in params:
        p.grad = None
    if bytes_only:
        return {"f": 0.0, "b": 0.0, "b_input": 0.0, "w": 0.0, "act": act, "act_w": act_w,
                "act_recompute": act_recompute, "graph_kept": graph_kept[0]}
    f = timer_median(lambda: forward(), f"{kind} F")

    def split_input(state):
        # as in the runtime, the output is dropped after B: W's end frees the graph
        out = state.pop()
        return split.input(out, state[0] if needs_input_grad else None, grad_out(out))[1]

    def input_only(state) -> float:
        t0 = clock(device)
        pending = split_input(state)
        dt = clock(device) - t0
        parked.append(pending)
        return dt

    def weight_after_input(state) -> float:
        pending = split_input(state)
        t0 = clock(device)
        weight_backward(pending)
        del pending
        return clock(device) - t0

    bodies = {"b": lambda st: _full(st, grad_out), "w": weight_after_input}
    if needs_input_grad:
        bodies["b_input"] = input_only
    med = fresh_state_medians(forward, bodies, repeats, kind, device=device)
    b, b_input, w = med["b"], med.get("b_input", 0.0), med["w"]
    return {"f": f, "b": b, "b_input": b_input, "w": w, "act": act, "act_w": act_w, "act_recompute": act_recompute,
            "graph_kept": graph_kept[0]}


def _full(state, grad_out) -> None:
    out = state.pop()
    full_backward(out, grad_out(out))


def layer_inputs(spec: ModelSpec, device: torch.device = CPU) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inputs :func:`measure_layers` feeds its layers (one generator, seed 0): token ids and
    targets [b, s], hidden states [b, s, h] drawn from N(0, 1)."""
    b, s, h = spec.micro_batch, spec.seq_len, spec.hidden
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, spec.vocab, (b, s), generator=g).to(device)
    targets = torch.randint(0, spec.vocab, (b, s), generator=g).to(device)
    return tokens, targets, torch.randn(b, s, h, generator=g).to(device)


def moe_block(spec: ModelSpec, device: torch.device = CPU) -> tuple[torch.nn.Module, tuple[int, ...]]:
    """The first MoE block as :func:`measure_layers` builds and measures it (EP 1, initialised as a
    run does) and the pairs its router sends to each expert on the measured micro-batch
    (:func:`layer_inputs`' hidden states; dropless: they sum to b s k)."""
    blk = block(spec, index=moe_block_index(spec))
    init_parameters(blk, 0, spec.layers)
    blk.to(device)
    seen = []
    hook = blk.mlp.register_forward_pre_hook(lambda mod, args: seen.append(args[0]))
    try:
        with torch.no_grad():
            blk(layer_inputs(spec, device)[2])
            counts = blk.mlp.route(seen[0]).routing.counts       # the MLP's own routing of what it was given
    finally:
        hook.remove()
    return blk, counts


def measure_layers(spec: ModelSpec, threads: int, repeats: int = 20, progress=None,
                   precision: Precision | None = None, bytes_only: bool = False, device: torch.device = CPU,
                   kinds: tuple[str, ...] = ("embedding", "block", "head"),
                   tp: TensorParallel = SINGLE) -> dict[str, dict]:
    """Per kind (embedding, block, head; ``kinds`` of them): times and kept bytes for one
    micro-batch (a block's kept bytes also under each recomputation mode: blocks are what the
    executor recomputes), computed on ``device`` (a GPU: times wait for its queued kernels).
    ``block`` is the model's first block as the executor builds it (:func:`executor.model.block`:
    GPT, Llama, a MoE block where the first is one); a mixture of experts with dense first layers
    also has ``moe_block`` (its first MoE block, EP 1).
    ``tp``: this process's place in a TP group; its shards of the layers are measured (see
    :func:`measure_tp_layers`)."""
    torch.set_num_threads(threads)
    tokens, targets, hidden = layer_inputs(spec, device)
    emb, blk, head = Embedding(spec, tp), block(spec, tp), (_TPHead(spec, tp) if tp.on else _Head(spec))
    moe = block(spec, tp, index=spec.dense_layers) if spec.is_moe and spec.dense_layers else None
    for m in (emb, blk, head, moe):
        if m is not None:
            init_parameters(m, 0, spec.layers)
            m.to(device)
    cases = {
        "embedding": (emb, lambda: (tokens, ())),
        "block": (blk, lambda: (hidden.clone().requires_grad_(True), ())),
        "head": (head, lambda: (hidden.clone().requires_grad_(True), (targets,))),
    }
    if moe is not None:
        cases["moe_block"] = (moe, lambda: (hidden.clone().requires_grad_(True), ()))
        kinds = tuple(kinds) + (("moe_block",) if "block" in kinds else ())
    unknown = set(kinds) - set(cases)
    if unknown:
        raise ValueError(f"layer kinds are {', '.join(cases)}; got {', '.join(sorted(unknown))}")
    out = {}
    for kind, (mod, mk) in cases.items():
        if kind not in kinds:
            continue
        if progress:
            progress(f"layer {kind}")
        out[kind] = measure_layer(mod, mk, kind, repeats, precision=precision,
                                  recompute=MODES if kind in ("block", "moe_block") else ("none",),
                                  bytes_only=bytes_only)
    return out


def tp_layers_worker(payload, rank, world, local_rank, local_world) -> dict[str, dict]:
    """Spawned process, a process group of its own: TP rank 0's layers of a group of T (their
    collectives over this one process) measured by :func:`measure_layers`."""
    import torch.distributed as dist

    from executor.worker import init_world
    init_world("cpu", rank, world, local_rank, local_world)
    try:
        return measure_layers(payload["spec"], payload["threads"], payload["repeats"], precision=payload["precision"],
                              tp=TensorParallel(payload["tp"], 0, dist.group.WORLD))
    finally:
        dist.destroy_process_group()


def measure_tp_layers(spec: ModelSpec, tp: int, threads: int, repeats: int = 20,
                      precision: Precision | None = None) -> dict[str, dict]:
    """:func:`measure_layers` of TP rank 0 of a group of ``tp``: the executor's TP layers at 1/T,
    exactly as a TP run builds them (its kept bytes are the run's), in a spawned process whose
    process group is itself alone, so that their collectives (over that one process: the copies
    they make) meet no partner; the group's all-reduces are timed apart (:func:`comm_worker`)."""
    from executor.launch import launch
    return launch("calibration.measure:tp_layers_worker",
                  {"spec": spec, "tp": tp, "threads": threads, "repeats": repeats, "precision": precision}, 1)


class _WithLoss(torch.nn.Module):
    """The last layer of a stack with the loss, as the runtime's last stage computes it."""

    def __init__(self, layer: torch.nn.Module, loss):
        super().__init__()
        self.layer = layer
        self._loss = (loss,)

    def forward(self, x, target):
        return self._loss[0](self.layer(x), target)


def _layer_inputs(stack, micro_batch: int):
    """The input of every layer of a stack at the micro-batch (one forward), and the target."""
    from executor.user_model import probe_forward
    x, y, outs, _ = probe_forward(stack, micro_batch)
    return [x] + [o.detach() for o in outs[:-1]], y, [o.detach() for o in outs]


def _stack_case(stack, i: int, inputs, target):
    """(module, make_input, needs_input_grad) of layer ``i`` measured as a stage's first layer."""
    last = i == len(stack.layers) - 1
    mod = _WithLoss(stack.layers[i], stack.loss) if last else stack.layers[i]
    x = inputs[i]
    grad_in = i > 0 and x.is_floating_point()
    extra = (target,) if last else ()
    return mod, (lambda: (x.clone().requires_grad_(True) if grad_in else x, extra)), grad_in


def _addmm_inplace_flops(self_shape, a_shape, b_shape, out_shape=None, **kwargs) -> int:
    """FLOPs of ``self.addmm_(a, b)``: 2 per multiply-accumulate of ``a @ b`` (as addmm's formula)."""
    return 2 * a_shape[0] * a_shape[1] * b_shape[1]


def count_flops(module: torch.nn.Module, make_input: Callable, needs_input_grad: bool) -> tuple[float, ...]:
    """FLOPs (f, b, b_input, w) of the very calls :func:`measure_layer` times (matrix products and
    convolutions, as ``torch.utils.flop_counter`` counts them: 2 per multiply-accumulate)."""
    from torch.utils.flop_counter import FlopCounterMode
    params = list(module.parameters())

    # W accumulates a linear layer's weight gradient in place (executor.backward: addmm_), which
    # the counter's table has no entry for: the same product as addmm
    inplace = {torch.ops.aten.addmm_: _addmm_inplace_flops}

    def counted(fn) -> float:
        with FlopCounterMode(display=False, custom_mapping=inplace) as fc:
            fn()
        return float(fc.get_total_flops())

    def fresh():
        x, extra = make_input()
        return x, module(x, *extra)

    def grad_out(out):
        return None if out.dim() == 0 else torch.ones_like(out) * 1e-3

    f = counted(fresh)
    x, out = fresh()
    if not (out.requires_grad and out.is_floating_point()):
        return f, 0.0, 0.0, 0.0
    b = counted(lambda: full_backward(out, grad_out(out)))
    split = SplitBackward(params)
    x, out = fresh()
    held = []
    bi = counted(lambda: held.append(split.input(out, x if needs_input_grad else None, grad_out(out))[1]))
    if not needs_input_grad:
        bi = 0.0
    w = counted(lambda: weight_backward(held.pop()))
    for p in params:
        p.grad = None
    return f, b, bi, w


def chain_kept_bytes(stack, micro_batch: int) -> list[int]:
    """Bytes each layer adds to the saved tensors when the whole stack (and the loss) runs as one
    graph (the runtime's meter on one forward): a layer that saves the tensor the layer before it
    saved (a pooling after a ReLU) adds only what is new."""
    params = [p for m in stack.layers for p in m.parameters()]
    x, y = stack.sample(torch.Generator().manual_seed(0), micro_batch)
    meter = SavedTensorMeter(params)
    out, before = [], 0
    h = x
    with meter.capture():
        for i, layer in enumerate(stack.layers):
            h = layer(h)
            if i == len(stack.layers) - 1:
                h = stack.loss(h, y)
            out.append(meter.current() - before)
            before = meter.current()
    del h
    return out


def measure_stack_layers(stack, micro_batch: int, threads: int, repeats: int = 20, progress=None) -> list[dict]:
    """Per layer of a user's stack: the times and kept bytes of :func:`measure_layer` (each layer as
    the first of a stage, on the output of the one before it; the last with the loss), FLOPs
    (:func:`count_flops`), parameters, output bytes (what a stage ending there sends; 0 for the
    last layer, whose stage ends in the loss) and ``act_chain`` (:func:`chain_kept_bytes`)."""
    from executor.user_model import LAYER_SECONDS, time_limit
    torch.set_num_threads(threads)
    inputs, target, outs = _layer_inputs(stack, micro_batch)
    chain = chain_kept_bytes(stack, micro_batch)
    rows = []
    n = len(stack.layers)
    for i in range(n):
        mod, make_input, grad_in = _stack_case(stack, i, inputs, target)
        name = type(stack.layers[i]).__name__
        if progress:
            progress(f"layer {i} {name}")
        with time_limit(LAYER_SECONDS, f"model {stack.ref}: measuring layer {i} ({name})"):
            row = measure_layer(mod, make_input, f"layer {i} {name}", repeats, needs_input_grad=grad_in)
        row["flops"] = count_flops(mod, make_input, grad_in)
        row["params"] = sum(p.numel() for p in stack.layers[i].parameters())
        row["out_bytes"] = 0 if i == n - 1 else outs[i].numel() * outs[i].element_size()
        row["act_chain"] = chain[i]
        row["name"] = name
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------- communication
def comm_worker(payload, rank, world, local_rank, local_world):
    """Spawned rank: ping-pong P2P sizes with rank 0 <-> 1, then all-reduce sizes over all ranks."""
    import torch.distributed as dist

    from executor.runtime import flatten, unflatten_into
    from executor.tensor_parallel import reduce
    from executor.worker import init_world
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

    p2p = []
    for size in payload["p2p_sizes"]:
        buf = torch.zeros(size // 4)
        p2p.append((size, timed(lambda b=buf: ping_pong(b), divide=2)))
    # as the runtime does it: a fresh flat buffer, on a group of its own, asynchronous, then wait
    group = dist.new_group(list(range(world)))
    ar = [(size, timed(lambda n=size // 4: dist.all_reduce(torch.ones(n), group=group, async_op=True).wait(),
                       quantile=0.5, reps=2 * repeats))
          for size in payload["ar_sizes"]]
    # the optimizer step and the gradient flatten/write-back as every rank does them at once (the
    # ranks of a bidirectional or data-parallel run step together and share memory bandwidth)
    params = model_parameters(payload["model"])
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = make_optimizer(params, "adam", 1e-3)
    grads = [p.grad for p in params]
    nparams = sum(p.numel() for p in params)
    t_opt = timed(opt.step)
    t_flat = timed(lambda: unflatten_into(flatten(grads), grads))
    # a TP group's all-reduce as a layer does it (executor.tensor_parallel.reduce): ranks 0..T-1
    T = payload.get("tp", 1)
    tp_ar = []
    if T > 1:
        tgroup = dist.new_group(list(range(T)))     # every rank creates it; its members use it
        me = TensorParallel(T, rank, tgroup) if rank < T else None
        if me is not None:      # the group's first collectives set up its connections: untimed
            for size in payload["tp_sizes"]:
                reduce(torch.ones(size // 4), me)
        for size in payload["tp_sizes"]:
            x = torch.ones(size // 4)
            t = timed((lambda x=x: reduce(x, me)) if me is not None else (lambda: None), quantile=0.5,
                      reps=2 * repeats)
            tp_ar.append((size, t))
    dist.barrier()
    dist.destroy_process_group()
    return {"p2p": p2p, "allreduce": ar, "optimizer_per_param": t_opt / nparams,
            "grad_copy_per_byte": t_flat / (4 * nparams), "tp_allreduce": tp_ar}


def model_parameters(model: ModelSpec | str) -> list[torch.nn.Parameter]:
    """The whole model's parameters (each once): the GPT of a spec, or a model file's layers."""
    if isinstance(model, ModelSpec):
        return list(full_model(model).parameters())
    from executor.user_model import build_stack, unique_parameters
    return unique_parameters(build_stack(model, 0).layers)


def measure_comm(model: ModelSpec | str, ranks: int, repeats: int = 10, tp: int = 1) -> dict:
    """``model``: a GPT spec or a model file reference (its parameters time the optimizer step);
    ``tp`` > 1: a TP group's all-reduces too (``"tp_allreduce"``: (bytes, seconds) per size)."""
    from executor.launch import launch
    return launch("calibration.measure:comm_worker",
                  {"repeats": repeats, "p2p_sizes": P2P_SIZES, "ar_sizes": AR_SIZES, "model": model, "tp": tp,
                   "tp_sizes": TP_SIZES}, max(ranks, tp))


def measure_data(spec: ModelSpec | None, stack=None, micro_batch: int = 1) -> float:
    """Seconds to produce one micro-batch (inputs and targets): the synthetic token stream of a GPT
    spec, or a model file's ``sample`` as the executor calls it (:class:`executor.user_model.StackData`)."""
    if stack is not None:
        from executor.user_model import StackData
        src = StackData(stack, micro_batch, 0)
    else:
        from executor.data import TokenSource
        src = TokenSource(spec, 0)
    it = iter(range(10 ** 9))
    return timer_median(lambda: src.batch(0, next(it), 1 << 20), "data")


def measure_optimizer(model: ModelSpec | str, threads: int) -> float:
    """Seconds per parameter of an Adam step (the executor's default optimizer) on this host."""
    torch.set_num_threads(threads)
    params = model_parameters(model)
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = make_optimizer(params, "adam", 1e-3)
    return timer_median(opt.step, "adam step") / sum(p.numel() for p in params)


# ---------------------------------------------------------------------------- mixtures of experts
# bytes one EP rank sends in one all-to-all: the routed rows of a tiny micro-batch (a few KiB) up
# to a larger model's (a few MiB), so that the bytes' time stands out of the latency
A2A_SIZES = (1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22)
MOE_PARTS = ("router", "experts", "experts_ep1", "shared")   # the expert layers a profile keeps


class _Rows(torch.nn.Module):
    """The ``experts`` step of :class:`executor.moe.MoeMLP` on rows grouped as an EP rank receives
    them: ``counts`` per (source EP rank, local expert), source-major (:class:`executor.moe.MoeState`)."""

    def __init__(self, experts, counts: list[int]):
        super().__init__()
        self.experts, self.counts = experts, list(counts)

    def forward(self, rows):
        from executor.moe import MoeState
        return self.experts(MoeState(x=rows, rows=rows, counts=list(self.counts))).rows


def moe_block_index(spec: ModelSpec) -> int:
    """The first MoE block of the spec (after its ``dense_layers``)."""
    if not spec.is_moe:
        raise ValueError(f"model {spec.name} is dense: it has no expert layers to measure (e.g. --model tiny-mixtral)")
    return spec.dense_layers


def routed_counts(spec: ModelSpec, ep: int, seed: int = 0) -> list[list[int]]:
    """Pairs the first MoE block's router (the executor's, initialised as a run initialises it)
    sends from each of ``ep`` EP ranks to each local expert of EP rank 0 (experts 0 .. E/EP-1):
    ``out[source][j]``. Each source routes its own micro-batch (``spec.micro_batch`` x ``seq_len``
    hidden states drawn from N(0, 1), seeded by ``seed`` + source: the EP peers of a run see other
    data), dropless, as :func:`executor.moe.route_tokens` routes them."""
    from executor.model import block
    from executor.moe import route_tokens
    i = moe_block_index(spec)
    blk = block(spec, index=i)
    init_parameters(blk, 0, spec.layers)
    per = spec.experts // ep
    out = []
    for src in range(ep):
        g = torch.Generator().manual_seed(seed + src)
        x = torch.randn(spec.micro_batch * spec.seq_len, spec.hidden, generator=g)
        with torch.no_grad():
            r = route_tokens(blk.mlp.router(x), spec.top_k, spec.router, blk.mlp.router.bias)
        out.append(list(r.counts[:per]))
    return out


def send_split(spec: ModelSpec, ep: int, seed: int = 0) -> list[float]:
    """The share of its routed rows an EP rank (rank 0's micro-batch) sends to each EP rank, as
    the router gives them (uneven: whatever the routing is): pairs for experts of rank e / all pairs."""
    from executor.model import block
    from executor.moe import route_tokens
    blk = block(spec, index=moe_block_index(spec))
    init_parameters(blk, 0, spec.layers)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(spec.micro_batch * spec.seq_len, spec.hidden, generator=g)
    with torch.no_grad():
        counts = route_tokens(blk.mlp.router(x), spec.top_k, spec.router, blk.mlp.router.bias).counts
    per = spec.experts // ep
    sums = [sum(counts[e * per:(e + 1) * per]) for e in range(ep)]
    return [s / sum(sums) for s in sums]


def split_rows(rows: int, shares: list[float]) -> list[int]:
    """``rows`` split by ``shares`` (rounded down, the remainder to the largest share): the send
    counts of one all-to-all."""
    out = [int(rows * s) for s in shares]
    out[max(range(len(shares)), key=lambda e: shares[e])] += rows - sum(out)
    return out


def measure_moe_layers(spec: ModelSpec, ep: int, threads: int, repeats: int = 20) -> dict[str, dict]:
    """The expert layers of the first MoE block, each timed and metered as :func:`measure_layer`
    times a layer (F, B, B_input, W; kept bytes): ``router`` (the gate on the micro-batch's
    tokens), ``experts`` (EP rank 0's E/EP local experts on the rows its EP peers route to them,
    :func:`routed_counts`: the real routed token counts at ``ep``), ``experts_ep1`` (all E experts
    on the micro-batch's own routed rows: the experts inside the block measured at EP 1) and
    ``shared`` (the shared expert on every token; absent without one). Each row also has
    ``rows`` (the rows the step ran on). At EP 1 ``experts`` is ``experts_ep1``."""
    from executor.model import block
    from executor.moe import LocalExperts
    torch.set_num_threads(threads)
    i = moe_block_index(spec)
    blk = block(spec, index=i)
    init_parameters(blk, 0, spec.layers)
    mlp = blk.mlp
    n, h = spec.micro_batch * spec.seq_len, spec.hidden
    g = torch.Generator().manual_seed(0)
    tokens = torch.randn(n, h, generator=g)
    out = {"router": dict(measure_layer(mlp.router, lambda: (tokens.clone().requires_grad_(True), ()),
                                        "router", repeats), rows=n)}
    counts = routed_counts(spec, ep)
    per = spec.experts // ep
    local = LocalExperts(range(per), h, spec.expert_width)
    init_parameters(local, 0, spec.layers)
    cases = {"experts": (local, [c for src in counts for c in src])}
    own = routed_counts(spec, 1)[0]
    cases["experts_ep1"] = (mlp.experts, own)
    for name, (experts, flat) in cases.items():
        rows = torch.randn(sum(flat), h, generator=g)
        mod = _Rows(experts, flat)
        out[name] = dict(measure_layer(mod, lambda r=rows: (r.clone().requires_grad_(True), ()), name, repeats),
                         rows=sum(flat))
    if mlp.shared is not None:
        out["shared"] = dict(measure_layer(mlp.shared, lambda: (tokens.clone().requires_grad_(True), ()), "shared",
                                           repeats), rows=n)
    return out


def a2a_worker(payload, rank, world, local_rank, local_world) -> dict:
    """Spawned EP rank (``world`` of them, one EP group): the executor's all-to-all
    (:meth:`executor.expert_parallel.ExpertParallel.all_to_all`: the row counts exchanged, then the
    rows by ``all_to_all_single`` with uneven splits) timed per size, every rank sending
    ``size`` bytes of rows of width h split as the router splits them (``payload["shares"]``,
    rotated by the rank: each rank's own heaviest destination differs); the median of rank 0's
    times after a barrier. Returns ``{"a2a": [(bytes sent per rank, seconds), ...]}``."""
    import torch.distributed as dist

    from executor.expert_parallel import ExpertParallel
    from executor.worker import init_world
    init_world("cpu", rank, world, local_rank, local_world)
    group = dist.new_group(list(range(world)))
    ep = ExpertParallel(world, rank, group, tuple(range(world)))
    h, shares = payload["hidden"], payload["shares"]
    mine = shares[-rank:] + shares[:-rank] if rank else list(shares)
    samples = []
    for size in payload["sizes"]:
        rows = max(world, size // (4 * h))
        x = torch.randn(rows, h)
        send = split_rows(rows, mine)
        ts = []
        for i in range(payload["repeats"] + 3):
            dist.barrier(group)
            t0 = time.perf_counter()
            ep.all_to_all(x, send)
            if i >= 3:
                ts.append(time.perf_counter() - t0)
        ts.sort()
        samples.append((rows * h * 4, ts[len(ts) // 2]))
    dist.barrier(group)
    dist.destroy_process_group()
    return {"a2a": samples}


def measure_a2a(spec: ModelSpec, ep: int, repeats: int = 20, sizes: tuple[int, ...] = A2A_SIZES) -> list:
    """(bytes each EP rank sends, seconds) of the executor's all-to-all over ``ep`` gloo ranks on
    this host, split unevenly as the spec's router splits a micro-batch (:func:`send_split`)."""
    if ep < 2:
        raise ValueError(f"an all-to-all needs an EP group of >= 2 ranks; got --ep {ep}")
    from executor.launch import launch
    return launch("calibration.measure:a2a_worker", {"hidden": spec.hidden, "shares": send_split(spec, ep),
                                                     "sizes": sizes, "repeats": repeats}, ep)["a2a"]
