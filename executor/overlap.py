"""Overlapped forward/backward pairs, run for real: an F of one micro-batch and the B of another,
interleaved segment by segment, generically from the IR (no model-side code from the user).

Where the lowered schedule pairs an F with the B right after it in its rank's compute order
(``meta["overlapped"]``: DualPipe-V's own pairs, or any family's with ``--overlap-fb``,
:func:`schedules.overlap.pair_forward_backward`), the runtime (:class:`executor.runtime.PipelineRuntime`)
runs the two as one block, as the simulator does (:func:`sim.overlap.overlapped_pair`): the RECVs
the program places between them first, then the block, then the rest (the F's SEND / COPY).

*Segments.* A stage's forward is a list of steps (``module.steps()``: a GPT or Llama stage's
blocks, the embedding folded into the first and the head into the last, :meth:`executor.model.StageModule.steps`;
a layer stack's layers; any other module is one step). A step is a callable, or a :class:`Step`
whose ``exchange`` is the communication at its end (an expert all-to-all, a collective), started
asynchronously. At each cut the forward detaches the tensor that crosses it into a leaf
(``requires_grad``), so each segment has its own autograd graph: :class:`Segment` (its input
leaf, its output, its exchange).

*Coroutines.* :func:`forward_segments` and :func:`backward_segments` are generators: each runs one
segment's compute, starts the segment's exchange (forward: the output; backward, walking the
segments in reverse: the input leaf's gradient, the reverse exchange), yields, and on resuming
waits for it. :func:`interleave` drives the pair in turns: F's segment, B's segment, F's, ... (F
first, as the simulator breaks ties), a turn being the wait for the op's last exchange (if it
started one) and its next segment's compute, so each exchange's wait comes after the other op's
next compute segment and the two ops alternate segment by segment whether a cut exchanges
anything or not. Run alone (an unpaired op) a generator is simply run to its end. An F whose B
will run in a pair is cut even when it runs alone (:class:`executor.runtime.PipelineRuntime`:
a detach at a cut shares storage, the segments keep what the whole forward keeps), so that every
paired B interleaves, as the simulator's pair overlaps it.

*Backward per segment.* Full: ``autograd.backward(out, grad)`` on the segment's graph (parameter
gradients accumulate), the leaf's ``.grad`` is the gradient of the segment before. Split (B then
W): the segment's B is :meth:`executor.backward.SplitBackward.input` on the segment's graph (one
SplitBackward per stage module and segment, so each keeps its graph template), its
:class:`~executor.backward.PendingWeightGrad` kept; W runs every segment's pending weight
gradients (:func:`executor.backward.weight_backward`).

*Mixtures of experts* (:func:`block_steps`). A block whose MLP is :class:`executor.moe.MoeMLP` is cut
at its two all-to-alls into three segments, by the MLP's own steps: (1) ``x1 = x + attn(ln1(x))``,
``h = ln2(x1)``, ``route`` (gate, top-k, balance loss, rows in expert order); the dispatch:
the experts' counts exchanged at once (a few ints, blocking), the rows started with
``ep.start_all_to_all``; (2) ``experts`` on the rows received; the combine, started alike; (3)
``unpermute`` (the weighted sum back into token order, the shared expert) and the residual. What
crosses a cut is then a tuple: x1, h, the rows, the gate weights and the balance loss (tensors, made
leaves) and the routing's record (indices and counts); a tensor a segment does not use passes
through it as the same leaf. Backward exchanges the rows' gradient in reverse (the counts
received go back as the counts sent). A dense block at T = 1 (no communication) stays one segment;
a dense block at T > 1 is cut in two at its row-parallel reductions (:func:`tp_block_steps`).

*Split backward of a tuple segment* (a MoE block's; a TP block's too: (x, p) and the pending
residual cross its cuts, so under a split backward W keeps those segments' graphs, more than an
uncut TP block's ``act_w``; and with full recomputation the retained graph's recomputed values go
uncounted). :class:`executor.backward.SplitBackward`'s templates take one output and one input;
a segment with a tuple input or output takes B as ``autograd.grad`` of its leaves with the graph
kept, and W as ``autograd.backward`` with the parameters as the only inputs
(:class:`RetainedWeightGrad`): the same sums, the chain between re-run in W, and the graph (not
only the linear layers' inputs) alive from B to W for those segments.

*Recompute.* The units of :mod:`executor.recompute` are the transformer blocks (a layer stack's
layers), and cuts fall on unit boundaries: a recomputed unit lies inside one segment and its
saved-tensor hooks re-run that unit only, from the leaf it was given, inside that segment's
backward. A mixture-of-experts block cut at its all-to-alls is recomputed per segment
(:meth:`executor.recompute.Recompute.run_unit` around each of its three steps): a recomputation
re-runs that segment's compute from the leaves it was given, never an all-to-all; a dense TP block
likewise per segment (:func:`tp_block_steps`), never a reduction at a cut (with sequence
parallelism the all-gathers in front of the column-parallel linears lie inside the segments and a
full recomputation runs them again in B, as an uncut block's does). Nothing is re-run across a cut,
whatever the interleaving (torchtitan's threaded
DualPipeV recomputed across the other micro-batch's work and did not compose with checkpointing).

Equality: per segment, the forward computes exactly what the unsegmented forward does (the same
ops on the same values: a detach changes no value); the backward computes the same gradients with
the chain rule applied at the cuts by hand, so losses and parameters equal the unpaired run's and
the single-process reference's up to the order of floating-point sums (within 1e-5 in fp32).

*Trace.* As the simulator records a pair: the F row spans the block, the B row is zero-length at
its end, the F's SEND / COPY after. The sub-phases (each segment's compute and each exchange's
wait) are recorded per pair as :class:`Phase` rows, kept on the runtime (``phases``) with the
kinds the simulator's two-stream pair uses (compute / comm).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, NamedTuple

import torch

COMPUTE, COMM = "compute", "comm"


@dataclass(frozen=True)
class Step:
    """One segment of a stage's forward: ``compute`` (the previous segment's output -> this one's),
    then, when ``exchange`` is given, the communication at the cut after it: ``exchange.start(y)``
    returns a handle whose ``wait()`` gives the next segment's input, ``exchange.start_back(g)`` the
    handle of the reverse exchange of a gradient (both asynchronous)."""

    compute: Callable
    exchange: Any = None


class Segment(NamedTuple):
    """A segment's own autograd graph: ``inp`` its input (a leaf, or the stage's input for the first),
    ``out`` its output, ``exchange`` the communication after it (None: none)."""

    inp: Any
    out: torch.Tensor
    exchange: Any


class Phase(NamedTuple):
    """One sub-phase of an overlapped pair as the runtime ran it: the op's token, the segment, the
    kind (compute, or comm: waiting for an exchange), start and end on the rank's clock."""

    token: str
    segment: int
    kind: str
    start: float
    end: float


