"""Plan files: a job record plus the planner's facts, for ``pipetwin simulate --plan`` and ``pipetwin run --plan``.

A plan file (version 2) is JSON. Both planners write the same head: the format, the version, which
planner wrote it and the **job** it plans, as the job's own records (:class:`cost_models.job.Layout`,
:class:`cost_models.parallel.Parallel`), beside the model and the cluster it was planned for::

    {
      "format": "pipetwin-plan", "version": 2, "planner": "layout" | "dapple",
      "job": {"layout": {"schedule", "devices" (D), "microbatches" (N), "replicas" (R), "chunks", "variant",
                         "memory_limit", "stage_replicas" (DAPPLE's r_s per stage, or null)},
              "parallel": {"tp", "sequence_parallel", "tp_overlap", "zero", "recompute", "micro_batch", "seq_len"},
              "partition": layers per stage of the schedule (null: the default split),
              "device_map": a mapping name or null, "placement": rank -> device id (a DAPPLE plan's) or null,
              "cost_model", "memory_reserve"},
      "model": {"kind": "transformer", "name", "spec": {...ModelSpec fields...}, ...}
               or a DAPPLE workload's source ({"kind": "paper", "name": "vgg-19", ...}, {"kind": "calibrated", ...}),
      "cluster": {...Cluster.to_dict(): nodes, devices_per_node, device, intra, inter, nics_per_node...},
      "memory_limit": bytes per device (null: the device's memory),
      ... the planner's facts
    }

The facts of the whole-layout search (``pipetwin plan``'s default for GPT and Llama, :mod:`planner.layout`):
``"global_batch"`` and ``"simulated"`` (the planner's record of the layout). The facts of the
DAPPLE planner: ``"plan"`` ({"global_batch", "microbatches" (M), "micro_batch" (b = G / M),
"policy", "schedule", "chunks", "split" (layers per stage of a schedule with other stages than
the plan's, [] = the stages' own), "stages": [{"layers": [start, stop], "replicas": r, "devices":
[physical ids]}, ...]}), ``"uniform"``, ``"run"`` (a uniform plan's flat view for other tools:
schedule, devices, microbatches, dp, chunks, micro_batch per replica, partition, device_map; null
otherwise), ``"estimate"`` and ``"simulated"``. A DAPPLE plan's job is what its facts give
(:meth:`LoadedPlan.run_job`): a non-uniform plan is DAPPLE's ``stage_replicas`` with M x lcm(r_s)
sub-batches; reading checks that the two agree.

Version 1 files (the same facts; a whole-layout plan's ``"kind": "layout"`` with a flat
``"layout"`` including ``"tp"`` and the parallel fields beside it) are still read.

Layers are global indices of the model's layer stack (for a transformer: 0 = embedding,
1..L = blocks, L + 1 = head). Device ids are ``node * devices_per_node + local``.

``simulate --plan`` binds a plan (:meth:`LoadedPlan.bind`, :meth:`LayoutPlan.bind`); a training run
takes its job: ``executor.RunConfig(job=plan.run_job(), placement=plan.placement)`` for a DAPPLE
plan, ``RunConfig(job=plan.run_job())`` for a whole-layout one.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from pathlib import Path

from cost_models import Cluster, cluster_from_dict
from cost_models.bind import Bound
from cost_models._spec import size_bytes
from cost_models.files import FileError, check_kind, data_or_none, one_line, parse_json, read_text, write_output
from cost_models.model_spec import spec_from_dict
from cost_models.parallel import Parallel
from cost_models.stack import absolute_model_ref
from schedules import ScheduleError
from schedules.registry import MAX_OPS

from cost_models.workloads.workload_sources import workload_from_source
from .plan import Plan
from .simulate import (Built, DapplePlanFacts, PlanInMemory, SimOutcome, build_plan, plan_placement,
                       simulate_plan)
from cost_models.workloads.workload import Workload

FORMAT, VERSION = "pipetwin-plan", 2
READS = (1, 2)      # the versions this pipetwin reads


JOB_FIELDS = ("layout", "parallel", "partition", "device_map", "placement", "cost_model", "memory_reserve")


def job_record(job, placement=None) -> dict:
    """A plan file's ``"job"``: the job's layout and parallel records, its partition, device map or
    explicit ``placement`` (rank -> device id), cost model and memory reserve (the model and the
    cluster are the file's own fields)."""
    lay = {f.name: getattr(job.layout, f.name) for f in fields(job.layout) if f.name != "schedule_file"}
    plain = lambda v: list(v) if isinstance(v, tuple) else v   # noqa: E731
    return {"layout": {k: plain(v) for k, v in lay.items()}, "parallel": job.parallel.record(),
            "partition": plain(job.partition), "device_map": job.device_map,
            "placement": None if placement is None else list(placement),
            "cost_model": job.cost_model, "memory_reserve": job.memory_reserve}


def plan_record(plan: Plan, work: Workload, cluster: Cluster, memory_limit: float | None = None,
                est=None, sim: SimOutcome | None = None) -> dict:
    run = None
    if plan.uniform:
        R = plan.dp
        run = {"schedule": plan.schedule, "devices": plan.num_stages, "microbatches": plan.microbatches,
               "dp": R, "chunks": plan.chunks, "micro_batch": plan.micro_batch // R,
               "partition": list(plan.schedule_partition), "device_map": list(plan.device_map())}
    job = LoadedPlan(plan, work, cluster, memory_limit, {}).planned_job()
    return {"format": FORMAT, "version": VERSION, "planner": "dapple", "job": job_record(job, plan_placement(plan)),
            "model": dict(work.source), "cluster": cluster.to_dict(),
            "memory_limit": memory_limit, "plan": plan.to_dict(), "uniform": plan.uniform, "run": run,
            "estimate": est.to_dict() if est is not None else None,
            "simulated": sim.to_dict() if sim is not None else None}


def save_plan(path, plan: Plan, work: Workload, cluster: Cluster, memory_limit: float | None = None,
              est=None, sim: SimOutcome | None = None) -> dict:
    rec = plan_record(plan, work, cluster, memory_limit, est, sim)
    write_output(path, json.dumps(rec, indent=2) + "\n", "plan file")
    return rec


@dataclass
class LoadedPlan(DapplePlanFacts):
    """A plan file read back: the plan, the model's workload, the cluster and the memory limit."""

    plan: Plan
    workload: Workload
    cluster: Cluster
    memory_limit: float | None
    record: dict
    path: str = "plan"      # the file it was read from (a job's plan source, see :meth:`bind`)

    @property
    def capacity(self) -> float | None:
        return self.memory_limit if self.memory_limit is not None else self.workload.memory_capacity

    def build(self, *, eager: bool = True, check: bool = True) -> Built:
        """The lowered schedule, its StageCosts and the cluster with the plan's device map
        (``.astuple()`` gives ``(lowered, costs, network)`` for :func:`sim.simulate`)."""
        return build_plan(self.plan, self.workload, self.cluster, self.capacity, eager=eager, check=check)

    def bind(self, job) -> Bound:
        """The plan as a bound job (:class:`cost_models.job.PlanSource`): its lowered schedule
        (gradients all-reduced eagerly as ``job.eager`` says), costs and placed cluster, with the
        report fields of :func:`build_plan` and the plan file. What-ifs on the same plan: the
        cluster rewired as ``job.cluster`` says (``--fabric`` ...) and ``job.memory_reserve``; its
        layer costs were planned with their cost model and it has no tensor-parallel group, so
        ``job.cost_model`` and ``job.parallel.tp_overlap`` are refused."""
        if job.cost_model is not None or job.parallel.tp_overlap:
            raise ValueError(f"{'--cost-model' if job.cost_model is not None else '--tp-overlap'}: a DAPPLE plan "
                             f"fixes its layer costs and has T 1 ({self.path}); plan again")
        cluster = job.cluster.shape(self.cluster)
        bound = PlanInMemory(self.plan, self.workload, cluster, self.capacity, path=self.path).bind(job)
        return Bound(bound.lowered, bound.costs, bound.network,
                     {**bound.report, **job.cluster.shape_report(), "memory_reserve": job.memory_reserve,
                      "plan_file": str(self.path)})

    def simulate(self, faults=None) -> SimOutcome:
        """The plan simulated as :func:`planner.simulate.simulate_plan` does (``faults``: a
        :class:`cost_models.job.Faults`)."""
        return simulate_plan(self.plan, self.workload, self.cluster, self.capacity, faults)

    def _planned(self, eager: bool) -> tuple:
        """(the plan as a job with its model left open, the plan built): one build for both."""
        from cost_models.job import Job, Layout
        bt = self.build(eager=eager, check=False)
        plan = self.plan
        if plan.uniform:
            per, layout = plan.micro_batch // plan.dp, Layout(
                schedule=plan.schedule, devices=plan.num_stages, microbatches=plan.microbatches, replicas=plan.dp,
                chunks=plan.chunks)
        else:
            C = bt.extra["sub_batches"]
            per, layout = plan.micro_batch // C, Layout(
                schedule="dapple", devices=bt.lowered.num_devices, microbatches=plan.microbatches * C,
                stage_replicas=tuple(plan.replicas))
        job = Job(layout=layout, parallel=replace(self.parallel, micro_batch=per),
                  partition=tuple(bt.costs.meta["partition"]), eager=eager)
        return job, bt

    def planned_job(self, *, eager: bool = True, device_map: str | None = None, model=None):
        """The plan as a job (:class:`cost_models.job.Job`): the very schedule the simulator runs (a
        uniform plan: its family on D = stages with R replicas; a non-uniform one: DAPPLE's
        ``stage_replicas`` with the M x C sub-batches as micro-batches), the samples per IR
        micro-batch, the IR stages' layers as the partition and the recomputation the plan's
        memory assumed; ``model``: what it trains (None: left open)."""
        return replace(self._planned(eager)[0], model=model, device_map=device_map)

    def trained_model(self):
        """What a run of the plan trains: the transformer's spec, or the profile's model file
        ``PATH.py:FUNC`` (written absolute; an older or hand-moved plan's relative path is taken
        beside the plan file). Raises ValueError for the paper's layer-cost models."""
        src = self.workload.source
        if src.get("kind") == "calibrated" and src.get("stack"):
            return absolute_model_ref(src["name"], Path(self.path).parent)
        spec = self.workload.spec.to_dict() if self.workload.spec is not None else src.get("spec")
        if spec is None:
            raise ValueError(f"the executor trains transformer models and model files; {self.workload.name} is a "
                             f"layer-cost model (the plan can be simulated, not run)")
        return spec_from_dict(dict(spec), f"plan model {src.get('name', self.workload.name)}")

    def run_job(self, *, eager: bool = True, device_map: str | None = None):
        """The job a training run of the plan takes (:meth:`planned_job` with :meth:`trained_model`:
        ``executor.RunConfig(job=..., placement=plan.placement)``); ``device_map``: a mapping name in
        place of the plan's placement."""
        return self.planned_job(eager=eager, device_map=device_map, model=self.trained_model())

    @property
    def placement(self) -> tuple[int, ...]:
        """Rank -> the plan cluster's device id: where the plan puts each rank of :meth:`run_job`."""
        return plan_placement(self.plan)

    def for_executor(self, *, eager: bool = True) -> dict:
        """How ``pipetwin run --plan`` describes the run of a transformer or model-file plan: the
        very lowered schedule the simulator runs (:func:`planner.simulate.build_plan`; its IR form is
        described there) and how it is fed:

        ``schedule`` (lowered Schedule), ``model`` (name), ``microbatches`` (IR micro-batches per
        pipeline replica: M for a uniform plan, M x C sub-batches for a non-uniform one),
        ``replicas`` (the IR's R; 1 for non-uniform plans), ``micro_batch`` (samples per IR
        micro-batch: b / R, or b / C), ``partition`` (layers of each of the schedule's stages per
        model copy: over the L + 2 layers embedding, blocks, head, or a model file's layers),
        ``device_map`` (rank -> physical device id of the plan's cluster), ``layout`` (a line) and
        ``global_batch``. Raises ValueError for models the executor cannot train."""
        self.trained_model()
        plan = self.plan
        job, bt = self._planned(eager)
        low, lay, per = bt.lowered, job.layout, job.parallel.micro_batch
        if plan.uniform:
            layout = (f"{plan.dp} x {plan.num_stages}-stage pipeline, {lay.microbatches} micro-batches of {per} "
                      f"per replica")
        else:
            layout = (f"stage replicas {':'.join(map(str, plan.replicas))}, {plan.microbatches} micro-batches of "
                      f"{plan.micro_batch} cut into {lay.microbatches // plan.microbatches} sub-batches of {per} "
                      f"(model copies)")
        return {"schedule": low, "model": self.workload.source.get("name", self.workload.name),
                "microbatches": lay.microbatches, "replicas": low.replicas, "micro_batch": per,
                "partition": list(job.partition), "device_map": list(bt.network.device_map or range(low.num_ranks)),
                "layout": layout, "global_batch": plan.global_batch}


