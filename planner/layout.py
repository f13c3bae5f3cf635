"""The whole-layout planner: T x D x R, schedule family, micro-batch, recompute, ZeRO-1 and sequence
parallelism for a transformer on a cluster, the fastest that fits each GPU's memory.

Every candidate is a :class:`cost_models.job.Job` (uniform layouts: R replicas of a D-stage
pipeline, each stage a tensor-parallel group of T GPUs, T x D x R = the GPUs used); it is costed
by :func:`cost_models.bind.bind` and simulated by the SimPy engine (one replica standing for all),
exactly as ``pipetwin simulate`` would. The search is exact over its space (:class:`LayoutSpace`),
by two bounds that never exceed the truth:

* time: an iteration is at least the mean compute of a pipeline device, N x (F + B + W of the
  whole model at T) / D, and at least one micro-batch's forward and backward through every layer;
  both come from the cost model's per-layer costs (:meth:`cost_models.TransformerCostModel.layer_costs`), one
  set per (micro-batch, T, sequence parallel, recompute), without building a schedule;
* memory: a GPU needs at least its mean static bytes (weights, gradients, optimizer state, ZeRO-1
  sharded), params x bytes / D, plus the transients every verdict counts; above the usable memory
  no schedule of that layout fits.

Candidates are taken in order of their time bound; one whose memory bound is over is skipped,
the others are bound (schedule built, costs) and judged by the ledger
(:func:`cost_models.memory.memory_report`, the reserve of ``simulate``); those that fit are
simulated; the search stops when the next bound is no better than the K-th best simulated time.
So the best K equal those of simulating every candidate (:func:`brute_force`, the tests' reference).
"""
from __future__ import annotations

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
from cost_models.parallel import RECOMPUTE, Parallel
from cost_models.transformer import megatron_flops
from schedules import registry
from schedules.ir import COMPUTE_KINDS, ScheduleError

DEFAULT_MICRO_BATCHES = (1, 2, 4, 8)
DEFAULT_CHUNKS = (2, 4)
EXCLUDED_BY_DEFAULT = ("zb-auto",)    # orders its ops under a limit from its own costs: give it with --schedules


