"""Shared construction of bidirectional schedules (Chimera, BitPipe and our own variants).

Two model copies run in opposite directions over the same devices. The micro-batches of each
basic unit (D of them) are split in half: the first half goes "down" (copy 0), the second "up"
(copy 1). The per-device order of a unit comes from greedy list scheduling under unit costs
with the rule "backward first; among forwards the deepest stage first"; N = K*D concatenates K
units, and a device may pull the first ``pull`` forwards of the next unit into idle time at the
junction (0 = direct concatenation).
"""
from __future__ import annotations

from .ir import B, F, W, make_schedule
from .timing import list_schedule


def v_placement(D: int) -> list[list[int]]:
    """Two opposite V-shaped copies of 2D stages each (BitPipe): down stage k < D on device k and
    k >= D on device 2D-1-k; the up copy mirrors it. Device d holds down stages d, 2D-1-d and
    up stages D-1-d, D+d; the V turn (stage D-1 -> D) stays on one device."""
    S = 2 * D
    down = [k if k < D else S - 1 - k for k in range(S)]
    up = [D - 1 - k if k < D else k - D for k in range(S)]
    return [down, up]


def straight_placement(D: int) -> list[list[int]]:
    """Two opposite straight copies of D stages (Chimera)."""
    return [list(range(D)), [D - 1 - s for s in range(D)]]


def copy_of(mb: int, D: int) -> int:
    return 0 if mb % D < D // 2 else 1


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
