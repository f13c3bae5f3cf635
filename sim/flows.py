"""Fair sharing of capacities among concurrent flows (links' bandwidth, hosts' cores).

A flow needs ``amount`` units of work (bytes, or core-seconds) and crosses a set of resources;
while n flows share a resource of capacity C, each gets C/n of it, and a flow progresses at the
smallest share along its resources (capped by its own ``cap``, e.g. one core per compute op);
a weight converts a flow's units into a resource's (a transfer that also keeps a CPU busy).
Rates are recomputed whenever a flow starts or ends (processor sharing), so two equal transfers
on one link take twice as long as one, and k compute ops on a host with c < k cores take k/c
times longer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import simpy

EPS = 1e-12


@dataclass(eq=False)
class _Flow:
    remaining: float
    resources: tuple[str, ...]
    weights: tuple[float, ...]
    cap: float
    event: simpy.Event
    rate: float = 0.0


@dataclass
class FairShare:
    env: simpy.Environment
    capacity: dict[str, float] = field(default_factory=dict)
    _flows: list[_Flow] = field(default_factory=list)
    _count: dict[str, int] = field(default_factory=dict)
    _last: float = 0.0
    _gen: int = 0

    def start(self, amount: float, resources: dict | list[tuple],
              cap: float = math.inf) -> simpy.Event:
        """Start a flow of ``amount`` over ``resources``; returns an event that fires when it
        completes. ``resources`` maps a name to its capacity, or to (capacity, weight): the flow
        uses ``weight`` resource units per unit of its own (e.g. core-seconds per byte when a
        transfer also keeps a host's CPU busy); unweighted means 1."""
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
        if amount <= EPS or (not names and math.isinf(cap)):
            ev.succeed()
            return ev
        self._advance()
        f = _Flow(amount, tuple(names), tuple(weights), cap, ev)
        self._flows.append(f)
        for n in names:
            self._count[n] = self._count.get(n, 0) + 1
        self._reschedule()
        return ev

    def _advance(self) -> None:
        now = self.env.now
        dt = now - self._last
        if dt > 0:
            for f in self._flows:
                f.remaining -= f.rate * dt
        self._last = now

    def _reschedule(self) -> None:
        done = [f for f in self._flows if f.remaining <= EPS * max(1.0, f.rate)]
        for f in done:
            self._remove(f)
        for f in done:
            f.event.succeed()
        if not self._flows:
            return
        nxt = math.inf
        for f in self._flows:
            r = f.cap
            for n, w in zip(f.resources, f.weights):
                r = min(r, self.capacity[n] / self._count[n] / w)
            f.rate = r
            nxt = min(nxt, f.remaining / r)
        self._gen += 1
        gen = self._gen
        t = self.env.timeout(max(nxt, 0.0))
        t.callbacks.append(lambda _e, gen=gen: self._wake(gen))

    def _wake(self, gen: int) -> None:
        if gen != self._gen:
            return
        self._advance()
        # snap flows that are within rounding of completion
        for f in self._flows:
            if f.rate > 0 and f.remaining / f.rate <= 1e-9 * max(1.0, self.env.now):
                f.remaining = 0.0
        self._reschedule()

    def _remove(self, f: _Flow) -> None:
        self._flows.remove(f)
        for n in f.resources:
            self._count[n] -= 1
