"""Plan a training job end to end: search, re-simulate the best candidates, compare with the baselines.

:func:`plan_training` (what ``pipetwin plan`` runs):

1. search the plan space exactly under DAPPLE's objective (:func:`planner.search.search_plans`), keeping
   the best plans found; add the best plans of the round-trip-aware search (``dapple-rt``, a
   heuristic on an evaluation budget) and the best uniform (R x D) plan;
2. re-simulate, with the SimPy engine (:func:`planner.simulate.simulate_plan`), the exact optimum,
   the best uniform plan and the other candidates with the shortest round-trip-aware estimate
   (``top_k`` in all; uniform plans also with every other schedule named in ``schedules`` whose
   requirements they meet) and pick the fastest simulated one that fits in memory. Non-uniform
   plans are simulated through the IR's model copies (see :mod:`planner.simulate`). The pivot
   formulation alone can prefer plans whose network round trips starve 1F1B (see
   :mod:`planner.cost`); the simulation is what decides;
3. the baselines, through the same search code: the PipeDream planner (its slowest-element
   objective; it has no notion of micro-batches, so it is run for every micro-batch count M and the
   M whose plan has the shortest estimated synchronous iteration is kept, skipping the Ms whose
   :func:`planner.search.latency_floor` says no plan of theirs can be shorter) and pure data parallelism
   (one stage replicated on every device, M chosen by the objective: gradient accumulation when
   memory needs it); both simulated like the DAPPLE plan.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from tqdm import tqdm

from cost_models import Cluster
from cost_models.bind import cost_model_for
from cost_models.memory import usable_memory
from cost_models.workloads.workload import is_profile_path
from schedules import ScheduleError, build

from .cost import Estimate, estimate
from cost_models.workloads.workload_sources import load_workload, workload_spec
from .placement import Topology
from .plan import Plan, StagePlan
from .search import PlanError, SearchResult, SearchSpace, divisors, latency_floor, search_plans
from .simulate import SimOutcome, simulate_plan, split_candidates
from cost_models.workloads.workload import Workload




@dataclass
class Evaluated:
    """A plan with its analytical estimate and (when simulated) its simulated iteration."""

    plan: Plan
    estimate: Estimate
    sim: SimOutcome | None = None
    note: str = ""

    @property
    def time(self) -> float:
        """Simulated iteration time when simulated, else the analytical latency."""
        return self.sim.iteration_time if self.sim is not None else self.estimate.latency

    @property
    def fits(self) -> bool:
        return (not self.sim.oom) if self.sim is not None else self.estimate.fits

    def throughput(self) -> float:
        """Samples per second."""
        return self.plan.global_batch / self.time

    def to_dict(self) -> dict:
        d = {"plan": self.plan.describe(), "iteration_time": self.time, "simulated": self.sim is not None,
             "estimate": {"latency": self.estimate.latency, "latency_round_trip": self.estimate.latency_rt,
                          "peak_memory": self.estimate.peak_memory},
             "throughput": self.throughput()}
        if self.sim is not None:
            d["sim"] = self.sim.to_dict()
        if self.note:
            d["note"] = self.note
        return d


@dataclass
class PlanningResult:
    workload: Workload
    cluster: Cluster
    global_batch: int
    capacity: float | None
    best: Evaluated
    candidates: list[Evaluated]
    search: SearchResult
    pipedream: Evaluated | None = None
    data_parallel: Evaluated | None = None
    baseline_notes: dict = field(default_factory=dict)
    baseline_seconds: float = 0.0

    def speedup(self, other: Evaluated | None) -> float | None:
        return None if other is None else other.time / self.best.time


def with_simulation(ev: Evaluated, work: Workload, cluster: Cluster, cap) -> Evaluated:
    return replace(ev, sim=simulate_plan(ev.plan, work, cluster, cap))


MAX_GLOBAL_BATCH = 1 << 16     # samples per iteration the planner searches (65,536: tens of seconds at most)


# tokens per iteration beyond any published training run (Llama 3 405B: 16M; DeepSeek-V3: 15,360 x
# 4,096 = 63M): a -G this large times the sequence length is almost surely tokens typed as sequences
MAX_TOKENS_PER_STEP = 64 << 20


def batch_in_sequences(global_batch: int | None, global_tokens: int | None, seq_len: int | None) -> int:
    """The global batch in sequences from ``-G`` (sequences) or ``--global-tokens`` (tokens, a whole
    number of ``seq_len``-token sequences; the unit given explicitly, any size is taken). A ``-G``
    whose tokens (G x ``seq_len``) exceed :data:`MAX_TOKENS_PER_STEP` is refused naming
    ``--global-tokens``: it looks like tokens typed as sequences. One line each."""
    if (global_batch is None) == (global_tokens is None):
        raise ValueError("give the global batch as -G SEQUENCES or as --global-tokens TOKENS (e.g. 4M), one of "
                         "the two" + ("" if global_batch is None else "; not both"))
    if global_tokens is not None:
        if seq_len is None:
            raise ValueError("--global-tokens needs the model's sequence length; this model (a layer profile) has "
                             "none: give -G in samples")
        n, rest = divmod(global_tokens, seq_len)
        if rest:
            near = sorted({max(1, n), n + 1}, key=lambda k: abs(k * seq_len - global_tokens))[0]
            raise ValueError(f"--global-tokens {global_tokens:,} is not a whole number of {seq_len:,}-token "
                             f"sequences; the nearest is {near * seq_len:,} tokens (-G {near:,})")
        return n
    if global_batch < 1:
        raise ValueError(f"--global-batch must be >= 1; got {global_batch}")
    if seq_len and global_batch * seq_len > MAX_TOKENS_PER_STEP:
        raise ValueError(f"-G {global_batch:,} sequences of {seq_len:,} tokens is {global_batch * seq_len:,} tokens "
                         f"per step, more than any published run (Llama 3 405B 16M, DeepSeek-V3 63M): -G counts "
                         f"sequences; to give tokens, use --global-tokens {_tokens(global_batch)}"
                         + (f" (= -G {global_batch // seq_len:,})" if global_batch % seq_len == 0 else ""))
    return global_batch


def _tokens(n: int) -> str:
    """``n`` tokens as --global-tokens spells it: 4194304 -> 4M."""
    for suffix, unit in (("G", 1 << 30), ("M", 1 << 20), ("k", 1 << 10)):
        if n % unit == 0:
            return f"{n // unit}{suffix}"
    return str(n)


def check_global_batch(global_batch: int) -> None:
    """Both planners' bound on the global batch: at most :data:`MAX_GLOBAL_BATCH` samples."""
    if global_batch > MAX_GLOBAL_BATCH:
        raise ValueError(f"--global-batch {global_batch:,} is beyond the planner's limit of {MAX_GLOBAL_BATCH:,} "
                         f"samples (planner.choose.MAX_GLOBAL_BATCH: every divisor is a micro-batch count to search "
                         f"and simulate); plan a smaller global batch and accumulate gradients over iterations")


