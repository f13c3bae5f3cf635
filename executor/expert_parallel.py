"""Expert parallelism: the EP group of a process and its differentiable, uneven all-to-all.

Inside a pipeline stage the T x R processes holding one stage (its TP ranks of each data-parallel
replica) are folded into ETP x EP x EDP (Megatron-LM's "parallel folding",
:mod:`cost_models.moe`): an EP group is EP consecutive members at stride ETP of the stage's T x R
processes, ETP innermost. EP rank e holds the routed experts ``[e E/EP, (e+1) E/EP)`` (Megatron's
contiguous order) under the whole model's parameter names (``...mlp.experts.{j}.w1`` with global
j), so a run's parameters compare with the single-process reference's by name.

A MoE MLP sends every token-expert pair to the EP rank holding its expert (*dispatch*) and back
(*combine*) with :meth:`ExpertParallel.all_to_all`: ``x`` [n, h] holds the rows sorted by
destination EP rank, ``send_counts`` the EP row counts to each rank (routing makes them uneven,
zeros included). The exchange is two ``torch.distributed.all_to_all_single`` calls: one of EP
integers (each rank learns how many rows it receives from each) and one of the rows with those
input/output split sizes; on gloo (CPU) and NCCL (GPU) alike. The result is the rows received
concatenated in source-rank order, ``sum(recv_counts)`` of them: row block s of rank e's output is
row block e of rank s's input. The backward is the reverse exchange of the gradient (input splits
``recv_counts``, output splits ``send_counts``): the transpose of a permutation of rows is its
inverse, so ``d x = a2a^T (d y)`` is exactly the gradient a concatenation done by hand would get.

Gradients (:func:`executor.worker.setup_rank`): every micro-batch's loss is scaled by 1/G (G = R N),
as without EP. The gradient of routed expert j on its EP rank already holds what every token its
EP group routed to j contributed (the backward exchange brings it back), so summing it over its EDP
group (the processes holding the same experts: one per EP group) sums it over all G micro-batches,
as the reference does; the routed experts are left out of the stage's all-reduce over its replicas
(which sums the dense parameters as before) and summed over their EDP group at OPTIM. With ZeRO-1
the dense parameters' state is sharded over the stage's shard group, the experts' over their EDP
group.

At size 1 (``NO_EP``) both calls return ``(x, send_counts)`` unchanged and issue nothing.

:meth:`ExpertParallel.start_all_to_all` issues the same exchange with ``async_op=True`` and
returns a handle whose ``wait()`` gives ``(y, recv_counts)``, so the overlap runtime can put compute
between the issue and the wait. The count exchange is synchronous (the output's size depends on
it; EP integers), the rows travel asynchronously; ``y`` is an autograd output of ``x``. The
backward exchange runs synchronously inside autograd's backward of the node.

*An emulated wire* (``wire``, bytes/s: the job's ``--a2a-wire``, :class:`cost_models.job.Faults`).
On a cluster an all-to-all is wire time the processor does not spend; over gloo on one host it is
a CPU copy. With a wire, an exchange of rows of ``S`` bytes (what this rank puts into it, its own
rows included: ``x``'s bytes, as the calibration's fit counts them) issued at ``t0`` (the call,
before its counts' round: the fit times the round and the rows as one exchange) ends no earlier
than ``t0 + S / wire``: its wait (:func:`wire_wait`) sleeps what is left of that after the gloo
exchange itself (counts' round and rows), so the core is free meanwhile; an exchange's seconds are
``max(gloo, S / wire)``, the simulator's rule on a calibrated profile
(:meth:`cost_models.profile.CalibrationProfile.a2a_times`). Under the F&B overlap the wait comes
after the other micro-batch's compute segment (:mod:`executor.overlap`), which then hides it. The
counts' exchange (a few integers) takes no wire time.
"""
from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .faults import note_injected_kill


_ROUTED = re.compile(r"(^|\.)experts\.\d+\.")   # a routed expert's parameter (global index), not a shared one's


def is_expert_param(name: str) -> bool:
    """Whether parameter ``name`` belongs to a routed expert (``...mlp.experts.{j}.w1``): held by one EP
    rank, its gradient summed over the EDP group (every other parameter: over the stage's replicas)."""
    return _ROUTED.search(name) is not None


