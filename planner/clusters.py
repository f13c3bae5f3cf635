"""Clusters the planner's experiments need that cost_models has no preset for.

* ``v100-4x8-25gbe``: four servers of 8 V100 32GB (NVLink 2) with one 25 Gb/s Ethernet NIC each,
  the 32-GPU end of DAPPLE's scaling experiment (the ``v100-2x8-25gbe`` preset, twice as many servers);
* ``a100-8x8-ib``: eight DGX A100 nodes (64 GPUs, 8 HDR InfiniBand NICs per node), the size of the
  planner's speed benchmark;
* :func:`gpus_on_servers`: the first n GPUs of a cluster's server type as a cluster of their own
  (n <= devices per server: one server with n GPUs; otherwise n / devices-per-server servers).

:func:`resolve_cluster` takes one of these names, a cost_models preset or a YAML path.
"""
from __future__ import annotations

from dataclasses import replace

from cost_models import Cluster, load_cluster, with_nodes
from cost_models.cluster import split_size


def _v100_4x8() -> Cluster:
    c = load_cluster("v100-2x8-25gbe")
    return replace(c, name="v100-4x8-25gbe", nodes=4,
                   description="4 x 8 V100 32GB (NVLink 2), 25 Gb/s Ethernet between servers")


def _a100_8x8() -> Cluster:
    c = load_cluster("dgx-a100-4x8-ib")
    return replace(c, name="a100-8x8-ib", nodes=8,
                   description="8 x DGX A100 (8 x A100 80GB, NVLink 3), 8 x InfiniBand HDR 200 Gb/s per node")


CLUSTERS = {"v100-4x8-25gbe": _v100_4x8, "a100-8x8-ib": _a100_8x8}


def resolve_cluster(name_or_path) -> Cluster:
    """A planner cluster name or a cost_models preset / YAML path, optionally sized ``NAME:NODES``."""
    if isinstance(name_or_path, Cluster):
        return name_or_path
    base, nodes = split_size(name_or_path)
    if base in CLUSTERS:
        c = CLUSTERS[base]()
        return c if nodes is None else with_nodes(c, nodes)
    return load_cluster(name_or_path)


def gpus_on_servers(base: Cluster, n: int) -> Cluster:
    """n GPUs of ``base``'s kind: one server of n GPUs, or n / devices_per_node full servers."""
    dpn = base.devices_per_node
    if n <= dpn:
        return replace(base, name=f"{base.name}@{n}", nodes=1, devices_per_node=n, device_map=None,
                       nics_per_node=min(base.nics_per_node, n))
    if n % dpn:
        raise ValueError(f"{n} GPUs are not whole servers of {dpn}")
    return replace(base, name=f"{base.name}@{n}", nodes=n // dpn, device_map=None)
