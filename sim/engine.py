"""The SimPy engine: interprets a lowered schedule with a cost model and returns its metrics (and,
when asked, its trace).

One SimPy process per rank walks its program:

- Every op runs in three parts: it waits (a RECV for its message, an OPTIM for the rank's
  all-reduces), takes its CPU work, then acts (a SEND posts its message, an ALLREDUCE joins its
  group's). The CPU work is the compute of F / B / W (from the cost model, times the rank's
  slowdown and optional per-op jitter), a SEND's ``send_time`` and a RECV's ``recv_time`` (0 unless
  calibrated on a host), an ALLREDUCE's flattening of the local gradient copies, OPTIM's
  ``optim_time`` and writing the sums back. Without ``hosts`` (GPUs) it takes its duration and the
  rank's clock just advances; with ``hosts``, ranks on one host share its cores as the host model
  says (:mod:`sim.cores`: processor sharing, or time slices).
- A SEND returns once posted (isend); the transfer occupies every link on the network path for
  latency + bytes / bandwidth, sharing each link's bandwidth max-min fairly with concurrent
  transfers (:mod:`sim.flows`). A RECV blocks until its message has arrived. COPY is local
  (``copy_time``).
- ALLREDUCE starts once every member of the stage's group has reached it; it runs the phases of
  a ring all-reduce (hierarchical when the group spans nodes, :func:`cost_models.comm.allreduce_phases`)
  as flows over the same links as P2P traffic, while the ranks go on (on a network with a measured
  all-reduce fit, its ring time, spent as the host model says); steps of one flow whose links carry
  nothing else and that end before SimPy's next event run as one timeout, at the times one event
  per step gives. OPTIM waits for the rank's all-reduces, then does its CPU work.
- Memory: static memory per rank from the cost model; activation memory grows by ``act`` at each
  F and shrinks when the backward that frees it ends (split schedules keep ``act_w`` until W); an
  overlapped pair (``meta["overlapped"]``) whose costs give the stages' segments
  (``StageCosts.act_segments``) is booked as the executor interleaves it, segment by segment: the
  F row holds the pair's peak (:func:`cost_models.memory.pair_memory`, closed form in
  :mod:`cost_models.segments`), with or without phases.
- Overlapped pairs: where the costs split F and B into compute and all-to-all phases
  (``StageCosts.phases_f`` / ``phases_b``) and the schedule lists F&B pairs (``meta["overlapped"]``:
  DualPipe-V, :func:`schedules.overlap.pair_forward_backward`, interleaved ``a2a-overlap``), a rank
  runs each pair as one block of :func:`sim.overlap.overlapped_pair` time: the pair's RECVs first,
  the F row spanning the block, the B row zero-length at its end, the F's SEND / COPY after
  (``_Engine._overlap``). ``SimResult.a2a_time`` / ``a2a_hidden``: per rank, the all-to-all seconds
  and the part of them hidden under compute.

A rank keeps its own clock and runs ahead of SimPy's while it touches nothing shared (compute on
its own device, a message already delivered, no network); it synchronises (a timeout to its
clock) before it starts a flow or takes a host's cores, and it blocks only on a message not yet
delivered. The times are those of one event per op; the events are far fewer.

Metrics (iteration time per step, per-rank busy time and peak activation) are kept on the fly;
the per-op trace is recorded only when asked (``trace=True``).

Replica symmetry: when the R data-parallel replicas are identical (same costs, no per-rank
slowdown that differs between replicas, no jitter, no shared host cores) and the network treats
them alike, only replica 0 is simulated. The others' traffic is there as multiplicity: each
transfer of replica 0 is one flow standing for the same transfer of every replica, and each
all-reduce phase is a few flows standing for its transfers. The classes come from refining the
transfers until every member of a class crosses links that carry the same load from the same
classes (an equitable partition, :func:`sim.symmetry.replica_classes`); then max-min fair sharing
gives every member the rate of its representative, so replica 0's run is every replica's. When a
replica's transfers fall into classes of their own, the placement is not symmetric: one replica of
each kind of alike ones is simulated (:mod:`sim.symmetry`), every replica when none are alike;
``SimOptions(exact=True)`` forces the full simulation.

The engine knows no schedule by name: everything it does is driven by op kinds and placement.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from functools import partial
from typing import Mapping, NamedTuple, Sequence

import pandas as pd
import simpy

from cost_models.base import PEAK_FLOOR, StageCosts
from cost_models.comm import allreduce_phases, ring_allreduce_time
from cost_models.memory import pair_memory
from cost_models.network import Network
from schedules.common import gc_paused
from schedules.ir import (ACT, ALLREDUCE, COPY, OPTIM, RECV, SEND, B, F, Schedule, ScheduleError, W, activation_change,
                          source_stage)
from schedules.lower import lower
from schedules.overlap import paired_backward
from schedules.trace import COLUMNS, DeviceMetrics, Metrics, TraceRow, make_trace

from .cores import host_model
from .flows import FairShare
from .overlap import overlapped_pair
from .symmetry import Symmetry, replica_classes, symmetry_blocker


@dataclass
class SimOptions:
    """Knobs beyond the schedule and the costs.

    slowdown: per-rank factor on compute time (a straggler GPU: {3: 1.5}).
    link_slowdown: per-link-name factor dividing bandwidth (a slow link: {"n1.nic0.out": 2};
      link names come from the network, e.g. ``Cluster.links()``).
    jitter: relative standard deviation of per-op compute noise: each compute op's time times a
      log-normal factor of mean 1 (seeded per rank, deterministic).
    hosts: rank -> host id, with ``cores`` per host: ranks on one host share its cores (how: the
      host model of :mod:`sim.cores`, processor sharing unless ``time_slice``).
    comm_uses_cores: with ``hosts``, transfers also occupy a core of each end's host while they
      run (CPU transports such as gloo, whose threads copy and reduce the bytes).
    time_slice: with ``hosts``, the seconds an OS gives a rank on a core before the next waiting
      rank takes it (:class:`sim.slicing.SlicedCores`: ranks take turns on whole cores, an op runs
      at full speed once it has one) instead of ideal processor sharing (every computing rank at
      its share of the cores at once); transfers then take no core time of their own (their CPU
      work is the SEND/RECV costs, queued like compute). None: processor sharing.
    steps: iterations simulated back to back (no barrier between them, as in the executor: a
      rank that finishes early starts the next step); the trace's ``step`` column tells them apart.
    exact: simulate every data-parallel replica op by op even when they are identical.
    """

    slowdown: Mapping[int, float] = field(default_factory=dict)
    link_slowdown: Mapping[str, float] = field(default_factory=dict)
    jitter: float = 0.0
    seed: int = 0
    hosts: Sequence[int] | None = None
    cores: float | Mapping[int, float] = 1.0
    steps: int = 1
    comm_uses_cores: bool = False
    exact: bool = False
    time_slice: float | None = None

    def __post_init__(self):
        # a NaN or infinite factor would stall the event loop (a time that never comes) or print nonsense
        for what, table in (("slowdown", self.slowdown), ("link_slowdown", self.link_slowdown)):
            for k, v in table.items():
                if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                    raise ValueError(f"SimOptions.{what}[{k!r}] must be a finite number > 0; got {v!r}")
        if not (math.isfinite(self.jitter) and self.jitter >= 0):
            raise ValueError(f"SimOptions.jitter must be a finite number >= 0; got {self.jitter!r}")
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"SimOptions.steps must be an integer >= 1; got {self.steps!r}")
        if self.time_slice is not None and not (math.isfinite(self.time_slice) and self.time_slice > 0):
            raise ValueError("SimOptions.time_slice must be a finite number of seconds > 0 or None; "
                             f"got {self.time_slice!r}")


class SimulationError(RuntimeError):
    pass


@dataclass
class SimResult:
    """What one simulation measured: per-step iteration times and, for the last step, every rank's
    busy (compute) time and peak activation memory; the trace when it was recorded.

    ``simulated_replicas``: 1 when replica symmetry let one replica stand for all, k when one of
    each of k kinds of alike replicas stood for the others, else R; ``full_reason`` says why more
    than one was simulated (None when it was not needed); ``rep_of[i]``: the simulated replica
    whose run is replica i's."""

    attrs: dict
    iteration_times: list[float]
    busy: list[float]                 # per rank, last step
    peak_activation: list[float]      # per rank, last step
    simulated_replicas: int
    full_reason: str | None = None
    _rows: list | None = field(default=None, repr=False)
    _trace: pd.DataFrame | None = field(default=None, repr=False)
    rep_of: list | None = field(default=None, repr=False)   # replica -> the simulated one standing for it
    # per rank, last step, in the costs' time unit: the all-to-all seconds of its F / B ops that have
    # phases (StageCosts.phases_f / phases_b), and of those the seconds that ran under compute in an
    # overlapped F&B pair (sim.overlap.PairTime.hidden); all zero without phases
    a2a_time: list = field(default_factory=list)
    a2a_hidden: list = field(default_factory=list)

    @property
    def iteration_time(self) -> float:
        return self.iteration_times[-1]

    def metrics(self) -> Metrics:
        """The last step's metrics, as :func:`schedules.trace.step_metrics` computes them from the trace."""
        it = self.iteration_time
        static = self.attrs["static_mem"]
        per = []
        for d, (b, pa) in enumerate(zip(self.busy, self.peak_activation)):
            st = float(static[d])
            per.append(DeviceMetrics(d, b, 1.0 - b / it if it > 0 else 0.0, pa, st + pa, st))
        return Metrics(it, sum(p.bubble_ratio for p in per) / len(per), per, list(self.iteration_times))

    def trace(self) -> pd.DataFrame:
        """The per-op trace (``simulate(..., trace=True)`` only). Under replica symmetry the other
        replicas' rows are replica 0's with the ranks shifted."""
        if self._trace is None:
            if self._rows is None:
                raise ValueError("this simulation kept no trace; run it with trace=True")
            self._trace = _expand(self._rows, self.attrs, self.rep_of)
            self._rows = None
        return self._trace


