"""Searching the plan space: an exact dynamic programme over stage suffixes, with pruning.

The space (DAPPLE's): the number of micro-batches M (a divisor of the global batch G; b = G / M),
whose choice matters when per-sample costs depend on the micro-batch (the kernel cost model: a
replica of q = b / r samples runs at the per-sample times of q, :meth:`Workload.at`),
the number of stages S, a contiguous partition of the layers, the replicas r_s of every stage (a
divisor of b, so each replica gets b / r_s whole samples), the placement policy
(:mod:`planner.placement`), with at most the cluster's devices in use and every device's memory
within the limit. :class:`SearchSpace` narrows it (``max_stages=1`` is pure data parallelism,
``uniform=True`` keeps R x D plans only, ``policies``, ``microbatches``, ``replicas``).

Why a DP works. Write the chain of elements of a plan (:mod:`planner.cost`) from the last one back:
with ``V`` = max over the elements e of a suffix of (round trips fw + bw of the suffix up to e) +
(M-1) st_e, and ``T`` = max over its stages of (AR + OPT - backward time between that stage and the
suffix's start), prepending an element gives

    V <- (fw + bw) + max((M - 1) st, V)        T <- max(AR + OPT, T - bw)   (a stage)
    V <- (fw + bw) + max((M - 1) st, V)        T <- T - bw                  (a boundary)

and the whole plan's latency is ``L = V + T``. Both updates are monotone in (V, T), and the memory
of a stage depends on the suffix only through n = min(stages in the suffix, M); the placement of a
stage depends on the suffix only through the slots the suffix takes and the first stage's replicas
(placement packs stages against the end of the allocation order). So for every state

    (j = first layer of the suffix, k = slots the suffix takes, r1 = replicas of its first stage)

the Pareto front of labels (V, T, n) is exact: a label dominated in all three can never lead to a
better plan. Labels are pruned against the best complete plan found so far (kept top_k deep) with a
lower bound: the layers [0, i) still to place need ``W_pre`` per-sample seconds on at most ``P - k``
devices, so some prefix stage runs at least ``W_pre b / (P - k)`` per micro-batch and
``L >= max(V + T, V + W_pre b / (P - k), M W_pre b / (P - k))``. A prefix stage also has at most
``rmax`` replicas (the largest replica count, <= b), so at least ``q = b / min(rmax, P - k)`` samples
per replica: the prefix adds round trips ``R_pre >= W_pre q`` and forwards ``FW_pre >= F_pre q``, and
since prepending adds its round trips to V and takes at most its backwards off T,
``L >= V + max(R_pre, T + FW_pre)``; its slowest stage holds the largest layer, ``>= w_max q``. Before
the exact passes, passes under a trial threshold (a fraction of the best seed, ``CEILINGS``) prune
harder; one counts only when it found top_k plans within its threshold, so what it pruned is worse
than those (:meth:`_Ctx.settled`); else the next raises it, the last has none. A stage that grows (layers added
at its front) only increases V and its memory, so the scan over its first layer stops at the first
one that breaks the memory limit or the bound. For DAPPLE's latency (and the PipeDream baseline's
second phase) the labels also meet whole-prefix bounds: tables, built once per configuration by a DP
forwards from layer 0, of the least (C + Tp), (R + Tp) and forwards any prefix [0, i) on at most f
slots can have (C: its largest pivot term, Tp: its all-reduces sticking out of the ending), with
boundaries free and each stage's all-reduce at its floor over the allocation order
(:func:`_prefix_tables`, :meth:`Topology.allreduce_floor`); they capture the prefix's own pivot and
ending, which the per-label bounds above leave out, and drop whole configurations at their first
stage. A stage's boundary is priced only when some label can pass the scan with it (its costs
only raise p and V). The search is exact: the tests check it against
:func:`exhaustive` (every plan of the space, evaluated with :func:`planner.cost.estimate`).

``dapple-rt`` searches the same way for :attr:`planner.cost.Estimate.latency_rt` (the pivot
formulation plus the 1F1B round-trip bound), with labels (suffix round trip, V, T, n). That search is
a heuristic, not exact: a stage's round-trip bound shrinks when more stages follow it (n larger) while
its memory grows, so labels with different n are not comparable, and treating fewer as better (as
the exact objectives may) can prune the best plan. The planner uses it only to propose candidates
for simulation next to the exact DAPPLE optimum.

The PipeDream objective uses the same DP with labels (slowest element, V, T, n): the slowest element
first, DAPPLE's latency L to break its ties (many plans tie when one layer that cannot be split is
the slowest element; breaking the tie in favour of the shorter iteration makes the baseline as
strong as its objective allows). With top_k = 1 (the baseline's use) it runs as two exact searches:
first the least slowest element p* alone (labels (p, n): V and T do not matter to it, and only a
strictly smaller p than the best found is of use, so the threshold is just below it), then DAPPLE's
L among the plans whose every element is within p* (an element above p* breaks the scan over a
stage's first layer, since elements only grow as a stage grows, and a label whose prefix bound on
the slowest element exceeds p* is dropped). Every plan of the second search has slowest element p*
(none is smaller), so its best is the lexicographic (slowest, L) optimum, and ties fall to the plan
found first as in one search; the second search's labels are DAPPLE's (V, T, n), far fewer than
(p, V, T, n) when many plans tie on p.

The code: :func:`search_plans` offers simple plans first (:func:`_seed`), then runs the passes
(:func:`_passes`), each the DP of every (micro-batch count, policy) configuration (:func:`_dp`). The
DP keeps a front of :class:`Label` per state; :func:`_extend` prepends a stage to the labels of one
state for every replica count (:class:`_NewStage`: its place, its costs and the label-free bounds,
shared by the states at the same layer) and hands them to the objective's scan over the stage's
first layer: :func:`_scan_latency` (DAPPLE's latency, and L within p* for the baseline's second
phase), :func:`_scan_slowest` (PipeDream's objective, and p* alone for the first phase) or
:func:`_scan_round_trip` (``dapple-rt``).
"""
from __future__ import annotations

import bisect
import gc
import heapq
import itertools
import math
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Callable

from cost_models.partition import balanced_edges

from .cost import Estimate, estimate
from .placement import POLICIES, Topology, check_policy
from .plan import Plan, StagePlan
from cost_models.workloads.workload import Workload
from cost_models.files import short_list

OBJECTIVES = ("dapple", "pipedream", "dapple-rt")
INF = float("inf")
CEILINGS = (0.86, 0.93)     # trial thresholds of the first passes, as fractions of the best seed
WCAP = 2                    # the tables keep at most this many micro-batches in flight (fewer tables)


class PlanError(ValueError):
    """No plan of the space fits; the message says why and what to change."""


class _OutOfBudget(Exception):
    pass


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class SearchSpace:
    """Restrictions of the plan space (None: unrestricted)."""

    policies: tuple[str, ...] = POLICIES
    microbatches: tuple[int, ...] | None = None
    max_stages: int | None = None
    uniform: bool = False
    replicas: tuple[int, ...] | None = None
    devices: int | None = None          # use at most this many devices of the cluster

    def __post_init__(self):
        for p in self.policies:
            check_policy(p)
        if self.max_stages is not None and self.max_stages < 1:
            raise ValueError(f"max_stages must be >= 1; got {self.max_stages}")


@dataclass(frozen=True)
class Candidate:
    plan: Plan
    value: float                 # the objective (seconds)
    estimate: Estimate


@dataclass
class SearchResult:
    objective: str
    candidates: list[Candidate]
    evaluated: int = 0           # stage placements evaluated (partial plans)
    complete: int = 0            # complete plans reached
    labels: int = 0              # partial plans kept in the fronts
    seconds: float = 0.0
    configurations: int = 0      # (micro-batch count, policy) pairs searched
    exhausted: bool = True       # False when an evaluation budget stopped the search early

    @property
    def best(self) -> Candidate:
        return self.candidates[0]


