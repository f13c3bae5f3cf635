"""Calibration profiles: costs measured on a real machine (the ``cpu`` device of the executor).

A profile is a YAML file written by a calibration run and read by :func:`load_profile`. It turns
into a per-layer cost model (measured seconds; parameter and activation bytes from the formulas
of :mod:`cost_models.transformer` unless measured) and a one-node :class:`Cluster` of ``cpu``
devices whose links are the fitted point-to-point and all-reduce costs. Format (version 1)::

    format: pipetwin-calibration/1
    name: laptop-gloo              # free text
    model: tiny                    # model preset name, YAML path, or a mapping of ModelSpec fields
    layers:                        # seconds per micro-batch of the model's micro_batch, per layer kind
      embedding: {f: 2.0e-5, b_input: 0.0, w: 3.0e-5}
      block:     {f: 4.1e-4, b_input: 4.5e-4, w: 3.9e-4}
      head:      {f: 1.2e-4, b_input: 1.1e-4, w: 1.0e-4}
    # per_layer: [{f:, b_input:, w:}, ...]   # optional, one entry per layer (L + 2), wins over `layers`
    # act_bytes: {embedding: ..., block: ..., head: ...}   # optional measured bytes kept F -> B
    # act_bytes_recompute_per_layer: {selective: [...], full: [...]}  # optional: kept F -> B per layer
    #                                # with the executor's recomputation (else the formulas)
    precision: fp32                # the executor's --dtype the profile was measured in (fp32 | bf16)
    p2p: {latency: 60 us, bandwidth: 2.5 GB/s}        # one message: latency + bytes / bandwidth
    allreduce: {latency: 80 us, bandwidth: 1.2 GB/s}  # fit of 2(n-1) latency + 2(n-1)/n S / bandwidth
    optimizer: {seconds_per_param: 3.0e-9}            # optimizer step time per parameter
    overhead: {F: 5.0e-5, B: 4.0e-5, W: 4.0e-5, SEND: 9.0e-5, RECV: 3.0e-5, OPTIM: 2.0e-4}  # per op (optional)
    data_time: 4.0e-4              # making one micro-batch's tokens (first / last stage F pays it)
    first_stage_all_in_w: false    # true: a split backward whose stage 0 B does nothing, its W everything
    cores: 2                       # the host's cores, shared by the ranks (processor sharing)
    time_slice: 4 ms               # with more ranks than cores: the OS's time slice (sim.slicing)
    oversubscribed_slowdown: 1.0   # compute this much slower then (profiles of earlier versions)
    grad_copy_per_byte: 2.0e-10    # flattening a stage's gradients for its all-reduce, and back
    copy_time: 0.0                 # seconds of a local hand-off (optional)
    memory: 16 GiB                 # memory one rank may use (optional; no OOM verdict without it)
    tp: 2                          # optional (default 1): the tensor-parallel size T measured at
    tp_allreduce: {latency: 30 us, bandwidth: 1.5 GB/s}  # with tp > 1: the TP group's all-reduce (ring fit)
    ep: 2                          # optional (default 1): the expert-parallel size E a MoE model was measured at
    all_to_all: {latency: 900 us, bandwidth: 0.4 GB/s, residual: 0.3}  # with ep > 1: one executor all-to-all
                                   # over the EP group, latency + bytes a rank sends / bandwidth (residual: the
                                   # fit's largest relative miss on its own points, meta["a2a_samples"]; round:
                                   # one synchronous EP round's in-run seconds, a2a_forward_parts; absent: latency / 2)
    expert_layers: {router: {f:, b_input:, w:, b:}, experts: {...}, experts_ep1: {...}, shared: {...}}
                                   # a MoE model's expert layers measured alone (calibration.measure.measure_moe_layers)
    meta: {host: ..., torch: ..., threads: 1, date: ...}   # free-form, kept as is

A profile of a mixture of experts (``pipetwin calibrate --model tiny-mixtral --ep E``) keeps the
expert layers of its first MoE block measured alone (``expert_layers``: the router, EP rank 0's
routed experts at the row counts the EP peers' routing sends them, all experts at EP 1, the shared
expert) and, with E > 1, the fit of the executor's all-to-all over E gloo ranks. A MoE block's
``per_layer`` time is then the block at EP 1 with its experts' time exchanged for theirs at E (done
when calibrating), and :meth:`CalibrationProfile.layer_costs` adds its all-to-alls from the fit:
per MoE block, F runs three (the per-expert counts, E x 8 bytes; the dispatch and the combine, each
``n k h d`` bytes per rank, :func:`cost_models.moe.moe_share`) and the input backward two (their
gradients; the forward's three again under full recomputation) (:meth:`CalibrationProfile.a2a_times`).
F's synchronous rounds (four a block: the counts exchange's two, the dispatch's and the combine's
counts' rounds) are priced at one in-run round cost, ``all_to_all.round``
(:meth:`CalibrationProfile.a2a_forward_parts`), as compute: the op's own stream waits on them.
A MoE model's costs carry F / B phases (compute and all-to-all segments,
:meth:`CalibrationProfile.layer_segments`), so that the simulator runs the schedule's overlapped
F&B pairs as the executor does (:mod:`sim.overlap`). A profile is used at the E it was measured at only.

A profile of a user's layer stack (``pipetwin calibrate --model PATH.py:FUNC``) has a ``model``
mapping with ``file: PATH.py:FUNC`` and the measured per-layer facts of
:class:`cost_models.stack.StackSpec` (names, parameters, output bytes, kept bytes at a stage's
start, FLOPs), ``per_layer`` timings (one per layer of the stack, required) and
``act_bytes_per_layer`` / ``act_w_bytes_per_layer`` (what each layer adds after the one before
it; required). Its default partition is :func:`cost_models.partition.stack_partition` (the
executor's), recomputation is not modelled.

A profile measured with tensor parallelism (``pipetwin calibrate --tp T``, T > 1) describes one TP
rank of a group of T processes: ``per_layer`` are the times of its layers at 1/T (the executor's
column- and row-parallel shards, :mod:`executor.tensor_parallel`) without their collectives, the
kept bytes those of its shards, and ``tp_allreduce`` the fit of the group's all-reduce (the
executor's own, over T gloo processes: ``2(T-1)`` steps of latency + ``2(T-1)/T S / bandwidth``).
The collectives of each layer (:func:`cost_models.transformer.layer_collectives`) are priced on it
and added to the layer's F and input backward (:meth:`CalibrationProfile.layer_costs`). A simulated
rank is the whole group: T processes that need T cores, so the host has ``cores // T`` of them
(:meth:`CalibrationProfile.host_cores`). A profile without ``tp`` is one of T = 1, and is only used
at T = 1.

On another device (``pipetwin simulate --profile FILE --cluster PRESET``),
:func:`scaled_layer_costs` scales the measured times by one factor: the FLOP rate this host reached
over the whole model (measured FLOPs / measured seconds, forward + full backward) against the
device's achievable rate (its peak at the precision x its efficiency).

Units: seconds, bytes, bytes/s (unit strings such as ``60 us`` or ``2.5 GB/s`` are accepted).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from . import _spec
from ._spec import SpecError
from .base import LayerCosts, PerLayerCostModel
from .cluster import Cluster, LinkSpec
from .device import DeviceSpec
from .files import FileError, check_kind, read_text, write_output
from .model_spec import ModelSpec, load_model, spec_from_dict
from .partition import balanced_counts, default_partition, stack_partition
from .stack import StackSpec, stack_from_dict
from .transformer import (TensorParallelGroup, _check_recompute, is_moe_block, layer_collectives, stage_phases,
                          transformer_layers)

FORMAT = "pipetwin-calibration/1"
KINDS = ("embedding", "block", "head")
PRECISIONS = ("fp32", "bf16")
# cores' worth of other processes' CPU, measured while a run's steps ran, from which the run is disturbed
# and its host busy (calibration.sitting: the sittings a profile is measured and checked in)
BUSY_CORES = 0.5
FP32_GRAD_BYTES = 4.0    # the executor keeps fp32 gradients (master weights) in every precision


@dataclass(frozen=True)
class LayerTiming:
    """Measured seconds of one layer for one micro-batch: forward, input-grad backward,
    weight-grad backward of a split backward, and (optional) the full backward, which may differ
    from b_input + w (a split backward can redo work)."""

    f: float
    b_input: float
    w: float
    b: float | None = None


# a profile's process-group sizes and the fitted collective each needs beyond 1: (field, its link, the
# calibrate flag's letter, what the link is)
_GROUPS = {"tp": ("tp_allreduce", "T", "the group's all-reduce"),
           "ep": ("all_to_all", "E", "the EP group's all-to-all")}


def _check_group_size(where: str, field: str, size, file: dict | None = None) -> int:
    """``tp`` / ``ep`` of a profile: an integer >= 1 (one line naming ``where`` otherwise); read from
    a profile ``file`` (its mapping), the size > 1 and its link field go together. Returns the size."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise SpecError(f"{where}: field '{field}' must be an integer >= 1; got {size!r}")
    if file is not None:
        link, letter, _ = _GROUPS[field]
        if (size > 1) != (link in file):
            given = "with" if link in file else "without"
            raise SpecError(f"{where}: fields '{field}' > 1 and '{link}' go together (calibrate --{field} {letter} "
                            f"writes both); got {field} {size} {given} {link}")
    return size


