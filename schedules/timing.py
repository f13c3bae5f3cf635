"""Dependency-driven timing of compute programs, without communication costs.

Two uses inside ``schedules`` (no simulator needed): the fixed-order timing of a program (used
by lowering to order eager all-reduces identically on every device) and a greedy list scheduler
that schedule families use to derive a per-device order from priorities (Chimera, BitPipe, ...).
"""
from __future__ import annotations

import heapq
from collections import deque
from typing import Callable, Iterable, Sequence

from .ir import ACT, GRAD, B, F, Op, ScheduleError, W, producer_stage

Key = tuple  # (kind, copy, stage, mb)
_COMPUTE = frozenset((F, B, W))


def key(op: Op) -> Key:
    return (op.kind, op.copy, op.stage, op.mb)


def compute_deps(kind: str, copy: int, stage: int, mb: int, num_stages: int) -> list[Key]:
    """Keys of the compute ops this one needs (data dependencies of a pipeline)."""
    if kind == F:
        return [(F, copy, producer_stage(ACT, stage), mb)] if stage > 0 else []
    if kind == B:
        d = [(F, copy, stage, mb)]
        if stage < num_stages - 1:
            d.append((B, copy, producer_stage(GRAD, stage), mb))
        return d
    if kind == W:
        return [(B, copy, stage, mb)]
    raise ScheduleError(f"{kind} is not a compute op")


def unit_duration(num_devices: int, num_stages: int, split: bool) -> Callable[[Op], float]:
    """The unit cost model: a full stage (L/D layers) takes F=1, B=2 (split: B=1, W=1)."""
    f = num_devices / num_stages

    def dur(op: Op) -> float:
        if op.kind == F:
            return f
        if op.kind == B:
            return f if split else 2 * f
        return f

    return dur


def time_programs(programs: Sequence[Sequence[Op]], num_stages: int,
                  dur: Callable[[Op], float]) -> dict[Key, tuple[int, float, float]]:
    """Start/end of every compute op when each device runs its program in order and an op
    starts as soon as its inputs exist (zero communication cost).

    Returns ``{key: (device, start, end)}``. Raises :class:`ScheduleError` naming the stuck
    devices if the order deadlocks. (A worklist: a device runs until an input is missing and
    is woken when that input's op ends, so every op is looked at about once.)
    """
    progs = [[o for o in p if o.kind in _COMPUTE] for p in programs]
    pos = [0] * len(progs)
    clock = [0.0] * len(progs)
    done: dict[Key, tuple[int, float, float]] = {}
    waiting: dict[Key, list[int]] = {}
    templates: dict[tuple, tuple] = {}      # (kind, copy, stage) -> deps as (kind, copy, stage)
    ready = deque(range(len(progs)))
    while ready:
        d = ready.popleft()
        prog, p, t = progs[d], pos[d], clock[d]
        n = len(prog)
        while p < n:
            op = prog[p]
            k, c, s, m = op.kind, op.copy, op.stage, op.mb
            tmpl = templates.get((k, c, s))
            if tmpl is None:
                tmpl = templates[(k, c, s)] = tuple(x[:3] for x in compute_deps(k, c, s, 0, num_stages))
            start = t
            blocked = False
            for dk, dc, ds in tmpl:
                e = done.get((dk, dc, ds, m))
                if e is None:
                    waiting.setdefault((dk, dc, ds, m), []).append(d)
                    blocked = True
                    break
                if e[2] > start:
                    start = e[2]
            if blocked:
                break
            t = start + dur(op)
            kk = (k, c, s, m)
            done[kk] = (d, start, t)
            p += 1
            woken = waiting.pop(kk, None)
            if woken:
                ready.extend(woken)
        pos[d], clock[d] = p, t
    if any(pos[d] < len(prog) for d, prog in enumerate(progs)):
        waits = []
        for d, prog in enumerate(progs):
            if pos[d] < len(prog):
                op = prog[pos[d]]
                missing = [k for k in compute_deps(op.kind, op.copy, op.stage, op.mb, num_stages)
                           if k not in done]
                waits.append(f"device {d} at {op} waits for " +
                             ", ".join(f"{k[0]}{k[3]}.s{k[2]}" + (f".c{k[1]}" if k[1] else "") for k in missing))
        raise ScheduleError("compute order deadlocks: " + "; ".join(waits))
    return done


