"""Memory per device: static state plus the activations of in-flight micro-batches, and the
out-of-memory verdict.

Static memory of a rank = parameters of every (copy, stage) it holds x bytes per parameter
(weights + gradients + optimizer state; 16 for mixed-precision Adam), each divided by the ZeRO
shard group S where the stage shards it (1 optimizer state, 2 and gradients, 3 and weights), plus,
with ZeRO-3, the whole weights it gathers for the compute (held across the activation peak:
``StageCosts.meta['memory_gathered']``, per rank). A bidirectional schedule
holds two copies of each stage, so its weights count twice: this follows from
``Schedule.stages_on`` and is already in ``StageCosts.static_mem``.

Activation memory is walked along a rank's program (its own op order decides it; timing does
not): F of (copy, stage) adds ``act[copy][stage]``; B frees it and, for split schedules, keeps
``act_w`` until the W of the same micro-batch frees that. The peak over the walk is what the
rank needs on top of its static memory. Units are those of the StageCosts (bytes, or Ma / Mw
for the unit model). This is what a trace measures too (simulated and executed alike).

Whether a GPU keeps it (:func:`memory_verdict`) also counts what the walk leaves out and can be
counted, the *transients* a cost model states (``StageCosts.meta['memory_transient']``: the one
layer being recomputed, whose activations live from its re-run forward to its backward, and the
staging buffers of one send and one receive), and a *reserve* for what cannot be: the CUDA
context, the communication library's buffers and the allocator's fragmentation, by default
:data:`RESERVE_BYTES` + :data:`RESERVE_FRACTION` of the device's memory (``--memory-reserve``).
A peak within :data:`NEAR_LIMIT` of the memory left is called near the limit.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

from schedules.ir import COMPUTE_KINDS, B, F, W, activation_change

from .base import StageCosts


BYTE_UNITS = (("B", 1), ("KiB", 2 ** 10), ("MiB", 2 ** 20), ("GiB", 2 ** 30), ("TiB", 2 ** 40))


def byte_unit(values) -> tuple[str, int]:
    """The binary unit that shows ``values`` (bytes) best: the largest in which the biggest value is >= 1."""
    top = max((abs(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))), default=0)
    name, div = BYTE_UNITS[0]
    for n, d in BYTE_UNITS:
        if top >= d:
            name, div = n, d
    return name, div


def fmt_bytes(n: float) -> str:
    """One size in its own best unit: ``2.11 MiB``."""
    name, div = byte_unit([n])
    return f"{n:.0f} B" if div == 1 else f"{n / div:.3g} {name}"


RESERVE_BYTES = 2 ** 30        # CUDA context and communicator buffers
RESERVE_FRACTION = 0.05        # allocator fragmentation
NEAR_LIMIT = 0.95


def default_reserve(capacity: float) -> float:
    """Bytes kept back on a device of ``capacity`` bytes: 1 GiB + 5% of it."""
    return RESERVE_BYTES + RESERVE_FRACTION * capacity


def check_reserve(reserve: float | None, capacity: float, device: str = "") -> None:
    """A ``--memory-reserve`` of ``reserve`` bytes must leave something of a device of ``capacity``
    bytes (``device``: its name, for the message): at or above it, nothing would be usable."""
    if reserve is not None and capacity and reserve >= capacity:
        whose = f"the {device}'s" if device else "the device's"
        raise ValueError(f"--memory-reserve {fmt_bytes(reserve)} is not below {whose} {fmt_bytes(capacity)} of "
                         f"memory: nothing would be usable; give less (default {fmt_bytes(default_reserve(capacity))})")


def usable_memory(capacity: float, reserve: float | None = None) -> float:
    """What a plan may use of a device of ``capacity`` bytes: less ``reserve`` (None: the default;
    one at or above ``capacity`` is refused, :func:`check_reserve`)."""
    check_reserve(reserve, capacity)
    return capacity - (default_reserve(capacity) if reserve is None else reserve)


@dataclass(frozen=True)
class Verdict:
    """Whether a peak fits a device: ``fits``, ``near`` (within :data:`NEAR_LIMIT` of the usable
    memory) and the one line that says so."""

    fits: bool
    near: bool
    text: str


def memory_verdict(static: float, activation: float, capacity: float, *, transient: float = 0.0,
                   reserve: float | None = None, where: str = "") -> Verdict:
    """The verdict for a peak of ``static`` + ``activation`` bytes (the walk's, on the device
    ``where``) plus ``transient`` bytes, with ``reserve`` (None: :func:`default_reserve`) kept back
    from ``capacity``."""
    usable = usable_memory(capacity, reserve)
    reserve = capacity - usable
    peak = static + activation
    need = peak + transient
    fits = need <= usable
    near = fits and need > NEAR_LIMIT * usable
    on = f" on {where}" if where else ""
    parts = f"peak {fmt_bytes(peak)}{on} (static {fmt_bytes(static)} + activations {fmt_bytes(activation)})"
    if transient:
        parts += f" + transients {fmt_bytes(transient)} (the recomputed layer, send and receive buffers)"
    head = "OUT OF MEMORY" if not fits else "fits, near the limit" if near else "fits"
    text = f"{head}: {parts} vs {fmt_bytes(usable)} usable of {fmt_bytes(capacity)} ({fmt_bytes(reserve)} reserved)"
    return Verdict(fits, near, text)


class OutOfMemory(ValueError):
    """A plan whose peak memory on some device exceeds the device's memory."""