def plan_training(model, cluster: Cluster, global_batch: int, *, memory_limit: float | None = None,
                  recompute: str = "none", schedules=("dapple",), top_k: int = 6, simulate: bool = True,
                  baselines: bool = True, progress: bool = False, space: SearchSpace | None = None,
                  model_name: str | None = None, rt_budget: int | None = 1_000_000, cost_model: str | None = None,
                  profile_batch: int | None = None) -> PlanningResult:
    """Search, simulate and compare (see the module docstring). ``model``: a name (paper model,
    cost_models preset or YAML path, profile ``*.txt``), a ModelSpec or a :class:`Workload`;
    ``cost_model`` / ``profile_batch``: see :func:`cost_models.load_workload` (ignored for a Workload);
    ``cost_model`` None: the default of every command (:func:`cost_models.bind.cost_model_for`: kernels
    where the device has kernel constants, linear for profiles ``*.txt``, other devices and blocks
    the kernel model does not price)."""
    check_global_batch(global_batch)
    if not isinstance(model, Workload):
        cost_model = cost_model_for(cost_model, cluster.device, isinstance(model, str) and is_profile_path(model),
                                    workload_spec(model))
    work = model if isinstance(model, Workload) else load_workload(model, cluster.device, recompute, cost_model,
                                                                   profile_batch)
    name = model_name or (model if isinstance(model, str) else work.name)
    # the device's memory less the reserve the verdicts keep back (cost_models.memory); a
    # --memory-limit is the memory a plan may use, as given
    cap = memory_limit if memory_limit is not None else \
        (None if work.memory_capacity is None else usable_memory(work.memory_capacity))
    topo = Topology(cluster)
    space = space or SearchSpace()
    res = search_plans(work, topo, global_batch, objective="dapple", space=space, capacity=cap, top_k=max(top_k, 8),
                 model=name, cluster=cluster.name, progress=progress)
    pool = [Evaluated(c.plan, c.estimate) for c in res.candidates]
    extra = []
    try:    # candidates that respect the 1F1B round trips (a heuristic search, on a budget)
        rt = search_plans(work, topo, global_batch, objective="dapple-rt", space=space, capacity=cap, top_k=3,
                    model=name, cluster=cluster.name, budget=rt_budget)
        extra += [Evaluated(c.plan, c.estimate, note="round-trip search") for c in rt.candidates]
    except PlanError:
        pass
    if not space.uniform:
        try:
            u = search_plans(work, topo, global_batch, space=replace(space, uniform=True), capacity=cap,
                       model=name, cluster=cluster.name)
            extra.append(Evaluated(u.best.plan, u.best.estimate, note="best uniform plan"))
        except PlanError:
            pass
    # simulate the exact optimum, then the most promising others by the round-trip-aware estimate
    seen, cands = set(), []
    rest = sorted(pool[1:] + extra, key=lambda c: c.estimate.latency_rt)
    for c in [pool[0]] + rest:
        key = (c.plan.microbatches, c.plan.stages, c.plan.policy)
        if key in seen:
            continue
        seen.add(key)
        if len(cands) < top_k or c.note == "best uniform plan":
            cands.append(c)
    cands += default_layouts(cands, work, topo, cap)
    base = [c for c in cands if c.plan.uniform and c.plan.schedule == "dapple"]
    for sched in schedules:
        if sched == "dapple":
            continue
        for c in base:
            for split in schedule_splits(c.plan, sched, work):
                p = c.plan.with_schedule(sched, split=split)
                cands.append(Evaluated(p, c.estimate, note=f"{sched} on the plan of a dapple candidate"))
    evaluated, unmet = [], {}
    for c in tqdm(cands, desc="simulating candidates", disable=not (progress and simulate), leave=False):
        if simulate:
            try:
                c = with_simulation(c, work, cluster, cap)
            except ScheduleError as e:      # a schedule whose requirements the plan does not meet
                unmet.setdefault(c.plan.schedule, str(e))
                continue
        evaluated.append(c)
    # the dapple candidates are what the other schedules are tried on; they are answers only when asked for
    evaluated = [c for c in evaluated if c.plan.schedule in schedules]
    if not evaluated:
        why = "; ".join(f"{n}: {unmet[n]}" for n in schedules if n in unmet)
        raise PlanError(f"no plan with schedule {', '.join(schedules)}: it is tried on the uniform R x D plans of the "
                        f"dapple search" + (f" and none meets its requirements ({why})" if why else
                                            " and none was simulated (simulate, or add dapple to --schedules)"))
    fitting = [c for c in evaluated if c.fits] or evaluated
    fitting.sort(key=lambda c: c.time)
    out = PlanningResult(work, cluster, global_batch, cap, fitting[0], fitting, res)
    if baselines:
        _baselines(out, work, topo, cluster, global_batch, cap, space, name, simulate, progress)
    return out


