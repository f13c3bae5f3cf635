"""Plan files: everything needed to rebuild a plan, for ``pipetwin simulate --plan`` and ``pipetwin run --plan``.

A plan file is JSON::

    {
      "format": "pipetwin-plan", "version": 1,
      "model":   {"kind": "transformer", "name": "bert-48", "spec": {...ModelSpec fields...}, "recompute": "none"}
                 or {"kind": "paper", "name": "vgg-19", "recompute": "none"}
                 or {"kind": "calibrated", "name": "my.py:build" (or a preset), "profile": ..., "stack": true,
                     "workload": {...the per-sample Workload fields...}, "spec": {...} (a transformer's)},
      "cluster": {...Cluster.to_dict(): nodes, devices_per_node, device, intra, inter, nics_per_node...},
      "memory_limit": bytes per device (null: the device's memory),
      "plan":    {"global_batch", "microbatches" (M), "micro_batch" (b = G / M), "policy", "schedule", "chunks",
                  "split" (layers per stage of a schedule with other stages than the plan's, e.g. zb-v's 2 D;
                  [] = the stages' own layers),
                  "stages": [{"layers": [start, stop], "replicas": r, "devices": [physical ids]}, ...]},
      "uniform": true | false,
      "run":     for a uniform plan, the executor's view (null otherwise):
                 {"schedule", "devices" (D = stages), "microbatches" (M), "dp" (R), "chunks",
                  "micro_batch" (b / R per pipeline replica), "partition" (layers per stage of the schedule:
                  the plan's "split" where set; over the L + 2 layers of a transformer: embedding and head
                  included), "device_map"
                  (rank i * D + s -> physical device of replica i of stage s)},
      "estimate": {...planner.cost.Estimate.to_dict()...}, "simulated": {...} or null
    }

A whole-layout plan (``pipetwin plan --tp``, :mod:`planner.layout`) is a job instead::

    {"format": "pipetwin-plan", "version": 1, "kind": "layout",
     "model": {"kind": "transformer", "name", "spec": {...}}, "cluster": {...},
     "layout": {"schedule", "devices" (D), "microbatches" (N), "replicas" (R), "chunks", "variant", "tp" (T)},
     "micro_batch", "recompute", "zero", "sequence_parallel", "device_map", "cost_model", "memory_reserve",
     "memory_limit",
     "global_batch", "simulated": {...the planner's record...}}

read back as a :class:`LayoutPlan` (its :meth:`LayoutPlan.job` is the job the planner simulated).

Layers are global indices of the model's layer stack (for a transformer: 0 = embedding,
1..L = blocks, L + 1 = head). Device ids are ``node * devices_per_node + local``.

``pipetwin run --plan`` reads :meth:`LoadedPlan.for_executor` (any transformer plan, uniform or not:
the lowered schedule the simulator runs and how to feed it; :mod:`experiments.plan_files`). The
``run`` record is the flat view of a uniform plan for other tools.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from cost_models import Cluster, cluster_from_dict
from cost_models.bind import Bound
from cost_models._spec import size_bytes
from cost_models.files import one_line, read_text, write_output
from cost_models.parallel import Parallel
from cost_models.stack import absolute_model_ref

from cost_models.workloads.workload_sources import workload_from_source
from .plan import Plan
from .simulate import Built, PlanInMemory, SimOutcome, build_plan, plan_parallel, simulate_plan
from cost_models.workloads.workload import Workload

FORMAT, VERSION = "pipetwin-plan", 1


def plan_record(plan: Plan, work: Workload, cluster: Cluster, memory_limit: float | None = None,
                est=None, sim: SimOutcome | None = None) -> dict:
    run = None
    if plan.uniform:
        R = plan.dp
        run = {"schedule": plan.schedule, "devices": plan.num_stages, "microbatches": plan.microbatches,
               "dp": R, "chunks": plan.chunks, "micro_batch": plan.micro_batch // R,
               "partition": list(plan.schedule_partition), "device_map": list(plan.device_map())}
    return {"format": FORMAT, "version": VERSION, "model": dict(work.source), "cluster": cluster.to_dict(),
            "memory_limit": memory_limit, "plan": plan.to_dict(), "uniform": plan.uniform, "run": run,
            "estimate": est.to_dict() if est is not None else None,
            "simulated": sim.to_dict() if sim is not None else None}


def save_plan(path, plan: Plan, work: Workload, cluster: Cluster, memory_limit: float | None = None,
              est=None, sim: SimOutcome | None = None) -> dict:
    rec = plan_record(plan, work, cluster, memory_limit, est, sim)
    write_output(path, json.dumps(rec, indent=2) + "\n", "plan file")
    return rec


@dataclass
class LoadedPlan:
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

    @property
    def parallel(self) -> Parallel:
        """The plan's parallel record: T 1 and the recomputation its memory assumed."""
        return plan_parallel(self.workload)

    def simulate(self, faults=None) -> SimOutcome:
        """The plan simulated as :func:`planner.simulate.simulate_plan` does (``faults``: a
        :class:`cost_models.job.Faults`)."""
        return simulate_plan(self.plan, self.workload, self.cluster, self.capacity, faults)

    def run_job(self, *, eager: bool = True, device_map: str | None = None):
        """The job a training run of the plan takes (:class:`cost_models.job.Job`, for
        ``executor.RunConfig(job=..., placement=plan.placement)``): the very schedule the simulator
        runs (a uniform plan: its family on D = stages with R replicas; a non-uniform one: DAPPLE's
        ``stage_replicas`` with the sub-batches as micro-batches), the model (a transformer spec or
        the profile's model file), the samples per IR micro-batch, the IR stages' layers as the
        partition and the recomputation the plan's memory assumed; ``device_map``: a mapping name
        in place of the plan's placement. Raises ValueError for the paper's layer-cost models."""
        from cost_models.job import Job, Layout
        from cost_models.model_spec import spec_from_dict
        ex = self.for_executor(eager=eager)
        low, plan = ex["schedule"], self.plan
        if plan.uniform:
            layout = Layout(schedule=plan.schedule, devices=plan.num_stages, microbatches=ex["microbatches"],
                            replicas=plan.dp, chunks=plan.chunks)
        else:
            layout = Layout(schedule="dapple", devices=low.num_devices, microbatches=ex["microbatches"],
                            stage_replicas=tuple(plan.replicas))
        model = ex["model_file"] if "model_file" in ex else spec_from_dict(dict(ex["model_spec"]),
                                                                          f"plan model {ex['model']}")
        par = replace(self.parallel, micro_batch=ex["micro_batch"])
        return Job(layout=layout, model=model, parallel=par, partition=tuple(ex["partition"]), eager=eager,
                   device_map=device_map)

    @property
    def placement(self) -> tuple[int, ...]:
        """Rank -> the plan cluster's device id: where the plan puts each rank of :meth:`run_job`."""
        return tuple(self.for_executor()["device_map"])

    def for_executor(self, *, eager: bool = True) -> dict:
        """What ``pipetwin run --plan`` runs, for uniform and non-uniform transformer plans: the very
        lowered schedule the simulator runs (:func:`planner.simulate.build_plan`; its IR form is
        described there) and how to feed it:

        ``schedule`` (lowered Schedule), ``model`` (name), ``model_spec`` (ModelSpec fields),
        ``microbatches`` (IR micro-batches per pipeline replica: M for a uniform plan, M x C
        sub-batches for a non-uniform one), ``replicas`` (the IR's R; 1 for non-uniform plans),
        ``micro_batch`` (samples per IR micro-batch: b / R, or b / C), ``partition`` (layers of each
        of the schedule's stages per model copy, over the L + 2 layers embedding, blocks, head),
        ``device_map`` (rank -> physical device id of the plan's cluster), ``layout`` (a line) and
        ``global_batch``; for a profile's layer stack ``model_file`` (``PATH.py:FUNC``) instead of
        ``model_spec`` and a partition over its layers. Raises ValueError for models the executor
        cannot train (the paper's layer-cost models)."""
        src = self.workload.source
        stack = src.get("kind") == "calibrated" and src.get("stack")
        spec = self.workload.spec.to_dict() if self.workload.spec is not None else src.get("spec")
        if not stack and spec is None:
            raise ValueError(f"the executor trains transformer models and model files; {self.workload.name} is a "
                             f"layer-cost model (the plan can be simulated, not run)")
        plan = self.plan
        bt = self.build(eager=eager, check=False)
        low = bt.lowered
        if plan.uniform:
            per, mbs = plan.micro_batch // plan.dp, plan.microbatches
            layout = f"{plan.dp} x {plan.num_stages}-stage pipeline, {mbs} micro-batches of {per} per replica"
        else:
            C = bt.extra["sub_batches"]
            per, mbs = plan.micro_batch // C, plan.microbatches * C
            layout = (f"stage replicas {':'.join(map(str, plan.replicas))}, {plan.microbatches} micro-batches of "
                      f"{plan.micro_batch} cut into {C} sub-batches of {per} (model copies)")
        # written absolute; an older or hand-moved plan's relative PATH.py: beside the plan file first
        out = ({"model_file": absolute_model_ref(src["name"], Path(self.path).parent)} if stack
               else {"model_spec": spec})
        return {**out, "schedule": low, "model": src.get("name", self.workload.name),
                "microbatches": mbs, "replicas": low.replicas,
                "micro_batch": per, "partition": list(bt.costs.meta["partition"]),
                "device_map": list(bt.network.device_map or range(low.num_ranks)), "layout": layout,
                "global_batch": plan.global_batch}


