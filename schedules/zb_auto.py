"""ZB-auto: the Zero Bubble paper's automatic scheduler (Qi et al., ICLR 2024, section 3.2), our own
code: an order of F, B and W per device under a memory limit, from the stage costs.

Requirements: D >= 1, N >= 1; a memory limit of at least one micro-batch per device. Stage s on
device s, a split backward (B = input gradient, W = weight gradient).

Inputs (:class:`AutoCosts`): per stage F, B, W times, one message time between adjacent stages,
the activation a micro-batch keeps on each stage from its F until its W, and each device's limit
in the same unit. Without costs (the registry's default, also what ``pipetwin run`` executes):
unit costs F = B = W = 1, no message time, 1 Ma per micro-batch. The variants set the limit:
``1p`` (ZB-1p) D Ma, the peak of 1F1B; ``2p`` (ZB-2p) 2D Ma, twice that. :func:`cost_models.bind.bind`
passes the job's own stage costs (any cost source) when it builds this family.

1. The heuristic: a list scheduler over time. When a device is free it runs, in this order of
   preference, the next B if its gradient has arrived, else the next F if its input has arrived
   and the memory limit allows one more micro-batch, else an owed W (with ``fill=True`` always; with
   ``fill=False`` only if it ends before the next F or B can start), else it waits. A W also runs
   whenever the limit blocks an F. Both settings of ``fill`` are built.
2. The refinement: every candidate order (the two heuristic ones, and ZB-H1 / ZB-H2 where they fit
   the limit) is timed exactly with the message time (:func:`makespan`), then W's are moved one
   place earlier or later in their device's order while that shortens the iteration and keeps the
   limit (at most ``REFINE_EVALS`` timings). The shortest order wins (ties: the first).

So the bubble is never above ZB-H1's at a limit that ZB-H1 fits (D Ma, ZB-1p), nor ZB-H2's at 2D Ma
(ZB-2p). Under unit costs both give the bound 3N + D - 1 + max(0, D - N) (the staggered start);
with the paper's Table 9 stage times ZB-2p's bubble is below ZB-H2's (``tests/test_zb_auto.py``).
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
REFINE_EVALS = 200

Order = list[tuple[str, int]]


@dataclass(frozen=True)
class AutoCosts:
    """Per-stage times ``f``, ``b``, ``w``, the ``message`` time, per-stage activation ``act`` per
    micro-batch and per-device ``limit`` (the unit of ``act``)."""

    f: tuple[float, ...]
    b: tuple[float, ...]
    w: tuple[float, ...]
    message: float
    act: tuple[float, ...]
    limit: tuple[float, ...]

    @classmethod
    def unit(cls, D: int, variant: str = "1p", limit_ma: float | None = None) -> "AutoCosts":
        """Unit costs under the variant's limit, or ``limit_ma`` Ma per device."""
        limit = float(LIMIT_MA[variant] * D) if limit_ma is None else float(limit_ma)
        return cls((1.0,) * D, (1.0,) * D, (1.0,) * D, 0.0, (1.0,) * D, (limit,) * D)

    def check(self, D: int) -> None:
        if not all(len(t) == D for t in (self.f, self.b, self.w, self.act, self.limit)):
            raise ScheduleError(f"{NAME}: stage costs must have {D} entries, one per device")
        for d in range(D):
            if self.limit[d] < self.act[d]:
                raise ScheduleError(f"{NAME}: device {d}'s memory limit {self.limit[d]:g} is below one micro-batch's "
                                    f"activation {self.act[d]:g}; raise the limit")


def _dur(c: AutoCosts, kind: str, d: int) -> float:
    return c.f[d] if kind == F else c.b[d] if kind == B else c.w[d]


def makespan(orders: list[Order], c: AutoCosts) -> float | None:
    """The iteration time of per-device ``orders`` (each op as soon as its device is free and its
    input, one message later from a neighbour, has arrived); None if the orders deadlock or break
    a device's memory limit."""
    D = len(orders)
    end: dict[tuple[str, int, int], float] = {}
    pos, free, mem = [0] * D, [0.0] * D, [0.0] * D
    N = sum(1 for k, _ in orders[0] if k == F)
    left = 3 * N * D
    while left:
        moved = False
        for d in range(D):
            o = orders[d]
            while pos[d] < len(o):
                kind, m = o[pos[d]]
                if kind == F:
                    dep = 0.0 if d == 0 else end.get((F, d - 1, m))
                    dep = dep if dep is None or d == 0 else dep + c.message
                elif kind == B:
                    dep = end.get((F, d, m)) if d == D - 1 else end.get((B, d + 1, m))
                    dep = dep if dep is None or d == D - 1 else dep + c.message
                else:
                    dep = end.get((B, d, m))
                if dep is None:
                    break
                start = max(free[d], dep)
                free[d] = end[(kind, d, m)] = start + _dur(c, kind, d)
                mem[d] += c.act[d] if kind == F else -c.act[d] if kind == W else 0.0
                if mem[d] > c.limit[d] + 1e-9:
                    return None
                pos[d] += 1
                left -= 1
                moved = True
        if not moved:
            return None
    return max(free)


