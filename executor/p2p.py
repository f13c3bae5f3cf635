"""Point-to-point messages of a lowered program: non-blocking sends, receives posted ahead.

Semantics (the ones :mod:`schedules.validate` checks symbolically): a SEND is posted and returns
(``isend``); a RECV takes the next message from its peer, which must be the one it expects
(per-pair FIFO, no tags). The executor keeps those semantics on real process groups:

- *Directional groups.* Messages from a lower to a higher rank travel on one process group,
  messages the other way on a second one (both span all ranks, created once). Per pair, each
  direction is then its own FIFO channel; on NCCL it is its own communicator and stream, so a
  send that is waiting for its receiver to arrive (NCCL send is a rendezvous for large
  messages) never sits in front of a receive from the same peer: unmatched sends cannot
  deadlock a program that is deadlock-free with buffered sends.
- *Receives posted ahead.* At the start of a step the mailbox posts ``irecv`` for the step's
  RECVs from each peer, in the program's (= the sender's FIFO) order, so every message can land
  as soon as it is sent and a RECV op only waits for its already-posted receive. Each posted
  receive holds a buffer; ``lookahead=K`` bounds them to K per peer, topping up after every op
  (a RECV is never posted later than its own position). On gloo, posting all at the start was
  the fastest (tiny GPT, interleaved, D=2, N=8: 42 ms per step; K=4: 44-45, K=2: 46-49,
  K=1: 55), so it is the default.
- *Timeouts.* Waiting longer than ``timeout`` seconds for a receive raises :class:`CommError`
  naming the rank, the op and the peer; so does a peer that died (the transport reports it).
- Send handles and their tensors are kept until :meth:`Mailbox.finish_step` waits for them.
"""
from __future__ import annotations

import datetime
from collections import deque
from typing import Callable

import torch
import torch.distributed as dist

from schedules.ir import RECV, Op


class CommError(RuntimeError):
    """A receive or collective that timed out or failed; the message names rank, op and peer."""


class DirectionalGroups:
    """Two all-rank process groups: one carries messages to higher ranks, one to lower ranks."""

    def __init__(self, world_size: int, backend: str | None = None):
        ranks = list(range(world_size))
        self.up = dist.new_group(ranks, backend=backend)
        self.down = dist.new_group(ranks, backend=backend)
        self._warm: set[tuple[int, int]] = set()

    def for_message(self, src: int, dst: int):
        return self.up if src < dst else self.down

    def warm_up(self, rank: int, pairs, device) -> None:
        """Exchange one tiny message each way on every pair (a < b) that will talk, before the
        step: NCCL creates a pair's communicator on its first message and blocks the CPU while
        doing so, which must not happen in the middle of a program. All ranks walk the pairs in
        one global order, so these blocking exchanges cannot deadlock."""
        t = torch.zeros(1, device=device)
        for a, b in sorted(set(pairs) - self._warm):
            if rank == a:
                dist.send(t, b, group=self.up)
                dist.recv(t, b, group=self.down)
            elif rank == b:
                dist.recv(t, a, group=self.up)
                dist.send(t, a, group=self.down)
            self._warm.add((a, b))


class Mailbox:
    """Posts, waits for and sends one rank's P2P messages; see the module docstring."""

    def __init__(self, rank: int, program: tuple[Op, ...], groups: DirectionalGroups,
                 buffer: Callable[[Op], torch.Tensor], *, timeout: float, lookahead: int | None = None,
                 to_rank: Callable[[int], int] = int):
        self.rank = rank          # the pipeline rank (the program's peers are pipeline ranks)
        self.to_rank = to_rank    # pipeline rank -> process-group rank (TP rank t talks to TP rank t)
        self.groups = groups
        self.buffer = buffer
        self.timeout = timeout
        self.lookahead = lookahead
        self._recv_ops: dict[int, list[Op]] = {}
        for op in program:
            if op.kind == RECV:
                self._recv_ops.setdefault(op.peer, []).append(op)
        self._todo: dict[int, deque[Op]] = {}
        self._posted: dict[int, deque[tuple[Op, torch.Tensor, object]]] = {}
        self._sends: list[tuple[object, torch.Tensor, Op]] = []
        self.step = 0

    # ------------------------------------------------------------------ receives
    def start_step(self, step: int) -> None:
        self.step = step
        self._todo = {p: deque(ops) for p, ops in self._recv_ops.items()}
        self._posted = {p: deque() for p in self._recv_ops}
        self.top_up()

    def top_up(self) -> None:
        """Post receives up to the lookahead, per peer, in FIFO order."""
        for peer, todo in self._todo.items():
            posted = self._posted[peer]
            while todo and (self.lookahead is None or len(posted) < self.lookahead):
                op = todo.popleft()
                buf = self.buffer(op)
                src, me = self.to_rank(peer), self.to_rank(self.rank)
                work = dist.irecv(buf, src=src, group=self.groups.for_message(src, me))
                posted.append((op, buf, work))

    def wait(self, op: Op) -> torch.Tensor:
        """Wait for the message of RECV ``op`` (posted earlier) and return it."""
        posted = self._posted.get(op.peer)
        if not posted:
            self.top_up()
            posted = self._posted.get(op.peer)
        if not posted or posted[0][0] != op:
            head = posted[0][0] if posted else None
            raise CommError(f"rank {self.rank} step {self.step}: {op} is not the next receive from rank {op.peer} "
                            f"(next posted: {head}); the program's RECV order differs from its plan")
        _, buf, work = posted.popleft()
        wait_work(work, self.timeout, f"rank {self.rank} step {self.step}: {op} waiting for rank {op.peer}")
        return buf

    # ------------------------------------------------------------------ sends
    def send(self, op: Op, tensor: torch.Tensor) -> None:
        tensor = tensor.contiguous()
        dst = self.to_rank(op.peer)
        work = dist.isend(tensor, dst=dst, group=self.groups.for_message(self.to_rank(self.rank), dst))
        self._sends.append((work, tensor, op))

    def finish_step(self) -> None:
        """Wait for this step's sends; every receive must have been consumed."""
        for work, _, op in self._sends:
            wait_work(work, self.timeout, f"rank {self.rank} step {self.step}: {op} (send) to rank {op.peer}")
        self._sends.clear()
        left = [str(op) for q in self._posted.values() for op, _, _ in q] + \
               [str(op) for q in self._todo.values() for op in q]
        if left:
            raise CommError(f"rank {self.rank} step {self.step}: receives never consumed: {' '.join(left)}")


def wait_work(work, timeout: float, what: str) -> None:
    """Wait for an async P2P op or collective; raise :class:`CommError` ``what: reason`` when it
    takes longer than ``timeout`` seconds or the transport fails (e.g. the peer died)."""
    try:
        ok = work.wait(datetime.timedelta(seconds=timeout))
    except RuntimeError as e:
        low = str(e).lower()
        timed_out = "timed out" in low or "timeout" in low
        reason = f"nothing arrived within {timeout:g} s" if timed_out else f"the transport failed ({_first_line(e)})"
        raise CommError(f"{what}: {reason}") from None
    if ok is False:
        raise CommError(f"{what}: nothing arrived within {timeout:g} s")


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else type(e).__name__