LAYOUT_FIELDS = ("schedule", "devices", "microbatches", "replicas", "chunks", "variant", "tp")


def layout_plan_record(job, cluster: Cluster, global_batch: int, *, memory_limit: float | None = None,
                       simulated: dict | None = None) -> dict:
    """The plan file of a whole-layout plan (:mod:`planner.layout`): ``"kind": "layout"``, the job's
    ``layout`` (schedule, devices D, microbatches N, replicas R, chunks, variant, tp T), the model's
    spec, the cluster, ``micro_batch``, ``recompute``, ``zero``, ``sequence_parallel``,
    ``device_map``, ``cost_model``, ``memory_reserve``, ``memory_limit``, ``global_batch`` and what the planner
    simulated (``simulated``: its record)."""
    lay, par = job.layout, job.parallel
    spec = job.model
    return {"format": FORMAT, "version": VERSION, "kind": "layout",
            "model": {"kind": "transformer", "name": spec.name, "spec": spec.to_dict()},
            "cluster": cluster.to_dict(), "layout": {k: getattr(par if k == "tp" else lay, k) for k in LAYOUT_FIELDS},
            "micro_batch": par.micro_batch, "recompute": par.recompute, "zero": par.zero,
            "sequence_parallel": par.sequence_parallel, "device_map": job.mapping, "cost_model": job.cost_model,
            "memory_reserve": job.memory_reserve, "memory_limit": memory_limit, "global_batch": global_batch,
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


def _layout_plan(rec: dict, source: str) -> LayoutPlan:
    from cost_models.job import Layout
    from cost_models.model_spec import spec_from_dict
    for k in ("layout", "micro_batch", "recompute", "zero", "sequence_parallel"):
        if k not in rec:
            raise ValueError(f"{source}: missing field {k!r}")
    cluster = cluster_from_dict(dict(rec["cluster"]), f"{source} (field 'cluster')")
    model = rec["model"]
    if not isinstance(model, dict) or not isinstance(model.get("spec"), dict):
        raise ValueError(f"{source}: field 'model' must hold the model's 'spec'")
    spec = spec_from_dict(dict(model["spec"]), f"{source} (field 'model')")
    lay = rec["layout"]
    if not isinstance(lay, dict) or set(lay) != set(LAYOUT_FIELDS):
        raise ValueError(f"{source}: field 'layout' must have exactly {', '.join(LAYOUT_FIELDS)}")
    try:
        lay = dict(lay)
        par = Parallel(tp=lay.pop("tp"), micro_batch=rec["micro_batch"], recompute=rec["recompute"],
                       zero=rec["zero"], sequence_parallel=rec["sequence_parallel"])
        layout = Layout(**lay)
        spec.check_tensor_parallel(par.tp)
        fields = {"layout": layout, "parallel": par,
                  "device_map": rec.get("device_map"), "cost_model": rec.get("cost_model"),
                  "memory_reserve": rec.get("memory_reserve")}
        spec = spec.replace(micro_batch=rec["micro_batch"])
        plan = LayoutPlan(fields, spec, cluster, rec, source)
        plan.job()      # every field checked as a job's
    except (TypeError, ValueError) as e:
        raise ValueError(f"{source}: {one_line(e)}") from None
    gpus = plan.job().gpus
    if gpus > cluster.num_devices:
        raise ValueError(f"{source}: the layout uses {gpus:,} GPUs, the cluster has {cluster.num_devices:,}")
    return plan


def plan_from_record(rec: dict, source: str = "plan") -> LoadedPlan | LayoutPlan:
    if not isinstance(rec, dict) or rec.get("format") != FORMAT:
        raise ValueError(f"{source}: not a pipetwin plan file (expected \"format\": \"{FORMAT}\")")
    if rec.get("version") != VERSION:
        raise ValueError(f"{source}: plan file version {rec.get('version')!r}; this pipetwin reads version {VERSION}")
    if rec.get("kind") == "layout":
        return _layout_plan(rec, source)
    for k in ("model", "cluster", "plan"):
        if k not in rec:
            raise ValueError(f"{source}: missing field {k!r}")
    cluster = cluster_from_dict(dict(rec["cluster"]), f"{source} (field 'cluster')")
    work = workload_from_source(rec["model"], cluster.device)
    try:
        plan = Plan.from_dict(rec["plan"])
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None
    if plan.num_layers != work.num_layers or plan.stages[0].start != 0:
        raise ValueError(f"{source}: the plan covers layers {plan.stages[0].start}..{plan.stages[-1].stop}, "
                         f"model {work.name} has {work.num_layers}")
    if max(d for st in plan.stages for d in st.devices) >= cluster.num_devices:
        raise ValueError(f"{source}: the plan uses devices beyond the cluster's {cluster.num_devices}")
    lim = rec.get("memory_limit")
    if lim is not None:
        lim = size_bytes(lim, source, "memory_limit")
    return LoadedPlan(plan, work, cluster, lim, rec, source)


def load_plan(path) -> LoadedPlan | LayoutPlan:
    """Read a plan file written by ``pipetwin plan --out`` (see the module docstring)."""
    p = Path(path)
    text = read_text(p, "plan file")
    try:
        rec = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: not valid JSON ({one_line(e)})") from None
    return plan_from_record(rec, str(p))