@dataclass(frozen=True)
class StaticMemory:
    """Static bytes of one rank, split by kind: ``weights``, ``grads``, ``optimizer`` as held at
    rest (their ZeRO shards), and ``gathered``: the whole weights ZeRO-3 all-gathers for the
    compute and holds at the peak (:meth:`cost_models.TransformerCostModel.gathered_bytes`)."""

    params: float
    weights: float
    grads: float
    optimizer: float
    gathered: float = 0.0

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.gathered


def static_memory(sched, param_counts: Sequence[float], weight_bytes: float = 2.0, grad_bytes: float = 2.0,
                  bytes_per_param: float = 16.0) -> list[StaticMemory]:
    """Per rank: parameters of the stages it holds (``param_counts[stage]``, every copy counted)
    times weight / gradient / optimizer bytes (optimizer = bytes_per_param - weights - gradients)."""
    opt = max(0.0, bytes_per_param - weight_bytes - grad_bytes)
    out = []
    for r in range(sched.num_ranks):
        p = float(sum(param_counts[s] for _, s in sched.stages_on(sched.rank_device(r))))
        out.append(StaticMemory(p, p * weight_bytes, p * grad_bytes, p * opt))
    return out


def activation_walk(program: Iterable, costs: StageCosts, split_backward: bool,
                    changes: dict | None = None) -> list[float]:
    """Activation memory after each compute op of a program (F / B / W ops; others skipped), by
    the one activation rule :func:`schedules.ir.activation_change`, but where ``changes`` (program
    index -> (allocated, freed): :func:`pair_memory`) says otherwise."""
    level, out = 0.0, []
    for i, op in enumerate(program):
        if op.kind not in COMPUTE_KINDS:
            continue
        act_w = costs.act_w[op.copy][op.stage] if split_backward else 0.0
        alloc, free = activation_change(op.kind, costs.act[op.copy][op.stage], act_w, split_backward)
        if changes and i in changes:
            alloc, free = changes[i]
        level += alloc - free
        out.append(level)
    return out


def peak_activation(sched, costs: StageCosts) -> tuple[float, ...]:
    """Peak activation memory of each rank over its program."""
    peaks = []
    for r in range(sched.num_ranks):
        walk = activation_walk(sched.programs[sched.rank_device(r)], costs, sched.split_backward,
                               pair_memory(sched, costs, r))
        peaks.append(max([0.0, *walk]))
    return tuple(peaks)


def pair_peak(f: Sequence[float], b: Sequence[float], b_kept: Sequence[float] | None = None) -> tuple[float, float]:
    """(the most an overlapped pair adds over what was alive before it, what it leaves): F's
    segments ``f`` allocated one by one, interleaved with B's ``b`` walked last first, each freeing
    ``b_j - b_kept_j`` (``b_kept``: what a split B keeps until W; None: nothing), module docstring's
    closed form."""
    kept = b_kept if b_kept is not None else (0.0,) * len(b)
    if len(kept) != len(b):
        raise ValueError(f"b_kept lists {len(kept)} segments; b has {len(b)}")
    frees = [x - w for x, w in zip(b, kept)][::-1]        # in the order B frees them
    level = peak = 0.0
    for k, x in enumerate(f):
        level += x
        peak = max(peak, level) if k else level
        if k < len(frees):
            level -= frees[k]
    level -= sum(frees[len(f):])
    return peak, level


