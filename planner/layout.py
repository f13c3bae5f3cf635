"""The whole-layout planner: T x C x D x R, schedule family, micro-batch, recompute, ZeRO 0 to 3 (ZeRO-3
as FSDP re-gathering per micro-batch, :func:`zero_record`) and sequence parallelism for a
transformer on a cluster, and for a mixture of experts its expert-parallel EP
(and ETP) and the forward/backward overlap, the fastest that fits each GPU's memory.

Every candidate is a :class:`cost_models.job.Job` (uniform layouts: R replicas of a D-stage
pipeline, each stage a tensor-parallel group of T GPUs, T x D x R = the GPUs used); it is costed
by :func:`cost_models.bind.bind` and simulated by the SimPy engine (one replica standing for all),
exactly as ``pipetwin simulate`` would. The search is exact over its space (:class:`LayoutSpace`),
by bounds that never exceed the truth:

* time: an iteration is at least the mean compute of a pipeline device, N x (F + B + W of the
  whole model at T) / D, with the mean of the optimizer steps each device runs after its last op
  (a mixture of experts' EDP all-reduce among them), and at least one micro-batch's forward and
  backward through every layer; both come from the cost model's per-layer costs
  (:meth:`cost_models.TransformerCostModel.layer_costs`), without building a schedule. Refined on the
  built schedule: each device's compute ops, after the forwards of the stages before its first,
  then its optimizer step; and, before a candidate is simulated, the built schedule timed with its
  compute costs and no communication (its bubbles: :meth:`_Bounds.critical_path`);
* memory: a GPU needs at least its mean static bytes (weights, gradients, optimizer state as its
  ZeRO stage shards them; ZeRO-3's gathered weights where it keeps them through the step),
  params x bytes / D, plus the mean over the devices of one micro-batch's activations of
  the stages each holds (a device runs the forwards of micro-batch 0 through all its stages before
  any of their backwards, which need the whole pipeline's forward), the whole model's / D, plus
  the transients every verdict counts; above the usable memory no schedule of that layout fits.

Context parallelism (C GPUs split each sequence, :func:`cost_models.transformer.context_parallel_layers`):
a pipeline device is T x C GPUs placed whole (T x C divides a node or is a multiple of it that
divides the nodes), so the GPUs used are T x C x D x R; by default C is 1 and every power of two
that leaves each GPU at least :data:`MIN_CP_TOKENS` (8,192) tokens (:func:`context_parallel_sizes`:
none at 8,192 tokens, so a short-sequence search is the same as before; 2 .. 16 at 131,072), each
candidate's K/V exchange ``cp_comm``. The bounds read the cost model's per-layer costs, the
exchange's exposed time and the gradient reduction over the CP group included.

Candidates are taken in order of their time bound; one whose memory bound is over is skipped,
the others are bound (schedule built, costs) and judged by the ledger
(:func:`cost_models.memory.memory_report`, the reserve of ``simulate``); those that fit are
simulated; the search stops when the next bound is no better than the K-th best simulated time.
So the best K equal those of simulating every candidate (:func:`brute_force`, the tests' reference).

Mixtures of experts (:mod:`cost_models.moe`): EP takes every divisor of the model's experts (or the
values asked) that :func:`cost_models.moe.check_expert_parallel` accepts on the layout's T x R
GPUs (the rule is its own: the search asks it), ETP the values asked (default 1). With EP > 1 a
candidate is placed in Megatron's order [TP, DP, PP] unless device maps are asked: an expert group
is consecutive GPUs of a stage, as its all-to-all is costed. ``overlap_fb`` takes False and True on
the schedules that place overlapped F and B pairs (:data:`PAIRED_FAMILIES`; every family with
``overlap_schedules``), where EP > 1 gives it all-to-alls to hide. The bounds follow: where a
candidate's all-to-alls may be overlapped, the ops that may pair take at least
max(all-to-alls, compute + SM share x all-to-alls) (:func:`overlapped`: the all-to-alls run one after
the other, and the compute under them at 1 - share), the others their whole time; the memory
bound counts the experts' weights, gradients and optimizer state per GPU as the cost model holds
them (1 / (EP x ETP), the optimizer state sharded over EDP with ZeRO-1).

Mixed clusters (pools of several devices, issue 45): the space is what the simulator prices per
pool (:func:`mixed_space`: a dense model, C = 1, ZeRO 0/1; T inside a node of every pool), placed
in Megatron's order [TP, DP, PP] so a stage's replicas are neighbours, on one pool wherever its
T x R GPUs fit in one (:func:`device_pools`; pools in order along the pipeline), and each
candidate's layers split by type (:class:`TypedPartition`: :func:`cost_models.partition.typed_split`
over the schedule's stages, more layers on the faster pool, within each pool's memory). The
bounds stay below the truth: the cheap time bound takes each layer at its least cost over the
pools, the memory bound is held against the roomiest pool's usable memory, and the refined bound
and critical path price every device on its own pool, for each replica's pools
(:func:`replica_pools`), the ledger judging each GPU against its own pool. Beside the search,
:func:`plan_type_blind`: today's search as if every GPU were the first pool's (:func:`one_kind`),
its plan simulated on the true costs, the gain :func:`planner.hetero.gain`.
"""
from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import time
from dataclasses import dataclass, field

from cost_models.bind import CostInputs, bind, bind_lowered, transformer_cost_model
from cost_models.cluster import Cluster
from cost_models.job import ClusterChoice, Job, Layout
from cost_models.memory import MemoryReport, fmt_bytes, memory_report, peak_activation, usable_memory
from cost_models.model_spec import ModelSpec
from cost_models.moe import check_expert_parallel
from cost_models.parallel import RECOMPUTE, ZERO_STAGES, Parallel
from cost_models.transformer import megatron_flops, transformer_layers
from schedules import registry
from schedules.ir import COMPUTE_KINDS, ScheduleError

DEFAULT_MICRO_BATCHES = (1, 2, 4, 8)
MIN_CP_TOKENS = 8192      # auto context parallelism: C > 1 only where each GPU keeps at least this many tokens
DEFAULT_CHUNKS = (2, 4)
EXCLUDED_BY_DEFAULT = ("zb-auto",)    # orders its ops under a limit from its own costs: give it with --schedules
PAIRED_FAMILIES = ("dualpipe-v",)     # families whose schedule places overlapped F and B pairs itself
# the Parallel fields a LayoutSpace's ``knobs`` may set: the MoE knobs the search does not vary
FIXED_KNOBS = ("expert_imbalance", "capacity_factor", "fp8_dispatch", "a2a_hierarchical", "route_nodes",
               "overlap_sm_share")