V1_LAYOUT_FIELDS = ("schedule", "devices", "microbatches", "replicas", "chunks", "variant", "tp")


def layout_plan_record(job, cluster: Cluster, global_batch: int, *, memory_limit: float | None = None,
                       simulated: dict | None = None) -> dict:
    """The plan file of a whole-layout plan (:mod:`planner.layout`; the module docstring): the
    planner and the job (:func:`job_record`, its device map resolved: Megatron's order at T > 1),
    the model's spec, the cluster, the memory limit and the facts, ``global_batch`` and what the
    planner simulated (``simulated``: its record)."""
    spec = job.model
    return {"format": FORMAT, "version": VERSION, "planner": "layout",
            "job": job_record(replace(job, device_map=job.mapping)),
            "model": {"kind": "transformer", "name": spec.name, "spec": spec.to_dict()},
            "cluster": cluster.to_dict(), "memory_limit": memory_limit, "global_batch": global_batch,
            "simulated": simulated}


@dataclass
class LayoutPlan:
    """A whole-layout plan file read back: a T x D x R job on the model x cluster formulas.
    ``simulate --plan`` binds it (:meth:`bind`: the job the planner simulated), ``run --plan``
    trains :meth:`run_job`."""

    job_fields: dict
    model: object       # ModelSpec, at the plan's micro-batch
    cluster: Cluster
    record: dict
    path: str = "plan"

    @property
    def parallel(self) -> Parallel:
        """The plan's parallel record (its T, ZeRO, sequence parallelism, recompute, micro-batch)."""
        return self.job_fields["parallel"]

    @property
    def mapping(self) -> str:
        """How the plan places its ranks (a mapping name)."""
        return self.job().mapping

    @property
    def gpus(self) -> int:
        return self.job().gpus

    def job(self, *, eager: bool = True):
        """The planner's job (its cluster named by the plan's; its costs from :meth:`inputs`)."""
        from cost_models.job import ClusterChoice, Job
        return Job(model=self.model, cluster=ClusterChoice(name=self.cluster.name), eager=eager, **self.job_fields)

    def run_job(self, *, eager: bool = True, device_map: str | None = None):
        """The job a training run takes: layout, model, micro-batch, recompute, ZeRO, sequence
        parallelism (no cluster or cost model: a run has its own)."""
        from cost_models.job import Job
        f = {k: v for k, v in self.job_fields.items() if k not in ("cost_model", "memory_reserve")}
        if device_map is not None:
            f["device_map"] = device_map
        return Job(model=self.model, eager=eager, **f)

    def inputs(self):
        from cost_models.bind import CostInputs
        return CostInputs("transformer", model=self.model, cluster=self.cluster)

    def bind(self, job) -> Bound:
        """The plan as a bound job (:class:`cost_models.job.PlanSource`): the planner's job with
        ``job.eager`` and the what-ifs ``job`` asks on the same layout: ``tp_overlap``, ``cost_model``
        and ``memory_reserve`` (where given) and the cluster rewired as ``job.cluster`` says
        (``--fabric`` ...). The options that would change the layout are the plan's
        (:func:`experiments.jobs.check_plan_args` refuses them)."""
        from cost_models.bind import CostInputs, bind
        planned = self.job(eager=job.eager)
        changes = {"parallel": job.parallel, "cluster": replace(job.cluster, name=self.cluster.name)}
        for k in ("cost_model", "memory_reserve"):
            if getattr(job, k) is not None:
                changes[k] = getattr(job, k)
        mine = replace(planned, **changes)     # checked again: --tp-overlap needs T > 1
        b = bind(mine, CostInputs("transformer", model=self.model, cluster=job.cluster.shape(self.cluster)))
        return Bound(b.lowered, b.costs, b.network, {**b.report, "plan_file": str(self.path)})


