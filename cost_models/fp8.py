"""FP8 training as Transformer Engine runs it: the recipes, the casts they add, what they keep.

``--precision fp8`` runs the GEMMs of the linear layers (QKV, the attention's output projection,
the MLP's) in 8 bits at the device's fp8 peak; the attention core (QK^T, x V), the embedding and
the output head stay in 16 bits, as Megatron-LM with Transformer Engine (TE) and DeepSeek-V3 run
them. An fp8 GEMM reads fp8 operands, so every operand is *quantized* first: a memory-bound
kernel that reads the 16-bit tensor and writes its fp8 copy, scaled so that its largest value
(its *amax*) lands near the format's maximum. ``--fp8-recipe`` says how the scale is found
(TE's recipes, ``transformer_engine.common.recipe``; Megatron-LM's ``--fp8-recipe``):

``delayed`` (``DelayedScaling``, TE's and Megatron-LM's default)
    one fp32 scale per tensor, taken from the amax *history* of earlier steps; the cast reads the
    tensor once and records its amax on the way (TE docs, "FP8 Delayed Scaling": "this reduces
    tensor reads per quantization from two to one"). The amaxes a layer recorded are all-reduced
    over the amax reduction group at the end of its forward and of its backward (one small
    all-reduce each; priced on the tensor-parallel group: ``tp_only_amax_red``; across the
    data-parallel replicas too the message is a few KB, latency only).
``tensorwise`` (``Float8CurrentScaling``; torchao's default dynamic tensorwise scaling)
    one fp32 scale per tensor from the tensor itself: the cast reads it twice, once for the amax
    and once to cast (TE docs, "FP8 Current Scaling"). A tensor split over the tensor-parallel
    group and gathered for the GEMM (the sequence-parallel inputs of the column-parallel layers in
    F, the output gradients of the row-parallel ones in B) needs one amax for all of its shards:
    one 4-byte all-reduce on the group per such tensor (2 in F, 2 in B per block, with SP only).
``blockwise`` (``Float8BlockScaling``, DeepSeek-V3's recipe)
    one fp32 scale per 1 x 128 block of an activation or gradient and per 128 x 128 block of a
    weight (TE docs, "FP8 Blockwise Scaling"): the amax of a block is found in the cast's one read,
    no amax is reduced across GPUs; the scales add 4 bytes per 128 elements to the cast's writes.

Hopper's fp8 GEMM takes its operands in one layout only (TN), so a tensor used by two GEMMs along
different axes is written twice, row-wise and column-wise (TE docs, "Performance
considerations: handling transposes"): a linear layer's input (F: the forward GEMM; W: the weight
gradient) and its output gradient (B: the input gradient; W: the weight gradient). Bytes of one
quantization of an n-element 16-bit tensor (``d`` = 2), written for ``u`` usages::

    delayed     n d + u n               (one read, u fp8 copies)
    tensorwise  2 n d + u n             (a read for the amax, a read to cast)
    blockwise   n d + u (n + 4 n / 128) (one read, u fp8 copies with their block scales)

Per linear layer ``[T x n_in] -> [T x n_out]`` and micro-batch, with u = 2: its input in F
(T n_in elements), its output gradient in B (T n_out); the weight (n_out n_in) is cast once per
step, on the first micro-batch (TE's ``is_first_microbatch``), and its two fp8 copies are kept to
the step's end: **2 bytes per linear-layer parameter** in the memory ledger (+ the amax history
and scales: 4 bytes per tensor, negligible), written by the optimizer's pass over the weights
(priced there: the weights' bytes touched grow by 2). Kept activations stay counted in 16 bits
(TE keeps a linear's input for the weight gradient in fp8, which this ledger does not take off:
an upper bound).

Optional fp8 payloads: ``fp8_dispatch`` (the MoE dispatch all-to-all, :mod:`cost_models.moe`) and
``fp8_gather`` (ZeRO-3 / FSDP weight all-gathers in fp8, torchao's ``enable_fsdp_float8_all_gather``:
:func:`gathered_weight_bytes` is the bytes per parameter a weight gather moves).
"""
from __future__ import annotations

FP8_RECIPES = ("delayed", "tensorwise", "blockwise")   # Megatron-LM's --fp8-recipe names (mxfp8: Blackwell)
DEFAULT_RECIPE = "delayed"
BLOCK = 128                      # blockwise: elements per scale (1 x 128 activations, 128 x 128 weights)
SCALE_BYTES = 4                  # one fp32 scale
USAGES = 2                       # Hopper: row-wise and column-wise copies of every operand
WEIGHT_COPY_BYTES = float(USAGES)   # fp8 bytes per linear-layer parameter kept for the step


def check_recipe(recipe: str) -> None:
    if recipe not in FP8_RECIPES:
        raise ValueError(f"--fp8-recipe must be one of {', '.join(FP8_RECIPES)}; got {recipe!r}")


def quantize_bytes(n: float, recipe: str, usages: int = USAGES, src_bytes: int = 2) -> float:
    """Bytes one quantization of an ``n``-element ``src_bytes`` tensor moves (module docstring)."""
    check_recipe(recipe)
    reads = 2 if recipe == "tensorwise" else 1
    per_usage = n + (SCALE_BYTES * n / BLOCK if recipe == "blockwise" else 0.0)
    return float(reads * n * src_bytes + usages * per_usage)


def linear_cast_bytes(rows: int, n_out: int, n_in: int, recipe: str, src_bytes: int = 2) -> tuple[float, float]:
    """(F, B) bytes of the casts of one linear layer over ``rows`` rows for one micro-batch: its input
    in F, its output gradient in B (the weight's cast is per step: :data:`WEIGHT_COPY_BYTES`)."""
    return (quantize_bytes(rows * n_in, recipe, src_bytes=src_bytes),
            quantize_bytes(rows * n_out, recipe, src_bytes=src_bytes))


def amax_reductions(recipe: str, tp: int, sequence_parallel: bool) -> tuple[int, int]:
    """(F, B) small all-reduces of amaxes one block adds on its tensor-parallel group (module
    docstring): delayed 1 + 1 (the layer's recorded amaxes), tensorwise with sequence parallelism
    2 + 2 (the gathered inputs and output gradients), none otherwise."""
    check_recipe(recipe)
    if tp == 1:
        return 0, 0
    if recipe == "delayed":
        return 1, 1
    if recipe == "tensorwise" and sequence_parallel:
        return 2, 2
    return 0, 0


def amax_bytes(linears: int) -> float:
    """Bytes of one amax all-reduce: an fp32 amax per quantized tensor of a block's ``linears``
    linear layers (input, weight, output gradient each)."""
    return float(SCALE_BYTES * 3 * linears)


def gathered_weight_bytes(parallel, dtype_bytes: float) -> float:
    """Bytes per parameter a ZeRO-3 / FSDP weight all-gather moves: 1 with ``fp8_gather`` (plus a
    scale per tensor, negligible), else the weights' ``dtype_bytes``."""
    return 1.0 if getattr(parallel, "fp8_gather", False) else float(dtype_bytes)


def precision_label(precision: str, recipe: str | None) -> str:
    """How a report names the precision: ``fp8 (delayed scaling)`` at fp8, else the precision."""
    return f"{precision} ({recipe} scaling)" if precision == "fp8" and recipe else precision