@dataclass(frozen=True, kw_only=True)
class LayoutSpace:
    """What the search varies. ``tp``: tensor-parallel sizes (None: every divisor of the node size
    that the model splits, :meth:`ModelSpec.check_tensor_parallel`); ``schedules``: families (None:
    the registry's, less :data:`EXCLUDED_BY_DEFAULT`), each with every variant (a family's
    ``overlap_variants``, for phased MoE costs, only for a mixture of experts, with the overlap
    on) and, for those that
    take chunks, ``chunks``; ``micro_batches``; ``recompute``; ``zero`` (ZeRO 1, 2, 3 only when
    R > 1; ZeRO-3 with ``reshard_after_forward``, :func:`zero_record`);
    ``sequence_parallel`` (only when T > 1); ``max_stages``: at most this many pipeline devices D;
    ``devices``: only these D (None: every D that divides the GPUs); ``gpus``: the GPUs used
    (None: the cluster's; a multiple of its node size); ``device_maps``: how
    ranks are placed (default ``sequential``: Llama 3's order [TP, PP, DP], a tensor-parallel group
    on consecutive GPUs of a node, a pipeline on consecutive groups; its replicas are alike, so the
    simulator runs one for all, where Megatron's [TP, DP, PP] on a rail fabric tells up to 32 kinds
    apart; None: ``sequential``, and Megatron's for EP > 1). ``cp``: context-parallel sizes C (None:
    :func:`context_parallel_sizes`, 1 and every C that keeps at least :data:`MIN_CP_TOKENS` tokens
    a GPU), each candidate's K/V exchange ``cp_comm``; a pipeline device is then T x C GPUs (T
    fastest), placed whole: T x C divides a node or is a multiple of it.

    Mixtures of experts (ignored for a dense model): ``ep`` (None: every divisor of the experts
    that :func:`cost_models.moe.check_expert_parallel` folds onto the layout's T x R), ``etp``;
    ``overlap_fb`` values on ``overlap_schedules`` (None: :data:`PAIRED_FAMILIES`) where EP > 1;
    ``knobs``: a :class:`Parallel` whose :data:`FIXED_KNOBS` every candidate takes (imbalance,
    capacity factor, fp8 dispatch, hierarchical all-to-all, node-limited routing, the overlap's
    SM share)."""

    tp: tuple[int, ...] | None = None
    schedules: tuple[str, ...] | None = None
    chunks: tuple[int, ...] = DEFAULT_CHUNKS
    micro_batches: tuple[int, ...] = DEFAULT_MICRO_BATCHES
    recompute: tuple[str, ...] = RECOMPUTE
    zero: tuple[int, ...] = ZERO_STAGES
    sequence_parallel: tuple[bool, ...] = (False, True)
    max_stages: int | None = None
    devices: tuple[int, ...] | None = None
    gpus: int | None = None
    device_maps: tuple[str, ...] | None = None
    cp: tuple[int, ...] | None = None
    cp_comm: str = "ring"
    ep: tuple[int, ...] | None = None
    etp: tuple[int, ...] = (1,)
    overlap_fb: tuple[bool, ...] = (False, True)
    overlap_schedules: tuple[str, ...] | None = None
    knobs: Parallel = Parallel()

    def __post_init__(self):
        for z in self.zero:
            if isinstance(z, bool) or z not in ZERO_STAGES:
                raise ValueError(f"--zero values must be among {', '.join(map(str, ZERO_STAGES))}; got {z!r}")
        for r in self.recompute:
            if r not in RECOMPUTE:
                raise ValueError(f"--recompute must be among {', '.join(RECOMPUTE)}; got {r!r}")
        from cost_models.parallel import CP_COMMS
        if self.cp_comm not in CP_COMMS:
            raise ValueError(f"--cp-comm must be one of {', '.join(CP_COMMS)}; got {self.cp_comm!r}")
        for name, values in (("--tp", self.tp or ()), ("--devices", self.devices or ()), ("--cp", self.cp or ()),
                             ("--micro-batch", self.micro_batches),
                             ("--chunks", self.chunks), ("--ep", self.ep or ()), ("--etp", self.etp)):
            for v in values:
                if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                    raise ValueError(f"{name} values must be integers >= 1; got {v!r}")
        for n in (*(self.schedules or ()), *(self.overlap_schedules or ())):
            registry.get(n)
        for v in self.overlap_fb:
            if not isinstance(v, bool):
                raise ValueError(f"--overlap-fb values must be true or false; got {v!r}")
        if not isinstance(self.knobs, Parallel):
            raise ValueError(f"knobs must be a cost_models.parallel.Parallel; got {self.knobs!r}")
        base = Parallel()
        moved = [f for f in self.knobs.record() if f not in FIXED_KNOBS and getattr(self.knobs, f) != getattr(base, f)]
        if moved:
            raise ValueError(f"knobs: {', '.join(moved)} is an axis of the search, not a fixed knob "
                             f"(fixed: {', '.join(FIXED_KNOBS)})")
        from cost_models.cluster import MAPPINGS
        for m in self.device_maps or ():
            if m not in MAPPINGS:
                raise ValueError(f"--device-map must be among {', '.join(MAPPINGS)}; got {m!r}")

    def families(self) -> list[str]:
        return list(self.schedules) if self.schedules is not None else \
            [n for n in registry.names() if n not in EXCLUDED_BY_DEFAULT]

    def overlaps(self, family: str) -> bool:
        """Whether ``overlap_fb`` is searched on ``family`` (with EP > 1)."""
        return family in (PAIRED_FAMILIES if self.overlap_schedules is None else self.overlap_schedules)

    def maps(self, ep: int) -> tuple[str, ...]:
        """The device maps of a candidate with expert parallelism ``ep``."""
        if self.device_maps is not None:
            return self.device_maps
        return ("megatron",) if ep > 1 else ("sequential",)


@dataclass(frozen=True)
class Candidate:
    """One layout with its bounds: ``job`` (a :class:`Job`), ``time_bound`` (seconds) and
    ``memory_bound`` (bytes a GPU needs at least)."""

    job: Job
    time_bound: float
    memory_bound: float


@dataclass(frozen=True)
class Confirmed:
    """A candidate simulated: its job, iteration time, bubble ratio, worst rank's peak memory
    (static + activations, as ``simulate`` reports it), the memory verdict's line, its time bound
    and ``memory_need`` (the worst peak plus the transients: what the verdict compares)."""

    job: Job
    iteration_time: float
    bubble_ratio: float
    peak_memory: float
    verdict: str
    time_bound: float
    memory_need: float = 0.0

    def record(self, global_batch: int, model: ModelSpec, peak_flops: float) -> dict:
        """The JSON record of ``pipetwin plan --tp``: tp, cp, cp_comm, devices, dp, schedule, chunks, variant,
        micro_batch, microbatches, recompute, zero, sequence_parallel, ep, etp, overlap_fb, iteration_time,
        tokens_per_s, mfu (:func:`layout_mfu`), peak_memory (bytes: the worst GPU's static +
        activations), memory_need (with the transients), bubble_ratio, time_bound, memory_verdict; on a
        mixed cluster partition (layers per stage)."""
        lay, j, par = self.job.layout, self.job, self.job.parallel
        return {"tp": par.tp, "cp": par.cp, "cp_comm": par.cp_comm, "devices": lay.devices, "dp": lay.replicas,
                "gpus": j.gpus,
                "schedule": lay.schedule, "chunks": lay.chunks if registry.get(lay.schedule).takes_chunks else 1,
                "variant": lay.variant, "micro_batch": par.micro_batch, "microbatches": lay.microbatches,
                "recompute": par.recompute, "zero": par.zero, "sequence_parallel": par.sequence_parallel,
                "ep": par.ep, "etp": par.etp, "overlap_fb": par.overlap_fb, "device_map": j.mapping,
                "iteration_time": self.iteration_time,
                "tokens_per_s": global_batch * model.seq_len / self.iteration_time,
                "mfu": layout_mfu(model, global_batch, self.iteration_time, j.gpus, peak_flops),
                "peak_memory": self.peak_memory, "memory_need": self.memory_need, "bubble_ratio": self.bubble_ratio,
                "time_bound": self.time_bound, "memory_verdict": self.verdict,
                **({"partition": list(j.partition)} if j.partition is not None else {})}


@dataclass
class LayoutResult:
    """The search's answer: ``top`` (best first), every confirmed candidate (``confirmed``, for
    the figure), counts of ``candidates``, ``memory_pruned`` (by the memory bound), ``refused``
    (requirements not met), ``out_of_memory`` (by the ledger), ``simulated``; ``seconds``;
    ``usable`` bytes per GPU; the model, cluster and global batch."""

    top: list[Confirmed]
    confirmed: list[Confirmed]
    model: ModelSpec
    cluster: Cluster
    global_batch: int
    usable: float
    candidates: int = 0
    memory_pruned: int = 0
    refused: int = 0
    out_of_memory: int = 0
    simulated: int = 0
    seconds: float = 0.0
    peak_flops: float = field(default=0.0)

    @property
    def best(self) -> Confirmed:
        return self.top[0]

    def records(self) -> list[dict]:
        return [c.record(self.global_batch, self.model, self.peak_flops) for c in self.top]


def layout_mfu(model: ModelSpec, global_batch: int, seconds: float, gpus: int, peak_flops: float) -> float:
    """Model FLOPs utilisation: the model FLOPs of an iteration without recomputation
    (:func:`cost_models.transformer.megatron_flops`; a mixture of experts: the formulas' forward and
    backward FLOPs of every layer for one sequence, its k experts a token, x the global batch) /
    (time x GPUs x each GPU's peak)."""
    if model.is_moe:
        one = transformer_layers(model.replace(micro_batch=1))
        flops = global_batch * sum(x.flops_f + x.flops_b_input + x.flops_w for x in one)
    else:
        flops = megatron_flops(global_batch, model.seq_len, model.layers, model.hidden, model.vocab, recompute=False)
    return flops / (seconds * gpus * peak_flops)