def _check_group_link(where: str, field: str, size: int, has_link: bool) -> None:
    """A profile record with ``tp`` / ``ep`` ``size`` > 1 holds that group's fitted collective."""
    link, _, what = _GROUPS[field]
    if not has_link:
        raise SpecError(f"{where}: {field} {size} needs field '{link}' ({what}); calibrate with --{field} {size}")


@dataclass(frozen=True)
class CalibrationProfile:
    name: str
    model: ModelSpec | StackSpec              # a transformer spec, or a measured layer stack
    layers: tuple[LayerTiming, ...]          # one per layer: embedding, blocks, head (or the stack's layers)
    p2p: LinkSpec
    allreduce: LinkSpec
    optimizer_seconds_per_param: float = 0.0
    copy_time: float = 0.0
    memory_bytes: float | None = None
    act_bytes: tuple[float, ...] | None = None   # measured bytes kept F -> B per layer, if any
    meta: dict = field(default_factory=dict, compare=False)
    act_w_bytes: tuple[float, ...] | None = None  # measured bytes still kept between B and W, if any
    overhead: tuple[tuple[str, float], ...] = ()  # per-op runtime overhead (s): F, B, W, SEND, RECV, OPTIM
    cores: int | None = None                      # cores of the host the ranks share
    data_time: float = 0.0                        # seconds to produce one micro-batch's tokens
    first_stage_all_in_w: bool = False            # stage 0's B does nothing, W all (see LayerCosts)
    grad_copy_per_byte: float = 0.0               # flattening gradients for an all-reduce and back
    oversubscribed_slowdown: float = 1.0          # compute slowdown while the ranks outnumber the cores
    time_slice: float | None = None               # s: the OS's slice while the ranks outnumber the cores
    # measured bytes kept F -> B per layer under each recomputation mode ((mode, per-layer bytes), ...)
    act_bytes_recompute: tuple[tuple[str, tuple[float, ...]], ...] = ()
    precision: str = "fp32"                       # the executor's --dtype when measured
    tp: int = 1                                   # tensor-parallel size T: layers are one TP rank's (1/T)
    tp_allreduce: LinkSpec | None = None          # with tp > 1: the TP group's all-reduce, one ring step
    ep: int = 1                                   # expert-parallel size E a MoE model was measured at
    all_to_all: LinkSpec | None = None            # with ep > 1: one executor all-to-all over the EP group
    a2a_residual: float | None = None             # the all-to-all fit's largest relative miss on its points
    a2a_round: float | None = None                # s: one synchronous EP round in a run (None: the fit's, latency / 2)
    expert_layers: tuple[tuple[str, LayerTiming], ...] = ()   # a MoE model's expert layers measured alone
    a2a_wire: float | None = None                 # a job's emulated wire (--a2a-wire, bytes/s), not the file's

    def __post_init__(self):
        # one canonical order of the per-op overheads (the file's), so equal profiles compare equal
        order = {k: i for i, k in enumerate(OVERHEAD_KINDS)}
        object.__setattr__(self, "overhead", tuple(sorted(self.overhead, key=lambda kv: order.get(kv[0], len(order)))))
        if self.is_stack and (self.act_bytes is None or len(self.layers) != self.model.num_layers):
            raise SpecError(f"profile {self.name}: a layer-stack profile needs one timing and measured activation "
                            f"bytes per layer ({self.model.num_layers} layers)")
        where = f"profile {self.name}"
        _check_group_size(where, "tp", self.tp)
        if self.tp > 1:
            if self.is_stack:
                raise SpecError(f"profile {self.name}: tensor parallelism splits the built-in GPT's layers, not a "
                                f"layer stack's; tp must be 1")
            _check_group_link(where, "tp", self.tp, self.tp_allreduce is not None)
            try:
                self.model.check_tensor_parallel(self.tp, "tp")
            except ValueError as e:
                raise SpecError(f"profile {self.name}: {e}") from None
        _check_group_size(where, "ep", self.ep)
        if self.ep > 1:
            if self.is_stack or not self.model.is_moe or self.model.experts % self.ep:
                raise SpecError(f"profile {self.name}: field 'ep' {self.ep} splits a mixture of experts' routed "
                                f"experts; model {self.model_name} has "
                                + (f"{self.model.experts}" if not self.is_stack and self.model.is_moe else "none"))
            _check_group_link(where, "ep", self.ep, self.all_to_all is not None)

    @property
    def is_stack(self) -> bool:
        """A profile of a user's layer stack (``--model PATH.py:FUNC``), not of a transformer spec."""
        return isinstance(self.model, StackSpec)

    @property
    def model_name(self) -> str:
        return self.model.name

    @property
    def micro_batch(self) -> int:
        return self.model.micro_batch

    def device(self) -> DeviceSpec:
        return DeviceSpec(name="cpu", memory_bytes=self.memory_bytes, calibrated=True,
                          description=f"CPU rank calibrated by {self.name}")

    def layer_costs(self, recompute: str = "none", bytes_per_param: float = 16.0,
                    grad_bytes_per_param: float | None = None, dropout: bool = True) -> LayerCosts:
        """Measured seconds; bytes measured where the profile has them (``act_bytes``, and per
        recomputation mode ``act_bytes_recompute``), else from the formulas. Recomputation adds the
        recomputed fraction of the measured forward to the input backward.

        Why measured bytes per mode: the formulas (:mod:`cost_models.transformer`) describe
        Megatron-style attention, whose softmax keeps ``s^2`` tensors (and dropout masks); the
        executor's fused attention keeps none, so ``selective`` saves only the attention output
        and its log-sum-exp there, and the formulas' selective / none differ from what it keeps by
        the ``a s^2 b`` terms. ``full`` (each block keeps its input, ``sbh d``) agrees with them.
        The gradients all-reduced are fp32 in every precision (master weights: 4 bytes per
        parameter), whatever the model's ``dtype_bytes``."""
        _check_recompute(recompute)
        if self.is_stack:
            return self._stack_costs(recompute, bytes_per_param, grad_bytes_per_param)
        formula = transformer_layers(self.model, recompute, dropout, tp=self.tp)
        comm = self.collective_times(recompute)
        measured = self.act_bytes if recompute == "none" else dict(self.act_bytes_recompute).get(recompute)
        act = [m if measured is not None else l.act_bytes
               for l, m in zip(formula, measured or [None] * len(formula))]
        mw = self.act_w_bytes
        # B -> W keeps the same with or without recomputation: a split backward recomputes in B and
        # keeps the recomputed graph for W (executor.recompute)
        act_w = [m if mw is not None else l.act_w_bytes for l, m in zip(formula, mw or [None] * len(formula))]
        a2a_f, a2a_b = self.all_to_all_times(recompute)
        comm = [(cf + af, cb + ab) for (cf, cb), af, ab in zip(comm, a2a_f, a2a_b)]
        full = None
        if all(t.b is not None for t in self.layers):
            full = tuple(t.b + (t.f * l.flops_recompute / l.flops_f if l.flops_f else 0.0) + cb
                         for t, l, (_, cb) in zip(self.layers, formula, comm))
        grad = float(FP32_GRAD_BYTES if grad_bytes_per_param is None else grad_bytes_per_param)
        return LayerCosts(
            f=tuple(t.f + cf for t, (cf, _) in zip(self.layers, comm)),
            b_input=tuple(t.b_input + (t.f * l.flops_recompute / l.flops_f if l.flops_f else 0.0) + cb
                          for t, l, (_, cb) in zip(self.layers, formula, comm)),
            w=tuple(t.w for t in self.layers),
            act=tuple(float(a) for a in act),
            act_w=tuple(float(a) for a in act_w),
            out_bytes=tuple(l.out_bytes for l in formula),
            params=tuple(float(l.params) for l in formula),
            bytes_per_param_static=float(bytes_per_param),
            grad_bytes_per_param=grad,
            optim_time_per_param=self.optimizer_seconds_per_param,
            copy_time=self.copy_time,
            b_full=full,
            op_overhead=self.overhead,
            data_time=self.data_time,
            first_stage_all_in_w=self.first_stage_all_in_w,
            grad_copy_per_byte=self.grad_copy_per_byte,
        )

    def collective_times(self, recompute: str = "none") -> list[tuple[float, float]]:
        """Per layer: seconds of its tensor-parallel collectives in F and in the input backward
        (:func:`cost_models.transformer.layer_collectives` priced on ``tp_allreduce``, a ring of the
        group's T processes); zeros at T = 1."""
        n = len(self.layers)
        if self.tp == 1:
            return [(0.0, 0.0)] * n
        link = self.tp_allreduce
        one = Cluster(name=f"{self.name}-tp", nodes=1, devices_per_node=self.tp, device=self.device(), intra=link,
                      inter=link, collective=link)
        group = TensorParallelGroup(one, self.tp)
        return [(group.phase_time(c.forward), group.phase_time(c.backward))
                for c in layer_collectives(self.model, recompute, self.tp)]

    def moe_blocks(self) -> list[bool]:
        """Per layer (embedding, blocks, head): whether it is a MoE block."""
        if self.is_stack:
            return [False] * len(self.layers)
        return [False] + [is_moe_block(self.model, i) for i in range(self.model.layers)] + [False]

    def a2a_times(self) -> tuple[float, float, float]:
        """Seconds of one MoE block's three forward all-to-alls on the fit (``all_to_all``): the
        per-expert counts (E int64 = 8 E bytes), the dispatch and the combine (n k h d bytes each per
        rank, :func:`cost_models.moe.moe_share`); zeros at E = 1 (the executor's all-to-all is then
        the identity). With an emulated wire (``a2a_wire``, the job's ``--a2a-wire`` W bytes/s) the
        dispatch and the combine of S bytes take ``max(latency + S / bandwidth, S / W)``: the
        executor's exchange ends no earlier than S / W after its start
        (:func:`executor.expert_parallel.wire_wait`); the counts take no wire time."""
        if self.ep == 1 or self.all_to_all is None:
            return 0.0, 0.0, 0.0
        from .moe import moe_share
        from .parallel import Parallel
        share = moe_share(self.model, Parallel(ep=self.ep))
        link = self.all_to_all
        one = lambda nbytes: link.latency + nbytes / link.bandwidth  # noqa: E731
        wire = (lambda nbytes: max(one(nbytes), nbytes / self.a2a_wire)) if self.a2a_wire is not None else one
        return one(8.0 * self.model.experts), wire(share.dispatch_bytes), wire(share.combine_bytes)

    def round_time(self) -> float:
        """Seconds of one synchronous gloo round of the EP group inside a run: ``a2a_round``, else the
        fit's own, ``all_to_all.latency / 2`` (the fit's empty exchange is two rounds: its counts'
        and its rows'); 0 at E = 1."""
        if self.ep == 1 or self.all_to_all is None:
            return 0.0
        return self.a2a_round if self.a2a_round is not None else self.all_to_all.latency / 2

    def a2a_forward_parts(self) -> tuple[float, float, float, float]:
        """One MoE block's forward all-to-alls as (sync before the dispatch's rows, the dispatch's
        rows, sync before the combine's rows, the combine's rows), seconds. The executor's F holds four
        synchronous rounds a block (:mod:`executor.expert_parallel`): the per-expert counts exchange
        (its counts' round and its rows), then the dispatch's and the combine's counts' rounds; each
        costs ``c`` = :meth:`round_time` on the compute stream, so the per-expert counts take
        ``2c + 8E / bandwidth`` and the dispatch ``c``, the combine ``c``. The rows of S bytes are
        what is left of the fitted exchange (``latency + S / bandwidth``, which holds one counts'
        round at the fit's ``latency / 2``) and of the wire (its clock starts at the call, before the
        counts' round): ``max(latency / 2 + S / bandwidth, S / W - c)``. At ``c = latency / 2`` (a
        profile without ``a2a_round``) the four sum to :meth:`a2a_times`' three, exactly. Zeros at E = 1."""
        if self.ep == 1 or self.all_to_all is None:
            return 0.0, 0.0, 0.0, 0.0
        from .moe import moe_share
        from .parallel import Parallel
        share = moe_share(self.model, Parallel(ep=self.ep))
        link, c = self.all_to_all, self.round_time()

        def rows(nbytes: float) -> float:
            fit = link.latency / 2 + nbytes / link.bandwidth
            return max(fit, nbytes / self.a2a_wire - c) if self.a2a_wire is not None else fit
        return (2 * c + 8.0 * self.model.experts / link.bandwidth + c, rows(share.dispatch_bytes), c,
                rows(share.combine_bytes))

    def all_to_all_times(self, recompute: str = "none") -> tuple[tuple[float, ...], tuple[float, ...]]:
        """Per layer, the all-to-all seconds in F (:meth:`a2a_forward_parts`: the synchronous rounds
        at the in-run round cost and the dispatch's and combine's rows) and in the input backward (the
        dispatch's and combine's gradients, :meth:`a2a_times`; under full recomputation the forward's
        again): 0 but in MoE blocks at E > 1."""
        _counts, disp, comb = self.a2a_times()
        f = sum(self.a2a_forward_parts())
        b = disp + comb + (f if recompute == "full" else 0.0)
        moe = self.moe_blocks()
        return tuple(f if m else 0.0 for m in moe), tuple(b if m else 0.0 for m in moe)

    def layer_segments(self, lc: LayerCosts, recompute: str = "none", split: bool = True
                       ) -> tuple[list[list[tuple[str, float]]], list[list[tuple[str, float]]]]:
        """Per layer, its F and its backward as ("compute" | "comm", seconds) segments (as
        :meth:`cost_models.transformer.TransformerCostModel.layer_segments`): a MoE block's F is the
        attention and router, the counts and dispatch all-to-alls, the routed and shared experts
        (``expert_layers``' ``experts`` + ``shared``), the combine; its backward the combine's
        gradient, the experts' input gradients, the dispatch's gradient, the rest (after the re-run
        forward's under full recomputation); any other layer one compute segment. The segments of a
        layer sum to its ``lc.f`` and to its input backward (``split``) or full backward (else: the
        weight gradients in the last compute segment); the all-to-alls are the fit's, the compute
        segments the measured alone times scaled to the rest (measured alone, the experts can take
        longer than inside the block on a loaded host: never a negative segment)."""
        _counts, disp, comb = self.a2a_times()
        sync_d, rows_d, sync_c, rows_c = self.a2a_forward_parts()
        parts = dict(self.expert_layers)
        ex = [parts[k] for k in ("experts", "shared") if k in parts]
        ex_f, ex_b = sum(t.f for t in ex), sum(t.b_input for t in ex)
        full = recompute == "full"
        back_total = lc.b_input if split else (lc.b_full or tuple(b + w for b, w in zip(lc.b_input, lc.w)))
        fs, bs = [], []
        for f, b, moe in zip(lc.f, back_total, self.moe_blocks()):
            if not moe or not ex:
                fs.append([("compute", f)])
                bs.append([("compute", b)])
                continue
            fwd = _fitted([("compute", max(0.0, f - sync_d - rows_d - sync_c - rows_c - ex_f)), ("round", sync_d),
                           ("comm", rows_d), ("compute", ex_f), ("round", sync_c), ("comm", rows_c)], f)
            back = (fwd if full else []) + [("comm", comb), ("compute", ex_b), ("comm", disp)]
            back.append(("compute", max(0.0, b - sum(x for _, x in back))))
            fs.append(fwd)
            bs.append(_fitted(back, b))
        return fs, bs

    def _stack_costs(self, recompute: str, bytes_per_param: float, grad_bytes_per_param: float | None) -> LayerCosts:
        if recompute != "none":
            raise SpecError(f"profile {self.name}: recomputation is modelled for transformers; a layer-stack profile "
                            f"takes recompute none")
        st: StackSpec = self.model
        act_w = self.act_w_bytes if self.act_w_bytes is not None else self.act_bytes
        full = tuple(t.b for t in self.layers) if all(t.b is not None for t in self.layers) else None
        return LayerCosts(
            f=tuple(t.f for t in self.layers), b_input=tuple(t.b_input for t in self.layers),
            w=tuple(t.w for t in self.layers), act=tuple(self.act_bytes), act_w=tuple(act_w),
            out_bytes=tuple(st.out_bytes), params=tuple(st.params), bytes_per_param_static=float(bytes_per_param),
            grad_bytes_per_param=float(st.dtype_bytes if grad_bytes_per_param is None else grad_bytes_per_param),
            optim_time_per_param=self.optimizer_seconds_per_param, copy_time=self.copy_time, b_full=full,
            op_overhead=self.overhead, data_time=self.data_time, first_stage_all_in_w=self.first_stage_all_in_w,
            grad_copy_per_byte=self.grad_copy_per_byte, act_first=tuple(st.act_first),
            act_w_first=tuple(st.act_w_first))

    def default_partition(self, num_stages: int) -> tuple[int, ...]:
        """Layers per stage the executor uses by default for this model (so simulated = run)."""
        if self.is_stack:
            return tuple(stack_partition(self.model.params, num_stages))
        return default_partition(self.model.layers, num_stages)

    def time_partition(self, num_stages: int) -> tuple[int, ...]:
        """Layers per stage balanced by the measured time of each layer (forward + full backward):
        the min-max split of :func:`cost_models.partition.balanced_counts`."""
        return tuple(balanced_counts([t.f + (t.b if t.b is not None else t.b_input + t.w) for t in self.layers],
                                     num_stages))

    def cost_model(self, num_stages: int, partition: tuple[int, ...] | None = None, **kw) -> PerLayerCostModel:
        """A per-layer cost model (seconds, bytes); ``kw`` go to :meth:`layer_costs`. A MoE model's
        binds with F / B phases (:class:`PhasedCostModel`)."""
        part = partition or self.default_partition(num_stages)
        lc = self.layer_costs(**kw)
        if not self.is_stack and self.model.is_moe:
            return PhasedCostModel(lc, part, self, kw.get("recompute", "none"))
        return PerLayerCostModel(lc, part)

    def cluster(self, num_ranks: int) -> Cluster:
        """``num_ranks`` cpu ranks on one host: the p2p fit is every rank's port, the all-reduce fit
        the collective."""
        return Cluster(name=f"{self.name}-{num_ranks}", nodes=1, devices_per_node=num_ranks, device=self.device(),
                       intra=self.p2p, inter=self.p2p, collective=self.allreduce,
                       description=f"{num_ranks} CPU ranks calibrated by profile {self.name}")

    def host_cores(self) -> dict | None:
        """How the ranks share the calibrated host (the fields of :class:`sim.host.HostCores`;
        None when the profile names no core count). With T > 1 a rank is a TP group of T processes
        that needs T cores: the host has ``cores // T`` (at least 1)."""
        if not self.cores:
            return None
        return {"cores": max(1, self.cores // self.tp), "time_slice": self.time_slice,
                "oversubscribed_slowdown": self.oversubscribed_slowdown}

    def to_dict(self) -> dict:
        # meta first: a measured profile's meta (MEASURED) makes the other fields it writes required,
        # so a file cut short anywhere after it is refused (profile_from_dict)
        d = {"format": FORMAT, "name": self.name, "meta": dict(self.meta), "model": self.model.to_dict(),
             "per_layer": [{"f": t.f, "b_input": t.b_input, "w": t.w, **({"b": t.b} if t.b is not None else {})}
                           for t in self.layers],
             "p2p": {"latency": self.p2p.latency, "bandwidth": self.p2p.bandwidth},
             "allreduce": {"latency": self.allreduce.latency, "bandwidth": self.allreduce.bandwidth},
             "optimizer": {"seconds_per_param": self.optimizer_seconds_per_param},
             "copy_time": self.copy_time}
        if self.memory_bytes is not None:
            d["memory"] = self.memory_bytes
        if self.act_bytes is not None:
            d["act_bytes_per_layer"] = list(self.act_bytes)
        if self.act_w_bytes is not None:
            d["act_w_bytes_per_layer"] = list(self.act_w_bytes)
        if self.overhead:
            d["overhead"] = dict(self.overhead)
        if self.cores is not None:
            d["cores"] = self.cores
        d["oversubscribed_slowdown"] = self.oversubscribed_slowdown
        if self.time_slice is not None:
            d["time_slice"] = self.time_slice
        d["data_time"] = self.data_time
        d["grad_copy_per_byte"] = self.grad_copy_per_byte
        d["first_stage_all_in_w"] = self.first_stage_all_in_w
        if self.act_bytes_recompute:
            d["act_bytes_recompute_per_layer"] = {m: list(v) for m, v in self.act_bytes_recompute}
        d["precision"] = self.precision
        if self.tp > 1:
            d["tp"] = self.tp
            d["tp_allreduce"] = {"latency": self.tp_allreduce.latency, "bandwidth": self.tp_allreduce.bandwidth}
        if self.ep > 1:
            d["ep"] = self.ep
            d["all_to_all"] = {"latency": self.all_to_all.latency, "bandwidth": self.all_to_all.bandwidth,
                               **({"residual": self.a2a_residual} if self.a2a_residual is not None else {}),
                               **({"round": self.a2a_round} if self.a2a_round is not None else {})}
        if self.expert_layers:
            d["expert_layers"] = {k: {"f": t.f, "b_input": t.b_input, "w": t.w,
                                      **({"b": t.b} if t.b is not None else {})} for k, t in self.expert_layers}
        return d


def _fitted(segs: list[tuple[str, float]], total: float) -> list[tuple[str, float]]:
    """``segs`` with the compute segments scaled so that all sum to ``total`` (the comm kept; total
    is at least their sum: a layer's time includes its all-to-alls); a "round" segment (a
    synchronous exchange priced as such, :meth:`CalibrationProfile.a2a_forward_parts`) is kept
    unscaled and becomes compute: it holds the op's own stream, no other op hides it."""
    fixed = sum(x for k, x in segs if k != "compute")
    compute = sum(x for k, x in segs if k == "compute")
    k = max(0.0, total - fixed) / compute if compute > 0 else 0.0
    return [("compute", x * k) if kind == "compute" else ("compute", x) if kind == "round" else (kind, x)
            for kind, x in segs]


@dataclass(frozen=True)
class PhasedCostModel(PerLayerCostModel):
    """A per-layer cost model whose stage costs carry F / B phases from the layers' segments
    (:func:`cost_models.transformer.stage_phases`): a calibrated mixture of experts."""

    profile: "CalibrationProfile | None" = None
    recompute: str = "none"

    def bind(self, sched):
        from dataclasses import replace
        costs = super().bind(sched)
        fs, bs = self.profile.layer_segments(self.layers, self.recompute, sched.split_backward)
        # a full backward's weight gradients are in its layers' segments already
        lc = self.layers if sched.split_backward else replace(self.layers, w=tuple(0.0 for _ in self.layers.w))
        return stage_phases(costs, sched, lc, fs, bs, self.partition)


_FIELDS = ("format", "name", "model", "layers", "per_layer", "act_bytes", "act_bytes_per_layer", "p2p",
           "allreduce", "optimizer", "copy_time", "memory", "meta", "act_w_bytes_per_layer", "overhead", "cores",
           "data_time", "first_stage_all_in_w", "grad_copy_per_byte", "oversubscribed_slowdown",
           "act_bytes_recompute_per_layer", "precision", "time_slice", "tp", "tp_allreduce", "ep", "all_to_all",
           "expert_layers")
OVERHEAD_KINDS = ("F", "B", "W", "SEND", "RECV", "OPTIM")
EXPERT_PARTS = ("router", "experts", "experts_ep1", "shared")   # calibration.measure.MOE_PARTS
# a profile that ``pipetwin calibrate`` measured has this key in its meta (calibration.host.host_profile) ...
MEASURED = "runtime_scale"
# ... and every field it always writes: such a profile missing one was cut short (it would simulate
# with the defaults, silently off)
MEASURED_FIELDS = ("per_layer", "act_bytes_per_layer", "act_w_bytes_per_layer", "optimizer", "copy_time", "cores",
                   "oversubscribed_slowdown", "data_time", "grad_copy_per_byte", "first_stage_all_in_w", "precision")


def _timing(v, source: str, fld: str) -> LayerTiming:
    _spec.mapping(v, source, fld)
    _spec.check_fields(v, source, ("f", "b_input", "w", "b"), ("f", "b_input", "w"), fld + ".")
    b = _spec.seconds(v["b"], source, f"{fld}.b") if "b" in v else None
    return LayerTiming(*(_spec.seconds(v[k], source, f"{fld}.{k}") for k in ("f", "b_input", "w")), b)


def _per_layer_bytes(d, key: str, n: int, source: str):
    if key not in d:
        return None
    al = d[key]
    if not isinstance(al, list) or len(al) != n:
        raise SpecError(f"{source}: field {key!r} must list {n} numbers")
    return tuple(_spec.size_bytes(v, source, f"{key}[{i}]", allow_zero=True) for i, v in enumerate(al))


def _fit(v, source: str, fld: str, kind: str) -> LinkSpec:
    _spec.mapping(v, source, fld)
    _spec.check_fields(v, source, ("latency", "bandwidth"), ("latency", "bandwidth"), fld + ".")
    return LinkSpec(kind, _spec.bandwidth(v["bandwidth"], source, fld + ".bandwidth"),
                    _spec.seconds(v["latency"], source, fld + ".latency"))


def profile_from_dict(d, source: str = "<dict>") -> CalibrationProfile:
    d = _spec.mapping(d, source)
    _spec.check_fields(d, source, _FIELDS, ("model", "p2p", "allreduce"))
    meta = d.get("meta", {}) or {}
    _spec.mapping(meta, source, "meta")
    missing = [k for k in MEASURED_FIELDS if k not in d] if MEASURED in meta else []
    if missing:
        raise SpecError(f"{source}: a measured profile (pipetwin calibrate) lacks field(s) {', '.join(missing)}: "
                        f"the file was cut short or edited; calibrate again")
    fmt = d.get("format", FORMAT)
    if fmt != FORMAT:
        raise SpecError(f"{source}: field 'format' must be {FORMAT!r}; got {fmt!r}")
    m = d["model"]
    stack = isinstance(m, dict) and "file" in m
    try:
        if stack:
            model = stack_from_dict(m, f"{source} (field 'model')")
        else:
            model = load_model(m) if isinstance(m, str) else spec_from_dict(m, f"{source} (field 'model')")
    except SpecError as e:
        raise SpecError(f"{source}: field 'model': {e}") from None
    n = model.num_layers if stack else model.layers + 2
    if stack and ("per_layer" not in d or "act_bytes_per_layer" not in d):
        raise SpecError(f"{source}: a layer-stack profile (model.file) needs fields 'per_layer' and "
                        f"'act_bytes_per_layer' ({n} entries each)")
    if "per_layer" in d:
        pl = d["per_layer"]
        if not isinstance(pl, list) or len(pl) != n:
            what = "the stack's layers" if stack else f"embedding, {model.layers} blocks, head"
            raise SpecError(f"{source}: field 'per_layer' must list {n} layers ({what}); "
                            f"got {len(pl) if isinstance(pl, list) else pl!r}")
        layers = tuple(_timing(v, source, f"per_layer[{i}]") for i, v in enumerate(pl))
    elif "layers" in d:
        by = _spec.mapping(d["layers"], source, "layers")
        _spec.check_fields(by, source, KINDS, KINDS, "layers.")
        t = {k: _timing(by[k], source, f"layers.{k}") for k in KINDS}
        layers = (t["embedding"], *[t["block"]] * model.layers, t["head"])
    else:
        raise SpecError(f"{source}: missing field 'layers' (or 'per_layer')")
    act = None
    if "act_bytes_per_layer" in d:
        al = d["act_bytes_per_layer"]
        if not isinstance(al, list) or len(al) != n:
            raise SpecError(f"{source}: field 'act_bytes_per_layer' must list {n} numbers")
        act = tuple(_spec.size_bytes(v, source, f"act_bytes_per_layer[{i}]", allow_zero=True)
                    for i, v in enumerate(al))
    elif "act_bytes" in d:
        ab = _spec.mapping(d["act_bytes"], source, "act_bytes")
        _spec.check_fields(ab, source, KINDS, KINDS, "act_bytes.")
        v = {k: _spec.size_bytes(ab[k], source, f"act_bytes.{k}", allow_zero=True) for k in KINDS}
        act = (v["embedding"], *[v["block"]] * model.layers, v["head"])
    opt = d.get("optimizer", {}) or {}
    _spec.mapping(opt, source, "optimizer")
    _spec.check_fields(opt, source, ("seconds_per_param",), prefix="optimizer.")
    osp = _spec.seconds(opt.get("seconds_per_param", 0.0), source, "optimizer.seconds_per_param")
    mem = d.get("memory")
    ovh = _spec.mapping(d.get("overhead", {}) or {}, source, "overhead")
    _spec.check_fields(ovh, source, OVERHEAD_KINDS, prefix="overhead.")
    overhead = tuple((k, _spec.seconds(ovh[k], source, f"overhead.{k}")) for k in OVERHEAD_KINDS if k in ovh)
    cores = d.get("cores")
    if cores is not None and (isinstance(cores, bool) or not isinstance(cores, int) or cores < 1):
        raise SpecError(f"{source}: field 'cores' must be an integer >= 1; got {cores!r}")
    rec = _spec.mapping(d.get("act_bytes_recompute_per_layer", {}) or {}, source, "act_bytes_recompute_per_layer")
    _spec.check_fields(rec, source, ("selective", "full"), prefix="act_bytes_recompute_per_layer.")
    act_rec = tuple((m, _per_layer_bytes(rec, m, n, f"{source}: act_bytes_recompute_per_layer"))
                    for m in ("selective", "full") if m in rec)
    precision = d.get("precision", "fp32")
    if precision not in PRECISIONS:
        raise SpecError(f"{source}: field 'precision' must be one of {', '.join(PRECISIONS)}; got {precision!r}")
    over = d.get("oversubscribed_slowdown", 1.0)
    if isinstance(over, bool) or not isinstance(over, (int, float)) or not 1 <= over <= 10:
        raise SpecError(f"{source}: field 'oversubscribed_slowdown' must be a number in [1, 10]; got {over!r}")
    tp = _check_group_size(source, "tp", d.get("tp", 1), file=d)
    tp_ar = _fit(d["tp_allreduce"], source, "tp_allreduce", "calibrated-tp-allreduce") if tp > 1 else None
    if tp > 1 and stack:
        raise SpecError(f"{source}: field 'tp' {tp}: tensor parallelism splits the built-in GPT's layers, not a layer "
                        f"stack's; tp must be 1")
    if tp > 1:
        try:
            model.check_tensor_parallel(tp, "tp")
        except ValueError as e:
            raise SpecError(f"{source}: field 'tp': {e}") from None
    ep = _check_group_size(source, "ep", d.get("ep", 1), file=d)
    a2a, a2a_res, a2a_round = None, None, None
    if ep > 1:
        v = _spec.mapping(d["all_to_all"], source, "all_to_all")
        _spec.check_fields(v, source, ("latency", "bandwidth", "residual", "round"), ("latency", "bandwidth"),
                           "all_to_all.")
        if "round" in v:
            a2a_round = _spec.seconds(v["round"], source, "all_to_all.round")
        a2a = _fit({k: v[k] for k in ("latency", "bandwidth")}, source, "all_to_all", "calibrated-all-to-all")
        if "residual" in v:
            a2a_res = v["residual"]
            if isinstance(a2a_res, bool) or not isinstance(a2a_res, (int, float)) or not 0 <= a2a_res < 1e6:
                raise SpecError(f"{source}: field 'all_to_all.residual' must be a number >= 0; got {a2a_res!r}")
            a2a_res = float(a2a_res)
    ex = _spec.mapping(d.get("expert_layers", {}) or {}, source, "expert_layers")
    _spec.check_fields(ex, source, EXPERT_PARTS, prefix="expert_layers.")
    expert_layers = tuple((k, _timing(ex[k], source, f"expert_layers.{k}")) for k in EXPERT_PARTS if k in ex)
    time_slice = d.get("time_slice")
    if time_slice is not None:
        time_slice = _spec.seconds(time_slice, source, "time_slice", allow_zero=False)
    return CalibrationProfile(
        name=str(d.get("name", Path(source).stem)), model=model, layers=layers,
        p2p=_fit(d["p2p"], source, "p2p", "calibrated-p2p"),
        allreduce=_fit(d["allreduce"], source, "allreduce", "calibrated-allreduce"),
        optimizer_seconds_per_param=osp,
        copy_time=_spec.seconds(d.get("copy_time", 0.0), source, "copy_time"),
        memory_bytes=None if mem is None else _spec.size_bytes(mem, source, "memory"),
        act_bytes=act, meta=dict(meta), act_w_bytes=_per_layer_bytes(d, "act_w_bytes_per_layer", n, source),
        overhead=overhead, cores=cores,
        data_time=_spec.seconds(d.get("data_time", 0.0), source, "data_time"),
        first_stage_all_in_w=bool(d.get("first_stage_all_in_w", False)),
        grad_copy_per_byte=_spec.seconds(d.get("grad_copy_per_byte", 0.0), source, "grad_copy_per_byte"),
        oversubscribed_slowdown=float(over), act_bytes_recompute=act_rec, precision=precision,
        time_slice=time_slice, tp=tp, tp_allreduce=tp_ar, ep=ep, all_to_all=a2a, a2a_residual=a2a_res,
        a2a_round=a2a_round,
        expert_layers=expert_layers)


def load_profile(path: str | Path) -> CalibrationProfile:
    """Read a calibration profile YAML file (see the module docstring for the format)."""
    p = Path(path)
    try:
        text = read_text(p, "calibration profile")
    except FileError as e:
        raise SpecError(str(e)) from None
    data = _spec.parse_yaml(text, str(p))
    try:
        check_kind(data, str(p), "profile")
    except FileError as e:
        raise SpecError(str(e)) from None
    return profile_from_dict(data, str(p))


def save_profile(profile: CalibrationProfile, path: str | Path) -> Path:
    """Write a profile (per-layer form) that :func:`load_profile` reads back unchanged."""
    return write_output(path, yaml.safe_dump(profile.to_dict(), sort_keys=False), "calibration profile")


def host_flop_rate(profile: CalibrationProfile) -> float:
    """FLOP/s this host reached over the whole model: counted FLOPs of the forward and full backward
    of every layer (measured for a layer stack, from the formulas of :mod:`cost_models.transformer`
    for a transformer) over their measured seconds."""
    if profile.is_stack:
        if profile.model.flops is None:
            raise SpecError(f"profile {profile.name} has no FLOP counts (calibrate again to scale it onto a device)")
        flops = [(f, b) for f, b, _, _ in profile.model.flops]
    else:
        flops = [(l.flops_f, l.flops_b_input + l.flops_w) for l in transformer_layers(profile.model)]
    secs = sum(t.f + (t.b if t.b is not None else t.b_input + t.w) for t in profile.layers)
    total = sum(f + b for f, b in flops)
    if secs <= 0 or total <= 0:
        raise SpecError(f"profile {profile.name}: no FLOPs or no time measured; cannot scale it onto a device")
    return total / secs


def scaled_layer_costs(profile: CalibrationProfile, device: DeviceSpec, precision: str = "fp32",
                       bytes_per_param: float = 16.0) -> tuple[LayerCosts, float]:
    """The profile's layers on ``device``: every measured time (F, B, split B and W) times
    ``host_flop_rate / device.achievable_flops(precision)`` (one factor for the whole model: the
    measured proportions between layers are kept; see the module docstring); activation, output
    and parameter bytes as measured; the optimizer step at the device's memory bandwidth (28 bytes
    touched per parameter, as :class:`cost_models.transformer.TransformerCostModel`); no host
    overheads (per-op, data, gradient copies: this host's CPU runtime costs). Returns (costs,
    the factor)."""
    base = profile.layer_costs(bytes_per_param=bytes_per_param)
    factor = host_flop_rate(profile) / device.achievable_flops(precision)
    sc = lambda xs: tuple(x * factor for x in xs)  # noqa: E731
    bw = device.memory_bandwidth
    costs = LayerCosts(
        f=sc(base.f), b_input=sc(base.b_input), w=sc(base.w), act=base.act, act_w=base.act_w,
        out_bytes=base.out_bytes, params=base.params, bytes_per_param_static=base.bytes_per_param_static,
        grad_bytes_per_param=base.grad_bytes_per_param, optim_time_per_param=(28.0 / bw) if bw else 0.0,
        copy_time=(2 * max(base.out_bytes) / bw) if bw else 0.0,
        b_full=sc(base.b_full) if base.b_full is not None else None,
        first_stage_all_in_w=base.first_stage_all_in_w, act_first=base.act_first, act_w_first=base.act_w_first)
    return costs, factor
