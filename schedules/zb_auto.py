"""ZB-auto: the Zero Bubble paper's automatic scheduler (Qi et al., ICLR 2024, section 3.2 and
appendix), our own code: an order of F, B and W per device under a memory limit, from the stage costs.

Requirements: D >= 1, N >= 1; a memory limit of at least one micro-batch per device. Stage s on
device s, a split backward (B = input gradient, W = weight gradient).

Inputs (:class:`AutoCosts`): per stage F, B, W times, one message time between adjacent stages,
the activation a micro-batch keeps on each stage from its F (its B frees all but ``act_w``, which
its W frees), and each device's limit in the same unit. Without costs (the registry's default, also
what ``pipetwin run`` executes): unit costs F = B = W = 1, no message time, 1 Ma per micro-batch
kept whole until W. The variants set the limit: ``1p`` (ZB-1p) D Ma, the peak of 1F1B; ``2p``
(ZB-2p) 2D Ma, twice that. :func:`cost_models.bind.bind` passes the job's own stage costs (any cost
source) when it builds this family.

The cost of an order is the paper's: the longest time any device takes from its first op to its
last (the devices' starts are staggered), then the makespan (ties). Messages are posted: a device
goes on while its message travels.

1. The heuristic (:func:`greedy`), round by round as the paper's: micro-batch 0's F on every
   device, then on each device as many more F's as end before (or, by a knob, start before) its
   first B's gradient arrives, no more on each later device (and, by a knob, fewer: the uniform
   stagger; a slow pool after a fast one wants as many); then per round one F per device (from
   the first) and one B (from the last). Before an F or a B a device runs owed W's that make room
   under the limit and W's that end before the op's input arrives. Four knobs, sixteen settings
   (the stagger above, and):
   the warm-up F's may delay the first B or not; a device two F's ahead of the next skips its F
   (or not) when the next's gradient would come back before that F could end and waiting keeps
   its idle time within the worst device's; a gap too short for a W is filled with one
   (overrunning it), or (the other setting) left idle when that keeps its idle time within the
   worst device's.
2. The candidates: the sixteen heuristic orders (timed as they are placed) and ZB-H1 / ZB-H2 where
   they fit the limit (timed by :func:`timing`); the cheapest is refined: two adjacent ops of
   different kinds and micro-batches swap (a W one place earlier or later, an F past a B), the
   busiest device first, while that lowers the cost (or, at the same cost, the makespan) and keeps
   the limit, within a budget of ``REFINE_OPS`` timed ops (one timing is 3 N D ops); the other
   distinct candidates, cheapest first, are refined with a quarter of that budget among them, and
   the cheapest result is the order. The search takes about a second at D = 32, N = 256.

Non-uniform stages (a slow pool's stages k times a fast pool's): the cost of any order is at least
the busiest device's work, max_d N (F + B + W)_d, since a device's span holds all its ops; the rest
is the warm-up and cool-down that device cannot fill (its first input, its last gradient). The
slow stages' W's wait while their B's feed the fast stages, and the fast stages' W's fill their
waits. Against an exhaustive search over every order (D = 2, 3; N = 2 .. 4; two pools, ratio 2, W
= F or F / 2 (F only at D = 3, N = 4), message 0 or 0.1, limits 1p and 2p: ``tests/test_zb_auto.py``)
it meets the bound in 54 of 128 cases, is the optimum in 127 and two message times (0.76 %) above it
in the last.

So the cost is never above ZB-H1's at a limit that ZB-H1 fits (D Ma, ZB-1p), nor ZB-H2's at 2D Ma
(ZB-2p). Under unit costs both give the bound 3N + D - 1 + max(0, D - N) (the staggered start).
On the Zero Bubble paper's Table 9 stage times (activation 34sbh + 5as^2b a layer, of which W
keeps 32sbh) it gives Table 5's ZB-1p and ZB-2p bubbles to 1e-3, every row
(``tests/test_zb_auto.py``).
"""
from __future__ import annotations

from dataclasses import dataclass

from .common import check_positive
from .ir import B, F, ScheduleError, W, make_schedule
from .zb_h1 import zbh1_device_order
from .zb_h2 import zbh2_device_order

NAME = "zb-auto"
REQUIRES = "D >= 1, N >= 1 (1p: D Ma, 2p: 2D Ma)"
VARIANTS = {"1p": "memory limit of 1F1B's peak, D Ma (ZB-1p)", "2p": "twice 1F1B's peak, 2D Ma (ZB-2p)"}
LIMIT_MA = {"1p": 1, "2p": 2}
TAKES_MEMORY_LIMIT = True       # --memory-limit: the limit itself, in Ma or bytes, in place of the variant's
REFINE_OPS = 400_000
KNOBS = [(a, b, c, s) for s in (True, False) for a in (True, False) for b in (True, False) for c in (True, False)]

