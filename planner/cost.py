"""The planner's analytical objective: DAPPLE's iteration time L = warm-up + steady + ending.

A plan (see :mod:`planner.plan`) is a chain of *elements*: stage 0, the boundary 0->1, stage 1, ...,
stage S-1. With b = G / M samples per micro-batch and q_s = b / r_s per replica of stage s:

* a stage has forward ``fw = F_s(q_s) q_s`` and backward ``bw = B_s(q_s) q_s`` (F_s, B_s: per-sample
  seconds of its layers at a micro-batch of q_s samples, the same at every q_s with the linear cost
  model; B = input + weight gradient) and occupies its devices ``st = fw + bw`` per micro-batch;
* a boundary has ``fw`` = the time to send one micro-batch's activations from stage s to stage s+1
  and ``bw`` = the time to send the gradients back (:meth:`planner.placement.Topology.transfer`);
  the two directions use different links (full duplex), so it occupies its links
  ``st = max(fw, bw)`` per micro-batch;
* a stage's gradient all-reduce over its r_s devices takes ``AR_s`` (:mod:`cost_models.comm`) and
  its optimizer step ``OPT_s``.

The pivot formulation of DAPPLE (Fan et al., PPoPP 2021, section 5): in 1F1B (early backward) the
pivot element Q is the one whose steady phase dominates; then

    T_w = sum_{e <= Q} fw_e                      warm-up: micro-batch 0 reaches the pivot
    T_s = (M - 1) * st_Q                         steady: the pivot runs the other M-1 micro-batches
    T_e = sum_{e <= Q} bw_e + max_s (AR_s + OPT_s - Bp_s)   ending: the last backward drains to
                                                 stage 0; the all-reduce of stage s starts when its
                                                 last backward is done, Bp_s = sum_{e < s} bw_e
                                                 before the end of the computation, and only the
                                                 part that sticks out is paid
    L = T_w + T_s + T_e

The pivot is ``Q = argmax_e (sum_{e'<=e} (fw + bw) + (M - 1) st_e)``: DAPPLE's backward scan from
the last stage (stage s replaces the pivot Q > s when ``(M-1) st_s > (M-1) st_Q + sum_{s<e<=Q}
(fw + bw)``) picks exactly this maximiser; ties go to the later element, as in the paper. The
communication of a boundary is part of the chain (a boundary can be the pivot when the network is
the bottleneck). Memory: stage s keeps the activations of ``min(S - s, M)`` micro-batches (1F1B) of
q_s samples each, on top of its weights, gradients and optimizer state (16 B / parameter for
mixed-precision Adam); a plan fits when every stage's peak is within the device memory limit.

What the pivot formulation leaves out, and the simulator shows: 1F1B lets stage s hold only
``w_s = min(S - s, M)`` micro-batches, so it cannot start a new one faster than one per
``RT_s / w_s``, where ``RT_s`` is the round trip from stage s to the end of the chain and back
(forward, every later element, backward). When the network is slow this starves the pipeline
although no element is saturated. :attr:`Estimate.latency_rt` adds these round trips as candidate
pivots (``sum of all round trips + (M - 1) RT_s / w_s``); it is what the planner uses to choose
which of the searched candidates to simulate. It is not the search objective: ``w_s`` rewards
appending stages (more in flight), which breaks the monotone structure the exact search relies on
and lets the search pad plans with one-layer stages.

The PipeDream planner's objective (Narayanan et al., SOSP 2019), evaluated on the same terms, is
the time of the slowest element per micro-batch: ``max(stage: max(st_s, AR_s / r_s);
boundary: fw + bw)`` (its replicated stages overlap the all-reduce with compute, and each replica
synchronises every r_s micro-batches; communication in and out of a stage is counted twice).
"""
from __future__ import annotations

from dataclasses import dataclass

from .placement import Topology
from .plan import Plan
from cost_models.workloads.workload import Workload


@dataclass(frozen=True)
class StageEstimate:
    f: float            # forward of one micro-batch on one replica (seconds)
    b: float            # backward
    allreduce: float    # gradient all-reduce over the replicas
    optim: float        # optimizer step
    static_mem: float   # weights + gradients + optimizer state (bytes)
    act_mem: float      # peak activations (bytes)

    @property
    def memory(self) -> float:
        return self.static_mem + self.act_mem


