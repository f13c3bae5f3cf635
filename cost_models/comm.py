"""Communication costs in closed form, and the transfer steps an engine can replay on links.

Units: bytes, seconds, bytes/s.

* Point to point: a lone message of S bytes on a path takes ``sum(latency) + S / min(bandwidth)``
  (:func:`p2p_time`).
* Ring all-reduce of S bytes over n devices on links of bandwidth B and latency a:
  ``2(n-1)/n * S/B + 2(n-1) * a`` (:func:`ring_allreduce_time`): a reduce-scatter and an
  all-gather of n-1 steps each, every step moving S/n bytes per device.
* Reduce-scatter / all-gather alone: ``(n-1)/n * S/B + (n-1) * a``.
* A group inside one node of a :class:`~cost_models.cluster.Cluster` runs a ring on the intra
  links. A group spanning m nodes with k ranks on each runs hierarchically: reduce-scatter
  inside each node (S bytes over k), k concurrent rings across nodes (S/k bytes each over m
  nodes; the k rings of a node share its NICs, ``share`` = most rings on one NIC), all-gather
  inside::

      t = (k-1)/k S/B_intra + (k-1) a_intra                       # reduce-scatter
        + 2(m-1)/m (S/k) share/B_inter + 2(m-1) a_inter           # all-reduce across nodes
        + (k-1)/k S/B_intra + (k-1) a_intra                       # all-gather

  With k = 1 this is the flat ring over the nodes. A group with unequal ranks per node (or any
  other :class:`~cost_models.network.Network`) runs a flat ring whose every step takes the
  slowest hop: ``2(n-1)/n * S/B_min + 2(n-1) * a_max``.

:func:`allreduce_steps` returns the same algorithm as steps of concurrent transfers
``(src, dst, bytes)``; replaying them with fair link sharing (:func:`step_time`) gives exactly
:func:`allreduce_time` (the tests check this), so a simulator can either charge the closed form
or move the bytes and see contention with pipeline traffic.
"""
from __future__ import annotations

from collections import Counter
from typing import Iterable, Sequence

from schedules.ir import SEND

from .cluster import Cluster
from .network import Link, Network

Transfer = tuple[int, int, float]


def path_time(path: Sequence[Link], nbytes: float) -> float:
    """Time of a lone message on a path: sum of latencies + bytes / bottleneck bandwidth (0 if empty)."""
    if not path:
        return 0.0
    return sum(l.latency for l in path) + nbytes / min(l.bandwidth for l in path)


def p2p_time(network: Network, src: int, dst: int, nbytes: float) -> float:
    """Seconds to send ``nbytes`` from rank ``src`` to rank ``dst`` with nothing else on the path."""
    if src == dst:
        return 0.0
    return path_time(network.path(src, dst), nbytes)


