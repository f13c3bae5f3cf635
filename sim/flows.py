"""Max-min fair sharing of capacities among concurrent flows (links' bandwidth, hosts' cores).

A flow needs ``amount`` units of work (bytes, or core-seconds) and crosses a set of resources,
using ``weight`` resource units per unit of its own on each (1 for a link it crosses once; the
core-seconds per byte of a transfer that also keeps a CPU busy; the number of identical flows it
stands for, when the simulator lets one flow represent the same transfer of every data-parallel
replica). Rates are max-min fair, found by progressive filling: every flow's level rises at the
same pace; a resource saturates when the flows on it use its whole capacity, and a flow stops
rising when one of its resources saturates or it reaches its own ``cap`` (one core for a compute
op). A flow's rate is its ``share`` times its level (``share`` puts flows of different units on
one scale: a transfer that keeps a core busy at link speed ``bw`` rises ``bw`` bytes/s per core).

So two equal flows on one link get half of it each; a flow throttled elsewhere (a slower link
upstream) keeps only what it can use, and the other flow takes the rest; k compute ops on a host
with c < k cores each get c/k of a core. Rates are recomputed whenever a flow starts or ends.

Worked example (the tests check it): links A (10 B/s) and B (4 B/s); flow 1 crosses A only,
flow 2 crosses A and B. Both rise to 4, where B saturates: flow 2 stops at 4; flow 1 rises on to
6, where A saturates. (An equal split would give each 5 of A and flow 2 only 4 of that: 1 B/s of
A unused.)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import simpy

EPS = 1e-12
_TIE = 1e-9       # levels within this relative distance saturate together


@dataclass(eq=False)
class _Flow:
    remaining: float
    resources: tuple[str, ...]
    weights: tuple[float, ...]
    cap: float
    share: float
    event: simpy.Event
    rate: float = 0.0


def max_min_rates(flows, capacity: dict[str, float]) -> None:
    """Set ``f.rate`` of every flow to its max-min fair rate (progressive filling, see the module
    docstring). ``flows``: objects with resources, weights, cap, share and a writable rate."""
    residual: dict[str, float] = {}
    for f in flows:
        for n in f.resources:
            residual[n] = capacity[n]
    active = list(flows)
    while active:
        demand: dict[str, float] = {}
        for f in active:
            s = f.share
            for n, w in zip(f.resources, f.weights):
                demand[n] = demand.get(n, 0.0) + w * s
        level = math.inf
        for f in active:
            c = f.cap / f.share
            if c < level:
                level = c
        sat = {}
        for n, d in demand.items():
            lv = residual[n] / d if residual[n] > 0 else 0.0
            sat[n] = lv
            if lv < level:
                level = lv
        if math.isinf(level):      # nothing limits these flows (cannot happen: start() rejects them)
            for f in active:
                f.rate = math.inf
            return
        top = level * (1 + _TIE) + EPS
        full = {n for n, lv in sat.items() if lv <= top}
        still = []
        for f in active:
            if f.cap / f.share <= top or any(n in full for n in f.resources):
                f.rate = f.share * level
                for n, w in zip(f.resources, f.weights):
                    residual[n] -= w * f.rate
            else:
                still.append(f)
        active = still


@dataclass
class FairShare:
    env: simpy.Environment
    capacity: dict[str, float] = field(default_factory=dict)
    _flows: list[_Flow] = field(default_factory=list)
    _users: dict[str, int] = field(default_factory=dict)    # resource -> active flows on it
    _last: float = 0.0
    _gen: int = 0

    def start(self, amount: float, resources: dict | list[tuple],
              cap: float = math.inf, share: float = 1.0) -> simpy.Event:
        """Start a flow of ``amount`` over ``resources``; returns an event that fires when it
        completes. ``resources`` maps a name to its capacity, or to (capacity, weight): the flow
        uses ``weight`` resource units per unit of its own (unweighted means 1). ``cap`` bounds
        its rate, ``share`` scales its level (see the module docstring)."""
        ev = self.env.event()
        items = resources.items() if isinstance(resources, dict) else resources
        names, weights = [], []
        for name, spec in items:
            cap_r, w = spec if isinstance(spec, tuple) else (spec, 1.0)
            if cap_r <= 0 or w <= 0:
                raise ValueError(f"resource {name} needs a positive capacity and weight; got {spec}")
            self.capacity.setdefault(name, cap_r)
            names.append(name)
            weights.append(w)
        if share <= 0:
            raise ValueError(f"a flow's share must be positive; got {share}")
        if amount <= EPS or (not names and math.isinf(cap)):
            ev.succeed()
            return ev
        self._advance()
        f = _Flow(amount, tuple(names), tuple(weights), cap, share, ev)
        users = self._users
        shared = False
        for n in f.resources:
            k = users.get(n, 0)
            shared = shared or k > 0
            users[n] = k + 1
        self._flows.append(f)
        # a flow on resources nobody else uses changes no other rate: only its own is computed
        max_min_rates(self._flows if shared else (f,), self.capacity)
        self._arm()
        return ev

    def solo_duration(self, amount: float, resources: list[tuple]) -> float | None:
        """Seconds a flow of ``amount`` over ``resources`` (as :meth:`start` takes them, share 1)
        would take if started now, when none of its resources carries a flow and it has them alone
        until it ends; None when one of them is in use (its rate would depend on the others')."""
        users = self._users
        names, weights = [], []
        for name, spec in resources:
            if users.get(name, 0):
                return None
            cap_r, w = spec if isinstance(spec, tuple) else (spec, 1.0)
            names.append(name)
            weights.append(w)
        if amount <= EPS or not names:
            return None
        f = _Flow(amount, tuple(names), tuple(weights), math.inf, 1.0, None)
        cap = {n: (spec[0] if isinstance(spec, tuple) else spec) for n, spec in resources}
        max_min_rates((f,), {n: self.capacity.get(n, c) for n, c in cap.items()})
        return f.remaining / f.rate

    @property
    def active(self) -> int:
        return len(self._flows)

    def _advance(self) -> None:
        now = self.env.now
        dt = now - self._last
        if dt > 0:
            for f in self._flows:
                f.remaining -= f.rate * dt
        self._last = now

    def _arm(self) -> None:
        """One timer for the next completion (an older timer is ignored when it fires)."""
        flows = self._flows
        if not flows:
            return
        nxt = min(f.remaining / f.rate for f in flows)
        self._gen += 1
        gen = self._gen
        t = self.env.timeout(max(nxt, 0.0))
        t.callbacks.append(lambda _e, gen=gen: self._wake(gen))

    def _wake(self, gen: int) -> None:
        if gen != self._gen:
            return
        self._advance()
        # snap flows that are within rounding of completion
        horizon = 1e-9 * max(1.0, self.env.now)
        done = [f for f in self._flows if f.remaining <= EPS * max(1.0, f.rate) or f.remaining / f.rate <= horizon]
        if done:
            users = self._users
            self._flows = [f for f in self._flows if f not in done]
            freed = False
            for f in done:
                f.remaining = 0.0
                for n in f.resources:
                    users[n] -= 1
                    freed = freed or users[n] > 0
                f.event.succeed()
            if freed:       # someone still uses what the finished flows leave: rates change
                max_min_rates(self._flows, self.capacity)
        self._arm()