def default_layouts(cands: list[Evaluated], work: Workload, topo: Topology, cap) -> list[Evaluated]:
    """For each R x D x M shape among the uniform candidates, the plan ``pipetwin simulate -s dapple
    -D D -N M --dp R`` runs: the default split (:func:`planner.simulate.split_candidates`' first) and
    the sequential device map (rank i * D + s, replica i of stage s, on device i * D + s), so that
    the planner's answer is never slower than the default layout of the shape it picks."""
    out, seen = [], {(c.plan.num_stages, c.plan.dp, c.plan.microbatches, c.plan.stages) for c in cands
                     if c.plan.uniform}
    shapes = dict.fromkeys((c.plan.num_stages, c.plan.dp, c.plan.microbatches) for c in cands if c.plan.uniform)
    for D, R, M in shapes:
        part = split_candidates(work, D)[0]
        edges = [sum(part[:s]) for s in range(D + 1)]
        stages = tuple(StagePlan(edges[s], edges[s + 1], tuple(i * D + s for i in range(R))) for s in range(D))
        if (D, R, M, stages) in seen:
            continue
        first = next(c.plan for c in cands if c.plan.uniform and c.plan.num_stages == D and c.plan.dp == R)
        plan = replace(first, microbatches=M, stages=stages, policy="sequential", schedule="dapple", split=())
        out.append(Evaluated(plan, estimate(plan, work, topo, cap), note="default split and device map"))
    return out


def schedule_splits(plan: Plan, sched: str, work: Workload) -> list[tuple[int, ...]]:
    """The splits to try for a dapple plan run with schedule ``sched``: () (the plan's own partition)
    when the schedule has the plan's stages, else :func:`planner.simulate.split_candidates` over the
    schedule's stages; none when the plan does not meet the schedule's requirements."""
    try:
        S = build(sched, plan.num_stages, plan.microbatches, chunks=plan.chunks).num_stages
        return [()] if S == plan.num_stages else split_candidates(work, S)
    except (ScheduleError, ValueError):
        return []