Order = list[tuple[str, int]]
_EPS = 1e-9

@dataclass(frozen=True)
class AutoCosts:
    """Per-stage times ``f``, ``b``, ``w``, the ``message`` time, per-stage activation ``act`` per
    micro-batch and per-device ``limit`` (the unit of ``act``); ``act_w``: the part of ``act`` a
    micro-batch keeps from its B until its W (None: all of it)."""

    f: tuple[float, ...]
    b: tuple[float, ...]
    w: tuple[float, ...]
    message: float
    act: tuple[float, ...]
    limit: tuple[float, ...]
    act_w: tuple[float, ...] | None = None

    @classmethod
    def unit(cls, D: int, variant: str = "1p", limit_ma: float | None = None) -> "AutoCosts":
        """Unit costs under the variant's limit, or ``limit_ma`` Ma per device."""
        limit = float(LIMIT_MA[variant] * D) if limit_ma is None else float(limit_ma)
        return cls((1.0,) * D, (1.0,) * D, (1.0,) * D, 0.0, (1.0,) * D, (limit,) * D)

    def kept(self) -> tuple[float, ...]:
        """What a micro-batch keeps on each stage between its B and its W."""
        return self.act if self.act_w is None else self.act_w

    def check(self, D: int) -> None:
        if not all(len(t) == D for t in (self.f, self.b, self.w, self.act, self.limit, self.kept())):
            raise ScheduleError(f"{NAME}: stage costs must have {D} entries, one per device")
        for d in range(D):
            if self.limit[d] < self.act[d]:
                raise ScheduleError(f"{NAME}: device {d}'s memory limit {self.limit[d]:g} is below one micro-batch's "
                                    f"activation {self.act[d]:g}; raise the limit")
            if not 0 <= self.kept()[d] <= self.act[d]:
                raise ScheduleError(f"{NAME}: device {d}'s act_w {self.kept()[d]:g} must lie in [0, act = "
                                    f"{self.act[d]:g}]")


def timing(orders: list[Order], c: AutoCosts) -> tuple[float, float] | None:
    """(cost, makespan) of per-device ``orders``: each op as soon as its device is free and its
    input, one message later from a neighbour, has arrived; the cost is the longest time a device
    takes from its first op's start to its last op's end. None if the orders deadlock or break a
    device's memory limit."""
    D = len(orders)
    fend: list[dict] = [{} for _ in range(D)]
    bend: list[dict] = [{} for _ in range(D)]
    pos, free, mem, first = [0] * D, [0.0] * D, [0.0] * D, [None] * D
    lens = [len(o) for o in orders]
    kept, msg, last = c.kept(), c.message, D - 1
    left = sum(lens)
    while left:
        moved = False
        for d in range(D):
            o, p, t = orders[d], pos[d], free[d]
            fe, be = fend[d], bend[d]
            up = fend[d - 1] if d else None
            down = bend[d + 1] if d < last else None
            m, act, lim = mem[d], c.act[d], c.limit[d] + _EPS
            n0 = p
            while p < lens[d]:
                kind, mb = o[p]
                if kind == F:
                    if up is None:
                        start = t
                    else:
                        dep = up.get(mb)
                        if dep is None:
                            break
                        start = max(t, dep + msg)
                    if first[d] is None:
                        first[d] = start
                    t = fe[mb] = start + c.f[d]
                    m += act
                    if m > lim:
                        return None
                elif kind == B:
                    if down is None:
                        dep = fe.get(mb)
                        if dep is None:
                            return None          # B before its own F
                    else:
                        dep = down.get(mb)
                        if dep is None:
                            break
                        dep += msg
                    if first[d] is None:
                        first[d] = max(t, dep)
                    t = be[mb] = max(t, dep) + c.b[d]
                    m -= act - kept[d]
                else:
                    dep = be.get(mb)
                    if dep is None:
                        return None              # W before its own B
                    if first[d] is None:
                        first[d] = max(t, dep)
                    t = max(t, dep) + c.w[d]
                    m -= kept[d]
                p += 1
            if p != n0:
                left -= p - n0
                pos[d], free[d], mem[d] = p, t, m
                moved = True
        if not moved:
            return None
    span = max(free[d] - (first[d] or 0.0) for d in range(D))
    return span, max(free)


def makespan(orders: list[Order], c: AutoCosts) -> float | None:
    """The iteration time of per-device ``orders`` (:func:`timing`'s makespan); None if they deadlock
    or break a device's memory limit."""
    t = timing(orders, c)
    return None if t is None else t[1]


