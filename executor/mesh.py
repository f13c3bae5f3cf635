"""The processes of a run as a T x D x R mesh, and where each one sits.

A lowered schedule has D x R *pipeline ranks* p = r * D + d (:mod:`schedules.ir`); with tensor
parallelism each is a group of T processes, TP ranks t = 0..T-1, that split every layer
(:mod:`executor.tensor_parallel`). A process's rank in the default process group is
``p * T + t`` (:class:`Mesh`), whatever device it runs on; TP rank t of pipeline rank p talks to
TP rank t of its pipeline peers (P2P, data-parallel all-reduce), so every t is one whole pipeline
of shards and the T of them meet only in their TP group's collectives.

*Placement* (:func:`placement`): the process on global device ``node * per_node + local`` runs the
mesh rank whose pipeline rank the device map puts on device slot ``device // T`` and whose TP rank
is ``device % T`` -- a TP group is T consecutive devices of one node, as in the simulator
(:func:`cost_models.cluster.tensor_parallel_groups`). The device map is a mapping name of
:data:`cost_models.cluster.MAPPINGS` laid over the slots (Megatron's order by default with T > 1:
TP fastest, then the data-parallel replicas, then the pipeline stages) or an explicit map. Under
torchrun and for spawned local ranks (one node) this is the same function.
"""
from __future__ import annotations

from dataclasses import dataclass

from schedules import Schedule
from cost_models.files import short_list


@dataclass(frozen=True)
class Mesh:
    """``ranks`` pipeline ranks (D x R) of ``tp`` processes each; see the module docstring."""

    tp: int
    ranks: int

    @property
    def world(self) -> int:
        return self.tp * self.ranks

    def rank(self, pipeline_rank: int, tp_rank: int = 0) -> int:
        return pipeline_rank * self.tp + tp_rank

    def coords(self, rank: int) -> tuple[int, int]:
        """(pipeline rank, TP rank) of a process-group rank."""
        return divmod(rank, self.tp)

    def lift(self, pipeline_ranks, tp_rank: int) -> tuple[int, ...]:
        """The process-group ranks of TP rank ``tp_rank`` of ``pipeline_ranks``."""
        return tuple(self.rank(p, tp_rank) for p in pipeline_ranks)

    def tp_group(self, pipeline_rank: int) -> tuple[int, ...]:
        return tuple(self.rank(pipeline_rank, t) for t in range(self.tp))


def device_map_for(device_map, sched: Schedule, nodes: int, per_node: int) -> tuple[int, ...]:
    """Pipeline rank -> global device (slot) on ``nodes`` x ``per_node`` of them: ``device_map`` is a
    mapping name (:data:`cost_models.cluster.MAPPINGS`, laid over that
    :class:`~cost_models.cluster.DeviceGrid`) or an explicit map (a plan's)."""
    from cost_models.cluster import MAPPINGS, DeviceGrid
    n = sched.num_ranks
    grid = DeviceGrid(nodes, per_node, f"torchrun {nodes}x{per_node}")
    if isinstance(device_map, str):
        if device_map not in MAPPINGS:
            raise ValueError(f"unknown device map {device_map!r}; choose one of {', '.join(MAPPINGS)}")
        dm = tuple(MAPPINGS[device_map](sched, grid))
    else:
        dm = tuple(int(d) for d in device_map)
    if len(dm) != n or sorted(dm) != sorted(set(dm)) or any(not 0 <= d < grid.num_devices for d in dm):
        raise ValueError(f"device map {short_list(dm)} must give each of the {n} ranks its own device among the "
                         f"{nodes} x {per_node} devices torchrun started")
    return dm


def placement(device_map, sched: Schedule, tp: int, node: int, local: int, nodes: int,
              per_node: int) -> tuple[int, int]:
    """(process-group rank, global device) of the process at (``node``, ``local``) of ``nodes`` x
    ``per_node`` processes (see the module docstring)."""
    if per_node % tp:
        raise ValueError(f"--tp {tp} does not divide the {per_node} processes per node; a tensor-parallel group "
                         f"is {tp} processes of one node")
    device = node * per_node + local
    slot, t = divmod(device, tp)
    dm = device_map_for(device_map, sched, nodes, per_node // tp)
    if slot not in dm:
        raise ValueError(f"device {device} (node {node}, local rank {local}) holds no rank of device map "
                         f"{short_list(dm)}")
    return Mesh(tp, sched.num_ranks).rank(dm.index(slot), t), device
