"""Shared pieces of the bidirectional schedules (Chimera, BitPipe and our own variants).

Two model copies run in opposite directions over the same devices. The micro-batches of each
basic unit (D of them) are split in half: the first half goes "down" (copy 0), the second "up"
(copy 1); :func:`copy_microbatch` numbers them, so a copy's k-th micro-batch (the k-th it runs,
first in first out, as the released runtimes do) is a fixed global micro-batch.

- placements live in :mod:`schedules.placement` (:func:`~schedules.placement.v_placement` for BitPipe,
  :func:`~schedules.placement.straight_placement` for Chimera);
- :func:`pick_variant`: one check of a family's ``variant=`` argument (one ScheduleError line);
- :class:`FifoStreams`: emit a released runtime's per-device order as "next forward / backward of
  this copy's chunk" calls and get pipetwin's (kind, micro-batch, copy, stage) tuples back;
- :func:`build_bidirectional`: the greedy list-scheduled order (pipetwin's own, BitPipe's
  ``greedy`` variant): list scheduling under unit costs with the rule "backward first; among
  forwards the deepest stage first"; N = K*D concatenates K units, and a device may pull the first
  ``pull`` forwards of the next unit into idle time at the junction (0 = direct concatenation).
"""
from __future__ import annotations

from .ir import B, F, ScheduleError, W, make_schedule
from .timing import list_schedule


def copy_of(mb: int, D: int) -> int:
    return 0 if mb % D < D // 2 else 1


def copy_microbatch(copy: int, k: int, D: int) -> int:
    """The global micro-batch that is the k-th one of a copy: unit k // (D/2), and within the unit
    the first D/2 micro-batches go down (copy 0), the next D/2 up (copy 1); inverse of
    :func:`copy_of` with the unit order."""
    half = D // 2
    return (k // half) * D + copy * half + k % half


def pick_variant(name: str, variant: str | None, variants: dict[str, str]) -> str:
    """The variant to build (the first of ``variants`` when None); a clear error otherwise."""
    if variant is None:
        return next(iter(variants))
    if variant not in variants:
        raise ScheduleError(f"{name} has no variant {variant!r}; choose one of {', '.join(variants)} "
                            f"(default {next(iter(variants))})")
    return variant


class FifoStreams:
    """Builds one device's order from "run the next F (or B) of this chunk" steps.

    The released runtimes keep one first-in-first-out queue per model chunk: the k-th forward a
    chunk runs is its copy's k-th micro-batch, and so is its k-th backward. ``stage_of[key]`` names
    the (copy, stage) a chunk key stands for; ``f(key)`` / ``b(key)`` append the next op."""

    def __init__(self, D: int, stage_of: dict):
        self.D = D
        self.stage_of = stage_of
        self.count: dict[tuple, int] = {}
        self.order: list[tuple[str, int, int, int]] = []

    def _next(self, kind: str, key) -> None:
        copy, stage = self.stage_of[key]
        k = self.count.get((kind, key), 0)
        self.count[(kind, key)] = k + 1
        self.order.append((kind, copy_microbatch(copy, k, self.D), copy, stage))

    def f(self, key) -> None:
        self._next(F, key)

    def b(self, key) -> None:
        self._next(B, key)


def build_bidirectional(name: str, D: int, N: int, placement, *, pull: int, split: bool = False,
                        meta: dict | None = None, priority=None):
    S = len(placement[0])
    ops = [[] for _ in range(D)]
    kinds = (F, B, W) if split else (F, B)
    for m in range(N):
        c = copy_of(m, D)
        for s in range(S):
            ops[placement[c][s]] += [(k, m, c, s) for k in kinds]
    f = D / S

    def dur(kind, c, s):
        return 2 * f if (kind == B and not split) else f

    def unit(op):
        return op[1] // D

    def prio(d, op):
        kind, mb, c, s = op
        # current unit first; backward before forward; the backward nearest to finishing its
        # micro-batch (shallowest stage) and the forward deepest into the pipeline first
        return (unit(op), {B: 0, W: 2, F: 1}[kind], -s if kind == F else s, mb)

    def admit(d, op, state):
        # ops of the device's current unit always; of the next unit only its first `pull` forwards
        current = min(g for g, n in state["pending"][d].items() if n)
        u = unit(op)
        if u == current:
            return True
        return op[0] == F and state["started"].get((d, u, F), 0) < pull

    order = list_schedule(ops, S, dur, priority or prio, admit=admit, group=unit)
    return make_schedule(name, D, N, placement, order, split_backward=split, meta=dict(meta or {}))