@dataclass
class _Ctx:
    work: Workload
    topo: Topology
    G: int
    objective: str
    space: SearchSpace
    capacity: float
    top_k: int
    model: str
    cluster: str
    P: int
    heap: list = field(default_factory=list)        # (-primary, -secondary, seq, key, plan)
    keys: set = field(default_factory=set)
    seq: itertools.count = field(default_factory=itertools.count)
    evaluated: int = 0
    complete: int = 0
    labels: int = 0
    budget: int | None = None
    pcap: float = INF           # "slowest-latency": the largest element a plan may have

    # -------------------------------------------------------------- incumbents
    ceiling: float = INF        # a pass's trial threshold (see :func:`_passes`)

    def threshold(self) -> float:
        if len(self.heap) < self.top_k:
            return self.ceiling
        x = -self.heap[0][0]
        if self.objective == "slowest":     # only a strictly smaller slowest element is of use
            x = math.nextafter(x, -INF)
        return x if x < self.ceiling else self.ceiling

    def settled(self) -> bool:
        """Whether the kept plans are what a search without the ceiling keeps: top_k plans at most
        the ceiling were found, so whatever the ceiling pruned (a lower bound above it) is worse."""
        return len(self.heap) >= self.top_k and -self.heap[0][0] <= self.ceiling

    def offer(self, value: tuple[float, float], M: int, policy: str, path) -> None:
        """A complete plan: stages [(i, j, r), ...] from the first."""
        self.complete += 1
        thr = self.threshold()
        if value[0] > thr:
            return
        stages = []
        while path is not None:
            i, j, r, path = path
            stages.append((i, j, r))
        reps = [r for _, _, r in stages]
        devs = self.topo.place(policy, reps)
        key = (M, tuple((i, j, d) for (i, j, _), d in zip(stages, devs)))
        if key in self.keys:
            return
        if len(self.heap) >= self.top_k:
            worst = self.heap[0]
            if (value[0], value[1]) >= (-worst[0], -worst[1]):
                return
            heapq.heappop(self.heap)
            self.keys.discard(worst[3])
        plan = Plan(self.model, self.cluster, self.G, M,
                    tuple(StagePlan(i, j, d) for (i, j, _), d in zip(stages, devs)), policy)
        heapq.heappush(self.heap, (-value[0], -value[1], next(self.seq), key, plan))
        self.keys.add(key)


def _rep_values(space: SearchSpace, b: int, P: int) -> list[int]:
    reps = [r for r in divisors(b) if r <= P]
    if space.replicas is not None:
        reps = [r for r in reps if r in space.replicas]
    return reps


