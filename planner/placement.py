"""Placing stage replicas on a hierarchical cluster, and what the placement costs.

DAPPLE's three device-assignment policies, made precise (``nodes x dpn`` devices, device id =
``node * dpn + local``):

* ``fresh-first``: every stage starts on a fresh machine. A stage of r replicas takes
  ``ceil(r / dpn)`` whole machines and uses the first r devices of them; the rest of its last
  machine stays idle (the fragmentation the paper warns about). Replicas of a stage share a machine
  whenever r <= dpn, so its gradient all-reduce runs on NVLink.
* ``append-first``: stages are packed one after the other in device order (node-major), filling the
  machines already in use before opening a new one; a stage may straddle two machines.
* ``scatter-first``: devices are taken round-robin over the machines (device 0 of every machine,
  then device 1, ...), so a stage's replicas are spread evenly over all machines and replica i of
  consecutive stages tends to sit on the same machine (point-to-point traffic stays local, the
  all-reduce crosses machines: good for models with small weights and large activations).

Stages take consecutive *slots* of the policy's allocation order, packed against its end: the last
stage gets the last slots; if a plan uses fewer devices than the cluster has, the unused ones are the
first slots. A stage's slots are thus fixed by (slots taken by the stages after it, its replicas),
which lets the search extend plans from the last stage backwards (:mod:`planner.search`).

Costs (closed forms from :mod:`cost_models.comm`, on the cluster with identity rank mapping):

* gradient all-reduce of a stage: :func:`cost_models.allreduce_time` over its devices;
* the stage-boundary transfer of one micro-batch: replica ``c mod r_s`` of stage s sends the
  activations of sub-batch c (c < lcm(r_s, r_s+1)) to replica ``c mod r_s+1`` of stage s+1, all at
  once; a transfer takes its path latency plus its bytes over its bottleneck link, where each link's
  bandwidth is shared by every transfer crossing it (a NIC shared by several replicas is the
  bottleneck between machines). The gradient travels back the same way.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from collections import Counter
from math import gcd

from cost_models import Cluster, allreduce_time
from cost_models.files import short_list

POLICIES = ("fresh-first", "append-first", "scatter-first")


def check_policy(policy: str) -> None:
    if policy not in POLICIES:
        raise ValueError(f"unknown placement policy {policy!r}; choose one of {', '.join(POLICIES)}")


def lcm(a: int, b: int) -> int:
    return a * b // gcd(a, b)


@dataclass
class Topology:
    """A cluster seen by the planner: allocation orders, slots and cached communication costs."""

    cluster: Cluster
    _order: dict = field(default_factory=dict, repr=False)
    _devs: dict = field(default_factory=dict, repr=False)
    _ar: dict = field(default_factory=dict, repr=False)
    _link: dict = field(default_factory=dict, repr=False)
    _xfer: dict = field(default_factory=dict, repr=False)
    _bound: dict = field(default_factory=dict, repr=False)
    _paths: dict = field(default_factory=dict, repr=False)
    # what planner.search computes alike for every search of one workload on this topology (seeds'
    # estimates, need tables, bound tables), by workload: see planner.search's _job_cache
    search_memo: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if self.cluster.device_map is not None:
            self.cluster = self.cluster.with_device_map(None)

    @property
    def num_devices(self) -> int:
        return self.cluster.num_devices

    @property
    def dpn(self) -> int:
        return self.cluster.devices_per_node

    def node(self, dev: int) -> int:
        return dev // self.dpn

    # ---------------------------------------------------------------- allocation
    def order(self, policy: str) -> tuple[int, ...]:
        o = self._order.get(policy)
        if o is None:
            check_policy(policy)
            n, d = self.cluster.nodes, self.dpn
            if policy == "scatter-first":
                o = tuple(node * d + g for g in range(d) for node in range(n))
            else:
                o = tuple(range(n * d))
            self._order[policy] = o
        return o

    def slots(self, policy: str, replicas: int) -> int:
        """Slots of the allocation order a stage of ``replicas`` devices takes."""
        if policy == "fresh-first":
            return -(-replicas // self.dpn) * self.dpn
        return replicas

    def devices(self, policy: str, offset: int, replicas: int) -> tuple[int, ...]:
        """Devices of a stage whose slots start at ``offset``."""
        key = (policy, offset, replicas)
        d = self._devs.get(key)
        if d is None:
            d = self._devs[key] = self.order(policy)[offset:offset + replicas]
        return d

    def place(self, policy: str, replicas) -> list[tuple[int, ...]]:
        """Devices of every stage of a replication vector (packed against the end of the order)."""
        sl = [self.slots(policy, r) for r in replicas]
        if sum(sl) > self.num_devices:
            raise ValueError(f"{policy}: replicas {short_list(replicas)} take {sum(sl)} slots; the cluster has "
                             f"{self.num_devices} devices")
        off = self.num_devices - sum(sl)
        out = []
        for r, s in zip(replicas, sl):
            out.append(self.devices(policy, off, r))
            off += s
        return out

    def translation_period(self, policy: str) -> int | None:
        """Slots by which every stage of a plan can move along the allocation order without any
        communication cost changing (None: no such shift): whole nodes (whole leaves on a fat-tree or
        rail fabric, whole pods on a spine) for the node-major orders; one device of every node for
        scatter-first on a flat fabric whose NICs are one per node or one per device. The search uses
        it to compare suffixes of different sizes (:mod:`planner.search`)."""
        c = self.cluster
        if c.nodes_per_pod is not None and c.nodes > c.nodes_per_pod:     # whole pods (on a spine)
            if c.nodes % c.nodes_per_pod:
                return None
            step = c.nodes_per_pod
        elif c.fabric != "flat":
            if c.nodes % c.nodes_per_leaf:
                return None
            step = c.nodes_per_leaf
        else:
            step = 1
        if policy in ("fresh-first", "append-first"):
            return step * self.dpn
        if policy == "scatter-first" and step == 1 and c.nics_per_node in (1, self.dpn):
            return c.nodes
        return None

    # ---------------------------------------------------------------- communication
    def allreduce_coef(self, devs: tuple[int, ...]) -> tuple[float, float]:
        """(alpha, beta): the all-reduce over ``devs`` of n bytes takes alpha + beta * n seconds."""
        c = self._ar.get(devs)
        if c is None:
            if len(devs) <= 1:
                c = (0.0, 0.0)
            else:
                a = allreduce_time(self.cluster, devs, 0.0)
                c = (a, allreduce_time(self.cluster, devs, 1.0) - a)
            self._ar[devs] = c
        return c

    def allreduce_at(self, policy: str, offset: int, replicas: int) -> tuple[float, float]:
        """:meth:`allreduce_coef` of the stage of ``replicas`` on the slots from ``offset``."""
        key = (policy, offset, replicas, None)
        c = self._ar.get(key)
        if c is None:
            c = self._ar[key] = self.allreduce_coef(self.devices(policy, offset, replicas))
        return c

    def fewest_nodes(self, policy: str, replicas: int) -> int:
        """The fewest nodes any stage of ``replicas`` devices spans under ``policy`` (over every
        offset of the allocation order; cached)."""
        key = ("nodes", policy, replicas)
        got = self._ar.get(key)
        if got is None:
            o, d = self.order(policy), self.dpn
            s, r = self.slots(policy, replicas), replicas
            count: dict[int, int] = {}
            for x in o[:r]:
                count[x // d] = count.get(x // d, 0) + 1
            got = len(count)
            for off in range(1, len(o) - s + 1):      # slide the window order[off:off + r]
                a, b = o[off - 1] // d, o[off + r - 1] // d
                count[a] -= 1
                if not count[a]:
                    del count[a]
                count[b] = count.get(b, 0) + 1
                if len(count) < got:
                    got = len(count)
            self._ar[key] = got
        return got

    def allreduce_floor(self, policy: str, replicas: int) -> tuple[float, float]:
        """(alpha, beta) with alpha + beta n <= the all-reduce of n bytes over the devices of any
        stage of ``replicas`` under ``policy``, whatever its offset (what :meth:`allreduce_at` gives
        at some offset), from the closed forms of :mod:`cost_models.comm` on a Cluster and the fewest
        nodes m0 such a stage spans (:meth:`fewest_nodes`). A group of n = r devices on m nodes runs

        * on one node (m = 1, needs r <= dpn): a ring on the node's collective (else intra) link:
          2(r-1) a_in + 2(r-1)/r n / B_in;
        * with k devices on each of m >= 2 nodes (r = m k, k <= dpn): reduce-scatter and all-gather
          inside (2(k-1) a_in + 2(k-1)/k n / B_in) plus a ring across nodes whose NICs are shared by
          ``share`` rings (2(m-1) a_inter + 2(m-1)/m n share / (k B_inter)), and k ranks on a node's
          ``nics_per_node`` NICs put share >= ceil(k / nics_per_node) on one of them;
        * otherwise (m >= 2, unequal counts) a flat ring whose every step takes the slowest hop: some
          hop crosses nodes, and a path between nodes starts with its NIC's link (bandwidth B_inter,
          latency a_inter; the other links' latencies are >= 0), so >= 2(r-1) a_inter + 2(r-1)/r n / B_inter.

        m >= m0 in every case. Each form is alpha_c + beta_c n, and their minimum is >= (min alpha_c)
        + (min beta_c) n for every n >= 0; that is the pair returned ((0, 0) for one replica), less a
        relative 1e-6 for the rounding of :meth:`allreduce_coef`'s beta = T(1) - T(0)."""
        key = ("floor", policy, replicas)
        got = self._ar.get(key)
        if got is None:
            c, r = self.cluster, replicas
            if r <= 1:
                got = (0.0, 0.0)
            else:
                m0 = self.fewest_nodes(policy, r)
                inside = c.collective or c.intra
                a_in, b_in, a_x, b_x = inside.latency, inside.bandwidth, c.inter.latency, c.inter.bandwidth
                forms = []
                if m0 <= 1 and r <= self.dpn:
                    forms.append((2 * (r - 1) * a_in, 2 * (r - 1) / r / b_in))
                for k in range(1, min(r, self.dpn) + 1):
                    m = r // k
                    if r % k == 0 and m >= max(2, m0):
                        share = -(-k // c.nics_per_node)
                        forms.append((2 * (k - 1) * a_in + 2 * (m - 1) * a_x,
                                      2 * (k - 1) / k / b_in + 2 * (m - 1) / m * share / (k * b_x)))
                if r >= max(2, m0):
                    forms.append((2 * (r - 1) * a_x, 2 * (r - 1) / r / b_x))
                got = ((min(f[0] for f in forms) * (1 - 1e-6), min(f[1] for f in forms) * (1 - 1e-6))
                       if forms else (0.0, 0.0))
            self._ar[key] = got
        return got

    def allreduce(self, devs: tuple[int, ...], nbytes: float) -> float:
        if len(devs) <= 1 or nbytes <= 0:
            return 0.0
        a, b = self.allreduce_coef(devs)
        return a + b * nbytes

    def relabel(self, src: tuple[int, ...], dst: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``src`` and ``dst`` with their nodes renamed in order of first appearance (groups of
        ``nodes_per_leaf`` first, then nodes inside a group), local device indices kept: a renaming
        that maps every link onto one of the same bandwidth and latency (all nodes alike; on a
        fat-tree or rail fabric whole groups alike, so only when the groups are all full), hence the
        same transfer costs. Unchanged when the fabric's groups are not all alike, or pods on a spine
        group the groups."""
        c = self.cluster
        if c.is_mixed:      # nodes of two pools are not alike: no renaming keeps the links
            return src, dst
        per = c.nodes if c.fabric == "flat" else c.nodes_per_leaf
        if c.nodes % per or (c.nodes_per_pod is not None and c.nodes > c.nodes_per_pod):
            return src, dst
        d = self.dpn
        groups: dict[int, int] = {}
        nodes: dict[int, int] = {}
        fill: list[int] = []

        def new(dev: int) -> int:
            n = dev // d
            m = nodes.get(n)
            if m is None:
                g = n // per
                h = groups.get(g)
                if h is None:
                    h = groups[g] = len(groups)
                    fill.append(0)
                m = nodes[n] = h * per + fill[h]
                fill[h] += 1
            return m * d + dev % d

        return tuple(new(x) for x in src), tuple(new(x) for x in dst)

    def transfer_terms(self, src: tuple[int, ...], dst: tuple[int, ...]) -> tuple[tuple[float, float], ...]:
        """(latency, seconds per byte of the whole micro-batch) of every transfer of a boundary
        (cached by the boundary's devices up to :meth:`relabel`)."""
        src, dst = self.relabel(src, dst)
        key = (src, dst)
        t = self._link.get(key)
        if t is None:
            distinct = len(set(src)) == len(src) and len(set(dst)) == len(dst)
            t = self._link[key] = self._distinct_terms(src, dst) if distinct else self._pair_terms(src, dst)
        return t

    def _pair_terms(self, src: tuple[int, ...], dst: tuple[int, ...]) -> tuple[tuple[float, float], ...]:
        """:meth:`transfer_terms` (uncached), pair by pair: sub-batch c < n = lcm(|src|, |dst|) goes from
        src[c mod |src|] to dst[c mod |dst|]; a link's load is the share of the micro-batch crossing it,
        a transfer's seconds per byte its path's largest load over bandwidth."""
        n = lcm(len(src), len(dst))
        pairs: dict[tuple[int, int], float] = {}
        for c in range(n):
            p = (src[c % len(src)], dst[c % len(dst)])
            pairs[p] = pairs.get(p, 0.0) + 1.0 / n
        load: dict[str, float] = {}
        paths = []
        for p, frac in pairs.items():
            path = self._path(p)
            paths.append(path)
            for name in path[0]:
                load[name] = load.get(name, 0.0) + frac
        terms = set()
        for names, bws, lat in paths:
            if names:
                terms.add((lat, max(load[nm] / bw for nm, bw in zip(names, bws))))
        return _pareto(terms)

    def _distinct_terms(self, src: tuple[int, ...], dst: tuple[int, ...]) -> tuple[tuple[float, float], ...]:
        """:meth:`transfer_terms` (uncached) of stages whose devices are distinct, in fewer steps and the
        same arithmetic: sub-batch c < n = lcm goes from src[c mod |src|] to dst[c mod |dst|], and these
        pairs are then all distinct (c is fixed by its residues), so each carries 0.0 + 1/n of the
        micro-batch and a link crossed by k of them carries 1/n added k times in turn, ``acc[k]``; a
        link's seconds per byte of the whole micro-batch are worked out once, not once per pair."""
        n = lcm(len(src), len(dst))
        ls, ld = len(src), len(dst)
        got, getp = self._paths.get, self._path
        paths = []
        for c in range(n):
            p = (src[c % ls], dst[c % ld])
            paths.append(got(p) or getp(p))
        count = Counter(nm for names, _, _ in paths for nm in names)
        frac = 0.0 + 1.0 / n
        acc = [0.0]
        for _ in range(max(count.values(), default=0)):
            acc.append(acc[-1] + frac)
        per: dict[str, float] = {}
        terms = set()
        for names, bws, lat in paths:
            if names:
                k = -1.0
                for nm, bw in zip(names, bws):
                    x = per.get(nm)
                    if x is None:
                        x = per[nm] = acc[count[nm]] / bw
                    if x > k:
                        k = x
                terms.add((lat, k))
        return _pareto(terms)

    def _path(self, pair: tuple[int, int]) -> tuple[tuple[str, ...], tuple[float, ...], float]:
        """(link names, bandwidths, latency) of the path between a pair of devices (cached)."""
        got = self._paths.get(pair)
        if got is None:
            path = self.cluster.path(*pair)
            got = self._paths[pair] = (tuple(ln.name for ln in path), tuple(ln.bandwidth for ln in path),
                                       sum(ln.latency for ln in path))
        return got

    def boundary(self, policy: str, offset: int, replicas: int, replicas1: int, nbytes: float) -> tuple[float, float]:
        """(activation, gradient) seconds of the boundary between a stage of ``replicas`` on the slots
        from ``offset`` and the next stage, of ``replicas1`` on the slots right after it, for a
        boundary tensor of ``nbytes`` (:meth:`transfer` both ways, cached by these small keys: the
        search asks for the same boundaries millions of times)."""
        key = (policy, offset, replicas, replicas1, nbytes)
        t = self._bound.get(key)
        if t is None:
            # the boundary's transfer terms do not depend on the bytes: kept by the stages alone, so
            # every tensor size (every micro-batch size of the search) reuses them
            tk = key[:4]
            terms = self._bound.get(tk)
            if terms is None:
                a = self.devices(policy, offset, replicas)
                b = self.devices(policy, offset + self.slots(policy, replicas), replicas1)
                terms = self._bound[tk] = (self.transfer_terms(a, b), self.transfer_terms(b, a))
            t = self._bound[key] = (transfer_seconds(terms[0], nbytes), transfer_seconds(terms[1], nbytes))
        return t

    def transfer(self, src: tuple[int, ...], dst: tuple[int, ...], nbytes: float) -> float:
        """Seconds to move ``nbytes`` (one micro-batch's boundary tensor) from stage ``src`` to ``dst``
        (cached: the search asks the same boundaries millions of times)."""
        key = (src, dst, nbytes)
        t = self._xfer.get(key)
        if t is None:
            t = self._xfer[key] = transfer_seconds(self.transfer_terms(src, dst), nbytes)
        return t


def _pareto(terms) -> tuple[tuple[float, float], ...]:
    """The (latency, seconds per byte) terms no other one exceeds in both, by decreasing latency:
    only they can be the largest lat + nbytes * k (nbytes >= 0)."""
    keep, best = [], -1.0
    for lat, k in sorted(terms, key=lambda x: (-x[0], -x[1])):
        if k > best:
            keep.append((lat, k))
            best = k
    return tuple(keep)


def transfer_seconds(terms, nbytes: float) -> float:
    """Seconds of a boundary transfer of ``nbytes`` with :meth:`Topology.transfer_terms` ``terms``: its
    slowest transfer, latency plus bytes over its share of its bottleneck link."""
    return max((lat + nbytes * k for lat, k in terms), default=0.0)