def _v1_job(rec: dict, source: str) -> dict:
    """A version 1 whole-layout plan's job fields: a flat ``layout`` with ``tp``, the parallel
    fields beside it."""
    for k in ("layout", "micro_batch", "recompute", "zero", "sequence_parallel"):
        if k not in rec:
            raise ValueError(f"{source}: missing field {k!r}")
    lay = rec["layout"]
    if not isinstance(lay, dict) or set(lay) != set(V1_LAYOUT_FIELDS):
        raise ValueError(f"{source}: field 'layout' must have exactly {', '.join(V1_LAYOUT_FIELDS)}")
    lay = dict(lay)
    par = {"tp": lay.pop("tp"), **{k: rec[k] for k in ("micro_batch", "recompute", "zero", "sequence_parallel")}}
    return {"layout": lay, "parallel": par, **{k: rec.get(k) for k in ("device_map", "cost_model", "memory_reserve")}}


def _job_fields(job: dict) -> dict:
    """A plan file's ``"job"`` (:func:`job_record`) as the fields of a :class:`cost_models.job.Job`
    (its records checked as a job's: one line naming the field; the caller names the file)."""
    from cost_models.job import Layout
    if not isinstance(job, dict) or not isinstance(job.get("layout"), dict) or \
            not isinstance(job.get("parallel"), dict):
        raise ValueError("field 'job' must hold the job's 'layout' and 'parallel'")
    extra = sorted(set(job) - set(JOB_FIELDS))
    if extra:
        raise ValueError(f"unknown job field {extra[0]!r} (fields: {', '.join(JOB_FIELDS)})")
    lay = {k: tuple(v) if isinstance(v, list) else v for k, v in job["layout"].items()}
    known = {f.name for f in fields(Layout)} - {"schedule_file"}
    if set(lay) - known:
        raise ValueError(f"unknown layout field {sorted(set(lay) - known)[0]!r}")
    missing = [k for k in ("schedule", "devices", "microbatches") if k not in lay]
    if missing:
        raise ValueError(f"the job's layout has no {', '.join(missing)}")
    out = {"layout": Layout(**lay), "parallel": Parallel.from_record(job["parallel"], "job.parallel")}
    for k in ("partition", "device_map", "cost_model", "memory_reserve"):
        v = job.get(k)
        if v is not None:
            out[k] = tuple(v) if isinstance(v, list) else v
    return out