def tensor_parallel_sizes(model: ModelSpec, cluster: Cluster, asked: tuple[int, ...] | None) -> list[int]:
    """T values: ``asked`` (each must divide the node size and split the model: one line if not),
    else every divisor of the node size that splits the model."""
    per = node_size(cluster)
    if asked is None:
        out = []
        for t in range(1, per + 1):
            try:
                model.check_tensor_parallel(t)
            except ValueError:
                continue
            if per % t == 0:
                out.append(t)
        return out
    for t in asked:
        if per % t:
            raise ValueError(f"--tp {t} does not divide the {per} GPUs of a node of {cluster.name}; a "
                             f"tensor-parallel group stays inside a node: pick a divisor of {per}")
        model.check_tensor_parallel(t)
    return sorted(set(asked))


def context_parallel_sizes(model: ModelSpec, cluster: Cluster, asked: tuple[int, ...] | None) -> list[int]:
    """C values: ``asked`` (each checked by :meth:`ModelSpec.check_context_parallel`: one line if
    the model cannot take it), else 1 and, for a dense model, every power of two C that splits the
    sequence into 2C chunks while each GPU keeps at least :data:`MIN_CP_TOKENS` tokens (Llama 3:
    131,072 / 16 = 8,192) and whose groups fit the cluster (C x 1 GPUs divide a node, or C is a multiple of
    it: :func:`_places`); a sequence of 8,192 tokens or fewer adds no C."""
    if asked is not None:
        for c in asked:
            model.check_context_parallel(c)
        return sorted(set(asked))
    out = [1]
    if model.is_moe or model.is_mla:
        return out
    c = 2
    while model.seq_len % (2 * c) == 0 and model.seq_len // c >= MIN_CP_TOKENS and c <= cluster.num_devices:
        out.append(c)
        c *= 2
    return out


