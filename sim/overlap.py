"""An overlapped forward/backward pair on one GPU: DualPipe's F&B, timed from the ops' phases.

Each op is a chain of alternating segments (:class:`cost_models.base.OpPhases`: compute, all-to-all,
compute, ...). The GPU has two streams, compute and communication; a segment runs on its kind's
stream, and starts once the segment before it in its chain has ended and its stream is free. The
two chains (the F of one micro-batch, the B of another) are interleaved by a small deterministic
list scheduler:

- when a stream is free and both chains have a ready segment for it, the one that became ready
  first starts; a tie goes to the F chain;
- a segment of length 0 takes no stream: it ends the moment it becomes ready (an op that starts
  with its all-to-all, ``compute[0] = 0``, starts on the comm stream at once);
- a comm segment of x seconds takes x seconds; while the comm stream is busy, compute runs at
  rate ``1 - sm_share`` (the communication kernels hold that share of the SMs), at rate 1 otherwise.

Closed forms. A compute segment of c seconds that starts with a comm segment of x seconds ends
after ``c / (1 - s)`` if that is at most x, else after ``c + s x``; the two together take
``max(x, c + s x)``. Over the whole pair the streams are never both idle before the end (an idle
stream with a ready segment starts it), so with W the compute seconds, X the comm seconds and H
the seconds both streams were busy (the comm seconds ``hidden`` under compute),
``time = W + X - (1 - s) H = serial - (1 - s) H``.

Sub-phases. ``PairTime.phases`` lists every segment of both chains as it ran
(:class:`PairPhase`: the op, F or B; its segment number within the op, counting the op's compute
segments as the executor does, so a comm segment (the wait for an exchange) carries the number
of the compute segment it precedes; the kind, compute or comm; start and end from the pair's
start), ordered by start (ties: F first, then chain order), in the form of the executor's measured sub-phases
(``RunResult.extra["phases"]``, :class:`executor.overlap.Phase`), so simulated and measured
overlap can be compared phase by phase.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

from cost_models.base import OpPhases

_COMPUTE, _COMM = 0, 1
KINDS = ("compute", "comm")      # executor.overlap's COMPUTE, COMM


class PairPhase(NamedTuple):
    """One segment of an overlapped pair as the simulator ran it (module docstring)."""

    op: str          # "F" or "B"
    segment: int
    kind: str        # "compute" or "comm"
    start: float
    end: float


@dataclass(frozen=True)
class PairTime:
    """The timing of one overlapped F&B pair, in the phases' time unit: ``time`` the pair takes,
    ``serial`` = F.total + B.total (one after the other), ``comm`` = both ops' all-to-all seconds,
    ``hidden`` = the comm seconds that ran while compute ran (``time = serial - (1 - s) hidden``)."""

    time: float
    serial: float
    comm: float
    hidden: float
    phases: tuple = field(default=(), compare=False)     # PairPhase rows (module docstring)


def _segments(p: OpPhases) -> list[tuple[int, float]]:
    out = []
    for i, c in enumerate(p.compute):
        out.append((_COMPUTE, c))
        if i < len(p.comm):
            out.append((_COMM, p.comm[i]))
    return out


def overlapped_pair(f: OpPhases, b: OpPhases, sm_share: float) -> PairTime:
    """Run F's and B's segment chains on the two streams (module docstring) and time the pair."""
    if isinstance(sm_share, bool) or not (isinstance(sm_share, (int, float)) and math.isfinite(sm_share)
                                           and 0 <= sm_share < 1):
        raise ValueError(f"sm_share must be a number in [0, 1); got {sm_share!r}")
    chains = (_segments(f), _segments(b))
    nxt = [0, 0]               # next segment of each chain
    ready = [0.0, 0.0]         # when that segment became ready
    # per stream: (chain, remaining) of its running segment, or None; compute remaining is work
    # (seconds at rate 1), comm remaining is seconds
    running: list[list | None] = [None, None]
    t = hidden = 0.0
    slow = 1.0 - sm_share
    began: dict = {}           # (chain, segment index) -> start
    while True:
        # zero-length segments end as they become ready, taking no stream
        for ch in (0, 1):
            seg = chains[ch]
            while nxt[ch] < len(seg) and seg[nxt[ch]][1] == 0.0 and not _runs(running, ch):
                began[(ch, nxt[ch])] = (t, t)
                nxt[ch] += 1
        # start what can start: per free stream, the ready segment that became ready first (ties to F)
        for stream in (_COMPUTE, _COMM):
            if running[stream] is not None:
                continue
            best = None
            for ch in (0, 1):
                seg = chains[ch]
                if nxt[ch] < len(seg) and seg[nxt[ch]][0] == stream and not _runs(running, ch):
                    if best is None or ready[ch] < ready[best]:
                        best = ch
            if best is not None:
                running[stream] = [best, chains[best][nxt[best]][1]]
                began[(best, nxt[best])] = (t, None)
        if running[_COMPUTE] is None and running[_COMM] is None:
            break
        # advance to the next end: the stream(s) whose segment ends first end it exactly
        rate = slow if running[_COMM] is not None else 1.0
        ends = [math.inf, math.inf]
        if running[_COMPUTE] is not None and rate > 0:
            ends[_COMPUTE] = running[_COMPUTE][1] / rate
        if running[_COMM] is not None:
            ends[_COMM] = running[_COMM][1]
        dt = min(ends)
        if running[_COMPUTE] is not None and running[_COMM] is not None:
            hidden += dt
        t += dt
        for stream in (_COMPUTE, _COMM):
            run = running[stream]
            if run is None:
                continue
            if ends[stream] == dt:
                ch = run[0]
                running[stream] = None
                began[(ch, nxt[ch])] = (began[(ch, nxt[ch])][0], t)
                nxt[ch] += 1
                ready[ch] = t
            else:
                run[1] -= dt * rate if stream == _COMPUTE else dt
    comm = f.comm_total + b.comm_total
    rows = []
    for (ch, i), (a, e) in began.items():
        kind = chains[ch][i][0]
        rows.append(PairPhase("FB"[ch], (i + 1) // 2, KINDS[kind], a, e))
    rows.sort(key=lambda r: (r.start, r.op != "F"))
    return PairTime(time=t, serial=f.total + b.total, comm=comm, hidden=hidden, phases=tuple(rows))


def _runs(running, ch: int) -> bool:
    return any(r is not None and r[0] == ch for r in running)
