"""Validation: structural checks and a symbolic run of the lowered programs.

Semantics of the symbolic run (what the executor does for real): a SEND is posted and returns
(isend); a RECV blocks until the next message from that peer arrives, and that message must be
the one it expects (per-pair FIFO, no tags); F/B/W need their inputs to be present on the rank
already (a missing input is an ordering error in the program, not a wait); an ALLREDUCE is
started asynchronously, every pair of ranks must issue the all-reduces they share in the same
order, and OPTIM waits until every member of each of its all-reduces has started it.
"""
from __future__ import annotations

from collections import deque

from .common import gc_paused
from .ir import ACT, ALLREDUCE, COPY, OPTIM, RECV, SEND, B, F, Schedule, ScheduleError, W, message_key
from .lower import incoming, lower


def check_structure(sched: Schedule) -> None:
    """Every (copy, stage, micro-batch) has exactly one F and one B (and one W when split), on the
    device its placement says, and every micro-batch uses exactly one model copy."""
    D, N, S = sched.num_devices, sched.num_microbatches, sched.num_stages
    if len(sched.programs) != D:
        raise ScheduleError(f"{sched.name}: {len(sched.programs)} programs for {D} devices")
    kinds = (F, B, W) if sched.split_backward else (F, B)
    compute = frozenset((F, B, W))
    seen: dict[tuple, int] = {}
    copy_of: dict[int, int] = {}
    C, placement, split = sched.num_copies, sched.placement, sched.split_backward
    for d, prog in enumerate(sched.programs):
        for op in prog:
            kind = op.kind
            if kind not in compute:
                continue
            c, st, mb = op.copy, op.stage, op.mb
            if kind == W and not split:
                raise ScheduleError(f"device {d}: {op} is a W op but {sched.name} does not split the backward")
            if not (0 <= c < C and 0 <= st < S):
                raise ScheduleError(f"device {d}: {op} names a copy/stage outside the schedule")
            if not 0 <= mb < N:
                raise ScheduleError(f"device {d}: {op} names micro-batch {mb}, outside 0..{N - 1}")
            want = placement[c][st]
            if want != d:
                raise ScheduleError(f"device {d}: {op} belongs on device {want} by the placement")
            k = (kind, c, st, mb)
            if k in seen:
                raise ScheduleError(f"device {d}: {op} appears twice")
            seen[k] = d
            if copy_of.setdefault(mb, c) != c:
                raise ScheduleError(f"micro-batch {op.mb} runs in two model copies ({copy_of[op.mb]} and {op.copy})")
    for m in range(N):
        if m not in copy_of:
            raise ScheduleError(f"{sched.name}: micro-batch {m} never runs")
        c = copy_of[m]
        for s in range(S):
            for kind in kinds:
                if (kind, c, s, m) not in seen:
                    raise ScheduleError(f"{sched.name}: missing {kind}{m}.s{s}" + (f".c{c}" if c else ""))


def validate(sched: Schedule) -> Schedule:
    """Check a schedule; return its lowered form (lowering it with defaults if needed)."""
    with gc_paused():
        check_structure(sched)
        low = sched if sched.lowered else lower(sched)
        symbolic_run(low)
    return low


def check_collective_order(sched: Schedule) -> None:
    """Every pair of ranks issues the all-reduces they share in the same order. Replicas run their
    device's program, so the pairs of replica 0's devices decide for every pair of ranks (two
    ranks of one device share every all-reduce and issue them in one order)."""
    D = sched.num_devices
    seqs = [[op.stage for op in sched.programs[d] if op.kind == ALLREDUCE] for d in range(D)]
    holds = [{s for _, s in sched.stages_on(d)} for d in range(D)]
    for r in range(D):
        for s in seqs[r]:
            if s not in holds[r]:
                raise ScheduleError(f"rank {r} all-reduces stage {s} but does not hold it")
    for a in range(D):
        for b in range(a + 1, D):
            sa = [s for s in seqs[a] if s in holds[b]]
            sb = [s for s in seqs[b] if s in holds[a]]
            if sa != sb:
                raise ScheduleError(f"ranks {a} and {b} issue their shared all-reduces in different orders: "
                                    f"{' '.join(f'AR.s{s}' for s in sa)} vs {' '.join(f'AR.s{s}' for s in sb)}")


