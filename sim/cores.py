"""How a rank's CPU work takes time: the host model, chosen once per simulation.

Every op of a rank has at most one piece of CPU work (its compute, the CPU time of posting or
taking a message, flattening gradients for an all-reduce, the optimizer step). Where it runs
decides how long it takes:

- :class:`NoHost`: every rank owns its device (a GPU, with copy engines for the transfers), so its
  work takes exactly its duration. The engine's loop then advances the rank's clock itself, with
  no SimPy event: this is the path of large GPU simulations, and :meth:`NoHost.work` says so by
  returning None.
- :class:`SharedCores`: ranks on one host share its cores by processor sharing (:mod:`sim.flows`):
  each piece of work is a flow of its duration in core-seconds, capped at one core. With
  ``comm_uses_cores`` (CPU transports such as gloo, whose threads copy and reduce the bytes) a
  transfer also keeps a core of each end's host busy while it runs, and a fitted all-reduce lets
  its per-message latency pass in wall time, then holds a core of each member for its bytes.
- :class:`TimeSlicedCores`: ranks on one host take turns on whole cores in time slices
  (:mod:`sim.slicing`). Transfers then take no core time of their own (their CPU work is the
  SEND/RECV costs, queued like compute); with ``comm_uses_cores`` a fitted all-reduce's whole ring
  time is CPU work each member queues for.

A model answers three questions: the work function of a rank (``work``: seconds -> the event of
their end, or None on the GPU path), what a transfer adds to its network path (``transfer``: host
cores and the rate scale of :mod:`sim.flows`), and how a fitted all-reduce spends its ring time
(``fitted_allreduce``).
"""
from __future__ import annotations

from functools import partial
from typing import Callable, Mapping, Sequence

import simpy

from .flows import FairShare
from .slicing import SlicedCores

Work = Callable[[float], simpy.Event]


class HostModel:
    """Where ranks run their CPU work (see the module docstring). The defaults are those of ranks
    whose transfers take no core time: a transfer adds nothing to its path, a fitted all-reduce
    takes wall time."""

    def __init__(self, env: simpy.Environment):
        self.env = env

    def work(self, rank: int) -> Work | None:
        """The function that runs ``seconds`` of the rank's CPU work: it returns the event of their end."""
        raise NotImplementedError

    def transfer(self, a: int, b: int, links: list) -> tuple[list, float]:
        """(resources a transfer from rank a to rank b adds to its ``links`` [(name, bandwidth)], its
        share in :mod:`sim.flows`)."""
        return [], 1.0

    def fitted_allreduce(self, members: Sequence[int], seconds: float, latency: float):
        """Spend the ring time ``seconds`` of a fitted all-reduce (``latency`` of it its messages'
        latency) of ranks ``members`` (a SimPy process body)."""
        yield self.env.timeout(seconds)


class NoHost(HostModel):
    """No host: ranks own their devices; nothing waits for a core."""

    def work(self, rank: int) -> None:
        """None: the caller advances the rank's clock by the work's duration (no SimPy event)."""
        return None


class _Host(HostModel):
    """Ranks on hosts (``hosts[rank]``) of ``cores`` cores each (a number, or one per host: 1 where
    the mapping names none)."""

    def __init__(self, env: simpy.Environment, hosts: Sequence[int], cores: float | Mapping[int, float],
                 comm_uses_cores: bool):
        super().__init__(env)
        self.hosts = hosts
        self.comm_uses_cores = comm_uses_cores
        self._cores_of = cores

    def cores(self, host: int) -> float:
        c = self._cores_of
        return float(c.get(host, 1.0)) if isinstance(c, Mapping) else float(c)


class SharedCores(_Host):
    """Ranks on one host share its cores by processor sharing (flows over ``host<h>.cores``)."""

    def __init__(self, env: simpy.Environment, flows: FairShare, hosts: Sequence[int],
                 cores: float | Mapping[int, float], comm_uses_cores: bool):
        super().__init__(env, hosts, cores, comm_uses_cores)
        self.flows = flows

    def work(self, rank: int) -> Work:
        """A flow of the work's core-seconds on the rank's host, at most one core."""
        h = self.hosts[rank]
        return partial(self.flows.start, resources={f"host{h}.cores": self.cores(h)}, cap=1.0)

    def transfer(self, a: int, b: int, links: list) -> tuple[list, float]:
        """With ``comm_uses_cores``: a transfer at its slowest link's speed keeps one core of each end's
        host busy, shared with the compute of that host; it rises on the cores' scale (share: bytes
        per second per core). Else nothing, 1."""
        if not (self.comm_uses_cores and links):
            return [], 1.0
        per_byte = 1.0 / min(bw for _, bw in links)
        cores = [(f"host{h}.cores", (self.cores(h), per_byte)) for h in sorted({self.hosts[a], self.hosts[b]})]
        return cores, 1.0 / per_byte

    def fitted_allreduce(self, members: Sequence[int], seconds: float, latency: float):
        """With ``comm_uses_cores``, as a P2P transfer's: the ring's per-message latency passes without
        a core (the transport's threads wait for the peer), then each member keeps a core busy for
        the bytes, shared with the compute of its host. Else wall time."""
        env = self.env
        if not self.comm_uses_cores:
            yield env.timeout(seconds)
            return
        yield env.timeout(latency)
        seconds -= latency
        yield env.all_of([self.work(m)(seconds) for m in members])


class TimeSlicedCores(_Host):
    """Ranks on one host take turns on its whole cores in slices of ``time_slice`` seconds."""

    def __init__(self, env: simpy.Environment, hosts: Sequence[int], cores: float | Mapping[int, float],
                 time_slice: float, comm_uses_cores: bool):
        super().__init__(env, hosts, cores, comm_uses_cores)
        self.time_slice = time_slice
        self._sliced: dict[int, SlicedCores] = {}

    def work(self, rank: int) -> Work:
        """The work queued on the rank's host (first come, first served, a slice at a time)."""
        h = self.hosts[rank]
        got = self._sliced.get(h)
        if got is None:
            got = self._sliced[h] = SlicedCores(self.env, self.cores(h), self.time_slice)
        return got.run

    def fitted_allreduce(self, members: Sequence[int], seconds: float, latency: float):
        """With ``comm_uses_cores``: the whole ring time is CPU work each member queues for. Else wall time."""
        if not self.comm_uses_cores:
            yield self.env.timeout(seconds)
            return
        yield self.env.all_of([self.work(m)(seconds) for m in members])


def host_model(env: simpy.Environment, flows: FairShare, hosts: Sequence[int] | None,
               cores: float | Mapping[int, float], time_slice: float | None,
               comm_uses_cores: bool) -> HostModel:
    """The model of :class:`sim.SimOptions` ``hosts`` / ``cores`` / ``time_slice`` / ``comm_uses_cores``:
    no hosts, processor sharing, or time slices."""
    if hosts is None:
        return NoHost(env)
    if time_slice is None:
        return SharedCores(env, flows, hosts, cores, comm_uses_cores)
    return TimeSlicedCores(env, hosts, cores, time_slice, comm_uses_cores)
