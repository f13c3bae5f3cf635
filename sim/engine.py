"""The SimPy engine: interprets a lowered schedule with a cost model and returns a trace.

One SimPy process per rank walks its program:

- F / B / W take their time from the cost model (times the rank's slowdown and optional
  per-op jitter). With ``hosts``, ranks on one host share its cores (processor sharing: each
  compute op is a flow of its duration in core-seconds, capped at one core).
- SEND posts the message (taking ``send_time`` of CPU, 0 unless calibrated on a host) and
  returns (isend); the transfer occupies every link on the
  network path for latency + bytes / bandwidth, sharing each link's bandwidth with concurrent
  transfers. RECV blocks until its message has arrived (then
  ``recv_time`` of CPU). COPY is local (``copy_time``).
- ALLREDUCE starts once every member of the stage's group has reached it; it runs the steps of
  a ring all-reduce (hierarchical when the group spans nodes) as flows over the same links as
  P2P traffic, while the ranks go on;
  OPTIM waits for the rank's all-reduces, then takes ``optim_time``.
- Memory: static memory per rank from the cost model; activation memory grows by ``act`` at each
  F and shrinks when the backward that frees it ends (split schedules keep ``act_w`` until W).

The engine knows no schedule by name: everything it does is driven by op kinds and placement.
"""
from __future__ import annotations

import gc
import math
import random
from dataclasses import dataclass, field
from functools import partial
from typing import Mapping, NamedTuple, Sequence

import pandas as pd
import simpy

from cost_models.base import StageCosts
from cost_models.comm import allreduce_steps, ring_allreduce_time
from cost_models.network import Network
from schedules.ir import (ACT, ALLREDUCE, COPY, OPTIM, RECV, SEND, B, F, Schedule, ScheduleError, W, activation_change,
                          source_stage)
from schedules.lower import lower
from schedules.trace import TraceRow, make_trace

from .flows import FairShare


@dataclass
class SimOptions:
    """Knobs beyond the schedule and the costs.

    slowdown: per-rank factor on compute time (a straggler GPU: {3: 1.5}).
    link_slowdown: per-link-name factor dividing bandwidth (a slow link: {"n1.nic0.out": 2};
      link names come from the network, e.g. ``Cluster.links()``).
    jitter: relative standard deviation of per-op compute noise (seeded, deterministic).
    hosts: rank -> host id, with ``cores`` per host: ranks on one host share its cores.
    comm_uses_cores: with ``hosts``, transfers also occupy a core of each end's host while they
      run (CPU transports such as gloo, whose threads copy and reduce the bytes).
    steps: iterations simulated back to back (no barrier between them, as in the executor: a
      rank that finishes early starts the next step); the trace's ``step`` column tells them apart.
    """

    slowdown: Mapping[int, float] = field(default_factory=dict)
    link_slowdown: Mapping[str, float] = field(default_factory=dict)
    jitter: float = 0.0
    seed: int = 0
    hosts: Sequence[int] | None = None
    cores: float | Mapping[int, float] = 1.0
    steps: int = 1
    comm_uses_cores: bool = False

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


class SimulationError(RuntimeError):
    pass


class _Planned(NamedTuple):
    """One op of a rank's program, resolved before the run. Every field means one thing for every
    kind (zero / None where it does not apply)."""

    kind: str
    head: tuple          # the trace row's first fields (device .. peer), see schedules.trace.TraceRow
    seconds: float       # compute time (F/B/W); flattening the local gradients (ALLREDUCE)
    nbytes: float        # bytes moved (SEND/RECV/ALLREDUCE)
    act_alloc: float     # activation bytes allocated when the op starts (F)
    act_free: float      # activation bytes freed when it ends (B/W)
    msg: tuple | None    # (src, dst, n-th message on that pair) for SEND/RECV
    stage: int
    peer: int


# records from one tuple, without a Python-level call (the engine makes one per op)
_new_row = partial(tuple.__new__, TraceRow)
_new_planned = partial(tuple.__new__, _Planned)