def pipedream_plan(work: Workload, topo: Topology, G: int, *, microbatches: int | None = None,
                   space: SearchSpace | None = None, capacity=None, model: str | None = None,
                   skip_by_floor: bool = True) -> Evaluated | None:
    """The PipeDream planner's plan. PipeDream plans for one micro-batch size (its minibatch) and has
    no notion of a synchronous iteration: with ``microbatches`` given it plans for b = G / M; without,
    it is run for every M dividing G and the M whose plan has the shortest estimated synchronous
    iteration (round-trip bound) is kept, the most favourable reading for the baseline (Ms that
    cannot beat the best found are not searched; the same M is kept; ``skip_by_floor=False``
    searches every M, the plain scan the skipping is checked against)."""
    space = space or SearchSpace()
    Ms = [microbatches] if microbatches is not None else [
        m for m in divisors(G) if space.microbatches is None or m in space.microbatches]
    # The kept M is the first (in increasing M) with the least latency_rt of its plan. Every plan's
    # latency_rt >= its L >= latency_floor(M), so an M whose floor exceeds the best latency_rt found
    # cannot be kept and is not searched; the Ms are searched in increasing floor so the best comes
    # early, and compared by (latency_rt, position in increasing M): the same M as the plain scan.
    floors = [latency_floor(work, topo, G, M, space=space, capacity=capacity) if len(Ms) > 1 else 0.0
              for M in Ms] if skip_by_floor else [0.0] * len(Ms)
    best = None
    for idx in sorted(range(len(Ms)), key=lambda x: (floors[x], x)):
        if best is not None and floors[idx] > best[0]:
            continue
        try:
            r = search_plans(work, topo, G, objective="pipedream", space=replace(space, microbatches=(Ms[idx],)),
                       capacity=capacity, model=model, cluster=topo.cluster.name)
        except PlanError:
            continue
        c = r.best
        if best is None or (c.estimate.latency_rt, idx) < best[:2]:
            best = (c.estimate.latency_rt, idx, c)
    return None if best is None else Evaluated(best[2].plan, best[2].estimate)


def data_parallel_plan(work: Workload, topo: Topology, G: int, *, space: SearchSpace | None = None,
                       capacity=None, model: str | None = None) -> Evaluated:
    """Pure data parallelism: the whole model on every device (gradient accumulation over M
    micro-batches when memory needs it). Raises PlanError when it does not fit."""
    space = space or SearchSpace()
    P = space.devices or topo.num_devices
    r = search_plans(work, topo, G, space=replace(space, max_stages=1, uniform=False, replicas=(P,)),
               capacity=capacity, model=model, cluster=topo.cluster.name)
    return Evaluated(r.best.plan, r.best.estimate)


def _baselines(out: PlanningResult, work, topo, cluster, G, cap, space, name, simulate, progress) -> None:
    import time
    t0 = time.perf_counter()
    bar = tqdm(total=2, desc="baselines: PipeDream's plan, data parallelism", disable=not progress, leave=False)
    with _clock(bar):
        _baseline_plans(out, work, topo, cluster, G, cap, space, name, simulate, bar)
    bar.close()
    out.baseline_seconds = time.perf_counter() - t0


def _clock(bar):
    """A context in which a shown tqdm ``bar`` is redrawn every second (its clock runs while one
    long step, PipeDream's search, has no tick to give)."""
    import contextlib
    import threading
    done = threading.Event()

    def redraw():
        while not done.wait(1.0):
            bar.refresh()

    @contextlib.contextmanager
    def ctx():
        if not bar.disable:
            threading.Thread(target=redraw, daemon=True).start()
        try:
            yield
        finally:
            done.set()
    return ctx()


def _baseline_plans(out: PlanningResult, work, topo, cluster, G, cap, space, name, simulate, bar) -> None:
    ev = pipedream_plan(work, topo, G, space=space, capacity=cap, model=name)
    if ev is None:
        out.baseline_notes["pipedream"] = "no plan fits"
    else:
        out.pipedream = with_simulation(ev, work, cluster, cap) if simulate else ev
    bar.update(1)
    try:
        ev = data_parallel_plan(work, topo, G, space=space, capacity=cap, model=name)
        out.data_parallel = with_simulation(ev, work, cluster, cap) if simulate else ev
    except PlanError as e:
        gib = 2 ** 30
        whole = work.total_params * work.bytes_per_param_static
        one = whole + work.activation(0, work.num_layers)     # at least one sample per micro-batch
        if cap is not None and one > cap:
            out.baseline_notes["data_parallel"] = (
                f"does not fit: every device would hold the whole model, {whole / gib:.1f} GiB of weights, "
                f"gradients and optimizer state plus activations, > {cap / gib:.1f} GiB")
        else:
            out.baseline_notes["data_parallel"] = "does not fit: " + str(e).split(": ", 1)[-1]
    bar.update(1)


def evaluate_plan(plan: Plan, work: Workload, cluster: Cluster, capacity=None, simulate: bool = True) -> Evaluated:
    """Estimate (and simulate) one given plan."""
    cap = capacity if capacity is not None else work.memory_capacity
    ev = Evaluated(plan, estimate(plan, work, Topology(cluster), cap))
    return with_simulation(ev, work, cluster, cap) if simulate else ev
