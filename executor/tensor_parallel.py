"""Tensor parallelism inside a stage (Megatron-LM's layer split), on any torch.distributed backend.

A stage replica is T processes (a *TP group*, :class:`TensorParallel`); each holds 1/T of every
split weight and the group computes the layer together:

- column-parallel linear (attention QKV, MLP fc, the output head): the weight's output rows are
  split, the input is whole; ``copy`` (Megatron's *f*: identity forward, all-reduce of the input
  gradient backward) sits in front of it. The fused QKV weight is split per head: rank t holds
  rows ``[q_t; k_t; v_t]`` (``parts=3`` in :data:`SPLITS`), so its heads are whole.
- row-parallel linear (attention proj, MLP out): the weight's input columns are split, each rank
  produces a partial sum and ``reduce`` (Megatron's *g*: all-reduce forward, identity backward)
  adds them. The bias is added once, by TP rank 0 into its partial sum before the all-reduce (the
  same sum as Megatron's bias after it; the gradient arriving there is the whole one), so no
  rank keeps a copy it does not use.
- vocabulary-parallel embedding: rank t looks up the tokens of its vocabulary slice (the others
  give zeros) and ``reduce`` sums them; position embeddings, norms and biases are replicated and,
  their inputs and gradients being identical on every TP rank, stay identical without a collective.
- vocabulary-parallel cross-entropy (:func:`vocab_parallel_cross_entropy`): the logits stay split;
  the max, the sum of exponentials and the target's logit are all-reduced (three collectives of
  one number per token), the backward needs none.

Why autograd functions and not ``torch.distributed.tensor.parallel``: its ``ColwiseParallel``
shards a weight's rows contiguously (``Shard(0)``), which gives rank 0 of a fused QKV weight all
of Q and half of K (the per-head layout above needs the weight permuted and unpermuted around
it); ``loss_parallel`` must be active around the backward, which here runs in a later B (or B
and W) op of the schedule; and DTensor gradients do not go into the flat buffers of the
data-parallel all-reduce, the saved-tensor meter or the recomputation without ``to_local`` at
every seam. Checked on gloo: a block under ``parallelize_module`` with a local-head attention
runs forward and the split backward, so the functions here are a choice of layout, not a
work-around of a missing feature. With these functions the stage modules stay plain modules of
plain tensors and everything else in the executor works unchanged: the collectives are autograd
nodes without parameters, the split backward (:mod:`executor.backward`) runs them in B, a
recomputed block (:mod:`executor.recompute`) runs its forward all-reduces again in B; every TP
rank runs the same program, so the collectives of a group always meet.

Parameters keep their global names; :func:`shard` and :func:`gather` map between a whole
parameter and its T shards (:data:`SPLITS` says which are split and how), so weights are
initialised as the whole model's and a run's parameters compare with the reference's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as Fn

# parameter name suffix -> (dim, parts): split along ``dim`` of each of ``parts`` equal blocks
SPLITS = {"attn.qkv.weight": (0, 3), "attn.qkv.bias": (0, 3), "attn.proj.weight": (1, 1),
          "fc.weight": (0, 1), "fc.bias": (0, 1), "out.weight": (1, 1),
          "embed.tok.weight": (0, 1), "head.weight": (0, 1),
          # the Llama block (executor.llama)
          **{f"attn.{n}.{w}": (0, 1) for n in "qkv" for w in ("weight", "bias")},
          "mlp.gate.weight": (0, 1), "mlp.up.weight": (0, 1), "mlp.down.weight": (1, 1)}


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in its TP group: ``size`` T, ``rank`` t, ``group`` (None when T = 1)."""

    size: int = 1
    rank: int = 0
    group: object = None

    @property
    def on(self) -> bool:
        return self.size > 1


SINGLE = TensorParallel()


def split_of(name: str) -> tuple[int, int] | None:
    """(dim, parts) of a split parameter (global name), None for a replicated one."""
    return next((v for k, v in SPLITS.items() if name.endswith(k)), None)