def steps_of(module, recompute=None) -> list:
    """The segments of ``module``'s forward (``module.steps()`` where it has it, a mixture of
    experts' blocks cut at their all-to-alls by :func:`block_steps`), else the module as one step.
    ``recompute`` (:class:`executor.recompute.Recompute`): a block's steps are recomputed as units of
    their own."""
    steps = getattr(module, "steps", None)
    if not callable(steps):
        return [module]
    try:
        return list(steps(split=lambda b, last=False: block_steps(b, recompute, last)))
    except TypeError:                       # a steps() without a split (a layer stack's)
        return list(steps())


def _compute(step):
    return step.compute if isinstance(step, Step) else step


def _exchange(step):
    return getattr(step, "exchange", None)


def _items(v) -> tuple:
    return v if isinstance(v, tuple) else (v,)


def _like(items: tuple, single: bool):
    return items[0] if single else items


def _rebuilt(v, items: tuple):
    """``items`` in the form of ``v``: a tensor, a tuple, or a named tuple of ``v``'s type."""
    if not isinstance(v, tuple):
        return items[0]
    return type(v)(*items) if hasattr(v, "_fields") else items


def differentiable(v) -> list[int]:
    """Positions of a crossing value (a tensor, or a tuple of tensors and other things) that carry a
    gradient."""
    return [i for i, t in enumerate(_items(v)) if torch.is_tensor(t) and t.requires_grad]


