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

Sequence parallelism (``--sequence-parallel``, ``TensorParallel.sequence``; Megatron-LM's variant,
Korthikanti et al. 2022): outside the column/row-parallel pairs the activations are split over the
TP group along the sequence (dim 1 of [b, s, h]: rank t holds positions ``[t s/T, (t+1) s/T)``), so
the norms, residual additions and the stage boundaries (:func:`executor.model.boundary_shape`) hold
1/T of the sequence. ``copy`` in front of column-parallel linears becomes a gather
(:func:`gather_linears`: all-gather of the sequence forward, reduce-scatter of the input gradient
backward) and the ``reduce`` after a row-parallel linear or the vocabulary-parallel embedding becomes
a scatter (reduce-scatter forward, all-gather backward): the same sums, one all-reduce split into
its two halves. The head's
input is gathered the same way, so the loss sees the whole sequence; attention runs on the gathered
sequence, so rotary positions are the whole sequence's, and the GPT's position table is read at the
rank's own positions. A replicated parameter applied to 1/T of the sequence (norm weights, the
position table: :func:`sequence_partial`) then gets 1/T of its gradient on each rank; the runtime
sums those over the TP group at OPTIM, where it synchronises every other gradient
(:class:`executor.runtime.PipelineRuntime`). As in Megatron, the column-parallel linears keep
their input's slice for the backward and gather it again there, so every activation a block keeps
outside the attention and the MLP's inner size is 1/T of the sequence (the simulator's ledger,
:func:`cost_models.transformer.block_activation_bytes` with ``sp``); under a split backward the
row-parallel linears likewise keep their output gradient's slice for W and gather it there
(:func:`cost_models.transformer.block_weight_grad_bytes` with ``sp``).

Parameters keep their global names; :func:`shard` and :func:`gather` map between a whole
parameter and its T shards (:data:`SPLITS` says which are split and how), so weights are
initialised as the whole model's and a run's parameters compare with the reference's.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as Fn

# replicated parameters that only TP rank 0 holds (the row-parallel biases, see above)
RANK0_ONLY = ("attn.proj.bias", ".out.bias")

# parameter name suffix -> (dim, parts): split along ``dim`` of each of ``parts`` equal blocks
SPLITS = {"attn.qkv.weight": (0, 3), "attn.qkv.bias": (0, 3), "attn.proj.weight": (1, 1),
          "fc.weight": (0, 1), "fc.bias": (0, 1), "out.weight": (1, 1),
          "embed.tok.weight": (0, 1), "head.weight": (0, 1),
          # the Llama block (executor.llama)
          **{f"attn.{n}.{w}": (0, 1) for n in "qkv" for w in ("weight", "bias")},
          "mlp.gate.weight": (0, 1), "mlp.up.weight": (0, 1), "mlp.down.weight": (1, 1),
          # a mixture of experts' shared experts (executor.moe.SharedExpert), latent attention's
          # per-head up-projections (executor.mla; its q is the Llama block's attn.q)
          "mlp.shared.w1.weight": (0, 1), "mlp.shared.w3.weight": (0, 1), "mlp.shared.w2.weight": (1, 1),
          "attn.q_b.weight": (0, 1), "attn.kv_b.weight": (0, 1)}


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in its TP group: ``size`` T, ``rank`` t, ``group`` (None when T = 1);
    ``sequence``: sequence parallelism (see the module docstring)."""

    size: int = 1
    rank: int = 0
    group: object = None
    sequence: bool = False

    @property
    def on(self) -> bool:
        return self.size > 1


SINGLE = TensorParallel()


def split_of(name: str) -> tuple[int, int] | None:
    """(dim, parts) of a split parameter (global name), None for a replicated one."""
    return next((v for k, v in SPLITS.items() if name.endswith(k)), None)


def sequence_partial(name: str) -> bool:
    """A parameter every TP rank holds whose gradient sequence parallelism splits over the ranks
    (norm weights and biases, the position table): each rank's covers its part of the sequence."""
    return split_of(name) is None and not name.endswith(RANK0_ONLY)


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


def _all_gather_seq(x: torch.Tensor, group, size: int) -> torch.Tensor:
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, 1)


def _reduce_scatter_seq(x: torch.Tensor, group, size: int) -> torch.Tensor:
    parts = [c.contiguous() for c in x.chunk(size, 1)]
    out = torch.empty_like(parts[0])
    dist.reduce_scatter(out, parts, group=group)
    return out


def _will_run(ctx, first: int, last: int | None = None) -> bool:
    """Whether the running backward needs the gradient of any of the tensor inputs ``first..last``
    of the node ``ctx`` (a split backward's B asks for the input's gradient only, its W for the
    weights' only)."""
    return any(n is not None and torch._C._will_engine_execute_node(n) for n, _ in ctx.next_functions[first:last])


