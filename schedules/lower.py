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

from .ir import (ACT, ALLREDUCE, COPY, GRAD, OPTIM, RECV, SEND, B, F, Op, Schedule, ScheduleError, W, consumer_stage,
                 message_key, producer_stage)
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

    # SEND / COPY after producers; remember each pair's send order
    sent: dict[tuple[int, int], list[tuple]] = {}
    for d, prog in enumerate(progs):
        for i, op in enumerate(prog):
            out = outgoing(op, sched)
            if out is None:
                continue
            payload, _, dst = out
            if dst == d:
                msg = Op(COPY, op.mb, op.stage, op.copy, op.chunk, -1, payload)
            else:
                msg = Op(SEND, op.mb, op.stage, op.copy, op.chunk, dst, payload)
                sent.setdefault((d, dst), []).append(message_key(msg))
            after[d].setdefault(i, []).append(msg)

    # RECV before consumers, in the sender's FIFO order
    for d, prog in enumerate(progs):
        consumer_pos: dict[tuple, int] = {}
        for i, op in enumerate(prog):
            inc = incoming(op, sched)
            if inc is not None and inc[2] != d:
                consumer_pos[(inc[0], op.copy, op.mb, inc[1])] = i
        for (src, dst), keys in sent.items():
            if dst != d:
                continue
            missing = [k for k in keys if k not in consumer_pos]
            if missing:
                raise ScheduleError(f"device {src} sends {missing[0]} to device {d}, which never consumes it")
            pos = [consumer_pos[k] for k in keys]
            for k in range(len(pos) - 2, -1, -1):
                pos[k] = min(pos[k], pos[k + 1])
            for (payload, c, mb, src_stage), p in zip(keys, pos):
                stage = consumer_stage(payload, src_stage)
                before[d].setdefault(p, []).append(Op(RECV, mb, stage, c, chunk[(c, stage)], src, payload))

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
        for i, op in enumerate(prog):
            out += before[d].get(i, [])
            out.append(op)
            out += after[d].get(i, [])
        out.append(Op(OPTIM))
        lowered.append(out)
    meta = dict(sched.meta, eager_allreduce=eager)
    return sched.with_programs(lowered, replicas=replicas, lowered=True, meta=meta)
