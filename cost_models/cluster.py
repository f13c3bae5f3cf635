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

Sizes: ``load_cluster("dgx-h100-ib:128")`` (or :func:`with_nodes`) is the preset with 128 nodes.

Units: bandwidth bytes/s per direction, latency seconds.
"""
from __future__ import annotations

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


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """``nodes`` x ``devices_per_node`` devices; see the module docstring for the link model.

    ``collective``: an optional fitted (latency, bandwidth) of a ring all-reduce inside a node
    (calibration profiles set it); :func:`cost_models.comm.allreduce_time` then uses it instead of
    the intra links.
    """

    name: str
    nodes: int
    devices_per_node: int
    device: DeviceSpec
    intra: LinkSpec
    inter: LinkSpec
    nics_per_node: int = 1
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

    def __post_init__(self):
        for f in ("nodes", "devices_per_node", "nics_per_node", "nodes_per_leaf", "nodes_per_pod"):
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
        if self.device_map is not None:
            m = self.device_map
            bad = [g for g in m if not (isinstance(g, int) and 0 <= g < self.num_devices)]
            if bad:
                raise SpecError(f"cluster {self.name!r}: device_map entry {bad[0]!r} is not a device "
                                f"0..{self.num_devices - 1}")
            if len(set(m)) != len(m):
                dup = next(g for g in m if m.count(g) > 1)
                raise SpecError(f"cluster {self.name!r}: device_map puts two ranks on device {dup}")

    # ------------------------------------------------------------------ placement
    @property
    def num_devices(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def grid(self) -> DeviceGrid:
        """Where this cluster's devices sit, as the rank -> device mappings read it."""
        return DeviceGrid(self.nodes, self.devices_per_node, f"cluster {self.name!r}")

    @property
    def num_ranks(self) -> int:
        """Ranks this cluster places: len(device_map), or every device without a map."""
        return self.num_devices if self.device_map is None else len(self.device_map)

    def physical(self, rank: int) -> int:
        """Global physical device index of a rank."""
        if not 0 <= rank < self.num_ranks:
            raise SpecError(f"rank {rank} is not placed on cluster {self.name!r} "
                            f"({self.num_ranks} ranks on {self.num_devices} devices)")
        return rank if self.device_map is None else self.device_map[rank]

    def node_of(self, rank: int) -> int:
        return self.physical(rank) // self.devices_per_node

    def local_of(self, rank: int) -> int:
        return self.physical(rank) % self.devices_per_node

    def nic_of(self, rank: int) -> int:
        """The NIC (0..nics_per_node-1 within its node) a rank's inter-node traffic uses."""
        return self.local_of(rank) * self.nics_per_node // self.devices_per_node

    def with_device_map(self, device_map) -> "Cluster":
        return replace(self, device_map=None if device_map is None else tuple(int(g) for g in device_map))

    def place(self, sched: "Schedule", mapping: str = "sequential", **kw) -> "Cluster":
        """This cluster with the ranks of ``sched`` placed by a named mapping (see :data:`MAPPINGS`)."""
        if mapping not in MAPPINGS:
            raise SpecError(f"unknown device mapping {mapping!r}; choose one of {', '.join(MAPPINGS)}")
        return self.with_device_map(MAPPINGS[mapping](sched, self.grid, **kw))

    # ------------------------------------------------------------------ network
    def _intra(self, node: int, local: int, direction: str, latency: float) -> Link:
        key = ("g", node, local, direction)
        ln = self._memo.get(key)
        if ln is None:
            ln = self._memo[key] = Link(f"n{node}.g{local}.{direction}", self.intra.bandwidth, latency)
        return ln

    def _nic(self, node: int, nic: int, direction: str, latency: float) -> Link:
        key = ("nic", node, nic, direction)
        ln = self._memo.get(key)
        if ln is None:
            ln = self._memo[key] = Link(f"n{node}.nic{nic}.{direction}", self.inter.bandwidth, latency)
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
        dpn = self.devices_per_node
        na, nb, la, lb = a // dpn, b // dpn, a % dpn, b % dpn
        if na == nb:
            return [self._intra(na, la, "out", self.intra.latency), self._intra(nb, lb, "in", 0.0)]
        ka, kb = la * self.nics_per_node // dpn, lb * self.nics_per_node // dpn
        return [self._nic(na, ka, "out", self.inter.latency), *self._uplinks(na, ka, nb, kb),
                self._nic(nb, kb, "in", 0.0)]

    def links(self) -> list[Link]:
        """Every link of the cluster (for engines that create links up front)."""
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


