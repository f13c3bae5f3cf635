"""Megatron-LM's interleaved 1F1B of August 2021 with its blocking P2P, op for op: does it add a bubble?

:mod:`experiments.reproduce.megatron` (mechanism 3) rests on this event model of
``forward_backward_pipelining_with_interleaving`` (``megatron/schedules.py`` at commit 78a69ea,
the code the SC'21 scripts ran), outside pipetwin's IR on purpose: it replays that function's
rounds exactly as written. Device d runs rounds; a round is its compute (a chunk's forward, or a
forward and a backward in the steady state, or a backward) followed by one call of
``p2p_communication`` whose sends and receives go out together (``batch_isend_irecv``, then
``wait`` on all of them, then ``torch.cuda.synchronize()``). In the steady state the forward's
output is sent only after the round's backward, in one call with the backward's gradient. The
n-th send from d to e matches the n-th receive of e from d. A round ends when every one of its
receives' senders and (``rendezvous``, as NCCL's sends of large messages) every one of its sends'
receivers has posted its matching call, plus ``comm`` seconds.

:func:`makespan` gives the step's time; at ``comm`` = 0 and balanced chunks it is exactly the
ideal interleaved step N(F + B) + (D-1)/v (F + B) with or without rendezvous (the warm-up's
extra 2(D-1-d) forwards absorb the deferred sends): the 2021 program adds no bubble of its own
(tests/test_reproduce_megatron.py). Unit: one full stage's forward F (a chunk F/v).
"""
from __future__ import annotations


def rounds(D: int, d: int, v: int, N: int) -> list[tuple[tuple, tuple]]:
    """Device ``d``'s rounds: (compute, p2p calls), compute a tuple of ("F" | "B", chunk), the calls
    of "send_next", "recv_prev", "send_prev", "recv_next" (the 2021 code's conditions)."""
    M = N * v
    first, last = d == 0, d == D - 1

    def chunk(k, forward):
        c = (k % (D * v)) // D
        return c if forward else v - 1 - c

    all_warmup = N == D
    warmup = M if all_warmup else min((D - d - 1) * 2 + (v - 1) * D, M)
    steady = M - warmup
    out = [((), () if first else ("recv_prev",))]          # recv_forward before the loop
    for k in range(warmup):
        c, nxt = chunk(k, True), chunk(k + 1, True)
        recv_prev = not (first and nxt == 0) and k != M - 1
        ops = ("send_next",) if not (last and c == v - 1) else ()
        ops += ("recv_prev",) if recv_prev else ()
        if k == warmup - 1 and not all_warmup and not last:
            ops += ("recv_next",)
        out.append(((("F", c),), ops))
    for k in range(steady):
        fk, bk = k + warmup, k
        fc, bc = chunk(fk, True), chunk(bk, False)
        recv_prev = not (first and chunk(fk - (D - 1), True) == v - 1) and k != steady - 1
        recv_next = not (last and chunk(bk - (D - 1), False) == 0)
        ops = (("send_prev",) if not (first and bc == 0) else ()) + (("recv_prev",) if recv_prev else ()) + \
            (("send_next",) if not (last and fc == v - 1) else ()) + (("recv_next",) if recv_next else ())
        out.append(((("F", fc), ("B", bc)), ops))
    if all_warmup:
        out.append(((), () if last else ("recv_next",)))
    for k in range(steady, M):
        bc, nb = chunk(k, False), chunk(k + 1, False)
        recv_next = not (last and nb == v - 1) and k != M - 1
        ops = (("send_prev",) if not (first and bc == 0) else ()) + (("recv_next",) if recv_next else ())
        out.append(((("B", bc),), ops))
    return out


_PEER = {"send_next": 1, "recv_next": 1, "send_prev": -1, "recv_prev": -1}


def makespan(D: int, v: int, N: int, F: float = 1.0, B: float = 3.0, comm: float = 0.0,
             rendezvous: bool = True) -> float:
    """Seconds of one step (in units of a full stage's F; B = 3F with full recomputation): the last
    device's last round's end."""
    progs = [rounds(D, d, v, N) for d in range(D)]
    sends: dict = {}
    recvs: dict = {}
    for d, prog in enumerate(progs):
        for j, (_, ops) in enumerate(prog):
            for op in ops:
                e = (d + _PEER[op]) % D
                (sends if op.startswith("send") else recvs).setdefault((d, e) if op.startswith("send") else (e, d),
                                                                       []).append(j)
    match = {}
    for pair, js in sends.items():
        if len(js) != len(recvs.get(pair, ())):
            raise ValueError(f"unmatched messages {pair}: {len(js)} sends, {len(recvs.get(pair, ()))} receives")
        for a, b in zip(js, recvs[pair]):
            match[(pair[0], a, pair[1])] = (pair[1], b)
            match[(pair[1], b, pair[0])] = (pair[0], a)
    posted = [[None] * len(p) for p in progs]
    clock, at = [0.0] * D, [0] * D
    while any(at[d] < len(progs[d]) for d in range(D)):
        moved = False
        for d in range(D):
            while at[d] < len(progs[d]):
                j = at[d]
                compute, ops = progs[d][j]
                if posted[d][j] is None:
                    posted[d][j] = clock[d] + sum((F if k == "F" else B) / v for k, _ in compute)
                times = [posted[d][j]]
                for op in ops:
                    if op.startswith("send") and not rendezvous:
                        continue
                    e, i = match[(d, j, (d + _PEER[op]) % D)]
                    if posted[e][i] is None:
                        break
                    times.append(posted[e][i])
                else:
                    clock[d] = max(times) + (comm if ops else 0.0)
                    at[d] += 1
                    moved = True
                    continue
                break
        if not moved:
            raise RuntimeError("the rounds deadlock")
    return max(clock)