def _expand(rows: list, attrs: dict, rep_of: list | None) -> pd.DataFrame:
    """The trace of every replica from the simulated ones' rows: replica i's are those of
    ``rep_of[i]`` with the ranks shifted."""
    D = attrs["devices"]
    base = make_trace(rows, **attrs)
    if rep_of is None or all(k == i for i, k in enumerate(rep_of)):
        return base
    parts = [base]
    by_rep = {}
    for i, k in enumerate(rep_of):
        if k == i:
            continue
        got = by_rep.get(k)
        if got is None:
            mine = base[base["device"].to_numpy() // D == k].reset_index(drop=True)
            tok = mine["token"].to_numpy()
            peer = mine["peer"].to_numpy()
            comm = peer >= 0
            cut = [t.rfind(">") if ">" in t else t.rfind("<") for t in tok[comm]]
            got = by_rep[k] = (mine, tok, peer, comm, [t[:c + 1] for t, c in zip(tok[comm], cut)])
        mine, tok, peer, comm, heads = got
        shift = (i - k) * D
        part = mine.copy()
        part["device"] = mine["device"].to_numpy() + shift
        part.loc[comm, "peer"] = peer[comm] + shift
        if comm.any():
            t = tok.copy()
            t[comm] = [h + str(p + shift) for h, p in zip(heads, peer[comm])]
            part["token"] = t
        parts.append(part)
    out = pd.concat(parts, ignore_index=True)
    out.attrs.update(attrs)
    return out[COLUMNS]


# what an op waits for before its CPU work (_Planned.waits) and what it does after (_Planned.then)
_NOTHING, _MESSAGE, _ALLREDUCES = 0, 1, 2
_COMPUTED, _POST, _JOIN, _HAND_OFF = 1, 2, 3, 4


class _Planned(NamedTuple):
    """What an op of a rank's program does, resolved before the run. An op runs in three parts: it
    waits (``waits``), takes its CPU work (``cpu``), then acts (``then``). Every field means one
    thing for every kind (zero / None where it does not apply). The ops of a rank that do the same
    (same kind, copy, stage, payload and peer; an OPTIM aside) share one record; what differs per op
    (the message, the trace row) is kept beside the plan. ``_Engine._rank`` unpacks the record by
    position, once per op of its loop: the fields' order is the loop's."""

    waits: int           # _MESSAGE (RECV: until its message has arrived), _ALLREDUCES (OPTIM: the
                         # rank's all-reduces of the step), _NOTHING
    cpu: float | None    # seconds of CPU work: the compute (F/B/W; always, even 0), posting (SEND) or
                         # taking (RECV) the message, flattening the local gradient copies (ALLREDUCE),
                         # the optimizer step and writing the sums back to every copy (OPTIM); None: none
    then: int            # _COMPUTED (F/B/W: busy time, activation memory), _POST (SEND: the message
                         # leaves), _JOIN (ALLREDUCE: its group's all-reduce), _HAND_OFF (COPY), _NOTHING
    nbytes: float        # bytes moved (SEND/RECV/ALLREDUCE)
    act_alloc: float     # activation bytes allocated by the op (F)
    act_free: float      # activation bytes freed when it ends (B/W)
    stage: int
    peer: int


# records from one tuple, without a Python-level call (the engine makes one per op)
_new_row = partial(tuple.__new__, TraceRow)


def simulate(sched: Schedule, costs: StageCosts, network: Network | None = None,
             options: SimOptions | None = None, *, eager: bool = True, free_comm: bool = False) -> pd.DataFrame:
    """Simulate one training iteration of ``sched`` (lowered here if it is not) and return its trace.

    ``network`` carries the messages and all-reduces (a placed :class:`cost_models.Cluster`, a
    profile's cluster, a :class:`cost_models.PortNetwork`). Without one, communication is free:
    fine for costs that move no bytes (:class:`cost_models.UnitCostModel`); costs that do need
    ``free_comm=True`` to say so, else this raises ValueError instead of dropping them silently."""
    return run(sched, costs, network, options, eager=eager, trace=True, free_comm=free_comm).trace()


def run(sched: Schedule, costs: StageCosts, network: Network | None = None,
        options: SimOptions | None = None, *, eager: bool = True, trace: bool = False,
        free_comm: bool = False, max_ops: int | None = None) -> SimResult:
    """Simulate ``sched`` and return its :class:`SimResult` (metrics on the fly; the per-op trace
    only with ``trace=True``; ``network`` and ``free_comm`` as for :func:`simulate`). ``max_ops``:
    refuse (ValueError, before running) to simulate more ops than that, e.g. every replica of a big
    job whose replicas differ."""
    opts = options or SimOptions()
    if network is None and not free_comm and _moves_bytes(costs):
        raise ValueError("these costs send messages and all-reduce gradients but no network was given; pass "
                         "network= (e.g. cluster.place(schedule)) or free_comm=True to make communication free")
    low = sched if sched.lowered else lower(sched, eager=eager)
    check_peak(low, costs, opts)
    eng = _Engine(low, costs, network, opts, trace)
    if max_ops is not None:
        ops = sum(len(low.programs[r % low.num_devices]) for r in eng.active)
        if ops > max_ops:
            why = "the run"
            if eng.full_reason:
                how = "one by one" if len(eng.active) == low.num_ranks else "one of each kind"
                why = f"the replicas are simulated {how} ({eng.full_reason})"
            raise ValueError(f"{why}: {ops:,} ops per iteration, beyond the limit of {max_ops:,}; use fewer "
                             f"replicas or micro-batches")
    return eng.run()


def check_peak(sched: Schedule, costs: StageCosts, opts: SimOptions) -> None:
    """The invariant of costs that know their FLOPs (``costs.meta["peak_floor"]``, see
    :func:`cost_models.base.with_peak_floor`): no compute op, times its rank's slowdown, runs faster
    than its FLOPs at the device's peak. O(copies x stages + slowed ranks); a ValueError names the
    op. (Per-op jitter is noise of mean 1 around these times.)"""
    for kind_costs in costs.kinds:        # a mixed cluster: each device kind's own tables and peak
        check_peak(sched, kind_costs, opts)
    floor = costs.meta.get(PEAK_FLOOR)
    if not floor:
        return
    ratio = {}      # (kind, copy, stage) -> modelled time / time at peak
    for kind, table in (("F", costs.f), ("B", costs.b), ("W", costs.w)):
        for c, row in enumerate(table):
            for s, t in enumerate(row):
                lo = floor[kind][c][s]
                if lo > 0:
                    ratio[kind, c, s] = t / lo
    slowed = {r: k for r, k in opts.slowdown.items() if k < 1 and 0 <= r < sched.num_ranks}
    checks = [(1.0, None, ratio)]
    for r, k in slowed.items():
        held = set(sched.stages_on(sched.rank_device(r)))
        checks.append((k, r, {key: v for key, v in ratio.items() if key[1:] in held}))
    for k, r, table in checks:
        if not table:
            continue
        key = min(table, key=table.get)
        if table[key] * k < 1 - 1e-9:
            kind, c, s = key
            who = "" if r is None else f"rank {r} (slowdown {k:g}): "
            took = table[key] * k * floor[kind][c][s]
            raise ValueError(f"{who}{kind} of copy {c} stage {s} would take {took:.4g} s, faster than its FLOPs at "
                             f"the device's peak ({floor[kind][c][s]:.4g} s at {floor['peak']:.4g} FLOP/s); no cost "
                             f"or slowdown may beat the peak")


def _moves_bytes(costs: StageCosts) -> bool:
    return any(x > 0 for table in (costs.act_bytes, costs.grad_bytes, costs.param_bytes) for row in table
               for x in row)


class _Engine:
    def __init__(self, sched: Schedule, costs: StageCosts, network: Network | None, opts: SimOptions,
                 record: bool):
        self.sched = sched
        self.costs = costs
        self.net = network
        self.opts = opts
        self.record = record
        self.env = simpy.Environment()
        self.flows = FairShare(self.env)
        self.host = host_model(self.env, self.flows, opts.hosts, opts.cores, opts.time_slice, opts.comm_uses_cores)
        R = sched.num_ranks
        if len(costs.static_mem) != R:
            raise ScheduleError(f"costs were bound for {len(costs.static_mem)} ranks, schedule has {R}; "
                                f"bind the cost model to the lowered schedule")
        self.sym: Symmetry | None = None
        self.full_reason: str | None = None
        if sched.replicas > 1:
            self.full_reason = symmetry_blocker(sched, costs, opts)
            if self.full_reason is None:
                self.sym, self.full_reason = replica_classes(sched, costs, network, opts)
        D = sched.num_devices
        # the ranks simulated: those of one replica per kind under symmetry (replica 0 alone when all
        # are alike), else all; replica i's run is that of replica rep_of[i], rank r's metrics those
        # of rank rep[r]
        if self.sym is None:
            self.rep_of = list(range(sched.replicas))
        else:
            self.rep_of = list(self.sym.rep_of) or [0] * sched.replicas
        reps = sorted(set(self.rep_of))
        self.active = [k * D + d for k in reps for d in range(D)]
        self.rep = [self.rep_of[r // D] * D + r % D for r in range(R)]
        self.simulated_replicas = len(reps)
        self.ranks = len(self.active)
        self.rows: list[TraceRow | None] = []
        self.arrived: dict[tuple, float] = {}            # messages delivered, not yet received -> time
        self.waiting: dict[tuple, simpy.Event] = {}      # RECVs blocked on a message
        self.ar_arrived: dict[tuple[int, int], list[int]] = {}   # (step, stage) -> ranks arrived
        self.ar_start: dict[tuple[int, int], float] = {}
        self.ar_done: dict[tuple[int, int], simpy.Event] = {}
        self.ar_end: dict[tuple[int, int], float] = {}
        self.pending_ar: dict[int, list[tuple]] = {}   # rank -> (row index, all-reduce key, row so far)
        self.pc = [0] * R
        self.finished = [False] * R
        self.busy = [0.0] * R
        self.peak = [0.0] * R
        self.a2a = [0.0] * R           # per rank: all-to-all seconds of a step (static: from _compile)
        self.a2a_hidden = [0.0] * R
        self.order: dict[int, list[int]] = {}   # rank -> program index of each plan position, where reordered
        self._pair_of: dict | None = None       # meta["overlapped"]: F key -> B key
        self._blocks: dict = {}                 # (F copy, stage, B copy, stage, plans, slowdown) -> block records
        self.step_first = [float("inf")] * opts.steps
        self.step_last = [float("-inf")] * opts.steps
        self.groups = {}
        simulated = set(self.active)
        for s in range(sched.num_stages):
            g = sched.stage_group(s)
            self.groups[s] = [r for r in g if r in simulated]
        self._paths: dict[tuple[int, int], tuple[list, float]] = {}

    # ------------------------------------------------------------------ helpers
    def _path(self, a: int, b: int):
        """(resources, latency, share) of a transfer from rank a to rank b (cached per pair)."""
        got = self._paths.get((a, b))
        if got is not None:
            return got
        if self.sym is not None:
            got = self.sym.p2p[(a, b)] + (1.0,)
        else:
            got = self._real_path(a, b)
        self._paths[(a, b)] = got
        return got

    def _real_path(self, a: int, b: int):
        links = self.net.path(a, b)
        out, lat = [], 0.0
        for ln in links:
            bw = ln.bandwidth / self.opts.link_slowdown.get(ln.name, 1.0)
            out.append((ln.name, bw))
            lat += ln.latency
        cores, share = self.host.transfer(a, b, out)    # on CPU ranks the transport's threads copy the bytes
        return out + cores, lat, share

    def _deliver(self, msg: tuple, t: float) -> None:
        """Message ``msg`` = (src, dst, n-th on that pair) has arrived at dst at time t."""
        ev = self.waiting.pop(msg, None)
        if ev is None:
            self.arrived[msg] = t
        else:
            ev.succeed(t)

    def _send(self, a: int, b: int, nbytes: float, msg: tuple) -> None:
        res, lat, share = self._path(a, b)
        if lat > 0:
            self.env.timeout(lat).callbacks.append(lambda _e: self._flow(res, nbytes, share, msg))
        else:
            self._flow(res, nbytes, share, msg)

    def _flow(self, res, nbytes: float, share: float, msg: tuple) -> None:
        ev = self.flows.start(nbytes, res, share=share)
        env = self.env
        ev.callbacks.append(lambda _e: self._deliver(msg, env.now))

    # ------------------------------------------------------------------ all-reduce
    def _allreduce(self, key: tuple[int, int]):
        """Replay the all-reduce algorithm of :func:`cost_models.comm.allreduce_phases` (a ring,
        or hierarchical when the group spans nodes) as flows over the same links as P2P traffic;
        on a network with a measured all-reduce fit (``collective``), take its ring time as the
        host model spends it (:meth:`sim.cores.HostModel.fitted_allreduce`)."""
        env = self.env
        start = self.ar_start[key]
        if start > env.now:
            yield env.timeout(start - env.now)
        stage = key[1]
        nbytes = self.costs.param_bytes[0][stage]
        full = self.sched.stage_group(stage)
        fitted = getattr(self.net, "collective", None)
        if self.net is not None and nbytes > 0 and len(full) > 1 and fitted is not None:
            # a measured all-reduce (calibration profile): its fitted ring time, of which the
            # messages' latency is the part without bytes
            t = ring_allreduce_time(nbytes, len(full), fitted.bandwidth, fitted.latency)
            lat = ring_allreduce_time(0.0, len(full), fitted.bandwidth, fitted.latency)
            yield from self.host.fitted_allreduce(full, t, lat)
        elif self.net is not None and nbytes > 0 and len(full) > 1:
            for repeat, lat, flows in self._ar_phases(stage, full, nbytes):
                left = repeat
                while left:
                    k, t = self._solo_steps(lat, flows, left)
                    if k:
                        yield env.timeout(t - env.now)
                        left -= k
                        continue
                    if lat > 0:
                        yield env.timeout(lat)
                    yield env.all_of([self.flows.start(b, res, share=sh) for res, b, sh in flows])
                    left -= 1
        self.ar_end[key] = env.now
        self.ar_done[key].succeed(env.now)

    def _solo_steps(self, lat: float, flows: list, left: int) -> tuple[int, float]:
        """(k, t): the next k of ``left`` steps of an all-reduce phase of one flow end by time t
        before anything else happens (SimPy's next event), with the flow's links to itself: each
        takes its latency and its flow's time alone, as one event per step would give them, so they
        are run as one timeout. (0, now) when the phase has several flows, a link of its flow
        carries another flow, or its first step would not end before the next event."""
        env = self.env
        if len(flows) != 1 or flows[0][2] != 1.0:
            return 0, env.now
        res, b, _ = flows[0]
        d = self.flows.solo_duration(b, res)
        if d is None:
            return 0, env.now
        nxt, t, k = env.peek(), env.now, 0
        while k < left:
            end = (t + lat if lat > 0 else t) + d
            if not end < nxt:
                break
            t, k = end, k + 1
        return k, t

    def _ar_phases(self, stage: int, full: list[int], nbytes: float):
        """[(repeat, latency, [(resources, bytes, share)])] of a stage's all-reduce."""
        if self.sym is not None:
            return self.sym.allreduce[stage]
        out = []
        for repeat, transfers in allreduce_phases(self.net, full, nbytes):
            lat, flows = 0.0, []
            for src, dst, b in transfers:
                res, la, share = self._path(src, dst)
                lat = max(lat, la)
                flows.append((res, b, share))
            out.append((repeat, lat, flows))
        return out

    def _ar_arrive(self, key: tuple[int, int], r: int, t: float) -> None:
        arrived = self.ar_arrived.setdefault(key, [])
        arrived.append(r)
        if key not in self.ar_done:
            self.ar_done[key] = self.env.event()
        self.ar_start[key] = max(self.ar_start.get(key, t), t)
        if len(arrived) == len(self.groups[key[1]]):
            nbytes = self.costs.param_bytes[0][key[1]]
            if self.net is None or nbytes <= 0 or len(self.sched.stage_group(key[1])) <= 1:
                self.ar_end[key] = self.ar_start[key]        # nothing to move
                self.ar_done[key].succeed(self.ar_start[key])
            else:
                self.env.process(self._allreduce(key))

    # ------------------------------------------------------------------ rank process
    def _compile(self, r: int) -> tuple[list[_Planned], list[tuple | None], list[tuple] | None]:
        """Rank r's program resolved once, so the hot loop does no lookups: (plan, messages, heads).
        ``plan[i]``: op i's :class:`_Planned` record (shared by the rank's ops that do the same,
        resolved once per such combination); ``messages[i]``: the key (src, dst, n-th message on that
        pair) of the message SEND or RECV i carries, None for other ops; ``heads[i]``: op i's trace row
        up to its peer (None without a trace)."""
        sched = self.sched
        split = sched.split_backward
        slow = self.opts.slowdown.get(r, 1.0)
        program = sched.program(r)
        messages: list[tuple | None] = [None] * len(program)
        heads = [None] * len(program) if self.record else None
        sent: dict = {}
        got: dict = {}
        planned: dict = {}
        plan = []
        append = plan.append
        copy_back = 0.0        # the step's flattening so far: writing the sums back costs as much at OPTIM
        for i, op in enumerate(program):
            k = op.kind
            if heads is not None:
                heads[i] = (r, 0, i, k, str(op), op.copy, op.stage, op.chunk, op.mb, op.peer)
            if k == SEND:
                # per-pair FIFO (checked by validation): the n-th SEND of a pair is the n-th RECV
                peer = op.peer
                n = sent[peer] = sent.get(peer, -1) + 1
                messages[i] = (r, peer, n)
            elif k == RECV:
                peer = op.peer
                n = got[peer] = got.get(peer, -1) + 1
                messages[i] = (peer, r, n)
            elif k == OPTIM:
                optim = self.costs.optim_time[r]
                cpu = optim + copy_back if optim or copy_back else None
                append(_Planned(_ALLREDUCES, cpu, _NOTHING, 0.0, 0.0, 0.0, op.stage, op.peer))
                continue
            what = (k, op.copy, op.stage, op.payload, op.peer)
            p = planned.get(what)
            if p is None:
                p = planned[what] = self._plan(r, op, split, slow)
            if k == ALLREDUCE and p.cpu is not None:
                copy_back += p.cpu
            append(p)
        for i, (alloc, free) in pair_memory(sched, self.costs.for_rank(r), r).items():
            plan[i] = plan[i]._replace(act_alloc=alloc, act_free=free)     # a segmented pair's memory
        if self.costs.has_phases:
            plan, messages, heads = self._overlap(r, program, plan, messages, heads, slow)
        return plan, messages, heads

    def _overlap(self, r: int, program, plan: list, messages: list, heads: list | None, slow: float):
        """Rank r's plan with every overlapped pair of the schedule (``meta["overlapped"]``: an F and
        the B right after it in the rank's compute order) whose F and B both have phases run as one
        block of :func:`sim.overlap.overlapped_pair` time, as DualPipe runs its F&B chunk: first the
        RECVs the lowered program places between the F and the B (in their order, so each pair of
        ranks' FIFO numbering is unchanged), then the F, which takes the whole block, then the B, of
        zero length at the block's end (busy time counts the block once; F's row books the pair's
        memory peak and B's what the pair leaves, segment by segment where the costs give segments:
        :func:`cost_models.memory.pair_memory`), then the other ops that were between them (F's
        SEND / COPY: the block's outputs exist at its end). The trace's ``seq`` is the position in
        this order. Also sets the rank's all-to-all seconds and the hidden part of them (times the
        rank's slowdown, which stretches a whole op, its all-to-alls included)."""
        c = self.costs.for_rank(r)
        pf, pb = c.phases_f, c.phases_b
        if self._pair_of is None:
            self._pair_of = {tuple(a): tuple(b) for a, b in self.sched.meta.get("overlapped", ())}
        pairs = self._pair_of
        blocks = self._blocks
        a2a = hidden = 0.0
        perm: list[int] = []
        n, i = len(program), 0
        while i < n:
            op = program[i]
            k = op.kind
            if k != F:
                if k == B and pb is not None:
                    ph = pb[op.copy][op.stage]
                    if ph is not None:
                        a2a += ph.comm_total
                perm.append(i)
                i += 1
                continue
            ph = pf[op.copy][op.stage] if pf is not None else None
            if ph is not None:
                a2a += ph.comm_total
            want = pairs.get((k, op.stage, op.mb)) if ph is not None and pb is not None else None
            if want is None:
                perm.append(i)
                i += 1
                continue
            j = paired_backward(program, i, want, r)
            nb = program[j]
            if pb[nb.copy][nb.stage] is None:
                perm.append(i)
                i += 1
                continue
            key = (op.copy, op.stage, nb.copy, nb.stage, plan[i], plan[j], slow)
            got = blocks.get(key)
            if got is None:
                pt = overlapped_pair(ph, pb[nb.copy][nb.stage], c.comm_sm_share)
                got = blocks[key] = (plan[i]._replace(cpu=pt.time * slow), plan[j]._replace(cpu=0.0), pt.hidden,
                                     pb[nb.copy][nb.stage].comm_total)
            plan[i], plan[j] = got[0], got[1]
            hidden += got[2]
            a2a += got[3]
            if j == i + 1:
                perm += (i, j)
            else:
                between = range(i + 1, j)
                perm += [x for x in between if program[x].kind == RECV]
                perm += (i, j)
                perm += [x for x in between if program[x].kind != RECV]
            i = j + 1
        self.a2a[r] = a2a * slow
        self.a2a_hidden[r] = hidden * slow
        if perm == list(range(n)):
            return plan, messages, heads
        self.order[r] = perm
        plan = [plan[k] for k in perm]
        messages = [messages[k] for k in perm]
        if heads is not None:
            heads = [heads[k][:2] + (pos,) + heads[k][3:] for pos, k in enumerate(perm)]
        return plan, messages, heads

    def _plan(self, r: int, op, split: bool, slow: float) -> _Planned:
        """The :class:`_Planned` record of op ``op`` of rank r (any kind but OPTIM)."""
        c, s, k = self.costs.for_rank(r), self.sched, op.kind
        if k in (F, B, W):
            alloc, free = activation_change(k, c.act[op.copy][op.stage],
                                            c.act_w[op.copy][op.stage] if split else 0.0, split)
            return _Planned(_NOTHING, c.compute_time(k, op.copy, op.stage) * slow, _COMPUTED, 0.0, alloc, free,
                            op.stage, op.peer)
        if k in (SEND, RECV):
            table = c.act_bytes if op.payload == ACT else c.grad_bytes
            nbytes = table[op.copy][source_stage(op)]
            if k == SEND:
                return _Planned(_NOTHING, c.send_time or None, _POST, nbytes, 0.0, 0.0, op.stage, op.peer)
            return _Planned(_MESSAGE, c.recv_time or None, _NOTHING, nbytes, 0.0, 0.0, op.stage, op.peer)
        if k == ALLREDUCE:
            nbytes = c.param_bytes[op.copy][op.stage]
            copies = sum(1 for _, st in s.stages_on(s.rank_device(r)) if st == op.stage)
            flatten = copies * c.grad_copy_per_byte * nbytes       # flatten the local copies
            return _Planned(_NOTHING, flatten or None, _JOIN, nbytes, 0.0, 0.0, op.stage, op.peer)
        if k == COPY:
            return _Planned(_NOTHING, None, _HAND_OFF, 0.0, 0.0, 0.0, op.stage, op.peer)
        raise ScheduleError(f"rank {r}: {op} is an op kind the simulator does not know")

    def _rank(self, r: int):
        """Rank r's SimPy process: its program, op by op, ``steps`` times. The rank keeps its own
        clock; without a host (the GPU path) its CPU work just advances it, with one it waits for
        its host's cores in SimPy's time (:mod:`sim.cores`)."""
        env, costs = self.env, self.costs
        rows = self.rows
        record = self.record
        new_row = _new_row
        work = self.host.work(r)
        jitter = self.opts.jitter
        rng = random.Random(self.opts.seed * 1_000_003 + r) if jitter else None
        # a log-normal factor of mean 1 and standard deviation ``jitter``: noise that keeps the mean
        # busy time (a clipped normal would not: its mean grows with the deviation) and stays > 0
        sigma = math.sqrt(math.log1p(jitter * jitter))
        mu = -0.5 * sigma * sigma
        no_net = self.net is None
        plan, messages, heads = self._compile(r)
        pc = self.pc
        arrived, waiting = self.arrived, self.waiting
        copy_time = costs.copy_time
        clock = 0.0
        for step in range(self.opts.steps):
            act = peak = busy = 0.0
            my_ars: list[tuple[int, int]] = []
            step_start = clock
            for i, (waits, cpu, then, nbytes, alloc, free, stage, peer) in enumerate(plan):
                start = clock
                # 1. what the op waits for
                if waits:
                    if waits == _MESSAGE:
                        msg = messages[i]
                        if step:
                            msg = msg + (step,)
                        t = arrived.pop(msg, None)
                        if t is None:
                            pc[r] = i
                            ev = waiting[msg] = env.event()
                            t = yield ev
                        if t > clock:
                            clock = t
                    else:                    # the rank's all-reduces of the step
                        pc[r] = i
                        for key in my_ars:
                            t = self.ar_end.get(key)
                            if t is None:
                                t = yield self.ar_done[key]
                            if t > clock:
                                clock = t
                        if record:
                            self._fill_ar_rows(r)
                # 2. its CPU work
                if cpu is not None:
                    if jitter and then == _COMPUTED:
                        cpu = cpu * rng.lognormvariate(mu, sigma)
                    if work is None:         # no host (the GPU path): the clock just advances
                        clock += cpu
                    else:                    # in SimPy's time, until the host's cores have run it
                        pc[r] = i
                        if clock > env.now:
                            yield env.timeout(clock - env.now)
                        yield work(cpu)
                        clock = env.now
                # 3. what it does then
                if then:
                    if then == _COMPUTED:
                        busy += cpu if work is None else clock - start
                        act += alloc
                        act -= free
                        if act > peak:
                            peak = act
                    elif then == _POST:
                        msg = messages[i]
                        if step:
                            msg = msg + (step,)
                        if no_net:       # delivered at once (self._deliver, inlined: one per SEND)
                            ev = waiting.pop(msg, None)
                            if ev is None:
                                arrived[msg] = clock
                            else:
                                ev.succeed(clock)
                        else:
                            if clock > env.now:
                                pc[r] = i
                                yield env.timeout(clock - env.now)
                                clock = env.now
                            self._send(r, peer, nbytes, msg)
                    elif then == _JOIN:
                        key = (step, stage)
                        my_ars.append(key)
                        self._ar_arrive(key, r, clock)
                        if record:
                            head = heads[i] if not step else (r, step) + heads[i][2:]
                            # asynchronous: its row is completed at OPTIM, once its end is known
                            self.pending_ar.setdefault(r, []).append(
                                (len(rows), key, new_row(head + (start, start, nbytes, act))))
                            rows.append(None)
                        continue
                    else:                    # a local hand-off
                        clock += copy_time
                if record:
                    head = heads[i] if not step else (r, step) + heads[i][2:]
                    rows.append(new_row(head + (start, clock, nbytes, act)))
            self.busy[r] = busy
            self.peak[r] = peak
            if step_start < self.step_first[step]:
                self.step_first[step] = step_start
            if clock > self.step_last[step]:
                self.step_last[step] = clock
        pc[r] = len(plan)
        self.finished[r] = True

    def _fill_ar_rows(self, r: int) -> None:
        for idx, key, row in self.pending_ar.pop(r, []):
            self.rows[idx] = row._replace(end=max(row.start, self.ar_end[key]))

    def run(self) -> SimResult:
        for r in self.active:
            self.env.process(self._rank(r))
        with gc_paused():
            self.env.run()
        stuck = [r for r in self.active if not self.finished[r]]
        if stuck:
            desc = "; ".join(f"rank {r} at {self._op_at(r)}" for r in stuck)
            raise SimulationError(f"simulation deadlocked: {desc}")
        s, c = self.sched, self.costs
        R = s.num_ranks
        attrs = dict(engine="sim", schedule=s.name, devices=s.num_devices, microbatches=s.num_microbatches,
                     replicas=s.replicas, time_unit=c.time_unit, mem_unit=c.mem_unit,
                     static_mem={r: c.static_mem[r] for r in range(R)}, cost_model=c.meta.get("model", ""))
        its = [float(b - a) for a, b in zip(self.step_first, self.step_last)]
        busy = [self.busy[x] for x in self.rep]
        peak = [self.peak[x] for x in self.rep]
        rows = [row for row in self.rows if row is not None] if self.record else None
        return SimResult(attrs, its, busy, peak, self.simulated_replicas, self.full_reason, rows, rep_of=self.rep_of,
                         a2a_time=[self.a2a[x] for x in self.rep], a2a_hidden=[self.a2a_hidden[x] for x in self.rep])

    def _op_at(self, r: int):
        """The op of rank r's program at its plan position ``pc[r]`` (the plan may be reordered)."""
        pc, order = self.pc[r], self.order.get(r)
        return self.sched.program(r)[order[pc] if order is not None else pc]