def with_nodes(cluster: Cluster, nodes) -> Cluster:
    """``cluster`` with ``nodes`` nodes of its kind (named ``<name>:<nodes>``)."""
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise SpecError(f"cluster {cluster.name!r}: the node count must be a whole number >= 1; got {nodes!r}")
    base = cluster.name.rsplit(":", 1)[0]
    return replace(cluster, nodes=nodes, name=f"{base}:{nodes}", device_map=None)


def with_fabric(cluster: Cluster, fabric: str | None = None, oversubscription: float | None = None,
                nodes_per_leaf: int | None = None) -> Cluster:
    """``cluster`` with another inter-node fabric (None keeps a field; checked by :class:`Cluster`)."""
    kw = {k: v for k, v in (("fabric", fabric), ("oversubscription", oversubscription),
                            ("nodes_per_leaf", nodes_per_leaf)) if v is not None}
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


def cluster_from_dict(d, source: str = "<dict>") -> Cluster:
    d = _spec.mapping(d, source)
    _spec.check_fields(d, source, _FIELDS, ("nodes", "devices_per_node", "device", "inter"))
    nodes = _spec.integer(d["nodes"], source, "nodes")
    dpn = _spec.integer(d["devices_per_node"], source, "devices_per_node")
    nics = _spec.integer(d.get("nics_per_node", 1), source, "nics_per_node")
    dev = d["device"]
    if isinstance(dev, str):
        try:
            device = load_device(dev)
        except SpecError as e:
            raise SpecError(f"{source}: field 'device': {e}") from None
    elif isinstance(dev, dict):
        device = device_from_dict(dev, f"{source} (field 'device')")
    else:
        raise SpecError(f"{source}: field 'device' must be a device preset name, a YAML path or a mapping; "
                        f"got {dev!r}")
    if "intra" not in d and dpn > 1:
        raise SpecError(f"{source}: missing field 'intra' (the link between devices of a node)")
    intra = link_from_value(d.get("intra", "pcie4"), source, "intra")
    inter = link_from_value(d["inter"], source, "inter")
    coll = link_from_value(d["collective"], source, "collective") if d.get("collective") is not None else None
    name = d.get("name", Path(source).stem)
    desc = d.get("description", "")
    if not isinstance(name, str) or not isinstance(desc, str):
        raise SpecError(f"{source}: fields 'name' and 'description' must be strings")
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
    return Cluster(name=name, nodes=nodes, devices_per_node=dpn, device=device, intra=intra, inter=inter,
                   nics_per_node=nics, collective=coll, description=desc, fabric=fabric, oversubscription=over,
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
def _fitting_grid(sched: "Schedule", where: DeviceGrid | Cluster) -> DeviceGrid:
    """The grid a mapping lays ``sched``'s ranks over (a cluster's own), refusing one too small."""
    if isinstance(where, Cluster):
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


def map_copies_same_node(sched: "Schedule", where: DeviceGrid | Cluster, *,
                         include_replicas: bool = False) -> tuple[int, ...]:
    """BitPipe's mapping: devices holding copies of one stage share a node.

    Groups of :func:`stage_sharing_groups` (for Chimera / BitPipe: devices d and D-1-d) are packed
    first-fit into nodes in order of their smallest rank; a group larger than a node's free slots
    spills over in rank order. For single-copy schedules every group is one rank and the result is
    the sequential mapping.
    """
    grid = _fitting_grid(sched, where)
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


MAPPINGS = {"sequential": sequential_map, "copies-same-node": map_copies_same_node, "megatron": megatron_map}
