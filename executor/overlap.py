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
waits for it. :func:`interleave` drives the pair: F's segment, B's segment, F's, ... (F first, as
the simulator breaks ties), so each exchange's wait comes after the other op's next compute
segment. Run alone (an unpaired op) a generator is simply run to its end.

*Backward per segment.* Full: ``autograd.backward(out, grad)`` on the segment's graph (parameter
gradients accumulate), the leaf's ``.grad`` is the gradient of the segment before. Split (B then
W): the segment's B is :meth:`executor.backward.SplitBackward.input` on the segment's graph (one
SplitBackward per stage module and segment, so each keeps its graph template), its
:class:`~executor.backward.PendingWeightGrad` kept; W runs every segment's pending weight
gradients (:func:`weight_backward`).

*Recompute.* The units of :mod:`executor.recompute` are the transformer blocks (a layer stack's
layers), and cuts fall on unit boundaries: a recomputed unit lies inside one segment and its
saved-tensor hooks re-run that unit only, from the leaf it was given, inside that segment's
backward. Nothing is re-run across a cut, whatever the interleaving (torchtitan's threaded
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


def steps_of(module) -> list:
    """The segments of ``module``'s forward (``module.steps()`` where it has it), else the module
    as one step."""
    steps = getattr(module, "steps", None)
    return list(steps()) if callable(steps) else [module]


def _compute(step):
    return step.compute if isinstance(step, Step) else step


def _exchange(step):
    return step.exchange if isinstance(step, Step) else None


def forward_segments(steps: list, x, enter: Callable, finish: Callable | None = None) -> Iterator:
    """F as a generator over ``steps`` (see the module docstring): yields after each segment but
    the last; returns the list of :class:`Segment`. ``enter()`` is the context each segment's
    compute runs in (autocast, the memory meter); ``finish(out)``, inside the last segment's, maps
    the last output (the loss of a last stage)."""
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
        handle = ex.start(out.detach()) if ex is not None else None
        yield COMPUTE
        if handle is not None:
            nxt = handle.wait()
            yield COMM
        else:
            nxt = out.detach()
        v = nxt.detach().requires_grad_(out.requires_grad)
    return segs


def backward_segments(segs: list[Segment], grad, run: Callable) -> Iterator:
    """B as a generator over a forward's segments, last first: ``run(i, seg, g)`` is the backward
    of segment i given its output's gradient ``g`` (None on a loss) and returns its input's
    gradient; the reverse exchange of that gradient is started, the generator yields and then
    waits for it. Returns the gradient of the first segment's input."""
    g = grad
    gx = None
    for i in range(len(segs) - 1, -1, -1):
        gx = run(i, segs[i], g)
        if i == 0:
            break
        ex = segs[i - 1].exchange
        handle = ex.start_back(gx) if ex is not None else None
        yield COMPUTE
        if handle is not None:
            g = handle.wait()
            yield COMM
        else:
            g = gx
    return gx


def run_alone(gen: Iterator):
    """Run a segment generator to its end; its return value."""
    while True:
        try:
            next(gen)
        except StopIteration as stop:
            return stop.value


def interleave(f_gen: Iterator, b_gen: Iterator, f_token: str, b_token: str, clock: Callable[[], float],
               sync: Callable[[], None] = lambda: None) -> tuple[Any, Any, list[Phase]]:
    """Drive an F and a B generator alternately (F first), one segment (or one wait) of each in
    turn, until both end; returns their values and the :class:`Phase` rows (``clock`` the rank's
    clock, ``sync`` the device synchronisation before a phase's end is read)."""
    gens = [f_gen, b_gen]
    tokens = (f_token, b_token)
    seg = [0, 0]
    values = [None, None]
    alive = [True, True]
    phases = []
    while alive[0] or alive[1]:
        for k in (0, 1):
            if not alive[k]:
                continue
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
