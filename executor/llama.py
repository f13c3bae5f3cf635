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

What the block keeps for its backward is what the fused kernels of Megatron-LM / Transformer Engine
keep, and what the simulator's ledger counts (:func:`cost_models.transformer.block_activation_bytes`):
the RMS norm keeps its input and one statistic per token (:class:`RMSNorm`; eager ``nn.RMSNorm``
would also keep the normalised input), rotary keeps nothing (:func:`rotary`; eager, its cos and sin
tables), SwiGLU keeps gate and up (:func:`swiglu`; eager, also silu(gate)), and attention keeps the
key/value heads unrepeated (``enable_gqa``, PyTorch >= 2.5; before, the repeated heads). With
context parallelism the rotary angles are those of the CP rank's positions and the attention is
:func:`executor.context_parallel.attention` (GQA without repeating K/V). Each is an
autograd function whose backward recomputes the cheap element-wise part: the same gradients.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as Fn

from cost_models.model_spec import ModelSpec

from .context_parallel import SINGLE as NO_CP, ContextParallel, attention as context_attention
from .tensor_parallel import SINGLE, RowParallelLinear, TensorParallel, copy, gather_linears

ROPE_THETA = 10000.0


def _cos_sin(s: int, d: int, like: torch.Tensor, positions: torch.Tensor | None = None) -> tuple[torch.Tensor,
                                                                                                 torch.Tensor]:
    inv = 1.0 / (ROPE_THETA ** (torch.arange(0, d, 2, device=like.device, dtype=torch.float32) / d))
    pos = torch.arange(s, device=like.device) if positions is None else positions
    ang = torch.outer(pos.to(torch.float32), inv)
    ang = torch.cat([ang, ang], -1)
    return ang.cos().to(like.dtype), ang.sin().to(like.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: int) -> torch.Tensor:
    """x cos + sign * rot(x) sin, rot(x) = [-x2, x1]: sign 1 rotates, sign -1 is its transpose."""
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1] if sign > 0 else [x2, -x1], -1) * sin


class _Rotary(torch.autograd.Function):
    """Rotary embedding that keeps nothing for its backward (the rotation's transpose, the tables
    made again; a context-parallel rank's positions are held as a plain attribute, s/C integers)."""

    @staticmethod
    def forward(ctx, x, positions):
        ctx.positions = positions
        cos, sin = _cos_sin(x.shape[-2], x.shape[-1], x, positions)
        return _rotate(x, cos, sin, 1)

    @staticmethod
    def backward(ctx, g):
        cos, sin = _cos_sin(g.shape[-2], g.shape[-1], g, ctx.positions)
        return _rotate(g, cos, sin, -1), None


def rotary(x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Rotary position embedding of ``x`` [b, heads, s, d] (half-split pairs, as Hugging Face's
    Llama) at ``positions`` (default 0..s-1: a context-parallel rank's are its chunks')."""
    return _Rotary.apply(x, positions)


class _SwiGLU(torch.autograd.Function):
    """silu(gate) * up, keeping gate and up (silu and its derivative made again in the backward)."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return Fn.silu(gate) * up

    @staticmethod
    def backward(ctx, g):
        gate, up = ctx.saved_tensors
        sig = torch.sigmoid(gate)
        return g * up * (sig * (1 + gate * (1 - sig))), g * (gate * sig)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return _SwiGLU.apply(gate, up)


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in fp32 when narrower (bf16, fp16), else as it is."""
    return t.float() if t.element_size() < 4 else t


class _RMSNormFn(torch.autograd.Function):
    """y = x / rms(x) * w over the last dimension (in fp32 at least), keeping x and 1/rms; the
    weight's gradient comes with the input's (a norm: :mod:`executor.backward` runs it in B)."""

    norm = True

    @staticmethod
    def forward(ctx, x, weight, eps):
        xf = _wide(x)
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (xf * rstd * _wide(weight)).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        x, weight, rstd = ctx.saved_tensors
        xhat = _wide(x) * rstd
        gf = _wide(g)
        gw = gf * _wide(weight)
        gx = rstd * (gw - xhat * (gw * xhat).mean(-1, keepdim=True))
        dw = (gf * xhat).reshape(-1, x.shape[-1]).sum(0) if ctx.needs_input_grad[1] else None
        return gx.to(x.dtype), None if dw is None else dw.to(weight.dtype), None


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` (same parameter, same numbers) that keeps only its input and 1/rms."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps     # nn.RMSNorm's default
        return _RMSNormFn.apply(x, self.weight, eps)


_GQA = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 5)   # SDPA's enable_gqa


class GroupedQueryAttention(nn.Module):
    def __init__(self, spec: ModelSpec, tp: TensorParallel = SINGLE, cp: ContextParallel = NO_CP):
        super().__init__()
        self.tp, self.cp = tp, cp
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
        group = self.heads // self.kv_heads
        if self.cp.on:      # this CP rank's s/C tokens at their positions, over every rank's keys
            pos = self.cp.positions(s * self.cp.size, q.device)
            y = context_attention(rotary(q, pos), rotary(k, pos), v, self.cp)
            return self.proj(y.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))
        q, k = rotary(q), rotary(k)
        if group > 1 and _GQA:
            y = Fn.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
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
        return self.down(swiglu(gate, up))


class LlamaBlock(nn.Module):
    """Pre-norm block: x + attn(rms1(x)), then x + mlp(rms2(x)). ``attn`` and ``mlp`` default to
    grouped-query attention and the dense SwiGLU; :func:`executor.model.block` gives multi-head
    latent attention (:class:`executor.mla.LatentAttention`) and the mixture-of-experts MLP
    (:class:`executor.moe.MoeMLP`) where the spec has them."""

    def __init__(self, spec: ModelSpec, tp: TensorParallel = SINGLE, cp: ContextParallel = NO_CP,
                 attn: nn.Module | None = None, mlp: nn.Module | None = None):
        super().__init__()
        self.ln1 = RMSNorm(spec.hidden, eps=1e-5)
        self.attn = attn if attn is not None else GroupedQueryAttention(spec, tp, cp)
        self.ln2 = RMSNorm(spec.hidden, eps=1e-5)
        self.mlp = mlp if mlp is not None else SwiGLU(spec, tp)

    @property
    def aux_value(self):
        """alpha * the load-balancing loss of the last forward (detached; None: a dense MLP or alpha 0)."""
        return getattr(self.mlp, "aux_value", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))
