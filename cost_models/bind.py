"""A job bound to its costs: :func:`bind` turns a :class:`~cost_models.job.Job` into the lowered
schedule, its per-op costs and the network it runs on, with the fields a report states.

How each cost source is costed:

* model x cluster: ``cost_model`` picks how layer times are computed from the model on the
  cluster's device: ``kernels`` (the default where the device preset has the kernel model's
  constants: :mod:`cost_models.kernels`; per-sample costs fall with the micro-batch) or ``linear``
  (FLOPs at the device's fixed efficiency: the same per sample at every micro-batch, the
  closed-form view). The ranks are placed on the cluster with ``device_map``.
* a per-layer profile in PipeDream's graph format (``model="FILE.txt"``, DAPPLE's released
  profiles): the workload at the micro-batch (default the profile batch, ``profile_batch`` or the
  ``pbs-B`` in the file name), scaled linearly from the profile batch as DAPPLE did unless
  ``cost_model="kernels"``, split over the schedule's stages by work.
* a calibration profile: on its own host (the ranks share its cores: the report's ``host``), or
  with a ``cluster`` scaled onto that cluster's devices (:func:`cost_models.scaled_layer_costs`:
  every measured time times this host's FLOP rate over the device's achievable one) and placed on
  its network. ``partition`` gives layers per stage, or ``"time"``: balanced by the profile's
  measured layer times.
* unit costs: F = 1, B = 2 per full stage, no network.
* stage costs (``stage_costs``, a user's FILE.yaml): its per-stage times, each message its fixed
  time (:mod:`cost_models.stage_costs`).
* a plan: the plan binds itself (:class:`cost_models.job.PlanSource`).

:func:`load_inputs` reads what the job names (presets and files: cheap), so that a caller costing
many schedules of one job (``pipetwin compare``) reads them once and runs the size checks before
building any schedule.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from schedules import Schedule

from .base import PEAK_FLOOR, PerLayerCostModel, StageCosts, UnitCostModel
from .profile import CalibrationProfile, load_profile, scaled_layer_costs
from .cluster import Cluster, tensor_parallel_groups
from .job import DEFAULT_MODEL, Job
from .fp8 import precision_label
from .kernels import COST_MODELS, check_priced, unpriced
from .model_spec import ModelSpec, load_model
from .hf_config import config_notes, is_hf_config
from .stage_costs import StageTimes, load_stage_costs
from .stack import is_model_ref, same_model_ref
from .segments import with_segments
from .moe import ExpertGroup
from .parallel import Parallel
from .memory import check_reserve
from .transformer import (ContextParallelGroup, DataParallelGroup, TensorParallelGroup, TransformerCostModel,
                          active_params, model_params)


@dataclass(frozen=True)
class Bound:
    """A job ready for an engine: ``lowered`` schedule, its ``costs``, the ``network`` it runs on
    (None with unit costs) and the ``report`` fields its cost source states (cost_model, model,
    micro_batch, cluster, device_map, memory_capacity, host, ...)."""

    lowered: Schedule
    costs: StageCosts
    network: object
    report: dict = field(default_factory=dict)


@dataclass(frozen=True)
class CostInputs:
    """What a job's cost source names, loaded: ``kind`` as :attr:`Job.source`; the model spec
    (transformer), the cluster (transformer, layer-profile; a profile's when scaled onto one), the
    calibration profile (profile)."""

    kind: str
    model: ModelSpec | None = None
    cluster: Cluster | None = None
    profile: CalibrationProfile | None = None
    stage_times: StageTimes | None = None

    def limits(self) -> dict:
        """Keyword arguments of :func:`cost_models.job.check_run_size` (cluster size, layers)."""
        size = {} if self.cluster is None else {"cluster_devices": self.cluster.num_devices,
                                                "cluster_name": self.cluster.name}
        if self.kind == "transformer":
            return {**size, "layers": self.model.layers + 2, "model_name": self.model.name}
        if self.kind == "profile":
            m = self.profile.model
            return {"layers": m.num_layers if self.profile.is_stack else m.layers + 2, "model_name": m.name, **size}
        return size


def cost_model_for(choice: str | None, device, profile: bool, model: ModelSpec | None = None, cp: int = 1) -> str:
    """The cost model to use: the one asked for, else linear for profiles, for devices without
    kernel constants, for blocks the kernel model does not price (``model``:
    :func:`cost_models.kernels.unpriced`: experts, latent attention, other head sizes) and for
    context parallelism (``cp`` > 1: its split attention is priced by the formulas), kernels
    otherwise. Kernels asked for such a block are refused in one line."""
    if choice is not None:
        if choice not in COST_MODELS:
            raise ValueError(f"--cost-model must be one of {', '.join(COST_MODELS)}; got {choice!r}")
        if choice == "kernels" and device.kernels is None:
            raise ValueError(f"--cost-model kernels needs the device's kernel constants; {device.name} has none "
                             f"(add a 'kernels:' block to its YAML, or use --cost-model linear)")
        if choice == "kernels" and model is not None:
            check_priced(model)
        return choice
    if profile or device.kernels is None or cp > 1 or (model is not None and unpriced(model) is not None):
        return "linear"
    return "kernels"


def cluster_cost_model(choice: str | None, cluster: Cluster, profile: bool, model: ModelSpec | None = None,
                       cp: int = 1) -> str:
    """:func:`cost_model_for` on a cluster: its device's, and on a mixed cluster one cost model for
    every pool (so their stage times compare): kernels only where every pool's device has kernel
    constants (asked for on one that has none: that device's one line), linear otherwise."""
    chosen = {cost_model_for(choice, p.device, profile, model, cp) for p in cluster.pools}
    return chosen.pop() if len(chosen) == 1 else "linear"


def check_profile_model(prof: CalibrationProfile, model, where: str = "--profile") -> None:
    """A model given with a calibration profile must be the profile's model."""
    if model is None:
        return
    if isinstance(model, ModelSpec):
        ok = model == prof.model
    else:
        ok = same_model_ref(model, prof.model_name) if is_model_ref(model) or prof.is_stack else \
            model == prof.model_name or load_model(model) == prof.model
    if not ok:
        name = model.name if isinstance(model, ModelSpec) else model
        raise ValueError(f"{where} {prof.name} was measured for model {prof.model_name}, not {name}; calibrate "
                         f"{name} (pipetwin calibrate --model {name}) or drop --model")


def check_profile_tp(prof: CalibrationProfile, tp: int, where: str = "--profile") -> None:
    """The tensor-parallel size asked for must be the one the profile was measured at (its layers
    are one TP rank's shards, its collectives the group's)."""
    if tp != prof.tp:
        raise ValueError(f"{where} {prof.name} was measured at --tp {prof.tp}, not --tp {tp}; calibrate with "
                         f"--tp {tp} (pipetwin calibrate --tp {tp}) or give --tp {prof.tp}")


def check_profile_ep(prof: CalibrationProfile, ep: int, where: str = "--profile") -> None:
    """The expert-parallel size asked for must be the one the profile was measured at (its MoE
    blocks' experts at that E's routed counts, its all-to-all the EP group's)."""
    if ep != prof.ep:
        raise ValueError(f"{where} {prof.name} was measured at --ep {prof.ep}, not --ep {ep}; calibrate with "
                         f"--ep {ep} (pipetwin calibrate --ep {ep}) or give --ep {prof.ep}")


def profile_partition(prof: CalibrationProfile, choice, num_stages: int) -> tuple[int, ...] | None:
    """Layers per stage over a calibration profile's layers: the given counts, ``"time"`` (balanced
    by the measured layer times) or None (the executor's default split)."""
    if choice == "time":
        return prof.time_partition(num_stages)
    return choice


def load_inputs(job: Job) -> CostInputs:
    """Load what the job's cost source names (a plan binds itself: not here)."""
    kind = job.source
    if kind == "unit":
        return CostInputs("unit")
    if kind == "stage-costs":
        times = load_stage_costs(job.stage_costs)
        times.check_devices(job.layout.devices)
        return CostInputs(kind, stage_times=times)
    if kind == "profile":
        prof = load_profile(job.profile)
        check_profile_model(prof, job.model)
        check_profile_tp(prof, job.parallel.tp)
        check_profile_ep(prof, job.parallel.ep)
        if prof.tp > 1 and job.cluster.name:
            raise ValueError(f"--profile {prof.name} was measured at --tp {prof.tp} on this host; scaling it onto "
                             f"--cluster {job.cluster.name} is modelled for profiles of --tp 1")
        mb = job.parallel.micro_batch
        if mb is not None and mb != prof.micro_batch:
            raise ValueError(f"profile {job.profile} was measured at micro-batch {prof.micro_batch}; calibrate "
                             f"again with --micro-batch {mb} (measured costs are not extrapolated)")
        cluster = job.cluster.load() if job.cluster.name else None
        if cluster is not None:
            check_mixed(cluster, f"--profile {prof.name} scaled onto it")
            check_reserve(job.memory_reserve, cluster.device.memory_bytes, cluster.device.name)
        return CostInputs("profile", profile=prof, cluster=cluster)
    if kind == "plan":
        raise ValueError("a plan job binds through its plan (cost_models.bind.bind)")
    cluster = job.cluster.load()
    for pool in cluster.pools:          # before any build; each pool's device (a mixed cluster's every kind)
        check_reserve(job.memory_reserve, pool.device.memory_bytes, pool.device.name)
    if kind == "layer-profile":
        check_mixed(cluster, f"a --model {job.model} layer profile")
        return CostInputs(kind, cluster=cluster)
    model = job.model if isinstance(job.model, ModelSpec) else load_model(job.model or DEFAULT_MODEL)
    model = job.parallel.sized(model)
    if cluster.is_mixed:
        check_mixed_job(job, model, cluster)
    return CostInputs(kind, model=model, cluster=cluster)


def check_mixed(cluster: Cluster, what: str) -> None:
    """A cost source priced on one device kind refuses a cluster of several pools in one line."""
    if cluster.is_mixed:
        raise ValueError(f"{what} is priced on one device kind, and cluster {cluster.name} has pools of "
                         f"{', '.join(p.name for p in cluster.pools)}; use --model with a model spec (priced per pool) "
                         f"or a one-pool --cluster")


def check_mixed_job(job: Job, model: ModelSpec, cluster: Cluster) -> None:
    """What a mixed cluster prices per pool: a dense model with T, D and R and ZeRO 0/1. The
    collectives folded into an op's cost (context parallelism's K/V exchange, the expert all-to-alls,
    ZeRO-2/3's per-micro-batch shards) run over groups that may join two pools, which those closed
    forms do not model: refused in one line."""
    par, name = job.parallel, cluster.name
    for bad, what in ((par.cp > 1, f"--cp {par.cp}"), (model.is_moe, f"the mixture of experts {model.name}"),
                      (par.zero >= 2, f"--zero {par.zero}")):
        if bad:
            raise ValueError(f"{what} on the mixed cluster {name}: its groups' collectives are priced for one pool; "
                             f"a mixed cluster prices dense models with --tp, -D, --dp and --zero 0/1 (or use a "
                             f"one-pool --cluster)")


def bind(job: Job, inputs: CostInputs | None = None) -> Bound:
    """The job's lowered schedule (built after the cheap size checks), its costs and network.
    ``inputs``: :func:`load_inputs` of this job's cost source, when the caller has them."""
    if job.plan is not None:
        return job.plan.bind(job)
    inputs = inputs or load_inputs(job)
    low = job.build(family=costed_family(job, inputs), **inputs.limits())
    bound = bind_lowered(job, inputs, low)
    if job.layout.schedule_file is not None:
        bound.report["schedule_file"] = job.layout.schedule_file.describe()
    return bound


def costed_family(job: Job, inputs: CostInputs) -> dict | None:
    """The keyword arguments a family that orders its ops from the job's costs takes (zb-auto:
    ``costs``, from the same layout costed as ZB-H1, which has its stages and split backward; the
    message time is one activation over the path from rank 0 to rank 1), else None."""
    if job.layout.schedule != "zb-auto" or job.layout.schedule_file is not None:
        return None
    from schedules.zb_auto import AutoCosts
    probe_job = job.with_layout(schedule="zb-h1", variant=None, memory_limit=None)
    probe = bind_lowered(probe_job, inputs, probe_job.build(**inputs.limits()))
    c, net = probe.costs, probe.network
    if inputs.kind == "stage-costs":
        message = inputs.stage_times.message
    elif net is None or job.layout.devices < 2:
        message = 0.0
    else:
        links = net.path(0, 1)
        message = sum(ln.latency for ln in links) + c.act_bytes[0][0] / min(ln.bandwidth for ln in links)
    return {"costs": AutoCosts(c.f[0], c.b[0], c.w[0], message, c.act[0], auto_limit(job.layout, c), c.act_w[0])}


def auto_limit(layout, c: StageCosts) -> tuple[float, ...]:
    """zb-auto's per-device activation limit in the unit of ``c.act``: the variant's k D Ma, or
    ``--memory-limit`` in Ma, or in bytes less each rank's static memory (weights, optimizer)."""
    from schedules.zb_auto import LIMIT_MA, VARIANTS
    if layout.memory_limit is None:
        k = LIMIT_MA[layout.variant or next(iter(VARIANTS))] * layout.devices
        return tuple(k * a for a in c.act[0])
    value, unit = layout.memory_limit
    if unit == "Ma":
        return tuple(value * a for a in c.act[0])
    if c.mem_unit != "B":
        raise ValueError(f"--memory-limit {value / 2**30:.3g} GiB needs costs with activation bytes; these count "
                         f"memory in Ma (give the limit in Ma, e.g. '16 Ma', or add 'activation:' to a --stage-costs "
                         f"file)")
    limit = tuple(value - c.static_mem[d] for d in range(layout.devices))
    if min(limit) <= 0:
        d = limit.index(min(limit))
        raise ValueError(f"--memory-limit {value / 2**30:.3g} GiB is below rank {d}'s weights and optimizer state "
                         f"({c.static_mem[d] / 2**30:.3g} GiB); raise it")
    return limit


def bind_lowered(job: Job, inputs: CostInputs, low: Schedule) -> Bound:
    """Costs and network of an already lowered schedule ``low`` under the job's cost source."""
    if inputs.kind == "unit":
        return Bound(low, UnitCostModel().bind(low), None, {"cost_model": "unit"})
    if inputs.kind == "stage-costs":
        times = inputs.stage_times
        return Bound(low, times.bind(low), times.network(), {"cost_model": f"stage costs {times.source}"})
    if inputs.kind == "profile":
        return calibrated(inputs.profile, low, cluster=inputs.cluster, device_map=job.mapping,
                          partition=job.partition, recompute=job.parallel.recompute, label=f"profile {job.profile}")
    cluster = inputs.cluster
    if inputs.kind == "transformer":
        return _transformer(job, inputs.model, cluster, low)
    _check_fits(low, cluster)
    placed = cluster.place(low, job.mapping)
    if inputs.kind == "layer-profile":
        if job.partition is not None:
            raise ValueError("--partition does not apply to a --model FILE.txt profile (it is split by work)")
        cost_model = cost_model_for(job.cost_model, cluster.device, True)
        costs, mb, part = _layer_profile_costs(job, low, cluster, cost_model)
        return Bound(low, costs, placed, {"cost_model": cost_model, "model": str(job.model),
                                          "device_fitted": cluster.device.provenance(), "micro_batch": mb,
                                          "partition": list(part), "cluster": cluster.name,
                                          "device_map": job.mapping,
                                          "memory_capacity": costs.meta.get("memory_capacity")})
    raise AssertionError(f"unhandled cost source {inputs.kind}")   # pragma: no cover


def transformer_cost_model(job: Job, model: ModelSpec, cluster: Cluster) -> TransformerCostModel:
    """The cost model of a job on the model x cluster formulas (``model``: its spec at the job's
    micro-batch, :func:`load_inputs`): its recompute, cost model, partition, T (the group's links
    on ``cluster``), sequence parallelism, overlap, ZeRO and replicas. The planner costs a layout
    without building its schedule from the same object."""
    par = job.parallel
    tp, unplaced = par.tp, cluster.with_device_map(None)
    group = TensorParallelGroup(unplaced, tp) if tp > 1 else None
    experts = ExpertGroup(unplaced, par.ep, par.etp, par.a2a_hierarchical, par.route_nodes,
                          model.top_k) if model.is_moe else None
    context = ContextParallelGroup(unplaced, tp, par.cp) if par.cp > 1 else None
    return TransformerCostModel(model, cluster.device, parallel=par,
                                compute=cost_model_for(job.cost_model, cluster.device, False, model, par.cp),
                                partition=job.partition, tp_group=group, replicas=job.layout.replicas,
                                grad_accumulation=job.grad_accumulation, expert_group=experts, cp_group=context,
                                **data_parallel_groups(job, unplaced))


def data_parallel_groups(job: Job, cluster: Cluster) -> dict:
    """ZeRO-2/3's ``dp_group`` (the S replicas of a shard group, with context parallelism the C GPUs
    of each, T apart, that hold the same weights) and, with HSDP, ``replicate_group`` (the R / S
    groups) of a job on ``cluster`` (unplaced): a replica is ``job.gpus / R`` consecutive GPUs, a
    shard group S consecutive replicas (torch's device mesh (replicate, shard)); {} below ZeRO-2."""
    par, R = job.parallel, job.layout.replicas
    if par.zero < 2:
        return {}
    S, C = par.dp_shard or R, par.cp
    per_replica = job.gpus // R
    return {"dp_group": DataParallelGroup(cluster, S, per_replica, C, par.tp) if S * C > 1 else None,
            "replicate_group": DataParallelGroup(cluster, R // S, per_replica * S) if R // S > 1 else None}


def stated(job: Job, inputs: CostInputs, model_ref=None) -> dict:
    """What the job's numbers assume, as report fields (simulate, compare, sweep and plan show them):
    for a model's formulas ``seq_len``, ``precision`` (the cost model's resolved one), ``cost_model``
    and ``assumptions`` (one line per approximation of a Hugging Face config,
    :func:`cost_models.hf_config.config_notes`; ``model_ref``: the config's path where the job holds
    the spec); ``device_fitted`` (where the device's constants come from) wherever a cluster's
    device prices the work, and one line per datasheet field the device leaves out
    (:meth:`cost_models.device.DeviceSpec.notes`). Empty for unit costs, a stage-costs file and a
    profile on its own host."""
    if inputs.kind == "transformer" and inputs.cluster.is_mixed:    # each pool's device, joined
        job = replace(job, cost_model=cluster_cost_model(job.cost_model, inputs.cluster, False, inputs.model,
                                                         job.parallel.cp))
        said = [stated(job, replace(inputs, cluster=inputs.cluster.pool_cluster(i)), model_ref)
                for i in range(len(inputs.cluster.pools))]
        out = {k: " | ".join(dict.fromkeys(str(x[k]) for x in said)) for k in ("precision", "cost_model",
                                                                                  "device_fitted")}
        return {**said[0], **out, "assumptions": list(dict.fromkeys(a for x in said for a in x["assumptions"]))}
    if inputs.kind == "transformer":      # none of these depends on the layout (a sweep's grid varies it)
        dev, model = inputs.cluster.device, job.parallel.sized(inputs.model)
        tcm = TransformerCostModel(model, dev, parallel=Parallel(precision=job.parallel.precision,
                                                                 fp8_recipe=job.parallel.fp8_recipe),
                                   compute=cost_model_for(job.cost_model, dev, False, model, job.parallel.cp))
        return _stated(job, model, dev, tcm, model_ref)
    return {"device_fitted": inputs.cluster.device.provenance()} if inputs.cluster is not None else {}


def _stated(job: Job, model: ModelSpec, device, tcm: TransformerCostModel, model_ref=None) -> dict:
    return stated_fields(model, device, tcm.compute, precision_label(tcm.resolved_precision(), tcm.fp8_recipe()),
                         job.model if model_ref is None else model_ref, job.parallel.seq_len, job.parallel.precision)


def stated_fields(model: ModelSpec, device, cost_model: str, precision: str, model_ref=None,
                  seq_len: int | None = None, precision_given: str | None = None) -> dict:
    """The fields of :func:`stated` from their parts (a planner that prices a spec without a job
    uses it too): ``model`` as priced, its resolved ``precision``; ``model_ref`` the name or path
    the user gave, with the ``--seq-len`` and ``--precision`` given (None: not given)."""
    notes = config_notes(model_ref, seq_len, precision_given) \
        if isinstance(model_ref, str) and is_hf_config(model_ref) else ()
    return {"seq_len": model.seq_len, "precision": precision, "cost_model": cost_model,
            "device_fitted": device.provenance(), "assumptions": [*notes, *device.notes()]}


def _transformer(job: Job, model: ModelSpec, cluster: Cluster, low: Schedule) -> Bound:
    """A model spec's formulas on a cluster, T x C x D x R: every rank a pipeline device of T
    tensor-parallel x C context-parallel GPUs (:func:`cost_models.cluster.tensor_parallel_groups`),
    its collectives and K/V exchanges on the groups' links. The cluster's size was checked before
    the build (:func:`cost_models.job.check_run_size`, with T and C)."""
    par = job.parallel
    tp, cp = par.tp, par.cp
    if cluster.is_mixed:
        return _mixed_transformer(replace(job, cost_model=cluster_cost_model(job.cost_model, cluster, False, model,
                                                                             cp)), model, cluster, low)
    tcm = transformer_cost_model(job, model, cluster)
    cost_model = tcm.compute
    costs = with_segments(tcm.bind(low), low, tcm)
    return Bound(low, costs, tensor_parallel_groups(cluster, tp, cp).place(low, job.mapping), {
        "cost_model": cost_model, "model": model.name, **_stated(job, model, cluster.device, tcm),
        "parameters": model_params(model),
        **({"active_parameters": active_params(model), "ep": par.ep, "etp": par.etp,
            "a2a_per_moe_layer": sum(tcm.a2a_times())} if model.is_moe else {}),
        "micro_batch": model.micro_batch, "cluster": cluster.name, "device_map": job.mapping,
        **(_cp_report(tcm, low) if cp > 1 else {}),
        "gpus": low.num_ranks * tp * cp, "tp": tp, "sequence_parallel": par.sequence_parallel,
        "tp_overlap": par.tp_overlap,
        "zero": par.zero, **fsdp_lines(costs.meta.get("fsdp")), **job.cluster.shape_report(),
        "memory_capacity": costs.meta.get("memory_capacity"), "memory_transient": costs.meta["memory_transient"],
        "memory_reserve": job.memory_reserve})


def mixed_costs(low: Schedule, per_pool: dict[int, StageCosts], rank_pool: tuple[int, ...]) -> StageCosts:
    """One :class:`StageCosts` from the schedule costed on each pool's device (``per_pool``: pool ->
    costs, ``rank_pool``: rank -> pool): every rank's ops priced on its own device
    (``kinds`` / ``rank_kinds``), the tables per (copy, stage) those of the pool of the replica-0
    rank holding it, static memory and optimizer time each rank's own. The memory capacity is
    per rank (``meta["memory_capacity_by_rank"]``; ``memory_capacity`` the least of them)."""
    used = sorted(per_pool)
    index = {p: i for i, p in enumerate(used)}
    kinds = tuple(per_pool[p] for p in used)
    rank_kinds = tuple(index[p] for p in rank_pool)
    kind_of = [[rank_kinds[low.placement[c][s]] for s in range(low.num_stages)] for c in range(low.num_copies)]

    def table(name):
        rows = [getattr(k, name) for k in kinds]
        if rows[0] is None:
            return None
        return tuple(tuple(rows[kind_of[c][s]][c][s] for s in range(low.num_stages))
                     for c in range(low.num_copies))
    first = kinds[rank_kinds[0]]
    caps = tuple(kinds[k].meta.get("memory_capacity") for k in rank_kinds)
    meta = {k: v for k, v in first.meta.items() if k != PEAK_FLOOR}
    meta.update(device=" + ".join(dict.fromkeys(k.meta.get("device", "") for k in kinds)),
                memory_capacity_by_rank=caps, memory_capacity=min(caps) if all(caps) else None,
                memory_transient=max(k.meta.get("memory_transient") or 0.0 for k in kinds))
    return replace(first, f=table("f"), b=table("b"), w=table("w"), phases_f=table("phases_f"),
                   phases_b=table("phases_b"),
                   static_mem=tuple(kinds[k].static_mem[r] for r, k in enumerate(rank_kinds)),
                   optim_time=tuple(kinds[k].optim_time[r] for r, k in enumerate(rank_kinds)),
                   meta=meta, kinds=kinds, rank_kinds=rank_kinds)


def _mixed_transformer(job: Job, model: ModelSpec, cluster: Cluster, low: Schedule) -> Bound:
    """A model spec's formulas on a cluster of several pools: the ranks placed (T x C GPUs a rank,
    never across two pools: :func:`cost_models.cluster.tensor_parallel_groups`), the schedule costed
    once per pool a rank sits on, on that pool alone (its device, its links for the TP collectives),
    and each rank's ops priced by its own pool (:func:`mixed_costs`). The report states each pool's
    device and ``pools`` (name, device, GPUs, ranks)."""
    par = job.parallel
    net = tensor_parallel_groups(cluster, par.tp, par.cp).place(low, job.mapping)
    rank_pool = tuple(net.pool_of(r) for r in range(low.num_ranks))
    tcms = {p: transformer_cost_model(job, model, cluster.pool_cluster(p)) for p in sorted(set(rank_pool))}
    costs = mixed_costs(low, {p: t.bind(low) for p, t in tcms.items()}, rank_pool)
    said = [_stated(job, model, cluster.pools[p].device, t) for p, t in tcms.items()]
    stated_ = {k: " | ".join(dict.fromkeys(str(x[k]) for x in said)) for k in ("precision", "cost_model",
                                                                                "device_fitted")}
    stated_.update(seq_len=said[0]["seq_len"],
                   assumptions=list(dict.fromkeys(a for x in said for a in x["assumptions"])))
    pools = [{"name": p.name, "device": p.device.name, "gpus": p.num_devices,
              "ranks": [r for r in range(low.num_ranks) if rank_pool[r] == i]} for i, p in enumerate(cluster.pools)]
    return Bound(low, costs, net, {
        "model": model.name, **stated_, "parameters": model_params(model), "micro_batch": model.micro_batch,
        "cluster": cluster.name, "device_map": job.mapping, "gpus": low.num_ranks * par.tp * par.cp, "tp": par.tp,
        "sequence_parallel": par.sequence_parallel, "tp_overlap": par.tp_overlap, "zero": par.zero,
        **job.cluster.shape_report(), "memory_capacity": costs.meta["memory_capacity"],
        "memory_capacity_by_rank": list(costs.meta["memory_capacity_by_rank"]),
        "memory_transient": costs.meta["memory_transient"], "memory_reserve": job.memory_reserve, "pools": pools})


def _cp_report(tcm: TransformerCostModel, low: Schedule) -> dict:
    """The report fields of context parallelism: C, how K/V is exchanged, one block's exchange per
    micro-batch on one GPU (bytes and seconds, F and B, exposed) and the step's on the busiest
    pipeline device, with what of it hides behind the attention compute."""
    x = tcm.cp_exchange()
    step, hidden = tcm.cp_step_comm(low)
    return {"cp": tcm.parallel.cp, "cp_comm": tcm.parallel.cp_comm,
            "cp_exchange_per_layer": {"f_bytes": x.f_bytes, "b_bytes": x.b_bytes, "f_time": x.f_time,
                                      "f_exposed": x.f_exposed, "b_time": x.b_time, "b_exposed": x.b_exposed},
            "cp_time": step, "cp_hidden": hidden}


def fsdp_lines(fsdp: dict | None) -> dict:
    """Report fields of ZeRO-2/3 (``StageCosts.meta["fsdp"]``): ``fsdp`` the per-stage record (JSON)
    and ``fsdp_collectives``, one line for the stage that moves the most (its times per micro-batch and
    at the step's end; a GPU holding several stages runs each one's)."""
    if not fsdp:
        return {}
    from .memory import fmt_bytes
    st = max(fsdp["stages"], key=lambda x: x["bytes_per_microbatch"] + x["bytes_step_end"])
    i = fsdp["stages"].index(st)
    S, G = fsdp["shard"], fsdp["replicate_groups"]
    C = fsdp.get("cp", 1)
    where = f"over {S} replicas" + (f" x C={C} ({S * C} GPUs)" if C > 1 else "") + \
        (f", {G} replicate groups (HSDP)" if G > 1 else "")
    gathers = f", all-gathers {st['f']:.3g} s in F and {st['b']:.3g} s in B" if fsdp["reshard_after_forward"] else ""
    line = (f"ZeRO-{fsdp['zero']} {where}: per micro-batch reduce-scatter {st['w']:.3g} s in W{gathers} (behind the "
            f"compute), step end {st['step_end']:.3g} s; stage {i}'s GPUs send {fmt_bytes(st['bytes_per_microbatch'])} "
            f"+ {fmt_bytes(st['bytes_step_end'])} each a step (per micro-batch + step end)")
    return {"fsdp": fsdp, "fsdp_collectives": line}


def _check_fits(low: Schedule, cluster: Cluster) -> None:
    if low.num_ranks > cluster.num_devices:
        raise ValueError(f"{low.num_ranks} ranks (D={low.num_devices} x R={low.replicas}) do not fit on cluster "
                         f"{cluster.name} with {cluster.num_devices} devices; pick a bigger --cluster")


def _layer_profile_costs(job: Job, low: Schedule, cluster: Cluster, cost_model: str):
    """StageCosts of a PipeDream/DAPPLE profile: its workload at the micro-batch (default the
    profile batch), a work-balanced contiguous partition over the schedule's stages."""
    from .partition import balanced_edges
    from .workloads.workload_sources import load_workload
    work = load_workload(job.model, cluster.device, recompute=job.parallel.recompute, cost_model=cost_model,
                         profile_batch=job.profile_batch)
    mb = job.parallel.micro_batch if job.parallel.micro_batch is not None else work.source["profile_batch"]
    S = low.num_stages
    if S > work.num_layers:
        raise ValueError(f"{S} stages but the profile has {work.num_layers} layers; use fewer devices/chunks")
    t = work.at(mb)
    edges = balanced_edges([t.fwd(i, i + 1) + t.bwd(i, i + 1) for i in range(work.num_layers)], S)
    part = tuple(edges[i + 1] - edges[i] for i in range(S))
    costs = PerLayerCostModel(work.layer_costs(mb), part).bind(low)
    costs.meta.update(memory_capacity=cluster.device.memory_bytes)
    return costs, mb, part


def calibrated(prof: CalibrationProfile, low: Schedule, *, cluster: Cluster | None = None,
               device_map: str = "sequential", partition=None, recompute: str = "none",
               label: str = "profile") -> Bound:
    """A lowered schedule costed from calibration profile ``prof``: on its own host (``cluster``
    None: cpu ranks sharing the calibrated cores, report field ``host``) or scaled onto
    ``cluster`` (the module docstring's scaling, placed with ``device_map``). ``partition``: layer
    counts, ``"time"`` or None (the executor's split)."""
    part = profile_partition(prof, partition, low.num_stages)
    if cluster is None:
        costs = prof.cost_model(low.num_stages, part, recompute=recompute).bind(low)
        net = prof.cluster(low.num_ranks)
        return Bound(low, costs, net, {"cost_model": label, "cluster": net.name, "micro_batch": prof.micro_batch,
                                       "host": prof.host_cores()})
    if recompute != "none":
        raise ValueError("--recompute with a profile scaled onto a cluster is not modelled; use none")
    _check_fits(low, cluster)
    layers, factor = scaled_layer_costs(prof, cluster.device)
    costs = PerLayerCostModel(layers, part or prof.default_partition(low.num_stages)).bind(low)
    costs.meta.update(memory_capacity=cluster.device.memory_bytes)
    return Bound(low, costs, cluster.place(low, device_map), {
        "cost_model": f"{label} scaled onto {cluster.device.name} (measured times x {factor:.3g}: this host's FLOP "
                      f"rate / the device's achievable fp32 rate)",
        "device_fitted": cluster.device.provenance(), "cluster": cluster.name, "micro_batch": prof.micro_batch,
        "device_map": device_map,
        "memory_capacity": cluster.device.memory_bytes})


EMULATED_MIN = 0.01     # pool_slowdowns: a rank less than 1 % slower than on the fastest pool is not slowed
EMULATED_MAP = "by-pool"   # pool_slowdowns: where a run's ranks sit on a mixed cluster unless --device-map says


@dataclass(frozen=True)
class PoolEmulation:
    """How a run emulates a mixed cluster's pools on one kind of device (:func:`pool_slowdowns`):
    ``slowdown`` the (rank, k) pairs (:class:`cost_models.job.Faults`' ``slowdown``), ``mapping`` the
    device map that placed the ranks, ``cost_model`` what priced the ratios, ``partition`` the layers
    per stage the ratios were priced for (the run's), ``pools`` each rank's pool, ``latency_bound``
    whether the job's kernel model priced every pool within :data:`EMULATED_MIN` (then the linear
    model priced them)."""

    cluster: str
    slowdown: tuple[tuple[int, float], ...]
    mapping: str
    cost_model: str
    partition: tuple[int, ...]
    pools: tuple[int, ...]
    typed: bool
    latency_bound: bool = False

    def line(self) -> str:
        """The run's output line: where the ranks sit, what priced their slowdowns, the partition."""
        why = (" (the kernel model prices this model's ops latency-bound, alike on every pool: the linear "
               "model's FLOPs at each device's efficiency instead)" if self.latency_bound else "")
        part = "typed split of the planner" if self.typed else "--partition"
        return (f"emulated {self.cluster}: ranks on pools {list(self.pools)} (device map {self.mapping}), slowdowns "
                f"priced with the {self.cost_model} cost model{why}; layers per stage {list(self.partition)} ({part})")


def _stage_pools(job: Job) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(each rank's pool, each stage's pool: its first rank's) of ``job`` placed on its cluster."""
    bound = bind(job)
    kinds, low = bound.costs.rank_kinds, bound.lowered
    return tuple(kinds), tuple(kinds[min(low.stage_group(s))] for s in range(low.num_stages))


def pool_slowdowns(job: Job) -> PoolEmulation | None:
    """What emulates a mixed cluster's pools in a run of ``job`` on one kind of device; None on a
    one-pool cluster. The rule, in one place:

    * **placement**: the job's ``device_map``, else :data:`EMULATED_MAP` (pipeline device d of D on
      pool ``d * P // D``, its replicas on that pool: :func:`cost_models.cluster.by_pool_map`, the
      type-aware planner's placement), so a run spans the pools;
    * **cost model**: the job's (:func:`cluster_cost_model`); when it was not asked for and the
      kernel model prices the model's layers (F + B + W per micro-batch, summed) within
      :data:`EMULATED_MIN` on every pool (a tiny model's ops are latency-bound), the linear model
      (FLOPs at each device's fixed efficiency: the ratio of the devices' achievable peaks);
    * **partition**: the job's, else the planner's typed split
      (:func:`cost_models.partition.typed_split` with each stage's pool fixed: the slowest stage
      fastest, more layers on the faster pool's stages);
    * **factor**: rank r on a slower pool gets k = its step's compute (every F, B and W of its
      program, priced on its own pool's device) over the same ops priced on the fastest pool's
      device; ranks within :data:`EMULATED_MIN` of k = 1 are left out.

    For a uniform-layer model of c seconds per layer on the fast kind and rho = the slow kind's time
    over the fast kind's, a stage of n layers on the slow pool gets k = n rho c / (n c) = rho."""
    from .partition import typed_split
    from .workloads.workload_sources import load_workload
    inputs = load_inputs(job)
    cluster = inputs.cluster
    if cluster is None or not cluster.is_mixed:
        return None
    mapping = job.device_map or EMULATED_MAP
    job = replace(job, device_map=mapping)
    cm = cluster_cost_model(job.cost_model, cluster, False, inputs.model, job.parallel.cp)
    q = job.parallel.micro_batch or inputs.model.micro_batch

    def layer_times(cost_model):
        ats = [load_workload(inputs.model, p.device, job.parallel.recompute, cost_model, None).at(q)
               for p in cluster.pools]
        return [[(a.f[x] + a.b_input[x] + a.w[x]) * q for x in range(len(a.f))] for a in ats]

    times = layer_times(cm)
    totals = [sum(t) for t in times]
    latency = job.cost_model is None and cm == "kernels" and max(totals) <= min(totals) * (1 + EMULATED_MIN)
    if latency:
        cm = "linear"
        times = layer_times(cm)
    job = replace(job, cost_model=cm)
    pools, stage_pools = _stage_pools(job)
    part, typed = job.partition, job.partition is None
    if typed:
        got = typed_split(times, len(stage_pools), [len(stage_pools)] * len(times), sequence=stage_pools)
        if got is None:
            raise ValueError(f"cannot split {len(times[0])} layers of {inputs.model.name} into {len(stage_pools)} "
                             f"stages")
        part = got.counts
        job = replace(job, partition=part)
    bound = bind(job)
    c, low = bound.costs, bound.lowered
    out = []
    for r in range(low.num_ranks):
        ops = [o for o in low.program(r) if o.kind in ("F", "B", "W")]
        t = [sum(k.compute_time(o.kind, o.copy, o.stage) for o in ops) for k in c.kinds]
        own, best = t[c.rank_kinds[r]], min(t)
        if best > 0 and own > best * (1 + EMULATED_MIN):
            out.append((r, own / best))
    return PoolEmulation(cluster=cluster.name, slowdown=tuple(out), mapping=mapping, cost_model=cm,
                         partition=tuple(part), pools=pools, typed=typed, latency_bound=latency)
