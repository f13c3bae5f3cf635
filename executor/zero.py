"""ZeRO stage 1 (``--zero 1``): the optimizer state sharded over the ranks that hold a stage.

Each of the k ranks of a stage's group (``schedule.stage_group(stage)``: the data-parallel
replicas and model copies of the stage; with tensor parallelism the same TP rank of each) steps
only its 1/k of the stage's parameters, seen as one flat vector: its shard is a fp32 master copy
(a view of the weights' one flat buffer) with the optimizer state (Adam's two moments, SGD's
momentum) of that slice alone, so the optimizer's memory per rank falls by k.

The runtime's ALLREDUCE of such a stage is a reduce-scatter (:meth:`ShardedOptimizer.reduce_scatter`):
each rank receives the sum of its own slice only, half the bytes of an all-reduce, as Megatron
does. At OPTIM the updated shards are all-gathered over the group into the weights: every rank
ends the step with the same weights, each element computed once. With sequence parallelism the
norms' gradients are partial sums over the TP group as well: their elements of this rank's
slice are summed over it before the step (TP ranks of a stage hold the same flat layout), once,
on the slice rather than on the whole gradients.

The optimizers are element-wise, so stepping slices of a flat vector gives exactly the updates
of stepping the whole parameters (tests: losses and weights equal to the reference's).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .model import make_optimizer


class _Shard:
    def __init__(self, params: list, group, index: int, size: int):
        self.params, self.group, self.index, self.size = params, group, index, size
        self.numel = sum(p.numel() for p in params)
        self.per = math.ceil(self.numel / size)
        self.flat = self._padded([p.detach() for p in params])
        with torch.no_grad():      # the parameters live in the flat buffer from here on
            for p, part in zip(params, torch.split(self.flat[:self.numel], [p.numel() for p in params])):
                p.data = part.view_as(p)
        self.master = torch.nn.Parameter(self.flat[index * self.per:(index + 1) * self.per])   # a view
        self.received: torch.Tensor | None = None     # this step's reduce-scattered slice of the gradients
        self.partial = torch.zeros(0, dtype=torch.long)   # positions in the slice of TP-partial gradients

    def _padded(self, tensors) -> torch.Tensor:
        flat = torch.cat([t.reshape(-1) for t in tensors])
        return torch.nn.functional.pad(flat, (0, self.per * self.size - self.numel))

    def mark_partial(self, ids: set[int]) -> None:
        """Positions, within this rank's slice, of the parameters in ``ids``."""
        pos, at = [], 0
        lo, hi = self.index * self.per, (self.index + 1) * self.per
        for p in self.params:
            if id(p) in ids:
                a, b = max(at, lo), min(at + p.numel(), hi)
                pos.extend(range(a - lo, b - lo))
            at += p.numel()
        self.partial = torch.tensor(pos, dtype=torch.long, device=self.flat.device)

    def reduce_scatter(self, flat: torch.Tensor):
        """Launch the sum over the group of ``flat`` (this rank's gradients in the parameters'
        order), of which this rank receives its slice; the work (None on a group of one)."""
        padded = torch.nn.functional.pad(flat, (0, self.per * self.size - self.numel))
        self.received = torch.empty(self.per, dtype=flat.dtype, device=flat.device)
        if self.group is None or self.size == 1:
            self.received.copy_(padded)
            return None
        return dist.reduce_scatter(self.received, list(padded.split(self.per)), group=self.group, async_op=True)

    def take_grad(self) -> None:
        if self.received is not None:      # reduce-scattered: the slice is already summed
            self.master.grad, self.received = self.received, None
        else:                              # all-reduced (or one rank): the slice of the summed gradients
            g = self._padded([p.grad for p in self.params])
            self.master.grad = g[self.index * self.per:(self.index + 1) * self.per].clone()

    @torch.no_grad()
    def put_weights(self) -> None:
        if self.size > 1:
            parts = [torch.empty_like(self.master) for _ in range(self.size)]
            dist.all_gather(parts, self.master.detach(), group=self.group)
            for k, part in enumerate(parts):
                if k != self.index:
                    self.flat[k * self.per:(k + 1) * self.per].copy_(part)


class ShardedOptimizer:
    """The optimizer ``name`` over the shards of ``stages``: ``[(params, group, index, size)]``, one
    entry per distinct stage module of this rank (``index`` of ``size`` ranks in its group).
    ``partial``: (parameters, TP group) whose gradients are partial sums over the TP group."""

    def __init__(self, stages, name: str, lr: float, *, partial=None, timeout: float = 60.0, rank: int = 0):
        self.shards = [_Shard(*s) for s in stages if s[0]]
        self.inner = make_optimizer([s.master for s in self.shards], name, lr)
        self._scatter = {id(s.params[0]): s for s in self.shards}
        self.timeout, self.rank = timeout, rank
        self.tp_group = None
        if partial is not None:
            params, self.tp_group = partial
            for s in self.shards:
                s.mark_partial({id(p) for p in params})

    def reduce_scatter(self, params: list, flat: torch.Tensor):
        """For the stage module whose parameters are ``params``: launch the reduce-scatter of its
        gradients ``flat`` and return ``(True, work)``; ``(False, None)`` for a module without a
        shard here (no parameters)."""
        shard = self._scatter.get(id(params[0])) if params else None
        if shard is None:
            return False, None
        return True, shard.reduce_scatter(flat)

    @property
    def state(self) -> dict:
        """Per shard: its optimizer state (what the optimizer keeps per rank; the shard itself is a
        view of the weights)."""
        return {s.master: dict(self.inner.state.get(s.master, {})) for s in self.shards}

    def step(self) -> None:
        from .p2p import wait_work
        pending = []
        for s in self.shards:
            s.take_grad()
            if self.tp_group is not None and s.partial.numel():
                part = s.master.grad[s.partial]
                pending.append((s, part, dist.all_reduce(part, group=self.tp_group, async_op=True)))
        for s, part, work in pending:
            wait_work(work, self.timeout, f"rank {self.rank}: all-reduce of the sequence-parallel norm "
                                          f"gradients of a ZeRO-1 shard over the tensor-parallel group")
            s.master.grad[s.partial] = part
        self.inner.step()
        for s in self.shards:
            s.put_weights()

    def zero_grad(self, set_to_none: bool = False) -> None:
        for s in self.shards:
            s.master.grad = None
            s.received = None
            for p in s.params:
                p.grad.zero_()
