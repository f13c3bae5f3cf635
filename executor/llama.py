"""The executor's Llama-family block: RMSNorm, grouped-query attention with rotary positions,
a SwiGLU MLP, no biases (but Q/K/V's with ``spec.qkv_bias``), as Llama 2/3, Mistral and Qwen2 build
it; :mod:`executor.model` assembles it into stages like the GPT block (token embedding without
positions, a final RMSNorm and an untied head).

With tensor parallelism (:mod:`executor.tensor_parallel`) the query heads and the key/value heads
are split over the TP group (T divides both: query head i of rank t uses its rank's key/value head
``i // (heads / kv_heads)``, the same pairing as the whole model's), gate and up are column-parallel,
proj and down row-parallel. The normalised input is handed to Q, K, V (and to gate, up) through one
``copy``, so its gradient is all-reduced once per sub-layer (with sequence parallelism: gathered
once, :func:`executor.tensor_parallel.gather_linears`; rotary positions are those of the whole sequence).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as Fn

from cost_models.model_spec import ModelSpec

from .tensor_parallel import SINGLE, RowParallelLinear, TensorParallel, copy, gather_linears

ROPE_THETA = 10000.0


def rotary(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of ``x`` [b, heads, s, d] (half-split pairs, as Hugging Face's Llama)."""
    d, s = x.shape[-1], x.shape[-2]
    inv = 1.0 / (ROPE_THETA ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = torch.outer(torch.arange(s, device=x.device, dtype=torch.float32), inv)
    cos, sin = torch.cat([ang, ang], -1).cos().to(x.dtype), torch.cat([ang, ang], -1).sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class GroupedQueryAttention(nn.Module):
    def __init__(self, spec: ModelSpec, tp: TensorParallel = SINGLE):
        super().__init__()
        self.tp = tp
        self.head_dim = spec.hidden // spec.heads
        self.heads, self.kv_heads = spec.heads // tp.size, spec.kv // tp.size
        self.q = nn.Linear(spec.hidden, self.heads * self.head_dim, bias=spec.qkv_bias)
        self.k = nn.Linear(spec.hidden, self.kv_heads * self.head_dim, bias=spec.qkv_bias)
        self.v = nn.Linear(spec.hidden, self.kv_heads * self.head_dim, bias=spec.qkv_bias)
        self.proj = RowParallelLinear(spec.hidden, spec.hidden, tp, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.sequence:     # the whole sequence, gathered from the ranks' slices
            q, k, v = gather_linears(x, self.tp, [(m.weight, m.bias) for m in (self.q, self.k, self.v)])
        else:
            x = copy(x, self.tp)
            q, k, v = self.q(x), self.k(x), self.v(x)
        b, s, _ = q.shape
        q = q.view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotary(q), rotary(k)
        group = self.heads // self.kv_heads
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        y = Fn.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class SwiGLU(nn.Module):
    def __init__(self, spec: ModelSpec, tp: TensorParallel = SINGLE):
        super().__init__()
        self.tp = tp
        self.gate = nn.Linear(spec.hidden, spec.ffn // tp.size, bias=False)
        self.up = nn.Linear(spec.hidden, spec.ffn // tp.size, bias=False)
        self.down = RowParallelLinear(spec.ffn, spec.hidden, tp, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.sequence:
            gate, up = gather_linears(x, self.tp, [(self.gate.weight, None), (self.up.weight, None)])
        else:
            x = copy(x, self.tp)
            gate, up = self.gate(x), self.up(x)
        return self.down(Fn.silu(gate) * up)


class LlamaBlock(nn.Module):
    """Pre-norm block: x + attn(rms1(x)), then x + mlp(rms2(x))."""

    def __init__(self, spec: ModelSpec, tp: TensorParallel = SINGLE):
        super().__init__()
        self.ln1 = nn.RMSNorm(spec.hidden, eps=1e-5)
        self.attn = GroupedQueryAttention(spec, tp)
        self.ln2 = nn.RMSNorm(spec.hidden, eps=1e-5)
        self.mlp = SwiGLU(spec, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))
