"""DAPPLE's planner on a cluster of mixed devices (pools of different GPUs): type-aware and type-blind.

A mixed cluster (:class:`cost_models.Cluster` with several ``pools``) prices the same layer
differently on each pool's device: each pool has its own :class:`Workload` (the model on that device,
:func:`pool_workloads`). A plan's stage runs its layers at the pace of its slowest device, so a
plan is costed on a **stitched** workload (:func:`stitched`): layer l takes the per-sample times of
the slowest pool among the devices of the stage that holds it (the elementwise maximum; for a stage
on one pool, that pool's). The analytical objective (:func:`planner.cost.estimate`) and the
simulator (:func:`planner.simulate.simulate_plan`) then read every stage's costs on its own
device, and the network (transfers, the stage's all-reduce) on the cluster's links, pools and
``between`` included. Memory is checked per device against its pool's usable memory.

The space (both modes): micro-batch counts M (a divisor of G), D stages of R replicas each (R | b,
D x R <= the GPUs used, a uniform R x D plan), as :class:`planner.search.SearchSpace` narrows it.

* **type-blind** (today's planner, as if every device were the first pool's kind): the default
  layer split of D stages (:func:`planner.simulate.split_candidates`' first: even blocks, the
  embedding and the head on the end stages), devices taken in order (stage s on devices
  ``s R .. s R + R - 1``, pools in order); the plan chosen as that planner would choose it, by
  its believed costs (the first pool's device everywhere: the best believed estimates simulated,
  the fastest believed one kept); its **true** time is then simulated on the stitched workload.
* **type-aware**: every stage on one pool (a TP group never spans two kinds, and a stage's
  replicas then share one pace), at most ``pool GPUs // R`` stages on a pool, which stages run on
  which pool and how many layers each holds chosen together, exactly, by
  :func:`cost_models.partition.typed_split` (the least slowest stage time, then the least sum of
  stage times, under each pool's memory with 1F1B's ``min(D - s, M)`` micro-batches in flight);
  stage s takes the next R devices of its pool. Beside it, the devices-in-order placement (stages
  may span two pools, the slowest sets the pace) with its kinds fixed and its layers split the same
  way. The candidates are ranked by DAPPLE's objective on the stitched workload, the best
  ``top_k`` simulated, and the fastest that fits kept.

The gain reported is the type-blind plan's true simulated time over the type-aware plan's.
For L uniform layers of c seconds on the first pool, a speed ratio rho = s_h / s_a and D stages
half on each pool, the type-blind slowest stage is an A100 one, L / D x c, and the type-aware split
balances L_a / L_h = s_a / s_h = 1 / rho, every stage 2 L c / (D (1 + rho)): a gain of
(1 + rho) / 2 on the slowest stage (tests/test_planner_mixed.py works it with the whole-layer
rounding and the 1F1B fill).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

from cost_models import Cluster
from cost_models.bind import cost_model_for
from cost_models.cluster import pool_devices
from cost_models.memory import usable_memory
from cost_models.partition import typed_split
from cost_models.workloads.workload import Workload, is_profile_path
from cost_models.workloads.workload_sources import load_workload, workload_spec

from .choose import Evaluated, check_global_batch
from .cost import estimate
from .placement import Topology
from .plan import Plan, StagePlan
from .search import PlanError, SearchSpace, divisors
from .simulate import SimOutcome, simulate_plan, split_candidates

AWARE, BLIND = "by-pool", "in-order"     # the plans' placement names (Plan.policy)


def pool_workloads(model, cluster: Cluster, recompute: str = "none", cost_model: str | None = None,
                   profile_batch: int | None = None) -> list[Workload]:
    """The model's workload on each pool's device (one per pool, in order)."""
    out = []
    for pool in cluster.pools:
        cm = cost_model_for(cost_model, pool.device, isinstance(model, str) and is_profile_path(model),
                            workload_spec(model))
        out.append(load_workload(model, pool.device, recompute, cm, profile_batch))
    return out


def pool_caps(cluster: Cluster, works: list[Workload], memory_limit: float | None) -> list[float | None]:
    """The memory a plan may use on each pool's devices: ``memory_limit`` as given, else the device's
    usable memory (less the verdicts' reserve, :func:`cost_models.memory.usable_memory`)."""
    if memory_limit is not None:
        return [float(memory_limit)] * len(works)
    return [None if w.memory_capacity is None else usable_memory(w.memory_capacity) for w in works]


def stitched(works: list[Workload], layer_pools: list[frozenset[int]]) -> Workload:
    """One workload whose layer l runs at the pace of the slowest pool in ``layer_pools[l]`` (the
    pools of the devices of the stage holding it): per-sample times the elementwise maximum over
    those pools' workloads, at every micro-batch (kernel costs: :meth:`Workload.at`); activations,
    boundary bytes and parameters are the model's (alike on every device)."""
    base = works[0]
    L = base.num_layers
    if len(layer_pools) != L:
        raise ValueError(f"stitched: {len(layer_pools)} layer pools for {L} layers")
    if len(works) == 1 or all(len(p) == 1 and 0 in p for p in layer_pools):
        return base

    def times(ws: list[Workload]):
        pick = lambda name: tuple(max(getattr(ws[p], name)[l] for p in layer_pools[l]) for l in range(L))  # noqa: E731
        return pick("f"), pick("b_input"), pick("w")

    f, b, w = times(works)
    curve = None
    if any(x.varies for x in works):
        def curve(q: int):
            return times([x.at(q) for x in works])
    kinds = "+".join(dict.fromkeys(str(x.device.name if x.device is not None else i) for i, x in enumerate(works)))
    return replace(base, f=f, b_input=b, w=w, spec=None, device=None, per_sample_at=curve,
                   source={**base.source, "devices": kinds})


def plan_pools(plan: Plan, cluster: Cluster) -> list[frozenset[int]]:
    """The pools of each stage's devices, per layer (what :func:`stitched` takes)."""
    out = []
    for st in plan.stages:
        pools = frozenset(cluster.pool_of_device(d) for d in st.devices)
        out += [pools] * st.num_layers
    return out


@dataclass(frozen=True)
class MixedCandidate:
    """A plan, the workload it is costed on, and whether every device is within its pool's memory."""

    evaluated: Evaluated
    work: Workload
    fits: bool

    @property
    def time(self) -> float:
        return self.evaluated.time


@dataclass
class MixedPlanning:
    """The type-aware plan and the type-blind one on one mixed cluster, both simulated on their
    true (stitched) costs; ``believed``: the type-blind plan as that planner saw it (its simulated
    time with the first pool's device everywhere)."""

    cluster: Cluster
    global_batch: int
    aware: MixedCandidate
    blind: MixedCandidate
    believed: Evaluated
    candidates: list[MixedCandidate]
    configurations: int
    seconds: float

    @property
    def gain(self) -> float:
        """Type-blind seconds per step over type-aware ones."""
        return gain(self.aware.time, self.blind.time)

    def summary(self) -> str:
        return gain_line(self.aware.time, self.blind.time)


def gain(aware_s: float, blind_s: float) -> float:
    """The gain of a type-aware plan: the type-blind plan's seconds per step over its own (both
    simulated on the mixed cluster's true costs). Both planners report it (DAPPLE's,
    :class:`MixedPlanning`; the whole-layout search, :func:`planner.layout.plan_type_blind`)."""
    return blind_s / aware_s


def gain_line(aware_s: float, blind_s: float) -> str:
    """The line both planners print: ``type-aware X s/step vs type-blind Y s/step: Gx``."""
    return f"type-aware {aware_s:.4g} s/step vs type-blind {blind_s:.4g} s/step: {gain(aware_s, blind_s):.2f}x"


def _configs(G: int, P: int, L: int, space: SearchSpace):
    """(M, D, R) of the space: M | G, R | b, D x R <= P, D <= L (and the space's restrictions)."""
    for M in divisors(G):
        if space.microbatches is not None and M not in space.microbatches:
            continue
        b = G // M
        for R in divisors(b):
            if R > P or (space.replicas is not None and R not in space.replicas):
                continue
            for D in range(1, min(L, P // R, space.max_stages or L) + 1):
                yield M, D, R


def _stage_fits(est, plan: Plan, cluster: Cluster, caps) -> bool:
    for st, se in zip(plan.stages, est.stages):
        for d in st.devices:
            cap = caps[cluster.pool_of_device(d)]
            if cap is not None and se.static_mem + se.act_mem > cap:
                return False
    return True


def _sim_fits(sim: SimOutcome, plan: Plan, cluster: Cluster, caps) -> bool:
    devs = plan.device_map()
    return all(caps[cluster.pool_of_device(d)] is None or peak <= caps[cluster.pool_of_device(d)]
               for d, peak in zip(devs, sim.per_device_peak))


def _plan(name: str, cluster_name: str, G: int, M: int, counts, devices, policy: str) -> Plan:
    edges = [0]
    for c in counts:
        edges.append(edges[-1] + c)
    return Plan(name, cluster_name, G, M, tuple(StagePlan(edges[s], edges[s + 1], tuple(devices[s]))
                                                 for s in range(len(counts))), policy)


def aware_candidates(works: list[Workload], cluster: Cluster, G: int, M: int, D: int, R: int, caps,
                     name: str, devices: int | None = None) -> list[Plan]:
    """The type-aware plans of one (M, D, R): stages on one pool each (:func:`typed_split` chooses
    the pools and the layers), and the devices-in-order placement with its layers split by type."""
    pools = cluster.pools
    P = cluster.num_devices if devices is None else devices
    L, b = works[0].num_layers, G // M
    q = b // R
    ats = [w.at(q) for w in works]
    times = [[(a.f[l] + a.b_input[l] + a.w[l]) * q for l in range(L)] for a in ats]
    base = works[0]
    static = [p * base.bytes_per_param_static for p in base.params]
    act = [a * q for a in base.act]
    inflight = [min(D - s, M) for s in range(D)]
    mem = dict(static=static, act=act, inflight=inflight, caps=[c if c is not None else float("inf") for c in caps])
    out = []
    # budget of GPUs: the first pools first (the devices the plan may use)
    left, limits, firsts = P, [], []
    first = 0
    for p in pools:
        use = min(p.num_devices, left)
        limits.append(use // R)
        firsts.append(first)
        first += p.num_devices
        left -= use
    got = typed_split(times, D, limits, **mem)
    if got is not None:
        devs = pool_devices([range(f, f + p.num_devices) for f, p in zip(firsts, pools)], got.kinds, R)
        out.append(_plan(name, cluster.name, G, M, got.counts, devs, AWARE))
    # devices in order, each stage at the pace of its slowest pool
    if D * R <= P:
        devs = [tuple(range(s * R, (s + 1) * R)) for s in range(D)]
        sets = [frozenset(cluster.pool_of_device(d) for d in ds) for ds in devs]
        kinds = list(dict.fromkeys(sets))
        ktimes = [[max(times[p][l] for p in ks) for l in range(L)] for ks in kinds]
        kcaps = [min(mem["caps"][p] for p in ks) for ks in kinds]
        seq = tuple(kinds.index(s) for s in sets)
        got = typed_split(ktimes, D, [D] * len(kinds), static=static, act=act, inflight=inflight, caps=kcaps,
                          sequence=seq)
        if got is not None:
            out.append(_plan(name, cluster.name, G, M, got.counts, devs, AWARE))
    return out


def blind_candidate(works: list[Workload], cluster: Cluster, G: int, M: int, D: int, R: int, name: str) -> Plan:
    """The type-blind plan of one (M, D, R): the default split, devices in order."""
    part = split_candidates(works[0], D)[0]
    return _plan(name, cluster.name, G, M, part, [tuple(range(s * R, (s + 1) * R)) for s in range(D)], BLIND)


def plan_mixed(model, cluster: Cluster, global_batch: int, *, memory_limit: float | None = None,
               recompute: str = "none", space: SearchSpace | None = None, top_k: int = 4, model_name: str | None = None,
               cost_model: str | None = None, profile_batch: int | None = None,
               works: list[Workload] | None = None) -> MixedPlanning:
    """Plan ``model`` on the mixed ``cluster`` both ways (the module docstring) and simulate both."""
    check_global_batch(global_batch)
    t0 = time.perf_counter()
    space = space or SearchSpace()
    works = works or pool_workloads(model, cluster, recompute, cost_model, profile_batch)
    name = model_name or (model if isinstance(model, str) else works[0].name)
    caps = pool_caps(cluster, works, memory_limit)
    P = cluster.num_devices if space.devices is None else min(space.devices, cluster.num_devices)
    topo = Topology(cluster)
    L = works[0].num_layers
    cap_max = max((c for c in caps if c is not None), default=None)
    aware, blind, n = [], [], 0
    for M, D, R in _configs(global_batch, P, L, space):
        n += 1
        for plan in aware_candidates(works, cluster, global_batch, M, D, R, caps, name, P):
            work = stitched(works, plan_pools(plan, cluster))
            est = estimate(plan, work, topo, cap_max)
            if _stage_fits(est, plan, cluster, caps):
                aware.append((est.latency, plan, work, est))
        plan = blind_candidate(works, cluster, global_batch, M, D, R, name)
        believed = estimate(plan, works[0], topo, caps[0])
        if believed.fits:
            blind.append((believed.latency, plan, believed))
    if not aware or not blind:
        raise PlanError(f"no plan of {name} with global batch {global_batch} fits on {P} device(s) of the mixed "
                        f"cluster {cluster.name} (each pool's memory); use more devices, recomputation or a "
                        f"smaller global batch")
    aware.sort(key=lambda x: x[0])
    seen, sims = set(), []
    for _, plan, work, est in aware:
        key = (plan.microbatches, plan.stages)
        if key in seen:
            continue
        seen.add(key)
        sim = simulate_plan(plan, work, cluster, cap_max)
        sims.append(MixedCandidate(Evaluated(plan, est, sim, note="type-aware"), work, _sim_fits(sim, plan, cluster,
                                                                                                 caps)))
        if len(sims) >= top_k:
            break
    fitting = sorted([c for c in sims if c.fits] or sims, key=lambda c: c.time)
    # type-blind: the planner's own choice by its believed costs, then the truth
    blind.sort(key=lambda x: x[0])
    believed = []
    for _, plan, est in blind[:top_k]:
        sim = simulate_plan(plan, works[0], cluster, caps[0])
        believed.append(Evaluated(plan, est, sim, note="type-blind (believed)"))
    chosen = min([b for b in believed if b.fits] or believed, key=lambda e: e.time)
    work = stitched(works, plan_pools(chosen.plan, cluster))
    est = estimate(chosen.plan, work, topo, cap_max)
    sim = simulate_plan(chosen.plan, work, cluster, cap_max)
    blind_true = MixedCandidate(Evaluated(chosen.plan, est, sim, note="type-blind"), work,
                                _sim_fits(sim, chosen.plan, cluster, caps))
    return MixedPlanning(cluster, global_batch, fitting[0], blind_true, chosen, fitting, n, time.perf_counter() - t0)