def symbolic_run(sched: Schedule) -> None:
    """Execute the lowered programs symbolically; raise ScheduleError on a deadlock or a FIFO
    mismatch, naming the ranks and ops involved. Replicas run their device's program on their own
    ranks and meet only in all-reduces, which every replica reaches exactly when replica 0 does:
    running replica 0 decides for all of them."""
    if not sched.lowered:
        raise ScheduleError("symbolic_run needs a lowered schedule (call lower() first)")
    check_collective_order(sched)
    R = sched.num_devices
    progs = [sched.program(r) for r in range(R)]
    members = {s: [g for g in sched.stage_group(s) if g < R] for s in range(sched.num_stages)}
    pc = [0] * R
    avail: list[set] = [set() for _ in range(R)]      # message keys present on the rank
    done: list[set] = [set() for _ in range(R)]       # (kind, copy, stage, mb) finished
    fifo: dict[tuple[int, int], deque] = {}
    ar_arrived: dict[int, int] = {}
    ar_started: list[list[int]] = [[] for _ in range(R)]
    inputs: dict[tuple, tuple | None] = {}             # (kind, copy, stage) -> incoming(...)

    def step(r: int) -> tuple | None:
        """Run rank r as far as it goes; return what it waits for, (rank, op, all-reduced stage or
        None), or None when finished."""
        prog = progs[r]
        av, dn = avail[r], done[r]
        p, n = pc[r], len(prog)
        try:
            while p < n:
                op = prog[p]
                k = op.kind
                if k == F or k == B or k == W:
                    c, st, mb = op.copy, op.stage, op.mb
                    if k != W:
                        ks = (k, c, st)
                        inc = inputs.get(ks, 0)
                        if inc == 0:
                            inc = inputs[ks] = incoming(op, sched)
                        if inc is not None and (inc[0], c, mb, inc[1]) not in av:
                            raise ScheduleError(f"rank {r}: {op} runs before its input "
                                                f"({'activation' if inc[0] == ACT else 'gradient'} from stage "
                                                f"{inc[1]}) was received or copied")
                    if k == B and (F, c, st, mb) not in dn:
                        raise ScheduleError(f"rank {r}: {op} runs before its forward")
                    if k == W and (B, c, st, mb) not in dn:
                        raise ScheduleError(f"rank {r}: {op} runs before its input-gradient backward")
                    dn.add((k, c, st, mb))
                elif k == SEND or k == COPY:
                    producer = F if op.payload == ACT else B
                    if (producer, op.copy, op.stage, op.mb) not in dn:
                        raise ScheduleError(f"rank {r}: {op} before the op that produces it")
                    if k == SEND:
                        q = fifo.get((r, op.peer))
                        if q is None:
                            q = fifo[(r, op.peer)] = deque()
                        q.append(message_key(op))
                    else:
                        av.add(message_key(op))
                elif k == RECV:
                    q = fifo.get((op.peer, r))
                    if not q:
                        return (r, op, None)        # formatted only if the run deadlocks
                    got = q.popleft()
                    want = message_key(op)
                    if got != want:
                        raise ScheduleError(f"FIFO mismatch: rank {r} at {op} expects {_fmt(want)} from rank "
                                            f"{op.peer}, but the next message rank {op.peer} sent is {_fmt(got)}")
                    av.add(want)
                elif k == ALLREDUCE:
                    ar_arrived[op.stage] = ar_arrived.get(op.stage, 0) + 1
                    ar_started[r].append(op.stage)
                elif k == OPTIM:
                    for s in ar_started[r]:
                        count = len(members[s])
                        if ar_arrived.get(s, 0) < count:
                            return (r, op, s)
                p += 1
            return None
        finally:
            pc[r] = p

    waiting = {r: "" for r in range(R)}
    while waiting:
        progressed = False
        for r in list(waiting):
            before = pc[r]
            w = step(r)
            if w is None:
                del waiting[r]
                progressed = True
            else:
                progressed |= pc[r] != before
                waiting[r] = w
        if waiting and not progressed:
            raise ScheduleError("deadlock: " + "; ".join(_wait_text(*waiting[r], members, ar_arrived)
                                                         for r in sorted(waiting)))
    leftovers = {pair: list(q) for pair, q in fifo.items() if q}
    if leftovers:
        (a, b), q = next(iter(leftovers.items()))
        raise ScheduleError(f"rank {a} sent {_fmt(q[0])} to rank {b}, which never receives it")


def _wait_text(r: int, op, stage, members: dict, arrived: dict) -> str:
    if stage is None:
        return f"rank {r} waits at {op} for rank {op.peer}"
    return (f"rank {r} waits at OPT for AR.s{stage} "
            f"({arrived.get(stage, 0)}/{len(members[stage])} members of {members[stage]} arrived)")


def _fmt(k: tuple) -> str:
    payload, c, mb, stage = k
    what = "activation" if payload == ACT else "gradient"
    return f"{what} of mb {mb} from stage {stage}" + (f" (copy {c})" if c else "")