def greedy(D: int, N: int, c: AutoCosts, delay_first_b: bool, b_first: bool,
           fill_gaps: bool, stagger: bool = True) -> tuple[list[Order], tuple[float, float]] | None:
    """The heuristic of the module docstring under one setting of its four knobs: the orders and
    their (cost, makespan), the times it placed the ops at being :func:`timing`'s; None where it
    cannot keep the limit."""
    kept = c.kept()
    msg = c.message
    dur = {F: c.f, B: c.b, W: c.w}
    n = {F: [0] * D, B: [0] * D, W: [0] * D}
    nf, nb, nw = n[F], n[B], n[W]
    fend: list[list[float]] = [[] for _ in range(D)]
    bend: list[list[float]] = [[] for _ in range(D)]
    e, mem, idle, first = [0.0] * D, [0.0] * D, [0.0] * D, [0.0] * D
    worst = [0.0]                   # the largest idle time of any device so far
    orders: list[Order] = [[] for _ in range(D)]

    def put(d: int, kind: str) -> None:
        i = n[kind][d]
        if kind == F:
            ready = fend[d - 1][i] + msg if d else 0.0
        elif kind == B:
            ready = bend[d + 1][i] + msg if d < D - 1 else fend[d][i]
        else:
            ready = bend[d][i]
        start = max(e[d], ready)
        if nf[d]:
            idle[d] += start - e[d]
            if idle[d] > worst[0]:
                worst[0] = idle[d]
        else:
            first[d] = start
        e[d] = start + dur[kind][d]
        if kind == F:
            fend[d].append(e[d])
            mem[d] += c.act[d]
        elif kind == B:
            bend[d].append(e[d])
            mem[d] -= c.act[d] - kept[d]
        else:
            mem[d] -= kept[d]
        n[kind][d] += 1
        orders[d].append((kind, i))

    def room(d: int) -> bool:
        """Run owed W's until one more F fits under the limit; False if none are left to run."""
        while mem[d] + c.act[d] > c.limit[d] + _EPS:
            if nw[d] >= nb[d]:
                return False
            put(d, W)
        return True

    def fill(d: int, ready: float) -> None:
        """Owed W's that end before ``ready``, then one that overruns a short gap unless the
        device's idle time leaves room to wait."""
        while nw[d] < nb[d] and e[d] + c.w[d] <= ready + _EPS:
            put(d, W)
        if nw[d] < nb[d] and e[d] < ready - _EPS:
            if ready - e[d] > worst[0] - idle[d] or fill_gaps:
                put(d, W)

    # round 0: micro-batch 0's F everywhere, extra F's before the first B's gradient comes back
    for d in range(D):
        put(d, F)
    extra = [0] * D
    back = fend[D - 1][0] + c.b[D - 1]          # the first B's end on the last device
    for d in range(D - 2, -1, -1):
        m, t, arrive = mem[d], e[d], back + msg
        while nf[d] + extra[d] < N and m + c.act[d] <= c.limit[d] + _EPS:
            if (t >= arrive) if delay_first_b else (t + c.f[d] > arrive + _EPS):
                break
            m, t, extra[d] = m + c.act[d], t + c.f[d], extra[d] + 1
        back = max(t, arrive) + c.b[d]
    for d in range(1, D):          # fewer on each later device (as many where all N are done)
        extra[d] = min(extra[d], extra[d - 1])
        if stagger and 0 < extra[d] == extra[d - 1] and nf[d] + extra[d] < N:
            extra[d] -= 1
    for d in range(D):
        for _ in range(extra[d]):
            put(d, F)
    for d in range(D - 1, -1, -1):
        put(d, B)
    # rounds 1 .. N-1: one F per device (first to last), one B (last to first)
    for _ in range(1, N):
        want = [nf[d] < N for d in range(D)]
        for d in range(D - 1):
            if not (want[d] and b_first and nf[d] >= nf[d + 1] + 2):
                continue
            grad = e[d + 1] + c.f[d + 1] + c.b[d + 1] + msg      # when the next device's B can come back
            if e[d] >= grad:
                want[d] = False
                continue
            m, wt, k = mem[d] + c.act[d], 0.0, 0
            while m > c.limit[d] + _EPS and nw[d] + k < nb[d]:
                wt, m, k = wt + c.w[d], m - kept[d], k + 1
            if e[d] + c.f[d] + wt > grad and grad - e[d] <= worst[0] - idle[d]:
                want[d] = False
        for d in range(D - 2, -1, -1):
            want[d] = want[d] and want[d + 1]
        for d in range(D):
            if not want[d]:
                continue
            if not room(d):
                return None
            if d:
                fill(d, fend[d - 1][nf[d]] + msg)
            put(d, F)
        for d in range(D - 1, -1, -1):
            if nb[d] >= nf[d]:
                return None
            if d < D - 1:
                if len(bend[d + 1]) <= nb[d]:
                    return None
                fill(d, bend[d + 1][nb[d]] + msg)
            if d == 0 and nf[0] == N:
                while nw[0] < nb[0]:
                    put(0, W)
            put(d, B)
    for d in range(D):
        if nb[d] < N:               # rounds that left a B behind
            return None
        while nw[d] < N:
            put(d, W)
    return orders, (max(e[d] - first[d] for d in range(D)), max(e))


