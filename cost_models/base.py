"""What the engines consume: per-stage costs bound to a schedule, and the network between ranks.

A cost model turns (model, device, schedule placement) into :class:`StageCosts`: per (copy,
stage) compute times and memory, indexed ``[copy][stage]``. The simulator never knows where
numbers came from (unit costs, formulas, a calibration profile).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from schedules.ir import Schedule

from .partition import layer_ranges

Table = tuple[tuple[float, ...], ...]


def _table(rows) -> Table:
    return tuple(tuple(float(x) for x in r) for r in rows)


@dataclass(frozen=True)
class OpPhases:
    """One compute op's time as alternating segments, in the costs' time unit: ``compute[0]``,
    ``comm[0]``, ``compute[1]``, ``comm[1]``, ... The op starts with a compute segment (0 where it
    starts with communication) and ends with either: ``len(compute) == len(comm)`` (it ends with
    a comm segment) or ``len(compute) == len(comm) + 1`` (it ends with compute). The comm segments
    are the expert all-to-alls (dispatch, combine) that the op waits for serially when it is not
    overlapped, so the op alone takes ``total``; an overlapped forward/backward pair runs two of
    them on a GPU's compute and communication streams (:func:`sim.overlap.overlapped_pair`)."""

    compute: tuple[float, ...]
    comm: tuple[float, ...]

    def __post_init__(self):
        c, x = tuple(self.compute), tuple(self.comm)
        if not (len(c) == len(x) or len(c) == len(x) + 1) or not c:
            raise ValueError(f"OpPhases needs len(compute) == len(comm) or len(comm) + 1 (segments alternate, "
                             f"compute first); got {len(c)} compute and {len(x)} comm segments")
        for what, seg in (("compute", c), ("comm", x)):
            for v in seg:
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v >= 0):
                    raise ValueError(f"OpPhases.{what} segments must be finite numbers >= 0; got {v!r}")
        object.__setattr__(self, "compute", tuple(float(v) for v in c))
        object.__setattr__(self, "comm", tuple(float(v) for v in x))

    @classmethod
    def from_segments(cls, segments) -> "OpPhases":
        """The phases of an op that runs ``segments`` in order: ("compute" | "comm", seconds) pairs,
        e.g. a stage's layers' segments one after the other (a backward's in reverse layer order).
        Zero-length segments are dropped and neighbours of one kind merged (a comm segment followed
        by one more is one wait); a first comm segment gets ``compute[0] = 0``."""
        compute: list[float] = []
        comm: list[float] = []
        last = None
        for kind, t in segments:
            if kind not in ("compute", "comm"):
                raise ValueError(f"an op segment is 'compute' or 'comm'; got {kind!r}")
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not (math.isfinite(t) and t >= 0):
                raise ValueError(f"OpPhases.{kind} segments must be finite numbers >= 0; got {t!r}")
            if t == 0:
                continue
            if kind == last:
                (compute if kind == "compute" else comm)[-1] += t
            elif kind == "compute":
                compute.append(float(t))
            else:
                if not compute:
                    compute.append(0.0)
                comm.append(float(t))
            last = kind
        if not compute:
            compute.append(0.0)
        return cls(tuple(compute), tuple(comm))

    @property
    def total(self) -> float:
        """The op's serial time: every segment one after the other."""
        return float(sum(self.compute) + sum(self.comm))

    @property
    def comm_total(self) -> float:
        return float(sum(self.comm))


PhaseTable = tuple[tuple["OpPhases | None", ...], ...]


