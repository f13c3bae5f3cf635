"""Transformer costs from formulas: FLOPs, parameters and bytes per layer, and a cost model.

Notation: b micro-batch (sequences), s sequence length, h hidden size, a heads, m = ffn_mult
(MLP width m*h, 4 in GPT/BERT), V vocabulary, d = dtype_bytes (2 for fp16/bf16).

FLOP convention: **2 FLOPs per multiply-accumulate**, counting matrix multiplications only
(layernorm, softmax, GeLU, dropout, residual adds are ignored; they are < 2% of a large layer).
This is the convention of Megatron-LM (Narayanan et al., SC 2021), of the zero-bubble paper
(Qi et al., ICLR 2024, table 1) and of ``torch.utils.flop_counter.FlopCounterMode``, which the
tests use to check the formulas exactly on a real torch block.

Per transformer block (pre-LN GPT block: QKV projection, attention, output projection, MLP)::

    forward          F = bsh((8 + 4m)h + 4s)   = sbh(24h + 4s) for m = 4
                       (QKV 6bsh^2, QK^T 2bs^2h, attention x V 2bs^2h, projection 2bsh^2, MLP 4m bsh^2)
    input gradient   B = bsh((8 + 4m)h + 8s)   = sbh(24h + 8s)  (both operands of QK^T and attn x V)
    weight gradient  W = bsh (8 + 4m)h         = 24sbh^2
    B + W = 2F (the usual "backward = 2 x forward").
    parameters       (4 + 2m)h^2 + (9 + m)h   = 12h^2 + 13h

Activations kept from F for the backward, bytes per micro-batch (Korthikanti et al., "Reducing
Activation Recomputation in Large Transformer Models", 2022), with 1-byte dropout masks::

    none       sbh((8 + 2m)d + 2) + a s^2 b (2d + 1)  = sbh(34 + 5as/h) for d = 2, m = 4
    selective  sbh((8 + 2m)d + 2)                     = 34 sbh   (attention core recomputed in B)
    full       sbh d                                  = 2 sbh    (only the block input; F re-run in B)

Without dropout the masks go: ``sbh (8 + 2m)d + a s^2 b d``. Recomputation adds FLOPs to the input
backward: selective ``4bs^2h`` (QK^T and attention x V again), full ``F``.
Alive between B and W (split backward): the inputs of the four linear layers and the gradients of
their outputs, ``(8 + 2m) sbh d`` = 32 sbh (the zero-bubble paper's M_W).
Bytes sent to the next stage: the hidden states, ``bsh d``.

Embedding (layer 0): token table Vh + learned positions sh (BERT: + 2 token types + layernorm),
no matmul FLOPs (a lookup; its backward is a scatter-add). Output head (last layer): a final
layernorm and the V x h projection (BERT: the MLM transform h x h + layernorm before it), with
F = B = W = 2bshV (+ 2bsh^2 for BERT); it keeps the fp32 logits (4 bsV bytes) for the loss.
In pipeline training the head holds its own copy of the (possibly tied) embedding table, so its
parameters count on the last stage.

Time of a layer: with ``compute="linear"`` FLOPs / (device peak at the precision x efficiency), the
same per sample at every micro-batch; with ``compute="kernels"`` the kernels the layer launches at
its micro-batch, priced by :mod:`cost_models.kernels` (GEMM tiles and waves, memory-bound
element-wise kernels, launch overhead; the device preset's ``kernels:`` constants). See
:class:`TransformerCostModel`.
"""
from __future__ import annotations

from dataclasses import dataclass

from .base import LayerCosts, PerLayerCostModel, StageCosts
from .device import DeviceSpec
from .kernels import COST_MODELS, DeviceRates, transformer_layer_times
from .memory import StaticMemory, static_memory
from .model_spec import ModelSpec, SpecError
from .partition import default_partition, layer_ranges

RECOMPUTE = ("none", "selective", "full")
LOGIT_BYTES = 4          # the loss keeps fp32 logits / softmax


def _check_recompute(recompute: str) -> None:
    if recompute not in RECOMPUTE:
        raise SpecError(f"recompute must be one of {', '.join(RECOMPUTE)}; got {recompute!r}")


