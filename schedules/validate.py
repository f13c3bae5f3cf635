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

from .ir import ACT, ALLREDUCE, COPY, OPTIM, RECV, SEND, B, F, Schedule, ScheduleError, W, message_key
from .lower import incoming, lower


def check_structure(sched: Schedule) -> None:
    """Every (copy, stage, micro-batch) has exactly one F and one B (and one W when split), on the
    device its placement says, and every micro-batch uses exactly one model copy."""
    D, N, S = sched.num_devices, sched.num_microbatches, sched.num_stages
    if len(sched.programs) != D:
        raise ScheduleError(f"{sched.name}: {len(sched.programs)} programs for {D} devices")
    kinds = (F, B, W) if sched.split_backward else (F, B)
    seen: dict[tuple, int] = {}
    copy_of: dict[int, int] = {}
    for d, prog in enumerate(sched.programs):
        for op in prog:
            if not op.is_compute:
                continue
            if op.kind == W and not sched.split_backward:
                raise ScheduleError(f"device {d}: {op} is a W op but {sched.name} does not split the backward")
            if not (0 <= op.copy < sched.num_copies and 0 <= op.stage < S):
                raise ScheduleError(f"device {d}: {op} names a copy/stage outside the schedule")
            if not 0 <= op.mb < N:
                raise ScheduleError(f"device {d}: {op} names micro-batch {op.mb}, outside 0..{N - 1}")
            want = sched.placement[op.copy][op.stage]
            if want != d:
                raise ScheduleError(f"device {d}: {op} belongs on device {want} by the placement")
            k = (op.kind, op.copy, op.stage, op.mb)
            if k in seen:
                raise ScheduleError(f"device {d}: {op} appears twice")
            seen[k] = d
            if copy_of.setdefault(op.mb, op.copy) != op.copy:
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
    check_structure(sched)
    low = sched if sched.lowered else lower(sched)
    symbolic_run(low)
    return low


def check_collective_order(sched: Schedule) -> None:
    R = sched.num_ranks
    seqs = [[op.stage for op in sched.program(r) if op.kind == ALLREDUCE] for r in range(R)]
    groups = {s: set(sched.stage_group(s)) for s in range(sched.num_stages)}
    for r in range(R):
        for s in seqs[r]:
            if r not in groups[s]:
                raise ScheduleError(f"rank {r} all-reduces stage {s} but does not hold it")
    for a in range(R):
        for b in range(a + 1, R):
            sa = [s for s in seqs[a] if b in groups[s]]
            sb = [s for s in seqs[b] if a in groups[s]]
            if sa != sb:
                raise ScheduleError(f"ranks {a} and {b} issue their shared all-reduces in different orders: "
                                    f"{' '.join(f'AR.s{s}' for s in sa)} vs {' '.join(f'AR.s{s}' for s in sb)}")


def symbolic_run(sched: Schedule) -> None:
    """Execute the lowered programs symbolically; raise ScheduleError on a deadlock or a FIFO
    mismatch, naming the ranks and ops involved."""
    if not sched.lowered:
        raise ScheduleError("symbolic_run needs a lowered schedule (call lower() first)")
    check_collective_order(sched)
    R = sched.num_ranks
    progs = [sched.program(r) for r in range(R)]
    pc = [0] * R
    avail: list[set] = [set() for _ in range(R)]      # message keys present on the rank
    done: list[set] = [set() for _ in range(R)]       # (kind, copy, stage, mb) finished
    fifo: dict[tuple[int, int], deque] = {}
    ar_arrived: dict[int, int] = {}
    ar_started: list[list[int]] = [[] for _ in range(R)]

    def step(r: int) -> str | None:
        """Run rank r as far as it goes; return what it waits for (None when finished)."""
        prog = progs[r]
        while pc[r] < len(prog):
            op = prog[pc[r]]
            k = op.kind
            if k in (F, B, W):
                inc = incoming(op, sched) if k != W else None
                if inc is not None:
                    mk = (inc[0], op.copy, op.mb, inc[1])
                    if mk not in avail[r]:
                        raise ScheduleError(f"rank {r}: {op} runs before its input "
                                            f"({'activation' if inc[0] == ACT else 'gradient'} from stage {inc[1]}) "
                                            f"was received or copied")
                if k == B and (F, op.copy, op.stage, op.mb) not in done[r]:
                    raise ScheduleError(f"rank {r}: {op} runs before its forward")
                if k == W and (B, op.copy, op.stage, op.mb) not in done[r]:
                    raise ScheduleError(f"rank {r}: {op} runs before its input-gradient backward")
                done[r].add((k, op.copy, op.stage, op.mb))
            elif k in (SEND, COPY):
                producer = F if op.payload == ACT else B
                if (producer, op.copy, op.stage, op.mb) not in done[r]:
                    raise ScheduleError(f"rank {r}: {op} before the op that produces it")
                if k == SEND:
                    fifo.setdefault((r, op.peer), deque()).append(message_key(op))
                else:
                    avail[r].add(message_key(op))
            elif k == RECV:
                q = fifo.get((op.peer, r))
                if not q:
                    return f"rank {r} waits at {op} for rank {op.peer}"
                got = q.popleft()
                want = message_key(op)
                if got != want:
                    raise ScheduleError(f"FIFO mismatch: rank {r} at {op} expects {_fmt(want)} from rank {op.peer}, "
                                        f"but the next message rank {op.peer} sent is {_fmt(got)}")
                avail[r].add(want)
            elif k == ALLREDUCE:
                ar_arrived[op.stage] = ar_arrived.get(op.stage, 0) + 1
                ar_started[r].append(op.stage)
            elif k == OPTIM:
                for s in ar_started[r]:
                    count = len(sched.stage_group(s))
                    if ar_arrived.get(s, 0) < count:
                        return (f"rank {r} waits at OPT for AR.s{s} "
                                f"({ar_arrived.get(s, 0)}/{count} members of {sched.stage_group(s)} arrived)")
            pc[r] += 1
        return None

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
            raise ScheduleError("deadlock: " + "; ".join(waiting[r] for r in sorted(waiting)))
    leftovers = {pair: list(q) for pair, q in fifo.items() if q}
    if leftovers:
        (a, b), q = next(iter(leftovers.items()))
        raise ScheduleError(f"rank {a} sent {_fmt(q[0])} to rank {b}, which never receives it")


def _fmt(k: tuple) -> str:
    payload, c, mb, stage = k
    what = "activation" if payload == ACT else "gradient"
    return f"{what} of mb {mb} from stage {stage}" + (f" (copy {c})" if c else "")
