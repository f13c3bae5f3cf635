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
weights once (the copies of a stage on one device are one set of weights); the IR form would count
them per copy, so the planner overrides it.

The executor runs such plans (``pipetwin run --plan``): the copies of one stage on a rank share
one module (one set of weights, gradients and optimizer state), their gradients are summed
locally before the stage's all-reduce, and messages between stages with different replica counts
use the per-copy peers the lowering records.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import reduce

from cost_models import Cluster, PerLayerCostModel, StageCosts
from cost_models.partition import balanced_edges
from schedules import Schedule, build, lower, make_schedule, validate
from schedules.dapple import one_f_one_b
from schedules.ir import B, F
from sim import SimOptions, run

from .placement import lcm
from .plan import Plan
from .workload import Workload

REPLICATED = "dapple-replicated"


def replicated_schedule(replicas, microbatches: int) -> Schedule:
    """DAPPLE's early-backward schedule for stage s on ``replicas[s]`` devices (see the module docstring).

    Device ids: stage 0's replicas first (0..r_0-1), then stage 1's, ... IR micro-batch ``m * C + c``
    is sub-batch c of micro-batch m; copy c of stage s sits on device ``offset_s + c mod r_s``.
    Each device runs min(S - s - 1, M) warm-up micro-batches (all its copies of each), then
    alternates one micro-batch forward and one backward, then drains.
    """
    reps = [int(r) for r in replicas]
    if not reps or min(reps) < 1:
        raise ValueError(f"replicas must be positive; got {reps}")
    S, M = len(reps), int(microbatches)
    C = reduce(lcm, reps, 1)
    offsets = [sum(reps[:s]) for s in range(S)]
    placement = [[offsets[s] + c % reps[s] for s in range(S)] for c in range(C)]
    order = []
    for s in range(S):
        for i in range(reps[s]):
            mine = [c for c in range(C) if c % reps[s] == i]
            fwd = lambda m, s=s, mine=mine: [(F, m * C + c, c, s) for c in mine]  # noqa: E731
            bwd = lambda m, s=s, mine=mine: [(B, m * C + c, c, s) for c in mine]  # noqa: E731
            order.append([op for group in one_f_one_b(M, S - s - 1, fwd, bwd) for op in group])
    return make_schedule(REPLICATED, sum(reps), M * C, placement, order,
                         meta={"replicas": reps, "microbatches": M, "sub_batches": C})


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
    if num_stages == plan.num_stages:
        return plan.partition
    if num_stages > work.num_layers:
        raise ValueError(f"schedule {plan.schedule} needs {num_stages} stages; {work.name} has only "
                         f"{work.num_layers} layers")
    wts = [work.fwd(l, l + 1) + work.bwd(l, l + 1) for l in range(work.num_layers)]
    e = balanced_edges(wts, num_stages)
    return tuple(e[i + 1] - e[i] for i in range(num_stages))


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


def build_plan(plan: Plan, work: Workload, cluster: Cluster, capacity: float | None = None, *,
               eager: bool = True, check: bool = True) -> Built:
    """Lower a plan, bind its costs and place it (see the module docstring)."""
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
        dmap = plan.device_map()
        extra = {"layout": f"{R} x {D}-stage pipeline", "micro_batch_per_replica": b // R}
    else:
        if plan.schedule not in ("dapple", REPLICATED):
            raise ValueError(f"a plan with replicas {list(plan.replicas)} per stage runs the DAPPLE schedule only; "
                             f"got {plan.schedule!r}")
        sched = replicated_schedule(plan.replicas, M)
        low = lower(sched, eager=eager)
        C = sched.meta["sub_batches"]
        part = plan.partition
        costs = PerLayerCostModel(_sub_batch_costs(plan, work, C), part).bind(low)
        stage_of = [s for s, st in enumerate(plan.stages) for _ in st.devices]
        params = [work.param_count(st.start, st.stop) for st in plan.stages]
        costs = replace(costs, static_mem=tuple(params[stage_of[r]] * work.bytes_per_param_static
                                                for r in range(low.num_ranks)),
                        optim_time=tuple(params[stage_of[r]] * work.optim_time_per_param
                                         for r in range(low.num_ranks)))
        dmap = tuple(d for st in plan.stages for d in st.devices)
        extra = {"layout": "replicas " + ":".join(map(str, plan.replicas)), "sub_batches": C,
                 "micro_batch_per_sub_batch": b // C}
    if check:
        validate(low)
    costs.meta.update(model=costs.meta.get("model", "per-layer"), model_name=work.name, memory_capacity=cap,
                      partition=list(part))
    extra.update(cost_model="planner", model=work.name, cluster=cluster.name, memory_capacity=cap,
                 plan=plan.describe())
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


def simulate_plan(plan: Plan, work: Workload, cluster: Cluster, capacity: float | None = None,
                  options: SimOptions | None = None) -> SimOutcome:
    """One simulated iteration of a plan (the simulator's fast path: metrics without a trace, one
    replica standing for identical ones)."""
    bt = build_plan(plan, work, cluster, capacity, check=False)
    m = run(bt.lowered, bt.costs, bt.network, options or SimOptions()).metrics()
    peaks = tuple(p.peak_memory for p in m.per_device)
    return SimOutcome(m.iteration_time, m.bubble_ratio, max(peaks), peaks, bt.costs.meta.get("memory_capacity"))