class _GatherLinears(torch.autograd.Function):
    """Sequence parallel: the column-parallel linears of one input, ``y_i = gather(x) W_i^T + b_i``
    (params: ``W_1, b_1, W_2, b_2, ...``, a bias may be None), as Megatron-LM's sequence-parallel
    linear layer: the forward all-gathers the sequence; the backward keeps only ``x`` (this rank's
    slice, 1/T of the sequence) and gathers it again for the weight gradients; the input gradient
    ``sum_i g_i W_i`` is reduce-scattered. A split backward (:mod:`executor.backward`) computes the
    input gradient in B and the weight gradients in W (:meth:`weight_grads`)."""

    @staticmethod
    def forward(ctx, x, group, size, *params):
        full = _all_gather_seq(x, group, size)
        ctx.group, ctx.size, ctx.params = group, size, params
        ctx.save_for_backward(x)
        out = tuple(Fn.linear(full, params[i], params[i + 1]) for i in range(0, len(params), 2))
        return out if len(out) > 1 else out[0]

    @staticmethod
    def backward(ctx, *grads):
        (x,) = ctx.saved_tensors
        params = ctx.params
        gx = None
        if _will_run(ctx, 0, 1):
            total = sum(g.matmul(params[2 * i].to(g.dtype)) for i, g in enumerate(grads))
            gx = _reduce_scatter_seq(total, ctx.group, ctx.size).to(x.dtype)
        out = [None] * len(params)
        if _will_run(ctx, 1):
            out = [g if g is None else g.to(p.dtype) for p, g in
                   zip(params, _param_grads(_all_gather_seq(x, ctx.group, ctx.size), grads, params))]
        return (gx, None, None, *out)

    # the split backward's protocol (executor.backward): what W keeps, and W's gradients from it
    @staticmethod
    def saved_for_weight(node) -> tuple:
        return (node.saved_tensors[0].detach(), (node.group, node.size, node.params))

    @staticmethod
    def weight_grads(saved: tuple, grads) -> list:
        """[(parameter, gradient)] of the linears from this rank's input slice (gathered again)
        and the gradients ``grads`` of their outputs."""
        x, (group, size, params) = saved
        grads = _param_grads(_all_gather_seq(x, group, size), grads, params)
        return [(p, g) for p, g in zip(params, grads) if g is not None]


def _param_grads(full: torch.Tensor, grads, params) -> list:
    """Per entry of ``params`` (W_1, b_1, ...) its gradient (None for an absent bias or output
    gradient) from the gathered input ``full`` and the output gradients ``grads``."""
    full = full.reshape(-1, full.shape[-1])
    out = [None] * len(params)
    for i, g in enumerate(grads):
        if g is None:
            continue
        g2 = g.reshape(-1, g.shape[-1])
        out[2 * i] = g2.t().mm(full.to(g.dtype))
        if params[2 * i + 1] is not None:
            out[2 * i + 1] = g2.sum(0)
    return out


class _LinearScatter(torch.autograd.Function):
    """Sequence parallel: a row-parallel linear, ``scatter(x W^T + b)`` (the reduce-scatter of the
    partial sums over the sequence). The backward all-gathers the output gradient (this rank's
    slice) for the input gradient and the weight gradient; a split backward keeps the slice for W
    and gathers it again there (:meth:`weight_grads`), so what waits for W is 1/T of the sequence."""

    @staticmethod
    def forward(ctx, x, group, size, weight, bias):
        ctx.group, ctx.size, ctx.params = group, size, (weight, bias)
        ctx.save_for_backward(x)
        return _reduce_scatter_seq(Fn.linear(x, weight, bias), group, size)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        weight, bias = ctx.params
        need_x, need_w = _will_run(ctx, 0, 1), _will_run(ctx, 1)
        full = _all_gather_seq(g, ctx.group, ctx.size) if need_x or need_w else None
        gx = full.matmul(weight.to(full.dtype)).to(x.dtype) if need_x else None
        gw = gb = None
        if need_w:
            gw, gb = _param_grads(x, [full], ctx.params)
            gw, gb = gw.to(weight.dtype), (None if gb is None else gb.to(bias.dtype))
        return gx, None, None, gw, gb

    @staticmethod
    def saved_for_weight(node) -> tuple:
        return (node.saved_tensors[0].detach(), (node.group, node.size, node.params))

    @staticmethod
    def weight_grads(saved: tuple, grads) -> list:
        """[(parameter, gradient)] from the kept input and this rank's slice of the output
        gradient (gathered again)."""
        x, (group, size, params) = saved
        grads = _param_grads(x, [_all_gather_seq(grads[0], group, size)], params)
        return [(p, g) for p, g in zip(params, grads) if g is not None]


def gather_linears(x: torch.Tensor, tp: TensorParallel, linears) -> tuple[torch.Tensor, ...]:
    """``(gather(x) W^T + b for each (W, b) of linears)`` with sequence parallelism (:class:`_GatherLinears`)."""
    flat = [t for wb in linears for t in wb]
    out = _GatherLinears.apply(x, tp.group, tp.size, *flat)
    return out if isinstance(out, tuple) else (out,)