def _leaves(v, like):
    """``v`` (what crossed a cut) with each tensor where ``like`` (the segment's output) requires
    grad detached into a leaf that requires grad."""
    items, ref = _items(v), _items(like)
    out = tuple(t.detach().requires_grad_(True) if torch.is_tensor(r) and r.requires_grad else t
                for t, r in zip(items, ref))
    return _rebuilt(v, out)


def _detached(v):
    items = tuple(t.detach() if torch.is_tensor(t) else t for t in _items(v))
    return _rebuilt(v, items)


def forward_segments(steps: list, x, enter: Callable, finish: Callable | None = None) -> Iterator:
    """F as a generator over ``steps`` (see the module docstring): yields after each segment but
    the last; returns the list of :class:`Segment`. ``enter()`` is the context each segment's
    compute runs in (autocast, the memory meter); ``finish(out)``, inside the last segment's, maps
    the last output (the loss of a last stage). What crosses a cut is a tensor or a tuple (tensors
    and other things: a mixture of experts' routing); its tensors that require grad become leaves."""
    segs = []
    n = len(steps)
    v = x
    for i, step in enumerate(steps):
        with enter():
            out = _compute(step)(v)
            if i == n - 1 and finish is not None:
                out = finish(out)
        ex = _exchange(step) if i < n - 1 else None
        segs.append(Segment(v, out, ex))
        if i == n - 1:
            break
        handle = ex.start(_detached(out)) if ex is not None else None
        yield COMPUTE
        if handle is not None:
            nxt = handle.wait()
            yield COMM
        else:
            nxt = out
        v = _leaves(nxt, out)
    return segs


def backward_segments(segs: list[Segment], grad, run: Callable) -> Iterator:
    """B as a generator over a forward's segments, last first: ``run(i, seg, g)`` is the backward
    of segment i given its output's gradient ``g`` (None on a loss; a tuple where the output is
    one, None where a place carries none) and returns its input's gradient (alike); the reverse
    exchange of that gradient is started, the generator yields and then waits for it. Returns the
    gradient of the first segment's input."""
    g = grad
    gx = None
    for i in range(len(segs) - 1, -1, -1):
        gx = run(i, segs[i], g)
        if i == 0:
            break
        ex = segs[i - 1].exchange
        handle = ex.start_back(gx, segs[i].inp) if ex is not None else None
        yield COMPUTE
        if handle is not None:
            g = handle.wait()
            yield COMM
        else:
            g = gx
    return gx


def input_grads(seg: Segment, has_input: bool):
    """The gradient of a segment's input after its backward ran: its leaves' ``.grad`` (zeros where
    none arrived), None where the input carries none (token ids; a routing record)."""
    if not has_input:
        return None
    out = tuple((t.grad if t.grad is not None else torch.zeros_like(t))
                if torch.is_tensor(t) and t.requires_grad else None for t in _items(seg.inp))
    return _like(out, not isinstance(seg.inp, tuple))


def _roots(seg: Segment, g) -> tuple[list, list]:
    """The outputs of a segment that carry a gradient and their gradients (None on a loss: ones)."""
    outs = _items(seg.out)
    gs = _items(g) if g is not None else (None,) * len(outs)
    pick = [(o, x) for o, x in zip(outs, gs) if torch.is_tensor(o) and o.requires_grad and (x is not None or g is None)]
    return [o for o, _ in pick], [torch.ones_like(o) if x is None else x for o, x in pick]


def tuple_backward(seg: Segment, g) -> None:
    """The full backward of a segment whose output or input is a tuple (a MoE block's segments)."""
    outs, gs = _roots(seg, g)
    if outs:
        torch.autograd.backward(outs, gs)


class RetainedWeightGrad:
    """W of a segment whose output or input is a tuple: B took the input gradients from the graph,
    kept (``retain_graph``), W takes the parameters' from it (``autograd.backward`` with the
    parameters as the only inputs: the chain between runs again, the price of a segment the
    template machinery of :mod:`executor.backward`, one output and one input, does not cover)."""

    full = None

    def __init__(self, outs: list, grads: list, params: list):
        self.outs = [o for o in outs if o.grad_fn is not None]
        self.grads = [x for o, x in zip(outs, grads) if o.grad_fn is not None]
        self.params = params

    def tensors(self) -> list:
        return list(self.grads)

    def weight(self) -> None:
        if self.outs:
            torch.autograd.backward(self.outs, self.grads, inputs=self.params)
        self.outs, self.grads = [], []