SENT_KEPT = 1024    # exchanges whose send counts an ExpertParallel keeps (the first ones: a long run stays small)
_KILL = [False]     # an injected fault armed in this process (executor.faults.A2A)


def arm_kill() -> None:
    """Fault injection (``--inject-fault RANK:a2a``, :mod:`executor.faults`): this process is killed by
    SIGKILL inside its next all-to-all over an EP group, after the row counts are exchanged, while
    its peers wait there for its rows."""
    _KILL[0] = True


def _counts(send_counts, size: int) -> list[int]:
    counts = [int(c) for c in send_counts]
    if len(counts) != size or any(c < 0 for c in counts):
        raise ValueError(f"an all-to-all over {size} EP ranks needs {size} row counts >= 0; got {counts}")
    return counts


def exchange_counts(send_counts: list[int], group, device) -> list[int]:
    """Row counts each EP rank receives from each: the all-to-all of the EP integers ``send_counts``."""
    send = torch.tensor(send_counts, dtype=torch.int64, device=device)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return [int(c) for c in recv.tolist()]


def wire_seconds(nbytes: float, wire: float | None) -> float:
    """Seconds ``nbytes`` take on the emulated wire of ``wire`` bytes/s: ``nbytes / wire`` (0 without one)."""
    return 0.0 if wire is None else nbytes / wire


def wire_wait(due: float | None, clock=time.perf_counter, sleep=time.sleep) -> float:
    """Sleep until ``due`` (an exchange's issue time + its wire seconds) where it is still ahead of
    ``clock()``; returns the seconds asked of ``sleep`` (0 when the exchange already took longer)."""
    if due is None:
        return 0.0
    left = due - clock()
    if left <= 0:
        return 0.0
    sleep(left)
    return left


def _bytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


def _issue(x: torch.Tensor, send: list[int], recv: list[int], group, async_op: bool):
    """Start the rows' exchange: (output buffer, work or None)."""
    x = x.contiguous()
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    work = dist.all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=send, group=group,
                                  async_op=async_op)
    return out, work


class _AllToAll(torch.autograd.Function):
    """Rows ``x`` split by ``send`` out, split by ``recv`` in; backward the reverse exchange."""

    @staticmethod
    def forward(ctx, x, send, recv, group, pending, ep):
        ctx.send, ctx.recv, ctx.group, ctx.ep = send, recv, group, ep
        out, work = _issue(x, send, recv, group, async_op=pending is not None)
        if pending is not None:
            pending.append(work)
        return out

    @staticmethod
    def backward(ctx, grad):
        ep = ctx.ep
        due = ep.wire_due(grad)
        out, _ = _issue(grad, ctx.recv, ctx.send, ctx.group, async_op=False)
        wire_wait(due, ep.clock, ep.sleep)
        return out, None, None, None, None, None


class AllToAllHandle:
    """An all-to-all in flight (:meth:`ExpertParallel.start_all_to_all`): ``wait()`` -> (rows,
    recv_counts), after the gloo work ends and, with an emulated wire, not before ``due`` (the
    issue time + the wire seconds of its rows, :func:`wire_wait` on ``clock`` / ``sleep``)."""

    def __init__(self, out: torch.Tensor, recv_counts: list[int], work=None, due: float | None = None,
                 clock=time.perf_counter, sleep=time.sleep):
        self._out, self._recv, self._work, self._due = out, recv_counts, work, due
        self._clock, self._sleep = clock, sleep
        self.slept = 0.0            # seconds the wire's wait asked of sleep

    def wait(self) -> tuple[torch.Tensor, list[int]]:
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._due is not None:
            self.slept += wire_wait(self._due, self._clock, self._sleep)
            self._due = None
        return self._out, self._recv


