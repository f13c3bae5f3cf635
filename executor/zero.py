"""ZeRO stage 1 (``--zero 1``): the optimizer state sharded over the ranks that hold a stage.

The runtime's ALLREDUCE sums a stage's gradients over ``schedule.stage_group(stage)`` (the
data-parallel replicas and model copies of the stage; with tensor parallelism the same TP rank
of each) as without ZeRO. At OPTIM each of the k ranks of the group then steps only its 1/k of the
stage's parameters, seen as one flat vector: its shard is a fp32 master copy with the optimizer
state (Adam's two moments, SGD's momentum) of that slice alone, so the optimizer's memory per
rank falls by k. The updated shards are all-gathered over the group and written into the
parameters: every rank ends the step with the same weights, each element computed once.

The optimizers are element-wise, so stepping slices of a flat vector gives exactly the updates
of stepping the whole parameters (tests: losses and weights equal to the reference's).
(Megatron reduce-scatters the gradients instead of all-reducing them; gloo has no
reduce-scatter, and the sum is the same.)
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

    def _padded(self, tensors) -> torch.Tensor:
        flat = torch.cat([t.reshape(-1) for t in tensors])
        return torch.nn.functional.pad(flat, (0, self.per * self.size - self.numel))

    def take_grad(self) -> None:
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
    entry per distinct stage module of this rank (``index`` of ``size`` ranks in its group)."""

    def __init__(self, stages, name: str, lr: float):
        self.shards = [_Shard(*s) for s in stages if s[0]]
        self.inner = make_optimizer([s.master for s in self.shards], name, lr)

    @property
    def state(self) -> dict:
        """Per shard: its optimizer state (what the optimizer keeps per rank; the shard itself is a
        view of the weights)."""
        return {s.master: dict(self.inner.state.get(s.master, {})) for s in self.shards}

    def step(self) -> None:
        for s in self.shards:
            s.take_grad()
        self.inner.step()
        for s in self.shards:
            s.put_weights()

    def zero_grad(self, set_to_none: bool = False) -> None:
        for s in self.shards:
            s.master.grad = None
            for p in s.params:
                p.grad.zero_()