def refine(orders: list[Order], c: AutoCosts, budget: int = REFINE_OPS) -> tuple[list[Order], tuple[float, float]]:
    """Swap adjacent ops of different kinds and micro-batches (a W one place earlier or later, an F
    past a B), the busiest device first, while that lowers :func:`timing` (within ``budget`` timed
    ops)."""
    orders, best, _ = _refine(orders, c, budget)
    return orders, best


def _refine(orders: list[Order], c: AutoCosts, budget: int) -> tuple[list[Order], tuple[float, float], int]:
    """:func:`refine` and the budget it left."""
    best = timing(orders, c)
    orders = [list(o) for o in orders]
    per = sum(len(o) for o in orders)
    improved = True
    while improved and budget >= per:
        improved = False
        for d in _busiest_first(orders, c):
            o = orders[d]
            for i in range(len(o) - 1):
                if budget < per:
                    break
                a, b = o[i], o[i + 1]
                if a[0] == b[0] or a[1] == b[1]:
                    continue        # one kind keeps its micro-batch order; no op passes its own micro-batch's
                o[i], o[i + 1] = b, a
                t = timing(orders, c)
                budget -= per
                if t is not None and _better(t, best):
                    best, improved = t, True
                else:
                    o[i], o[i + 1] = a, b
    return orders, best, budget


def _better(t: tuple[float, float], than: tuple[float, float]) -> bool:
    """A lower cost, or the same cost and a lower makespan."""
    return t[0] < than[0] - _EPS or (t[0] <= than[0] + _EPS and t[1] < than[1] - _EPS)


def _busiest_first(orders: list[Order], c: AutoCosts) -> list[int]:
    """Devices, the one with the most compute first (the likeliest to set the cost)."""
    work = [sum(c.f[d] if k == F else c.b[d] if k == B else c.w[d] for k, _ in orders[d]) for d in range(len(orders))]
    return sorted(range(len(orders)), key=lambda d: -work[d])


def candidates(D: int, N: int, c: AutoCosts) -> list[tuple[tuple[float, float], list[Order]]]:
    """((cost, makespan), orders) of the heuristic under every knob setting, then of ZB-H1 and ZB-H2
    where they keep the limit."""
    out = [(g[1], g[0]) for k in KNOBS if (g := greedy(D, N, c, *k)) is not None]
    for hand in (zbh1_device_order, zbh2_device_order):
        orders = [hand(D, d, N) for d in range(D)]
        if (t := timing(orders, c)) is not None:
            out.append((t, orders))
    return out


def auto_orders(D: int, N: int, c: AutoCosts) -> list[Order]:
    """The chosen per-device order (module docstring: heuristic, then refinement)."""
    c.check(D)
    timed = candidates(D, N, c)
    if not timed:
        raise ScheduleError(f"{NAME}: no device can proceed under the memory limit; raise the limit")
    timed.sort(key=lambda x: x[0])
    orders, best, _ = _refine(timed[0][1], c, REFINE_OPS)
    budget, seen = REFINE_OPS // 4, {tuple(map(tuple, timed[0][1]))}
    for _, start in timed[1:]:      # the others, cheapest first, with a quarter of the budget among them
        key = tuple(map(tuple, start))
        if budget < 3 * N * D:
            break
        if key not in seen:
            seen.add(key)
            o, t, budget = _refine(start, c, budget)
            if _better(t, best):
                orders, best = o, t
    return orders


def build(num_devices: int, num_microbatches: int, variant: str | None = None, costs: AutoCosts | None = None,
          memory_limit: float | None = None, **_):
    """``costs``: the job's own (their limit included); without them unit costs under ``memory_limit``
    Ma per device (None: the variant's)."""
    D, N = num_devices, num_microbatches
    check_positive(NAME, D, N)
    variant = variant or next(iter(VARIANTS))
    if variant not in VARIANTS:
        raise ScheduleError(f"{NAME} variant must be one of {', '.join(VARIANTS)}; got {variant!r}")
    c = costs if costs is not None else AutoCosts.unit(D, variant, memory_limit)
    orders = auto_orders(D, N, c)
    order = [[(k, m, 0, d) for k, m in orders[d]] for d in range(D)]
    return make_schedule(NAME, D, N, [list(range(D))], order, split_backward=True)
