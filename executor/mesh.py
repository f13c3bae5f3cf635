"""The processes of a run as a T x C x D x R mesh, and where each one sits.

A lowered schedule has D x R *pipeline ranks* p = r * D + d (:mod:`schedules.ir`); with tensor
parallelism each is a group of T processes, TP ranks t = 0..T-1, that split every layer
(:mod:`executor.tensor_parallel`); with context parallelism each pipeline rank is C such groups,
CP ranks c = 0..C-1, that split the sequence (:mod:`executor.context_parallel`). A process's rank
in the default process group is ``(p * C + c) * T + t`` (:class:`Mesh`: TP fastest, then CP, then
the pipeline ranks, Llama 3's order [TP, CP, PP, DP]), whatever device it runs on; process (c, t)
of pipeline rank p talks to process (c, t) of its pipeline peers (P2P), so every (c, t) is one
whole pipeline of shards of one part of the sequence; the T of a group meet in their TP
collectives, the C of a pipeline rank in the attention's K/V exchange, and the data-parallel
gradient sum of a stage spans its R replicas x C CP ranks (the same TP rank of each:
:meth:`Mesh.stage_group`).

*Expert parallelism* (:meth:`Mesh.expert_fold`, Megatron's parallel folding as
:mod:`cost_models.moe` states it for the simulator): the T x C x R processes holding one stage (its
TP ranks of each CP rank of each data-parallel replica, in process-group rank order: TP fastest,
then CP, then the replicas) are folded into ETP x EP x EDP, ETP innermost: member i = (k EP + e)
ETP + u of the stage's processes is EP rank e of the EP group (k, u) and EDP rank k of the EDP
group (e, u). An EP group exchanges tokens (:mod:`executor.expert_parallel`); an EDP group holds
the same experts and sums their gradients. EP folds over existing processes: the world stays T x
C x D x R. With C > 1 the CP ranks fold in as the data-parallel replicas do: Megatron-LM's
``initialize_model_parallel`` (megatron/core/parallel_state.py) builds the expert ranks with a
second ``RankGenerator(tp=ETP, ep=EP, dp=EDP, pp=PP, cp=1, order=order)`` beside the attention's
``RankGenerator(tp=T, ep=1, dp=R, pp=PP, cp=C)``, EDP = world / (ETP x EP x PP), with the same
order ('tp-cp-ep-dp-pp'): the expert side's ``dp`` axis is the attention side's C x R, so an EP
group runs over consecutive CP ranks first. Routing is per token: each CP rank routes its s/C
tokens and sends them to the EP group's holders like a replica's.

*Placement* (:func:`placement`): the process on global device ``node * per_node + local`` runs the
mesh rank whose pipeline rank the device map puts on device slot ``device // (T x C)``, whose CP
rank is ``device // T % C`` and whose TP rank is ``device % T`` -- a TP group is T consecutive
devices of one node, as in the simulator (:func:`cost_models.cluster.tensor_parallel_groups`), and
a pipeline rank's T x C processes are consecutive devices of one node. The device map is a mapping name of
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
    """``ranks`` pipeline ranks (D x R) of ``cp`` x ``tp`` processes each; see the module docstring."""

    tp: int
    ranks: int
    cp: int = 1

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.ranks

    def rank(self, pipeline_rank: int, tp_rank: int = 0, cp_rank: int = 0) -> int:
        return (pipeline_rank * self.cp + cp_rank) * self.tp + tp_rank

    def coords(self, rank: int) -> tuple[int, int]:
        """(pipeline rank, TP rank) of a process-group rank."""
        return rank // (self.tp * self.cp), rank % self.tp

    def cp_rank(self, rank: int) -> int:
        """The CP rank of a process-group rank."""
        return rank // self.tp % self.cp

    def lift(self, pipeline_ranks, tp_rank: int, cp_rank: int = 0) -> tuple[int, ...]:
        """The process-group ranks of process (``cp_rank``, ``tp_rank``) of ``pipeline_ranks``."""
        return tuple(self.rank(p, tp_rank, cp_rank) for p in pipeline_ranks)

    def tp_group(self, pipeline_rank: int, cp_rank: int = 0) -> tuple[int, ...]:
        return tuple(self.rank(pipeline_rank, t, cp_rank) for t in range(self.tp))

    def cp_group(self, pipeline_rank: int, tp_rank: int = 0) -> tuple[int, ...]:
        """The C processes of ``pipeline_rank`` with TP rank ``tp_rank``, in CP-rank order."""
        return tuple(self.rank(pipeline_rank, tp_rank, c) for c in range(self.cp))

    def stage_group(self, pipeline_ranks, tp_rank: int) -> tuple[int, ...]:
        """The processes that hold the same weights as TP rank ``tp_rank`` of ``pipeline_ranks``
        (a stage's group: its copies and replicas) and sum their gradients: every CP rank of each."""
        return tuple(self.rank(p, tp_rank, c) for p in pipeline_ranks for c in range(self.cp))

    def expert_fold(self, pipeline_ranks, ep: int, etp: int = 1) -> tuple[tuple[tuple[int, ...], ...],
                                                                         tuple[tuple[int, ...], ...]]:
        """(EP groups, EDP groups) of the stage held by ``pipeline_ranks`` (its replicas, in replica
        order): its T x C x R processes in process-group rank order (TP fastest, then CP, then the
        replicas) folded into ETP x EP x EDP, ETP innermost (module docstring). Each group lists
        process-group ranks in EP (EDP) rank order."""
        procs = [self.rank(p, t, c) for p in pipeline_ranks for c in range(self.cp) for t in range(self.tp)]
        if len(procs) % (ep * etp):
            raise ValueError(f"EP {ep} x ETP {etp} must fold onto the stage's T x C x R = {len(procs)} processes")
        edp = len(procs) // (ep * etp)
        eps = tuple(tuple(procs[(k * ep + e) * etp + u] for e in range(ep)) for k in range(edp) for u in range(etp))
        edps = tuple(tuple(procs[(k * ep + e) * etp + u] for k in range(edp)) for e in range(ep) for u in range(etp))
        return eps, edps

    def expert_tp_groups(self, pipeline_ranks, ep: int, etp: int) -> tuple[tuple[int, ...], ...]:
        """The ETP groups of the stage held by ``pipeline_ranks`` (:meth:`expert_fold`'s fold): ETP
        consecutive processes of its T x C x R (TP fastest, then CP), member u of group (k, e) being
        process (k EP + e) ETP + u."""
        self.expert_fold(pipeline_ranks, ep, etp)       # its check
        procs = [self.rank(p, t, c) for p in pipeline_ranks for c in range(self.cp) for t in range(self.tp)]
        return tuple(tuple(procs[i:i + etp]) for i in range(0, len(procs), etp))


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
              per_node: int, cp: int = 1) -> tuple[int, int]:
    """(process-group rank, global device) of the process at (``node``, ``local``) of ``nodes`` x
    ``per_node`` processes (see the module docstring)."""
    if per_node % tp:
        raise ValueError(f"--tp {tp} does not divide the {per_node} processes per node; a tensor-parallel group "
                         f"is {tp} processes of one node")
    if per_node % (tp * cp):
        raise ValueError(f"--tp {tp} x --cp {cp} = {tp * cp} does not divide the {per_node} processes per node; a "
                         f"pipeline rank's tensor- and context-parallel processes are {tp * cp} processes of one node")
    device = node * per_node + local
    slot, within = divmod(device, tp * cp)
    c, t = divmod(within, tp)
    dm = device_map_for(device_map, sched, nodes, per_node // (tp * cp))
    if slot not in dm:
        raise ValueError(f"device {device} (node {node}, local rank {local}) holds no rank of device map "
                         f"{short_list(dm)}")
    return Mesh(tp, sched.num_ranks, cp).rank(dm.index(slot), t, c), device