def heuristic(D: int, N: int, c: AutoCosts, fill: bool) -> list[Order]:
    """The list scheduler of the module docstring."""
    INF = float("inf")
    nf, nb, nw = [0] * D, [0] * D, [0] * D
    free, mem = [0.0] * D, [0.0] * D
    fend: dict[tuple[int, int], float] = {}
    bend: dict[tuple[int, int], float] = {}
    orders: list[Order] = [[] for _ in range(D)]

    def ready(d):
        """(ready time of the next F or INF, ready time of the next B or INF)."""
        rf = INF
        if nf[d] < N:
            rf = 0.0 if d == 0 else fend.get((d - 1, nf[d]), INF) + c.message
        rb = INF
        if nb[d] < nf[d]:
            rb = fend[(d, nb[d])] if d == D - 1 else bend.get((d + 1, nb[d]), INF) + c.message
        return rf, rb

    def choose(d):
        """(start, kind) of device d's next op, or None if it must wait on another device."""
        rf, rb = ready(d)
        t = free[d]
        f_fits = mem[d] + c.act[d] <= c.limit[d] + 1e-9
        owed = nw[d] < nb[d]
        if rb <= t:
            return t, B
        if rf <= t and f_fits:
            return t, F
        if owed and (fill or not f_fits or t + c.w[d] <= min(rb, rf if f_fits else INF)):
            return t, W
        nxt = min(rb, rf if f_fits else INF)
        if nxt == INF:
            return None
        return nxt, (B if rb <= nxt else F)

    total = 3 * N * D
    done = 0
    while done < total:
        best = None
        for d in range(D):
            got = choose(d)
            if got is not None and (best is None or got[0] < best[0]):
                best = (got[0], got[1], d)
        if best is None:
            raise ScheduleError(f"{NAME}: no device can proceed under the memory limit; raise the limit")
        start, kind, d = best
        end = start + _dur(c, kind, d)
        free[d] = end
        if kind == F:
            fend[(d, nf[d])] = end
            orders[d].append((F, nf[d]))
            nf[d] += 1
            mem[d] += c.act[d]
        elif kind == B:
            bend[(d, nb[d])] = end
            orders[d].append((B, nb[d]))
            nb[d] += 1
        else:
            orders[d].append((W, nw[d]))
            nw[d] += 1
            mem[d] -= c.act[d]
        done += 1
    return orders


def refine(orders: list[Order], c: AutoCosts, budget: int = REFINE_EVALS) -> tuple[list[Order], float]:
    """Move W's one place earlier or later while that shortens :func:`makespan` (within ``budget``
    timings)."""
    best = makespan(orders, c)
    orders = [list(o) for o in orders]
    improved = True
    while improved and budget > 0:
        improved = False
        for d in range(len(orders)):
            o = orders[d]
            for i in range(len(o) - 1):
                if budget <= 0:
                    break
                a, b = o[i], o[i + 1]
                if (a[0] == W) == (b[0] == W) or (a[0] == B and b == (W, a[1])):
                    continue        # move only a W past a non-W, never a W before its own B
                o[i], o[i + 1] = b, a
                t = makespan(orders, c)
                budget -= 1
                if t is not None and t < best - 1e-12:
                    best, improved = t, True
                else:
                    o[i], o[i + 1] = a, b
    return orders, best


def auto_orders(D: int, N: int, c: AutoCosts) -> list[Order]:
    """The chosen per-device order (module docstring: heuristic, then refinement)."""
    c.check(D)
    cands = [heuristic(D, N, c, fill) for fill in (True, False)]
    cands += [[hand(D, d, N) for d in range(D)] for hand in (zbh1_device_order, zbh2_device_order)]
    timed = [(t, o) for o in cands if (t := makespan(o, c)) is not None]
    timed.sort(key=lambda x: x[0])
    orders, _ = refine(timed[0][1], c)
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