def pair_memory(sched, costs: StageCosts, rank: int) -> dict[int, tuple[float, float]]:
    """Where an overlapped F&B pair runs segment by segment (the schedule's ``meta["overlapped"]``
    pairs, with segments known: ``costs.act_segments``), (allocated, freed) per index of ``rank``'s
    program for the ops it changes; empty otherwise (every op by :func:`schedules.ir.activation_change`).

    As the executor runs it (:mod:`executor.overlap`): a paired F is cut into its stage's segments
    f; the pair's B walks its own F's segments last first (b, each keeping w until W in a split
    backward, :mod:`cost_models.segments`): its F was cut, paired or not (an F whose B is paired
    runs cut even alone). The pair's F allocates the pair's peak over what was alive before it,
    ``max_k (f_1 + .. + f_k - sum_{j > m-k+1} (b_j - w_j))`` (:func:`pair_peak`),
    and its B frees down to what the pair leaves, ``sum f - sum (b - w)``: the F's trace row holds
    the block's peak, as the executor's does. A split B (paired or not) of a micro-batch whose F was
    cut keeps ``sum w`` until its W, which frees that (a tuple segment keeps its whole graph: more
    than ``act_w``). What a stage's ``act`` holds beyond its segments' sum is in its first segment."""
    pairs = {tuple(a): tuple(b) for a, b in sched.meta.get("overlapped", ())}
    if costs.act_segments is None or not pairs:
        return {}
    from schedules.overlap import paired_backward
    split = sched.split_backward
    program = sched.programs[sched.rank_device(rank)]

    def segs(op) -> tuple[tuple[float, ...], tuple[float, ...]]:
        a = list(costs.act_segments[op.copy][op.stage])
        a[0] += costs.act[op.copy][op.stage] - sum(a)
        w = costs.act_w_segments[op.copy][op.stage] if split else (0.0,) * len(a)
        return tuple(a), tuple(w)

    # the micro-batches (stage, mb) whose F is cut: a paired F, and an F whose B runs in a pair (cut
    # even when it runs alone, so that its B interleaves: executor.runtime.PipelineRuntime)
    cut = {(k[1], k[2]) for k in pairs} | {(b[1], b[2]) for b in pairs.values()}
    out: dict[int, tuple[float, float]] = {}
    for i, op in enumerate(program):
        key = (op.stage, op.mb)
        if op.kind == F:
            want = pairs.get((F, op.stage, op.mb))
            if want is None:
                continue
            j = paired_backward(program, i, want, rank)
            f, _ = segs(op)
            b, w = segs(program[j])
            peak, left = pair_peak(f, b, w)
            out[i] = (peak, 0.0)
            out[j] = (0.0, peak - left)
        elif op.kind == B and key in cut and i not in out and split:
            a, w = segs(op)
            out[i] = (0.0, sum(a) - sum(w))
        elif op.kind == W and key in cut:
            out[i] = (0.0, sum(segs(op)[1]))
    return out


@dataclass(frozen=True)
class MemoryReport:
    """Per-rank static and peak activation memory against a capacity (None: unknown), with the
    transients and reserve of :func:`memory_verdict` (which every verdict here is)."""

    static: tuple[float, ...]
    activation: tuple[float, ...]
    capacity: float | None
    unit: str = "B"
    transient: float = 0.0
    reserve: float | None = None
    capacities: tuple[float, ...] | None = None    # per rank, on a mixed cluster (then each rank's own)

    @property
    def peak(self) -> tuple[float, ...]:
        return tuple(s + a for s, a in zip(self.static, self.activation))

    @property
    def max_peak(self) -> float:
        return max(self.peak)

    @property
    def worst_rank(self) -> int:
        p = self.peak
        return p.index(max(p))

    def _verdict(self, r: int) -> Verdict | None:
        cap = self.capacity if self.capacities is None else self.capacities[r]
        if cap is None or self.unit != "B":
            return None
        return memory_verdict(self.static[r], self.activation[r], cap, transient=self.transient,
                              reserve=self.reserve, where=f"rank {r}")

    @property
    def oom(self) -> bool:
        return bool(self.oom_ranks)

    @property
    def oom_ranks(self) -> tuple[int, ...]:
        return tuple(r for r in range(len(self.static)) if (v := self._verdict(r)) is not None and not v.fits)

    def summary(self) -> str:
        r = self.worst_rank if self.capacities is None or self.unit != "B" else max(   # fullest for its device
            range(len(self.static)), key=lambda i: (self.peak[i] + self.transient)
            / usable_memory(self.capacities[i], self.reserve))
        v = self._verdict(r)
        if v is not None:
            return v.text + (f"; out of memory on rank(s) {', '.join(map(str, self.oom_ranks))}" if self.oom else "")
        fmt = fmt_bytes if self.unit == "B" else (lambda x: f"{x:g} {self.unit}")
        return (f"peak {fmt(self.peak[r])} on rank {r} (static {fmt(self.static[r])} + activations "
                f"{fmt(self.activation[r])})" + ("; device memory unknown" if self.capacity is None else ""))

    def raise_if_oom(self) -> "MemoryReport":
        if self.oom:
            raise OutOfMemory(self.summary() + "; use fewer micro-batches in flight, recomputation, more stages "
                                               "or a device with more memory")
        return self


def memory_report(sched, costs: StageCosts, capacity: float | None = None,
                  reserve: float | None = None) -> MemoryReport:
    """Static + peak activation memory of each rank of ``sched`` under ``costs``. ``capacity``
    defaults to ``costs.meta['memory_capacity']`` (set by TransformerCostModel from the device),
    the transients to ``costs.meta['memory_transient']``; ``reserve`` None: the default one. On a
    mixed cluster (``meta['memory_capacity_by_rank']``, no ``capacity`` given) each rank is judged
    against its own device."""
    by_rank = costs.meta.get("memory_capacity_by_rank") if capacity is None else None
    if capacity is None:
        capacity = costs.meta.get("memory_capacity")
    return MemoryReport(tuple(costs.static_mem), peak_activation(sched, costs), capacity, costs.mem_unit,
                        float(costs.meta.get("memory_transient") or 0.0), reserve,
                        None if by_rank is None else tuple(by_rank))


def check_memory(sched, costs: StageCosts, capacity: float | None = None) -> MemoryReport:
    """:func:`memory_report`, raising :class:`OutOfMemory` when a rank's peak exceeds ``capacity``."""
    return memory_report(sched, costs, capacity).raise_if_oom()