@dataclass(frozen=True, kw_only=True)
class LayoutSpace:
    """What the search varies. ``tp``: tensor-parallel sizes (None: every divisor of the node size
    that the model splits, :meth:`ModelSpec.check_tensor_parallel`); ``schedules``: families (None:
    the registry's, less :data:`EXCLUDED_BY_DEFAULT`), each with every variant (but a family's
    ``overlap_variants``, for phased MoE costs) and, for those that
    take chunks, ``chunks``; ``micro_batches``; ``recompute``; ``zero`` (ZeRO-1 only when R > 1);
    ``sequence_parallel`` (only when T > 1); ``max_stages``: at most this many pipeline devices D;
    ``devices``: only these D (None: every D that divides the GPUs); ``gpus``: the GPUs used
    (None: the cluster's; a multiple of its node size); ``device_maps``: how
    ranks are placed (default ``sequential``: Llama 3's order [TP, PP, DP], a tensor-parallel group
    on consecutive GPUs of a node, a pipeline on consecutive groups; its replicas are alike, so the
    simulator runs one for all, where Megatron's [TP, DP, PP] on a rail fabric tells up to 32 kinds
    apart)."""

    tp: tuple[int, ...] | None = None
    schedules: tuple[str, ...] | None = None
    chunks: tuple[int, ...] = DEFAULT_CHUNKS
    micro_batches: tuple[int, ...] = DEFAULT_MICRO_BATCHES
    recompute: tuple[str, ...] = RECOMPUTE
    zero: tuple[int, ...] = (0, 1)
    sequence_parallel: tuple[bool, ...] = (False, True)
    max_stages: int | None = None
    devices: tuple[int, ...] | None = None
    gpus: int | None = None
    device_maps: tuple[str, ...] = ("sequential",)

    def __post_init__(self):
        for r in self.recompute:
            if r not in RECOMPUTE:
                raise ValueError(f"--recompute must be among {', '.join(RECOMPUTE)}; got {r!r}")
        for name, values in (("--tp", self.tp or ()), ("--devices", self.devices or ()),
                             ("--micro-batch", self.micro_batches),
                             ("--chunks", self.chunks)):
            for v in values:
                if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                    raise ValueError(f"{name} values must be integers >= 1; got {v!r}")
        for n in self.schedules or ():
            registry.get(n)
        from cost_models.cluster import MAPPINGS
        for m in self.device_maps:
            if m not in MAPPINGS:
                raise ValueError(f"--device-map must be among {', '.join(MAPPINGS)}; got {m!r}")

    def families(self) -> list[str]:
        return list(self.schedules) if self.schedules is not None else \
            [n for n in registry.names() if n not in EXCLUDED_BY_DEFAULT]


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
        """The JSON record of ``pipetwin plan --tp``: tp, devices, dp, schedule, chunks, variant,
        micro_batch, microbatches, recompute, zero, sequence_parallel, iteration_time,
        tokens_per_s, mfu (:func:`layout_mfu`), peak_memory (bytes: the worst GPU's static +
        activations), memory_need (with the transients), bubble_ratio, time_bound, memory_verdict."""
        lay, j, par = self.job.layout, self.job, self.job.parallel
        return {"tp": par.tp, "devices": lay.devices, "dp": lay.replicas, "gpus": j.gpus,
                "schedule": lay.schedule, "chunks": lay.chunks if registry.get(lay.schedule).takes_chunks else 1,
                "variant": lay.variant, "micro_batch": par.micro_batch, "microbatches": lay.microbatches,
                "recompute": par.recompute, "zero": par.zero, "sequence_parallel": par.sequence_parallel,
                "device_map": j.mapping, "iteration_time": self.iteration_time,
                "tokens_per_s": global_batch * model.seq_len / self.iteration_time,
                "mfu": layout_mfu(model, global_batch, self.iteration_time, j.gpus, peak_flops),
                "peak_memory": self.peak_memory, "memory_need": self.memory_need, "bubble_ratio": self.bubble_ratio,
                "time_bound": self.time_bound, "memory_verdict": self.verdict}


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
    (:func:`cost_models.transformer.megatron_flops`) / (time x GPUs x each GPU's peak)."""
    flops = megatron_flops(global_batch, model.seq_len, model.layers, model.hidden, model.vocab, recompute=False)
    return flops / (seconds * gpus * peak_flops)


def tensor_parallel_sizes(model: ModelSpec, cluster: Cluster, asked: tuple[int, ...] | None) -> list[int]:
    """T values: ``asked`` (each must divide the node size and split the model: one line if not),
    else every divisor of the node size that splits the model."""
    per = cluster.devices_per_node
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


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_gpus(cluster: Cluster, gpus: int | None) -> int:
    """The GPUs the layouts use: the cluster's, or ``gpus`` (a multiple of the node size, at most
    the cluster's)."""
    if gpus is None:
        return cluster.num_devices
    per = cluster.devices_per_node
    if gpus % per:
        raise ValueError(f"--gpus {gpus} is not a multiple of the {per} GPUs of a node of {cluster.name}; "
                         f"use a multiple of {per}")
    if gpus > cluster.num_devices:
        raise ValueError(f"--gpus {gpus} is more than the {cluster.num_devices} GPUs of {cluster.name}")
    return gpus


def candidates(model: ModelSpec, cluster: Cluster, global_batch: int, space: LayoutSpace = LayoutSpace(), *,
               cluster_choice: ClusterChoice | None = None, cost_model: str | None = None,
               memory_reserve: float | None = None) -> list[Job]:
    """Every job of the space on ``cluster`` at ``global_batch`` (R x micro-batch divides it; the
    family's own requirements are checked when it is built). ``cluster_choice``: how the jobs name
    the cluster (their costs come from ``cluster`` itself, :func:`plan_layouts`)."""
    gpus = check_gpus(cluster, space.gpus)
    choice = cluster_choice or ClusterChoice(name=cluster.name)
    tps = tensor_parallel_sizes(model, cluster, space.tp)
    most = min(model.layers, space.max_stages or model.layers, registry.MAX_RANKS)
    out = []
    for tp in tps:
        if gpus % tp:
            continue
        for D in _divisors(gpus // tp):
            if D > most:
                break
            if space.devices is not None and D not in space.devices:
                continue
            R = gpus // (tp * D)
            for mb in space.micro_batches:
                if global_batch % (R * mb):
                    continue
                N = global_batch // (R * mb)
                for name in space.families():
                    fam = registry.get(name)
                    for variant in [v for v in fam.variants if v not in fam.overlap_variants] or (None,):
                        for chunks in (space.chunks if fam.takes_chunks else (2,)):
                            if D * (chunks if fam.takes_chunks else 1) > model.layers:
                                continue
                            lay = Layout(schedule=name, devices=D, microbatches=N, replicas=R, chunks=chunks,
                                         variant=variant)
                            for rc, zero, sp, dmap in itertools.product(
                                    space.recompute, space.zero if R > 1 else (0,),
                                    space.sequence_parallel if tp > 1 else (False,), _distinct_maps(space, D, R)):
                                par = Parallel(tp=tp, micro_batch=mb, recompute=rc, zero=zero, sequence_parallel=sp)
                                out.append(Job(layout=lay, model=model, cluster=choice, parallel=par,
                                               cost_model=cost_model, memory_reserve=memory_reserve, device_map=dmap))
    return out


def _distinct_maps(space: LayoutSpace, D: int, R: int) -> tuple[str, ...]:
    """The device maps of ``space`` that place a D x R layout differently: with one pipeline device
    or one replica, Llama 3's [TP, PP, DP] and Megatron's [TP, DP, PP] are the same placement (the
    first named is kept), so their candidates would be the same job twice."""
    if D > 1 and R > 1:
        return space.device_maps
    same = {"sequential", "megatron"}
    kept = next((m for m in space.device_maps if m in same), None)
    return tuple(m for m in space.device_maps if m not in same or m == kept)


class _Bounds:
    """The per-layer costs behind the bounds, computed once per (micro-batch, T, SP, recompute,
    ZeRO, R): the job's own :func:`cost_models.bind.transformer_cost_model`."""

    def __init__(self, model: ModelSpec, cluster: Cluster):
        self.model, self.cluster = model, cluster
        self._work: dict = {}
        self._mem: dict = {}
        self._shapes: dict = {}
        self._counts: dict = {}
        self._acts: dict = {}

    def inputs(self, job: Job) -> CostInputs:
        return CostInputs("transformer", model=job.parallel.sized(self.model), cluster=self.cluster)

    def time(self, job: Job) -> float:
        lay, par = job.layout, job.parallel
        key = (par.micro_batch, par.tp, par.sequence_parallel, par.recompute)
        if key not in self._work:
            tcm = transformer_cost_model(job, self.inputs(job).model, self.cluster)
            c = tcm.layer_costs()
            self._work[key] = (sum(c.f) + sum(c.b_input) + sum(c.w), sum(c.f) + sum(c.b_input))
        work, path = self._work[key]
        return max(lay.microbatches * work / lay.devices, path)

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
        tcm = transformer_cost_model(job, self.inputs(job).model, self.cluster)
        try:
            costs = tcm.bind(sched)
        except ValueError as e:
            return str(e)
        par = job.parallel
        akey = (id(sched), par.micro_batch, par.tp, par.sequence_parallel, par.recompute)
        if akey not in self._acts:       # ZeRO changes the static bytes only: one walk for both
            self._acts[akey] = peak_activation(sched, costs)
        rep = MemoryReport(tuple(costs.static_mem), self._acts[akey], capacity, costs.mem_unit,
                           float(costs.meta.get("memory_transient") or 0.0), reserve)
        f = costs.f
        best = 0.0
        for held, counts in self._work_of(sched):
            start = min(sum(f[c][:s]) for c, s in held)
            busy = sum(n * costs.compute_time(k, c, s) for (k, c, s), n in counts.items())
            best = max(best, start + busy)
        return best, rep.max_peak + rep.transient, not rep.oom

    def _work_of(self, sched) -> list:
        """Per device of a built schedule: the (copy, stage) it holds and how many compute ops of
        each (kind, copy, stage) its program runs (kept with the shape)."""
        key = id(sched)
        if key not in self._counts:
            from collections import Counter
            self._counts[key] = [(sched.stages_on(d), Counter((op.kind, op.copy, op.stage) for op in sched.programs[d]
                                                               if op.kind in COMPUTE_KINDS))
                                 for d in range(sched.num_devices)]
        return self._counts[key]

    def memory(self, job: Job) -> float:
        lay, par = job.layout, job.parallel
        key = (par.micro_batch, par.tp, par.sequence_parallel, par.recompute, par.zero, lay.replicas)
        if key not in self._mem:
            tcm = transformer_cost_model(job, self.inputs(job).model, self.cluster)
            params = sum(float(x.params) for x in tcm.layers())
            self._mem[key] = (params * sum(tcm.static_split()), tcm.transient_bytes())
        static, transient = self._mem[key]
        return static / lay.devices + transient


def _order(job: Job) -> tuple:
    lay, par = job.layout, job.parallel
    return (par.tp, lay.devices, lay.schedule, lay.variant or "", lay.chunks, par.micro_batch,
            RECOMPUTE.index(par.recompute), par.zero, par.sequence_parallel, job.mapping)


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
                      memory_reserve=memory_reserve)
    gpus = check_gpus(cluster, space.gpus)
    if not jobs:
        most = min(model.layers, space.max_stages or model.layers, registry.MAX_RANKS)
        least = min(gpus // (t * d) for t in tensor_parallel_sizes(model, cluster, space.tp) if gpus % t == 0
                    for d in _divisors(gpus // t) if d <= most) * min(space.micro_batches)
        raise ValueError(f"-G {global_batch} is not divisible by R x micro-batch of any layout of {gpus:,} GPUs "
                         f"(R replicas, micro-batches {', '.join(map(str, space.micro_batches))}); use a multiple "
                         f"of {least:,}")
    capacity, reserve = memory_budget(cluster, memory_limit, memory_reserve)
    usable = usable_memory(capacity, reserve)
    bounds = _Bounds(model, cluster)
    cands = sorted((Candidate(j, bounds.time(j), bounds.memory(j)) for j in jobs),
                   key=lambda c: (c.time_bound, _order(c.job)))
    result = LayoutResult([], [], model, cluster, global_batch, usable, candidates=len(cands),
                          peak_flops=cluster.device.peak(_precision(model, cluster)))
    top: list[Confirmed] = []
    misses: list[tuple[float, Candidate | None]] = []
    # (bound, order, index, refined): a candidate comes up first on its cheap bound, then again on
    # its refined one (memory judged by the ledger in between), then it is confirmed
    heap = [(c.time_bound, _order(c.job), i, False) for i, c in enumerate(cands)]
    heapq.heapify(heap)
    refined: dict[int, float] = {}
    seen = 0
    while heap:
        tb, order, i, done = heapq.heappop(heap)
        if len(top) >= top_k and tb >= top[-1].iteration_time:
            break
        c = cands[i]
        if not done:
            seen += 1
            if progress is not None:
                progress(seen, len(cands))
            if c.memory_bound > usable:
                result.memory_pruned += 1
                misses.append((c.memory_bound, c))
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
                    continue
                tb = refined[i] = max(tb, t2)
            heapq.heappush(heap, (tb, order, i, True))
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
    device's memory less ``memory_reserve`` (None: the default reserve), as ``simulate`` judges."""
    if memory_limit is not None:
        return memory_limit, 0.0
    return cluster.device.memory_bytes, memory_reserve


def _precision(model: ModelSpec, cluster: Cluster) -> str:
    from cost_models.transformer import TransformerCostModel
    return TransformerCostModel(model, cluster.device).resolved_precision()


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
    return (f"no plan fits: the smallest needs {fmt_bytes(best)} per GPU, {fmt_bytes(best - usable)} more than the "
            f"{fmt_bytes(usable)} usable of {fmt_bytes(capacity)}; use more GPUs (nodes), a smaller model or "
            f"a device with more memory")


def brute_force(model: ModelSpec, cluster: Cluster, global_batch: int, space: LayoutSpace = LayoutSpace(), *,
                memory_limit: float | None = None, memory_reserve: float | None = None,
                cost_model: str | None = None) -> list[tuple[Candidate, object]]:
    """Every candidate of the space with what :func:`confirm` makes of it (bound, judged by the
    ledger and, when it fits, simulated): the reference the search must equal."""
    bounds = _Bounds(model, cluster)
    capacity, reserve = memory_budget(cluster, memory_limit, memory_reserve)
    out = []
    for j in candidates(model, cluster, global_batch, space, memory_reserve=memory_reserve, cost_model=cost_model):
        ref = bounds.refine(j, capacity, reserve)
        tb = bounds.time(j)
        if isinstance(ref, tuple):
            tb = max(tb, ref[0])
        c = Candidate(j, tb, bounds.memory(j))
        got = confirm(j, bounds.inputs(j), capacity, reserve, tb)
        if isinstance(ref, tuple):     # the refined verdict is the ledger's
            assert ref[2] == (not isinstance(got, tuple)), (j, ref, got)
        out.append((c, got))
    return out


def ranked(confirmed: list[Confirmed]) -> list[Confirmed]:
    """Confirmed candidates in the search's order: time, then the layout's fields."""
    return sorted(confirmed, key=lambda x: (x.iteration_time, _order(x.job)))