def tuple_input_backward(seg: Segment, g, has_input: bool, params: list):
    """B of a split backward for a tuple segment: the input gradients now, the rest for W."""
    outs, gs = _roots(seg, g)
    leaves = [t for t in _items(seg.inp) if torch.is_tensor(t) and t.requires_grad] if has_input else []
    got = torch.autograd.grad(outs, leaves, gs, retain_graph=True, allow_unused=True) if outs and leaves else ()
    it = iter(got)
    grads = None
    if has_input:
        grads = []
        for t in _items(seg.inp):
            if torch.is_tensor(t) and t.requires_grad:
                x = next(it, None)
                grads.append(torch.zeros_like(t) if x is None else x)
            else:
                grads.append(None)
        grads = _like(tuple(grads), not isinstance(seg.inp, tuple))
    return grads, RetainedWeightGrad(outs, gs, params)


def is_tuple_segment(seg: Segment) -> bool:
    return isinstance(seg.out, tuple) or isinstance(seg.inp, tuple)


def run_alone(gen: Iterator):
    """Run a segment generator to its end; its return value."""
    while True:
        try:
            next(gen)
        except StopIteration as stop:
            return stop.value


def interleave(f_gen: Iterator, b_gen: Iterator, f_token: str, b_token: str, clock: Callable[[], float],
               sync: Callable[[], None] = lambda: None) -> tuple[Any, Any, list[Phase]]:
    """Drive an F and a B generator alternately (F first), one turn of each in turn, until both
    end: a turn is one segment's compute, preceded by the wait for the exchange the op started at
    its previous cut (if any); so each exchange's wait comes after the other op's next compute
    segment, and the pair alternates F's segment 1, B's last, F's segment 2, B's next-to-last, ...
    whether or not a cut exchanges anything (:func:`cost_models.memory.pair_peak`'s order).
    Returns their values and the :class:`Phase` rows (``clock`` the rank's clock, ``sync`` the
    device synchronisation before a phase's end is read)."""
    gens = [f_gen, b_gen]
    tokens = (f_token, b_token)
    seg = [0, 0]
    values = [None, None]
    alive = [True, True]
    phases = []
    while alive[0] or alive[1]:
        for k in (0, 1):
            kind = COMM
            while alive[k] and kind == COMM:     # a turn: the wait for the op's exchange (if any), a segment
                t0 = clock()
                try:
                    kind = next(gens[k])
                except StopIteration as stop:
                    values[k] = stop.value
                    alive[k] = False
                    kind = COMPUTE
                sync()
                phases.append(Phase(tokens[k], seg[k], kind, t0, clock()))
                if kind == COMPUTE:
                    seg[k] += 1
    return values[0], values[1], phases


# ---------------------------------------------------------------------------- mixture-of-experts blocks
def is_moe_block(block) -> bool:
    """A pre-norm block (``ln1``, ``attn``, ``ln2``) whose ``mlp`` is a mixture of experts written as
    the steps route / dispatch / experts / combine / unpermute (:class:`executor.moe.MoeMLP`)."""
    mlp = getattr(block, "mlp", None)
    return all(hasattr(block, n) for n in ("ln1", "attn", "ln2")) and \
        all(hasattr(mlp, n) for n in ("route", "dispatch_counts", "experts", "unpermute", "ep"))


def block_steps(block, recompute=None, last: bool = False) -> list:
    """A block's steps: a mixture-of-experts block (:func:`is_moe_block`) in three, cut at its
    dispatch and combine all-to-alls (``x + attn(ln1(x))``, ``ln2`` and the routing; the local
    experts; the weighted sum back into token order, the shared expert and the residual: the
    block's forward, ``x + mlp(ln2(x + attn(ln1(x))))``, by the MoE MLP's own steps); any other
    block is one step. ``recompute``: each step is recomputed as a unit of its own, so a
    recomputation re-runs its segment only, never an all-to-all."""
    run = recompute.run_unit if recompute is not None else (lambda fn, *a: fn(*a))
    if is_tp_block(block):
        return tp_block_steps(block, run, last)
    if not is_moe_block(block):
        return [lambda v: block(resolved(v))]
    mlp = block.mlp
    return [Step(lambda x: run(_moe_in, block, resolved(x)), _Dispatch(mlp)),
            Step(lambda v: run(_moe_experts, block, v), _Combine(mlp)),
            lambda v: run(_moe_out, block, v)]