# ---------------------------------------------------------------------------- one block
def block_params(spec: ModelSpec) -> int:
    """Parameters of one transformer block: (4 + 2m)h^2 + (9 + m)h (= 12h^2 + 13h)."""
    h, m = spec.hidden, spec.ffn_mult
    return (4 + 2 * m) * h * h + (9 + m) * h


def block_flops(spec: ModelSpec) -> tuple[float, float, float]:
    """(forward, input-gradient, weight-gradient) FLOPs of one block for one micro-batch."""
    b, s, h, m = spec.micro_batch, spec.seq_len, spec.hidden, spec.ffn_mult
    lin = (8 + 4 * m) * h
    return float(b * s * h * (lin + 4 * s)), float(b * s * h * (lin + 8 * s)), float(b * s * h * lin)


def recompute_flops(spec: ModelSpec, recompute: str = "none") -> float:
    """Extra forward FLOPs the input backward of one block re-runs: 0, 4bs^2h (selective) or F (full)."""
    _check_recompute(recompute)
    if recompute == "none":
        return 0.0
    if recompute == "selective":
        return float(4 * spec.micro_batch * spec.seq_len ** 2 * spec.hidden)
    return block_flops(spec)[0]


def block_activation_bytes(spec: ModelSpec, recompute: str = "none", dropout: bool = True) -> float:
    """Bytes one block keeps from F to B for one micro-batch (see the module docstring)."""
    _check_recompute(recompute)
    b, s, h, a, m, d = spec.micro_batch, spec.seq_len, spec.hidden, spec.heads, spec.ffn_mult, spec.dtype_bytes
    sbh = s * b * h
    if recompute == "full":
        return float(sbh * d)
    linear = sbh * ((8 + 2 * m) * d + (2 if dropout else 0))
    if recompute == "selective":
        return float(linear)
    return float(linear + a * s * s * b * (2 * d + 1 if dropout else d))


def block_weight_grad_bytes(spec: ModelSpec) -> float:
    """Bytes alive between a block's input backward and its weight backward: (8 + 2m) sbh d."""
    return float((8 + 2 * spec.ffn_mult) * spec.seq_len * spec.micro_batch * spec.hidden * spec.dtype_bytes)


def boundary_bytes(spec: ModelSpec) -> float:
    """Bytes of the hidden states a stage sends to the next one (and of the gradient sent back): bsh d."""
    return float(spec.micro_batch * spec.seq_len * spec.hidden * spec.dtype_bytes)


# ---------------------------------------------------------------------------- the layer stack
@dataclass(frozen=True)
class Layer:
    """One layer of the stack: FLOPs per micro-batch, parameter count, bytes per micro-batch."""

    name: str                 # "embedding", "block0".., "head"
    kind: str                 # embedding | block | head
    flops_f: float
    flops_b_input: float
    flops_w: float
    flops_recompute: float    # extra forward FLOPs re-run in the input backward
    params: int
    act_bytes: float          # kept from F to B
    act_w_bytes: float        # alive between B and W (split backward)
    out_bytes: float          # output sent onwards if a stage ends here (0 for the head)

    @property
    def flops_total(self) -> float:
        return self.flops_f + self.flops_b_input + self.flops_w + self.flops_recompute


def embedding_layer(spec: ModelSpec, dropout: bool = True) -> Layer:
    b, s, h, V, d = spec.micro_batch, spec.seq_len, spec.hidden, spec.vocab, spec.dtype_bytes
    params = V * h + s * h + (4 * h if spec.kind == "bert" else 0)   # bert: 2 token types + layernorm
    ids = 8 * b * s                                                    # int64 token ids
    act = ids + b * s * h * ((d if spec.kind == "bert" else 0) + (1 if dropout else 0))
    return Layer("embedding", "embedding", 0.0, 0.0, 0.0, 0.0, params, float(act), float(ids + b * s * h * d),
                 boundary_bytes(spec))


