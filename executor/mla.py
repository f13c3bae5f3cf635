"""Multi-head latent attention (DeepSeek-V2 and V3), as the executor's Llama block builds it for a
spec with ``kv_lora_rank`` > 0 (:class:`cost_models.model_spec.ModelSpec`).

With a heads, d_n = ``head_size`` (the non-rotary part of a query/key head), d_r = ``rope_head_dim``
(the decoupled rotary part), d_v = ``v_head_size``, r_q = ``q_lora_rank``, r_kv = ``kv_lora_rank``::

    queries   q = q_b(rms(q_a(x)))     q_a: h -> r_q, q_b: r_q -> a (d_n + d_r)   (r_q > 0)
              q = q(x)                 q: h -> a (d_n + d_r)                       (r_q = 0)
    latent    [c, k_r] = kv_a(x)       kv_a: h -> r_kv + d_r (the rotary key part, one for all heads)
    keys      [k_n, v] = kv_b(rms(c))  kv_b: r_kv -> a (d_n + d_v)
    heads     q_i = [q_n,i, rope(q_r,i)],  k_i = [k_n,i, rope(k_r)]  (k_r shared over the heads)
    output    proj(softmax(q_i k_i^T / sqrt(d_n + d_r), causal) v_i),  proj: a d_v -> h

Parameter names: ``attn.q_a / q_norm / q_b`` (or ``attn.q``), ``attn.kv_a / kv_norm / kv_b``,
``attn.proj`` (its init scaled as every residual output projection's). The norms and rotary
positions are the Llama block's (:class:`executor.llama.RMSNorm` keeps its input and 1/rms,
:func:`executor.llama.rotary` keeps nothing); the attention is PyTorch's fused causal kernel, which
takes one head size: where d_v differs from d_n + d_r the narrower of queries/keys and values are
zero-padded to the wider (the scores, with the scale 1/sqrt(d_n + d_r), and the values unchanged;
what Hugging Face's DeepSeek-V3 does for FlashAttention-2). The padding is kept from F to B where
the ledger (:func:`cost_models.transformer._attention_split_bytes`) counts d_v wide values and
outputs, as a kernel with two head sizes (FlashMLA) keeps them. Without it PyTorch falls back to
its unfused attention, under which the selective recomputation (:mod:`executor.recompute`, whose
op list holds that path's bmm) gave losses 3e-5 off the reference's at the second step (not traced
further).

Tensor parallelism (with sequence parallelism, which a run at T > 1 has: :mod:`executor.config`), as
Megatron-LM's ``MLASelfAttention``: the down-projections ``q_a`` and ``kv_a`` and the norms are
replicated and run on the rank's 1/T of the sequence (the latents kept are 1/T of the sequence;
their weight gradients, each rank's tokens', are summed over the TP group at OPTIM as a norm's,
:func:`executor.tensor_parallel.sequence_partial`); the up-projections ``q_b`` and ``kv_b`` (or
``q``) are column-parallel over the heads (rank t its a/T heads), their input gathered over the
sequence (:func:`executor.tensor_parallel.gather_linears`: the latent slice kept, gathered again in
the backward); the rotary key part ``k_r``, one for all heads, is all-gathered (its gradient, each
rank's heads' part, reduce-scattered); ``proj`` is row-parallel (reduce-scattered over the
sequence). Not split over context-parallel ranks (the run refuses --cp with it).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as Fn

from cost_models.model_spec import ModelSpec

from .llama import RMSNorm, rotary
from .tensor_parallel import SINGLE, RowParallelLinear, TensorParallel, _all_gather_seq, _reduce_scatter_seq, \
    gather_linears


class _GatherSeq(torch.autograd.Function):
    """Sequence parallel: all-gather over the sequence forward, reduce-scatter of the gradient backward
    (Megatron-LM's ``gather_from_sequence_parallel_region``)."""

    @staticmethod
    def forward(ctx, x, group, size):
        ctx.group, ctx.size = group, size
        return _all_gather_seq(x, group, size)

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter_seq(g, ctx.group, ctx.size), None, None


class LatentAttention(nn.Module):
    def __init__(self, spec: ModelSpec, tp: TensorParallel = SINGLE):
        super().__init__()
        self.tp = tp
        h, a = spec.hidden, spec.heads // tp.size      # this rank's heads
        self.heads, self.d_n, self.d_r, self.d_v = a, spec.head_dim, spec.rope_head_dim, spec.v_head_dim
        self.r_kv = spec.kv_lora_rank
        d_qk = self.d_n + self.d_r
        if spec.q_lora_rank:
            self.q_a = nn.Linear(h, spec.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(spec.q_lora_rank, eps=1e-6)
            self.q_b = nn.Linear(spec.q_lora_rank, a * d_qk, bias=False)
        else:
            self.q = nn.Linear(h, a * d_qk, bias=False)
        self.kv_a = nn.Linear(h, self.r_kv + self.d_r, bias=False)
        self.kv_norm = RMSNorm(self.r_kv, eps=1e-6)
        self.kv_b = nn.Linear(self.r_kv, a * (self.d_n + self.d_v), bias=False)
        self.proj = RowParallelLinear(spec.heads * self.d_v, h, tp, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, d_n, d_r, d_v = self.heads, self.d_n, self.d_r, self.d_v
        c, k_r = self.kv_a(x).split([self.r_kv, d_r], dim=-1)
        if self.tp.on:      # x is the rank's 1/T of the sequence (module docstring)
            tp = self.tp
            q = gather_linears(self.q_norm(self.q_a(x)), tp, [(self.q_b.weight, None)])[0] if hasattr(self, "q_a") \
                else gather_linears(x, tp, [(self.q.weight, None)])[0]
            kv = gather_linears(self.kv_norm(c), tp, [(self.kv_b.weight, None)])[0]
            k_r = _GatherSeq.apply(k_r, tp.group, tp.size)
        else:
            q = self.q_b(self.q_norm(self.q_a(x))) if hasattr(self, "q_a") else self.q(x)
            kv = self.kv_b(self.kv_norm(c))
        b, s, _ = q.shape
        q = q.view(b, s, a, d_n + d_r).transpose(1, 2)
        kv = kv.view(b, s, a, d_n + d_v).transpose(1, 2)
        k_n, v = kv.split([d_n, d_v], dim=-1)
        q_n, q_r = q.split([d_n, d_r], dim=-1)
        if d_r:
            q_r = rotary(q_r.contiguous())
            k_r = rotary(k_r.reshape(b, 1, s, d_r)).expand(b, a, s, d_r)
            q = torch.cat([q_n, q_r], -1)
            k = torch.cat([k_n, k_r], -1)
        else:
            q, k = q_n, k_n
        d_qk, width = d_n + d_r, max(d_n + d_r, d_v)
        if d_qk != d_v:     # one head size for the fused kernel: zero-padded (the scores and values unchanged)
            q, k = (Fn.pad(t, (0, width - d_qk)) for t in (q, k))
            v = Fn.pad(v, (0, width - d_v))
        y = Fn.scaled_dot_product_attention(q, k, v.contiguous(), is_causal=True, scale=d_qk ** -0.5)[..., :d_v]
        return self.proj(y.transpose(1, 2).reshape(b, s, a * d_v))