class _Routed(NamedTuple):
    """What crosses a MoE block's cuts besides its tensors: the routing, the counts of the rows
    received (per EP source and local expert), the rows received from and sent to each EP rank."""

    routing: Any
    counts: Any = None
    recv: Any = None
    send: Any = None


def _moe_in(block, x):
    """x1 = x + attn(ln1(x)); h = ln2(x1); route h. Crossing: (x1, h, rows, weight, aux, _Routed)."""
    x1 = x + block.attn(block.ln1(x))
    h = block.ln2(x1)
    st = block.mlp.route(h)
    r = st.routing
    return (x1, h, st.rows, r.weight, r.aux, _Routed(r))


def _moe_experts(block, v):
    from .moe import MoeState
    x1, h, rows, w, aux, meta = v
    st = block.mlp.experts(MoeState(h, meta.routing, rows, meta.counts, meta.recv))
    return (x1, h, st.rows, w, aux, meta)


def _moe_out(block, v):
    from dataclasses import replace

    from .moe import MoeState
    x1, h, rows, w, aux, meta = v
    return x1 + block.mlp.unpermute(MoeState(h, replace(meta.routing, weight=w, aux=aux), rows))


_ROWS = 2    # the rows' place in the crossing tuple


class _Handle:
    """An exchange in flight: ``wait()`` gives the crossing value (or gradient tuple) with the rows
    received in place, and with ``meta`` (the routing's record) its counts received."""

    def __init__(self, value: tuple, handle, meta=None):
        self.value, self.handle, self.meta = value, handle, meta

    def wait(self):
        rows, recv = self.handle.wait()
        v = list(self.value)
        v[_ROWS] = rows
        if self.meta is not None:
            v[-1] = self.meta._replace(recv=recv)
        return tuple(v)


class _Dispatch:
    """The dispatch all-to-all at the first cut: the experts' counts exchanged first (small,
    blocking), then the rows asynchronously (``ep.start_all_to_all``); backward the reverse exchange
    of the rows' gradient (each source's rows back to it: the counts received)."""

    def __init__(self, mlp):
        self.mlp = mlp

    def start(self, v):
        from .moe import MoeState
        meta = v[-1]
        st = MoeState(v[1], meta.routing, v[_ROWS])
        send = self.mlp.dispatch_counts(st)
        h = self.mlp.ep.start_all_to_all(v[_ROWS], send)
        return _Handle(v, h, meta._replace(counts=st.counts, send=send))

    def start_back(self, g, crossed):
        return _Handle(g, self.mlp.ep.start_all_to_all(g[_ROWS], crossed[-1].recv))


class _Combine:
    """The combine all-to-all at the second cut: the expert outputs back to the ranks their rows
    came from (the counts received at dispatch); backward the reverse exchange (the counts sent)."""

    def __init__(self, mlp):
        self.mlp = mlp

    def start(self, v):
        return _Handle(v, self.mlp.ep.start_all_to_all(v[_ROWS], v[-1].recv))

    def start_back(self, g, crossed):
        return _Handle(g, self.mlp.ep.start_all_to_all(g[_ROWS], crossed[-1].send))


# ---------------------------------------------------------------------------- dense tensor-parallel blocks
def is_tp_block(block) -> bool:
    """A dense pre-norm block at T > 1 whose attention and MLP are the executor's own (GPT:
    :class:`executor.model.Block`; Llama: grouped-query attention and the SwiGLU): each ends in a
    row-parallel linear whose reduction :func:`tp_block_steps` cuts. A mixture of experts or latent
    attention keeps its TP collectives inside its segments (blocking)."""
    from .llama import GroupedQueryAttention, LlamaBlock, SwiGLU
    attn = getattr(block, "attn", None)
    if isinstance(block, LlamaBlock):
        ok = isinstance(attn, GroupedQueryAttention) and isinstance(block.mlp, SwiGLU)
    else:     # the GPT's block (executor.model.Block: qkv, proj; fc, out), known by its parts
        ok = all(hasattr(block, n) for n in ("ln1", "ln2", "fc", "out")) and \
            all(hasattr(attn, n) for n in ("qkv", "proj", "heads"))
    return ok and getattr(getattr(attn, "proj", None), "tp", None) is not None and attn.proj.tp.on