def head_layer(spec: ModelSpec) -> Layer:
    b, s, h, V, d = spec.micro_batch, spec.seq_len, spec.hidden, spec.vocab, spec.dtype_bytes
    bsh = b * s * h
    logits = b * s * V
    if spec.kind == "bert":     # MLM transform (dense h x h, GeLU, layernorm) then the decoder V x h + bias
        params = h * h + h + 2 * h + V * h + V
        flops = 2.0 * bsh * h + 2.0 * bsh * V
        act = 4 * bsh * d + logits * LOGIT_BYTES
        act_w = 3 * bsh * d + logits * d
    else:                       # final layernorm then the V x h projection (no bias)
        params = 2 * h + V * h
        flops = 2.0 * bsh * V
        act = 2 * bsh * d + logits * LOGIT_BYTES
        act_w = bsh * d + logits * d
    return Layer("head", "head", flops, flops, flops, 0.0, params, float(act), float(act_w), 0.0)


def transformer_layers(spec: ModelSpec, recompute: str = "none", dropout: bool = True) -> list[Layer]:
    """[embedding, block0, ..., block(L-1), head]: L + 2 layers."""
    f, bi, w = block_flops(spec)
    block = dict(flops_f=f, flops_b_input=bi, flops_w=w, flops_recompute=recompute_flops(spec, recompute),
                 params=block_params(spec), act_bytes=block_activation_bytes(spec, recompute, dropout),
                 act_w_bytes=block_weight_grad_bytes(spec), out_bytes=boundary_bytes(spec))
    blocks = [Layer(f"block{i}", "block", **block) for i in range(spec.layers)]
    return [embedding_layer(spec, dropout), *blocks, head_layer(spec)]


def model_params(spec: ModelSpec, tied_embeddings: bool | None = None) -> int:
    """Parameters of the whole model. ``tied_embeddings`` (default: True for gpt) counts the output
    projection once with the embedding table, as the papers' model sizes do."""
    layers = transformer_layers(spec)
    total = sum(l.params for l in layers)
    if tied_embeddings if tied_embeddings is not None else spec.kind == "gpt":
        total -= spec.vocab * spec.hidden
    return total


def model_flops(spec: ModelSpec, recompute: str = "none") -> float:
    """FLOPs of one micro-batch's forward + backward through the whole model."""
    return sum(l.flops_total for l in transformer_layers(spec, recompute))