@dataclass(frozen=True, kw_only=True)
class StageCosts:
    """Costs of every (copy, stage) of a schedule.

    f, b, w: forward, backward (full; or input-grad only when the schedule splits it), and
      weight-grad times. act: activation memory kept from F until the backward that frees it;
      act_w: the part of it still alive between B and W (split schedules).
    act_bytes / grad_bytes: message sizes a stage sends downstream (activation) / upstream
      (gradient w.r.t. its input). param_bytes: gradient bytes all-reduced for the stage.
    static_mem: per device (weights + gradients + optimizer state of the stages it holds).
    optim_time: per device. copy_time: local hand-off time (V turn).
    send_time / recv_time: CPU time a rank spends posting a message / taking a delivered one
      (host overheads measured by calibration; 0 for GPUs, where the copy engines do the work).
    grad_copy_per_byte: CPU time per gradient byte a rank spends flattening a stage's gradients
      at its ALLREDUCE and writing the result back at OPTIM (per local copy of the stage).
    phases_f / phases_b: optional tables ``[copy][stage]`` of :class:`OpPhases` (None, or a None
      entry: that op has no phases), the compute / all-to-all segments of F and of B (the
      input-gradient backward where the schedule splits it, the full backward otherwise); each
      entry's ``total`` equals its ``f`` / ``b`` entry (relative 1e-9). The simulator overlaps the
      schedule's paired F and B (``meta["overlapped"]``) from them, see :mod:`sim.overlap`.
    act_segments / act_w_segments: optional tables ``[copy][stage]`` of the bytes each segment of
      the stage's forward keeps (summing to ``act``) and what each keeps from a split B until W, where
      an overlapped pair runs segment by segment (:mod:`cost_models.segments`); the simulator books
      a pair's memory from them (:func:`cost_models.memory.pair_memory`); None: the pair books F whole.
    comm_sm_share: the share of the GPU's SMs (0 <= share < 1) the communication kernels take while
      they run: overlapped compute runs at rate 1 - share then (DeepSeek-V3 kept 20 of 132 SMs
      for communication: 20/132).
    kinds / rank_kinds: a mixed cluster's costs per device kind (:func:`cost_models.bind.bind` on a
      cluster of several pools): ``kinds[k]`` is the whole schedule costed on kind k, and rank r's
      ops take ``kinds[rank_kinds[r]]``'s (:meth:`for_rank`); the tables of this record are then,
      per (copy, stage), those of the kind its replica-0 rank sits on (what a family that orders its
      ops from per-stage costs reads), ``static_mem`` / ``optim_time`` each rank's own. None / ():
      one kind, every rank takes these tables.
    """

    time_unit: str
    mem_unit: str
    f: Table
    b: Table
    w: Table
    act: Table
    act_w: Table
    act_bytes: Table
    grad_bytes: Table
    param_bytes: Table
    static_mem: tuple[float, ...]
    optim_time: tuple[float, ...]
    copy_time: float = 0.0
    meta: dict = field(default_factory=dict, compare=False)
    send_time: float = 0.0
    recv_time: float = 0.0
    grad_copy_per_byte: float = 0.0
    phases_f: PhaseTable | None = None
    phases_b: PhaseTable | None = None
    comm_sm_share: float = 0.0
    act_segments: tuple[tuple[tuple[float, ...], ...], ...] | None = None
    act_w_segments: tuple[tuple[tuple[float, ...], ...], ...] | None = None
    kinds: tuple["StageCosts", ...] = ()
    rank_kinds: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.rank_kinds is not None:
            if len(self.rank_kinds) != len(self.static_mem) or \
                    any(not 0 <= k < len(self.kinds) for k in self.rank_kinds):
                raise ValueError(f"StageCosts.rank_kinds must give each of the {len(self.static_mem)} ranks a kind "
                                 f"0..{len(self.kinds) - 1}; got {self.rank_kinds!r}")
            for k in self.kinds:
                if len(k.f) != len(self.f) or any(len(a) != len(b) for a, b in zip(k.f, self.f)):
                    raise ValueError("StageCosts.kinds must cost the same schedule (tables shaped alike)")
        elif self.kinds:
            raise ValueError("StageCosts.kinds needs rank_kinds (each rank's kind)")
        s = self.comm_sm_share
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not (math.isfinite(s) and 0 <= s < 1):
            raise ValueError(f"StageCosts.comm_sm_share must be a number in [0, 1); got {s!r}")
        for name, phases, table in (("phases_f", self.phases_f, self.f), ("phases_b", self.phases_b, self.b)):
            if phases is None:
                continue
            if len(phases) != len(table) or any(len(p) != len(t) for p, t in zip(phases, table)):
                raise ValueError(f"StageCosts.{name} must be a [copy][stage] table shaped like "
                                 f"{name[-1]} ({len(table)} x {len(table[0]) if table else 0})")
            for c, (prow, trow) in enumerate(zip(phases, table)):
                for st, (ph, t) in enumerate(zip(prow, trow)):
                    if ph is None:
                        continue
                    if not isinstance(ph, OpPhases):
                        raise ValueError(f"StageCosts.{name}[{c}][{st}] must be OpPhases or None; got {ph!r}")
                    if not math.isclose(ph.total, t, rel_tol=1e-9):
                        raise ValueError(f"StageCosts.{name}[{c}][{st}] sums to {ph.total!r}, not "
                                         f"{name[-1]}[{c}][{st}] = {t!r}: the phases must split the op's time")

    @property
    def has_phases(self) -> bool:
        return self.phases_f is not None or self.phases_b is not None or any(k.has_phases for k in self.kinds)

    def for_rank(self, rank: int) -> "StageCosts":
        """The costs rank ``rank``'s ops take: its device kind's (``kinds``), or these."""
        return self if self.rank_kinds is None else self.kinds[self.rank_kinds[rank]]

    def compute_time(self, kind: str, copy: int, stage: int) -> float:
        table = self.f if kind == "F" else self.b if kind == "B" else self.w
        return table[copy][stage]