def list_schedule(ops: Sequence[Iterable[tuple[str, int, int, int]]], num_stages: int,
                  dur: Callable[[str, int, int], float],
                  priority: Callable[[int, tuple[str, int, int, int]], tuple],
                  admit: Callable[[int, tuple[str, int, int, int], dict], bool] | None = None,
                  group: Callable[[tuple[str, int, int, int]], int] | None = None,
                  ) -> list[list[tuple[str, int, int, int]]]:
    """Greedy list scheduling. ``ops[d]`` are device d's (kind, mb, copy, stage) tuples.

    Whenever a device is idle it starts, among its ops whose inputs are ready, the one with the
    smallest ``priority(device, op)`` that ``admit(device, op, state)`` allows. ``state`` holds
    ``started[(device, group, kind)]`` (ops started so far) and ``pending[device][group]`` (count
    of ops not started).
    With ``group`` (e.g. the unit of concatenated units), a device only looks at its two lowest
    groups that still have ops. Ties in time are processed in device order, so the result is
    deterministic. Returns the order per device.
    """
    D = len(ops)
    grp = group or (lambda op: 0)
    where: dict[Key, tuple] = {}
    ndeps: dict[tuple, int] = {}
    succ: dict[Key, list[tuple]] = {}
    pending_n = [dict() for _ in range(D)]
    ready: list[list[tuple]] = [[] for _ in range(D)]
    total = 0
    for d, dev_ops in enumerate(ops):
        for op in dev_ops:
            kind, mb, c, s = op
            where[(kind, c, s, mb)] = (d, op)
            g = grp(op)
            pending_n[d][g] = pending_n[d].get(g, 0) + 1
            total += 1
    for _k, (d, op) in where.items():
        deps = compute_deps(op[0], op[2], op[3], op[1], num_stages)
        deps = [x for x in deps if x in where]
        ndeps[op] = len(deps)
        for x in deps:
            succ.setdefault(x, []).append((d, op))
        if not deps:
            ready[d].append(op)
    order: list[list] = [[] for _ in range(D)]
    busy = [False] * D
    state = {"pending": pending_n, "started": {}}
    running: list[tuple[float, int, int, tuple]] = []
    seq = 0
    now = 0.0
    while total:
        for d in range(D):
            if busy[d] or not ready[d]:
                continue
            live = sorted(g for g, n in pending_n[d].items() if n)[:2]
            cands = [o for o in ready[d] if grp(o) in live and (admit is None or admit(d, o, state))]
            if not cands:
                continue
            op = min(cands, key=lambda o: priority(d, o))
            ready[d].remove(op)
            kind, mb, c, s = op
            g = grp(op)
            pending_n[d][g] -= 1
            sk = (d, g, kind)
            state["started"][sk] = state["started"].get(sk, 0) + 1
            heapq.heappush(running, (now + dur(kind, c, s), seq, d, op))
            seq += 1
            busy[d] = True
            order[d].append(op)
            total -= 1
        if not total:
            break
        if not running:
            stuck = {d: sorted(r)[:3] for d, r in enumerate(ready) if r}
            raise ScheduleError(f"list scheduling stalled at t={now}; ready but not admitted: {stuck}")
        now = running[0][0]
        while running and running[0][0] <= now:
            _, _, d, op = heapq.heappop(running)
            busy[d] = False
            kind, mb, c, s = op
            for d2, op2 in succ.get((kind, c, s, mb), ()):
                ndeps[op2] -= 1
                if ndeps[op2] == 0:
                    ready[d2].append(op2)
    return order