@dataclass(frozen=True)
class ExpertParallel:
    """A process's expert-parallel group: ``size`` EP ranks (``ranks``, global process-group ranks in
    EP-rank order), this process being EP rank ``rank``; ``group`` the torch process group
    (None at size 1). ``sent``: the send counts of the first :data:`SENT_KEPT` exchanges issued (what
    a run reports: routing's uneven splits, :func:`executor.worker.merge_reports`). ``wire``: an
    emulated wire's bytes/s under the rows' exchanges (module docstring; None: none); ``clock`` /
    ``sleep`` its wait's (a test's fake clock)."""

    size: int = 1
    rank: int = 0
    group: object = None
    ranks: tuple[int, ...] = ()
    sent: list = field(default_factory=list, compare=False, repr=False)   # each exchange's send counts
    wire: float | None = None
    clock: object = field(default=time.perf_counter, compare=False, repr=False)
    sleep: object = field(default=time.sleep, compare=False, repr=False)

    def __post_init__(self):
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"EP rank {self.rank} of an EP group of {self.size}")
        if self.ranks and len(self.ranks) != self.size:
            raise ValueError(f"an EP group of {self.size} lists {len(self.ranks)} ranks")
        if self.wire is not None and not self.wire > 0:
            raise ValueError(f"an emulated wire needs a bandwidth > 0 bytes/s; got {self.wire!r}")

    def wire_due(self, x: torch.Tensor) -> float | None:
        """When an exchange of rows ``x`` issued now may end on the emulated wire: ``clock()`` +
        ``x``'s bytes / ``wire`` (None without a wire)."""
        return None if self.wire is None else self.clock() + wire_seconds(_bytes(x), self.wire)

    def experts(self, num_experts: int) -> range:
        """The global indices of the routed experts this EP rank holds (contiguous, Megatron's order)."""
        if num_experts % self.size:
            raise ValueError(f"EP {self.size} does not divide the {num_experts} experts")
        per = num_experts // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    def all_to_all(self, x: torch.Tensor, send_counts) -> tuple[torch.Tensor, list[int]]:
        """Rows ``x`` (sorted by destination EP rank, ``send_counts[e]`` to rank e) exchanged: the rows
        received in source-rank order and their counts (module docstring). Differentiable."""
        return self.start_all_to_all(x, send_counts, async_op=False).wait()

    def start_all_to_all(self, x: torch.Tensor, send_counts, async_op: bool = True) -> AllToAllHandle:
        """:meth:`all_to_all` issued asynchronously: ``handle.wait()`` -> (rows, recv_counts)."""
        send = _counts(send_counts, self.size)
        if sum(send) != x.shape[0]:
            raise ValueError(f"send counts {send} sum to {sum(send)}; the all-to-all was given {x.shape[0]} rows")
        if self.size == 1:
            return AllToAllHandle(x, send)
        if len(self.sent) < SENT_KEPT:
            self.sent.append(tuple(send))
        due = self.wire_due(x)      # the exchange starts here: its counts' round is part of its seconds
        recv = exchange_counts(send, self.group, x.device)
        if _KILL[0]:
            note_injected_kill("by --inject-fault (inside an expert all-to-all)")
            os.kill(os.getpid(), signal.SIGKILL)
        pending = [] if async_op else None
        out = _AllToAll.apply(x, send, recv, self.group, pending, self)
        return AllToAllHandle(out, recv, pending[0] if pending else None, due, self.clock, self.sleep)


NO_EP = ExpertParallel()


@dataclass(frozen=True)
class ExpertGroups:
    """One process's expert groups for one stage: ``ep`` (its EP group, handed to the stage's MoE
    blocks) and its EDP group (``edp_ranks`` in EDP-rank order, this process at ``edp_index``;
    ``edp_group`` the torch group, None with one member): the processes that hold the same experts
    and sum their gradients."""

    ep: ExpertParallel = NO_EP
    edp_ranks: tuple[int, ...] = ()
    edp_group: object = None
    edp_index: int = 0
    etp: "ExpertTensorParallel" = None      # its ETP group (None: ETP 1)


def _gather_uneven(x: torch.Tensor, counts: list[int], group) -> torch.Tensor:
    """The rows of every member concatenated in member order (``counts[u]`` from member u): each pads
    its rows to the largest count for one equal-size ``all_gather`` (gloo and NCCL alike)."""
    top = max(counts)
    pad = x.new_zeros((top,) + tuple(x.shape[1:]))
    pad[:x.shape[0]] = x
    parts = [torch.empty_like(pad) for _ in counts]
    dist.all_gather(parts, pad, group=group)
    return torch.cat([p[:c] for p, c in zip(parts, counts)])