def held_stages(sched: Schedule, rank: int) -> list[int]:
    """The stage of every set of weights rank ``rank`` keeps: one per (copy, stage) it holds, or one
    per stage where the schedule's copies share their weights on a device (``meta["shared_copies"]``:
    DAPPLE's replicated stages, :mod:`schedules.dapple_replicated`)."""
    held = [s for _, s in sched.stages_on(sched.rank_device(rank))]
    return sorted(set(held)) if sched.meta.get("shared_copies") else held


@dataclass(frozen=True)
class UnitCostModel:
    """The closed-form model: a full stage (L/D layers) has F = 1, B = 2 (split: B = 1, W = 1), a
    device holding more stages runs proportionally shorter chunks; activations in Ma, weights in
    Mw (weights + gradients + optimizer state of one full stage = 1), no communication cost."""

    def bind(self, sched: Schedule) -> StageCosts:
        C, S, D = sched.num_copies, sched.num_stages, sched.num_devices
        f = D / S
        ones = [[f] * S for _ in range(C)]
        zeros = [[0.0] * S for _ in range(C)]
        b = [[f if sched.split_backward else 2 * f] * S for _ in range(C)]
        w = ones if sched.split_backward else zeros
        static = [0.0] * sched.num_ranks
        for r in range(sched.num_ranks):
            static[r] = f * len(held_stages(sched, r))
        return StageCosts(time_unit="F", mem_unit="Ma", f=_table(ones), b=_table(b), w=_table(w), act=_table(ones),
                          act_w=_table(ones if sched.split_backward else zeros), act_bytes=_table(zeros),
                          grad_bytes=_table(zeros), param_bytes=_table(zeros), static_mem=tuple(static),
                          optim_time=tuple([0.0] * sched.num_ranks), meta={"model": "unit"})


@dataclass(frozen=True)
class LayerCosts:
    """Per-layer costs (seconds, bytes); index i is layer i of the whole model."""

    f: tuple[float, ...]
    b_input: tuple[float, ...]
    w: tuple[float, ...]
    act: tuple[float, ...]          # bytes kept for backward per micro-batch
    act_w: tuple[float, ...]        # of which still needed by W after B (split)
    out_bytes: tuple[float, ...]    # bytes of the layer's output (sent if a stage ends here)
    params: tuple[float, ...]       # parameter count
    bytes_per_param_static: float = 16.0   # weights + grads + optimizer state
    grad_bytes_per_param: float = 2.0      # bytes all-reduced per parameter
    optim_time_per_param: float = 0.0
    copy_time: float = 0.0
    b_full: tuple[float, ...] | None = None  # measured full backward (else b_input + w)
    op_overhead: tuple[tuple[str, float], ...] = ()  # seconds added per op: (("F", s), ("SEND", s), ...)
    data_time: float = 0.0   # producing one micro-batch's inputs/targets, paid by the first F needing it
    # a split backward whose first stage (no input gradient to produce) runs nothing in B and the
    # whole backward in W (an implementation that does not end B at the first parameterised ops;
    # the executor's B ends there, see executor.backward)
    first_stage_all_in_w: bool = False
    grad_copy_per_byte: float = 0.0   # CPU s/byte to flatten gradients for an all-reduce (and back)
    # bytes a layer keeps (and keeps until W) when it is the first layer of a stage, where act / act_w
    # are what it adds after the layer before it (a measured layer stack: cost_models.stack); None: act
    act_first: tuple[float, ...] | None = None
    act_w_first: tuple[float, ...] | None = None
    # per layer, where its parameters are not all alike (a mixture of experts: the experts' optimizer
    # state sharded over another group, their gradients reduced over it at the step's end): the
    # static bytes a GPU holds, the seconds the step's end spends on it, and the parameters in the
    # pipeline's data-parallel all-reduce; None: params x bytes_per_param_static,
    # params x optim_time_per_param, params
    static_bytes: tuple[float, ...] | None = None
    optim_time: tuple[float, ...] | None = None
    reduced_params: tuple[float, ...] | None = None
    # per layer, the bytes each of its segments keeps (an overlapped pair's F runs a stage's forward
    # segment by segment, its B frees them last first: cost_models.segments) and of them what a split
    # B keeps until W; ``folds[i]``: layer i (embedding, head) is one part folded into the segment
    # next to it in its stage (the first layer's into the next, any other's into the one before).
    # None: a measured layer stack's (``act_first`` given) is one segment per layer, else none known
    act_segments: tuple[tuple[float, ...], ...] | None = None
    act_w_segments: tuple[tuple[float, ...], ...] | None = None
    folds: tuple[bool, ...] | None = None

    @property
    def num_layers(self) -> int:
        return len(self.f)

    def static_total(self) -> float:
        """Static bytes of every layer on one GPU: ``static_bytes`` where given, else the
        parameters x ``bytes_per_param_static``."""
        if self.static_bytes is not None:
            return sum(self.static_bytes)
        return sum(self.params) * self.bytes_per_param_static

    def optim_total(self) -> float:
        """Seconds of every layer's optimizer step: ``optim_time`` where given, else the parameters x
        ``optim_time_per_param``."""
        if self.optim_time is not None:
            return sum(self.optim_time)
        return sum(self.params) * self.optim_time_per_param