def _live_reps(ctx: _Ctx, M: int, policy: str) -> list[int]:
    """The replica counts a stage of a plan of (M, policy) can have and still be within the current
    threshold: some single layer fits in memory with one micro-batch of b / r samples kept, and
    the objective of any plan with such a stage is at least M st (DAPPLE's latency: its V counts
    the stage's round trip st plus (M - 1) st; the round-trip latency is larger still) or st (the
    slowest element), st >= the fastest single layer's forward + backward at b / r samples.
    The scans (:func:`_extend`) stop at once on the others (memory, or the threshold), before any label."""
    work, topo, P, b = ctx.work, ctx.topo, ctx.P, ctx.G // M
    thr = ctx.threshold()
    bps, cap = work.bytes_per_param_static, ctx.capacity
    out = []
    for r in _rep_values(ctx.space, b, P):
        if topo.slots(policy, r) > P:
            continue
        q = b / r
        wq = work.at(b // r)
        if min(work.params[l] * bps + work.act[l] * q for l in range(work.num_layers)) > cap:
            continue
        cf, cb = wq.forward_prefix_sums, wq.backward_prefix_sums
        st = min((cf[l + 1] - cf[l] + cb[l + 1] - cb[l]) * q for l in range(work.num_layers))
        if (st if ctx.objective in ("pipedream", "slowest") else M * st) > thr or st > ctx.pcap:
            continue
        out.append(r)
    return out


def _twin_key(ctx: _Ctx, M: int, policy: str):
    """What determines the search of (M, policy) under the current threshold: the allocation order,
    the translation period and the slots of every live replica count (:func:`_live_reps`). Two
    configurations with the same key run the same DP on the same stage placements (devices
    ``order[offset:offset + r]`` at the same offsets), so they meet the same plans (same keys:
    M and every stage's layers and devices) and a later one, under a threshold no larger, can only
    offer plans the earlier one offered (or worse ones); e.g. fresh-first and append-first when
    every live stage takes whole nodes. None when no replica count is live."""
    live = _live_reps(ctx, M, policy)
    if not live:
        return None
    topo = ctx.topo
    return (M, topo.order(policy), topo.translation_period(policy), tuple((r, topo.slots(policy, r)) for r in live))


def _dp(ctx: _Ctx, M: int, policy: str) -> None:
    """Exact search of one (M, policy): see the module docstring."""
    work, topo, P = ctx.work, ctx.topo, ctx.P
    L, b = work.num_layers, ctx.G // M
    slots = {r: topo.slots(policy, r) for r in _rep_values(ctx.space, b, P)}
    reps = [r for r, s in slots.items() if s <= P]
    if not reps:
        return
    min_slot = min(slots[r] for r in reps)
    # per-sample times at each replica's share of the micro-batch; the bounds use the smallest
    cap = ctx.capacity
    known = _job_cache(topo, work)
    qs = tuple(b // r for r in reps)
    got = known.get(("floor", qs, cap))
    if got is None:
        lo = work.floor(qs)
        got = known[("floor", qs, cap)] = (lo, _sqrt_work_bound(lo, cap))
    lo, g = got     # g: prefix round trips: sum rt >= g[i]^2 b / devices
    needs: dict[int, list[float]] = {}    # w -> slots layers [0, i) need with w micro-batches in flight

    def need(w: int) -> list[float]:
        """need[i]: slots layers [0, i) need with w micro-batches in flight."""
        w = 1 << (w.bit_length() - 1)     # a power of two <= w: a valid (smaller) requirement
        tab = needs.get(w)
        if tab is None:
            rs = tuple((r, slots[r]) for r in reps)
            tab = known.get(("need", b, w, rs, cap))
            if tab is None:
                tab = known[("need", b, w, rs, cap)] = _need_table(work, b, w, list(rs), cap)
            needs[w] = tab
        return tab

    cols: dict = {}     # (w, free // step) -> the columns of _prefix_tables at the slots left
    step = max(1, -(-P // 128))     # the tables count slots in units of step (see _prefix_tables)

    def tables(w: int, free: int):
        """(Y, X, F) of :func:`_prefix_tables` for prefixes on at most ``free`` slots, by first layer
        i of the suffix; None where they do not apply."""
        w = min(1 << (w.bit_length() - 1), WCAP)     # as need(): a valid (smaller) requirement
        key = (w, free // step)
        got = cols.get(key)
        if got is None:
            tk = ("prefix", policy, b, M, w, tuple((r, slots[r]) for r in reps), cap, P)
            tab = known.get(tk)
            if tab is None:
                tab = known[tk] = _prefix_tables(work, topo, policy, b, M, w, reps, slots, cap, P, step)
            f = free // step
            got = cols[key] = tuple(t[:, f].tolist() for t in tab)
        return got

    wmax = [0.0] * (L + 1)      # wmax[i]: the largest per-sample round trip of one layer in [0, i)
    cf, cb = lo.forward_prefix_sums, lo.backward_prefix_sums
    for i in range(1, L + 1):
        x = cf[i] - cf[i - 1] + cb[i] - cb[i - 1]
        wmax[i] = x if x > wmax[i - 1] else wmax[i - 1]
    live = set(_live_reps(ctx, M, policy))
    env = _DPEnv(M=M, policy=policy, b=b, lo=lo, at_q={r: work.at(b // r) for r in reps}, reps=reps,
                 live=[r for r in reps if r in live], slots=slots,
                 min_slot=min_slot, need=need, g=g, N=topo.num_devices, period=topo.translation_period(policy),
                 rmax=max(reps), wmax=wmax, tables=tables)
    fronts: list[dict] = [dict() for _ in range(L + 1)]
    # A front is keyed by (k mod period, first stage's replicas): on a cluster whose costs do not
    # change when every stage moves by ``period`` slots, a suffix on fewer slots with no worse labels
    # leaves the prefix the same choices and more room (see Topology.translation_period)
    fronts[L][(0, 0)] = [Label(0.0, 0.0, -INF, 0, 0, None, 0)]
    with _collector_paused():
        for j in range(L, 0, -1):
            states = fronts[j]
            fronts[j] = None  # free
            new_stages: dict = {}   # (k2, r) -> the _NewStage, shared by the states at j
            for (_, r1), mixed in states.items():
                by_k: dict[int, list] = {}
                for lab in mixed:
                    by_k.setdefault(lab.k, []).append(lab)
                for k, labels in by_k.items():
                    _extend(ctx, env, j, k, r1, labels, fronts, new_stages)


@contextmanager
def _collector_paused():
    """Python's cyclic garbage collector paused while the DP runs. The fronts keep up to hundreds of
    thousands of labels alive, each an object the collector tracks (a tuple of numbers it would stop
    tracking), and its full passes, started every few hundred thousand allocations, walk them all
    again, which made the searches for GPT-96 on 1,024 GPUs up to 1.7 times slower. The DP makes no
    reference cycles (reference counting frees all it drops), so the pause leaves nothing behind."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@dataclass(frozen=True, kw_only=True)
class _DPEnv:
    """What one (M, policy) search shares between its steps (see :func:`_dp`)."""

    M: int
    policy: str
    b: int
    lo: Workload            # the smallest per-sample times over the replica counts (bounds)
    at_q: dict              # replicas -> the workload at its share of the micro-batch
    reps: list
    live: list              # the replica counts that can still be in a plan within the threshold (_live_reps)
    slots: dict
    min_slot: int
    need: object            # w -> need table
    g: list
    N: int                  # the allocation order's length (stages pack against its end)
    period: int | None
    rmax: int               # the most replicas a stage can have
    wmax: list              # wmax[i]: the largest per-sample round trip of one layer of [0, i)
    tables: object          # (w, free) -> the whole-prefix bounds (_prefix_tables), for DAPPLE's latency


@dataclass(slots=True)
class Label:
    """A partial plan on the front of its state: stages for the layers [j, L) on the last ``k`` slots
    of the allocation order (the state: j, k and its first stage's replicas; module docstring).

    ``p``: the slowest element (PipeDream's objective and DAPPLE's latency, whose fronts ignore it), or
    the suffix's round trip (``dapple-rt``); ``v`` and ``t``: V and T of DAPPLE's latency; ``n`` =
    min(stages, M); ``stages``: the stages, counted only under ``max_stages`` (else 0); ``path``: the
    stages from the first, as nested ``(start, stop, replicas, rest)`` tuples ending in None.

    Slotted and not frozen, for speed: the search builds one per partial plan it keeps (hundreds of
    thousands) and reads its fields in the fronts' comparisons, which a slotted class does as fast as
    a tuple's items (a NamedTuple's fields are slower to read and to unpack, a frozen dataclass is
    four times slower to build); none is changed once built. Like a NamedTuple, and unlike a tuple
    of numbers, it stays tracked by the cyclic garbage collector, which the DP pauses
    (:func:`_collector_paused`)."""

    p: float
    v: float
    t: float
    n: int
    stages: int
    path: tuple | None
    k: int


@dataclass(slots=True)
class _NewStage:
    """A stage [i, j) prepended on ``r`` replicas to the suffixes of one state, the two together on
    the last ``k2`` slots, and the lazily filled tables its labels' scans share: per first layer i,
    the stage's costs and the label-free parts of the bounds on the prefix [0, i) (:func:`_new_stage`),
    each computed once and read by every label in the same arithmetic."""

    j: int
    r: int
    q: float                # samples per replica of a micro-batch
    k2: int
    key: tuple              # the front the new labels go to: (k2 mod period, r)
    free: int               # slots left for the layers [0, i)
    more: bool              # whether another stage fits in them
    off: int                # its place in the allocation order, up to whole translation periods
    rows: list              # rows[i]: the stage [i, j)'s costs (row(i) fills it)
    row: Callable
    bnds: list              # bnds[i]: the label-free bounds on the prefix [0, i) (part(i) fills it)
    part: Callable

    def shared(self) -> tuple:
        """What a scan reads on every step: j, r, q, free, k2, key, rows, row, bnds, part."""
        return self.j, self.r, self.q, self.free, self.k2, self.key, self.rows, self.row, self.bnds, self.part


def _new_stage(ctx: _Ctx, env: _DPEnv, j: int, k2: int, r: int) -> _NewStage:
    """The stage [i, j) on r replicas on the slots before the last k2 - slots(r): it depends on no
    state but through k2, so the states at j share it (and its tables)."""
    work, b, period = ctx.work, env.b, env.period
    q, free = b / r, ctx.P - k2
    # its slots, moved towards the order's start by whole translation periods (no communication cost
    # changes: Topology.translation_period), so the caches of all-reduces and boundaries hold one
    # period of offsets instead of the whole order
    off = (env.N - k2) % period if period else env.N - k2
    wq = env.at_q[r]
    cfq, cbq = wq.forward_prefix_sums, wq.backward_prefix_sums
    cp, ca = work.param_prefix_sums, work.activation_prefix_sums
    bps, gbp, otp = work.bytes_per_param_static, work.grad_bytes_per_param, work.optim_time_per_param
    alpha, beta = ctx.topo.allreduce_at(env.policy, off, r)
    has_ar = bool(alpha or beta)
    rows = [None] * j

    def row(i):
        """The stage [i, j)'s parameter bytes, activation bytes per micro-batch, backward, round trip,
        all-reduce, and all-reduce plus optimizer step."""
        par = cp[j] - cp[i]
        bw = (cbq[j] - cbq[i]) * q
        rt = (cfq[j] - cfq[i]) * q + bw
        ar = alpha + beta * par * gbp if has_ar and par > 0 else 0.0
        got = rows[i] = (par * bps, ca[j] - ca[i], bw, rt, ar, ar + par * otp)
        return got

    # the prefix's stages have at most ``free`` replicas in all and each at most min(rmax, free), so
    # at least qmin = b / min(rmax, free) samples each
    qmin = b / min(env.rmax, free) if free > 0 else 0.0
    cf, cb, g, wmax = env.lo.forward_prefix_sums, env.lo.backward_prefix_sums, env.g, env.wmax
    bnds = [None] * j

    def part(i):
        """The label-free parts of the bounds on the prefix [0, i) on ``free`` slots (module
        docstring): its least slowest stage, round trips and forwards."""
        pw = (cf[i] + cb[i]) * b / free
        x = wmax[i] * qmin
        if x > pw:
            pw = x
        prt = g[i] * g[i] * b / free
        x = (cf[i] + cb[i]) * qmin
        if x > prt:
            prt = x
        got = bnds[i] = (pw, prt, cf[i] * qmin)
        return got

    return _NewStage(j, r, q, k2, (k2 % period if period else k2, r), free, free >= env.min_slot, off, rows, row,
                     bnds, part)


def _heads(labels: list, env: _DPEnv, limit: int | None) -> list[tuple]:
    """What a label's new stage depends on that no replica count changes: (label, n2 = the
    micro-batches the new stage keeps, min(n + 1, M), its stage count, whether a stage may come
    before it (``max_stages``), w = min(n2 + 1, M), and the need table of the stages before it,
    which keep at least w micro-batches). Labels already at ``max_stages`` are left out."""
    M, need = env.M, env.need
    needs: dict = {}
    out = []
    for lab in labels:
        if limit is not None and lab.stages >= limit:
            continue
        n2 = lab.n + 1 if lab.n < M else M
        stages = lab.stages + 1 if limit is not None else 0
        w = n2 + 1 if n2 < M else M
        need_w = needs.get(w)
        if need_w is None:
            need_w = needs[w] = need(w)
        out.append((lab, n2, stages, limit is None or stages < limit, w, need_w))
    return out


def _extend(ctx: _Ctx, env: _DPEnv, j: int, k: int, r1: int, labels: list, fronts: list, new_stages: dict) -> None:
    """Prepend a stage [i, j) to every label of the suffix [j, L) on the last k slots (its first stage
    on r1 replicas): for every replica count r the new stage can have, its place and costs
    (:class:`_NewStage`, kept in ``new_stages`` for the other states at j), the boundary's transfers,
    then the objective's scan over the first layer i (:data:`_SCANS`).

    The boundary is priced (costly the first time) only when some label's shortest new stage fits and
    passes the objective's test with a free boundary: a boundary only raises p and V, so when no
    label passes without it, none passes with it and the scan would evaluate nothing."""
    passes, scan = _SCANS[ctx.objective]
    heads = _heads(labels, env, ctx.space.max_stages)
    uniform, P, budget, cap, M, Mm1 = ctx.space.uniform, ctx.P, ctx.budget, ctx.capacity, env.M, env.M - 1
    nbytes = ctx.work.out_bytes[j - 1] * env.b      # what the boundary carries each way
    for r in env.live:
        if k and uniform and r != r1:
            continue
        k2 = k + env.slots[r]
        if k2 > P:
            continue
        if budget is not None and ctx.evaluated > budget:
            raise _OutOfBudget
        st = new_stages.get((k2, r))
        if st is None:
            st = new_stages[(k2, r)] = _new_stage(ctx, env, j, k2, r)
        thr = ctx.threshold()
        ca = cg = 0.0           # the suffix is empty: no boundary
        if k:
            rows, row, q, more = st.rows, st.row, st.q, st.more
            for lab, n2, _, grows, _, _ in heads:
                i = j - 1 if more and grows else 0
                pbs, da, _, rt, ar, _ = rows[i] or row(i)
                if pbs + n2 * da * q <= cap and passes(ctx, M, lab, n2, rt, ar / r, thr):
                    break
            else:
                continue
            ca, cg = ctx.topo.boundary(env.policy, st.off, r, r1, nbytes)
        # every label's V and T through the boundary (module docstring), the same for every objective;
        # p's rule is the objective's (its scan applies it to ca + cg)
        xb = Mm1 * (ca if ca > cg else cg)
        through = [(h, ca + cg + (xb if xb > h[0].v else h[0].v), h[0].t - cg) for h in heads]
        ev, nl = scan(ctx, env, st, through, ca + cg, thr, fronts)
        ctx.evaluated += ev
        ctx.labels += nl


# The objectives' scans, one per objective family, each given a new stage (_NewStage), its labels
# with V and T through the boundary, the boundary's round trip and the threshold; they return the
# stage placements evaluated and the labels offered to fronts. Each walks, for every label, the new
# stage's first layer i from j - 1 down (the stage grows at its front; only i = 0 when no stage may
# come before it) and stops at the first i whose stage breaks the memory limit or the threshold: a
# longer stage holds more and only adds to V, T's floor, p and the round trips. At i = 0 the plan
# is complete and offered; at i > 0 the label (i, ...) goes to the front of its state when layers
# [0, i) fit on the slots left and its lower bound (module docstring) is within the threshold. The
# threshold changes only when a plan is offered, so it is re-read only then. The objective's
# ``passes`` is its test on one stage with a free boundary (what _extend checks before pricing the
# boundary).

def _passes_latency(ctx: _Ctx, M: int, lab: Label, n2: int, rt: float, ar_per: float, thr: float) -> bool:
    x = (M - 1) * rt
    return not (rt + (x if x > lab.v else lab.v) > thr or max(lab.p, rt, ar_per) > ctx.pcap)


def _scan_latency(ctx: _Ctx, env: _DPEnv, st: _NewStage, through: list, cacg: float, thr: float,
                  fronts: list) -> tuple[int, int]:
    """DAPPLE's latency L = V + T, and the PipeDream baseline's second phase (``slowest-latency``): L
    among the plans whose every element is within ``ctx.pcap`` (INF for DAPPLE's), ranked by (L,
    slowest element); DAPPLE's ranks by L alone, ties to the plan found first. Its labels also meet
    the whole-prefix bounds (:func:`_prefix_tables`)."""
    M, Mm1, j, r, q, free, k2, key, rows, row, bnds, part = env.M, env.M - 1, *st.shared()
    cap, pcap, policy, tables, offer, threshold = ctx.capacity, ctx.pcap, env.policy, env.tables, ctx.offer, \
        ctx.threshold
    ranked = ctx.objective == "slowest-latency"
    ev = nl = 0
    for (lab, n2, stages, grows, w, need_w), v1, t1 in through:
        p1 = lab.p if lab.p > cacg else cacg       # the slowest element: the boundary is one
        if free > 0:
            tY, tX, tF = tables(w, free)
        for i in range(j - 1 if st.more and grows else 0, -1, -1):
            pbs, da, bw, rt, ar, y = rows[i] or row(i)
            if pbs + n2 * da * q > cap:
                break
            x = Mm1 * rt
            v2 = rt + (x if x > v1 else v1)
            p2 = p1 if p1 > rt else rt
            x = ar / r
            if x > p2:
                p2 = x
            if v2 > thr or p2 > pcap:
                break
            t2 = y if y > t1 - bw else t1 - bw
            ev += 1
            if i == 0:
                offer((v2 + t2, p2 if ranked else 0.0), M, policy, (0, j, r, lab.path))
                thr = threshold()
            elif need_w[i] <= free:
                pw, prt, fwm = bnds[i] or part(i)
                x = t2 + fwm
                # the per-label bounds, then the whole-prefix ones (module docstring)
                if (v2 + (x if x > prt else prt) <= thr and M * pw <= thr and pw <= pcap
                        and tY[i] <= thr and v2 + tX[i] <= thr and v2 + t2 + tF[i] <= thr):
                    _push(fronts[i], key, Label(p2, v2, t2, n2, stages, (i, j, r, lab.path), k2), _FRONT_VT)
                    nl += 1
    return ev, nl


def _passes_slowest(ctx: _Ctx, M: int, lab: Label, n2: int, rt: float, ar_per: float, thr: float) -> bool:
    return not max(lab.p, rt, ar_per) > thr


def _scan_slowest(ctx: _Ctx, env: _DPEnv, st: _NewStage, through: list, cacg: float, thr: float,
                  fronts: list) -> tuple[int, int]:
    """PipeDream's objective: the slowest element p first, DAPPLE's L to break its ties
    (``pipedream``), or p alone (``slowest``, the baseline's first phase, whose fronts ignore V and
    T). The scan stops at p above the threshold; the bound is max(p, the prefix's least slowest stage)."""
    M, Mm1, j, r, q, free, k2, key, rows, row, bnds, part = env.M, env.M - 1, *st.shared()
    cap, policy, offer, threshold, mode = ctx.capacity, env.policy, ctx.offer, ctx.threshold, _MODES[ctx.objective]
    ev = nl = 0
    for (lab, n2, stages, grows, _, need_w), v1, t1 in through:
        p1 = lab.p if lab.p > cacg else cacg       # the boundary is an element
        for i in range(j - 1 if st.more and grows else 0, -1, -1):
            pbs, da, bw, rt, ar, y = rows[i] or row(i)
            if pbs + n2 * da * q > cap:
                break
            p2 = p1 if p1 > rt else rt
            x = ar / r
            if x > p2:
                p2 = x
            if p2 > thr:
                break
            x = Mm1 * rt
            v2 = rt + (x if x > v1 else v1)
            t2 = y if y > t1 - bw else t1 - bw
            ev += 1
            if i == 0:
                offer((p2, v2 + t2), M, policy, (0, j, r, lab.path))
                thr = threshold()
            elif need_w[i] <= free and (bnds[i] or part(i))[0] <= thr:    # (p2 is within it)
                _push(fronts[i], key, Label(p2, v2, t2, n2, stages, (i, j, r, lab.path), k2), mode)
                nl += 1
    return ev, nl


def _passes_round_trip(ctx: _Ctx, M: int, lab: Label, n2: int, rt: float, ar_per: float, thr: float) -> bool:
    return not rt + max((M - 1) * rt, lab.v, lab.p + (M - 1) * (lab.p + rt) / n2) > thr


def _scan_round_trip(ctx: _Ctx, env: _DPEnv, st: _NewStage, through: list, cacg: float, thr: float,
                     fronts: list) -> tuple[int, int]:
    """``dapple-rt``: DAPPLE's latency with the 1F1B round-trip bound (module docstring), p the
    suffix's round trip; a new stage that holds n2 micro-batches adds p2 (M - 1) / n2 as a pivot
    candidate. A heuristic: labels with different n are compared as the exact objectives compare them."""
    M, Mm1, j, r, q, free, k2, key, rows, row, bnds, part = env.M, env.M - 1, *st.shared()
    cap, policy, offer, threshold = ctx.capacity, env.policy, ctx.offer, ctx.threshold
    ev = nl = 0
    for (lab, n2, stages, grows, _, need_w), v1, t1 in through:
        p1 = lab.p + cacg                          # the suffix's round trip, the boundary's added
        for i in range(j - 1 if st.more and grows else 0, -1, -1):
            pbs, da, bw, rt, ar, y = rows[i] or row(i)
            if pbs + n2 * da * q > cap:
                break
            p2 = p1 + rt
            v2 = rt + max(Mm1 * rt, v1, p1 + Mm1 * p2 / n2)
            if v2 > thr:
                break
            t2 = y if y > t1 - bw else t1 - bw
            ev += 1
            if i == 0:
                offer((v2 + t2, 0.0), M, policy, (0, j, r, lab.path))
                thr = threshold()
            elif need_w[i] <= free:
                pw, prt, fwm = bnds[i] or part(i)
                x = t2 + fwm
                if v2 + (x if x > prt else prt) <= thr and M * pw <= thr:     # the per-label bounds
                    _push(fronts[i], key, Label(p2, v2, t2, n2, stages, (i, j, r, lab.path), k2), _FRONT_PVT)
                    nl += 1
    return ev, nl


# objective -> (the test on one stage with a free boundary, the scan)
_SCANS = {"dapple": (_passes_latency, _scan_latency), "slowest-latency": (_passes_latency, _scan_latency),
          "pipedream": (_passes_slowest, _scan_slowest), "slowest": (_passes_slowest, _scan_slowest),
          "dapple-rt": (_passes_round_trip, _scan_round_trip)}


def _job_cache(topo: Topology, work: Workload) -> dict:
    """What every search of this workload on this topology computes alike (the planner searches
    several objectives and spaces of one job): the seeds' estimates, the need tables and the bounds
    g of :func:`_dp`, each by all its inputs; kept on the topology, per workload object."""
    got = topo.search_memo.get(id(work))
    if got is None or got[0] is not work:
        got = topo.search_memo[id(work)] = (work, {})
    return got[1]


def _seed(ctx: _Ctx, jobs) -> dict:
    """Offer simple plans first (uniform R x D with a work-balanced partition) so that pruning bites
    from the start; they are plans of the space, so the result stays exact."""
    work, topo, P = ctx.work, ctx.topo, ctx.P
    L = work.num_layers
    limit = ctx.space.max_stages or L
    cap = None if ctx.capacity == INF else ctx.capacity
    known = _job_cache(topo, work)
    slow = ctx.objective in ("pipedream", "slowest")

    def edges_of(D):
        """The work-balanced partition into D stages (one per D: it depends on nothing else)."""
        got = known.get(("edges", D))
        if got is None:
            wts = known.get("wts")
            if wts is None:
                wts = known["wts"] = [work.fwd(l, l + 1) + work.bwd(l, l + 1) for l in range(L)]
            got = known[("edges", D)] = balanced_edges(wts, D)
        return got

    def fits(M, r, D):
        """Whether the seed's stages fit in memory as estimate() counts them (cached, policy-free):
        most seeds do not, and estimating the others is what costs."""
        fk = ("seed-fits", ctx.G, cap, M, r, D)
        got = known.get(fk)
        if got is None:
            q = ctx.G // M / r
            edges = edges_of(D)
            got = known[fk] = cap is None or not any(
                work.param_count(edges[s], edges[s + 1]) * work.bytes_per_param_static
                + min(D - s, M) * work.activation(edges[s], edges[s + 1]) * q > cap for s in range(D))
        return got

    def value(M, policy, r, D):
        """(edges, the seed's objective value) or None when it does not fit or is not of the space."""
        ek = (ctx.G, cap, M, policy, r, D)
        edges, est = known.get(ek, (None, None))
        if est is None:
            edges = edges_of(D)
            if not fits(M, r, D):      # (the estimate is kept as False when it does not fit)
                est = False
            else:
                devs = topo.place(policy, [r] * D)
                plan = Plan(ctx.model, ctx.cluster, ctx.G, M,
                            tuple(StagePlan(edges[s], edges[s + 1], devs[s]) for s in range(D)), policy)
                est = estimate(plan, work, topo, cap)
            known[ek] = (edges, est)
        if est is False or not est.fits:
            return None
        if slow:
            return edges, (est.slowest, est.latency)
        if ctx.objective == "slowest-latency":
            return None if est.slowest > ctx.pcap else (edges, (est.latency, est.slowest))
        return edges, (est.latency_rt if ctx.objective == "dapple-rt" else est.latency, 0.0)

    def shapes(M, policy):
        """(r, D, total): the seeds of a configuration in order; total = its stages' round trips."""
        b = ctx.G // M
        for r in _rep_values(ctx.space, b, P):
            sl = topo.slots(policy, r)
            wq = work.at(b // r)
            total = (wq.forward_prefix_sums[L] + wq.backward_prefix_sums[L]) * (b / r)
            for D in range(1, min(L, limit, P // sl) + 1):
                if D * sl > P:
                    break
                yield r, D, total

    def lower(M, r, D, total, bound=-INF, best=-INF):
        """A lower bound on the seed's value: its slowest stage takes >= total / D, and L >= the
        stages' round trips and >= M times a stage's; and unless that exceeds ``bound`` and is at
        least ``best`` (the seed is skipped then), the tighter one of its stages' compute alone
        (cached, policy-free): L >= max over stages s of (round trips st of stages 0..s) + (M - 1)
        st_s (the pivot formula's value at stage s, whose elements up to it include the boundaries'
        transfers too, plus an ending >= 0), the slowest element >= max st_s; less a relative 1e-9
        for sums in another order than estimate()'s. Both are <= the value: skipping by them keeps
        what the seeds keep (see below)."""
        lb = (total / D if slow else max(total, M * total / D)) * (1 - 1e-9)
        if lb > bound and lb >= best:
            return lb
        lk = ("seed-bound", ctx.G, M, r, D)
        got = known.get(lk)
        if got is None:
            b = ctx.G // M
            wq = work.at(b // r)
            q, cf, cb, e = b / r, wq.forward_prefix_sums, wq.backward_prefix_sums, edges_of(D)
            acc = piv = top = 0.0
            for s in range(D):
                st = (cf[e[s + 1]] - cf[e[s]] + cb[e[s + 1]] - cb[e[s]]) * q
                acc += st
                if st > top:
                    top = st
                x = acc + (M - 1) * st
                if x > piv:
                    piv = x
            got = known[lk] = (top * (1 - 1e-9), piv * (1 - 1e-9))
        x = got[0] if slow else got[1]
        return x if x > lb else lb

    # The seeds on the most replicas of every configuration first (usually the best ones): their
    # top_k-th best value (over distinct plans) bounds the threshold after seeding, and their best
    # per configuration the configuration's best seed. A seed whose lower bound exceeds both is
    # neither kept nor its configuration's best: it is not estimated. The others are offered in
    # their usual order, so the kept plans are the same. The first ones are taken in increasing
    # lower bound, and one whose bound exceeds the top_k-th best value found so far and its
    # configuration's best so far is skipped: both only fall, so the seed is above the final ones
    # too and changes neither (the same bound and best per configuration as estimating them all).
    pre, first, vals = {}, {}, []
    order = []
    for M, policy in jobs:
        rs = [r for r in _rep_values(ctx.space, ctx.G // M, P) if topo.slots(policy, r) <= P]
        for r, D, total in shapes(M, policy):
            if rs and r == rs[-1] and fits(M, r, D):    # (value(): None if not)
                order.append((lower(M, r, D, total), len(order), M, policy, r, D))
    order.sort()
    for lb, _, M, policy, r, D in order:
        kth = vals[ctx.top_k - 1] if len(vals) >= ctx.top_k else INF
        if lb > kth and lb >= first.get((M, policy), INF):
            continue
        got = value(M, policy, r, D)
        if got is not None:
            devs = topo.place(policy, [r] * D)
            key = (M, tuple(zip(got[0], got[0][1:], devs)))
            if key not in pre:
                bisect.insort(vals, got[1][0])
            pre[key] = got[1][0]
            first[(M, policy)] = min(first.get((M, policy), INF), got[1][0])
    bound = vals[ctx.top_k - 1] if len(vals) >= ctx.top_k else INF
    found = {}
    for M, policy in jobs:
        for r, D, total in shapes(M, policy):
            best = first.get((M, policy), INF)
            lbv = lower(M, r, D, total)         # the cheap bound alone
            if lbv > bound and lbv >= best:
                continue
            if not fits(M, r, D):
                continue        # value() is None: nothing offered, nothing found
            lbv = lower(M, r, D, total, bound, best)
            if lbv > bound and lbv >= best:
                continue
            got = value(M, policy, r, D)
            if got is None:
                continue
            edges, v = got
            found[(M, policy)] = min(found.get((M, policy), INF), v[0])
            if v[0] <= ctx.threshold():
                path = None
                for s in reversed(range(D)):
                    path = (edges[s], edges[s + 1], r, path)
                ctx.offer(v, M, policy, path)
                ctx.complete -= 1
    return found


def latency_floor(work: Workload, topo: Topology, global_batch: int, microbatches: int, *,
                  space: SearchSpace | None = None, capacity: float | None = None) -> float:
    """A lower bound on DAPPLE's latency L of every plan of ``space`` with ``microbatches`` micro-batches
    that fits in memory (INF when none can). A plan is a prefix [0, i) (stages that keep at least
    min(2, M) micro-batches in flight) and a last stage [i, L) on r replicas (one in flight), so the
    recursion of :func:`_prefix_tables` applied to the last stage bounds it: L >= C + Tp >=
    max(Y[i], X[i] + M rt, F[i] + M rt + y) at the slots the last stage leaves, least over (i, r) and
    the policies. The tables are the search's own (same keys), so the planner's later searches reuse
    them. The planner uses it to skip micro-batch counts whose plans cannot win."""
    space = space or SearchSpace()
    P = topo.num_devices if space.devices is None else min(space.devices, topo.num_devices)
    cap = capacity if capacity is not None else work.memory_capacity
    cap = INF if cap is None else float(cap)
    M, b, L = microbatches, global_batch // microbatches, work.num_layers
    step = max(1, -(-P // 128))
    w = min(2, M, WCAP)
    known = _job_cache(topo, work)
    cp, ca = work.param_prefix_sums, work.activation_prefix_sums
    bps, gbp, otp = work.bytes_per_param_static, work.grad_bytes_per_param, work.optim_time_per_param
    out = INF
    for policy in space.policies:
        slots = {r: topo.slots(policy, r) for r in _rep_values(space, b, P)}
        reps = [r for r, sl in slots.items() if sl <= P]
        if not reps:
            continue
        tk = ("prefix", policy, b, M, w, tuple((r, slots[r]) for r in reps), cap, P)
        tab = known.get(tk)
        if tab is None:
            tab = known[tk] = _prefix_tables(work, topo, policy, b, M, w, reps, slots, cap, P, step)
        Y, X, F = tab
        for r in reps:
            f = (P - slots[r]) // step
            q = b / r
            wq = work.at(b // r)
            cf, cb = wq.forward_prefix_sums, wq.backward_prefix_sums
            alpha, beta = topo.allreduce_floor(policy, r)
            for i in range(L - 1, -1, -1):      # the last stage [i, L); it only grows as i falls
                par = cp[L] - cp[i]
                if par * bps + (ca[L] - ca[i]) * q > cap:
                    break
                rt = (cf[L] - cf[i]) * q + (cb[L] - cb[i]) * q
                y = (alpha + beta * par * gbp if r > 1 and par > 0 else 0.0) + par * otp
                v = max(float(Y[i][f]), float(X[i][f]) + M * rt, float(F[i][f]) + M * rt + y)
                if v < out:
                    out = v
    return out * (1 - 1e-9) if 0 < out < INF else out


def _prefix_tables(work: Workload, topo: Topology, policy: str, b: int, M: int, w: int, reps: list, slots: dict,
                   cap: float, P: int, step: int):
    """Lower bounds on what a whole prefix (stages [0, i), from the first) adds to DAPPLE's latency,
    by i and the slots it may take: arrays ``Y, X, F`` of shape (L + 1, P // step + 1).

    For a prefix (its stages and the boundaries between them) write R = its round trips, FW = its
    forwards, C = max over its elements e of (round trips up to e) + (M - 1) st_e and Tp = max over
    its stages s of (AR_s + OPT_s - its backwards before s). A plan = prefix + boundary + a suffix
    with DAPPLE's (V, T) (module docstring) has V_full >= max(C, R + V) and T_full = max(Tp, T - BW')
    with BW' the prefix's backwards and the boundary's, so

        L >= C + Tp,     L >= V + R + Tp,     L >= (R' + V) + (T - BW') >= V + T + FW.

    Appending a stage sigma = [a, c) on r replicas (round trip rt, forward fw, all-reduce and
    optimizer y = AR + OPT, after a boundary beta of fw_b + bw_b) to a prefix gives R' >= R + rt,
    FW' >= FW + fw, C' >= max(C, R + M rt) (sigma's own term: R + rt_b + rt + (M - 1) rt), and
    Tp' = max(Tp, y - BW - bw_b) with R' - BW - bw_b >= FW + rt, so

        R' + Tp' >= max(R + Tp + rt, FW + rt + y)
        C' + Tp' >= max(C + Tp, R + Tp + M rt, FW + M rt + y)

    monotone in (C + Tp, R + Tp, FW): the least of each over the prefixes [0, a) bound the new
    ones (``Y`` = least C + Tp, ``X`` = least R + Tp, ``F`` = least FW; the empty prefix has
    FW = 0 and C + Tp = R + Tp = -inf, which gives the first stage its exact C + Tp = M rt + y and
    R + Tp = rt + y). Only lower bounds go in, so each entry is <= its least over real prefixes:
    boundaries count 0; a stage's all-reduce is :meth:`Topology.allreduce_floor` (no larger at any
    offset); it must fit in memory with ``w`` micro-batches in flight, at most what any prefix stage
    keeps ahead of a suffix of n stages (min(n + 1, M) or more: the caller passes a power of two
    <= that); stages are not capped in number. Entry [i][f] is the least over prefixes on at most
    f steps of slots, a stage of s slots taking floor(s / step) of them: the floors of the stages of
    a prefix on ``free`` slots sum to at most floor(free / step), so looking up f = floor(free /
    step) bounds every prefix on ``free`` slots (exact when ``step`` divides every stage's slots).
    Positive entries are lowered by a relative 1e-9 (the search sums the same terms in another
    order, which rounds differently)."""
    import numpy as np
    L = work.num_layers
    nf = P // step + 1
    Y = np.full((L + 1, nf), INF)
    X = np.full((L + 1, nf), INF)
    F = np.full((L + 1, nf), INF)
    Y[0] = X[0] = -INF
    F[0] = 0.0
    cp, ca = np.array(work.param_prefix_sums), np.array(work.activation_prefix_sums)
    bps, gbp, otp = work.bytes_per_param_static, work.grad_bytes_per_param, work.optim_time_per_param
    per_r = []
    for r in reps:
        wq = work.at(b // r)
        alpha, beta = topo.allreduce_floor(policy, r)
        per_r.append((r, slots[r] // step, b / r, np.array(wq.forward_prefix_sums), np.array(wq.backward_prefix_sums),
                      alpha, beta))
    for c in range(1, L + 1):
        for r, sg, q, cf, cb, alpha, beta in per_r:
            if sg >= nf:
                continue
            # the stages [a, c) that fit: memory only grows as a stage grows, so a = a0 .. c - 1
            par = cp[c] - cp[:c]
            fit = par * bps + w * (ca[c] - ca[:c]) * q <= cap
            if not fit[c - 1]:
                continue
            a0 = c - 1
            while a0 > 0 and fit[a0 - 1]:
                a0 -= 1
            par = par[a0:]
            fw = (cf[c] - cf[a0:c]) * q
            rt = fw + (cb[c] - cb[a0:c]) * q
            y = np.where(par > 0, alpha + beta * par * gbp, 0.0) if r > 1 else np.zeros(c - a0)
            y = y + par * otp
            n = nf - sg
            Fa, Xa, Ya = F[a0:c, :n], X[a0:c, :n], Y[a0:c, :n]
            rt_, fw_, y_ = rt[:, None], fw[:, None], y[:, None]
            np.minimum(F[c, sg:], (Fa + fw_).min(axis=0), out=F[c, sg:])
            np.minimum(X[c, sg:], np.maximum(Xa + rt_, Fa + (rt_ + y_)).min(axis=0), out=X[c, sg:])
            np.minimum(Y[c, sg:], np.maximum(np.maximum(Ya, Xa + M * rt_), Fa + (M * rt_ + y_)).min(axis=0),
                       out=Y[c, sg:])
        for t in (Y, X, F):     # on at most f steps of slots
            np.minimum.accumulate(t[c], out=t[c])
    for t in (Y, X, F):     # less a relative 1e-9: sums in another order than the search's round differently
        t[t > 0] *= 1 - 1e-9
    return Y, X, F


def _need_table(work: Workload, b: int, w: int, reps: list[tuple[int, int]], cap: float) -> list[float]:
    """need[i] = fewest slots on which layers [0, i) fit as stages that each keep ``w`` micro-batches
    of b / r samples per replica (INF: never). Stages before a suffix of n stages keep at least
    min(n + 1, M) micro-batches, so this bounds what a prefix needs."""
    L = work.num_layers
    bps = work.bytes_per_param_static
    need = [0.0] + [INF] * L
    for i in range(1, L + 1):
        best = INF
        for r, sl in reps:
            q = b / r
            for i0 in range(i - 1, -1, -1):
                if work.param_count(i0, i) * bps + w * work.activation(i0, i) * q > cap:
                    break
                v = need[i0] + sl
                if v < best:
                    best = v
        need[i] = best
    return need


def _sqrt_work_bound(work: Workload, cap: float) -> list[float]:
    """g[i] = min over splits of layers [0, i) into stages whose weights, gradients and optimizer state
    fit in ``cap`` of sum_s sqrt(W_s) (W_s: per-sample forward + backward seconds of stage s).

    Stages on r_1.. devices (sum r_s <= f) have round trips sum_s W_s b / r_s >= (sum_s sqrt(W_s))^2 b / f
    (Cauchy-Schwarz), so g[i]^2 b / f bounds the round trips a prefix on f devices adds to every
    pivot behind it: memory forces big models into several stages, and splitting costs round trip."""
    L = work.num_layers
    bps = work.bytes_per_param_static
    g = [0.0] + [INF] * L
    for i in range(1, L + 1):
        best = INF
        for i0 in range(i - 1, -1, -1):
            if work.param_count(i0, i) * bps > cap:
                break
            v = g[i0] + (work.fwd(i0, i) + work.bwd(i0, i)) ** 0.5
            if v < best:
                best = v
        g[i] = best
    return g


# which fields of a label a front compares (see _push), by objective
_FRONT_VT, _FRONT_PVT, _FRONT_P = 0, 1, 2
_MODES = {"dapple": _FRONT_VT, "slowest-latency": _FRONT_VT, "pipedream": _FRONT_PVT, "dapple-rt": _FRONT_PVT,
          "slowest": _FRONT_P}


def _push(front: dict, key, lab: Label, mode: int) -> None:
    """Insert a label into a state's Pareto front, unless a label there is no worse in every field
    compared (smaller is better), and drop those it is no worse than. Every mode compares n, the
    stages and the slots the suffix takes (fronts hold suffixes of several sizes); ``_FRONT_VT``
    (DAPPLE's latency) V and T, ``_FRONT_PVT`` (PipeDream's objective, the round-trip one) p, V and T,
    ``_FRONT_P`` (the slowest element alone) p."""
    fr = front.get(key)
    if fr is None:
        front[key] = [lab]
        return
    p, v, t, n, c, k = lab.p, lab.v, lab.t, lab.n, lab.stages, lab.k
    if mode == _FRONT_PVT:
        for o in fr:
            if o.p <= p and o.v <= v and o.t <= t and o.n <= n and o.stages <= c and o.k <= k:
                return
        fr[:] = [o for o in fr if not (p <= o.p and v <= o.v and t <= o.t and n <= o.n and c <= o.stages
                                       and k <= o.k)]
    elif mode == _FRONT_P:
        for o in fr:
            if o.p <= p and o.n <= n and o.stages <= c and o.k <= k:
                return
        fr[:] = [o for o in fr if not (p <= o.p and n <= o.n and c <= o.stages and k <= o.k)]
    else:
        for o in fr:
            if o.v <= v and o.t <= t and o.n <= n and o.stages <= c and o.k <= k:
                return
        fr[:] = [o for o in fr if not (v <= o.v and t <= o.t and n <= o.n and c <= o.stages and k <= o.k)]
    fr.append(lab)


def _policies(topo: Topology, policies) -> list[str]:
    """Drop policies that place every plan exactly like an earlier one on this cluster."""
    out = []
    c = topo.cluster
    for p in policies:
        same = any(topo.order(p) == topo.order(o) and (c.devices_per_node == 1 or "fresh-first" not in (p, o))
                   for o in out)
        if not same:
            out.append(p)
    return out


def search_plans(work: Workload, topo: Topology, global_batch: int, *, objective: str = "dapple",
           space: SearchSpace | None = None, capacity: float | None = None, top_k: int = 1,
           model: str | None = None, cluster: str | None = None, progress: bool = False,
           budget: int | None = None) -> SearchResult:
    """The best ``top_k`` plans of the space by ``objective`` (``dapple``: the latency L; ``pipedream``:
    the slowest element; ``dapple-rt``: L with the 1F1B round-trip bound, heuristically). Raises
    :class:`PlanError` when no plan fits. With top_k > 1 the best plan is exact; the others are the
    best complete plans the search met (a plan dominated at a shared partial state is not kept).
    ``budget``: stop after about this many stage placements and return the best plans found so far
    (``exhausted`` is then False; the result is no longer exact)."""
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {objective!r}; choose one of {', '.join(OBJECTIVES)}")
    if not isinstance(global_batch, int) or global_batch < 1:
        raise ValueError(f"global batch must be a positive integer; got {global_batch!r}")
    space = space or SearchSpace()
    P = topo.num_devices if space.devices is None else min(space.devices, topo.num_devices)
    cap = capacity if capacity is not None else work.memory_capacity
    ctx = _Ctx(work, topo, global_batch, objective, space, INF if cap is None else float(cap), max(1, top_k),
               model or work.name, cluster or topo.cluster.name, P, budget=budget)
    Ms = [m for m in divisors(global_batch) if space.microbatches is None or m in space.microbatches]
    if not Ms:
        raise PlanError(f"no micro-batch count in {short_list(space.microbatches or [])} divides the global batch "
                        f"{global_batch}")
    pols = _policies(topo, space.policies)
    t0 = time.perf_counter()
    jobs = [(M, p) for M in Ms for p in pols]
    from tqdm import tqdm
    bar = tqdm(total=len(jobs), desc=f"planning {ctx.model} ({objective})", unit="config", file=sys.stderr,
               disable=not progress, leave=False)
    if objective == "pipedream" and ctx.top_k == 1 and budget is None:
        # (slowest element, L) in two exact searches: the least slowest element p*, then the least L
        # among the plans whose every element is within p* (see the module docstring)
        ctx = replace(ctx, objective="slowest")
        exhausted = _passes(ctx, list(jobs), bar, progress)
        if ctx.heap:
            first = ctx.heap[0]
            ctx = replace(ctx, objective="slowest-latency", pcap=-first[0], heap=[], keys=set())
            ctx.heap.append((first[1], first[0], next(ctx.seq), first[3], first[4]))
            ctx.keys.add(first[3])
            exhausted = _passes(ctx, list(jobs), bar, progress) and exhausted
            ctx.heap = [(h[1], h[0], *h[2:]) for h in ctx.heap]     # back to (slowest, L)
        ctx.objective = objective
    else:
        exhausted = _passes(ctx, jobs, bar, progress)
    bar.close()
    if not ctx.heap:
        raise PlanError(no_plan_message(work, topo, global_batch, cap, space, P))
    ranked = sorted(ctx.heap, key=lambda h: (-h[0], -h[1], h[2]))
    cands = [Candidate(h[4], -h[0], estimate(h[4], work, topo, cap)) for h in ranked]
    return SearchResult(objective, cands, ctx.evaluated, ctx.complete, ctx.labels, time.perf_counter() - t0,
                        len(jobs), exhausted)


def _passes(ctx: _Ctx, jobs: list, bar, progress: bool) -> bool:
    """Seed, then search every configuration of ``jobs``; False when the budget stopped it."""
    seeds = _seed(ctx, jobs)
    jobs.sort(key=lambda mp: seeds.get(mp, INF))     # promising configurations first: pruning bites sooner
    # Passes under a trial threshold (the ceiling) below the best seed: pruning against it is far
    # stronger than against the seeds, and once top_k plans within it are found nothing it pruned can
    # be among the best (ctx.settled); otherwise the next pass raises it, the last has none. The
    # plans found stay in the heap. A budgeted search makes one plain pass.
    best_seed = min(seeds.values(), default=INF)
    if ctx.heap:
        best_seed = min(best_seed, -ctx.heap[0][0])
    ceilings = [INF] if ctx.budget is not None or best_seed == INF else [best_seed * a for a in CEILINGS] + [INF]
    exhausted = True
    for ceiling in ceilings:
        ctx.ceiling = ceiling
        bar.reset()
        ran: dict = {}          # (M, the placements of its live replica counts) -> a policy searched
        for M, p in jobs:
            twin = _twin_key(ctx, M, p)
            if twin is not None and ran.setdefault(twin, p) != p:
                bar.update()
                continue        # the same search as an earlier configuration's (see _twin_key)
            try:
                _dp(ctx, M, p)
            except _OutOfBudget:
                exhausted = False
                break
            bar.update()
            if progress and ctx.heap:
                bar.set_postfix_str(f"best {min(-h[0] for h in ctx.heap):.4g} s")
        if not exhausted or ctx.settled():
            break
    ctx.ceiling = INF
    return exhausted


def no_plan_message(work: Workload, topo: Topology, G: int, cap, space: SearchSpace, P: int) -> str:
    gib = 2 ** 30
    static = work.total_params * work.bytes_per_param_static
    what = f"no plan of {work.name} with global batch {G} fits on {P} device(s) of {topo.cluster.name}"
    if cap is None:
        return what + " under the search restrictions; relax them (stages, replicas, micro-batch counts)"
    lim = f"{cap / gib:.1f} GiB per device"
    worst = max(range(work.num_layers),
                key=lambda l: work.params[l] * work.bytes_per_param_static + work.act[l])
    one = work.params[worst] * work.bytes_per_param_static + work.act[worst]
    if one > cap:
        return (f"{what}: layer {work.layer_names[worst]!r} alone needs {one / gib:.2f} GiB (weights, gradients, "
                f"optimizer state and one sample's activations) > {lim}; use a device with more memory "
                f"or a larger --memory-limit")
    need = static + work.activation(0, work.num_layers)
    return (f"{what}: the model needs {static / gib:.1f} GiB of weights, gradients and optimizer state "
            f"({work.total_params / 1e9:.2f} B parameters x {work.bytes_per_param_static:g} B) plus "
            f"{work.activation(0, work.num_layers) / gib:.2f} GiB of activations per sample, "
            f"{need / gib:.1f} GiB in all, and no split over {P} devices keeps every device within {lim}; "
            f"use more devices, a larger --memory-limit, recomputation (--recompute full) or a smaller global batch"
            + ("" if space == SearchSpace() else ", or relax the search restrictions"))


# ---------------------------------------------------------------------- reference
def compositions(n: int, parts: int):
    """Every way to write n as an ordered sum of ``parts`` positive integers."""
    for cuts in itertools.combinations(range(1, n), parts - 1):
        edges = (0, *cuts, n)
        yield tuple(edges[i + 1] - edges[i] for i in range(parts))


def all_plans(work: Workload, topo: Topology, global_batch: int, space: SearchSpace | None = None,
              model: str = "m", cluster: str = "c"):
    """Every plan of the space (memory not checked): for tests and tiny cases only."""
    space = space or SearchSpace()
    P = topo.num_devices if space.devices is None else min(space.devices, topo.num_devices)
    L = work.num_layers
    for M in divisors(global_batch):
        if space.microbatches is not None and M not in space.microbatches:
            continue
        reps = _rep_values(space, global_batch // M, P)
        for policy in space.policies:
            for S in range(1, min(L, P, space.max_stages or L) + 1):
                for sizes in compositions(L, S):
                    for rv in itertools.product(reps, repeat=S):
                        if space.uniform and len(set(rv)) > 1:
                            continue
                        if sum(topo.slots(policy, r) for r in rv) > P:
                            continue
                        devs = topo.place(policy, rv)
                        edges = list(itertools.accumulate((0, *sizes)))
                        yield Plan(model, cluster, global_batch, M,
                                   tuple(StagePlan(edges[s], edges[s + 1], devs[s]) for s in range(S)), policy)


def exhaustive(work: Workload, topo: Topology, global_batch: int, *, objective: str = "dapple",
               space: SearchSpace | None = None, capacity: float | None = None) -> tuple[float, Plan | None, int]:
    """(best objective value, a best plan, plans evaluated) by brute force over :func:`all_plans`."""
    cap = capacity if capacity is not None else work.memory_capacity
    best, arg, n = INF, None, 0
    for plan in all_plans(work, topo, global_batch, space):
        n += 1
        est = estimate(plan, work, topo, cap)
        if not est.fits:
            continue
        v = {"dapple": est.latency, "dapple-rt": est.latency_rt, "pipedream": est.slowest}[objective]
        if v < best:
            best, arg = v, plan
    return best, arg, n