def shard(full: torch.Tensor, rank: int, size: int, dim: int, parts: int = 1) -> torch.Tensor:
    """Rank ``rank``'s shard of ``full``: each of its ``parts`` blocks along ``dim`` cut in ``size``."""
    blocks = full.unflatten(dim, (parts, -1))
    return blocks.chunk(size, dim + 1)[rank].flatten(dim, dim + 1).contiguous()


def gather(shards: list[torch.Tensor], dim: int, parts: int = 1) -> torch.Tensor:
    """The whole tensor of the shards of ranks 0..T-1 (the inverse of :func:`shard`)."""
    return torch.cat([s.unflatten(dim, (parts, -1)) for s in shards], dim + 1).flatten(dim, dim + 1)


class _Copy(torch.autograd.Function):
    """f: identity forward, all-reduce of the gradient over the TP group backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _Reduce(torch.autograd.Function):
    """g: all-reduce over the TP group forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        y = x.contiguous().clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, g):
        return g, None


def copy(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return _Copy.apply(x, tp.group) if tp.on else x


def reduce(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return _Reduce.apply(x, tp.group) if tp.on else x


class _VocabParallelCE(torch.autograd.Function):
    """Mean cross-entropy of logits split over the vocabulary (rows of ``logits``: tokens)."""

    @staticmethod
    def forward(ctx, logits, targets, lo, group):
        logits = logits.float()
        m = logits.max(-1).values
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - m.unsqueeze(-1)
        local = targets - lo
        outside = (local < 0) | (local >= logits.shape[-1])
        local = local.masked_fill(outside, 0)
        rows = torch.arange(logits.shape[0], device=logits.device)
        picked = shifted[rows, local].masked_fill(outside, 0.0)
        exp = shifted.exp()
        total = exp.sum(-1)
        both = torch.stack([picked, total])
        dist.all_reduce(both, group=group)
        picked, total = both[0], both[1]
        loss = (total.log() - picked).mean()
        exp.div_(total.unsqueeze(-1))
        ctx.save_for_backward(exp, local, outside)
        return loss

    @staticmethod
    def backward(ctx, g):
        soft, local, outside = ctx.saved_tensors
        rows = torch.arange(soft.shape[0], device=soft.device)
        grad = soft.clone()
        grad[rows, local] -= (~outside).to(grad.dtype)
        return grad * (g / soft.shape[0]), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """The mean next-token loss of ``logits`` [..., V/T] (this rank's vocabulary slice) and ``targets``."""
    flat = logits.reshape(-1, logits.shape[-1])
    return _VocabParallelCE.apply(flat, targets.reshape(-1), tp.rank * logits.shape[-1], tp.group)


def vocab_parallel_embedding(tokens: torch.Tensor, weight: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Embeddings of ``tokens`` from this rank's vocabulary slice ``weight`` [V/T, h], summed over the group."""
    lo = tp.rank * weight.shape[0]
    local = tokens - lo
    outside = (local < 0) | (local >= weight.shape[0])
    emb = torch.nn.functional.embedding(local.masked_fill(outside, 0), weight)
    return reduce(emb.masked_fill(outside.unsqueeze(-1), 0.0), tp)


class ColumnParallelLinear(nn.Linear):
    """``nn.Linear(n_in, n_out / T)``: this rank's output rows, its input's gradient summed over
    the TP group (see the module docstring); a plain linear layer when T = 1."""

    def __init__(self, n_in: int, n_out: int, tp: TensorParallel, bias: bool = True):
        super().__init__(n_in, n_out // tp.size, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Fn.linear(copy(x, self.tp), self.weight, self.bias)


class RowParallelLinear(nn.Linear):
    """``nn.Linear(n_in / T, n_out)``: this rank's input columns, the partial sums all-reduced
    over the TP group; the bias lives on TP rank 0 only (see the module docstring)."""

    def __init__(self, n_in: int, n_out: int, tp: TensorParallel, bias: bool = True):
        super().__init__(n_in // tp.size, n_out, bias=bias and tp.rank == 0)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reduce(Fn.linear(x, self.weight, self.bias), self.tp)