@dataclass(frozen=True)
class Estimate:
    """DAPPLE's latency of a plan and its parts (seconds), memory (bytes) and the PipeDream objective."""

    latency: float
    warmup: float
    steady: float
    ending: float
    pivot: str                               # "stage s" or "link s->s+1"
    stages: tuple[StageEstimate, ...]
    links: tuple[tuple[float, float], ...]   # (activation, gradient) transfer per boundary
    capacity: float | None
    slowest: float                           # PipeDream's objective
    latency_rt: float = 0.0                  # L with the 1F1B round-trip bound (>= latency)

    @property
    def peak_memory(self) -> float:
        return max(s.memory for s in self.stages)

    @property
    def fits(self) -> bool:
        return self.capacity is None or self.peak_memory <= self.capacity

    def to_dict(self) -> dict:
        return {"latency": self.latency, "latency_round_trip": self.latency_rt, "warmup": self.warmup,
                "steady": self.steady, "ending": self.ending,
                "pivot": self.pivot, "slowest_element": self.slowest, "peak_memory": self.peak_memory,
                "fits": self.fits,
                "stages": [{"f": s.f, "b": s.b, "allreduce": s.allreduce, "optim": s.optim,
                            "static_mem": s.static_mem, "act_mem": s.act_mem} for s in self.stages],
                "links": [list(l) for l in self.links]}


def stage_estimate(work: Workload, topo: Topology, i: int, j: int, devs: tuple[int, ...], b: int,
                   inflight: int) -> StageEstimate:
    """Layers [i, j) on ``devs`` with b samples per micro-batch and ``inflight`` micro-batches kept
    (compute at the per-sample times of a micro-batch of b / replicas samples)."""
    q = b / len(devs)
    p = work.param_count(i, j)
    wq = work.at(round(q))
    return StageEstimate(wq.fwd(i, j) * q, wq.bwd(i, j) * q,
                         topo.allreduce(devs, p * work.grad_bytes_per_param), p * work.optim_time_per_param,
                         p * work.bytes_per_param_static, inflight * work.activation(i, j) * q)


def boundary_bytes(work: Workload, layer: int, b: int) -> float:
    """Bytes of one micro-batch's output of ``layer`` (the tensor a stage ending there sends)."""
    return work.out_bytes[layer] * b


def estimate(plan: Plan, work: Workload, topo: Topology, capacity: float | None = None) -> Estimate:
    """The objective of a plan (see the module docstring), computed forwards with an explicit pivot."""
    if plan.num_layers != work.num_layers or plan.stages[0].start != 0:
        raise ValueError(f"plan covers layers {plan.stages[0].start}..{plan.stages[-1].stop}; model "
                         f"{work.name} has {work.num_layers}")
    S, M, b = plan.num_stages, plan.microbatches, plan.micro_batch
    stages = [stage_estimate(work, topo, st.start, st.stop, st.devices, b, min(S - s, M))
              for s, st in enumerate(plan.stages)]
    links = []
    for s in range(S - 1):
        a, c = plan.stages[s], plan.stages[s + 1]
        nbytes = boundary_bytes(work, a.stop - 1, b)
        links.append((topo.transfer(a.devices, c.devices, nbytes), topo.transfer(c.devices, a.devices, nbytes)))
    # the chain of elements: (fw, bw, st, name, stage index or -1)
    elems = []
    for s in range(S):
        st = stages[s]
        elems.append((st.f, st.b, st.f + st.b, f"stage {s}", s))
        if s < S - 1:
            fw, bw = links[s]
            elems.append((fw, bw, max(fw, bw), f"link {s}->{s + 1}", -1))
    best, piv, acc = -1.0, None, 0.0
    for e, (fw, bw, st, name, _) in enumerate(elems):
        acc += fw + bw
        v = acc + (M - 1) * st
        if v >= best:
            best, piv = v, (e, st, name)
    e, st, name = piv
    warm = sum(x[0] for x in elems[:e + 1])
    drain = sum(x[1] for x in elems[:e + 1])
    steady = (M - 1) * st
    tail, bp = float("-inf"), 0.0
    for _fw, bw, _, _, s in elems:
        if s >= 0:
            tail = max(tail, stages[s].allreduce + stages[s].optim - bp)
        bp += bw
    # the 1F1B round-trip bound (see the module docstring): stage s holds min(S - s, M) micro-batches
    total_rt, rt_suffix, loop = acc, 0.0, best
    for e2 in range(len(elems) - 1, -1, -1):
        fw, bw, _, _, s = elems[e2]
        rt_suffix += fw + bw
        if s >= 0:
            loop = max(loop, total_rt + (M - 1) * rt_suffix / min(S - s, M))
    slowest = 0.0
    for s, st in enumerate(stages):
        slowest = max(slowest, st.f + st.b, st.allreduce / plan.stages[s].replicas)
    for fw, bw in links:
        slowest = max(slowest, fw + bw)
    return Estimate(warm + steady + drain + tail, warm, steady, drain + tail, name, tuple(stages),
                    tuple(links), capacity if capacity is not None else work.memory_capacity, slowest,
                    loop + tail)