def _layout_plan(rec: dict, source: str) -> LayoutPlan:
    for k in ("model", "cluster"):
        if k not in rec:
            raise ValueError(f"{source}: missing field {k!r}")
    cluster = cluster_from_dict(dict(rec["cluster"]), f"{source} (field 'cluster')")
    model = rec["model"]
    if not isinstance(model, dict) or not isinstance(model.get("spec"), dict):
        raise ValueError(f"{source}: field 'model' must hold the model's 'spec'")
    spec = spec_from_dict(dict(model["spec"]), f"{source} (field 'model')")
    try:
        f = _job_fields(_v1_job(rec, source) if rec["version"] == 1 else rec.get("job"))
        spec.check_tensor_parallel(f["parallel"].tp)
        spec = f["parallel"].sized(spec)
        plan = LayoutPlan(f, spec, cluster, rec, source)
        plan.job()      # every field checked as a job's
    except (TypeError, ValueError) as e:
        raise ValueError(f"{source}: {one_line(e)}") from None
    gpus = plan.job().gpus
    if gpus > cluster.num_devices:
        raise ValueError(f"{source}: the layout uses {gpus:,} GPUs, the cluster has {cluster.num_devices:,}")
    return plan


def plan_from_record(rec: dict, source: str = "plan") -> LoadedPlan | LayoutPlan:
    if not isinstance(rec, dict) or rec.get("format") != FORMAT:
        check_kind(rec, source, "plan")
        raise ValueError(f"{source}: not a pipetwin plan file (expected \"format\": \"{FORMAT}\")")
    if rec.get("version") not in READS:
        raise ValueError(f"{source}: plan file version {rec.get('version')!r}; this pipetwin reads versions "
                         f"{', '.join(map(str, READS))}")
    kind = rec.get("kind") if rec["version"] == 1 else rec.get("planner")
    if rec["version"] > 1 and kind not in ("layout", "dapple"):
        raise ValueError(f"{source}: field 'planner' must be 'layout' or 'dapple'; got {kind!r}")
    if kind == "layout":
        return _layout_plan(rec, source)
    for k in ("model", "cluster", "plan"):
        if k not in rec:
            raise ValueError(f"{source}: missing field {k!r}")
    cluster = cluster_from_dict(dict(rec["cluster"]), f"{source} (field 'cluster')")
    try:
        plan = Plan.from_dict(rec["plan"])
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None
    if cluster.is_mixed:        # each stage's layers on its pool's device, the slowest of a stage's (planner.hetero)
        from .hetero import plan_pools, stitched
        if max(d for st in plan.stages for d in st.devices) >= cluster.num_devices:
            raise ValueError(f"{source}: the plan uses devices beyond the cluster's {cluster.num_devices}")
        works = [workload_from_source(rec["model"], p.device) for p in cluster.pools]
        if plan.num_layers != works[0].num_layers:
            raise ValueError(f"{source}: the plan covers layers {plan.stages[0].start}..{plan.stages[-1].stop}, "
                             f"model {works[0].name} has {works[0].num_layers}")
        work = stitched(works, plan_pools(plan, cluster))
    else:
        work = workload_from_source(rec["model"], cluster.device)
    if plan.num_layers != work.num_layers or plan.stages[0].start != 0:
        raise ValueError(f"{source}: the plan covers layers {plan.stages[0].start}..{plan.stages[-1].stop}, "
                         f"model {work.name} has {work.num_layers}")
    if max(d for st in plan.stages for d in st.devices) >= cluster.num_devices:
        raise ValueError(f"{source}: the plan uses devices beyond the cluster's {cluster.num_devices}")
    lim = rec.get("memory_limit")
    if lim is not None:
        lim = size_bytes(lim, source, "memory_limit")
    loaded = LoadedPlan(plan, work, cluster, lim, rec, source)
    try:
        job = loaded.planned_job()      # sizes checked before the schedule is built
    except ScheduleError as e:
        if "MAX_OPS" in str(e):
            raise ValueError(f"{source}: field 'plan.microbatches' {plan.microbatches:,} makes an iteration beyond "
                             f"pipetwin's limit of {MAX_OPS:,} ops (schedules.registry.MAX_OPS); plan again with a "
                             f"smaller global batch") from None
        raise ValueError(f"{source}: {e}") from None
    if rec["version"] > 1 and rec.get("job") != job_record(job, loaded.placement):
        raise ValueError(f"{source}: field 'job' disagrees with the plan's stages and micro-batches (edited by "
                         f"hand?); plan again")
    return loaded


def load_plan(path) -> LoadedPlan | LayoutPlan:
    """Read a plan file written by ``pipetwin plan --out`` (see the module docstring)."""
    p = Path(path)
    if p.suffix == ".py":
        raise ValueError(f"plan file {p} is a Python file; a model file is given as --model {p}:FUNC, a plan as "
                         f"--plan PLAN.json (pipetwin plan --out)")
    text = read_text(p, "plan file")
    try:
        rec = parse_json(text, str(p))
    except FileError:
        check_kind(data_or_none(text), str(p), "plan")   # YAML of another kind: named as such
        raise
    return plan_from_record(rec, str(p))