def ring_allreduce_time(nbytes: float, n: int, bandwidth: float, latency: float = 0.0) -> float:
    """Ring all-reduce of ``nbytes`` over ``n`` devices: 2(n-1)/n * S/B + 2(n-1) * latency."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / bandwidth + 2 * (n - 1) * latency


def reduce_scatter_time(nbytes: float, n: int, bandwidth: float, latency: float = 0.0) -> float:
    """Ring reduce-scatter (or all-gather) of ``nbytes`` over ``n``: (n-1)/n * S/B + (n-1) * latency."""
    if n <= 1:
        return 0.0
    return (n - 1) / n * nbytes / bandwidth + (n - 1) * latency


all_gather_time = reduce_scatter_time


def _node_groups(cluster: Cluster, ranks: Iterable[int]) -> list[list[int]]:
    by_node: dict[int, list[int]] = {}
    for r in ranks:
        by_node.setdefault(cluster.node_of(r), []).append(r)
    return [sorted(v, key=cluster.local_of) for _, v in sorted(by_node.items())]


def _nic_share(cluster: Cluster, groups: list[list[int]]) -> int:
    return max(max(Counter(cluster.nic_of(r) for r in g).values()) for g in groups)


def _ring_order(network: Network, ranks: list[int]) -> list[int]:
    if isinstance(network, Cluster):
        return [r for g in _node_groups(network, ranks) for r in g]
    return sorted(ranks)


def _flat_ring(network: Network, ring: list[int]) -> tuple[float, float]:
    """(bottleneck bandwidth, worst latency) over the hops of a ring."""
    bw, lat = float("inf"), 0.0
    for i, r in enumerate(ring):
        p = network.path(r, ring[(i + 1) % len(ring)])
        if p:
            bw = min(bw, min(l.bandwidth for l in p))
            lat = max(lat, sum(l.latency for l in p))
    return bw, lat


def allreduce_kind(network: Network, ranks: Sequence[int]) -> str:
    """'none' (one rank), 'ring' (one node, or a flat ring) or 'hierarchical' (equal ranks on
    each of several nodes of a Cluster)."""
    ranks = sorted(set(ranks))
    if len(ranks) <= 1:
        return "none"
    if isinstance(network, Cluster):
        groups = _node_groups(network, ranks)
        if len(groups) > 1 and len({len(g) for g in groups}) == 1:
            return "hierarchical"
    return "ring"


def allreduce_time(network: Network, ranks: Sequence[int], nbytes: float) -> float:
    """Seconds to all-reduce ``nbytes`` over ``ranks`` (see the module docstring for the forms)."""
    ranks = sorted(set(ranks))
    n = len(ranks)
    kind = allreduce_kind(network, ranks)
    if kind == "none":
        return 0.0
    if isinstance(network, Cluster) and network.is_mixed:   # pools' own links: the phases' lone step times
        return sum(k * step_time(network, step) for k, step in allreduce_phases(network, ranks, nbytes))
    if isinstance(network, Cluster):
        groups = _node_groups(network, ranks)
        inside = network.collective or network.intra
        if len(groups) == 1:
            return ring_allreduce_time(nbytes, n, inside.bandwidth, inside.latency)
        if kind == "hierarchical":
            m, k = len(groups), len(groups[0])
            share = _nic_share(network, groups)
            return (reduce_scatter_time(nbytes, k, inside.bandwidth, inside.latency)
                    + ring_allreduce_time(nbytes / k, m, network.inter.bandwidth / share, network.inter.latency)
                    + all_gather_time(nbytes, k, inside.bandwidth, inside.latency))
    bw, lat = _flat_ring(network, _ring_order(network, ranks))
    return ring_allreduce_time(nbytes, n, bw, lat)


def _ring_step(rings: list[list[int]], chunk: float) -> list[Transfer]:
    return [(ring[i], ring[(i + 1) % len(ring)], chunk) for ring in rings for i in range(len(ring))]


def allreduce_phases(network: Network, ranks: Sequence[int], nbytes: float) -> list[tuple[int, list[Transfer]]]:
    """The all-reduce of :func:`allreduce_time` as phases ``(repeat, transfers)``: a phase is one
    step of concurrent transfers ``(src, dst, bytes)`` run ``repeat`` times in a row (a ring's
    steps all move the same chunks between the same neighbours), so a group of n ranks costs O(n)
    to describe, not O(n^2). :func:`allreduce_steps` spells the steps out."""
    ranks = sorted(set(ranks))
    n = len(ranks)
    kind = allreduce_kind(network, ranks)
    if kind == "none":
        return []
    if kind == "hierarchical":
        groups = _node_groups(network, ranks)  # type: ignore[arg-type]
        m, k = len(groups), len(groups[0])
        inside = [(k - 1, _ring_step(groups, nbytes / k))] if k > 1 else []
        across = [(2 * (m - 1), _ring_step([[g[j] for g in groups] for j in range(k)], nbytes / (k * m)))]
        return inside + across + [(r, list(t)) for r, t in inside]
    return [(2 * (n - 1), _ring_step([_ring_order(network, ranks)], nbytes / n))]


def allreduce_steps(network: Network, ranks: Sequence[int], nbytes: float) -> list[list[Transfer]]:
    """The all-reduce of :func:`allreduce_time` as steps; every transfer ``(src, dst, bytes)`` of a
    step starts together and the next step starts when all of them have arrived."""
    return [list(t) for r, t in allreduce_phases(network, ranks, nbytes) for _ in range(r)]


def step_time(network: Network, transfers: Sequence[Transfer]) -> float:
    """Time of a step of concurrent transfers started together: each transfer gets, on each link of
    its path, an equal share of the link; its time is its path latency + bytes / its slowest share.
    (Exact max-min fair sharing when the transfers of a step have equal sizes, as in a ring.)"""
    paths = [network.path(s, d) for s, d, _ in transfers]
    load = Counter(l.name for p in paths for l in p)
    t = 0.0
    for (_s, _d, nb), p in zip(transfers, paths):
        if p:
            t = max(t, sum(l.latency for l in p) + nb / min(l.bandwidth / load[l.name] for l in p))
    return t


def steps_time(network: Network, steps: Sequence[Sequence[Transfer]]) -> float:
    return sum(step_time(network, s) for s in steps)


def links_used(sched, network: Network) -> set[str]:
    """Names of the links a lowered schedule's messages and all-reduces cross on ``network`` (the
    same paths and all-reduce phases the simulator uses). Replicas run their device's program, so
    the device programs' pairs, shifted per replica, are every rank's."""
    D = sched.num_devices
    dev_pairs = {(d, op.peer) for d in range(D) for op in sched.programs[d] if op.kind == SEND}
    pairs = {(a + i * D, b + i * D) for i in range(sched.replicas) for a, b in dev_pairs}
    for s in range(sched.num_stages):
        group = sched.stage_group(s)
        if len(group) > 1:
            pairs |= {(a, b) for _, transfers in allreduce_phases(network, group, 1.0) for a, b, _ in transfers}
    return {ln.name for a, b in pairs for ln in network.path(a, b)}