@dataclass(frozen=True)
class PerLayerCostModel:
    """Sums per-layer costs over each stage's contiguous layers (even split unless given)."""

    layers: LayerCosts
    partition: tuple[int, ...] | None = None

    def bind(self, sched: Schedule) -> StageCosts:
        L = self.layers
        S, C = sched.num_stages, sched.num_copies
        parts = layer_ranges(L.num_layers, S, self.partition)

        def per_stage(vals):
            return [sum(vals[i] for i in rng) for rng in parts]

        ovh = dict(L.op_overhead)
        f = [x + ovh.get("F", 0.0) for x in per_stage(L.f)]
        full = per_stage(L.b_full) if L.b_full is not None else \
            [x + y for x, y in zip(per_stage(L.b_input), per_stage(L.w))]
        if sched.split_backward:
            b = [x + ovh.get("B", 0.0) for x in per_stage(L.b_input)]
            w = [x + ovh.get("W", 0.0) for x in per_stage(L.w)]
            if L.first_stage_all_in_w:
                b[0], w[0] = ovh.get("B", 0.0), full[0] + ovh.get("W", 0.0)
        else:
            b = [x + ovh.get("B", 0.0) for x in full]
            w = [0.0] * S
        # inputs are made where the first stage runs, targets where the last one does (once per
        # device: a V-shaped copy has both on one device)
        f_copy = []
        for c in range(C):
            fc = list(f)
            fc[0] += L.data_time
            if S > 1 and sched.placement[c][S - 1] != sched.placement[c][0]:
                fc[S - 1] += L.data_time
            f_copy.append(fc)
        act = stage_sums(L.act, L.act_first, parts)
        act_w = stage_sums(L.act_w, L.act_w_first, parts) if sched.split_backward else [0.0] * S
        if sched.split_backward and L.first_stage_all_in_w:
            act_w[0] = act[0]     # B does nothing there: what F kept waits for W as it is
        segs = stage_segment_sums(L, parts, sched.split_backward)
        out = [L.out_bytes[rng[-1]] for rng in parts]
        # the gradient a stage sends upstream has the shape of its input = previous stage's output
        grad = [0.0] + out[:-1]
        params = per_stage(L.params)
        static_of = per_stage(L.static_bytes) if L.static_bytes is not None else None
        optim_of = per_stage(L.optim_time) if L.optim_time is not None else None
        reduced = per_stage(L.reduced_params) if L.reduced_params is not None else params
        static, optim = [], []
        for r in range(sched.num_ranks):
            held = held_stages(sched, r)
            p = sum(params[s] for s in held)
            static.append(p * L.bytes_per_param_static if static_of is None else sum(static_of[s] for s in held))
            optim.append((p * L.optim_time_per_param if optim_of is None else sum(optim_of[s] for s in held))
                         + ovh.get("OPTIM", 0.0))
        rows = lambda v: _table([v] * C)  # noqa: E731
        return StageCosts(time_unit="s", mem_unit="B", f=_table(f_copy), b=rows(b), w=rows(w), act=rows(act),
                          act_w=rows(act_w), act_bytes=rows(out), grad_bytes=rows(grad),
                          param_bytes=rows([p * L.grad_bytes_per_param for p in reduced]), static_mem=tuple(static),
                          optim_time=tuple(optim), copy_time=L.copy_time,
                          meta={"model": "per-layer", "partition": [len(r) for r in parts]},
                          send_time=ovh.get("SEND", 0.0), recv_time=ovh.get("RECV", 0.0),
                          grad_copy_per_byte=L.grad_copy_per_byte,
                          act_segments=tuple(tuple(segs[0]) for _ in range(C)) if segs else None,
                          act_w_segments=tuple(tuple(segs[1]) for _ in range(C)) if segs else None)