def simulate(sched: Schedule, costs: StageCosts, network: Network | None = None,
             options: SimOptions | None = None, *, eager: bool = True, free_comm: bool = False) -> pd.DataFrame:
    """Simulate one training iteration of ``sched`` (lowered here if it is not) and return its trace.

    ``network`` carries the messages and all-reduces (a placed :class:`cost_models.Cluster`, a
    profile's cluster, a :class:`cost_models.PortNetwork`). Without one, communication is free:
    fine for costs that move no bytes (:class:`cost_models.UnitCostModel`); costs that do need
    ``free_comm=True`` to say so, else this raises ValueError instead of dropping them silently."""
    opts = options or SimOptions()
    if network is None and not free_comm and _moves_bytes(costs):
        raise ValueError("these costs send messages and all-reduce gradients but no network was given; pass "
                         "network= (e.g. cluster.place(schedule)) or free_comm=True to make communication free")
    low = sched if sched.lowered else lower(sched, eager=eager)
    return _Engine(low, costs, network, opts).run()


def _moves_bytes(costs: StageCosts) -> bool:
    return any(x > 0 for table in (costs.act_bytes, costs.grad_bytes, costs.param_bytes) for row in table
               for x in row)


class _Engine:
    def __init__(self, sched: Schedule, costs: StageCosts, network: Network | None, opts: SimOptions):
        self.s = sched
        self.c = costs
        self.net = network
        self.o = opts
        self.env = simpy.Environment()
        self.flows = FairShare(self.env)
        self.rows: list[TraceRow | None] = []
        self.arrived: set[tuple] = set()                 # messages delivered, not yet received
        self.waiting: dict[tuple, simpy.Event] = {}      # RECVs blocked on a message
        self.ar_arrived: dict[tuple[int, int], list[int]] = {}   # (step, stage) -> ranks arrived
        self.ar_done: dict[tuple[int, int], simpy.Event] = {}
        self.ar_end: dict[tuple[int, int], float] = {}
        self.pending_ar: dict[int, list[tuple]] = {}   # rank -> (row index, all-reduce key, row so far)
        self.rng = random.Random(opts.seed)
        self.pc = [0] * sched.num_ranks
        self.finished = [False] * sched.num_ranks
        R = sched.num_ranks
        if len(costs.static_mem) != R:
            raise ScheduleError(f"costs were bound for {len(costs.static_mem)} ranks, schedule has {R}; "
                                f"bind the cost model to the lowered schedule")
        self.groups = {s: sched.stage_group(s) for s in range(sched.num_stages)}

    # ------------------------------------------------------------------ helpers
    def _path(self, a: int, b: int):
        links = self.net.path(a, b)
        out, lat = [], 0.0
        for ln in links:
            bw = ln.bandwidth / self.o.link_slowdown.get(ln.name, 1.0)
            out.append((ln.name, bw))
            lat += ln.latency
        if self.o.comm_uses_cores and self.o.hosts is not None and out:
            # on CPU ranks the transport's threads copy the bytes: a transfer at the link's speed
            # keeps one core of each end's host busy, shared with the compute of that host
            per_byte = 1.0 / min(bw for _, bw in out)
            for h in sorted({self.o.hosts[a], self.o.hosts[b]}):
                out.append((f"host{h}.cores", (self._cores(h), per_byte)))
        return out, lat

    def _deliver(self, msg: tuple) -> None:
        """Message ``msg`` = (src, dst, n-th on that pair) has arrived at dst."""
        ev = self.waiting.pop(msg, None)
        if ev is None:
            self.arrived.add(msg)
        else:
            ev.succeed()

    def _transfer(self, a: int, b: int, nbytes: float, msg: tuple):
        links, lat = self._path(a, b)
        if lat > 0:
            yield self.env.timeout(lat)
        yield self.flows.start(nbytes, links)
        self._deliver(msg)

    def _busy(self, host, seconds: float) -> simpy.Event:
        """The rank computes for ``seconds`` of one core; on a shared host the ranks that compute
        at the same moment share its cores."""
        if host is None:
            return self.env.timeout(seconds)
        return self.flows.start(seconds, {f"host{host}.cores": self._cores(host)}, cap=1.0)

    def _cores(self, host: int) -> float:
        c = self.o.cores
        return float(c.get(host, 1.0)) if isinstance(c, Mapping) else float(c)

    # ------------------------------------------------------------------ all-reduce
    def _allreduce(self, key: tuple[int, int], members: list[int]):
        """Replay the all-reduce algorithm of :func:`cost_models.comm.allreduce_steps` (a ring,
        or hierarchical when the group spans nodes) as flows over the same links as P2P traffic;
        on a network with a measured all-reduce fit (``collective``), take its ring time."""
        nbytes = self.c.param_bytes[0][key[1]]
        fitted = getattr(self.net, "collective", None)
        if self.net is not None and nbytes > 0 and len(members) > 1 and fitted is not None:
            # a measured all-reduce (calibration profile): its fitted ring time
            n = len(members)
            t = ring_allreduce_time(nbytes, n, fitted.bandwidth, fitted.latency)
            if self.o.comm_uses_cores and self.o.hosts is not None:
                # CPU transports reduce on the host: each member keeps a core busy for that time,
                # shared with the compute of its host
                yield self.env.all_of([self._busy(self.o.hosts[m], t) for m in members])
            else:
                yield self.env.timeout(t)
        elif self.net is not None and nbytes > 0 and len(members) > 1:
            for step in allreduce_steps(self.net, members, nbytes):
                lat, flows = 0.0, []
                for src, dst, b in step:
                    links, la = self._path(src, dst)
                    lat = max(lat, la)
                    flows.append((links, b))
                if lat > 0:
                    yield self.env.timeout(lat)
                yield self.env.all_of([self.flows.start(b, ln) for ln, b in flows])
        self.ar_end[key] = self.env.now
        self.ar_done[key].succeed()

    # ------------------------------------------------------------------ rank process
    def _compile(self, r: int) -> list[_Planned]:
        """Resolve every op of rank r once (its trace-row prefix, duration, bytes, activation
        change, message), so the hot loop does no lookups. What depends only on (kind, copy,
        stage, payload) is resolved once per such combination."""
        s = self.s
        split = s.split_backward
        slow = self.o.slowdown.get(r, 1.0)
        fifo_count: dict = {}
        resolved: dict = {}
        out = []
        append, planned = out.append, _new_planned
        for i, op in enumerate(s.program(r)):
            k = op.kind
            head = (r, 0, i, k, str(op), op.copy, op.stage, op.chunk, op.mb, op.peer)
            what = (k, op.copy, op.stage, op.payload)
            res = resolved.get(what)
            if res is None:
                res = resolved[what] = self._resolve(r, op, split, slow)
            seconds, nbytes, alloc, free = res
            msg = None
            if k == SEND or k == RECV:
                src, dst = (r, op.peer) if k == SEND else (op.peer, r)
                # per-pair FIFO (checked by validation): the n-th SEND of a pair is the n-th RECV
                n = fifo_count[(k, src, dst)] = fifo_count.get((k, src, dst), -1) + 1
                msg = (src, dst, n)
            append(planned((k, head, seconds, nbytes, alloc, free, msg, op.stage, op.peer)))
        return out

    def _resolve(self, r: int, op, split: bool, slow: float) -> tuple[float, float, float, float]:
        """(seconds, nbytes, act_alloc, act_free) of an op of rank r (see :class:`_Planned`)."""
        c, s, k = self.c, self.s, op.kind
        if k in (F, B, W):
            alloc, free = activation_change(k, c.act[op.copy][op.stage],
                                            c.act_w[op.copy][op.stage] if split else 0.0, split)
            return c.compute_time(k, op.copy, op.stage) * slow, 0.0, alloc, free
        if k in (SEND, RECV):
            table = c.act_bytes if op.payload == ACT else c.grad_bytes
            return 0.0, table[op.copy][source_stage(op)], 0.0, 0.0
        if k == ALLREDUCE:
            nbytes = c.param_bytes[op.copy][op.stage]
            copies = sum(1 for _, st in s.stages_on(s.rank_device(r)) if st == op.stage)
            return copies * c.grad_copy_per_byte * nbytes, nbytes, 0.0, 0.0   # flatten the local copies
        return 0.0, 0.0, 0.0, 0.0

    def _rank(self, r: int):
        env, c = self.env, self.c
        rows = self.rows
        new_row = _new_row
        host = self.o.hosts[r] if self.o.hosts is not None else None
        jitter = self.o.jitter
        no_net = self.net is None
        compiled = self._compile(r)
        pc = self.pc
        for step in range(self.o.steps):
            act = 0.0
            copy_back = 0.0
            my_ars: list[tuple[int, int]] = []
            for i, (k, head, seconds, nbytes, alloc, free, msg, stage, peer) in enumerate(compiled):
                pc[r] = i
                if step:
                    head = (r, step) + head[2:]
                    if msg is not None:
                        msg = msg + (step,)
                start = env.now
                if k in (F, B, W):
                    dur = seconds * max(0.05, self.rng.gauss(1.0, jitter)) if jitter else seconds
                    act += alloc
                    yield self._busy(host, dur)
                    act -= free
                elif k == SEND:
                    if c.send_time:
                        yield self._busy(host, c.send_time)
                    if no_net:
                        self._deliver(msg)
                    else:
                        env.process(self._transfer(r, peer, nbytes, msg))
                elif k == RECV:
                    if msg in self.arrived:
                        self.arrived.discard(msg)
                    else:
                        ev = self.waiting[msg] = env.event()
                        yield ev
                    if c.recv_time:
                        yield self._busy(host, c.recv_time)
                elif k == COPY:
                    if c.copy_time:
                        yield env.timeout(c.copy_time)
                elif k == ALLREDUCE:
                    if seconds:
                        yield self._busy(host, seconds)
                    key = (step, stage)
                    arrived = self.ar_arrived.setdefault(key, [])
                    arrived.append(r)
                    if key not in self.ar_done:
                        self.ar_done[key] = env.event()
                    my_ars.append(key)
                    if len(arrived) == len(self.groups[stage]):
                        env.process(self._allreduce(key, self.groups[stage]))
                    # asynchronous: its row is completed at OPTIM, once its end is known
                    self.pending_ar.setdefault(r, []).append(
                        (len(rows), key, new_row(head + (start, start, nbytes, act))))
                    copy_back += seconds    # ... and write the sums back to every copy at OPTIM
                    rows.append(None)
                    continue
                elif k == OPTIM:
                    for key in my_ars:
                        ev = self.ar_done[key]
                        if not ev.triggered:
                            yield ev
                    self._fill_ar_rows(r)
                    if c.optim_time[r] or copy_back:
                        yield self._busy(host, c.optim_time[r] + copy_back)
                rows.append(new_row(head + (start, env.now, nbytes, act)))
        self.finished[r] = True

    def _fill_ar_rows(self, r: int) -> None:
        for idx, key, row in self.pending_ar.pop(r, []):
            self.rows[idx] = row._replace(end=max(row.start, self.ar_end[key]))

    def run(self):
        for r in range(self.s.num_ranks):
            self.env.process(self._rank(r))
        # a run allocates one long-lived record per op and almost no cyclic garbage: the cyclic
        # collector would walk the growing heap again and again (measured: half the run time of
        # a 97k-op run), so it is paused while the engine runs
        paused = gc.isenabled()
        gc.disable()
        try:
            self.env.run()
        finally:
            if paused:
                gc.enable()
        stuck = [r for r in range(self.s.num_ranks) if not self.finished[r]]
        if stuck:
            desc = "; ".join(f"rank {r} at {self.s.program(r)[self.pc[r]]}" for r in stuck)
            raise SimulationError(f"simulation deadlocked: {desc}")
        rows = [row for row in self.rows if row is not None]
        c = self.c
        return make_trace(rows, engine="sim", schedule=self.s.name, devices=self.s.num_devices,
                          microbatches=self.s.num_microbatches, replicas=self.s.replicas,
                          time_unit=c.time_unit, mem_unit=c.mem_unit,
                          static_mem={r: c.static_mem[r] for r in range(self.s.num_ranks)},
                          cost_model=c.meta.get("model", ""))