def _places(cluster: Cluster, g: int) -> bool:
    """Whether a pipeline device of g GPUs sits whole on the cluster's nodes: g divides a node, or is
    a multiple of it that divides the nodes (:func:`cost_models.cluster.tensor_parallel_groups`)."""
    dpn = node_size(cluster)
    if cluster.is_mixed:        # inside a node of every pool (a group never spans two kinds)
        return dpn % g == 0
    return dpn % g == 0 if g <= dpn else g % dpn == 0 and cluster.nodes % (g // dpn) == 0


def node_size(cluster: Cluster) -> int:
    """The GPUs of a node; on a mixed cluster the greatest common divisor of its pools' (a group of
    that many GPUs sits inside a node of any pool)."""
    return math.gcd(*(p.devices_per_node for p in cluster.pools))


def node_divisors(cluster: Cluster) -> list[int]:
    """Every divisor of the cluster's node size (the group sizes that stay inside a node)."""
    return _divisors(node_size(cluster))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_gpus(cluster: Cluster, gpus: int | None) -> int:
    """The GPUs the layouts use: the cluster's, or ``gpus`` (a multiple of the node size, at most
    the cluster's)."""
    if gpus is None:
        return cluster.num_devices
    per = node_size(cluster)
    if gpus % per:
        raise ValueError(f"--gpus {gpus} is not a multiple of the {per} GPUs of a node of {cluster.name}; "
                         f"use a multiple of {per}")
    if gpus > cluster.num_devices:
        raise ValueError(f"--gpus {gpus} is more than the {cluster.num_devices} GPUs of {cluster.name}")
    return gpus


def candidates(model: ModelSpec, cluster: Cluster, global_batch: int, space: LayoutSpace = LayoutSpace(), *,
               cluster_choice: ClusterChoice | None = None, cost_model: str | None = None,
               memory_reserve: float | None = None, memory_limit: float | None = None) -> list[Job]:
    """Every job of the space on ``cluster`` at ``global_batch`` (R x micro-batch divides it; the
    family's own requirements are checked when it is built; a mixture of experts' EP x ETP as
    :func:`cost_models.moe.check_expert_parallel` allows on the layout). Where the space has C > 1 and
    no ``cost_model`` is asked, every candidate is priced by the linear model (the kernel model
    does not price context parallelism), so they compare alike; ``kernels`` asked keeps C = 1 (and
    refuses a C > 1 asked). ``cluster_choice``: how the
    jobs name the cluster (their costs come from ``cluster`` itself, :func:`plan_layouts`). On a mixed
    cluster: :func:`mixed_space`, whole stages on a pool, each job's partition :class:`TypedPartition`'s
    (within ``memory_limit`` where given, else each pool's usable memory)."""
    gpus = check_gpus(cluster, space.gpus)
    choice = cluster_choice or ClusterChoice(name=cluster.name)
    mixed = cluster.is_mixed
    if mixed:
        space = mixed_space(model, cluster, space)
    tps = tensor_parallel_sizes(model, cluster, space.tp)
    cps = context_parallel_sizes(model, cluster, space.cp) if not mixed else [1]
    if cost_model == "kernels" and max(cps) > 1:
        if space.cp is not None:
            raise ValueError(f"--cp {max(cps)} is priced by --cost-model linear; the kernel model prices "
                             f"whole-sequence attention kernels (drop --cost-model kernels or --cp)")
        cps = [1]                 # the kernel model asked: its layouts have no CP
    if cost_model is None and max(cps) > 1:
        cost_model = "linear"     # the kernel model prices no CP: every candidate alike, by the formulas
    most = min(model.layers, space.max_stages or model.layers, registry.MAX_RANKS)
    experts = _ExpertAxes(model, space)
    out = []
    pairs = [(tp, cp) for tp in tps for cp in cps if gpus % (tp * cp) == 0 and _places(cluster, tp * cp)]
    for c in space.cp or ():
        if not any(cp == c for _, cp in pairs):
            raise ValueError(f"--cp {c} fits no layout: T x {c} GPUs must divide the {gpus:,} GPUs and a node of "
                             f"{node_size(cluster)} (or be a multiple of it) for some --tp")
    for tp, cp in pairs:
        for D in _divisors(gpus // (tp * cp)):
            if D > most:
                break
            if space.devices is not None and D not in space.devices:
                continue
            R = gpus // (tp * cp * D)
            for mb in space.micro_batches:
                if global_batch % (R * mb):
                    continue
                N = global_batch // (R * mb)
                for name in (space.families() if D > 1 or model.is_moe else _one_stage(space.families())):
                    fam = registry.get(name)
                    for variant in _variants(fam, model, space):
                        for chunks in (space.chunks if fam.takes_chunks else (2,)):
                            if D * (chunks if fam.takes_chunks else 1) > model.layers:
                                continue
                            lay = Layout(schedule=name, devices=D, microbatches=N, replicas=R, chunks=chunks,
                                         variant=variant)
                            for rc, zero, sp in itertools.product(
                                    space.recompute, space.zero if R > 1 else (0,),
                                    space.sequence_parallel if tp > 1 else (False,)):
                                if sp and cp > 1 and (model.seq_len // cp) % tp:
                                    continue
                                overlap = "only" if variant in fam.overlap_variants else \
                                    "both" if space.overlaps(name) else "off"
                                for par in experts.records(tp, R, mb, rc, zero, sp, overlap, cp):
                                    for dmap in _distinct_maps(space.maps(par.ep), D, R):
                                        out.append(Job(layout=lay, model=model, cluster=choice, parallel=par,
                                                       cost_model=cost_model, memory_reserve=memory_reserve,
                                                       device_map=dmap))
    experts.check_asked()
    if mixed:
        split = TypedPartition(model, cluster, memory_limit)
        out = [dataclasses.replace(j, partition=split(j)) for j in out]
    return out


def mixed_space(model: ModelSpec, cluster: Cluster, space: LayoutSpace) -> LayoutSpace:
    """The space on a mixed cluster (several pools): what the simulator prices per pool
    (:func:`cost_models.bind.check_mixed_job`: a dense model, C = 1, ZeRO 0/1) placed whole stage by
    whole stage (Megatron's order [TP, DP, PP]: pipeline device d on GPUs d T R .. (d + 1) T R - 1,
    pools in order, :func:`device_pools`); an axis asked outside it is one line."""
    name = cluster.name
    if model.is_moe:
        raise ValueError(f"--search layout on the mixed cluster {name}: the mixture of experts {model.name}'s "
                         f"all-to-alls are priced for one pool; plan a dense model or a one-pool --cluster")
    if space.cp is not None and max(space.cp) > 1:
        raise ValueError(f"--cp {max(space.cp)} on the mixed cluster {name}: the K/V exchange is priced for one "
                         f"pool; drop --cp (C = 1) or plan a one-pool --cluster")
    zero = tuple(z for z in space.zero if z < 2)
    if not zero:
        raise ValueError(f"--zero {','.join(map(str, space.zero))} on the mixed cluster {name}: ZeRO-2/3's shards "
                         f"are priced for one pool; give --zero 0 or 1 (or plan a one-pool --cluster)")
    if space.device_maps not in (None, ("megatron",)):
        raise ValueError(f"--device-map {','.join(space.device_maps)} on the mixed cluster {name}: its stages are "
                         f"placed whole on a pool (megatron's order, pools in order); drop --device-map")
    return dataclasses.replace(space, zero=zero, cp=(1,), device_maps=("megatron",))


def device_pools(cluster: Cluster, devices: int, tp: int, replicas: int) -> list[frozenset[int]]:
    """The pools of each pipeline device's R replicas in Megatron's order [TP, DP, PP] (replica r of
    pipeline device d on GPUs (d R + r) T ..): a stage's replicas are neighbours, on one pool
    wherever T x R GPUs fit in one (two where they straddle a pool's end: the slower sets the pace)."""
    R = replicas
    return [frozenset(cluster.pool_of_device((d * R + r) * tp) for r in range(R)) for d in range(devices)]


def replica_pools(cluster: Cluster, devices: int, tp: int, replicas: int) -> list[tuple[int, ...]]:
    """The distinct pool vectors of the replicas (pipeline device d of replica r on the pool at d),
    Megatron's order as :func:`device_pools`."""
    R = replicas
    return sorted({tuple(cluster.pool_of_device((d * R + r) * tp) for d in range(devices)) for r in range(R)})


def in_flight(sched) -> list[int]:
    """Per stage of copy 0: the most micro-batches whose forward its device has run and whose
    backward (B, or the input half B of a split one) it has not, at any point of its program: each
    holds that stage's activations then."""
    out = [0] * sched.num_stages
    for prog in sched.programs:
        held: dict = {}
        for op in prog:
            if op.copy != 0 or op.kind not in ("F", "B"):
                continue
            held[op.stage] = held.get(op.stage, 0) + (1 if op.kind == "F" else -1)
            out[op.stage] = max(out[op.stage], held[op.stage])
    return out


def _optim_layers(c) -> tuple[float, ...]:
    """Seconds of each layer's optimizer step (:meth:`cost_models.base.LayerCosts.optim_total`, layer by layer)."""
    if c.optim_time is not None:
        return tuple(c.optim_time)
    return tuple(p * c.optim_time_per_param for p in c.params)


class TypedPartition:
    """A mixed-cluster candidate's layers per stage: :func:`cost_models.partition.typed_split` over
    the schedule's stages with each stage's kind fixed by the pools of its device's replicas
    (:func:`device_pools`), a layer costing F + B + W on the slowest of them (the job's own per-pool
    cost model: what the simulator charges) and every stage within its pools' usable memory as far
    as a stage alone needs it: its weights, gradients and optimizer state and the activations of the
    most micro-batches its device's program holds forward-done and backward-undone at once
    (:func:`in_flight`); where no
    split meets it, the time-only split (the ledger then judges it). More layers on the faster pool.
    Per (parallel record, R, D, schedule, chunks, variant, cost model)."""

    def __init__(self, model: ModelSpec, cluster: Cluster, memory_limit: float | None = None):
        self.model, self.cluster, self.limit = model, cluster, memory_limit
        self._memo: dict = {}

    def __call__(self, job: Job) -> tuple[int, ...] | None:
        from cost_models.partition import typed_split
        from schedules import build
        lay = job.layout
        key = (job.parallel, lay.replicas, lay.devices, lay.microbatches, lay.schedule, lay.chunks, lay.variant,
               job.cost_model)
        if key in self._memo:
            return self._memo[key]
        try:
            sched = build(lay.schedule, lay.devices, lay.microbatches, **lay.family_options())
        except (ScheduleError, ValueError):
            self._memo[key] = None       # refused when bound (its own line)
            return None
        where = device_pools(self.cluster, lay.devices, job.parallel.tp, lay.replicas)
        stages = [where[sched.placement[0][s]] for s in range(sched.num_stages)]
        kinds = list(dict.fromkeys(stages))
        model = job.parallel.sized(self.model)
        pools = sorted(set().union(*kinds))
        costs = {p: transformer_cost_model(job, model, self.cluster.pool_cluster(p)).layer_costs() for p in pools}
        per = {p: [f + b + w for f, b, w in zip(c.f, c.b_input, c.w)] for p, c in costs.items()}
        times = [[max(per[p][l] for p in k) for l in range(len(per[pools[0]]))] for k in kinds]   # the slowest
        c = costs[pools[0]]
        static = list(c.static_bytes) if c.static_bytes is not None else \
            [p * c.bytes_per_param_static for p in c.params]
        caps = [self.limit if self.limit is not None else
                min(usable_memory(self.cluster.pools[p].device.memory_bytes, job.memory_reserve) for p in k)
                for k in kinds]
        used = kinds
        seq = tuple(kinds.index(k) for k in stages)
        S = len(stages)
        got = typed_split(times, S, [S] * len(used), static=static, act=list(c.act), inflight=in_flight(sched),
                          caps=caps, sequence=seq) or typed_split(times, S, [S] * len(used), sequence=seq)
        self._memo[key] = None if got is None else tuple(got.counts)
        return self._memo[key]


class _ExpertAxes:
    """The parallel records of a layout: one per (EP, ETP, overlap) the model and the layout allow
    (a dense model: the one record without them). EP x ETP is checked by
    :func:`cost_models.moe.check_expert_parallel` (once per T, R, SP, EP, ETP); an EP or ETP value
    asked that no layout of the space folds is one line (the check's own)."""

    def __init__(self, model: ModelSpec, space: LayoutSpace):
        self.model, self.space = model, space
        if model.is_moe:
            self.eps = space.ep if space.ep is not None else tuple(_divisors(model.experts))
            self.etps = space.etp
        else:       # a dense model: an MoE option given is the check's line
            check_expert_parallel(model, dataclasses.replace(space.knobs, ep=max(space.ep or (1,)),
                                                             etp=max(space.etp)), 1)
            self.eps, self.etps = (1,), (1,)
        self.fixed = {f: getattr(space.knobs, f) for f in FIXED_KNOBS}
        self._ok: dict = {}
        self._why: dict = {}
        self._used: set = set()
        self._records: dict = {}

    def records(self, tp: int, R: int, mb: int, rc: str, zero: int, sp: bool, overlap: str,
                cp: int = 1) -> list[Parallel]:
        """``overlap``: "off" (overlap_fb False), "both" (the space's values where EP > 1), "only"
        (a variant that pays only overlapped: True, where EP > 1). Once per argument set: the
        layouts of every D, schedule and chunk count share the records."""
        key = (tp, R, mb, rc, zero, sp, overlap, cp)
        got = self._records.get(key)
        if got is None:
            got = self._records[key] = self._new_records(tp, R, mb, rc, zero, sp, overlap, cp)
        return got

    def _new_records(self, tp: int, R: int, mb: int, rc: str, zero: int, sp: bool, overlap: str,
                     cp: int) -> list[Parallel]:
        out = []
        for ep, etp in itertools.product(self.eps, self.etps):
            if overlap == "only":
                ofbs = (True,) if ep > 1 and True in self.space.overlap_fb else ()
            else:
                ofbs = self.space.overlap_fb if overlap == "both" and ep > 1 else (False,)
            for ofb in ofbs:
                par = Parallel(tp=tp, micro_batch=mb, recompute=rc, **zero_record(zero), sequence_parallel=sp, ep=ep,
                               etp=etp, overlap_fb=ofb, cp=cp, cp_comm=self.space.cp_comm if cp > 1 else "ring",
                               **(self.fixed if self.model.is_moe else {}))
                if self._fits(par, R):
                    out.append(par)
        return out

    def _fits(self, par: Parallel, R: int) -> bool:
        key = (par.tp, par.cp, par.sequence_parallel, R, par.ep, par.etp, par.overlap_fb)   # the fold: T x C x R
        if key not in self._ok:
            try:
                check_expert_parallel(self.model, par, R)
                self._ok[key] = True
                self._used.update({("ep", par.ep), ("etp", par.etp)})
            except ValueError as e:
                self._ok[key] = False
                for name, v in (("ep", par.ep), ("etp", par.etp)):
                    self._why.setdefault((name, v), str(e))
        return self._ok[key]

    def check_asked(self) -> None:
        """An EP or ETP value asked (``--ep 3``) that no layout folds: the check's line for it."""
        if not self.model.is_moe:
            return
        for name, values in (("ep", self.space.ep or ()), ("etp", self.space.etp)):
            for v in values:
                if (name, v) not in self._used and (name, v) in self._why:
                    raise ValueError(f"--{name} {v} fits no layout of the space: {self._why[(name, v)]}")


def _one_stage(families) -> list[str]:
    """The families searched for a dense model at D = 1: no pipeline, so every family runs a device's
    F and B of its micro-batches one after another (gradient accumulation) in the same time; 1F1B's
    order keeps one micro-batch's activations, the least, so ``dapple`` stands for them all where
    it is searched (else the first family asked): a plan lists distinct layouts, not one under five
    names. (A mixture of experts keeps them all: DualPipe-V's F&B pairs hide all-to-alls at D = 1 too.)"""
    families = list(families)
    return ["dapple"] if "dapple" in families else families[:1]


def zero_record(zero: int) -> dict:
    """The :class:`Parallel` fields of ZeRO stage ``zero`` in the search: ZeRO-3 re-gathers the
    weights for each micro-batch's F and B (``reshard_after_forward``): gathered once per step it
    takes ZeRO-2's time (the same reduce-scatters per micro-batch, the same all-gather per step)
    and more memory (the whole weights held through the step beside their shard), so it never
    wins; HSDP (``dp_shard``) is not searched."""
    return {"zero": zero, "reshard_after_forward": zero == 3}


def _variants(fam, model: ModelSpec, space: LayoutSpace) -> list:
    """A family's variants in the search: all but its ``overlap_variants`` (they pay only where
    overlapped pairs hide all-to-alls: Megatron's combined 1F1B), which a mixture of experts searches
    with the overlap on."""
    keep = [v for v in fam.variants if v not in fam.overlap_variants or (model.is_moe and True in space.overlap_fb)]
    return keep or [None]


def _distinct_maps(maps: tuple[str, ...], D: int, R: int) -> tuple[str, ...]:
    """The device maps of ``maps`` that place a D x R layout differently: with one pipeline device
    or one replica, Llama 3's [TP, PP, DP] and Megatron's [TP, DP, PP] are the same placement (the
    first named is kept), so their candidates would be the same job twice."""
    if D > 1 and R > 1:
        return maps
    same = {"sequential", "megatron"}
    kept = next((m for m in maps if m in same), None)
    return tuple(m for m in maps if m not in same or m == kept)


class _Bounds:
    """The per-layer costs behind the bounds, computed once per (micro-batch, T, SP, recompute,
    ZeRO, R): the job's own :func:`cost_models.bind.transformer_cost_model`."""

    def __init__(self, model: ModelSpec, cluster: Cluster):
        self.model, self.cluster = model, cluster
        self.mixed = cluster.is_mixed
        self._work: dict = {}
        self._optim: dict = {}
        self._mem: dict = {}
        self._shapes: dict = {}
        self._counts: dict = {}
        self._paths: dict = {}
        self._acts: dict = {}
        self._models: dict = {}

    def inputs(self, job: Job) -> CostInputs:
        return CostInputs("transformer", model=job.parallel.sized(self.model), cluster=self.cluster)

    def cost_model(self, job: Job):
        """The job's :func:`cost_models.bind.transformer_cost_model`, one per (parallel record, R, D,
        cost model, partition): the candidates of other schedules, chunks and micro-batch counts
        share it, and its layer costs (computed once per record)."""
        lay = job.layout
        key = (job.parallel, lay.replicas, lay.devices, job.cost_model, job.partition, job.grad_accumulation)
        got = self._models.get(key)
        if got is None:
            got = self._models[key] = transformer_cost_model(job, self.inputs(job).model, self.cluster)
        return got

    def pool_models(self, job: Job) -> list:
        """On a mixed cluster: the job's cost model on each pool alone (its device, its links), as
        :func:`cost_models.bind.bind` prices a rank on that pool; one per (parallel record, R, D, cost
        model, partition)."""
        lay = job.layout
        key = ("pools", job.parallel, lay.replicas, lay.devices, job.cost_model, job.partition, job.grad_accumulation)
        got = self._models.get(key)
        if got is None:
            model = self.inputs(job).model
            got = self._models[key] = [transformer_cost_model(job, model, self.cluster.pool_cluster(p))
                                       for p in range(len(self.cluster.pools))]
        return got

    def _least(self, job: Job):
        """On a mixed cluster: each layer's costs at their least over the pools (the elementwise
        minimum of F, B, W and the optimizer step; bytes alike on every pool): what the bounds read,
        since a layer costs at least that on whichever pool holds it."""
        cs = [t.layer_costs() for t in self.pool_models(job)]
        least = lambda name: tuple(min(x) for x in zip(*(getattr(c, name) for c in cs)))  # noqa: E731
        return dataclasses.replace(cs[0], f=least("f"), b_input=least("b_input"), w=least("w"),
                                   optim_time=tuple(min(x) for x in zip(*(_optim_layers(c) for c in cs))))

    def time(self, job: Job) -> float:
        lay, par = job.layout, job.parallel
        hidden = may_overlap(job)
        key = (par.micro_batch, par.tp, par.sequence_parallel, par.recompute, par.ep, par.etp, hidden, par.cp,
               par.cp_comm, *_fsdp_key(job))
        if key not in self._work:
            c, a2a = self._layer_costs(job, hidden)
            work = sum(c.f) + sum(c.b_input) + sum(c.w)
            self._work[key] = (overlapped(work, a2a, par.overlap_sm_share), sum(c.f) + sum(c.b_input))
        work, path = self._work[key]
        return max((lay.microbatches * work + self.optim(job)) / lay.devices, path)

    def optim(self, job: Job) -> float:
        """Seconds of the optimizer steps of every layer (with a mixture of experts' EDP all-reduce):
        each rank's OPTIM runs after its last compute op."""
        par = job.parallel
        key = (par.tp, par.ep, par.etp, par.zero, job.layout.replicas, par.cp, *_fsdp_key(job))
        if key not in self._optim:
            c = self._least(job) if self.mixed else self.cost_model(job).layer_costs()
            self._optim[key] = c.optim_total()
        return self._optim[key]

    def _layer_costs(self, job: Job, hidden: bool):
        """(the job's per-layer costs, 0); ``hidden``: (its costs without the expert all-to-alls,
        the all-to-alls' seconds of one micro-batch), for :func:`overlapped`. On a mixed cluster each
        layer's least over the pools (no all-to-alls there: dense models only)."""
        if self.mixed:
            return self._least(job), 0.0
        tcm = self.cost_model(job)
        c = tcm.layer_costs()
        if not hidden:
            return c, 0.0
        a2a_f, a2a_b = tcm.all_to_all_times()
        return dataclasses.replace(c, f=tuple(x - y for x, y in zip(c.f, a2a_f)),
                                   b_input=tuple(x - y for x, y in zip(c.b_input, a2a_b))), sum(a2a_f) + sum(a2a_b)

    def shape(self, job: Job):
        """The family's compute-only schedule of the job's (schedule, D, N, chunks, variant), built
        once and shared by every (T, micro-batch, recompute, ZeRO, SP) on it; a ScheduleError or
        ValueError (requirements not met) is kept and returned."""
        lay = job.layout
        key = (lay.schedule, lay.devices, lay.microbatches, lay.chunks, lay.variant)
        if key not in self._shapes:
            from schedules import build
            try:
                self._shapes[key] = build(lay.schedule, lay.devices, lay.microbatches, **lay.family_options())
            except (ScheduleError, ValueError) as e:
                self._shapes[key] = e
        return self._shapes[key]

    def refine(self, job: Job, capacity: float, reserve: float | None):
        """The second bound, from the job's costs on its built (not lowered) schedule: ``(time,
        need, fits)``: time = max over ranks of (its busy time, every compute op of its program,
        plus the forwards of the stages before the first stage it holds, which must run before its
        first op can start); need and fits: the ledger's verdict (the :class:`MemoryReport` of
        :func:`memory_report`, the same walk as on the lowered schedule: it counts compute ops
        only). None for families that order their ops from their own costs (zb-auto: bound and
        judged when confirmed); a string when the family refuses the shape."""
        if registry.get(job.layout.schedule).takes_memory_limit:
            return None
        sched = self.shape(job)
        if isinstance(sched, Exception):
            return str(sched)
        if self.mixed:
            return self._refine_mixed(job, sched, capacity, reserve)
        tcm = self.cost_model(job)
        try:
            costs = tcm.bind(sched)
        except ValueError as e:
            return str(e)
        akey = (id(sched), costs.act, costs.act_w)
        if akey not in self._acts:       # one walk for the layouts that keep the same activations
            self._acts[akey] = peak_activation(sched, costs)
        rep = MemoryReport(tuple(costs.static_mem), self._acts[akey], capacity, costs.mem_unit,
                           float(costs.meta.get("memory_transient") or 0.0), reserve)
        hidden = may_overlap(job)
        alone = costs
        if hidden:        # the ops' compute alone, and their all-to-alls (see overlapped)
            from cost_models.base import PerLayerCostModel
            alone = PerLayerCostModel(self._layer_costs(job, True)[0], tcm.partition_for(sched.num_stages)).bind(sched)
        f, optim, share = alone.f, costs.optim_time, job.parallel.overlap_sm_share
        best = 0.0
        for d, (held, counts) in enumerate(self._work_of(sched, hidden)):
            start = min(sum(f[c][:s]) for c, s in held)
            serial = compute = a2a = 0.0
            for (k, c, s, paired), n in counts.items():
                whole = costs.compute_time(k, c, s)
                if paired:
                    mine = alone.compute_time(k, c, s)
                    compute += n * mine
                    a2a += n * (whole - mine)
                else:
                    serial += n * whole
            best = max(best, start + serial + overlapped(compute, a2a, share) + optim[d])
        return best, rep.max_peak + rep.transient, not rep.oom

    def critical_path(self, job: Job) -> float:
        """The third bound, for a candidate whose refined bound is below the best so far: its built
        schedule timed with its compute costs and no communication (each device runs its program
        in order, an op starts when its inputs exist: :func:`schedules.timing.time_programs`), the
        pipeline's bubbles included, each device's optimizer step after its last op; with the
        overlap, each op's compute alone."""
        from schedules.timing import time_programs
        sched = self.shape(job)
        if self.mixed:
            costs, vectors = self._pool_costs(job, sched)
            best = 0.0
            for pools in vectors:       # each replica's pipeline, every op on its own device's pool
                def cost(op, pools=pools):
                    return costs[pools[sched.placement[op.copy][op.stage]]].compute_time(op.kind, op.copy, op.stage)
                times = time_programs(sched.programs, sched.num_stages, cost)
                ends = [0.0] * sched.num_devices
                for d, _, end in times.values():
                    ends[d] = max(ends[d], end)
                best = max(best, max(end + costs[pools[d]].optim_time[d] for d, end in enumerate(ends)))
            return best
        tcm = self.cost_model(job)
        costs = tcm.bind(sched)
        optim = costs.optim_time
        if may_overlap(job):
            from cost_models.base import PerLayerCostModel
            costs = PerLayerCostModel(self._layer_costs(job, True)[0], tcm.partition_for(sched.num_stages)).bind(sched)
        key = (id(sched), costs.f, costs.b, costs.w)
        if key not in self._paths:
            times = time_programs(sched.programs, sched.num_stages,
                                  lambda op: costs.compute_time(op.kind, op.copy, op.stage))
            ends = [0.0] * sched.num_devices
            for d, _, end in times.values():
                ends[d] = max(ends[d], end)
            self._paths[key] = ends
        return max(end + optim[d] for d, end in enumerate(self._paths[key]))

    def _pool_costs(self, job: Job, sched):
        """A mixed-cluster job's built schedule costed on each pool it sits on (pool -> StageCosts) and
        the distinct pool vectors of its replicas (:func:`replica_pools`)."""
        lay = job.layout
        vectors = replica_pools(self.cluster, lay.devices, job.parallel.tp, lay.replicas)
        models = self.pool_models(job)
        return {p: models[p].bind(sched) for p in sorted(set().union(*vectors))}, vectors

    def _refine_mixed(self, job: Job, sched, capacity: float | None, reserve: float | None):
        """:meth:`refine` on a mixed cluster: each device's compute ops and optimizer step priced on its
        own pool, after the forwards of the stages before its first (each on its own device's pool),
        for each replica's pools (:func:`replica_pools`); the ledger judging each device against the
        least memory of its replicas' pools (``capacity`` None) or ``capacity`` (bytes alike on
        every pool)."""
        try:
            costs, vectors = self._pool_costs(job, sched)
        except ValueError as e:
            return str(e)
        c0 = costs[vectors[0][0]]
        akey = (id(sched), c0.act, c0.act_w)
        if akey not in self._acts:
            self._acts[akey] = peak_activation(sched, c0)
        caps = None if capacity is not None else \
            tuple(min(self.cluster.pools[v[d]].device.memory_bytes for v in vectors) for d in range(sched.num_devices))
        rep = MemoryReport(tuple(c0.static_mem), self._acts[akey], capacity, c0.mem_unit,
                           float(c0.meta.get("memory_transient") or 0.0), reserve, caps)
        best = 0.0
        for pools in vectors:
            for d, (held, counts) in enumerate(self._work_of(sched)):
                start = min(sum(costs[pools[sched.placement[c][x]]].f[c][x] for x in range(s)) for c, s in held)
                mine = costs[pools[d]]
                busy = sum(n * mine.compute_time(k, c, s) for (k, c, s, _), n in counts.items())
                best = max(best, start + busy + mine.optim_time[d])
        return best, rep.max_peak + rep.transient, not rep.oom

    def _work_of(self, sched, hidden: bool = False) -> list:
        """Per device of a built schedule: the (copy, stage) it holds and how many compute ops of
        each (kind, copy, stage, paired) its program runs (kept with the shape); ``hidden``: paired
        marks the ops that may run overlapped (the halves of the schedule's own pairs,
        ``meta["overlapped"]``; without them every F and B), else none."""
        pairs = {tuple(k) for p in sched.meta.get("overlapped", ()) for k in p} if hidden else set()
        mode = "off" if not hidden else "pairs" if pairs else "all"
        key = (id(sched), mode)
        if key not in self._counts:
            from collections import Counter

            def paired(op) -> bool:
                return mode == "all" and op.kind in ("F", "B") or (op.kind, op.stage, op.mb) in pairs
            self._counts[key] = [(sched.stages_on(d), Counter((op.kind, op.copy, op.stage, paired(op))
                                                               for op in sched.programs[d] if op.kind in COMPUTE_KINDS))
                                 for d in range(sched.num_devices)]
        return self._counts[key]

    def memory(self, job: Job) -> float:
        lay, par = job.layout, job.parallel
        key = (par.micro_batch, par.tp, par.sequence_parallel, par.recompute, par.zero, lay.replicas, par.ep, par.etp,
               par.cp, par.cp_comm, *_fsdp_key(job))
        if key not in self._mem and self.mixed:     # bytes alike on every pool; the least, to be safe
            ts = self.pool_models(job)
            self._mem[key] = (min(t.layer_costs().static_total() + sum(t.layer_costs().act) for t in ts),
                              min(t.transient_bytes() for t in ts))
        if key not in self._mem:
            tcm = self.cost_model(job)
            c = tcm.layer_costs()       # a mixture of experts' held and sharded as the cost model holds them
            # ZeRO-3 gathered once per step: every rank holds its stages' whole weights through the step
            # (re-gathered per micro-batch: two layers at a time, at least 0)
            gathered = sum(c.params) * tcm.bytes_split()[0] if par.zero == 3 and not par.reshard_after_forward else 0.0
            self._mem[key] = (c.static_total() + gathered + sum(c.act), tcm.transient_bytes())
        held, transient = self._mem[key]
        return held / lay.devices + transient


def _fsdp_key(job: Job) -> tuple:
    """What ZeRO-2/3's costs add to a cache key of :class:`_Bounds` (their collectives depend on the
    shard and replicate groups); () below ZeRO-2, whose layer times do not depend on them."""
    par = job.parallel
    if par.zero < 2:
        return ()
    return par.zero, job.layout.replicas, par.dp_shard, par.reshard_after_forward


def overlapped(compute: float, a2a: float, share: float) -> float:
    """The least time of ops whose ``compute`` seconds and all-to-all seconds ``a2a`` may overlap,
    the communication kernels taking ``share`` of the GPU while they run: the all-to-alls run one
    after the other (at least ``a2a``), and while they run the compute goes at 1 - share, so at most
    (1 - share) a2a of it hides: at least max(a2a, compute + share x a2a)."""
    return max(a2a, compute + share * a2a)


def may_overlap(job: Job) -> bool:
    """Whether the job's expert all-to-alls may hide behind compute: EP > 1 and ``overlap_fb`` (on
    the pairs its schedule places, :data:`PAIRED_FAMILIES`, or pairs an F with the B right after it)."""
    par = job.parallel
    return par.ep > 1 and par.overlap_fb


_ZERO, _OVERLAP = 7, 12       # the places of ZeRO and overlap_fb in _order


def _leaner(order: tuple) -> list[tuple]:
    """The orders of the candidates that need no more memory than ``order``'s on any GPU: with
    ZeRO 0, the same with ZeRO-1 (it only shards the optimizer state: the same activations and
    transients, less static memory on every GPU), and with ZeRO 0 or 1 the same with ZeRO-2 (which
    also shards the gradients; not ZeRO-3, whose gathered layers may outweigh its weight shards on a
    GPU that holds few); with the overlap, the same without it (it
    changes the times, not what a GPU keeps). The ledger's out of memory for one of them is the
    candidate's. Not on a mixed cluster, where each ZeRO stage's layers are split under its own
    memory (:class:`TypedPartition`): the twins hold different layers."""
    out = []
    if order[_ZERO] in (0, 1):
        out += [order[:_ZERO] + (z,) + order[_ZERO + 1:] for z in range(order[_ZERO] + 1, 3)]
    if order[_OVERLAP]:
        out.append(order[:_OVERLAP] + (False,) + order[_OVERLAP + 1:])
    return out


def _order(job: Job) -> tuple:
    lay, par = job.layout, job.parallel
    return (par.tp, lay.devices, lay.schedule, lay.variant or "", lay.chunks, par.micro_batch,
            RECOMPUTE.index(par.recompute), par.zero, par.sequence_parallel, job.mapping, par.ep, par.etp,
            par.overlap_fb, par.cp)


def confirm(job: Job, inputs: CostInputs, capacity: float, reserve: float | None, time_bound: float = 0.0,
            built=None):
    """Bind ``job`` and judge its memory by the ledger (``capacity`` bytes less ``reserve``, None:
    the default); simulate it when it fits. ``built``: its compute-only schedule, built already
    (then lowered, validated and costed as :func:`cost_models.bind.bind` does). Returns a
    :class:`Confirmed`, ``("oom", need)`` (bytes the worst GPU needs) or ``("refused", why)``."""
    from sim import job_options, run
    try:
        if built is None or isinstance(built, Exception):
            bound = bind(job, inputs)
        else:
            bound = bind_lowered(job, inputs, job.build(built=built, **inputs.limits()))
    except (ScheduleError, ValueError) as e:
        return "refused", str(e)
    rep = memory_report(bound.lowered, bound.costs, capacity, reserve)
    worst = rep.worst_rank
    if rep.oom:
        return "oom", rep.peak[worst] + rep.transient
    res = run(bound.lowered, bound.costs, bound.network, job_options(job, bound))
    m = res.metrics()
    return Confirmed(job, res.iteration_time, m.bubble_ratio, rep.max_peak, rep.summary(), time_bound,
                     rep.max_peak + rep.transient)


class NoPlanFits(ValueError):
    """No layout of the space fits a GPU's memory (the message says by how much the smallest misses)."""


def plan_layouts(model: ModelSpec, cluster: Cluster, global_batch: int, space: LayoutSpace = LayoutSpace(), *,
                 top_k: int = 1, cluster_choice: ClusterChoice | None = None, cost_model: str | None = None,
                 memory_limit: float | None = None, memory_reserve: float | None = None,
                 progress=None) -> LayoutResult:
    """The ``top_k`` fastest layouts that fit (module docstring), each simulated. ``memory_limit``:
    bytes a GPU may use (None: the device's memory less the reserve of ``simulate``,
    ``memory_reserve`` or the default). Raises ValueError (one line) when no (R, micro-batch) divides
    the global batch and :class:`NoPlanFits` when nothing fits."""
    t0 = time.perf_counter()
    if global_batch < 1:
        raise ValueError(f"--global-batch must be >= 1; got {global_batch}")
    from .choose import check_global_batch
    check_global_batch(global_batch)
    jobs = candidates(model, cluster, global_batch, space, cluster_choice=cluster_choice, cost_model=cost_model,
                      memory_reserve=memory_reserve, memory_limit=memory_limit)
    gpus = check_gpus(cluster, space.gpus)
    if not jobs:
        most = min(model.layers, space.max_stages or model.layers, registry.MAX_RANKS)
        least = min(gpus // (t * d) for t in tensor_parallel_sizes(model, cluster, space.tp) if gpus % t == 0
                    for d in _divisors(gpus // t) if d <= most) * min(space.micro_batches)
        raise ValueError(f"-G {global_batch} is not divisible by R x micro-batch of any layout of {gpus:,} GPUs "
                         f"(R replicas, micro-batches {', '.join(map(str, space.micro_batches))}); use a multiple "
                         f"of {least:,}")
    capacity, reserve = memory_budget(cluster, memory_limit, memory_reserve)
    usable = usable_of(cluster, capacity, reserve)
    bounds = _Bounds(model, cluster)
    cands = sorted((Candidate(j, bounds.time(j), bounds.memory(j)) for j in jobs),
                   key=lambda c: (c.time_bound, _order(c.job)))
    result = LayoutResult([], [], model, cluster, global_batch, usable, candidates=len(cands),
                          peak_flops=mean_peak(model, cluster))
    top: list[Confirmed] = []
    misses: list[tuple[float, Candidate | None]] = []
    # (bound, order, index, level): a candidate comes up first on its cheap bound (level 0), then
    # again on its refined one (1; memory judged by the ledger in between), then on its critical
    # path (2), then it is confirmed
    heap = [(c.time_bound, _order(c.job), i, 0) for i, c in enumerate(cands)]
    heapq.heapify(heap)
    refined: dict[int, float] = {}
    over: set = set()       # the orders of candidates the ledger found out of memory
    seen = 0
    while heap:
        tb, order, i, level = heapq.heappop(heap)
        if len(top) >= top_k and tb >= top[-1].iteration_time:
            break
        c = cands[i]
        if level == 1:
            tb = refined[i] = max(tb, bounds.critical_path(c.job))
            heapq.heappush(heap, (tb, order, i, 2))
            continue
        if level == 0:
            seen += 1
            if progress is not None:
                progress(seen, len(cands))
            if c.memory_bound > usable:
                result.memory_pruned += 1
                misses.append((c.memory_bound, c))
                continue
            if not bounds.mixed and any(t in over for t in _leaner(order)):   # (mixed: each its own split)
                result.out_of_memory += 1       # a leaner twin is over already (its need is in misses)
                continue
            ref = bounds.refine(c.job, capacity, reserve)
            if isinstance(ref, str):
                result.refused += 1
                continue
            if ref is not None:
                t2, need, fits = ref
                if not fits:
                    result.out_of_memory += 1
                    misses.append((need, None))
                    over.add(order)
                    continue
                tb = refined[i] = max(tb, t2)
            heapq.heappush(heap, (tb, order, i, 1 if ref is not None else 2))
            continue
        got = confirm(c.job, bounds.inputs(c.job), capacity, reserve, refined.get(i, c.time_bound),
                      built=bounds.shape(c.job) if i in refined else None)
        if isinstance(got, tuple):
            if got[0] == "oom":
                result.out_of_memory += 1
                misses.append((got[1], None))
            else:
                result.refused += 1
            continue
        result.simulated += 1
        result.confirmed.append(got)
        top = ranked(top + [got])[:top_k]
    result.seconds = time.perf_counter() - t0
    if not top:
        raise NoPlanFits(_no_fit(misses, bounds, capacity, reserve, usable))
    result.top = top
    return result


def memory_budget(cluster: Cluster, memory_limit: float | None, memory_reserve: float | None):
    """(capacity, reserve) of a GPU's verdict: ``memory_limit`` whole (no reserve), else the
    device's memory less ``memory_reserve`` (None: the default reserve), as ``simulate`` judges; on
    a mixed cluster capacity None: each GPU judged against its own pool's device."""
    if memory_limit is not None:
        return memory_limit, 0.0
    if cluster.is_mixed:
        return None, memory_reserve
    return cluster.device.memory_bytes, memory_reserve


def usable_of(cluster: Cluster, capacity: float | None, reserve: float | None) -> float:
    """The bytes a GPU may use: of ``capacity``, or (None, a mixed cluster) of the roomiest pool's
    device (what the memory bound is held against: a layout whose mean need is above it fits no GPU
    of any pool)."""
    if capacity is not None:
        return usable_memory(capacity, reserve)
    return max(usable_memory(p.device.memory_bytes, reserve) for p in cluster.pools)


def mean_peak(model: ModelSpec, cluster: Cluster) -> float:
    """Peak FLOP/s per GPU at the model's precision: the device's, on a mixed cluster the mean over
    its GPUs (each pool's device's peak, weighted by its GPUs: MFU against the whole cluster's peak)."""
    if not cluster.is_mixed:
        return cluster.device.peak(_precision(model, cluster.device))
    return sum(p.num_devices * p.device.peak(_precision(model, p.device)) for p in cluster.pools) / \
        cluster.num_devices


def _precision(model: ModelSpec, device) -> str:
    from cost_models.transformer import TransformerCostModel
    return TransformerCostModel(model, device).resolved_precision()


def _no_fit(misses, bounds: _Bounds, capacity: float, reserve: float | None, usable: float) -> str:
    """The line of :class:`NoPlanFits`: the smallest need of any layout, exact (layouts whose bound
    is below the smallest exact need are costed by the ledger), and how far it is over."""
    best = min((need for need, c in misses if c is None), default=math.inf)
    for lb, c in sorted((m for m in misses if m[1] is not None), key=lambda m: (m[0], _order(m[1].job))):
        if lb >= best:
            break
        got = confirm(c.job, bounds.inputs(c.job), capacity, reserve)
        if isinstance(got, tuple) and got[0] == "oom":
            best = min(best, got[1])
    if not math.isfinite(best):
        return "no layout of the space can be built (every schedule's requirements fail); widen --schedules or --tp"
    of = f" of {fmt_bytes(capacity)}" if capacity is not None else " on the roomiest pool's GPU"
    return (f"no plan fits: the smallest needs {fmt_bytes(best)} per GPU, {fmt_bytes(best - usable)} more than the "
            f"{fmt_bytes(usable)} usable{of}; use more GPUs (nodes), a smaller model or "
            f"a device with more memory")


def brute_force(model: ModelSpec, cluster: Cluster, global_batch: int, space: LayoutSpace = LayoutSpace(), *,
                memory_limit: float | None = None, memory_reserve: float | None = None,
                cost_model: str | None = None) -> list[tuple[Candidate, object]]:
    """Every candidate of the space with what :func:`confirm` makes of it (bound, judged by the
    ledger and, when it fits, simulated): the reference the search must equal."""
    bounds = _Bounds(model, cluster)
    capacity, reserve = memory_budget(cluster, memory_limit, memory_reserve)
    out = []
    for j in candidates(model, cluster, global_batch, space, memory_reserve=memory_reserve, cost_model=cost_model,
                        memory_limit=memory_limit):
        ref = bounds.refine(j, capacity, reserve)
        tb = bounds.time(j)
        if isinstance(ref, tuple):
            tb = max(tb, ref[0], bounds.critical_path(j))
        c = Candidate(j, tb, bounds.memory(j))
        got = confirm(j, bounds.inputs(j), capacity, reserve, tb)
        if isinstance(ref, tuple):     # the refined verdict is the ledger's
            assert ref[2] == (not isinstance(got, tuple)), (j, ref, got)
        out.append((c, got))
    return out


@dataclass(frozen=True)
class TypeBlind:
    """The whole-layout search's plan on a mixed cluster made as if every GPU were the first pool's
    device (:func:`plan_type_blind`): ``job`` (its default partition and device map), ``believed``
    (its simulated seconds on that one-kind cluster), ``iteration_time`` (simulated on the mixed
    cluster's true per-pool costs) and ``fits`` (every GPU within its own pool's memory there)."""

    job: Job
    believed: float
    iteration_time: float
    fits: bool


def one_kind(cluster: Cluster) -> Cluster:
    """A mixed cluster seen by a type-blind planner: its GPUs all the first pool's (device, node
    size, links), one pool of as many nodes."""
    first = cluster.pools[0]
    if cluster.num_devices % first.devices_per_node:
        raise ValueError(f"the type-blind plan of {cluster.name} sees {cluster.num_devices} GPUs as {first.name}'s "
                         f"nodes of {first.devices_per_node}: they do not divide evenly")
    return Cluster(name=cluster.name, pools=(dataclasses.replace(first, nodes=cluster.num_devices //
                                                                  first.devices_per_node),),
                   description=f"{cluster.name} as if every GPU were a {first.device.name}")


def plan_type_blind(model: ModelSpec, cluster: Cluster, global_batch: int, space: LayoutSpace = LayoutSpace(), *,
                    cluster_choice: ClusterChoice | None = None, cost_model: str | None = None,
                    memory_limit: float | None = None, memory_reserve: float | None = None) -> TypeBlind:
    """The type-blind whole-layout plan of a mixed ``cluster``: today's search on :func:`one_kind`
    (the space :func:`mixed_space` allows, device maps as asked: its replicas may span pools),
    its best job then simulated on ``cluster`` itself (each rank on its own device, a stage's
    replicas on two kinds at the slower's pace), judged against each pool's memory."""
    from sim import job_options, run
    blind = one_kind(cluster)
    ms = mixed_space(model, cluster, space)
    bspace = dataclasses.replace(ms, device_maps=space.device_maps)
    res = plan_layouts(model, blind, global_batch, bspace, top_k=1, cluster_choice=cluster_choice,
                       cost_model=cost_model, memory_limit=memory_limit, memory_reserve=memory_reserve)
    job = res.best.job
    bound = bind(job, CostInputs("transformer", model=job.parallel.sized(model), cluster=cluster))
    capacity, reserve = memory_budget(cluster, memory_limit, memory_reserve)
    rep = memory_report(bound.lowered, bound.costs, capacity, reserve)
    sim = run(bound.lowered, bound.costs, bound.network, job_options(job, bound))
    return TypeBlind(job, res.best.iteration_time, sim.iteration_time, not rep.oom)


def ranked(confirmed: list[Confirmed]) -> list[Confirmed]:
    """Confirmed candidates in the search's order: time, then the layout's fields."""
    return sorted(confirmed, key=lambda x: (x.iteration_time, _order(x.job)))