def stage_segment_sums(L: "LayerCosts", parts: list[range], split: bool):
    """(per stage the bytes each segment of its forward keeps, per stage what each keeps from a
    split B until W (zeros without a split backward)) from the layers' segments (:class:`LayerCosts`
    ``act_segments`` / ``folds``; a measured layer stack: one segment per layer, its first one
    ``act_first``), or None where the layers give none. Each stage's segments sum to its ``act``."""
    if L.act_segments is None and L.act_first is None:
        return None
    acts, ws = [], []
    for rng in parts:
        a: list[float] = []
        w: list[float] = []
        pending_a = pending_w = 0.0        # a folded layer before the stage's first segment
        for k, i in enumerate(rng):
            if L.act_segments is None:     # a layer stack: each layer one segment
                first = k == 0
                la = (L.act_first[i] if first else L.act[i],)
                lw = ((L.act_w_first if first and L.act_w_first is not None else L.act_w)[i],)
            else:
                la, lw = L.act_segments[i], L.act_w_segments[i]
            if L.folds is not None and L.folds[i]:
                if a:
                    a[-1] += sum(la)
                    w[-1] += sum(lw)
                else:
                    pending_a += sum(la)
                    pending_w += sum(lw)
                continue
            a += la
            w += lw
            if pending_a or pending_w:
                a[-len(la)] += pending_a
                w[-len(lw)] += pending_w
                pending_a = pending_w = 0.0
        if not a:                          # no block to fold into: the stage is one plain segment
            a, w = [sum(L.act[i] for i in rng)], [sum(L.act_w[i] for i in rng)]
        acts.append(tuple(float(x) for x in a))
        ws.append(tuple(float(x) for x in w) if split else (0.0,) * len(a))
    return acts, ws


def stage_sums(per_layer, first, parts: list[range]) -> list[float]:
    """Per stage: the sum of ``per_layer`` over its layers, with the stage's first layer counted by
    ``first`` when given (what a layer keeps at the start of a stage; see :class:`LayerCosts`)."""
    out = []
    for rng in parts:
        vals = [per_layer[i] for i in rng]
        if first is not None and len(rng):
            vals[0] = first[rng[0]]
        out.append(float(sum(vals)))
    return out


PEAK_FLOOR = "peak_floor"   # StageCosts.meta key of :func:`with_peak_floor`


def with_peak_floor(costs: StageCosts, sched: Schedule, flops_f, flops_b_input, flops_w,
                    partition: tuple[int, ...] | None, peak: float) -> StageCosts:
    """``costs`` with ``meta["peak_floor"]``: per (copy, stage), the seconds of its F, B and W at
    the device's ``peak`` FLOP/s, from per-layer FLOPs (``flops_b_input`` with any recomputed
    forward) summed over the same stages and split as :class:`PerLayerCostModel` sums the times.
    No op can run faster; the simulator checks its costs against it (:func:`sim.engine.run`)."""
    zero = (0.0,) * len(flops_f)
    at_peak = lambda flops: tuple(x / peak for x in flops)  # noqa: E731
    floor = PerLayerCostModel(LayerCosts(f=at_peak(flops_f), b_input=at_peak(flops_b_input), w=at_peak(flops_w),
                                         act=zero, act_w=zero, out_bytes=zero, params=zero), partition).bind(sched)
    costs.meta[PEAK_FLOOR] = {"F": floor.f, "B": floor.b, "W": floor.w, "peak": peak}
    return costs

