"""Cluster specs: nodes of devices, the links inside a node and the network between nodes.

A :class:`Cluster` implements the :class:`~cost_models.network.Network` protocol. The model:

* Inside a node every device has one full-duplex port into a non-blocking fabric (NVSwitch,
  or a PCIe switch): a message from local device i to local device j crosses the links
  ``n<node>.g<i>.out`` and ``n<node>.g<j>.in`` (``intra`` bandwidth each, ``intra`` latency once).
* Between nodes a message leaves through the sender's NIC and enters through the receiver's
  NIC: links ``n<a>.nic<k>.out`` and ``n<b>.nic<l>.in`` (``inter`` bandwidth, latency once).
  Local device i uses NIC ``i * nics_per_node // devices_per_node`` (with 8 NICs for 8 GPUs
  each GPU has its own; with one NIC all flows of a node share it).
* The fabric between the NICs (``fabric``): ``flat`` is one non-blocking switch. ``fat-tree``
  groups the nodes into leaves of ``nodes_per_leaf``; a message between leaves also crosses its
  leaf's uplink ``leaf<x>.up`` and the other leaf's downlink ``leaf<y>.down``, each carrying the
  leaf's NIC bandwidth divided by ``oversubscription`` (1 = non-blocking, 2 = half as much up as
  down). ``rail`` is rail-optimised: NIC k of the nodes of a group of ``nodes_per_leaf`` share
  one rail switch, so a message between the same rail of one group stays there, and any other
  (another rail, another group) crosses ``g<x>.rail<k>.up`` and ``g<y>.rail<l>.down`` (the rail
  switch's ports divided by ``oversubscription``).
* Pods (``nodes_per_pod``, optional, a multiple of ``nodes_per_leaf`` on a fat-tree or rail
  fabric): the fabric above is one pod of that many nodes, and pods meet in a spine whose links
  are ``pod_oversubscription`` times narrower than the NICs under them. A message between pods
  also crosses its pod's uplink ``pod<p>.up`` and the other pod's downlink ``pod<q>.down``, each
  carrying the pod's NIC bandwidth divided by ``pod_oversubscription`` (after the leaf or rail
  uplinks of its two ends). The ``h100-pods`` preset: pods of 8,192 H100s (1,024 nodes, full
  bisection inside) joined 7:1 (the ratio between Llama 3's pods, Llama 3 paper section 3.3.1).
* Each link carries its latency on the first link of a path only, so a lone message of S bytes
  takes ``sum(latencies) + S / min(bandwidths)`` (:func:`cost_models.comm.p2p_time`); the
  simulator shares a link's bandwidth between the transfers crossing it.

Ranks of a schedule are placed on physical devices by ``device_map`` (rank -> global device
index ``node * devices_per_node + local``; None = identity). The mappings (:data:`MAPPINGS`) read
only where devices sit, a :class:`DeviceGrid` of nodes x devices per node (a cluster's
:attr:`Cluster.grid`, or the executor's torchrun nodes x processes per node). :func:`sequential_map` keeps rank
order; :func:`map_copies_same_node` puts the devices that hold copies of the same stage (the two
pipelines of Chimera / BitPipe, optionally data-parallel replicas too) on one node, so the stage
gradient all-reduce stays on NVLink (BitPipe's mapping).

A cluster YAML file (presets in ``cost_models/presets/clusters``)::

    name: dgx-a100-4x8-ib
    nodes: 4
    devices_per_node: 8
    device: a100                  # device preset, YAML path, or an inline device mapping
    intra: nvlink3                # a link type (see LINK_TYPES) or {type:, bandwidth:, latency:}
    inter: {type: ib-hdr}         # bandwidth in B/s or e.g. '200 Gb/s'; latency in s or '5 us'
    nics_per_node: 8
    fabric: flat                  # flat | fat-tree | rail (optional)
    oversubscription: 1           # fat-tree / rail: down / up bandwidth of a leaf (optional)
    nodes_per_leaf: 32            # fat-tree / rail: nodes under one leaf switch (optional)
    nodes_per_pod: 1024           # pods of that many nodes joined by a spine (optional; none: one pod)
    pod_oversubscription: 7       # the spine: NIC bandwidth of a pod / its uplink (optional, 1)

Pools (a cluster of mixed devices): a file may list ``pools`` instead of the one pool's fields
at the top level, each pool with its own nodes, devices per node, device (preset, YAML path or
inline mapping), intra link, NICs and their link, and ``between``, the link that joins two pools::

    name: a100-h100
    pools:
      - {nodes: 2, device: a100, devices_per_node: 8, intra: nvlink3, inter: ib-hdr, nics_per_node: 8}
      - {nodes: 2, device: h100, devices_per_node: 8, intra: nvlink4, inter: ib-ndr, nics_per_node: 8}
    between: ib-hdr               # how nodes of two pools reach each other

Node ids and GPU numbers are global: pools in order, node-major (the a100 GPUs are 0..15, the
h100 ones 16..31; nodes 0-1 and 2-3). A node's intra-node links are its pool's, its NICs its
pool's ``inter``. The fabric of a mixed cluster is flat: each pool one non-blocking switch, and
the pools' switches joined without contention at ``between``'s rate per NIC, so a message between
nodes of two pools crosses ``n<a>.nic<k>.out`` (its pool's NIC), ``n<a>.nic<k>.bx.out`` and
``n<b>.nic<l>.bx.in`` (that NIC's port to the other pools, ``between``'s bandwidth) and
``n<b>.nic<l>.in``: latency the sender pool's ``inter`` plus ``between``'s, bandwidth the least of
the two NICs and ``between``. Fat-tree, rail and pods are one-pool fabrics: refused with pools.
Every single-kind cluster is a one-pool cluster (:class:`Pool`), with today's fields and links.

Sizes: ``load_cluster("dgx-h100-ib:128")`` (or :func:`with_nodes`) is the preset with 128 nodes.

Units: bandwidth bytes/s per direction, latency seconds.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from . import _spec
from ._spec import SpecError
from .device import DeviceSpec, device_from_dict, load_device
from .network import Link

if TYPE_CHECKING:  # pragma: no cover
    from schedules.ir import Schedule


@dataclass(frozen=True)
class LinkSpec:
    """A class of link: ``bandwidth`` bytes/s per direction of one port, ``latency`` seconds."""

    kind: str
    bandwidth: float
    latency: float

    def to_dict(self) -> dict:
        # a link that is no preset type (e.g. a calibration profile's fitted one) reads back as custom
        return {"type": self.kind if self.kind in LINK_TYPES else "custom", "bandwidth": self.bandwidth,
                "latency": self.latency}


# Nominal per-direction bandwidths of one device's / NIC's port, and typical NCCL-level one-way
# latencies. Edit in a cluster file (``intra: {type: nvlink3, bandwidth: 200 GB/s}``) to match
# what you measure; bandwidth achievable by NCCL is usually 70-90% of these.
LINK_TYPES: dict[str, LinkSpec] = {
    "nvlink2": LinkSpec("nvlink2", 150e9, 3e-6),    # V100 SXM2: 6 links x 25 GB/s
    "nvlink3": LinkSpec("nvlink3", 300e9, 3e-6),    # A100: 12 links x 25 GB/s, NVSwitch
    "nvlink4": LinkSpec("nvlink4", 450e9, 3e-6),    # H100/H200: 18 links x 25 GB/s, NVSwitch
    "pcie3": LinkSpec("pcie3", 15.75e9, 5e-6),      # PCIe 3.0 x16
    "pcie4": LinkSpec("pcie4", 31.5e9, 5e-6),       # PCIe 4.0 x16
    "pcie5": LinkSpec("pcie5", 63e9, 5e-6),         # PCIe 5.0 x16
    "ib-edr": LinkSpec("ib-edr", 100e9 / 8, 5e-6),  # InfiniBand EDR 100 Gb/s
    "ib-hdr": LinkSpec("ib-hdr", 200e9 / 8, 5e-6),  # InfiniBand HDR 200 Gb/s
    "ib-ndr": LinkSpec("ib-ndr", 400e9 / 8, 5e-6),  # InfiniBand NDR 400 Gb/s
    # NVLink bridges of two consumer / workstation cards (per direction: links x lanes): GA102 (RTX 3090)
    # 4 x 14.0625 GB/s (112.5 GB/s both ways, the RTX 3090 datasheet); TU102 (Titan RTX, RTX 2080 Ti)
    # 2 x 25 GB/s (100 GB/s both ways, the Titan RTX datasheet); TU104 (RTX 2080) 1 x 25 GB/s (50 GB/s
    # both ways). A bridge joins two cards: a node of two bridged cards uses it as its intra link.
    "nvlink-bridge-ga102": LinkSpec("nvlink-bridge-ga102", 56.25e9, 3e-6),
    "nvlink-bridge-tu102": LinkSpec("nvlink-bridge-tu102", 50e9, 3e-6),
    "nvlink-bridge-tu104": LinkSpec("nvlink-bridge-tu104", 25e9, 3e-6),
    "eth-10g": LinkSpec("eth-10g", 10e9 / 8, 30e-6),    # 10 Gb/s Ethernet (TCP sockets)
    "eth-25g": LinkSpec("eth-25g", 25e9 / 8, 30e-6),    # 25 Gb/s Ethernet (TCP sockets)
    "eth-100g": LinkSpec("eth-100g", 100e9 / 8, 20e-6),  # 100 Gb/s Ethernet
}


FABRICS = ("flat", "fat-tree", "rail")
DEFAULT_NODES_PER_LEAF = 32       # a DGX SuperPOD scalable unit


def link_types() -> list[str]:
    return sorted(LINK_TYPES)


def link_from_value(value, source: str, field: str) -> LinkSpec:
    """A link type name, or a mapping ``{type?, bandwidth?, latency?}`` (a type's values are the
    defaults; without a type both bandwidth and latency are required)."""
    if isinstance(value, str):
        if value not in LINK_TYPES:
            raise SpecError(f"{source}: field {field!r}: unknown link type {value!r} "
                            f"(known: {', '.join(link_types())})")
        return LINK_TYPES[value]
    if not isinstance(value, dict):
        raise SpecError(f"{source}: field {field!r} must be a link type name or a mapping with "
                        f"type / bandwidth / latency; got {value!r}")
    _spec.check_fields(value, source, ("type", "bandwidth", "latency"), prefix=field + ".")
    kind = value.get("type", "custom")
    if kind != "custom" and kind not in LINK_TYPES:
        raise SpecError(f"{source}: field {field + '.type'!r}: unknown link type {kind!r} "
                        f"(known: {', '.join(link_types())})")
    base = LINK_TYPES.get(kind)
    if base is None:
        _spec.check_fields(value, source, ("type", "bandwidth", "latency"), ("bandwidth", "latency"), field + ".")
    bw = _spec.bandwidth(value["bandwidth"], source, field + ".bandwidth") if "bandwidth" in value else base.bandwidth
    lat = _spec.seconds(value["latency"], source, field + ".latency") if "latency" in value else base.latency
    return LinkSpec(kind, bw, lat)


@dataclass(frozen=True)
class DeviceGrid:
    """Where ranks can sit: ``nodes`` x ``devices_per_node`` devices, global device ``node *
    devices_per_node + local``; what the rank -> device mappings of :data:`MAPPINGS` read (``name``
    names it in their errors: a cluster's name, or ``torchrun NODESxPER_NODE``)."""

    nodes: int
    devices_per_node: int
    name: str = "device grid"

    def __post_init__(self):
        for f in ("nodes", "devices_per_node"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise SpecError(f"{self.name}: field {f!r} must be an integer >= 1; got {v!r}")

    @property
    def num_devices(self) -> int:
        return self.nodes * self.devices_per_node


POOL_FIELDS = ("nodes", "devices_per_node", "device", "intra", "inter", "nics_per_node")


@dataclass(frozen=True)
class Pool:
    """``nodes`` nodes of ``devices_per_node`` devices of one kind (``device``), joined inside a node
    by ``intra`` and between its nodes by ``nics_per_node`` NICs of ``inter``; ``name`` names it in
    the output (default: the device's name)."""

    nodes: int
    devices_per_node: int
    device: DeviceSpec
    intra: LinkSpec
    inter: LinkSpec
    nics_per_node: int = 1
    name: str = ""
    # NIC ports one of its NICs stands for (1; more in the view of tensor-parallel groups, whose NIC is
    # several merged: :func:`tensor_parallel_groups`), so its port to other pools is as many ``between``s
    nic_ports: float = field(default=1.0, repr=False)

    def __post_init__(self):
        if not self.name:
            object.__setattr__(self, "name", self.device.name)

    @property
    def num_devices(self) -> int:
        return self.nodes * self.devices_per_node

    def to_dict(self) -> dict:
        return {"name": self.name, "nodes": self.nodes, "devices_per_node": self.devices_per_node,
                "device": self.device.to_dict(), "intra": self.intra.to_dict(), "inter": self.inter.to_dict(),
                "nics_per_node": self.nics_per_node}


@dataclass(frozen=True, kw_only=True, init=False)
class Cluster:
    """Pools of devices (:class:`Pool`); see the module docstring for the link model.

    A one-pool cluster is built as before, ``Cluster(name=, nodes=, devices_per_node=, device=,
    intra=, inter=, nics_per_node=)``, or with ``pools=(Pool(...),)``: the two are equal. Its
    ``nodes``, ``devices_per_node``, ``device``, ``intra``, ``inter`` and ``nics_per_node`` are its
    pool's, and ``dataclasses.replace`` with those names changes its pool. A mixed cluster
    (``pools`` of several, ``between``: how nodes of two pools reach each other) has global node
    ids and GPU numbers (pools in order, node-major); its ``nodes`` and ``num_devices`` are the
    totals, and each of the per-pool fields answers only when every pool has the same value (else
    a :class:`SpecError` says to ask per rank: :meth:`device_of`, :meth:`pool_of`), so no caller
    silently prices a mixed cluster on one kind.

    ``collective``: an optional fitted (latency, bandwidth) of a ring all-reduce inside a node
    (calibration profiles set it, one-pool clusters only); :func:`cost_models.comm.allreduce_time`
    then uses it instead of the intra links.
    """

    name: str
    pools: tuple[Pool, ...]
    between: LinkSpec | None = None
    device_map: tuple[int, ...] | None = None
    collective: LinkSpec | None = None
    description: str = ""
    fabric: str = "flat"
    oversubscription: float = 1.0
    nodes_per_leaf: int = DEFAULT_NODES_PER_LEAF
    nodes_per_pod: int | None = None
    pod_oversubscription: float = 1.0
    # the links made so far, by what names them (a path of a 131,072-GPU job is looked up, not built)
    _memo: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    def __init__(self, *, name: str, pools: tuple[Pool, ...] | None = None, between: LinkSpec | None = None,
                 device_map: tuple[int, ...] | None = None, collective: LinkSpec | None = None,
                 description: str = "", fabric: str = "flat", oversubscription: float = 1.0,
                 nodes_per_leaf: int = DEFAULT_NODES_PER_LEAF, nodes_per_pod: int | None = None,
                 pod_oversubscription: float = 1.0, **pool_fields):
        bad = sorted(set(pool_fields) - set(POOL_FIELDS))
        if bad:
            raise TypeError(f"Cluster() got unexpected keyword argument(s) {', '.join(bad)}")
        if pools is None:
            missing = [f for f in POOL_FIELDS if f not in pool_fields and f != "nics_per_node"]
            if missing:
                raise TypeError(f"Cluster() needs pools= or the one-pool fields; missing {', '.join(missing)}")
            pools = (Pool(**pool_fields),)
        else:
            pools = tuple(pools)
            if pool_fields:           # dataclasses.replace(one_pool_cluster, nodes=...): its pool changes
                if len(pools) != 1:
                    raise SpecError(f"cluster {name!r} has {len(pools)} pools: change {', '.join(sorted(pool_fields))} "
                                    f"of one pool (dataclasses.replace(cluster.pools[i], ...)), not of the cluster")
                pools = (replace(pools[0], **pool_fields),)
        for k, v in (("name", name), ("pools", pools), ("between", between), ("device_map", device_map),
                     ("collective", collective), ("description", description), ("fabric", fabric),
                     ("oversubscription", oversubscription), ("nodes_per_leaf", nodes_per_leaf),
                     ("nodes_per_pod", nodes_per_pod), ("pod_oversubscription", pod_oversubscription),
                     ("_memo", {})):
            object.__setattr__(self, k, v)
        self.__post_init__()

    def __post_init__(self):
        if not self.pools or not all(isinstance(p, Pool) for p in self.pools):
            raise SpecError(f"cluster {self.name!r}: pools must be a non-empty tuple of Pool; got {self.pools!r}")
        for i, p in enumerate(self.pools):
            where = f"cluster {self.name!r}" if len(self.pools) == 1 else f"cluster {self.name!r} pool {i} ({p.name})"
            for f in ("nodes", "devices_per_node", "nics_per_node"):
                v = getattr(p, f)
                if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                    raise SpecError(f"{where}: field {f!r} must be an integer >= 1; got {v!r}")
        names = [p.name for p in self.pools]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup is not None:
            i, j = [k for k, n in enumerate(names) if n == dup][:2]
            raise SpecError(f"cluster {self.name!r}: pools {i} and {j} are both named {dup!r}; give one a 'name:'")
        if self.is_mixed:
            if self.between is None:
                raise SpecError(f"cluster {self.name!r} has {len(self.pools)} pools but no 'between' link: say how "
                                f"nodes of two pools reach each other (e.g. between: ib-hdr)")
            if self.fabric != "flat" or self.nodes_per_pod is not None:
                raise SpecError(f"cluster {self.name!r}: a cluster of several pools has a flat fabric (each pool "
                                f"one switch, the pools joined by 'between'); remove fabric / nodes_per_pod")
            if self.collective is not None:
                raise SpecError(f"cluster {self.name!r}: 'collective' (a fitted all-reduce inside a node) is "
                                f"for one-pool clusters; remove it")
        elif self.between is not None:
            raise SpecError(f"cluster {self.name!r} has one pool: 'between' joins pools; remove it")
        for f in ("nodes_per_leaf", "nodes_per_pod"):
            v = getattr(self, f)
            if v is None and f == "nodes_per_pod":
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise SpecError(f"cluster {self.name!r}: field {f!r} must be an integer >= 1; got {v!r}")
        if self.fabric not in FABRICS:
            raise SpecError(f"cluster {self.name!r}: unknown fabric {self.fabric!r}; "
                            f"choose one of {', '.join(FABRICS)}")
        for f in ("oversubscription", "pod_oversubscription"):
            o = getattr(self, f)
            if isinstance(o, bool) or not isinstance(o, (int, float)) or not (1.0 <= o < float("inf")):
                raise SpecError(f"cluster {self.name!r}: {f} must be a finite number >= 1 "
                                f"(1 = non-blocking); got {o!r}")
        pod = self.nodes_per_pod
        if pod is not None and self.fabric != "flat" and pod % self.nodes_per_leaf:
            raise SpecError(f"cluster {self.name!r}: nodes_per_pod ({pod}) must be a multiple of nodes_per_leaf "
                            f"({self.nodes_per_leaf}): a pod holds whole leaves")
        # pool p's first node and first GPU (global ids: pools in order, node-major)
        nodes0, gpus0 = [0], [0]
        for p in self.pools:
            nodes0.append(nodes0[-1] + p.nodes)
            gpus0.append(gpus0[-1] + p.num_devices)
        object.__setattr__(self, "_memo", {"pool_node0": tuple(nodes0), "pool_gpu0": tuple(gpus0)})
        if self.device_map is not None:
            m = self.device_map
            bad = [g for g in m if not (isinstance(g, int) and 0 <= g < self.num_devices)]
            if bad:
                raise SpecError(f"cluster {self.name!r}: device_map entry {bad[0]!r} is not a device "
                                f"0..{self.num_devices - 1}")
            if len(set(m)) != len(m):
                dup = next(g for g in m if m.count(g) > 1)
                raise SpecError(f"cluster {self.name!r}: device_map puts two ranks on device {dup}")

    # ------------------------------------------------------------------ pools
    @property
    def is_mixed(self) -> bool:
        """More than one pool (devices, links or both differ between them)."""
        return len(self.pools) > 1

    def _same(self, f: str):
        """A per-pool field where every pool agrees on it (always on a one-pool cluster), else one line."""
        first = getattr(self.pools[0], f)
        if len(self.pools) == 1:
            return first
        if all(getattr(p, f) == first for p in self.pools[1:]):
            return first
        def shown(v):
            return getattr(v, "name", None) or getattr(v, "kind", None) or v
        values = ", ".join(f"pool {p.name}: {shown(getattr(p, f))}" for p in self.pools)
        raise SpecError(f"cluster {self.name!r} is mixed ({values}): it has no single {f}; ask per rank "
                        f"(cluster.device_of(rank), cluster.pool_of(rank)) or per pool (cluster.pools[i].{f})")

    @property
    def nodes(self) -> int:
        """Nodes of every pool (node ids are global)."""
        pools = self.pools
        return pools[0].nodes if len(pools) == 1 else sum(p.nodes for p in pools)

    @property
    def devices_per_node(self) -> int:
        pools = self.pools
        return pools[0].devices_per_node if len(pools) == 1 else self._same("devices_per_node")

    @property
    def device(self) -> DeviceSpec:
        pools = self.pools
        return pools[0].device if len(pools) == 1 else self._same("device")

    @property
    def intra(self) -> LinkSpec:
        pools = self.pools
        return pools[0].intra if len(pools) == 1 else self._same("intra")

    @property
    def inter(self) -> LinkSpec:
        pools = self.pools
        return pools[0].inter if len(pools) == 1 else self._same("inter")

    @property
    def nics_per_node(self) -> int:
        pools = self.pools
        return pools[0].nics_per_node if len(pools) == 1 else self._same("nics_per_node")

    def pool_of_device(self, gpu: int) -> int:
        """The pool of global physical GPU ``gpu``."""
        g0 = self._memo["pool_gpu0"]
        for i in range(len(self.pools)):
            if gpu < g0[i + 1]:
                return i
        raise SpecError(f"device {gpu} is not on cluster {self.name!r} (devices 0..{self.num_devices - 1})")

    def pool_of_node(self, node: int) -> int:
        """The pool of global node ``node``."""
        n0 = self._memo["pool_node0"]
        for i in range(len(self.pools)):
            if node < n0[i + 1]:
                return i
        raise SpecError(f"node {node} is not on cluster {self.name!r} (nodes 0..{self.nodes - 1})")

    def pool_of(self, rank: int) -> int:
        """The pool a rank sits on (its physical GPU's)."""
        return self.pool_of_device(self.physical(rank))

    def device_of(self, rank: int) -> DeviceSpec:
        """The device a rank sits on."""
        return self.pools[self.pool_of(rank)].device

    def pool_gpus(self, i: int) -> range:
        """The global GPU numbers of pool ``i`` (pools in order, node-major)."""
        g0 = self._memo["pool_gpu0"]
        return range(g0[i], g0[i + 1])

    def pool_cluster(self, i: int) -> "Cluster":
        """Pool ``i`` alone, as a one-pool cluster (its links; no placement): what a stage on it is
        priced on."""
        if len(self.pools) == 1:
            return self.with_device_map(None)
        return Cluster(name=f"{self.name}/{self.pools[i].name}", pools=(self.pools[i],))

    # ------------------------------------------------------------------ placement
    @property
    def num_devices(self) -> int:
        return self._memo["pool_gpu0"][-1]        # every pool's GPUs (counted once, in __post_init__)

    @property
    def grid(self) -> DeviceGrid:
        """Where this cluster's devices sit, as the rank -> device mappings read it (a mixed
        cluster's pools must have one devices-per-node)."""
        return DeviceGrid(self.nodes, self.devices_per_node, f"cluster {self.name!r}")

    @property
    def num_ranks(self) -> int:
        """Ranks this cluster places: len(device_map), or every device without a map."""
        return self.num_devices if self.device_map is None else len(self.device_map)

    def physical(self, rank: int) -> int:
        """Global physical device index of a rank."""
        m = self.device_map
        if m is not None and 0 <= rank < len(m):
            return m[rank]
        if not 0 <= rank < self.num_ranks:
            raise SpecError(f"rank {rank} is not placed on cluster {self.name!r} "
                            f"({self.num_ranks} ranks on {self.num_devices} devices)")
        return rank if self.device_map is None else self.device_map[rank]

    def _where(self, gpu: int) -> tuple[Pool, int, int]:
        """(pool, global node, local index) of global GPU ``gpu``."""
        if len(self.pools) == 1:
            p = self.pools[0]
            return p, gpu // p.devices_per_node, gpu % p.devices_per_node
        i = self.pool_of_device(gpu)
        p, off = self.pools[i], gpu - self._memo["pool_gpu0"][i]
        return p, self._memo["pool_node0"][i] + off // p.devices_per_node, off % p.devices_per_node

    def node_of(self, rank: int) -> int:
        if len(self.pools) == 1:
            return self.physical(rank) // self.pools[0].devices_per_node
        return self._where(self.physical(rank))[1]

    def local_of(self, rank: int) -> int:
        if len(self.pools) == 1:
            return self.physical(rank) % self.pools[0].devices_per_node
        return self._where(self.physical(rank))[2]

    def nic_of(self, rank: int) -> int:
        """The NIC (0..nics_per_node-1 within its node) a rank's inter-node traffic uses."""
        p, _, local = self._where(self.physical(rank))
        return local * p.nics_per_node // p.devices_per_node

    def with_device_map(self, device_map) -> "Cluster":
        return replace(self, device_map=None if device_map is None else tuple(int(g) for g in device_map))

    def place(self, sched: "Schedule", mapping: str = "sequential", **kw) -> "Cluster":
        """This cluster with the ranks of ``sched`` placed by a named mapping (see :data:`MAPPINGS`)."""
        if mapping not in MAPPINGS:
            raise SpecError(f"unknown device mapping {mapping!r}; choose one of {', '.join(MAPPINGS)}")
        return self.with_device_map(MAPPINGS[mapping](sched, self, **kw))

    # ------------------------------------------------------------------ network
    def _intra(self, node: int, local: int, direction: str, latency: float) -> Link:
        key = ("g", node, local, direction)
        ln = self._memo.get(key)
        if ln is None:
            bw = self.pools[self.pool_of_node(node)].intra.bandwidth
            ln = self._memo[key] = Link(f"n{node}.g{local}.{direction}", bw, latency)
        return ln

    def _nic(self, node: int, nic: int, direction: str, latency: float) -> Link:
        key = ("nic", node, nic, direction)
        ln = self._memo.get(key)
        if ln is None:
            bw = self.pools[self.pool_of_node(node)].inter.bandwidth
            ln = self._memo[key] = Link(f"n{node}.nic{nic}.{direction}", bw, latency)
        return ln

    def _gateway(self, node: int, nic: int, direction: str, latency: float) -> Link:
        """NIC ``nic`` of ``node``'s port to the other pools (``between``'s bandwidth)."""
        key = ("bx", node, nic, direction)
        ln = self._memo.get(key)
        if ln is None:
            bw = self.between.bandwidth * self.pools[self.pool_of_node(node)].nic_ports
            ln = self._memo[key] = Link(f"n{node}.nic{nic}.bx.{direction}", bw, latency)
        return ln

    def _fabric_link(self, name: str, bandwidth: float) -> Link:
        ln = self._memo.get(name)
        if ln is None:
            ln = self._memo[name] = Link(name, bandwidth, 0.0)
        return ln

    def _leaf_nodes(self, leaf: int) -> int:
        """Nodes under leaf (or rail group) ``leaf``: ``nodes_per_leaf``, fewer in the last one."""
        return min(self.nodes_per_leaf, self.nodes - leaf * self.nodes_per_leaf)

    def _pod_nodes(self, pod: int) -> int:
        """Nodes in pod ``pod``: ``nodes_per_pod``, fewer in the last one."""
        return min(self.nodes_per_pod, self.nodes - pod * self.nodes_per_pod)

    def _uplinks(self, na: int, ka: int, nb: int, kb: int) -> list[Link]:
        """The fabric links between NIC ka of node na and NIC kb of node nb (none on a flat fabric,
        inside one leaf, or on one rail of one group), the spine's between two pods included."""
        pod = self.nodes_per_pod
        if pod is None or na // pod == nb // pod:
            return self._leaf_links(na, ka, nb, kb)
        pa, pb = na // pod, nb // pod
        bw = self.inter.bandwidth * self.nics_per_node / self.pod_oversubscription
        leaf = self._leaf_links(na, ka, nb, kb)
        return [*leaf[:1], self._fabric_link(f"pod{pa}.up", bw * self._pod_nodes(pa)),
                self._fabric_link(f"pod{pb}.down", bw * self._pod_nodes(pb)), *leaf[1:]]

    def _leaf_links(self, na: int, ka: int, nb: int, kb: int) -> list[Link]:
        """The leaf (fat-tree) or rail-group uplink and downlink between two NICs, if any."""
        if self.fabric == "flat":
            return []
        per = self.nodes_per_leaf
        ga, gb = na // per, nb // per
        over = self.oversubscription
        if self.fabric == "fat-tree":
            if ga == gb:
                return []
            nic = self.inter.bandwidth * self.nics_per_node
            return [self._fabric_link(f"leaf{ga}.up", nic * self._leaf_nodes(ga) / over),
                    self._fabric_link(f"leaf{gb}.down", nic * self._leaf_nodes(gb) / over)]
        if ga == gb and ka == kb:
            return []
        bw = self.inter.bandwidth
        return [self._fabric_link(f"g{ga}.rail{ka}.up", bw * self._leaf_nodes(ga) / over),
                self._fabric_link(f"g{gb}.rail{kb}.down", bw * self._leaf_nodes(gb) / over)]

    def path(self, src: int, dst: int) -> list[Link]:
        """Links a message from rank ``src`` to rank ``dst`` occupies ([] on the same device)."""
        a, b = self.physical(src), self.physical(dst)
        if a == b:
            return []
        if len(self.pools) > 1:
            return self._mixed_path(a, b)
        dpn = self.devices_per_node
        na, nb, la, lb = a // dpn, b // dpn, a % dpn, b % dpn
        if na == nb:
            return [self._intra(na, la, "out", self.intra.latency), self._intra(nb, lb, "in", 0.0)]
        ka, kb = la * self.nics_per_node // dpn, lb * self.nics_per_node // dpn
        return [self._nic(na, ka, "out", self.inter.latency), *self._uplinks(na, ka, nb, kb),
                self._nic(nb, kb, "in", 0.0)]

    def _mixed_path(self, a: int, b: int) -> list[Link]:
        """A mixed cluster's path between GPUs ``a`` and ``b`` (flat fabric, the module docstring)."""
        pa, na, la = self._where(a)
        pb, nb, lb = self._where(b)
        if na == nb:
            return [self._intra(na, la, "out", pa.intra.latency), self._intra(nb, lb, "in", 0.0)]
        ka, kb = la * pa.nics_per_node // pa.devices_per_node, lb * pb.nics_per_node // pb.devices_per_node
        if pa is pb:
            return [self._nic(na, ka, "out", pa.inter.latency), self._nic(nb, kb, "in", 0.0)]
        return [self._nic(na, ka, "out", pa.inter.latency), self._gateway(na, ka, "out", self.between.latency),
                self._gateway(nb, kb, "in", 0.0), self._nic(nb, kb, "in", 0.0)]

    def links(self) -> list[Link]:
        """Every link of the cluster (for engines that create links up front)."""
        if len(self.pools) > 1:
            out = []
            for n in range(self.nodes):
                p = self.pools[self.pool_of_node(n)]
                for i in range(p.devices_per_node):
                    out += [self._intra(n, i, "out", p.intra.latency), self._intra(n, i, "in", 0.0)]
                for k in range(p.nics_per_node):
                    out += [self._nic(n, k, "out", p.inter.latency), self._nic(n, k, "in", 0.0),
                            self._gateway(n, k, "out", self.between.latency), self._gateway(n, k, "in", 0.0)]
            return out
        out = []
        for n in range(self.nodes):
            for i in range(self.devices_per_node):
                out += [self._intra(n, i, "out", self.intra.latency), self._intra(n, i, "in", 0.0)]
            for k in range(self.nics_per_node):
                out += [self._nic(n, k, "out", self.inter.latency), self._nic(n, k, "in", 0.0)]
        groups = -(-self.nodes // self.nodes_per_leaf)
        if self.fabric != "flat" and (groups > 1 or self.fabric == "rail"):
            for g in range(groups):
                lead = g * self.nodes_per_leaf
                other = 0 if g else min(self.nodes - 1, self.nodes_per_leaf)   # a node of another leaf
                if self.fabric == "fat-tree":
                    out += self._uplinks(lead, 0, other, 0) + self._uplinks(other, 0, lead, 0)
                else:
                    for k in range(self.nics_per_node):
                        k2 = (k + 1) % self.nics_per_node
                        out += [ln for ln in self._uplinks(lead, k, lead, k2) + self._uplinks(lead, k2, lead, k)
                                if ln.name.startswith(f"g{g}.rail{k}.")]
        pod = self.nodes_per_pod
        if pod is not None and self.nodes > pod:
            for p in range(-(-self.nodes // pod)):
                lead, other = p * pod, (0 if p else pod)
                out += [ln for ln in self._uplinks(lead, 0, other, 0) + self._uplinks(other, 0, lead, 0)
                        if ln.name.startswith(f"pod{p}.")]
        seen, uniq = set(), []
        for ln in out:
            if ln.name not in seen:
                seen.add(ln.name)
                uniq.append(ln)
        return uniq

    # ------------------------------------------------------------------ I/O
    def to_dict(self) -> dict:
        if self.is_mixed:        # read back by cluster_from_dict (the pools' devices and links inline)
            return {"name": self.name, "description": self.description, "pools": [p.to_dict() for p in self.pools],
                    "between": self.between.to_dict()}
        p = self.pools[0]
        if p.name != p.device.name and self.fabric == "flat" and self.nodes_per_pod is None and \
                self.collective is None:        # a one-pool file's 'pools:' list, its pool named
            return {"name": self.name, "description": self.description, "pools": [p.to_dict()]}
        d = {"name": self.name, "description": self.description, "nodes": self.nodes,
             "devices_per_node": self.devices_per_node, "device": self.device.to_dict(),
             "intra": self.intra.to_dict(), "inter": self.inter.to_dict(), "nics_per_node": self.nics_per_node}
        if self.collective is not None:
            d["collective"] = self.collective.to_dict()
        if self.fabric != "flat":
            d.update(fabric=self.fabric, oversubscription=self.oversubscription, nodes_per_leaf=self.nodes_per_leaf)
        if self.nodes_per_pod is not None:
            d.update(nodes_per_pod=self.nodes_per_pod, pod_oversubscription=self.pod_oversubscription)
        return d

    def describe(self) -> str:
        if self.is_mixed:
            b = self.between
            return (f"{self.name}: " + " + ".join(_describe_pool(p) for p in self.pools)
                    + f"; pools joined by {b.kind} {b.bandwidth * 8 / 1e9:g} Gb/s per NIC")
        per = self.nodes_per_leaf
        fab = "" if self.fabric == "flat" else (
            f", {self.fabric}" + (f" {per}/leaf" if per != DEFAULT_NODES_PER_LEAF else "")
            + (f" {self.oversubscription:g}:1" if self.oversubscription != 1 else ""))
        if self.nodes_per_pod is not None:
            fab += f", pods of {self.nodes_per_pod} node(s) {self.pod_oversubscription:g}:1"
        return (f"{self.name}: {self.nodes} node(s) x {self.devices_per_node} {self.device.name}, "
                f"intra {self.intra.kind} {self.intra.bandwidth / 1e9:g} GB/s, "
                f"inter {self.inter.kind} {self.inter.bandwidth * 8 / 1e9:g} Gb/s x {self.nics_per_node} NIC(s)/node"
                + fab)


def _describe_pool(p: Pool) -> str:
    return (f"{p.nodes} node(s) x {p.devices_per_node} {p.device.name} (intra {p.intra.kind} "
            f"{p.intra.bandwidth / 1e9:g} GB/s, inter {p.inter.kind} {p.inter.bandwidth * 8 / 1e9:g} Gb/s x "
            f"{p.nics_per_node} NIC(s)/node)")


def with_nodes(cluster: Cluster, nodes) -> Cluster:
    """``cluster`` with ``nodes`` nodes of its kind (named ``<name>:<nodes>``); one-pool clusters
    only (a mixed cluster's pools are sized in its file)."""
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise SpecError(f"cluster {cluster.name!r}: the node count must be a whole number >= 1; got {nodes!r}")
    if cluster.is_mixed:
        raise SpecError(f"cluster {cluster.name!r} has {len(cluster.pools)} pools: size each pool's 'nodes' in a "
                        f"cluster file, not with ':NODES' or --nodes")
    base = cluster.name.rsplit(":", 1)[0]
    return replace(cluster, nodes=nodes, name=f"{base}:{nodes}", device_map=None)


def with_fabric(cluster: Cluster, fabric: str | None = None, oversubscription: float | None = None,
                nodes_per_leaf: int | None = None) -> Cluster:
    """``cluster`` with another inter-node fabric (None keeps a field; checked by :class:`Cluster`)."""
    kw = {k: v for k, v in (("fabric", fabric), ("oversubscription", oversubscription),
                            ("nodes_per_leaf", nodes_per_leaf)) if v is not None}
    if kw and cluster.is_mixed:
        raise SpecError(f"cluster {cluster.name!r} has {len(cluster.pools)} pools: its fabric is flat (each pool one "
                        f"switch, joined by 'between'); drop --fabric / --oversubscription / --nodes-per-leaf")
    check_leaf_fields(kw.get("fabric", cluster.fabric), kw, f"cluster {cluster.name} is flat: add --fabric fat-tree "
                      f"(or rail)", lambda f: f"--{f.replace('_', '-')}")
    return replace(cluster, **kw) if kw else cluster


LEAF_FIELDS = ("oversubscription", "nodes_per_leaf")


def check_leaf_fields(fabric: str, given, fix: str, name=lambda f: f"field {f!r}", where: str = "") -> None:
    """The one rule for the leaf fields (``oversubscription``, ``nodes_per_leaf``): they shape the
    leaves of a fat-tree or rail fabric, so one given on a flat fabric (which has no leaves) is
    refused, not ignored, on the command line (:func:`with_fabric`) and in a cluster file
    (:func:`cluster_from_dict`) alike. ``given``: the names given; ``name`` spells one (an option or
    a field); ``fix``: what to do, after the semicolon; ``where``: the message's start (a file)."""
    leaf = [name(f) for f in LEAF_FIELDS if f in given]
    if leaf and fabric == "flat":
        verb = "shape" if len(leaf) > 1 else "shapes"
        raise SpecError(f"{where}{' and '.join(leaf)} {verb} the leaves of a fat-tree or rail fabric; {fix}")


_FIELDS = ("name", "description", "nodes", "devices_per_node", "device", "intra", "inter", "nics_per_node",
           "collective", "fabric", "oversubscription", "nodes_per_leaf", "nodes_per_pod", "pod_oversubscription")
_MIXED_FIELDS = ("name", "description", "pools", "between")
_POOL_KEYS = ("name", *POOL_FIELDS)


def _device_value(dev, source: str, field: str) -> DeviceSpec:
    """A cluster file's device: a preset name, a YAML path or an inline mapping."""
    if isinstance(dev, str):
        try:
            return load_device(dev)
        except SpecError as e:
            raise SpecError(f"{source}: field {field!r}: {e}") from None
    if isinstance(dev, dict):
        return device_from_dict(dev, f"{source} (field {field!r})")
    raise SpecError(f"{source}: field {field!r} must be a device preset name, a YAML path or a mapping; "
                    f"got {dev!r}")


def _pool_from_dict(d: dict, source: str, prefix: str = "") -> Pool:
    """One pool's fields (``prefix``: ``pools[i].`` in a mixed cluster's file, so every bad field names
    its pool)."""
    def name(f):
        return prefix + f
    nodes = _spec.integer(d["nodes"], source, name("nodes"))
    dpn = _spec.integer(d["devices_per_node"], source, name("devices_per_node"))
    nics = _spec.integer(d.get("nics_per_node", 1), source, name("nics_per_node"))
    device = _device_value(d["device"], source, name("device"))
    if "intra" not in d and dpn > 1:
        raise SpecError(f"{source}: missing field {name('intra')!r} (the link between devices of a node)")
    intra = link_from_value(d.get("intra", "pcie4"), source, name("intra"))
    inter = link_from_value(d["inter"], source, name("inter"))
    pname = d.get("name", "") if prefix else ""      # a one-pool file's name is the cluster's
    if not isinstance(pname, str):
        raise SpecError(f"{source}: field {name('name')!r} must be a string; got {pname!r}")
    return Pool(nodes=nodes, devices_per_node=dpn, device=device, intra=intra, inter=inter, nics_per_node=nics,
                name=pname)


def _mixed_from_dict(d: dict, source: str, name: str, desc: str) -> Cluster:
    """A cluster file with ``pools:`` (a list of pool mappings) and ``between:`` (a link)."""
    fabric = [f for f in ("fabric", "oversubscription", "nodes_per_leaf", "nodes_per_pod", "pod_oversubscription",
                          "collective") if f in d]
    if fabric:
        raise SpecError(f"{source}: field {fabric[0]!r} shapes a one-pool cluster; a file with 'pools' has a flat "
                        f"fabric (each pool one switch, the pools joined by 'between'): remove it")
    pool_level = [f for f in POOL_FIELDS if f in d]
    if pool_level:
        raise SpecError(f"{source}: field {pool_level[0]!r} is a pool's: with 'pools', give it inside each pool "
                        f"(pools[i].{pool_level[0]})")
    _spec.check_fields(d, source, _MIXED_FIELDS, ("pools",))
    pools = d["pools"]
    if not isinstance(pools, list) or not pools:
        raise SpecError(f"{source}: field 'pools' must be a list of pool mappings ({{nodes, devices_per_node, "
                        f"device, intra, inter, nics_per_node, name}}); got {pools!r}")
    out = []
    for i, p in enumerate(pools):
        where = f"pools[{i}]"
        if not isinstance(p, dict):
            raise SpecError(f"{source}: field {where!r} must be a mapping with nodes, devices_per_node, device, "
                            f"intra, inter, nics_per_node (and optionally name); got {p!r}")
        _spec.check_fields(p, source, _POOL_KEYS, ("nodes", "devices_per_node", "device", "inter"),
                           prefix=where + ".")
        out.append(_pool_from_dict(p, source, where + "."))
    if len(out) > 1 and d.get("between") is None:
        raise SpecError(f"{source}: {len(out)} pools need field 'between', the link that joins nodes of two pools "
                        f"(e.g. between: ib-hdr)")
    if len(out) == 1 and d.get("between") is not None:
        raise SpecError(f"{source}: field 'between' joins pools, and this file has one; remove it")
    between = link_from_value(d["between"], source, "between") if len(out) > 1 else None
    try:
        return Cluster(name=name, pools=tuple(out), between=between, description=desc)
    except SpecError as e:
        raise SpecError(f"{source}: {e}") from None


def cluster_from_dict(d, source: str = "<dict>") -> Cluster:
    """A cluster file's mapping: one pool's fields at the top level (``nodes``, ``device``, ...), or
    ``pools:`` and ``between:`` (the module docstring)."""
    d = _spec.mapping(d, source)
    name = d.get("name", Path(source).stem)
    desc = d.get("description", "")
    if not isinstance(name, str) or not isinstance(desc, str):
        raise SpecError(f"{source}: fields 'name' and 'description' must be strings")
    if "pools" in d:
        return _mixed_from_dict(d, source, name, desc)
    _spec.check_fields(d, source, _FIELDS, ("nodes", "devices_per_node", "device", "inter"))
    pool = _pool_from_dict(d, source)
    coll = link_from_value(d["collective"], source, "collective") if d.get("collective") is not None else None
    fabric = d.get("fabric", "flat")
    if fabric not in FABRICS:
        raise SpecError(f"{source}: field 'fabric' must be one of {', '.join(FABRICS)}; got {fabric!r}")
    check_leaf_fields(fabric, [f for f in LEAF_FIELDS if d.get(f) is not None],
                      "the file's fabric is flat: add 'fabric: fat-tree' (or rail), or remove it", where=f"{source}: ")
    over = _spec.number(d.get("oversubscription", 1.0), source, "oversubscription")
    if not 1.0 <= over < float("inf"):
        raise SpecError(f"{source}: field 'oversubscription' must be a finite number >= 1; got {over!r}")
    per = _spec.integer(d.get("nodes_per_leaf", DEFAULT_NODES_PER_LEAF), source, "nodes_per_leaf")
    pod = _spec.integer(d["nodes_per_pod"], source, "nodes_per_pod") if d.get("nodes_per_pod") is not None else None
    pod_over = _spec.number(d.get("pod_oversubscription", 1.0), source, "pod_oversubscription")
    if not 1.0 <= pod_over < float("inf"):
        raise SpecError(f"{source}: field 'pod_oversubscription' must be a finite number >= 1; got {pod_over!r}")
    return Cluster(name=name, pools=(pool,), collective=coll, description=desc, fabric=fabric, oversubscription=over,
                   nodes_per_leaf=per, nodes_per_pod=pod, pod_oversubscription=pod_over)


def cluster_presets() -> list[str]:
    return _spec.presets("clusters")


def split_size(name_or_path: str | Path) -> tuple[str | Path, int | None]:
    """``"NAME:NODES"`` -> (NAME, NODES); anything else -> (it, None). A bad count is a SpecError."""
    if not isinstance(name_or_path, str) or ":" not in name_or_path or Path(name_or_path).exists():
        return name_or_path, None
    base, count = name_or_path.rsplit(":", 1)
    if not count.strip().isdigit() or int(count) < 1:
        raise SpecError(f"cluster {name_or_path!r}: the node count after ':' must be a whole number >= 1; "
                        f"got {count!r} (e.g. dgx-h100-ib:128)")
    return base, int(count)


def load_cluster(name_or_path: str | Path) -> Cluster:
    """A preset name (see :func:`cluster_presets`) or a path to a YAML file, optionally sized as
    ``NAME:NODES`` (e.g. ``dgx-h100-ib:128``)."""
    base, nodes = split_size(name_or_path)
    data, source = _spec.read_yaml(base, "clusters", "cluster")
    c = cluster_from_dict(data, source)
    return c if nodes is None else with_nodes(c, nodes)


# ---------------------------------------------------------------------- rank -> device mappings
def _fitting_grid(sched: "Schedule", where: DeviceGrid | Cluster, nodes: bool = False) -> DeviceGrid:
    """The grid a mapping lays ``sched``'s ranks over (a cluster's own), refusing one too small.
    A mixed cluster whose pools' nodes differ in size has no grid: a mapping that reads only the
    device count (``nodes`` False) gets its devices as one row; one that packs nodes is refused."""
    if isinstance(where, Cluster) and where.is_mixed and len({p.devices_per_node for p in where.pools}) > 1:
        if nodes:
            sizes = " and ".join(sorted({str(p.devices_per_node) for p in where.pools}))
            raise SpecError(f"cluster {where.name!r} has pools of {sizes} devices per node: the copies-same-node "
                            f"mapping packs equal nodes; use --device-map sequential or megatron")
        where = DeviceGrid(1, where.num_devices, f"cluster {where.name!r}")
    elif isinstance(where, Cluster):
        where = where.grid
    elif not isinstance(where, DeviceGrid):
        raise TypeError(f"a rank -> device mapping takes a DeviceGrid or a Cluster; got {type(where).__name__}")
    if sched.num_ranks > where.num_devices:
        raise SpecError(f"schedule {sched.name!r} needs {sched.num_ranks} ranks ({sched.num_devices} devices x "
                        f"{sched.replicas} replicas) but {where.name} has {where.num_devices} devices")
    return where


def sequential_map(sched: "Schedule", where: DeviceGrid | Cluster) -> tuple[int, ...]:
    """Rank r on physical device r: pipeline neighbours share a node, copies of a stage may not."""
    _fitting_grid(sched, where)
    return tuple(range(sched.num_ranks))


def stage_sharing_groups(sched: "Schedule", include_replicas: bool = False) -> list[list[int]]:
    """Ranks joined by holding copies of the same stage (connected components), each sorted, ordered
    by their smallest rank. Without ``include_replicas`` a group stays inside one pipeline replica
    (ranks r*D .. r*D+D-1); with it, the data-parallel replicas of a stage join too."""
    D, R = sched.num_devices, sched.replicas
    parent = list(range(sched.num_ranks))

    def find(x):
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for s in range(sched.num_stages):
        group = sched.stage_group(s)
        if include_replicas:
            parts = [group]
        else:
            parts = [[g for g in group if g // D == r] for r in range(R)]
        for part in parts:
            for g in part[1:]:
                parent[find(g)] = find(part[0])
    comps: dict[int, list[int]] = {}
    for r in range(sched.num_ranks):
        comps.setdefault(find(r), []).append(r)
    return sorted(comps.values(), key=lambda g: g[0])


def megatron_map(sched: "Schedule", where: DeviceGrid | Cluster) -> tuple[int, ...]:
    """Megatron-LM's rank order: tensor-parallel ranks fastest, then context-parallel ones (both
    inside one simulated rank: see :func:`tensor_parallel_groups`), then the data-parallel replicas,
    then the pipeline stages ([TP, CP, DP, PP]; :func:`sequential_map` is Llama 3's [TP, CP, PP, DP]).
    Rank (replica r, pipeline device d) sits on slot d * R + r: the replicas of a stage are
    neighbours (their gradient all-reduce stays as local as it can), a pipeline spans the cluster."""
    _fitting_grid(sched, where)
    D, R = sched.num_devices, sched.replicas
    return tuple((r % D) * R + r // D for r in range(sched.num_ranks))


def tensor_parallel_groups(cluster: Cluster, tp: int, cp: int = 1) -> Cluster:
    """The cluster as the simulator sees it when every rank is a group of ``tp`` x ``cp``
    consecutive GPUs (a pipeline device: T tensor-parallel GPUs fastest, then C context-parallel
    ones; the GPUs of a group run in lockstep, so one rank stands for the group).

    A group of g = t c <= devices-per-node GPUs is one device of a node holding dpn / g of them; its
    g GPUs' ports move their 1/g shares of a message side by side, so the group's port is g ports
    wide (intra bandwidth x g), and the node's NICs are shared out among its groups (each group
    gets nics / groups of them, as one NIC of that many times the bandwidth; with fewer NICs than
    groups, the groups share them as their GPUs would). A group of g > dpn GPUs spans g / dpn
    whole nodes: one device per (merged) node with all their NICs. Messages between groups are
    whole tensors on these wider links. Refuses a g that does not divide a node (or is no multiple
    of it) with one line."""
    g = tp * cp
    if g == 1:
        return cluster
    if cluster.is_mixed:
        return _mixed_groups(cluster, tp, cp)
    dpn, name = cluster.devices_per_node, cluster.name
    what = f"--tp {tp}" if cp == 1 else f"--tp {tp} x --cp {cp} = {g}"
    if g <= dpn:
        if dpn % g:
            raise SpecError(f"{what} does not divide the {dpn} devices per node of cluster {name}; pick a "
                            f"{'--tp' if cp == 1 else '--tp x --cp'} that divides {dpn} (or a multiple of it)")
        groups = dpn // g
        nics = cluster.nics_per_node
        nics_g, inter_bw = (groups, cluster.inter.bandwidth * nics / groups) if nics >= groups else \
            (nics, cluster.inter.bandwidth)
        coll = cluster.collective
        return replace(cluster, devices_per_node=groups, nics_per_node=nics_g, device_map=None,
                       intra=replace(cluster.intra, bandwidth=cluster.intra.bandwidth * g),
                       inter=replace(cluster.inter, bandwidth=inter_bw),
                       collective=None if coll is None else replace(coll, bandwidth=coll.bandwidth * g))
    if g % dpn or cluster.nodes % (g // dpn):
        raise SpecError(f"{what} spans nodes of {dpn} devices: it must be a multiple of {dpn} that divides the "
                        f"cluster's {cluster.num_devices} devices into whole groups")
    span = g // dpn
    return replace(cluster, nodes=cluster.nodes // span, devices_per_node=1, nics_per_node=1, device_map=None,
                   inter=replace(cluster.inter, bandwidth=cluster.inter.bandwidth * cluster.nics_per_node * span),
                   nodes_per_leaf=max(1, cluster.nodes_per_leaf // span), collective=None,
                   nodes_per_pod=None if cluster.nodes_per_pod is None else max(1, cluster.nodes_per_pod // span))


def _mixed_groups(cluster: Cluster, tp: int, cp: int) -> Cluster:
    """:func:`tensor_parallel_groups` of a mixed cluster: each pool's groups as one pool's (its own
    links), so a group never spans two pools (two kinds): a group that would is refused in one line
    (its size must divide each pool's devices per node, or be a multiple that divides its nodes)."""
    g = tp * cp
    what = f"--tp {tp}" if cp == 1 else f"--tp {tp} x --cp {cp} = {g}"
    pools = []
    for i, p in enumerate(cluster.pools):
        dpn = p.devices_per_node
        if (g <= dpn and dpn % g) or (g > dpn and (g % dpn or p.nodes % (g // dpn))):
            raise SpecError(f"{what} on cluster {cluster.name}: a group of {g} GPUs would span pool {i} ({p.name}, "
                            f"{p.nodes} x {dpn}) and the next: a tensor-parallel group never spans two device kinds; "
                            f"pick a size that divides {dpn} (or whole nodes of pool {i})")
        q = tensor_parallel_groups(Cluster(name=f"{cluster.name}/{p.name}", pools=(p,)), tp, cp).pools[0]
        pools.append(replace(q, nic_ports=p.nic_ports * q.inter.bandwidth / p.inter.bandwidth))
    return Cluster(name=cluster.name, pools=tuple(pools), between=cluster.between, description=cluster.description)


def map_copies_same_node(sched: "Schedule", where: DeviceGrid | Cluster, *,
                         include_replicas: bool = False) -> tuple[int, ...]:
    """BitPipe's mapping: devices holding copies of one stage share a node.

    Groups of :func:`stage_sharing_groups` (for Chimera / BitPipe: devices d and D-1-d) are packed
    first-fit into nodes in order of their smallest rank; a group larger than a node's free slots
    spills over in rank order. For single-copy schedules every group is one rank and the result is
    the sequential mapping.
    """
    grid = _fitting_grid(sched, where, nodes=True)
    dpn = grid.devices_per_node
    slots: list[list[int]] = [[] for _ in range(grid.nodes)]
    for g in stage_sharing_groups(sched, include_replicas):
        target = next((n for n in range(grid.nodes) if dpn - len(slots[n]) >= len(g)), None)
        for r in g:
            n = target if target is not None else next(n for n in range(grid.nodes) if len(slots[n]) < dpn)
            slots[n].append(r)
    dm = [0] * sched.num_ranks
    for n, ranks in enumerate(slots):
        for i, r in enumerate(ranks):
            dm[r] = n * dpn + i
    return tuple(dm)


def pool_devices(pool_gpus: Sequence[Sequence[int]], kinds: Sequence[int], replicas: int) -> list[tuple[int, ...]]:
    """The devices of each stage placed by pool, as the type-aware planner places them
    (:func:`planner.hetero.aware_candidates`): stage s on pool ``kinds[s]`` takes the next
    ``replicas`` devices of that pool (``pool_gpus[k]``: its devices, in order); a pool with too
    few is refused in one line."""
    nxt = [0] * len(pool_gpus)
    out = []
    for k in kinds:
        gpus = pool_gpus[k]
        if nxt[k] + replicas > len(gpus):
            raise SpecError(f"pool {k} has {len(gpus)} devices; stages {[i for i, x in enumerate(kinds) if x == k]} "
                            f"on it need {replicas * sum(1 for x in kinds if x == k)} ({replicas} each)")
        out.append(tuple(gpus[nxt[k] + j] for j in range(replicas)))
        nxt[k] += replicas
    return out


def spread_kinds(stages: int, pools: int) -> tuple[int, ...]:
    """Stages spread over pools in order, an equal share each: stage s on pool ``s * P // S``
    (S = 4 stages on P = 2 pools: 0, 0, 1, 1; S = 3: 0, 0, 1)."""
    return tuple(s * pools // stages for s in range(stages))


def by_pool_map(sched: "Schedule", where: DeviceGrid | Cluster) -> tuple[int, ...]:
    """Pipeline device d of D on pool ``d * P // D`` (:func:`spread_kinds`: the pools in order, an
    equal share of the stages each, so a run spans every pool), its R replicas on the next R devices
    of that pool (:func:`pool_devices`, the type-aware planner's placement); rank r = replica
    r // D of device r % D. On one pool (or a device grid): device d's replicas on d R .. d R + R - 1
    (:func:`megatron_map`'s order)."""
    _fitting_grid(sched, where)
    D, R = sched.num_devices, sched.replicas
    gpus = ([list(where.pool_gpus(i)) for i in range(len(where.pools))] if isinstance(where, Cluster)
            else [list(range(where.num_devices))])
    devs = pool_devices(gpus, spread_kinds(D, len(gpus)), R)
    return tuple(devs[r % D][r // D] for r in range(sched.num_ranks))


MAPPINGS = {"sequential": sequential_map, "copies-same-node": map_copies_same_node, "megatron": megatron_map,
            "by-pool": by_pool_map}
