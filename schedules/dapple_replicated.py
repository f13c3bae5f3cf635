"""DAPPLE's early-backward schedule with a different number of replicas per stage (a non-uniform plan).

Stage s runs on r_s devices. With C = lcm(r_s), every micro-batch is cut into C sub-batches,
sub-batch c runs on model copy c, and copy c of stage s is placed on replica ``c mod r_s`` of that
stage: a device of stage s holds C / r_s copies of the stage (one set of weights: the schedule's
``meta["shared_copies"]``, which the cost models and the executor honour)
and runs them one after the other. Programs follow 1F1B over whole micro-batches: each device runs
min(S - s - 1, M) warm-up micro-batches (all its copies of each), then alternates one micro-batch
forward and one backward, then drains. A layout names it with ``stage_replicas``
(:class:`cost_models.job.Layout`); the DAPPLE planner writes such plans (:mod:`planner.simulate`).

Requirements: r_s >= 1 per stage; the layout's micro-batches are the schedule's M x C sub-batches.
Bubble: 1F1B's, (S - 1) / (M + S - 1) in units of a whole micro-batch's stage time; memory: a
device of stage s keeps at most min(S - s, M) micro-batches, C / r_s sub-batches each.
Paper: DAPPLE (Fan et al., PPoPP 2021), its replicated stages.
"""
from __future__ import annotations

from functools import reduce
from math import gcd

from .dapple import one_f_one_b
from .ir import B, F, Schedule, make_schedule

REPLICATED = "dapple-replicated"


def sub_batches(replicas) -> int:
    """C = lcm of the stages' replica counts."""
    return reduce(lambda a, b: a * b // gcd(a, b), [int(r) for r in replicas], 1)


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
    C = sub_batches(reps)
    from .registry import check_size
    # before anything is built (a plan file's micro-batches edited by hand): each stage runs each of
    # the M x C sub-batches once, on one of its replicas: the ops of an S-stage pipeline of M x C
    check_size(S, M * C)
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
                         meta={"replicas": reps, "microbatches": M, "sub_batches": C, "shared_copies": True})