def static_bytes_split(dtype_bytes: float, grad_bytes: float, bytes_per_param: float) -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) bytes per parameter out of ``bytes_per_param`` in all:
    16 = 2 fp16 weights + 2 fp16 gradients + 12 fp32 master weights, momentum and variance (Adam)."""
    w, g = float(dtype_bytes), float(grad_bytes)
    return w, g, max(0.0, bytes_per_param - w - g)


@dataclass(frozen=True)
class TransformerCostModel:
    """Seconds and bytes for a transformer on a device, from the formulas above.

    ``bind(schedule)`` gives :class:`StageCosts` in seconds ("s") and bytes ("B").

    recompute: none | selective | full (activation recomputation of the blocks).
    bytes_per_param: static bytes per parameter (weights + gradients + optimizer state); 16 for
      mixed-precision Adam. grad_bytes_per_param: bytes all-reduced per parameter (default the
      model's dtype_bytes). precision: fp16 | bf16 | fp32 | ... (default bf16 when the device has
      it for 2-byte models, else fp16; fp32 for 4-byte models). dropout: the masks count in the
      activations. partition: layers per stage over the L + 2 layers (default
      :func:`default_partition`). optimizer_bytes_touched: bytes the optimizer step reads and
      writes per parameter (default gradients + 2 x optimizer state + weights = 28 for Adam at 16);
      its time is that over the device's memory bandwidth. The local hand-off of a V turn copies the
      boundary tensor once (read + write) at memory bandwidth. compute: ``linear`` (FLOPs at a fixed
      efficiency: per-sample costs independent of the micro-batch) or ``kernels`` (the kernel model
      of :mod:`cost_models.kernels`: costs depend on the micro-batch; needs the device's ``kernels:``
      constants).
    """

    model: ModelSpec
    device: DeviceSpec
    recompute: str = "none"
    bytes_per_param: float = 16.0
    grad_bytes_per_param: float | None = None
    precision: str | None = None
    dropout: bool = True
    partition: tuple[int, ...] | None = None
    optimizer_bytes_touched: float | None = None
    compute: str = "linear"

    def __post_init__(self):
        _check_recompute(self.recompute)
        if self.compute not in COST_MODELS:
            raise SpecError(f"cost model must be one of {', '.join(COST_MODELS)}; got {self.compute!r}")
        if self.compute == "kernels":
            DeviceRates.of(self.device, self.resolved_precision())   # fail fast: constants present
        if self.bytes_per_param <= 0:
            raise SpecError(f"bytes_per_param must be > 0; got {self.bytes_per_param}")
        self.flop_rate()   # fail fast on a device without a peak (e.g. cpu: use a calibration profile)

    @property
    def grad_bytes(self) -> float:
        return float(self.model.dtype_bytes if self.grad_bytes_per_param is None else self.grad_bytes_per_param)

    def resolved_precision(self) -> str:
        if self.precision is not None:
            return self.precision
        if self.model.dtype_bytes == 2:
            return "bf16" if self.device.has("bf16") else "fp16"
        if self.model.dtype_bytes == 4:
            return "fp32"
        raise SpecError(f"model {self.model.name!r}: no default precision for dtype_bytes "
                        f"{self.model.dtype_bytes}; pass precision=")

    def flop_rate(self) -> float:
        """Achievable FLOP/s: the device's peak at the precision times its efficiency."""
        return self.device.achievable_flops(self.resolved_precision())

    def layers(self) -> list[Layer]:
        return transformer_layers(self.model, self.recompute, self.dropout)

    def static_split(self) -> tuple[float, float, float]:
        return static_bytes_split(self.model.dtype_bytes, self.grad_bytes, self.bytes_per_param)

    def optim_time_per_param(self) -> float:
        if not self.device.memory_bandwidth:
            return 0.0
        w, g, o = self.static_split()
        touched = self.optimizer_bytes_touched if self.optimizer_bytes_touched is not None else g + 2 * o + w
        return touched / self.device.memory_bandwidth

    def copy_time(self) -> float:
        if not self.device.memory_bandwidth:
            return 0.0
        return 2 * boundary_bytes(self.model) / self.device.memory_bandwidth

    def layer_costs(self) -> LayerCosts:
        """Per-layer seconds and bytes (the input of :class:`PerLayerCostModel` and of planners)."""
        L = self.layers()
        if self.compute == "kernels":
            t = transformer_layer_times(self.model, self.device, self.resolved_precision(), self.recompute,
                                        self.dropout)
            f, b_in, w = (tuple(x[i] for x in t) for i in range(3))
        else:
            rate = self.flop_rate()
            f = tuple(l.flops_f / rate for l in L)
            b_in = tuple((l.flops_b_input + l.flops_recompute) / rate for l in L)
            w = tuple(l.flops_w / rate for l in L)
        return LayerCosts(
            f=f,
            b_input=b_in,
            w=w,
            act=tuple(l.act_bytes for l in L),
            act_w=tuple(l.act_w_bytes for l in L),
            out_bytes=tuple(l.out_bytes for l in L),
            params=tuple(float(l.params) for l in L),
            bytes_per_param_static=float(self.bytes_per_param),
            grad_bytes_per_param=self.grad_bytes,
            optim_time_per_param=self.optim_time_per_param(),
            copy_time=self.copy_time(),
        )

    def partition_for(self, num_stages: int) -> tuple[int, ...]:
        return self.partition if self.partition is not None else default_partition(self.model.layers, num_stages)

    def per_layer_model(self, num_stages: int) -> PerLayerCostModel:
        return PerLayerCostModel(self.layer_costs(), self.partition_for(num_stages))

    def stage_params(self, num_stages: int) -> list[float]:
        """Parameter count of each stage under :meth:`partition_for`."""
        parts = layer_ranges(self.model.layers + 2, num_stages, self.partition_for(num_stages))
        L = self.layers()
        return [float(sum(L[i].params for i in r)) for r in parts]

    def static_breakdown(self, sched) -> list[StaticMemory]:
        """Per rank: parameters held and their weight / gradient / optimizer bytes."""
        w, g, o = self.static_split()
        return static_memory(sched, self.stage_params(sched.num_stages), w, g, w + g + o)

    def bind(self, sched) -> StageCosts:
        costs = self.per_layer_model(sched.num_stages).bind(sched)
        costs.meta.update(model="transformer", cost_model=self.compute, model_name=self.model.name,
                          device=self.device.name,
                          precision=self.resolved_precision(), recompute=self.recompute,
                          bytes_per_param=self.bytes_per_param, memory_capacity=self.device.memory_bytes)
        return costs