class Pending(NamedTuple):
    """What crosses the cut after a TP block's MLP: the residual stream ``x`` and the MLP's reduced
    output ``o``; the next segment adds them first (:func:`resolved`), as the block's last residual."""

    x: Any
    o: Any


def resolved(v):
    """A segment's input with a pending residual (:class:`Pending`) added; anything else as it is."""
    return v.x + v.o if isinstance(v, Pending) else v


def tp_block_steps(block, run, last: bool = False) -> list:
    """A dense TP block (:func:`is_tp_block`) in two segments, cut at each row-parallel reduction
    (the all-reduce; with sequence parallelism the reduce-scatter), each started asynchronously at
    its cut (:func:`executor.tensor_parallel.start_reduction`):

    1. ``x = resolved(v)`` (the previous TP block's last residual), ``p = attn(ln1(x))`` with the
       output projection's partial sum; crossing ``(x, p)``, p reduced across the cut;
    2. ``x1 = x + P``, ``o = mlp(ln2(x1))`` with the MLP's partial sum; crossing ``Pending(x1, o)``,
       o reduced across the cut; the next segment adds ``x1 + O`` first.

    Backward, across each cut the other way: with sequence parallelism the all-gather of the reduced
    slice's gradient (:func:`executor.tensor_parallel.start_gather_grad`), started asynchronously;
    without it none (an all-reduce's backward is the identity). ``run`` (a recomputation's
    ``run_unit``): each segment's compute (not the residual add of ``resolved``) is a unit of its
    own, so a recomputation re-runs that segment only, never a reduction across a cut.

    The stage's last block (``last``) is not cut after its MLP: its segment 2 ends with the MLP's
    reduction, blocking, and the block's last residual, so the stage's segments are two per block
    with the head folded into the last (:func:`cost_models.segments.stage_segments`); that reduction
    runs outside the recomputed unit too (a recomputation never re-runs it)."""
    tp = block.attn.proj.tp
    first = Step(lambda v: _tp_first(block, resolved(v), run), _Reduction(tp, tuple))
    if last:
        return [first, lambda v: _tp_closed(run(_tp_mlp, block, v), tp)]
    return [first, Step(lambda v: run(_tp_mlp, block, v), _Reduction(tp, Pending))]


def _tp_closed(v: Pending, tp):
    from .tensor_parallel import reduce
    return v.x + reduce(v.o, tp)


def _tp_attention(block, x):
    from .tensor_parallel import deferred_reduction
    with deferred_reduction():
        return block.attn(block.ln1(x))


def _tp_first(block, x, run):
    return (x, run(_tp_attention, block, x))


def _tp_mlp(block, v):
    from .tensor_parallel import deferred_reduction
    x, p = v
    x1 = x + p
    with deferred_reduction():
        h = block.ln2(x1)
        o = block.mlp(h) if hasattr(block, "mlp") else block.out(torch.nn.functional.gelu(block.fc(h)))
    return Pending(x1, o)


class _TPHandle:
    """A TP reduction (or its backward's gather) in flight across a cut: ``wait()`` gives the
    crossing value with its second place replaced by the collective's result."""

    def __init__(self, value, handle, make):
        self.value, self.handle, self.make = value, handle, make

    def wait(self):
        return self.make(self.value[0], self.handle.wait())


class _Reduction:
    """The exchange at a TP block's cut (:func:`tp_block_steps`): forward the reduction of the
    partial sum (second place of the crossing), backward the gather of its gradient's slice with
    sequence parallelism (else none: the gradient crosses as it is). ``make``: the crossing's type."""

    def __init__(self, tp, make):
        self.tp = tp
        self.make = make if make is not tuple else (lambda a, b: (a, b))

    def start(self, v):
        from .tensor_parallel import start_reduction
        return _TPHandle(v, start_reduction(v[1], self.tp), self.make)

    def start_back(self, g, crossed):
        from .tensor_parallel import start_gather_grad
        h = start_gather_grad(g[1], self.tp)
        return None if h is None else _TPHandle(g, h, lambda a, b: (a, b))
