"""Lowering: turn a compute-only schedule into programs that both engines can run.

Inserted ops:
- SEND right after the op that produces a message for a stage on another device, COPY when the
  next stage sits on the same device (e.g. the V turn);
- RECV before the op that consumes a message. Messages between a pair of ranks are FIFO with no
  tags (NCCL semantics), so RECVs from one peer appear in the order that peer sends; a RECV sits
  right before its consumer unless a later-sent message is consumed earlier, in which case it
  moves up to that consumer (RECV k goes before min(consumer(j) for j >= k));
- ALLREDUCE of a stage's gradients over every rank holding a copy of it (bidirectional copies,
  data-parallel replicas). Every rank issues its all-reduces in one global order (stages sorted
  by when their gradients are final under unit costs, on the last member). With ``eager=True``
  each one sits right after the op that finalises the stage's gradients on that rank (in the
  bubbles), otherwise all at the end;
- OPTIM at the end of every program.
"""
from __future__ import annotations

from .common import gc_paused
from .ir import (ACT, ALLREDUCE, COPY, GRAD, OPTIM, RECV, SEND, B, F, Op, Schedule, ScheduleError, W, consumer_stage,
                 message_key, new_op, producer_stage)
from .timing import key, time_programs, unit_duration

_PAYLOAD = {F: ACT, B: GRAD}   # what a forward / an input-gradient backward hands on


def _neighbour(op: Op, sched: Schedule, other_stage) -> tuple[str, int, int] | None:
    payload = _PAYLOAD.get(op.kind)
    if payload is None:
        return None
    st = other_stage(payload, op.stage)
    if not 0 <= st < sched.num_stages:
        return None
    return payload, st, sched.placement[op.copy][st]


def outgoing(op: Op, sched: Schedule) -> tuple[str, int, int] | None:
    """(payload, destination stage, destination device) of the message a compute op produces."""
    return _neighbour(op, sched, consumer_stage)


def incoming(op: Op, sched: Schedule) -> tuple[str, int, int] | None:
    """(payload, source stage, source device) of the message a compute op consumes."""
    return _neighbour(op, sched, producer_stage)


def lower(sched: Schedule, *, replicas: int = 1, eager: bool = True) -> Schedule:
    with gc_paused():
        return _lower(sched, replicas, eager)


def _lower(sched: Schedule, replicas: int, eager: bool) -> Schedule:
    if sched.lowered:
        raise ScheduleError(f"{sched.name} is already lowered")
    if replicas < 1:
        raise ScheduleError(f"replicas must be >= 1; got {replicas}")
    D = sched.num_devices
    progs = sched.compute_programs()
    chunk = {cs: sched.chunk_of(*cs) for cs in
             [(c, s) for c in range(sched.num_copies) for s in range(sched.num_stages)]}
    before: list[dict[int, list[Op]]] = [dict() for _ in range(D)]
    after: list[dict[int, list[Op]]] = [dict() for _ in range(D)]

    # SEND / COPY after producers; remember each pair's send order. What depends only on (kind,
    # copy, stage) is resolved once per such combination (the ops of one stage all alike).
    out_of: dict[tuple, tuple | None] = {}
    in_of: dict[tuple, tuple | None] = {}
    sent: dict[tuple[int, int], list[tuple]] = {}
    consumers: list[dict[tuple, int]] = [dict() for _ in range(D)]   # message key -> consumer position
    for d, prog in enumerate(progs):
        after_d = after[d]
        consumer_pos = consumers[d]
        for i, op in enumerate(prog):
            ks = (op.kind, op.copy, op.stage)
            inc = in_of.get(ks, 0)
            if inc == 0:
                inc = in_of[ks] = incoming(op, sched)
            if inc is not None and inc[2] != d:
                consumer_pos[(inc[0], op.copy, op.mb, inc[1])] = i
            out = out_of.get(ks, 0)
            if out == 0:
                out = out_of[ks] = outgoing(op, sched)
            if out is None:
                continue
            payload, _, dst = out
            if dst == d:
                msg = new_op(COPY, op.mb, op.stage, op.copy, op.chunk, -1, payload)
            else:
                msg = new_op(SEND, op.mb, op.stage, op.copy, op.chunk, dst, payload)
                sent.setdefault((d, dst), []).append(message_key(msg))
            lst = after_d.get(i)
            if lst is None:
                after_d[i] = [msg]
            else:
                lst.append(msg)

    # RECV before consumers, in the sender's FIFO order
    by_dst: dict[int, list] = {}
    for (src, dst), keys in sent.items():
        by_dst.setdefault(dst, []).append((src, keys))
    for d in range(D):
        consumer_pos = consumers[d]
        before_d = before[d]
        for src, keys in by_dst.get(d, ()):
            missing = [k for k in keys if k not in consumer_pos]
            if missing:
                raise ScheduleError(f"device {src} sends {missing[0]} to device {d}, which never consumes it")
            pos = [consumer_pos[k] for k in keys]
            for k in range(len(pos) - 2, -1, -1):
                if pos[k + 1] < pos[k]:
                    pos[k] = pos[k + 1]
            for (payload, c, mb, src_stage), p in zip(keys, pos):
                stage = consumer_stage(payload, src_stage)
                rv = new_op(RECV, mb, stage, c, chunk[(c, stage)], src, payload)
                lst = before_d.get(p)
                if lst is None:
                    before_d[p] = [rv]
                else:
                    lst.append(rv)

    # ALLREDUCE: one global order, eager (after the last grad op of the stage) or at the end
    proto = sched.with_programs(progs, replicas=replicas)
    synced = [s for s in range(sched.num_stages) if len(proto.stage_group(s)) > 1]
    if synced:
        times = time_programs(progs, sched.num_stages,
                              unit_duration(D, sched.num_stages, sched.split_backward))
        grad_kind = W if sched.split_backward else B
        final_time: dict[int, float] = {}
        last_pos: list[dict[int, int]] = [dict() for _ in range(D)]
        for d, prog in enumerate(progs):
            for i, op in enumerate(prog):
                if op.kind == grad_kind:
                    last_pos[d][op.stage] = i
                    final_time[op.stage] = max(final_time.get(op.stage, 0.0), times[key(op)][2])
        global_order = sorted(synced, key=lambda s: (final_time[s], s))
        for d, prog in enumerate(progs):
            mine = [s for s in global_order if s in last_pos[d]]
            floor = -1
            for s in mine:
                p = max(last_pos[d][s], floor) if eager else len(prog) - 1
                floor = p
                c = next(c for c in range(sched.num_copies) if sched.placement[c][s] == d)
                after[d].setdefault(p, []).append(Op(ALLREDUCE, -1, s, c, chunk[(c, s)]))

    lowered = []
    for d, prog in enumerate(progs):
        out: list[Op] = []
        append, extend = out.append, out.extend
        before_d, after_d = before[d], after[d]
        for i, op in enumerate(prog):
            b = before_d.get(i)
            if b is not None:
                extend(b)
            append(op)
            a = after_d.get(i)
            if a is not None:
                extend(a)
        append(Op(OPTIM))
        lowered.append(out)
    meta = dict(sched.meta, eager_allreduce=eager)
    return sched.with_programs(lowered, replicas=replicas, lowered=True, meta=meta)
