"""Plans in the schedule IR, bound to costs and placed on the cluster, and simulated with SimPy.

Uniform plans (R replicas of every stage) are the IR's own data x pipeline layout: the schedule
family by name with D = stages and N = M micro-batches, ``lower(..., replicas=R)``, per-replica
micro-batch b / R, rank ``i * D + s`` on the device of replica i of stage s. Schedules whose stage
count differs from D (interleaved, V-shaped and bidirectional ones) get a work-balanced partition of
their own stage count; the plan's partition is for D stages.

Non-uniform plans (stage s on r_s devices) are expressed with the IR's model copies, which the
lowering, the validator and the simulator already handle: with C = lcm(r_s), every micro-batch is
cut into C sub-batches of b / C samples, sub-batch c runs on model copy c, and copy c of stage s is
placed on replica ``c mod r_s`` of that stage. A device of stage s thus holds C / r_s copies of the
stage and runs them one after the other (b / r_s samples per micro-batch, as the plan says); its
gradient all-reduce covers exactly the r_s devices of the stage (with micro-batch-dependent costs each
sub-batch is priced at the per-sample times of the stage's share b / r_s, see
:func:`_sub_batch_costs`). Programs follow 1F1B over whole
micro-batches (:func:`replicated_schedule`). The static memory of such a device counts the stage's
weights once (the copies of a stage on one device are one set of weights: the schedule says so,
``meta["shared_copies"]``, and every cost model counts them once, :func:`cost_models.base.held_stages`).

The executor runs such plans (``pipetwin run --plan``): the copies of one stage on a rank share
one module (one set of weights, gradients and optimizer state), their gradients are summed
locally before the stage's all-reduce, and messages between stages with different replica counts
use the per-copy peers the lowering records.

The planner simulates a non-uniform plan whose replica counts share a divisor g > 1 as g
data-parallel replicas of the plan with r_s / g (``build_plan(split=True)``, exactly the same
programs on the same devices), so the simulator's replica symmetry applies: one replica of each
kind of alike ones is simulated (GPT-96's exact optimum on 1,024 A100s at M = 16: 128 of 1,024
ranks).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import reduce
from math import gcd

from cost_models import Cluster, PerLayerCostModel, StageCosts
from cost_models.bind import Bound
from cost_models.job import Faults, Job
from cost_models.parallel import Parallel
from cost_models.partition import balanced_edges
from cost_models.workloads.workload import Workload
from schedules import Schedule, build, lower, validate
from schedules.dapple_replicated import REPLICATED, replicated_schedule
from sim import simulate_job

from .plan import Plan
from cost_models.files import short_list

@dataclass
class Built:
    """A plan ready for an engine: the lowered schedule, its costs and the placed cluster."""

    plan: Plan
    lowered: Schedule
    costs: StageCosts
    network: Cluster
    extra: dict = field(default_factory=dict)

    def astuple(self):
        return self.lowered, self.costs, self.network


def ir_partition(plan: Plan, work: Workload, num_stages: int) -> tuple[int, ...]:
    """Layers per stage of the lowered schedule: the plan's own partition, or its ``split`` for a
    schedule with other stages than the plan (a plan file without one: the work-balanced split)."""
    if plan.split:
        if len(plan.split) != num_stages:
            raise ValueError(f"the plan's split {short_list(plan.split, sep='|', bare=True)} has {len(plan.split)} "
                             f"stage(s); schedule {plan.schedule} has {num_stages}")
        return plan.split
    if num_stages == plan.num_stages:
        return plan.partition
    return split_candidates(work, num_stages)[-1]


def split_candidates(work: Workload, num_stages: int) -> list[tuple[int, ...]]:
    """The layer splits over ``num_stages`` schedule stages the planner tries where a plan's own
    partition does not apply or may be beaten: the default split of ``pipetwin simulate`` / ``run``
    (a transformer's even blocks with the embedding and the head on the end stages), then the
    split balanced by forward + backward work (distinct ones only)."""
    from cost_models.partition import default_partition
    if num_stages > work.num_layers:
        raise ValueError(f"{num_stages} schedule stages; {work.name} has only {work.num_layers} layers")
    out = []
    if work.spec is not None:
        out.append(tuple(default_partition(work.spec.layers, num_stages)))
    wts = [work.fwd(l, l + 1) + work.bwd(l, l + 1) for l in range(work.num_layers)]
    e = balanced_edges(wts, num_stages)
    bal = tuple(e[i + 1] - e[i] for i in range(num_stages))
    if bal not in out:
        out.append(bal)
    return out


def _sub_batch_costs(plan: Plan, work: Workload, C: int):
    """Layer costs of one sub-batch (b / C samples) of a non-uniform plan. With micro-batch-dependent
    costs a device of stage s runs its C / r_s sub-batches at the per-sample times of b / r_s
    samples, the micro-batch share the planner priced (DAPPLE runs it as one pass), so every layer
    of stage s gets those per-sample times times b / C."""
    b = plan.micro_batch
    lc = work.layer_costs(b // C)
    if not work.varies:
        return lc
    sub = float(b // C)
    f, bi, w = list(lc.f), list(lc.b_input), list(lc.w)
    for st in plan.stages:
        wq = work.at(b // st.replicas)
        for i in range(st.start, st.stop):
            f[i], bi[i], w[i] = wq.f[i] * sub, wq.b_input[i] * sub, wq.w[i] * sub
    return replace(lc, f=tuple(f), b_input=tuple(bi), w=tuple(w), b_full=None)


def replica_groups(plan: Plan) -> int:
    """g = gcd of the stages' replica counts: the data-parallel replicas a non-uniform plan splits into
    (see :func:`build_plan`'s ``split``)."""
    return reduce(gcd, plan.replicas, 0)


def plan_placement(plan: Plan, g: int = 1) -> tuple[int, ...]:
    """Rank -> device id of a plan's lowered form: a uniform plan's ``device_map``; a non-uniform
    one's IR form (stage 0's replicas first), or with ``g`` > 1 its split into g replicas (rank
    ``j D' + offset'_s + i'`` on ``devices_s[i' g + j]``, see :func:`build_plan`)."""
    if plan.uniform:
        return tuple(plan.device_map())
    sub = [r // g for r in plan.replicas]
    return tuple(st.devices[i * g + j] for j in range(g) for st, r in zip(plan.stages, sub) for i in range(r))


def build_plan(plan: Plan, work: Workload, cluster: Cluster, capacity: float | None = None, *,
               eager: bool = True, check: bool = True, split: bool = False) -> Built:
    """Lower a plan, bind its costs and place it (see the module docstring).

    ``split`` (non-uniform plans whose replica counts r_s have a common divisor g = gcd(r_s) > 1,
    :func:`replica_groups`): the same programs as g data-parallel replicas of the plan with r_s / g
    replicas per stage, ``lower(replicated_schedule(r / g, M), replicas=g)``, so the simulator can
    take its replica-symmetric path. Exact: with C = lcm(r_s) = g C', copy c = c' g + j of the
    IR form sits on device i = (c mod r_s) = g (c' mod r_s / g) + j of stage s, so the copies and
    devices with one j = c mod g form a pipeline of their own (every transfer goes from a device of
    group j to one of group j; only the stages' all-reduces join the groups), and group j is that
    of replica j of the split form with c' = c // g, i' = i // g: the same ops in the same order on
    every device (the copies of a device ascending in c and in c' alike), the same FIFO messages, the
    same sub-batch b / C and the same all-reduce groups (every device of the stage). Rank
    ``j D' + offset'_s + i'`` of the split form runs on device ``devices_s[i' g + j]``, the one
    that rank ``offset_s + i`` of the IR form runs on. For the simulator, not the executor (whose
    plan files keep the IR form)."""
    cap = capacity if capacity is not None else work.memory_capacity
    if plan.num_layers != work.num_layers:
        raise ValueError(f"the plan covers {plan.num_layers} layers; model {work.name} has {work.num_layers}")
    need = max((d for st in plan.stages for d in st.devices), default=-1) + 1
    if need > cluster.num_devices:
        raise ValueError(f"the plan uses device {need - 1}; cluster {cluster.name} has {cluster.num_devices}")
    b, M = plan.micro_batch, plan.microbatches
    if plan.uniform:
        D, R = plan.num_stages, plan.dp
        sched = build(plan.schedule, D, M, chunks=plan.chunks)
        low = lower(sched, replicas=R, eager=eager)
        part = ir_partition(plan, work, low.num_stages)
        costs = PerLayerCostModel(work.layer_costs(b // R), part).bind(low)
        dmap = plan_placement(plan)
        extra = {"layout": f"{R} x {D}-stage pipeline", "micro_batch_per_replica": b // R}
    else:
        if plan.schedule not in ("dapple", REPLICATED):
            raise ValueError(f"a plan with replicas {short_list(plan.replicas)} per stage runs the DAPPLE schedule "
                             f"only; got {plan.schedule!r}")
        g = replica_groups(plan) if split else 1
        sub = [r // g for r in plan.replicas]
        sched = replicated_schedule(sub, M)
        low = lower(sched, replicas=g, eager=eager)
        C = g * sched.meta["sub_batches"]
        part = plan.partition
        costs = PerLayerCostModel(_sub_batch_costs(plan, work, C), part).bind(low)   # weights once per device
        dmap = plan_placement(plan, g)
        extra = {"layout": "replicas " + ":".join(map(str, plan.replicas)), "sub_batches": C,
                 "micro_batch_per_sub_batch": b // C}
        if g > 1:
            extra["split_replicas"] = g
    if check:
        validate(low)
    costs.meta.update(model=costs.meta.get("model", "per-layer"), model_name=work.name, memory_capacity=cap,
                      partition=list(part))
    extra.update(cost_model="planner", model=work.name, cluster=cluster.name, memory_capacity=cap,
                 plan=plan.describe(), partition=list(part),
                 device_fitted=" | ".join(dict.fromkeys(p.device.provenance() for p in cluster.pools)),
                 **({"seq_len": work.spec.seq_len} if work.spec is not None else {}))
    return Built(plan, low, costs, cluster.with_device_map(dmap), extra)


@dataclass(frozen=True)
class SimOutcome:
    iteration_time: float
    bubble_ratio: float
    peak_memory: float                 # max over devices (bytes)
    per_device_peak: tuple[float, ...]
    capacity: float | None

    @property
    def oom(self) -> bool:
        return self.capacity is not None and self.peak_memory > self.capacity

    def to_dict(self) -> dict:
        return {"iteration_time": self.iteration_time, "bubble_ratio": self.bubble_ratio,
                "peak_memory": self.peak_memory, "out_of_memory": self.oom}


class DapplePlanFacts:
    """What a DAPPLE plan held with its workload (``self.plan``, ``self.workload``) says of its job,
    for :class:`PlanInMemory` and :class:`planner.plan_io.LoadedPlan` alike."""

    @property
    def parallel(self) -> Parallel:
        """The plan's parallel record: T 1 and the recomputation its workload (and so its memory) assumed."""
        return Parallel(recompute=self.workload.source.get("recompute", "none"))

    @property
    def gpus(self) -> int:
        """The devices the plan uses."""
        return self.plan.devices_used


@dataclass(frozen=True)
class PlanInMemory(DapplePlanFacts):
    """A plan, its workload and its cluster as a job's cost source
    (:class:`cost_models.job.PlanSource`): binding it builds the plan (:func:`build_plan`; ``split``
    and ``check`` as there), so a plan the planner confirms is simulated as a job, the same path as
    ``pipetwin simulate --plan``."""

    plan: Plan
    workload: Workload
    cluster: Cluster
    capacity: float | None = None
    split: bool = False
    check: bool = True
    path: str = "plan (in memory)"

    def bind(self, job) -> Bound:
        bt = build_plan(self.plan, self.workload, self.cluster, self.capacity, eager=job.eager, check=self.check,
                        split=self.split)
        return Bound(bt.lowered, bt.costs, bt.network, dict(bt.extra))


def simulate_plan(plan: Plan, work: Workload, cluster: Cluster, capacity: float | None = None,
                  faults: Faults | None = None, *, split: bool = True) -> SimOutcome:
    """One simulated iteration of a plan, as a job (:class:`PlanInMemory`; the simulator's fast
    path: metrics without a trace, one replica standing for identical ones; a non-uniform plan
    split into gcd(r_s) replicas, see :func:`build_plan`; ``split=False``: its IR form, every rank
    simulated), with ``faults`` (stragglers, slow links) if given."""
    job = Job(plan=PlanInMemory(plan, work, cluster, capacity, split=split, check=False),
              faults=faults or Faults())
    bound, res = simulate_job(job, max_ops=None)
    m = res.metrics()
    peaks = [p.peak_memory for p in m.per_device]
    g = bound.report.get("split_replicas", 1)
    if g > 1:       # back to the IR form's rank order: its rank offset_s + i' g + j is j D' + offset'_s + i'
        D, subs = bound.lowered.num_devices, [r // g for r in plan.replicas]
        peaks = [peaks[j * D + sum(subs[:s]) + i // g] for s, r in enumerate(plan.replicas) for i in range(r)
                 for j in [i % g]]
    peaks = tuple(peaks)
    return SimOutcome(m.iteration_time, m.bubble_ratio, max(peaks), peaks, bound.costs.meta.get("memory_capacity"))
