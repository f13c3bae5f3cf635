"""Overlapped forward/backward pairs for any schedule (the user's ``--overlap-fb``).

DualPipe-V lists the F and B it overlaps in ``meta["overlapped"]``: ``((\"F\", stage, mb), (\"B\",
stage, mb))`` tuples, the F right before its B in its device's compute order. An engine given
phased costs runs each such pair as one block whose all-to-alls hide behind the other op's
compute (:mod:`sim.overlap`). :func:`pair_forward_backward` marks the same pairs in any schedule:
every F that its device's compute order (F / B / W, communication ignored) follows at once with a
B of another micro-batch. A B of the same micro-batch is never paired (it may need the F's own
output, as at a V's turn).

A pair runs as one block: the inputs of both ops first, the outputs of both at the block's end
(DualPipe's F&B chunk). So a pair whose B needs, through other devices, the output of its own F
(GPipe's last forward paired with the first backward, on every device but the last) would wait for
itself. :func:`pair_forward_backward` keeps only pairs that cannot: it runs the compute orders
symbolically with the pairs fused, and when no device can go on it runs serially the blocked
pairs whose F could run alone (all blocked pairs where none could), until the run completes.

The same rule makes pairing a cost where the B's gradient is late: on 1F1B (dapple) each paired F
waits for its B's gradient, a round trip through the later stages per steady step, so with phased
costs (D = 4, N = 16, 40 % all-to-all, SM share 20/132) the step grows from 57 to 87.9 F although
46.5 F of all-to-all are hidden. Megatron-LM's combined 1F1B warms up one more forward so that the
gradient is there: the interleaved variant ``a2a-overlap`` (39.8 F against 52.5 F serial).
"""
from __future__ import annotations

from collections import Counter

from .ir import B, F, Schedule, ScheduleError, W
from .timing import compute_deps, key

META_KEY = "overlapped"


def _key(op) -> tuple[str, int, int]:
    return (op.kind, op.stage, op.mb)


def forward_backward_pairs(sched: Schedule) -> list[tuple[tuple, tuple]]:
    """Every (F, B) that ``sched``'s compute orders place back to back, the B of another micro-batch,
    in device order then program order; keys as in ``meta["overlapped"]``."""
    pairs = []
    for d, prog in enumerate(sched.compute_programs()):
        keys = Counter(_key(o) for o in prog)
        for a, b in zip(prog, prog[1:]):
            if a.kind == F and b.kind == B and a.mb != b.mb:
                for op in (a, b):
                    if keys[_key(op)] > 1:
                        raise ScheduleError(f"device {d}: {op} is one of several ops with key {_key(op)} "
                                            f"(kind, stage, micro-batch); overlapped pairs cannot name it")
                pairs.append((_key(a), _key(b)))
    return pairs


def paired_backward(program, i: int, want: tuple, rank: int) -> int:
    """The index in ``program`` of the B that the overlapped F ``program[i]`` is paired with: the next
    compute op (F, B or W) after it, which must be ``want`` ((kind, stage, micro-batch), as in
    ``meta["overlapped"]``); else a ScheduleError naming the rank and the pair. The one rule both
    engines' pair blocks follow (:meth:`sim.engine._Engine._overlap`,
    :func:`executor.runtime.execution_order`)."""
    n, j = len(program), i + 1
    while j < n and program[j].kind not in (F, B, W):
        j += 1
    nb = program[j] if j < n else None
    if nb is None or (nb.kind, nb.stage, nb.mb) != tuple(want):
        raise ScheduleError(f"rank {rank}: overlapped pair {program[i]} & {want[0]}{want[2]}.s{want[1]} is not "
                            f"back to back in its compute order (next compute op: {nb})")
    return j


def pair_forward_backward(sched: Schedule) -> Schedule:
    """``sched`` with ``meta["overlapped"]`` listing every F followed at once on its device by a B of
    another micro-batch (:func:`forward_backward_pairs`) whose fused block cannot wait for itself
    (module docstring), the schedule's own pairs (DualPipe-V's) kept as they are and first; a new
    pair that shares an op with one of them is left out. The programs are unchanged (compute-only
    or lowered alike)."""
    own = [(tuple(a), tuple(b)) for a, b in sched.meta.get(META_KEY, ())]
    used = {k for p in own for k in p}
    new = [p for p in forward_backward_pairs(sched) if p[0] not in used and p[1] not in used]
    blocked = unsafe_pairs(sched, own + new)
    new = [p for p in new if p not in blocked]
    meta = dict(sched.meta)
    meta[META_KEY] = own + new
    return sched.with_programs(sched.programs, meta=meta)


def unsafe_pairs(sched: Schedule, pairs) -> set[tuple[tuple, tuple]]:
    """The pairs of ``pairs`` that the fused run of ``sched`` (module docstring) has to run serially
    to complete. Raises ScheduleError when the schedule deadlocks without any pair."""
    want = {tuple(a): tuple(b) for a, b in pairs}
    S = sched.num_stages
    progs = sched.compute_programs()
    # paired[d]: positions of device d's paired Fs (the B right after them)
    paired = []
    for prog in progs:
        paired.append({i for i, (a, b) in enumerate(zip(prog, prog[1:]))
                       if a.kind == F and want.get(_key(a)) == _key(b)})
    done: set = set()
    pos = [0] * len(progs)
    dropped: set = set()
    waiting: dict = {}              # key -> devices waiting for it
    ready = list(range(len(progs)))
    blocked_at: dict[int, bool] = {}  # stuck device -> its head is a pair whose F alone could run

    def missing(ops, inner):
        for o in ops:
            for x in compute_deps(o.kind, o.copy, o.stage, o.mb, S):
                if x not in done and x not in inner:
                    return x
        return None

    while True:
        while ready:
            d = ready.pop()
            blocked_at.pop(d, None)
            prog = progs[d]
            while pos[d] < len(prog):
                i = pos[d]
                grp = prog[i:i + 2] if i in paired[d] else prog[i:i + 1]
                x = missing(grp, {key(o) for o in grp})
                if x is not None:
                    waiting.setdefault(x, []).append(d)
                    blocked_at[d] = len(grp) == 2 and missing(grp[:1], set()) is None
                    break
                for o in grp:
                    k = key(o)
                    done.add(k)
                    ready += waiting.pop(k, [])
                pos[d] += len(grp)
        if all(pos[d] == len(p) for d, p in enumerate(progs)):
            return dropped
        heads = [d for d, f_alone in blocked_at.items() if f_alone]
        if not heads:
            heads = [d for d in blocked_at if pos[d] in paired[d]]
        if not heads:
            stuck = ", ".join(f"device {d} at {progs[d][pos[d]]}" for d in sorted(blocked_at))
            raise ScheduleError(f"{sched.name}: the compute orders deadlock without any overlapped pair ({stuck})")
        for d in heads:
            i = pos[d]
            paired[d].discard(i)
            dropped.add((_key(progs[d][i]), _key(progs[d][i + 1])))
            for ws in waiting.values():
                if d in ws:
                    ws.remove(d)
            ready.append(d)
