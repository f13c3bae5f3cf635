"""Cluster helpers of the planner's experiments.

Every cluster name is a cost_models preset (``v100-4x8-25gbe`` and ``a100-8x8-ib``, which the
planner's experiments use, are presets too), so every command resolves the same names:
:func:`resolve_cluster` is :func:`cost_models.load_cluster` (a preset or YAML path, optionally
sized ``NAME:NODES``), kept for the planner's callers.

* :func:`gpus_on_servers`: the first n GPUs of a cluster's server type as a cluster of their own
  (n <= devices per server: one server with n GPUs; otherwise n / devices-per-server servers).
"""
from __future__ import annotations

from dataclasses import replace

from cost_models import Cluster, load_cluster


def resolve_cluster(name_or_path) -> Cluster:
    """A cluster (returned as is), or a cost_models preset / YAML path, optionally sized ``NAME:NODES``."""
    if isinstance(name_or_path, Cluster):
        return name_or_path
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