def _reduce_scatter_uneven(x: torch.Tensor, counts: list[int], rank: int, group) -> torch.Tensor:
    """Member ``rank``'s block of rows (``counts[rank]`` of them, after the blocks of the members
    before it) summed over the members: each block padded to the largest count, one ``reduce_scatter``."""
    top = max(counts)
    parts = []
    for block in x.split(counts):
        pad = x.new_zeros((top,) + tuple(x.shape[1:]))
        pad[:block.shape[0]] = block
        parts.append(pad)
    out = torch.empty_like(parts[0])
    dist.reduce_scatter(out, parts, group=group)
    return out[:counts[rank]]


class _GatherRows(torch.autograd.Function):
    """ETP all-gather of uneven row blocks forward, reduce-scatter of the gradient backward
    (Megatron-LM's ``gather_from_sequence_parallel_region`` with output split sizes)."""

    @staticmethod
    def forward(ctx, x, counts, rank, group):
        ctx.counts, ctx.rank, ctx.group = counts, rank, group
        return _gather_uneven(x, counts, group)

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter_uneven(g, ctx.counts, ctx.rank, ctx.group), None, None, None


class _ScatterRows(torch.autograd.Function):
    """ETP reduce-scatter of uneven row blocks forward (the partial sums of the row-split w2), all-gather
    of the gradient backward (Megatron-LM's ``reduce_scatter_to_sequence_parallel_region``)."""

    @staticmethod
    def forward(ctx, x, counts, rank, group):
        ctx.counts, ctx.group = counts, group
        return _reduce_scatter_uneven(x, counts, rank, group)

    @staticmethod
    def backward(ctx, g):
        return _gather_uneven(g, ctx.counts, ctx.group), None, None, None


@dataclass(frozen=True)
class ExpertTensorParallel:
    """A process's expert-tensor-parallel group (``--etp``): ``size`` members (``ranks``, process-group
    ranks in ETP-rank order: consecutive processes of the stage's fold, ETP innermost), this process at
    ``rank``; ``group`` the torch group (None at size 1). Each member holds 1/ETP of every routed expert
    of its EP rank: w1 and w3 split by output rows (column-parallel), w2 by input columns (row-parallel)
    (:data:`ETP_SPLITS`). After the EP dispatch the members' rows are all-gathered (:meth:`gather_rows`),
    every member runs its slice of each expert on all of them, and the partial outputs of w2 are
    reduce-scattered back to the member whose rows they are (:meth:`scatter_rows`): Megatron-LM's order
    (``MoEAlltoAllTokenDispatcher``: all-to-all over EP, then all-gather over ETP; combine: reduce-scatter
    over ETP, then all-to-all)."""

    size: int = 1
    rank: int = 0
    group: object = None
    ranks: tuple[int, ...] = ()

    def gather_counts(self, counts: list[int], device) -> list[list[int]]:
        """Every member's per-expert row counts (this member's ``counts`` among them), in member order."""
        if self.size == 1:
            return [list(counts)]
        mine = torch.tensor(counts, dtype=torch.int64, device=device)
        parts = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(parts, mine, group=self.group)
        return [[int(c) for c in p.tolist()] for p in parts]

    def gather_rows(self, x: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """Rows ``x`` of every member (``rows[u]`` from member u) concatenated in member order; differentiable."""
        return x if self.size == 1 else _GatherRows.apply(x, rows, self.rank, self.group)

    def scatter_rows(self, x: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """This member's block of ``x`` (blocks of ``rows[u]`` rows) summed over the members; differentiable."""
        return x if self.size == 1 else _ScatterRows.apply(x, rows, self.rank, self.group)


NO_ETP = ExpertTensorParallel()

# a routed expert's parameter -> (dim, parts) of its ETP split (executor.tensor_parallel.shard's)
ETP_SPLITS = {"w1.weight": (0, 1), "w3.weight": (0, 1), "w2.weight": (1, 1)}


def etp_split_of(name: str) -> tuple[int, int] | None:
    """(dim, parts) of a routed expert's parameter under ETP (None: not a routed expert's)."""
    if not is_expert_param(name):
        return None
    return next((v for k, v in ETP_SPLITS.items() if name.endswith(k)), None)
