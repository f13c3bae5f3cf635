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
:func:`executor.llama.rotary` keeps nothing); the attention is PyTorch's fused causal kernel. Where
d_v differs from d_n + d_r: ``scaled_dot_product_attention`` takes the two head sizes only on its
unfused (math) path, which keeps the a s^2 probabilities (torch 2.13, CPU: its flash path refuses,
"Flash attention requires q,k,v to have the same last dimension"); so on the CPU
:class:`_LatentCore` runs the flash kernel on zero-padded heads (the scores, with the scale
1/sqrt(d_n + d_r), and the values unchanged; what Hugging Face's DeepSeek-V3 does for
FlashAttention-2) and keeps what a kernel with two head sizes keeps (FlashMLA; Megatron-LM's MLA
hands its core attention q, k and v unpadded): q, k, v at their own widths, the row statistics and
the output (which is the output projection's input), as the ledger counts them
(:func:`cost_models.transformer._attention_split_bytes`); off the CPU the padded tensors are kept.

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
from .tensor_parallel import SINGLE, RowParallelLinear, TensorParallel, gather_linears, gather_seq


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
            k_r = gather_seq(k_r, tp)
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
        d_qk = d_n + d_r
        if d_qk != d_v and q.device.type == "cpu":     # FlashMLA's kept tensors on the CPU's flash kernel
            return self.proj(_LatentCore.apply(q.contiguous(), k.contiguous(), v.contiguous(), d_qk ** -0.5))
        width = max(d_qk, d_v)
        if d_qk != d_v:     # one head size for the fused kernel: zero-padded (the scores and values unchanged)
            q, k = (Fn.pad(t, (0, width - d_qk)) for t in (q, k))
            v = Fn.pad(v, (0, width - d_v))
        y = Fn.scaled_dot_product_attention(q, k, v.contiguous(), is_causal=True, scale=d_qk ** -0.5)[..., :d_v]
        return self.proj(y.transpose(1, 2).reshape(b, s, a * d_v))


_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_flash_cpu_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


class _LatentCore(torch.autograd.Function):
    """Causal attention with value heads (d_v) narrower or wider than the query/key heads (d_qk)
    on PyTorch's CPU flash kernel, which takes one head size: it runs on the narrower of q/k and v
    zero-padded to the wider (the scores and the values unchanged; the output's padded columns are
    exactly 0), and keeps what a kernel with two head sizes keeps (FlashMLA; Megatron-LM's MLA passes
    q, k of d_qk and v of d_v to its core attention unpadded): q, k (a d_qk each), v (a d_v), the
    fp32 row statistics (a) and the output (a d_v, returned as the output projection's input
    [b, s, a d_v], one storage with it). B pads v and the output again (transient) for the kernel's
    backward and cuts the padding off the gradients."""

    @staticmethod
    def forward(ctx, q, k, v, scale):
        b, a, s, d_qk = q.shape
        d_v = v.shape[-1]
        width = max(d_qk, d_v)
        out, lse = _flash_cpu(*_pad_to(width, q, k, v), 0.0, True, scale=scale)
        y = out[..., :d_v].transpose(1, 2).reshape(b, s, a * d_v)
        ctx.scale = scale
        ctx.save_for_backward(q, k, v, y, lse)
        return y

    @staticmethod
    def backward(ctx, g):
        q, k, v, y, lse = ctx.saved_tensors
        b, a, s, d_qk = q.shape
        d_v = v.shape[-1]
        width = max(d_qk, d_v)
        heads = lambda t: t.view(b, s, a, d_v).transpose(1, 2)      # noqa: E731
        qp, kp, vp, yp, gp = _pad_to(width, q, k, v, heads(y), heads(g))
        gq, gk, gv = _flash_cpu_backward(gp.contiguous(), qp, kp, vp, yp.contiguous(), lse, 0.0, True,
                                         scale=ctx.scale)
        return gq[..., :d_qk], gk[..., :d_qk], gv[..., :d_v], None


def _pad_to(width: int, *ts: torch.Tensor) -> list[torch.Tensor]:
    """Each tensor's last dimension zero-padded to ``width`` (unchanged where it is that wide)."""
    return [t if t.shape[-1] == width else Fn.pad(t, (0, width - t.shape[-1])) for t in ts]
