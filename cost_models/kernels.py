"""GPU op costs from kernel shapes: the micro-batch-dependent cost model (``--cost-model kernels``).

The linear model (:class:`cost_models.TransformerCostModel` with ``compute="linear"``) charges
FLOPs / (peak x efficiency): a sample costs the same at micro-batch 1 and 64. A real GPU does not:
at small micro-batches the GEMMs leave SMs idle and the framework's per-op overhead dominates;
measured on a V100 (Chimera's profiles, ``cost_models/presets/measurements/chimera-v100``) one
BERT-large layer costs 4.2x less per sample at batch 64 than at batch 1. This module prices every
kernel a layer launches:

**GEMM** ``C[m x n] = A[m x k] B[k x n]`` (``batch`` independent products for batched matmuls).
The library runs it as output tiles of ``tm x tn`` (one thread block each), one tile per SM at a
time, so a GEMM of ``T = batch * ceil(m / tm) * ceil(n / tn)`` tiles takes ``waves =
ceil(T / sms)`` rounds (tile and wave quantisation). A tile of depth k does ``2 tm tn k`` FLOPs at
the SM's share of the peak times the tile's efficiency::

    e(tile) = gemm_efficiency * I / (I + tile_intensity),   I = tm tn / (tm + tn)

(``I`` is the tile's FLOPs per operand element loaded: small tiles re-read their operands more
often and reach less of the peak). With split-K ``p`` (for GEMMs with few tiles and a deep k) the
tiles multiply by p, each does k / p, and the p partial results are summed (an extra pass over
``p m n`` fp32 elements). The GEMM cannot be faster than moving its operands once::

    t_compute = waves * 2 tm tn (k / p) / (peak / sms * e(tile))
    t_memory  = bytes(A + B + C) / (memory_bandwidth * memory_efficiency)
    t_gemm    = kernel_latency + max(t_compute, t_memory)      minimised over tiles and p

as the library's heuristic picks the fastest kernel. Tiles: :data:`TILES`; p in 1, 2, 4, 8, 16.

**Attention** is priced as the batched GEMMs it is made of (eager attention: ``QK^T`` and ``PV``
over ``batch x heads`` products, plus the element-wise passes over the ``b a s^2`` scores), or as
one fused kernel (``gpt``: ``scaled_dot_product_attention``) of ``4 b s^2 h`` FLOPs at the GEMM
efficiency of its tiles, reading Q, K, V and writing the output once; causal, it skips the key
blocks above the diagonal, ``(n + 1) / (2 n)`` of the square for ``n = s / 128`` query blocks
(:func:`causal_share`: a decoder's flash kernel does about half the work the formulas count).

**Element-wise and reduction kernels** (bias, GeLU, dropout, softmax, layer norm, residual adds,
copies of permuted views, gradient accumulation) are memory-bound::

    t = kernel_latency + bytes / (memory_bandwidth * memory_efficiency)

**Launch overhead.** An eager framework issues the kernels one by one from the host. Issuing a
kernel costs the host ``dispatch_forward`` seconds in the forward (the ATen dispatch and the
launch) plus ``module_overhead`` for every ``nn.Module`` call that leads to it (Python: the
module's ``__call__``, its hooks, its ``forward``), and ``dispatch_backward`` per kernel in the
backward (the autograd engine, no Python). A kernel starts when it has been issued and the previous
one has finished. A pass of kernels of host times h_i and GPU times g_i repeated back to back (the
layers of a stage) costs per pass, in the long run::

    t_pass = max(sum_i h_i, sum_i g_i)

(:func:`stream_time` with ``repeats=None``); :func:`stream_time` with a repeat count simulates the
queue exactly (what a benchmark that times a few passes sees). The constants (``sms`` from the
datasheet; the efficiencies, the latency and the host times fitted to measurements) are the
``kernels:`` block of a device preset (:class:`GpuConstants`); ``pipetwin reproduce cost-curves``
fits them and reports the error on held-out files.

Layers priced here: transformer blocks of five families (:data:`ARCHS`: ``bert`` = Hugging Face
BertLayer, ``gpt`` = Megatron-LM's pre-norm GPT layer, ``opt`` = OPT decoder layer, ``t5`` = T5
encoder block, ``llama``; each a :class:`Family`, its slots in forward order: norms, the
attention's projections and core, the MLP, dropouts, residuals, in :data:`FAMILIES`), the
embedding lookup and the output head with its loss (:func:`transformer_layer_times`); the planner
builds its CNN/RNN layers from :func:`gemm`, :func:`conv2d` and :func:`memory`
(:mod:`cost_models.workloads.paper_kernels`). Phases: ``F`` forward, ``B`` input gradient (with
the element-wise backward), ``W`` weight gradient (GEMMs, bias reductions, gradient accumulation):
B + W is the full backward, and the split is what zero-bubble schedules use.

The ``gpt`` block launches what Megatron-LM launches: a fused bias-GeLU; with dropout (the model's
``dropout``, whose 1-byte masks the memory ledger counts) a fused bias-dropout-add closing each
sub-block (it writes the mask; its backward passes the gradient through it) and, with eager
attention, a dropout on the attention probabilities (read, write, mask; the same backward);
gradient-accumulation fusion: each weight-gradient GEMM adds into the fp32 main gradient (its result
read and written in fp32), the bias and LayerNorm-parameter gradients are reduced in B, so W is the
four weight-gradient GEMMs alone, what Zero Bubble's W pass defers. Megatron-LM's code before that
fusion, at its default settings (``grad_accumulation="autograd"``), let autograd add each GEMM's
16-bit gradient into the parameter's 16-bit ``.grad`` (3 x 2 bytes per parameter, in W).

**fp8** (``precision="fp8"``, :mod:`cost_models.fp8`): a block's linear layers run their three GEMMs
on 1-byte operands (a 16-bit result) at the device's fp8 peak (``Kernel.fp8``,
``DeviceRates.peak_fp8``), each after a memory-bound quantize kernel (its input in F, its output
gradient in B; bytes by the scaling recipe, :func:`cost_models.fp8.quantize_bytes`); the attention
core, the norms, the embedding and the head stay at the 16-bit peak.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import TYPE_CHECKING, Iterable, Sequence

from ._spec import SpecError
from .fp8 import DEFAULT_RECIPE, check_recipe, linear_cast_bytes

if TYPE_CHECKING:  # pragma: no cover
    from .device import DeviceSpec
    from .model_spec import ModelSpec

TILES: tuple[tuple[int, int], ...] = ((256, 128), (128, 256), (128, 128), (128, 64), (64, 128), (64, 64),
                                      (64, 32), (32, 64), (32, 32))
SPLIT_K = (1, 2, 4, 8, 16)
# ARCHS, TP_ARCHS, CONTAINERS: from the block families (FAMILIES, below)
PHASES = ("F", "B", "W")
COST_MODELS = ("kernels", "linear")
# how Megatron-LM's gpt block accumulates weight gradients over micro-batches: ``fused`` (gradient-
# accumulation fusion: the weight-gradient GEMM adds into the fp32 main gradient) or ``autograd``
# (its code before that fusion, with its defaults: the GEMM writes a 16-bit gradient that autograd
# adds into the parameter's 16-bit ``.grad``)
GRAD_ACCUMULATION = ("fused", "autograd")


@dataclass(frozen=True)
class GpuConstants:
    """The constants of the kernel model for one device (the ``kernels:`` block of a device preset).

    sms: streaming multiprocessors (datasheet). gemm_efficiency: fraction of the peak an SM reaches
    on GEMM tiles of unbounded intensity (the asymptote of ``e(tile)``). tile_intensity: FLOPs per
    loaded operand element at which a tile reaches half of it. memory_efficiency: fraction of the
    memory bandwidth streaming kernels reach. kernel_latency: seconds of GPU time every kernel
    costs on top of its work (launch, ramp-up, tail). dispatch_forward / dispatch_backward: host
    seconds per kernel the framework needs to issue the forward / backward (eager PyTorch);
    module_overhead: host seconds per ``nn.Module`` call in the forward."""

    sms: int
    gemm_efficiency: float
    tile_intensity: float
    memory_efficiency: float
    kernel_latency: float
    dispatch_forward: float
    dispatch_backward: float
    module_overhead: float

    FIELDS = ("sms", "gemm_efficiency", "tile_intensity", "memory_efficiency", "kernel_latency",
              "dispatch_forward", "dispatch_backward", "module_overhead")

    def __post_init__(self):
        for f in self.FIELDS:
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise SpecError(f"kernel constant {f!r} must be a finite number; got {v!r}")
        if not isinstance(self.sms, int) or self.sms < 1:
            raise SpecError(f"kernel constant 'sms' must be a positive integer; got {self.sms!r}")
        for f in ("gemm_efficiency", "memory_efficiency"):
            if not 0 < getattr(self, f) <= 1:
                raise SpecError(f"kernel constant {f!r} must be in (0, 1]; got {getattr(self, f)!r}")
        if self.tile_intensity < 0:
            raise SpecError(f"kernel constant 'tile_intensity' must be >= 0; got {self.tile_intensity!r}")
        for f in ("kernel_latency", "dispatch_forward", "dispatch_backward", "module_overhead"):
            if getattr(self, f) < 0:
                raise SpecError(f"kernel constant {f!r} must be a time >= 0; got {getattr(self, f)!r}")

    def to_dict(self) -> dict:
        return {f: getattr(self, f) for f in self.FIELDS}

    def with_values(self, **kw) -> "GpuConstants":
        return replace(self, **kw)


def constants_from_dict(d, source: str) -> GpuConstants:
    """The ``kernels:`` block of a device YAML (times accept units: ``20 us``)."""
    from . import _spec
    d = _spec.mapping(d, source, "kernels")
    _spec.check_fields(d, source, GpuConstants.FIELDS, GpuConstants.FIELDS, prefix="kernels.")
    vals = {"sms": _spec.integer(d["sms"], source, "kernels.sms")}
    for f in ("gemm_efficiency", "tile_intensity", "memory_efficiency"):
        vals[f] = _spec.number(d[f], source, f"kernels.{f}", allow_zero=f == "tile_intensity")
    for f in ("kernel_latency", "dispatch_forward", "dispatch_backward", "module_overhead"):
        vals[f] = _spec.seconds(d[f], source, f"kernels.{f}")
    try:
        return GpuConstants(**vals)
    except SpecError as e:
        raise SpecError(f"{source}: " + str(e).replace("kernel constant '", "field 'kernels.")) from None


# ---------------------------------------------------------------------------- kernels
@dataclass(frozen=True)
class Kernel:
    """One GPU kernel: a GEMM (``gemm = (batch, m, n, k)``) or a memory-bound kernel moving
    ``bytes``. ``phase``: F, B or W (see the module docstring). ``modules``: nn.Module calls the
    host makes before issuing it (forward only)."""

    name: str
    phase: str
    bytes: float = 0.0
    gemm: tuple[int, int, int, int] | None = None
    flops: float = 0.0          # fused attention: FLOPs priced at the GEMM efficiency of its tiles
    modules: int = 0
    fp8: bool = False           # a GEMM of fp8 operands, at the device's fp8 peak (DeviceRates.peak_fp8)


def gemm(name: str, phase: str, m: int, n: int, k: int, dtype_bytes: int, batch: int = 1, modules: int = 0) -> Kernel:
    """``batch`` products ``[m x k] x [k x n]``; bytes = the operands and the result, read/written once."""
    m, n, k, batch = int(m), int(n), int(k), int(batch)
    return Kernel(name, phase, float(dtype_bytes * batch * (m * k + k * n + m * n)), (batch, m, n, k),
                  modules=modules)


def gemm_fp8(name: str, phase: str, m: int, n: int, k: int, out_bytes: int, modules: int = 0) -> Kernel:
    """An fp8 GEMM ``[m x k] x [k x n]``: 1-byte operands, an ``out_bytes`` result, at the fp8 peak."""
    m, n, k = int(m), int(n), int(k)
    return Kernel(name, phase, float(m * k + k * n + out_bytes * m * n), (1, m, n, k), modules=modules, fp8=True)


def memory(name: str, phase: str, nbytes: float, modules: int = 0) -> Kernel:
    return Kernel(name, phase, float(nbytes), modules=modules)


CAUSAL_BLOCK = 128      # a flash kernel's block of queries and of keys (FlashAttention, cuDNN, TE)


def causal_share(s: int, block: int = CAUSAL_BLOCK) -> float:
    """The share of the s x s scores a causal flash kernel computes: of n = ceil(s / block) query
    blocks, block i visits key blocks 0..i (the ones above the diagonal are skipped), n (n + 1) / 2
    of n^2 blocks: (n + 1) / (2 n) (0.508 at s = 8,192; 1 for one block)."""
    n = -(-s // block)
    return (n + 1) / (2 * n)


def fused_attention(name: str, phase: str, b: int, heads: int, s: int, head_dim: int, dtype_bytes: int,
                    backward: bool = False, causal: bool = True) -> Kernel:
    """One flash-style attention kernel: 4 b s^2 a d FLOPs forward (QK^T and PV), 2.5x that
    backward (recomputing the scores), times :func:`causal_share` for a causal mask (every block
    priced with this kernel is a decoder's: gpt, llama); reads Q, K, V (and dO, O) and writes O (or
    dQ, dK, dV)."""
    flops = 4.0 * b * heads * s * s * head_dim * (2.5 if backward else 1.0) * (causal_share(s) if causal else 1.0)
    tensors = (7 if backward else 4) * b * s * heads * head_dim * dtype_bytes
    return Kernel(name, phase, float(tensors), (b * heads, s, head_dim, s), flops)


def conv2d(name: str, phase: str, batch: int, h_out: int, w_out: int, c_in: int, c_out: int, ksize: int,
           dtype_bytes: int) -> list[Kernel]:
    """A convolution as the implicit GEMM cuDNN runs: forward ``[b h w x c_out]``, depth
    ``c_in k^2``; phase B is the data gradient, W the filter gradient."""
    M, K = batch * h_out * w_out, c_in * ksize * ksize
    if phase == "F":
        return [gemm(name, "F", M, c_out, K, dtype_bytes, modules=1)]
    if phase == "B":
        return [gemm(name + ".dgrad", "B", M, K, c_out, dtype_bytes)]
    return [gemm(name + ".wgrad", "W", c_out, K, M, dtype_bytes)]


# ---------------------------------------------------------------------------- timing
def tile_efficiency(c: GpuConstants, tm: int, tn: int) -> float:
    inten = tm * tn / (tm + tn)
    return c.gemm_efficiency * inten / (inten + c.tile_intensity)


def tile_time(c: GpuConstants, peak: float, bandwidth: float, batch: int, m: int, n: int, k: int, nbytes: float,
              tm: int, tn: int, split: int = 1, scale: float = 1.0) -> float:
    """Seconds of one GEMM run with ``tm x tn`` tiles and split-K ``split`` (no kernel latency):
    ``max(waves * tile work / (SM peak * e(tile)), bytes / bandwidth)`` plus the split-K reduction.
    ``scale`` multiplies the FLOPs (a fused kernel doing more than 2 m n k per product)."""
    tiles = batch * -(-m // tm) * -(-n // tn) * split
    waves = -(-tiles // c.sms)
    bw = bandwidth * c.memory_efficiency
    t = waves * 2.0 * tm * tn * (k / split) * scale / (peak / c.sms * tile_efficiency(c, tm, tn))
    t = max(t, nbytes / bw)
    if split > 1:
        t += (split + 1) * m * n * batch * 4.0 / bw
    return t


def gemm_time(c: GpuConstants, peak: float, bandwidth: float, batch: int, m: int, n: int, k: int,
              nbytes: float, flops: float | None = None) -> tuple[float, tuple[int, int, int]]:
    """(seconds without the kernel latency, (tm, tn, split-K) chosen) for one GEMM: the fastest of
    :data:`TILES` x :data:`SPLIT_K` (split-K only while every split keeps k / p >= 64 and the tiles
    stay within four waves), as the library's heuristic picks (module docstring)."""
    if min(batch, m, n, k) < 1:
        return 0.0, (0, 0, 1)
    scale = 1.0 if flops is None else flops / (2.0 * batch * m * n * k)
    best, arg = math.inf, (0, 0, 1)
    for tm, tn in TILES:
        tiles = batch * -(-m // tm) * -(-n // tn)
        for p in SPLIT_K:
            if p > 1 and (k // p < 64 or tiles * p > 4 * c.sms):
                break
            t = tile_time(c, peak, bandwidth, batch, m, n, k, nbytes, tm, tn, p, scale)
            if t < best:
                best, arg = t, (tm, tn, p)
    return best, arg


def kernel_time(k: Kernel, c: GpuConstants, peak: float, bandwidth: float) -> float:
    """GPU seconds of one kernel: latency + max(compute, memory) for GEMMs, latency + bytes / BW else
    (``peak``: the kernel's own, :meth:`DeviceRates.times`)."""
    if k.gemm is not None:
        t, _ = gemm_time(c, peak, bandwidth, *k.gemm, k.bytes, k.flops or None)
        return c.kernel_latency + t
    return c.kernel_latency + k.bytes / (bandwidth * c.memory_efficiency)


def stream_time(gpu_times: Sequence[float], host_times: Sequence[float], repeats: int | None = None) -> float:
    """Seconds per pass of kernels the host issues in order (kernel i after ``host_times[i]`` more
    seconds of host work), each starting when issued and when the previous one has finished.

    ``repeats=None``: the long-run time per pass of a pass repeated back to back,
    ``max(sum(host_times), sum(gpu_times))``. ``repeats=r``: the queue simulated exactly for r
    passes from an idle start, divided by r."""
    if len(gpu_times) != len(host_times):
        raise ValueError("stream_time: one host time per kernel")
    if repeats is None:
        return max(float(sum(host_times)), float(sum(gpu_times)))
    issue = end = 0.0
    for _ in range(int(repeats)):
        for g, h in zip(gpu_times, host_times):
            issue += h
            end = max(issue, end) + g
    return end / repeats


@dataclass(frozen=True)
class DeviceRates:
    """What the timing needs from a device: kernel constants, peak FLOP/s at the precision, bandwidth.
    At ``fp8`` the GEMMs of fp8 operands (``Kernel.fp8``: the linear layers) run at ``peak_fp8`` and
    every other GEMM (the attention core, the head) at ``peak``, the device's 16-bit peak."""

    constants: GpuConstants
    peak: float
    bandwidth: float
    peak_fp8: float | None = None

    @staticmethod
    def of(device: "DeviceSpec", precision: str, constants: GpuConstants | None = None) -> "DeviceRates":
        c = constants if constants is not None else device.kernels
        if c is None:
            raise SpecError(f"device {device.name!r} has no 'kernels:' constants for the kernel cost model; add "
                            f"them to its YAML (see cost_models/kernels.py) or use --cost-model linear")
        if not device.memory_bandwidth:
            raise SpecError(f"device {device.name!r} needs 'memory_bandwidth' for the kernel cost model")
        if precision == "fp8":      # the 8-bit GEMMs at the fp8 peak, the rest in 16 bits
            sixteen = "bf16" if device.has("bf16") else "fp16"
            return DeviceRates(c, device.peak(sixteen), device.memory_bandwidth, device.peak("fp8"))
        return DeviceRates(c, device.peak(precision), device.memory_bandwidth)

    def peak_of(self, k: Kernel) -> float:
        if k.fp8:
            if self.peak_fp8 is None:
                raise SpecError(f"kernel {k.name!r} is an fp8 GEMM; these rates have no fp8 peak (precision fp8)")
            return self.peak_fp8
        return self.peak

    def times(self, kernels: Iterable[Kernel]) -> list[float]:
        return [kernel_time(k, self.constants, self.peak_of(k), self.bandwidth) for k in kernels]

    def host_times(self, kernels: Iterable[Kernel]) -> list[float]:
        """Host seconds to issue each kernel: dispatch (per phase) + module calls (forward)."""
        c = self.constants
        return [c.dispatch_forward + k.modules * c.module_overhead if k.phase == "F" else c.dispatch_backward
                for k in kernels]

    def phase_time(self, kernels: Sequence[Kernel], phase: str, repeats: int | None = None) -> float:
        ks = [k for k in kernels if k.phase == phase]
        if not ks:
            return 0.0
        return stream_time(self.times(ks), self.host_times(ks), repeats)

    def phases(self, kernels: Sequence[Kernel]) -> tuple[float, float, float]:
        """(F, B, W) seconds, each phase a long-run stream of its own kernels."""
        return tuple(self.phase_time(kernels, p) for p in PHASES)  # type: ignore[return-value]


# ---------------------------------------------------------------------------- transformer blocks
@dataclass(frozen=True)
class BlockShape:
    """One transformer block: ``arch`` (a family of :data:`FAMILIES`), hidden h, heads a, sequence s, MLP width
    ffn, bytes per element, micro-batch b. ``pre_norm`` (opt: the norm before each sub-block) and
    ``dropout`` (masks and their kernels) follow the arch unless given. ``gpt`` and ``llama``
    blocks also take ``kv_heads`` (grouped-query attention), ``attention`` (``flash``: one fused
    kernel; ``eager``: the scores' batched GEMMs and a fused scale-mask-softmax, as Megatron-LM
    runs them) and a tensor-parallel split over ``tp`` GPUs (the GEMMs at 1/t of their width or
    depth, the attention over a/t heads; the norms, residuals and dropouts on the whole sequence,
    or on 1/t of it with ``sp``, sequence parallelism)."""

    arch: str
    hidden: int
    heads: int
    seq: int
    ffn: int
    dtype_bytes: int
    micro_batch: int
    dropout: bool = True
    pre_norm: bool | None = None
    kv_heads: int | None = None
    attention: str = "flash"
    tp: int = 1
    sp: bool = False
    grad_accumulation: str = "fused"
    fp8: str | None = None          # the linear layers' GEMMs in fp8 with this scaling recipe (cost_models.fp8)

    def __post_init__(self):
        if self.fp8 is not None:
            check_recipe(self.fp8)
        fam = FAMILIES.get(self.arch)
        if fam is None:
            raise SpecError(f"unknown block arch {self.arch!r}; choose one of {', '.join(FAMILIES)}")
        if self.grad_accumulation not in GRAD_ACCUMULATION:
            raise SpecError(f"grad_accumulation must be one of {', '.join(GRAD_ACCUMULATION)}; "
                            f"got {self.grad_accumulation!r}")
        if self.grad_accumulation != "fused" and not fam.megatron:
            raise SpecError(f"grad_accumulation {self.grad_accumulation!r} is Megatron-LM's, priced for "
                            f"{' and '.join(a for a, f in FAMILIES.items() if f.megatron)} blocks, not {self.arch}")
        if (self.tp > 1 or self.kv_heads is not None or self.attention != "flash") and not fam.tensor_parallel:
            tps = " and ".join(a for a, f in FAMILIES.items() if f.tensor_parallel)
            raise SpecError(f"tensor parallelism (--tp with --cost-model kernels), kv_heads and eager attention are "
                            f"priced for {tps} blocks, not {self.arch}; use --cost-model linear")
        for f in ("hidden", "heads", "seq", "ffn", "dtype_bytes", "micro_batch"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise SpecError(f"block field {f!r} must be a positive integer; got {v!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads


def _norm(name, phase, kind, n, d, T):
    """Kernels of a norm (``kind``, see :class:`Family`) over n elements (T rows): LayerNorm (and a
    fused RMSNorm) one kernel forward, three backward (input gradient; partial and final gamma/beta
    sums); T5's eager RMSNorm six forward (pow, mean, add eps, rsqrt, scale, weight) and eight backward."""
    small = 4 * T
    if kind == "rmsnorm-eager":
        if phase == "F":
            return [memory(f"{name}.pow", "F", 2 * n * d, modules=1), memory(f"{name}.mean", "F", n * d + small),
                    memory(f"{name}.eps", "F", 2 * small), memory(f"{name}.rsqrt", "F", 2 * small),
                    memory(f"{name}.scale", "F", 2 * n * d + small), memory(f"{name}.weight", "F", 2 * n * d)]
        return [memory(f"{name}.weight.dx", "B", 3 * n * d), memory(f"{name}.scale.dx", "B", 3 * n * d),
                memory(f"{name}.scale.dr", "B", 2 * n * d + small), memory(f"{name}.rsqrt.bwd", "B", 3 * small),
                memory(f"{name}.mean.bwd", "B", n * d + small), memory(f"{name}.pow.bwd", "B", 3 * n * d),
                memory(f"{name}.accum", "B", 3 * n * d),
                memory(f"{name}.weight.dw", "W", 2 * n * d)]
    if phase == "F":
        return [memory(f"{name}", "F", 2 * n * d + 2 * small, modules=1)]
    return [memory(f"{name}.dx", "B", 3 * n * d + 2 * small), memory(f"{name}.dgb", "W", 2 * n * d),
            memory(f"{name}.dgb.sum", "W", small)]


def _linear(name, T, n_out, n_in, d, bias, input_grad=True, megatron=False, fused_accum=False, fp8=None):
    """(forward kernels, backward kernels) of a linear layer over T rows. ``megatron``: the bias
    gradient is reduced in B (Megatron-LM's W is the weight-gradient GEMM alone, what Zero Bubble's
    W pass defers); ``fused_accum`` (its gradient-accumulation fusion): that GEMM adds into the fp32
    main gradient (its result read and written in fp32). ``fp8`` (a recipe of :mod:`cost_models.fp8`):
    the three GEMMs take fp8 operands at the fp8 peak, after a quantize kernel of the input in F and
    of the output gradient in B (:func:`cost_models.fp8.linear_cast_bytes`; the weight's cast is
    per step, in the optimizer's pass)."""
    mm = gemm if fp8 is None else gemm_fp8      # the 16-bit GEMM's dtype_bytes is the fp8 one's result bytes
    fwd = [mm(name, "F", T, n_out, n_in, d, modules=1)]
    bwd = []
    if fp8 is not None:
        cast_f, cast_b = linear_cast_bytes(T, n_out, n_in, fp8, d)
        fwd.insert(0, memory(f"{name}.quantize", "F", cast_f))
        bwd.append(memory(f"{name}.dy.quantize", "B", cast_b))
    if input_grad:
        bwd.append(mm(f"{name}.dx", "B", T, n_in, n_out, d))
    dw = mm(f"{name}.dw", "W", n_out, n_in, T, d)
    if fused_accum:     # the fp32 result read and written instead of a 16-bit one written
        dw = replace(dw, bytes=dw.bytes + (8 - d) * n_out * n_in)
    bwd.append(dw)
    if bias:
        bwd.append(memory(f"{name}.db", "B" if megatron else "W", T * n_out * d + n_out * 4))
    return fwd, bwd


# ---------------------------------------------------------------------------- a block, slot by slot
class _Block:
    """One block's kernels being laid down slot by slot (see :class:`Family`): the forward in order,
    the backward kernels of each forward step, the attention core (what selective recomputation
    re-runs) and the parameter tensors (gradient accumulation), with the sizes the slots share."""

    def __init__(self, sh: BlockShape, fam: "Family", input_grad: bool):
        self.sh, self.fam, self.input_grad = sh, fam, input_grad
        tp, d = sh.tp, sh.dtype_bytes
        self.A, self.Dh = sh.heads // tp, sh.head_dim     # heads on one GPU of the tensor-parallel group
        self.T = sh.micro_batch * sh.seq
        self.Te = self.T // tp if sh.sp else self.T       # rows of the element-wise kernels (sequence parallel: 1/t)
        self.th = self.Te * sh.hidden * d                 # bytes of one [T x h] tensor
        self.n_sc = sh.micro_batch * self.A * sh.seq * sh.seq   # attention score elements
        self.sc = self.n_sc * d
        self.ft = sh.ffn // tp                            # MLP width on one GPU
        self.pre = sh.pre_norm if sh.pre_norm is not None else fam.pre_norm
        self.drop = sh.dropout and fam.module_dropouts    # nn.Dropout modules (1-byte masks)
        self.mdrop = sh.dropout and fam.megatron          # Megatron's: fused bias-dropout-add, attention probs
        self.qkv_dx = input_grad or self.pre              # the Q/K/V inputs need a gradient
        self.fwd: list[Kernel] = []
        self.groups: list[list[Kernel]] = []              # backward kernels of each forward step, in forward order
        self.core: list[Kernel] = []
        self.params: list[int] = []

    def step(self, fwd, bwd, core=False):
        self.fwd.extend(fwd)
        self.groups.append(list(bwd))
        if core:
            self.core.extend(fwd)

    def linear(self, name, n_out, n_in, dx=True):
        fam, sh = self.fam, self.sh
        fw, bw = _linear(name, self.T, n_out, n_in, sh.dtype_bytes, fam.bias, dx, fam.megatron,
                         fam.megatron and sh.grad_accumulation == "fused", sh.fp8)
        self.step(fw, bw)
        self.params.extend([n_out * n_in] + ([n_out] if fam.bias else []))

    def norm(self, name):
        fam, h, d = self.fam, self.sh.hidden, self.sh.dtype_bytes
        bw = _norm(name, "B", fam.norm, self.Te * h, d, self.Te)
        if fam.megatron:    # the fused LayerNorm's gamma/beta gradients come with its input gradient
            bw = [replace(k, phase="B") for k in bw]
        self.step(_norm(name, "F", fam.norm, self.Te * h, d, self.Te), bw)
        self.params.extend([h, h] if fam.norm == "layernorm" else [h])

    def residual(self, name, grad: bool):
        """The residual add closing a sub-block (``grad``: its gradient is summed in B); Megatron's
        fused bias-dropout-add with dropout (writes the 1-byte mask; its backward passes the
        gradient through the mask)."""
        th, te = self.th, self.Te * self.sh.hidden
        if self.mdrop:
            self.step([memory(name, "F", 3 * th + te)],
                      [memory(f"{name}.accum", "B", 3 * th), memory(f"{name}.dropout.bwd", "B", 2 * th + te)])
        else:
            self.step([memory(name, "F", 3 * th)], [memory(f"{name}.accum", "B", 3 * th)] if grad else [])

    def dropout(self, name, nbytes, elems):
        if self.drop:
            self.step([memory(name, "F", 2 * nbytes + elems, modules=1)],
                      [memory(f"{name}.bwd", "B", 2 * nbytes + elems)])

    def kernels(self, accumulate_grads: bool, recompute: str) -> tuple[Kernel, ...]:
        """Forward, then the backward in backward order (B and W interleaved, as autograd runs
        them), the recomputation first, the gradient accumulation last."""
        fwd = list(self.fwd)
        fwd[0] = replace(fwd[0], modules=fwd[0].modules + self.fam.containers)
        back = [k for g in reversed(self.groups) for k in g]
        if recompute == "full":
            back = [replace(k, phase="B", name=k.name + ".re") for k in fwd] + back
        elif recompute == "selective":
            back = [replace(k, phase="B", name=k.name + ".re") for k in self.core] + back
        elif recompute != "none":
            raise SpecError(f"recompute must be one of none, selective, full; got {recompute!r}")
        if self.fam.megatron and self.sh.grad_accumulation == "fused":
            pass            # accumulated inside the weight-gradient GEMMs
        elif accumulate_grads:
            d = self.sh.dtype_bytes
            back += [memory(f"grad.accum{i}", "W", 3 * p * d) for i, p in enumerate(self.params)]
        return tuple(fwd + back)


# the slots: each lays down one part of a block (a no-op where the block's shape has no such part)
def _norm_before(name):
    def norm_before(k: _Block):
        if k.pre:
            k.norm(name)
    return norm_before


def _norm_after(name):
    def norm_after(k: _Block):
        if not k.pre:
            k.norm(name)
    return norm_after


def _qkv_fused(k: _Block):
    """Q, K and V in one GEMM (grouped-query: ``kv`` heads for K and V), split over the TP group."""
    sh = k.sh
    k.linear("qkv", (sh.heads + 2 * sh.kv) * k.Dh // sh.tp, sh.hidden, k.qkv_dx)


def _qkv_separate(k: _Block):
    """Three h x h projections; their three input gradients are summed."""
    if k.qkv_dx:
        k.step([], [memory(f"qkv.dx.sum{i}", "B", 3 * k.th) for i in range(2)])
    for nm in ("q", "k", "v"):
        k.linear(nm, k.sh.hidden, k.sh.hidden, k.qkv_dx)


def _q_scale(k: _Block):
    k.step([memory("q.scale", "F", 2 * k.th)], [memory("q.scale.bwd", "B", 2 * k.th)])


def _rotary(k: _Block):
    """Rotary embeddings on Q and K."""
    qk = k.T * (k.A + k.sh.kv // k.sh.tp) * k.Dh * k.sh.dtype_bytes
    k.step([memory("rotary", "F", 2 * qk)], [memory("rotary.bwd", "B", 2 * qk)], core=True)


def _qk_copies(k: _Block):
    """Permuted views of Q and K copied to contiguous tensors for the batched matmuls."""
    k.step([memory("q.copy", "F", 2 * k.th), memory("k.copy", "F", 2 * k.th)],
           [memory("q.copy.bwd", "B", 2 * k.th), memory("k.copy.bwd", "B", 2 * k.th)], core=True)


def _scores(k: _Block):
    """QK^T over the batch x heads."""
    s, Dh, d, n = k.sh.seq, k.Dh, k.sh.dtype_bytes, k.sh.micro_batch * k.A
    k.step([gemm("qk", "F", s, s, Dh, d, batch=n)],
           [gemm("qk.dq", "B", s, Dh, s, d, batch=n), gemm("qk.dk", "B", s, Dh, s, d, batch=n)], core=True)


def _scale_mask(k: _Block):
    """BERT: the scores scaled, then the attention mask added."""
    k.step([memory("scale", "F", 2 * k.sc)], [memory("scale.bwd", "B", 2 * k.sc)], core=True)
    k.step([memory("mask", "F", 2 * k.sc)], [], core=True)


def _mask_clamp(k: _Block):
    """OPT: the causal mask added, then torch.max(scores, finfo.min), whose backward is where(eq,
    grad / 2, grad) then masked_fill(lt): five passes over the scores (two writing bool masks)."""
    sc, bm, s = k.sc, k.n_sc, k.sh.seq
    k.step([memory("mask", "F", 2 * sc + k.sh.micro_batch * s * s * k.sh.dtype_bytes)], [], core=True)
    k.step([memory("clamp", "F", 2 * sc)],
           [memory("clamp.eq", "B", sc + bm), memory("clamp.half", "B", 2 * sc),
            memory("clamp.where", "B", 3 * sc + bm), memory("clamp.lt", "B", sc + bm),
            memory("clamp.fill", "B", 2 * sc + bm)], core=True)


def _position_bias(k: _Block):
    """T5: a position bias (zeros + mask) added to the scores in place."""
    pb = k.A * k.sh.seq * k.sh.seq * k.sh.dtype_bytes
    k.step([memory("bias.zeros", "F", pb), memory("bias.mask", "F", 2 * pb),
            memory("bias.add", "F", 2 * k.sc + pb)], [], core=True)


def _softmax(k: _Block):
    k.step([memory("softmax", "F", 2 * k.sc)], [memory("softmax.bwd", "B", 3 * k.sc)], core=True)


def _probs_dropout(k: _Block):
    """Dropout on the attention probabilities: a 1-byte mask written, read back in B."""
    if k.drop or k.mdrop:
        k.step([memory("attn.dropout", "F", 2 * k.sc + k.n_sc, modules=1)],
               [memory("attn.dropout.bwd", "B", 2 * k.sc + k.n_sc)], core=True)


def _v_copy(k: _Block):
    k.step([memory("v.copy", "F", 2 * k.th)], [memory("v.copy.bwd", "B", 2 * k.th)], core=True)


def _context(k: _Block):
    """PV over the batch x heads."""
    s, Dh, d, n = k.sh.seq, k.Dh, k.sh.dtype_bytes, k.sh.micro_batch * k.A
    k.step([gemm("pv", "F", s, Dh, s, d, batch=n)],
           [gemm("pv.dp", "B", s, s, Dh, d, batch=n), gemm("pv.dv", "B", s, Dh, s, d, batch=n)], core=True)


def _ctx_copy(k: _Block):
    k.step([memory("ctx.copy", "F", 2 * k.th)], [memory("ctx.copy.bwd", "B", 2 * k.th)], core=True)


def _attention_core(k: _Block):
    """``flash``: one fused kernel; ``eager``: Megatron's QK^T, fused scale-mask-softmax, PV."""
    sh = k.sh
    if sh.attention == "flash":
        b, s, d = sh.micro_batch, sh.seq, sh.dtype_bytes
        k.step([fused_attention("attn", "F", b, k.A, s, k.Dh, d)],
               [fused_attention("attn.bwd", "B", b, k.A, s, k.Dh, d, backward=True)], core=True)
    else:
        for slot in (_scores, _softmax, _probs_dropout, _context):
            slot(k)


def _out_projection(name):
    def out_projection(k: _Block):
        k.linear(name, k.sh.hidden, k.sh.hidden // k.sh.tp)
    return out_projection


def _out_dropout(k: _Block):
    k.dropout("o.dropout", k.th, k.T * k.sh.hidden)


def _residual1(k: _Block):
    k.residual("residual1", k.input_grad or k.pre)


def _mlp_gelu(k: _Block):
    """fc1 and the activation (Megatron's bias-GeLU fused into no module call of its own)."""
    k.linear("fc1", k.ft, k.sh.hidden)
    k.step([memory("act", "F", 2 * k.T * k.ft * k.sh.dtype_bytes, modules=0 if k.fam.megatron else 1)],
           [memory("act.bwd", "B", 3 * k.T * k.ft * k.sh.dtype_bytes)])


def _mlp_swiglu(k: _Block):
    """SwiGLU: gate and up in one GEMM, silu(gate) * up."""
    k.linear("fc1", 2 * k.ft, k.sh.hidden)
    k.step([memory("swiglu", "F", 3 * k.T * k.ft * k.sh.dtype_bytes)],
           [memory("swiglu.bwd", "B", 5 * k.T * k.ft * k.sh.dtype_bytes)])


def _act_dropout(k: _Block):
    k.dropout("act.dropout", k.T * k.sh.ffn * k.sh.dtype_bytes, k.T * k.sh.ffn)


def _fc2(k: _Block):
    k.linear("fc2", k.sh.hidden, k.ft)


def _fc2_dropout(k: _Block):
    k.dropout("fc2.dropout", k.th, k.T * k.sh.hidden)


def _residual2(k: _Block):
    k.residual("residual2", True)


@dataclass(frozen=True)
class Family:
    """A block family: its ``slots`` in forward order (each lays down one part of the block; a new
    kind of attention or MLP is a new slot in a family's list, not a branch in the others) and how
    its parts are made: ``pre_norm`` (unless the shape says), ``norm`` (``layernorm``: one kernel,
    gamma and beta; ``rmsnorm``: one kernel, a weight; ``rmsnorm-eager``: T5's six kernels),
    ``bias`` on the linear layers, ``module_dropouts`` (``nn.Dropout`` modules), ``megatron``
    (Megatron-LM's layer: fused kernels, bias and norm gradients in B, its dropouts, fp32 main
    gradients), ``tensor_parallel`` (priced split over a TP group) and ``containers`` (the block's
    ``nn.Module`` calls that launch no kernel of their own)."""

    slots: tuple
    pre_norm: bool
    norm: str
    bias: bool
    module_dropouts: bool
    megatron: bool
    tensor_parallel: bool
    containers: int


_HF_ATTENTION_OUT = (_v_copy, _context, _ctx_copy, _out_projection("o"), _out_dropout, _residual1, _norm_after("ln1"))
FAMILIES = {
    # Hugging Face BertLayer (containers: BertLayer, BertAttention, BertSelfAttention, BertSelfOutput,
    # BertIntermediate, BertOutput)
    "bert": Family((_norm_before("ln1"), _qkv_separate, _qk_copies, _scores, _scale_mask, _softmax, _probs_dropout,
                    *_HF_ATTENTION_OUT, _norm_before("ln2"), _mlp_gelu, _fc2, _fc2_dropout, _residual2,
                    _norm_after("ln2")),
                   pre_norm=False, norm="layernorm", bias=True, module_dropouts=True, megatron=False,
                   tensor_parallel=False, containers=6),
    # Megatron-LM's pre-norm GPT layer (containers: the executor's Block and CausalSelfAttention)
    "gpt": Family((_norm_before("ln1"), _qkv_fused, _attention_core, _out_projection("proj"), _residual1,
                   _norm_after("ln1"), _norm_before("ln2"), _mlp_gelu, _fc2, _residual2, _norm_after("ln2")),
                  pre_norm=True, norm="layernorm", bias=True, module_dropouts=False, megatron=True,
                  tensor_parallel=True, containers=2),
    # OPT decoder layer (containers: OPTDecoderLayer, OPTAttention)
    "opt": Family((_norm_before("ln1"), _qkv_separate, _q_scale, _qk_copies, _scores, _mask_clamp, _softmax,
                   *_HF_ATTENTION_OUT, _norm_before("ln2"), _mlp_gelu, _fc2, _fc2_dropout, _residual2,
                   _norm_after("ln2")),
                  pre_norm=False, norm="layernorm", bias=True, module_dropouts=True, megatron=False,
                  tensor_parallel=False, containers=2),
    # T5 encoder block (containers: T5Block, T5LayerSelfAttention, T5Attention, T5LayerFF, T5DenseActDense)
    "t5": Family((_norm_before("ln1"), _qkv_separate, _qk_copies, _scores, _position_bias, _softmax, _probs_dropout,
                  *_HF_ATTENTION_OUT, _norm_before("ln2"), _mlp_gelu, _act_dropout, _fc2, _fc2_dropout, _residual2,
                  _norm_after("ln2")),
                 pre_norm=True, norm="rmsnorm-eager", bias=False, module_dropouts=True, megatron=False,
                 tensor_parallel=False, containers=5),
    # Llama decoder layer: RMSNorm, rotary embeddings, SwiGLU, no biases, no dropout (containers: the
    # executor's Block and CausalSelfAttention)
    "llama": Family((_norm_before("ln1"), _qkv_fused, _rotary, _attention_core, _out_projection("proj"), _residual1,
                     _norm_after("ln1"), _norm_before("ln2"), _mlp_swiglu, _fc2, _residual2, _norm_after("ln2")),
                    pre_norm=True, norm="rmsnorm", bias=False, module_dropouts=False, megatron=False,
                    tensor_parallel=True, containers=2),
}
ARCHS = tuple(FAMILIES)
TP_ARCHS = tuple(a for a, f in FAMILIES.items() if f.tensor_parallel)   # the blocks priced split over a TP group
CONTAINERS = {a: f.containers for a, f in FAMILIES.items()}


def block_kernels(sh: BlockShape, *, input_grad: bool = True, accumulate_grads: bool = True,
                  recompute: str = "none") -> list[Kernel]:
    """Every kernel one block launches for one micro-batch: forward (F, in order), then the input
    gradient with the element-wise backward (B) and the weight gradients (W), in backward order;
    the block is its family's slots (:data:`FAMILIES`).

    input_grad: the block's input needs a gradient (False for a benchmark that feeds a leaf tensor:
    with a post-norm block the Q/K/V input-gradient GEMMs, their sum and the first residual's
    gradient sum are skipped). accumulate_grads: the weight gradients are added into existing
    ``.grad`` tensors (one kernel per parameter tensor: every micro-batch after the first).
    recompute: ``selective`` re-runs the attention core in B, ``full`` the whole forward."""
    return list(_block_kernels(sh, input_grad, accumulate_grads, recompute))


@lru_cache(maxsize=4096)
def _block_kernels(sh: BlockShape, input_grad: bool, accumulate_grads: bool, recompute: str) -> tuple[Kernel, ...]:
    """The kernels of :func:`block_kernels` as a tuple (cached per distinct block)."""
    fam = FAMILIES[sh.arch]
    k = _Block(sh, fam, input_grad)
    for slot in fam.slots:
        slot(k)
    return k.kernels(accumulate_grads, recompute)


def unpriced(spec: "ModelSpec") -> str | None:
    """What of ``spec``'s block this model does not price, in words (None: it prices the whole
    block): its families are plain dense blocks, so the first of
    :attr:`cost_models.model_spec.ModelSpec.beyond_dense` (experts, latent attention, another head
    size, q/k norms; the linear model, :class:`cost_models.transformer.TransformerCostModel`, prices
    them)."""
    return spec.beyond_dense[0] if spec.beyond_dense else None


def check_priced(spec: "ModelSpec") -> None:
    """Refuse, in one line, a spec :func:`unpriced` says this model does not price."""
    why = unpriced(spec)
    if why is not None:
        raise ValueError(f"--cost-model kernels prices dense gpt, bert and llama blocks; model {spec.name} has {why}: "
                         f"use --cost-model linear (the default for it)")


def block_shape(spec: "ModelSpec", dropout: bool = True, arch: str | None = None, tp: int = 1,
                sp: bool = False, attention: str | None = None, grad_accumulation: str = "fused",
                fp8: str | None = None) -> BlockShape:
    """The block of a model spec: ``bert`` for kind bert, ``gpt`` (Megatron-LM's layer) for gpt,
    ``llama`` for llama; its attention the model's unless given (a block :func:`unpriced` names
    is refused); ``fp8``: its linear layers in fp8 with that recipe."""
    check_priced(spec)
    arch = arch or ("bert" if spec.kind == "bert" else "llama" if spec.kind == "llama" else "gpt")
    extra = {} if arch not in TP_ARCHS else dict(kv_heads=None if spec.kv == spec.heads else spec.kv,
                                                 attention=attention or spec.attention_kind)
    return BlockShape(arch, spec.hidden, spec.heads, spec.seq_len, spec.ffn, spec.dtype_bytes,
                      spec.micro_batch, dropout, tp=tp, sp=sp, grad_accumulation=grad_accumulation, fp8=fp8, **extra)


def embedding_kernels(spec: "ModelSpec", tp: int = 1, sp: bool = False) -> list[Kernel]:
    """Token (+ position, + token type) lookup and sum; backward: a scatter-add into the tables.
    Vocabulary-parallel over ``tp``: each GPU looks up the tokens of its rows (the others are
    masked to zero) and the outputs are summed by an all-reduce (costed apart)."""
    T, h, d = spec.micro_batch * spec.seq_len, spec.hidden, spec.dtype_bytes
    n = 3 if spec.kind == "bert" else 1 if spec.kind == "llama" else 2
    ks = [memory(f"embed.lookup{i}", "F", 2 * T * h * d + 8 * T) for i in range(n)]
    if n > 1:
        ks += [memory("embed.sum", "F", (n + 1) * T * h * d)]
    if tp > 1:
        ks += [memory("embed.mask", "F", 2 * T * h * d + 8 * T)]
    ks += [memory(f"embed.scatter{i}", "W", 3 * T * h * d + 8 * T) for i in range(n)]
    return ks


def head_kernels(spec: "ModelSpec", tp: int = 1, sp: bool = False) -> list[Kernel]:
    """Final norm, the V x h projection (BERT: the h x h transform and GeLU first), the softmax
    cross-entropy over the fp32 logits and their gradient; the projection and the loss over V/t
    rows of the vocabulary on each of ``tp`` GPUs, the norm over 1/t of the sequence with ``sp``."""
    T, h, d, V = spec.micro_batch * spec.seq_len, spec.hidden, spec.dtype_bytes, -(-spec.vocab // tp)
    Tn = T // tp if sp else T
    ks = [memory("head.norm", "F", 2 * Tn * h * d), memory("head.norm.dx", "B", 3 * Tn * h * d)]
    if spec.kind == "bert":
        ks += [gemm("head.transform", "F", T, h, h, d), memory("head.gelu", "F", 2 * T * h * d),
               gemm("head.transform.dx", "B", T, h, h, d), memory("head.gelu.bwd", "B", 3 * T * h * d),
               gemm("head.transform.dw", "W", h, h, T, d)]
    ks += [gemm("head.proj", "F", T, V, h, d), memory("head.logsoftmax", "F", T * V * (d + 4)),
           memory("head.loss", "F", T * V * 4), memory("head.loss.bwd", "B", T * V * (4 + d)),
           gemm("head.proj.dx", "B", T, h, V, d), gemm("head.proj.dw", "W", V, h, T, d)]
    return ks


def transformer_layer_times(spec: "ModelSpec", device: "DeviceSpec", precision: str, recompute: str = "none",
                            dropout: bool = True, constants: GpuConstants | None = None, tp: int = 1,
                            sp: bool = False, grad_accumulation: str = "fused",
                            fp8_recipe: str | None = None) -> list[tuple[float, float, float]]:
    """(F, B, W) seconds of every layer of the stack [embedding, blocks, head] for one micro-batch
    of ``spec.micro_batch`` sequences on one of ``tp`` GPUs, each phase a long-run kernel stream
    (see :func:`stream_time`); the tensor-parallel collectives are not in them. At ``precision``
    fp8 the blocks' linear layers run in fp8 with ``fp8_recipe`` (None: the default,
    :data:`cost_models.fp8.DEFAULT_RECIPE`), the embedding, the head and the attention core in 16 bits."""
    rates = DeviceRates.of(device, precision, constants)
    fp8 = (fp8_recipe or DEFAULT_RECIPE) if precision == "fp8" else None
    shape = block_shape(spec, dropout, tp=tp, sp=sp, grad_accumulation=grad_accumulation, fp8=fp8)
    block = rates.phases(block_kernels(shape, recompute=recompute))
    return [rates.phases(embedding_kernels(spec, tp, sp)), *([block] * spec.layers),
            rates.phases(head_kernels(spec, tp, sp))]


# ---------------------------------------------------------------------------- measurement protocol
@dataclass(frozen=True)
class Protocol:
    """How a benchmark timed a layer (Chimera's ``prof_steps``-style script): ``passes`` forward
    passes back to back, then as many backward passes, host-timed; the forward time is the first
    part / passes, the backward the rest / passes. ``input_grad``: the layer input needs a gradient;
    ``accumulate_grads``: the backward passes add into existing gradients (all but the first)."""

    passes: int = 4
    input_grad: bool = False
    accumulate_fraction: float = 0.75


def measured_layer_times(sh: BlockShape, rates: DeviceRates, protocol: Protocol = Protocol()) -> tuple[float, float]:
    """(forward, backward) seconds per pass of one block as the protocol measures them: the queue of
    ``passes`` forward passes, then (one stream) as many backward passes, simulated exactly."""
    ks = block_kernels(sh, input_grad=protocol.input_grad, accumulate_grads=False)
    acc = [k for k in block_kernels(sh, input_grad=protocol.input_grad, accumulate_grads=True)
           if k.name.startswith("grad.accum")]
    fk = [k for k in ks if k.phase == "F"]
    bk = [k for k in ks if k.phase != "F"]
    n = protocol.passes
    n_acc = round(protocol.accumulate_fraction * n)
    f_g, f_h = rates.times(fk), rates.host_times(fk)
    b_g, b_h = rates.times(bk), rates.host_times(bk)
    a_g, a_h = rates.times(acc), rates.host_times(acc)
    t_f = stream_time(f_g * n, f_h * n, 1)
    gpu = f_g * n + b_g * (n - n_acc) + (b_g + a_g) * n_acc
    host = f_h * n + b_h * (n - n_acc) + (b_h + a_h) * n_acc
    return t_f / n, (stream_time(gpu, host, 1) - t_f) / n


# ---------------------------------------------------------------------------- a mixture-of-experts block
MLP_KERNELS = ("fc1", "swiglu", "fc2")     # the dense llama block's MLP: what a MoE block has in its place


def moe_mlp_kernels(spec: "ModelSpec", counts: Sequence[int]) -> list[Kernel]:
    """The kernels of the executor's MoE MLP (:class:`executor.moe.MoeMLP`, EP 1) on one micro-batch
    of T = b s tokens whose routed pairs per expert are ``counts`` (m = their sum; T k dropless):

    * router: the gate GEMM [T x h] x [h x E] in fp32 (4-byte operands: the executor keeps the router
      in fp32), the softmax (or sigmoid) and top-k over [T, E] fp32 scores; backward the two GEMMs'
      input and weight gradients and the scores' element-wise backward;
    * dispatch: the m rows gathered (read and written, m h d), their gradient scattered back (3 m h d);
    * each expert j with c_j > 0 rows: ``w1`` and ``w3`` [c_j x h] x [h x f_e], SwiGLU (3 c_j f_e d;
      backward 5), ``w2`` [c_j x f_e] x [f_e x h] (Mixtral's three separate linears);
    * combine: the weighted rows added into token order (rows, weights, output: 3 m h d; backward 2);
    * the shared expert on all T tokens (f_s > 0), as an expert, and Qwen2's gate [T x h] x [h x 1];
    * the weight gradients added into ``.grad`` (3 numel d per tensor, as the dense blocks').

    2 FLOPs per multiply-accumulate, so the forward's GEMM FLOPs are 2 T E h + 6 m h f_e + 6 T h f_s
    (+ 2 T h with the shared gate)."""
    T, h, d, E, fe, fs = spec.micro_batch * spec.seq_len, spec.hidden, spec.dtype_bytes, spec.experts, \
        spec.expert_width, spec.shared_ffn
    if len(counts) != E:
        raise ValueError(f"moe_mlp_kernels needs one row count per expert ({E}); got {len(counts)}")
    m = int(sum(counts))
    fwd, back, params = [], [], []

    def linear(name, rows, n_out, n_in, dt=d):
        f, b = _linear(name, rows, n_out, n_in, dt, bias=False)
        fwd.extend(f)
        back[:0] = b             # backward in reverse order
        params.append((n_out * n_in, dt))

    linear("router", T, E, h, 4)
    fwd.append(memory("router.scores", "F", 2 * T * E * 4 + T * E * 4))
    back.insert(0, memory("router.scores.bwd", "B", 3 * T * E * 4))
    fwd.append(memory("moe.dispatch", "F", 2 * m * h * d))
    back.insert(0, memory("moe.dispatch.bwd", "B", 3 * m * h * d))
    for j, c in enumerate(counts):
        if c <= 0:
            continue
        linear(f"expert{j}.w1", c, fe, h)
        linear(f"expert{j}.w3", c, fe, h)
        fwd.append(memory(f"expert{j}.swiglu", "F", 3 * c * fe * d))
        back.insert(0, memory(f"expert{j}.swiglu.bwd", "B", 5 * c * fe * d))
        linear(f"expert{j}.w2", c, h, fe)
    fwd.append(memory("moe.combine", "F", 3 * m * h * d))
    back.insert(0, memory("moe.combine.bwd", "B", 2 * m * h * d))
    if fs:
        linear("shared.w1", T, fs, h)
        linear("shared.w3", T, fs, h)
        fwd.append(memory("shared.swiglu", "F", 3 * T * fs * d))
        back.insert(0, memory("shared.swiglu.bwd", "B", 5 * T * fs * d))
        linear("shared.w2", T, h, fs)
        if spec.shared_gate:
            linear("shared.gate", T, 1, h)
    accum = [memory(f"moe.grad.accum{i}", "W", 3 * p * dt) for i, (p, dt) in enumerate(params)]
    return fwd + back + accum


def moe_block_times(spec: "ModelSpec", device: "DeviceSpec", precision: str, counts: Sequence[int],
                    constants: GpuConstants | None = None) -> tuple[float, float, float]:
    """(F, B, W) seconds of one MoE block of ``spec`` (a llama-kind mixture of experts, EP 1) for
    one micro-batch whose routed pairs per expert are ``counts``: the llama block's kernels
    (:func:`block_kernels`, flash attention, no dropout) without its dense MLP (:data:`MLP_KERNELS`
    and their two gradient accumulations) and with :func:`moe_mlp_kernels` in its place, each phase a
    long-run stream (:func:`stream_time`)."""
    if spec.kind != "llama" or not spec.is_moe:
        raise ValueError(f"moe_block_times prices the llama kind's MoE block; model {spec.name} is "
                         f"{'dense' if not spec.is_moe else spec.kind}")
    if spec.is_mla:
        raise ValueError(f"moe_block_times prices grouped-query attention; model {spec.name} has latent attention")
    rates = DeviceRates.of(device, precision, constants)
    from dataclasses import fields

    from .model_spec import MOE_FIELDS
    dense = spec.replace(**{f.name: f.default for f in fields(spec) if f.name in MOE_FIELDS},
                         ffn_hidden=spec.expert_width)
    attn = block_kernels(block_shape(dense, dropout=False))
    mlp_params = {"grad.accum4", "grad.accum5"}     # fc1's and fc2's (the block's parameters in order)
    attn = [k for k in attn if k.name.split(".")[0] not in MLP_KERNELS and k.name not in mlp_params]
    return rates.phases(attn + moe_mlp_kernels(spec, counts))