class _SeqExchange(torch.autograd.Function):
    """Sequence parallel, one exchange and its transpose. ``gather`` False (after a row-parallel
    linear): reduce-scatter of the partial sums over the sequence forward, all-gather of the gradient
    backward (Megatron-LM's ``reduce_scatter_to_sequence_parallel_region``); True: all-gather
    forward, reduce-scatter of the gradient backward (``gather_from_sequence_parallel_region``)."""

    @staticmethod
    def forward(ctx, x, group, size, gather=False):
        ctx.group, ctx.size, ctx.gather = group, size, gather
        return (_all_gather_seq if gather else _reduce_scatter_seq)(x, group, size)

    @staticmethod
    def backward(ctx, g):
        return (_reduce_scatter_seq if ctx.gather else _all_gather_seq)(g, ctx.group, ctx.size), None, None, None


def gather_seq(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """The whole sequence from each rank's 1/T (its gradient reduce-scattered back): :class:`_SeqExchange`."""
    return _SeqExchange.apply(x, tp.group, tp.size, True)


def copy(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """The input of column-parallel layers without sequence parallelism (Megatron's f; with it,
    :func:`gather_linears` gathers the input)."""
    return _Copy.apply(x, tp.group) if tp.on else x


def reduce(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """The sum of the ranks' partial outputs: whole on every rank (``reduce``, Megatron's g), or
    with sequence parallelism each rank's slice of the sequence."""
    if not tp.on:
        return x
    return _SeqExchange.apply(x, tp.group, tp.size) if tp.sequence else _Reduce.apply(x, tp.group)


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
        if self.tp.sequence:
            return gather_linears(x, self.tp, [(self.weight, self.bias)])[0]
        return Fn.linear(copy(x, self.tp), self.weight, self.bias)


class RowParallelLinear(nn.Linear):
    """``nn.Linear(n_in / T, n_out)``: this rank's input columns, the partial sums all-reduced
    over the TP group; the bias lives on TP rank 0 only (see the module docstring)."""

    def __init__(self, n_in: int, n_out: int, tp: TensorParallel, bias: bool = True):
        super().__init__(n_in // tp.size, n_out, bias=bias and tp.rank == 0)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _DEFER[0] and self.tp.on:        # the partial sum; the caller reduces it (start_reduction)
            return Fn.linear(x, self.weight, self.bias)
        if self.tp.sequence:
            return _LinearScatter.apply(x, self.tp.group, self.tp.size, self.weight, self.bias)
        return reduce(Fn.linear(x, self.weight, self.bias), self.tp)


# ---------------------------------------------------------------------------- the async form
# An overlapped F&B pair (executor.overlap) cuts a dense TP block at its row-parallel reductions:
# the segment before a cut computes the partial sum (deferred_reduction), the reduction runs
# asynchronously across the cut (start_reduction), and the backward's matching collective (with
# sequence parallelism the all-gather of the gradient's slice, start_gather_grad; without it the
# reduction's backward is the identity) runs across the cut the other way.
_DEFER = [0]


@contextlib.contextmanager
def deferred_reduction():
    """Inside: every :class:`RowParallelLinear` with T > 1 returns its rank's partial sum
    ``x W_t^T (+ b on TP rank 0)``, unreduced (the caller reduces it: :func:`start_reduction`)."""
    _DEFER[0] += 1
    try:
        yield
    finally:
        _DEFER[0] -= 1


class CollectiveHandle:
    """A TP collective in flight: ``wait()`` gives its result."""

    def __init__(self, work, result):
        self.work, self.result = work, result

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
        return self.result()


def start_reduction(partial: torch.Tensor, tp: TensorParallel) -> CollectiveHandle:
    """The sum over the TP group of the ranks' partial sums ``partial`` [b, s, h], started
    asynchronously: the whole sum (all-reduce), or with sequence parallelism this rank's slice of
    the sequence (reduce-scatter) -- what :func:`reduce` computes, blocking."""
    if tp.sequence:
        parts = [c.contiguous() for c in partial.chunk(tp.size, 1)]
        out = torch.empty_like(parts[0])
        work = dist.reduce_scatter(out, parts, group=tp.group, async_op=True)
        return CollectiveHandle(work, lambda: out)
    y = partial.contiguous().clone()
    work = dist.all_reduce(y, group=tp.group, async_op=True)
    return CollectiveHandle(work, lambda: y)


def start_gather_grad(g: torch.Tensor, tp: TensorParallel) -> CollectiveHandle | None:
    """The backward of :func:`start_reduction` for the gradient ``g`` of its result: with sequence
    parallelism the all-gather of the slices (started asynchronously), else None (the identity:
    the gradient of an all-reduce's input is its output's)."""
    if not tp.sequence:
        return None
    parts = [torch.empty_like(g, memory_format=torch.contiguous_format) for _ in range(tp.size)]
    work = dist.all_gather(parts, g.contiguous(), group=tp.group, async_op=True)
    return CollectiveHandle(work, lambda: torch.cat(parts, 1))
