"""Transformer costs from formulas: FLOPs, parameters and bytes per layer, and a cost model.

Notation: b micro-batch (sequences), s sequence length, h hidden size, a heads, k key/value heads
(grouped-query attention; k = a without it), e = h/a head size, f the MLP's inner size (4h in
GPT/BERT: ``ffn_mult`` m = 4), V vocabulary, d = dtype_bytes (2 for fp16/bf16), t the
tensor-parallel size (each stage replica is t GPUs that split every layer Megatron-style: the
attention heads and the MLP's inner dimension column-parallel, the output projections
row-parallel; the embedding table and the LM head split over the vocabulary). Every per-GPU
quantity below is for one of the t GPUs; t = 1 is the unsplit layer.

FLOP convention: **2 FLOPs per multiply-accumulate**, counting matrix multiplications only
(norms, softmax, activations, dropout, residual adds, rotary embeddings are ignored; they are < 2%
of a large layer). This is the convention of Megatron-LM (Narayanan et al., SC 2021), of the
zero-bubble paper (Qi et al., ICLR 2024, table 1) and of ``torch.utils.flop_counter``, which the
tests use to check the formulas exactly on a real torch block.

Per transformer block, n = 2 matrices in a GeLU MLP (gpt, bert) and 3 in a SwiGLU MLP (llama)::

    linear           P = 2bs(h(h + 2ke) + h^2 + n h f)   (QKV, output projection, MLP)
    forward          F = (P + 4bs^2h) / t               = sbh(24h + 4s) for GPT at t = 1
    input gradient   B = (P + 8bs^2h) / t                 (both operands of QK^T and attention x V)
    weight gradient  W = P / t
    parameters       h(h + 2ke) + h^2 + n h f + norms (2 x 2h LayerNorm, 2 x h RMSNorm) + biases
                     (gpt/bert: every linear; Qwen2: Q, K, V)  = 12h^2 + 13h for GPT

Activations kept from F for the backward, bytes per micro-batch and GPU (Korthikanti et al.,
"Reducing Activation Recomputation in Large Transformer Models", 2022, generalised to k, f, d and
the masks). Three parts:

    replicated  R = sbh(4d + 2 x mask)     the two norms' inputs, the two column-parallel inputs, the
                                           two dropout masks after the sub-blocks: split over t only
                                           with sequence parallelism
    split       S = sbh d + 2sbke d + sbh d + n' sb f d      Q, K, V, the output projection's input,
                                           the MLP's (n' = 2 GeLU: its input and output; 3 SwiGLU:
                                           gate, up and their product)
    scores      A = eager: a s^2 b (d + mask + mask x d)     softmax output, its dropout mask and
                                           output; flash: 4 a s b (the fp32 row statistics)

    none        R' + (S + A) / t          R' = R / t with sequence parallelism, else R
    selective   R' + S / t                (the attention core re-run in B)
    full        sbh d (/ t with SP)       (only the block input; F re-run in B)

mask = 1 byte with dropout, 0 without (llama has no dropout). For GPT at d = 2 with dropout and
eager attention this is Korthikanti's Table 2: sbh(34 + 5as/h) at t = 1, sbh(10 + 24/t + 5as/(ht))
with t, sbh(34/t + 5as/(ht)) with t and SP, selective dropping the 5as/(ht) term. Recomputation
adds FLOPs to the input backward: selective ``4bs^2h / t``, full ``F``.
Alive between B and W (split backward): the inputs of the linear layers and the gradients of their
outputs, ``(8 + 2m) sbh d`` = 32 sbh for GPT at t = 1 (the zero-bubble paper's M_W); with t the
column-parallel inputs and the row-parallel output gradients are whole tensors (split with SP).
Bytes sent to the next stage: the hidden states, ``bsh d`` for the whole tensor-parallel group (its
t GPUs send 1/t each over their own links; :func:`cost_models.cluster.tensor_parallel_groups`).

Embedding (layer 0): token table Vh/t (vocabulary-parallel) + learned positions sh (gpt, bert:
+ 2 token types + LayerNorm; llama: rotary, no table), no matmul FLOPs (a lookup; its backward is
a scatter-add). It keeps the int64 token ids (8bs); a split backward computes the tables'
gradients in B (no FLOPs to defer; deferring them would keep the lookups' output gradients, bsh d,
until W), so nothing of it waits for W.
Output head (last layer): a final norm and the V x h projection (BERT: the MLM
transform h x h + LayerNorm before it), with F = B = W = 2bshV / t; it keeps the fp32 logits
(4 bsV / t bytes) for the loss. In pipeline training the head holds its own copy of the (possibly
tied) embedding table, so its parameters count on the last stage.

Tensor-parallel collectives per micro-batch (:func:`layer_collectives`): a block all-reduces its
bsh d output twice in the forward (after the attention and the MLP) and its input gradient twice
in the backward; with sequence parallelism each all-reduce is a reduce-scatter and an all-gather
(the same bytes on a ring). The embedding all-reduces (SP: reduce-scatters) its output; the head
all-reduces its input gradient (SP: all-gathers its input, reduce-scatters the gradient) and the
loss three fp32 [b, s] statistics. A full recomputation runs the forward's collectives again in B.

Context parallelism (``parallel.cp`` = c > 1, :func:`context_parallel_layers`): each of c GPUs
holds s/c tokens of every sequence (chunks i and 2c-1-i of 2c), so every quantity above is the
formula at s/c but the attention core's FLOPs and eager attention's scores, which pair the s/c local
queries with all s keys: 1/c of the whole (4bs^2h / (tc) in F), exactly 1/c of the causal work on
every GPU. The c GPUs exchange K and V (X = 2 (s/c) b k e d / t bytes a GPU) on the CP group's links
(:class:`ContextParallelGroup`): ``ring``, c-1 P2P steps in F each hidden behind a step of the
attention, 2(c-1) X in B (K,V and the dK,dV partial sums); ``allgather``, K,V all-gathered before
the attention and dK,dV reduce-scattered in B, exposed (:meth:`TransformerCostModel.cp_exchange`).
Per layer and micro-batch a GPU sends (c-1) X in F and 2(c-1) X in B (3(c-1) X with recomputation).

Time of a layer: with ``compute="linear"`` FLOPs / (device peak at the precision x efficiency), the
same per sample at every micro-batch; with ``compute="kernels"`` the kernels the layer launches at
its micro-batch, priced by :mod:`cost_models.kernels` (GEMM tiles and waves, memory-bound
element-wise kernels, launch overhead; the device preset's ``kernels:`` constants). The
collectives' time is added to F and B (Megatron's default: on the critical path) or, with
``overlap``, hidden behind the layer's compute up to its length. See :class:`TransformerCostModel`.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache

from .base import LayerCosts, OpPhases, PerLayerCostModel, StageCosts, held_stages, with_peak_floor
from .cluster import Cluster, tensor_parallel_groups
from .comm import allreduce_time, step_time
from .device import DeviceSpec
from .fp8 import (DEFAULT_RECIPE, WEIGHT_COPY_BYTES, amax_bytes, amax_reductions, gathered_weight_bytes,
                  linear_cast_bytes)
from .kernels import COST_MODELS, GRAD_ACCUMULATION, DeviceRates, check_priced, transformer_layer_times
from .memory import StaticMemory, static_memory
from .model_spec import ModelSpec, SpecError
from .moe import (ExpertGroup, check_expert_parallel, expert_data_parallel, moe_mlp_active_params, moe_mlp_params,
                  moe_share)
from .parallel import RECOMPUTE, Parallel
from .partition import default_partition, layer_ranges

LOGIT_BYTES = 4          # the loss keeps fp32 logits / softmax


def _check_recompute(recompute: str) -> None:
    if recompute not in RECOMPUTE:
        raise SpecError(f"recompute must be one of {', '.join(RECOMPUTE)}; got {recompute!r}")


# ---------------------------------------------------------------------------- one block
def _mlp_matrices(spec: ModelSpec) -> int:
    """Weight matrices of the MLP: 3 for SwiGLU (gate, up, down), 2 for GeLU."""
    return 3 if spec.kind == "llama" else 2


def _qkv_width(spec: ModelSpec) -> int:
    """Output width of the fused Q, K, V projection: a e + 2 k e (= h + 2ke when e = h / a)."""
    return (spec.heads + 2 * spec.kv) * spec.head_dim


def _sp_div(tp: int, sp: bool) -> int:
    """What the replicated activations are divided by: t with sequence parallelism, else 1."""
    return tp if sp else 1


def _qk_dim(spec: ModelSpec) -> int:
    """Width of one query/key head (MLA: its non-rotary and rotary parts)."""
    return spec.head_dim + spec.rope_head_dim


def attention_matrices(spec: ModelSpec) -> int:
    """Weights of the attention's linear layers (split over t with the heads).

    Standard (grouped-query): h(a e + 2 k e) + a e h (= h(h + 2ke) + h^2 when e = h/a).
    Multi-head latent attention (DeepSeek; q_r, kv_r the ranks, r the rotary head size, v the value
    head size): Q h q_r + q_r a (e + r) (or h a (e + r) without a query rank), KV h (kv_r + r) +
    kv_r a (e + v), output a v h."""
    h, a = spec.hidden, spec.heads
    if not spec.is_mla:
        return h * _qkv_width(spec) + a * spec.head_dim * h
    qk, v, qr, kr = _qk_dim(spec), spec.v_head_dim, spec.q_lora_rank, spec.kv_lora_rank
    q = h * qr + qr * a * qk if qr else h * a * qk
    return q + h * (kr + spec.rope_head_dim) + kr * a * (spec.head_dim + v) + a * v * h


def _attention_replicated(spec: ModelSpec) -> int:
    """Weights of the attention whole on every GPU of a TP group: MLA's down-projections h q_r + h (kv_r + r),
    which Megatron-LM's ``MLASelfAttention`` duplicates (``parallel_mode="duplicated"``) and runs on each
    GPU's 1/T of the sequence (the executor's :class:`executor.mla.LatentAttention` alike); 0 otherwise."""
    if not spec.is_mla:
        return 0
    return spec.hidden * (spec.q_lora_rank + spec.kv_lora_rank + spec.rope_head_dim)


def _attention_norms(spec: ModelSpec) -> int:
    """Norms inside the attention (whole on every GPU): Qwen3's per-head q/k RMSNorm (2e), MLA's
    latent RMSNorms (q_r + kv_r)."""
    return (2 * spec.head_dim if spec.qk_norm else 0) + (spec.q_lora_rank + spec.kv_lora_rank)


def _attention_core_flops(spec: ModelSpec) -> float:
    """FLOPs of QK^T and attention x V for one micro-batch: 2bs^2 a (e_qk + v) (= 4bs^2h)."""
    return 2.0 * spec.micro_batch * spec.seq_len ** 2 * spec.heads * (_qk_dim(spec) + spec.v_head_dim)


def is_moe_block(spec: ModelSpec, i: int) -> bool:
    """Block ``i`` has a mixture-of-experts MLP (the first ``dense_layers`` keep a dense one)."""
    return spec.is_moe and i >= spec.dense_layers


def _moe_par(tp: int, parallel: Parallel | None) -> Parallel:
    """What holds a MoE block's experts: ``parallel``, else T alone (EP = ETP = 1)."""
    return parallel if parallel is not None else Parallel(tp=tp)


def block_params(spec: ModelSpec, tp: int = 1, moe: bool = False, parallel: Parallel | None = None) -> int:
    """Parameters of one transformer block on one of ``tp`` GPUs: the matrices and the
    column-parallel biases split, the norms, the row-parallel biases and MLA's down-projections
    (:func:`_attention_replicated`) whole (``tp`` = 1:
    (4 + 2m)h^2 + (9 + m)h = 12h^2 + 13h for GPT). ``moe``: its MLP is a mixture of experts,
    held as ``parallel`` says (:func:`cost_models.moe.moe_share`; default EP = ETP = 1)."""
    h, f, qkv = spec.hidden, spec.ffn, _qkv_width(spec)
    if moe:
        share = moe_share(spec, _moe_par(tp, parallel))
        mlp = share.params_dense + share.params_expert
    else:
        mlp = _mlp_matrices(spec) * h * f // tp
    mats = attention_matrices(spec)
    if spec.kind == "llama":
        col_bias, row_bias, norms = (qkv if spec.qkv_bias else 0), 0, 2 * h + _attention_norms(spec)
    else:
        col_bias, row_bias, norms = qkv + f, 2 * h, 4 * h
        mats += _mlp_matrices(spec) * h * f
        mlp = 0
    whole = _attention_replicated(spec)
    return (mats - whole + col_bias) // tp + whole + mlp + row_bias + norms


def block_flops(spec: ModelSpec, tp: int = 1, moe: bool = False,
                parallel: Parallel | None = None) -> tuple[float, float, float]:
    """(forward, input-gradient, weight-gradient) FLOPs of one block for one micro-batch on one of
    ``tp`` GPUs (the module docstring's P, F, B, W; a MoE block's MLP from
    :func:`cost_models.moe.moe_share`)."""
    b, s, h = spec.micro_batch, spec.seq_len, spec.hidden
    lin = 2 * b * s * attention_matrices(spec) / tp
    if moe:
        share = moe_share(spec, _moe_par(tp, parallel))
        lin += share.flops_dense + share.flops_expert
    else:
        lin += 2 * b * s * _mlp_matrices(spec) * h * spec.ffn / tp
    att = _attention_core_flops(spec) / tp
    return float(lin + att), float(lin + 2 * att), float(lin)


def recompute_flops(spec: ModelSpec, recompute: str = "none", tp: int = 1, moe: bool = False,
                    parallel: Parallel | None = None) -> float:
    """Extra forward FLOPs the input backward of one block re-runs: 0, 4bs^2h/t (selective) or F (full)."""
    _check_recompute(recompute)
    if recompute == "none":
        return 0.0
    if recompute == "selective":
        return _attention_core_flops(spec) / tp
    return block_flops(spec, tp, moe, parallel)[0]


def _attention_split_bytes(spec: ModelSpec) -> float:
    """Attention tensors kept and split over t, per micro-batch: Q (a e_qk), K (k e_qk), V (k v), the
    output projection's input (a v) (= 2sbh + 2sbke when e = h / a), and MLA's latents, each twice
    as Megatron-LM's ``MLASelfAttention`` keeps them (its q/kv layernorm keeps its input, the up
    projection the normalised latent): the query latent's norm input and output (2 q_r), the
    down-projected key/value latent with its rotary part (kv_r + r, the KV norm's input is a view of
    it) and the normalised key/value latent (kv_r): 2 q_r + 2 kv_r + r (the attention kernel takes
    v at its own head size, unpadded: :class:`executor.mla.LatentAttention`)."""
    sb, a, k = spec.seq_len * spec.micro_batch, spec.heads, spec.kv
    qk, v = _qk_dim(spec), spec.v_head_dim
    width = a * qk + k * qk + k * v + a * v
    if spec.is_mla:
        width += 2 * spec.q_lora_rank + 2 * spec.kv_lora_rank + spec.rope_head_dim
    return float(sb * width * spec.dtype_bytes)


def _attention_score_bytes(spec: ModelSpec, mask: int) -> float:
    """The attention core's kept bytes per micro-batch (the module docstring's A): eager
    a s^2 b (d + mask + mask x d), flash 4 a s b."""
    a, s, b, d = spec.heads, spec.seq_len, spec.micro_batch, spec.dtype_bytes
    if spec.attention_kind == "eager":
        return float(a * s * s * b * (d + mask + mask * d))
    return float(4 * a * s * b)


def block_activation_bytes(spec: ModelSpec, recompute: str = "none", dropout: bool | None = None, tp: int = 1,
                           sp: bool = False, moe: bool = False, parallel: Parallel | None = None) -> float:
    """Bytes one block keeps from F to B for one micro-batch on one of ``tp`` GPUs (``sp``:
    sequence parallel; ``dropout`` None: the model's; see the module docstring; a MoE block's MLP
    from :func:`cost_models.moe.moe_share`)."""
    _check_recompute(recompute)
    b, s, h, d = spec.micro_batch, spec.seq_len, spec.hidden, spec.dtype_bytes
    mask = 1 if (spec.has_dropout if dropout is None else dropout) else 0
    sbh = s * b * h
    if recompute == "full":
        return float(sbh * d) / _sp_div(tp, sp)
    replicated = sbh * (4 * d + 2 * mask)
    split = _attention_split_bytes(spec)
    mlp = moe_share(spec, _moe_par(tp, parallel)).act if moe else \
        _mlp_matrices(spec) * s * b * spec.ffn * d / tp
    scores = _attention_score_bytes(spec, mask)
    kept = replicated / _sp_div(tp, sp) + split / tp + mlp
    if recompute == "selective":
        return float(kept)
    return float(kept + scores / tp)


def block_weight_grad_bytes(spec: ModelSpec, tp: int = 1, sp: bool = False, moe: bool = False,
                            parallel: Parallel | None = None) -> float:
    """Bytes alive between a block's input backward and its weight backward on one of ``tp`` GPUs:
    the linear layers' inputs and output gradients ((8 + 2m) sbh d for GPT at t = 1; a MoE MLP
    keeps what its experts' weight gradients read: its kept activations)."""
    s, b, h, f, d = spec.seq_len, spec.micro_batch, spec.hidden, spec.ffn, spec.dtype_bytes
    sb = s * b
    whole = 4 * sb * h                     # QKV and fc1 inputs, o and fc2 output gradients
    up = 2 if spec.kind == "llama" else 1  # SwiGLU: gate and up outputs
    if moe:
        mlp = moe_share(spec, _moe_par(tp, parallel)).act
        split = sb * h + sb * _qkv_width(spec)
    else:
        mlp = 0.0
        split = sb * h + sb * f + sb * _qkv_width(spec) + up * sb * f
    return float(whole * d) / _sp_div(tp, sp) + float(split * d) / tp + mlp


def boundary_bytes(spec: ModelSpec) -> float:
    """Bytes of the hidden states a stage sends to the next one (and of the gradient sent back): bsh d
    (for the whole tensor-parallel group)."""
    return float(spec.micro_batch * spec.seq_len * spec.hidden * spec.dtype_bytes)


# ---------------------------------------------------------------------------- the layer stack
@dataclass(frozen=True)
class Layer:
    """One layer of the stack: FLOPs per micro-batch, parameter count, bytes per micro-batch (per
    GPU of a tensor-parallel group)."""

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


def _vocab_share(spec: ModelSpec, tp: int) -> int:
    """Rows of the vocabulary one of ``tp`` GPUs holds (vocabulary-parallel: ceil(V / t))."""
    return -(-spec.vocab // tp)


def embedding_layer(spec: ModelSpec, dropout: bool | None = None, tp: int = 1, sp: bool = False) -> Layer:
    b, s, h, d = spec.micro_batch, spec.seq_len, spec.hidden, spec.dtype_bytes
    mask = 1 if (spec.has_dropout if dropout is None else dropout) else 0
    positions = 0 if spec.kind == "llama" else s * h                  # llama: rotary, no table
    params = _vocab_share(spec, tp) * h + positions + (4 * h if spec.kind == "bert" else 0)
    ids = 8 * b * s                                                    # int64 token ids
    act = ids + b * s * h * ((d if spec.kind == "bert" else 0) + mask) / _sp_div(tp, sp)
    # a split backward computes the tables' gradients in B (a scatter-add, no FLOPs to defer): none waits for W
    return Layer("embedding", "embedding", 0.0, 0.0, 0.0, 0.0, params, float(act), 0.0, boundary_bytes(spec))


def head_layer(spec: ModelSpec, tp: int = 1, sp: bool = False) -> Layer:
    b, s, h, d = spec.micro_batch, spec.seq_len, spec.hidden, spec.dtype_bytes
    V = _vocab_share(spec, tp)
    bsh = b * s * h / _sp_div(tp, sp)
    logits = b * s * V
    if spec.kind == "bert":     # MLM transform (dense h x h, GeLU, layernorm) then the decoder V x h + bias
        params = h * h + h + 2 * h + V * h + V
        flops = 2.0 * b * s * h * h + 2.0 * b * s * h * V
        act = 4 * bsh * d + logits * LOGIT_BYTES
        act_w = 3 * bsh * d + logits * d
    else:                       # final norm (LayerNorm 2h, RMSNorm h) then the V x h projection (no bias)
        params = (h if spec.kind == "llama" else 2 * h) + V * h
        flops = 2.0 * b * s * h * V
        act = 2 * bsh * d + logits * LOGIT_BYTES
        act_w = bsh * d + logits * d
    return Layer("head", "head", flops, flops, flops, 0.0, params, float(act), float(act_w), 0.0)


def transformer_layers(spec: ModelSpec, recompute: str = "none", dropout: bool | None = None, tp: int = 1,
                       sp: bool = False, parallel: Parallel | None = None) -> list[Layer]:
    """[embedding, block0, ..., block(L-1), head]: L + 2 layers, per GPU of a ``tp`` group (a MoE
    model's experts as ``parallel`` holds them: EP, ETP, imbalance; default EP = ETP = 1)."""
    def block(moe: bool) -> dict:
        f, bi, w = block_flops(spec, tp, moe, parallel)
        return dict(flops_f=f, flops_b_input=bi, flops_w=w,
                    flops_recompute=recompute_flops(spec, recompute, tp, moe, parallel),
                    params=block_params(spec, tp, moe, parallel),
                    act_bytes=block_activation_bytes(spec, recompute, dropout, tp, sp, moe, parallel),
                    act_w_bytes=block_weight_grad_bytes(spec, tp, sp, moe, parallel), out_bytes=boundary_bytes(spec))
    kinds = {moe: block(moe) for moe in {is_moe_block(spec, i) for i in range(spec.layers)}}
    blocks = [Layer(f"block{i}", "block", **kinds[is_moe_block(spec, i)]) for i in range(spec.layers)]
    return [embedding_layer(spec, dropout, tp, sp), *blocks, head_layer(spec, tp, sp)]


@lru_cache(maxsize=1024)
def _layers(spec: ModelSpec, recompute: str, dropout: bool, tp: int, sp: bool, parallel: Parallel | None):
    """:func:`transformer_layers` once per argument set (its layers are frozen): the layout search
    costs thousands of records whose layers differ in none of these."""
    return tuple(transformer_layers(spec, recompute, dropout, tp, sp, parallel))


@lru_cache(maxsize=1024)
def _kernel_times(spec: ModelSpec, device: DeviceSpec, precision: str, recompute: str, dropout: bool, tp: int,
                  sp: bool, grad_accumulation: str, fp8_recipe: str | None):
    """:func:`cost_models.kernels.transformer_layer_times` once per argument set."""
    return tuple(transformer_layer_times(spec, device, precision, recompute, dropout, tp=tp, sp=sp,
                                         grad_accumulation=grad_accumulation, fp8_recipe=fp8_recipe))


def model_params(spec: ModelSpec, tied_embeddings: bool | None = None) -> int:
    """Parameters of the whole model. ``tied_embeddings`` (default: the model's, True for gpt)
    counts the output projection once with the embedding table, as the papers' model sizes do."""
    layers = transformer_layers(spec)
    total = sum(l.params for l in layers)
    if spec.tied if tied_embeddings is None else tied_embeddings:
        total -= spec.vocab * spec.hidden
    return total


def active_params(spec: ModelSpec, tied_embeddings: bool | None = None) -> int:
    """Parameters one token passes through: :func:`model_params` less, in every MoE block, the
    routed experts it is not sent to (E - k of them); = :func:`model_params` for a dense model."""
    return model_params(spec, tied_embeddings) - spec.moe_layers * (moe_mlp_params(spec) - moe_mlp_active_params(spec))


def model_flops(spec: ModelSpec, recompute: str = "none") -> float:
    """FLOPs of one micro-batch's forward + backward through the whole model."""
    return sum(l.flops_total for l in transformer_layers(spec, recompute))


def megatron_flops(global_batch: int, seq_len: int, layers: int, hidden: int, vocab: int, *,
                   recompute: bool = True) -> float:
    """FLOPs of one iteration by Narayanan et al. (SC'21), Eq. (3): with full recomputation (the
    blocks' forward run twice) 96 B s l h^2 (1 + s/6h + V/16lh); without (``recompute`` False: the
    model FLOPs of MFU, every pass once) 72 B s l h^2 (1 + s/6h + V/12lh)."""
    B, s, l, h, V = global_batch, seq_len, layers, hidden, vocab
    if recompute:
        return 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
    return 72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))


# ---------------------------------------------------------------------------- tensor-parallel collectives
COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather")


@dataclass(frozen=True)
class Collectives:
    """The tensor-parallel collectives of one layer for one micro-batch: ``forward`` and
    ``backward`` (the input backward), each a tuple of (kind, bytes of the whole tensor)."""

    forward: tuple[tuple[str, float], ...] = ()
    backward: tuple[tuple[str, float], ...] = ()


def ring_bytes(kind: str, nbytes: float, tp: int) -> float:
    """Bytes each of ``tp`` GPUs sends in a ring collective of an ``nbytes`` tensor: all-reduce
    2(t-1)/t S, reduce-scatter and all-gather (t-1)/t S."""
    if kind not in COLLECTIVES:
        raise ValueError(f"unknown collective {kind!r}")
    return (2.0 if kind == "all-reduce" else 1.0) * (tp - 1) / tp * nbytes


def layer_collectives(spec: ModelSpec, recompute: str = "none", tp: int = 1, sp: bool = False) -> list[Collectives]:
    """Per layer of :func:`transformer_layers`, its tensor-parallel collectives (none at t = 1;
    see the module docstring)."""
    _check_recompute(recompute)
    n = spec.layers + 2
    if tp == 1:
        return [Collectives()] * n
    out = boundary_bytes(spec)
    stats = 3 * spec.micro_batch * spec.seq_len * 4.0        # the loss's fp32 max, sum and target logit
    pair = (("all-gather", out), ("reduce-scatter", out)) if sp else (("all-reduce", out),)
    fwd = pair * 2
    block = Collectives(fwd, fwd + (fwd if recompute == "full" else ()))
    embed = Collectives((("reduce-scatter" if sp else "all-reduce", out),))
    head = Collectives(((("all-gather", out),) if sp else ()) + (("all-reduce", stats),) * 3,
                       (("reduce-scatter" if sp else "all-reduce", out),))
    return [embed, *([block] * spec.layers), head]


@dataclass(frozen=True)
class TensorParallelGroup:
    """The links of one tensor-parallel group: ``size`` consecutive GPUs of ``cluster`` (unplaced:
    GPU i is device i), inside one node when ``size`` <= devices per node, across ``size`` /
    devices-per-node nodes otherwise. Collective times by :func:`cost_models.comm.allreduce_time`
    (a ring inside a node, hierarchical across nodes); a reduce-scatter or an all-gather is half an
    all-reduce (one of its two ring passes)."""

    cluster: Cluster
    size: int

    def time(self, kind: str, nbytes: float) -> float:
        t = allreduce_time(self.cluster, range(self.size), nbytes)
        return t if kind == "all-reduce" else t / 2

    def phase_time(self, ops: tuple[tuple[str, float], ...]) -> float:
        return sum(self.time(kind, nbytes) for kind, nbytes in ops)


# ---------------------------------------------------------------------------- context parallelism
def cp_local(spec: ModelSpec, cp: int) -> ModelSpec:
    """The model as one GPU of a context-parallel group of ``cp`` sees it: s/C tokens of each
    sequence (every per-token quantity of the formulas above is the formula at s/C)."""
    return spec if cp == 1 else spec.replace(seq_len=spec.seq_len // cp)


def cp_chunks(rank: int, cp: int) -> tuple[int, int]:
    """The two of the sequence's 2C equal chunks CP rank ``rank`` holds: i and 2C-1-i (causal load
    balance, :func:`context_parallel_layers`)."""
    if not 0 <= rank < cp:
        raise ValueError(f"CP rank {rank} is not in 0..{cp - 1}")
    return rank, 2 * cp - 1 - rank


def cp_kv_block_bytes(spec: ModelSpec, cp: int, tp: int = 1) -> float:
    """Bytes of one GPU's K and V block: its s/C tokens' keys and values over its k/t key/value
    heads, (s/C) b (k/t) (e_qk + v) d (= 2 (s/C) b k e d / t when e_qk = v = e)."""
    return float((spec.seq_len // cp) * spec.micro_batch * spec.kv * (_qk_dim(spec) + spec.v_head_dim)
                 * spec.dtype_bytes) / tp


def context_parallel_layers(spec: ModelSpec, parallel: Parallel, dropout: bool | None = None) -> list[Layer]:
    """:func:`transformer_layers` on one GPU of a T x C group (``parallel.cp`` = C > 1).

    Each GPU holds s/C tokens of every sequence: 2C chunks of s/(2C), chunks i and 2C-1-i on CP
    rank i. Every per-token quantity is the formula at s/C (:func:`cp_local`): the linear layers'
    FLOPs, the activations (Korthikanti's R, S, the flash row statistics), the bytes kept for W,
    the stage boundary's bytes, the head's logits, the embedding's ids. Two terms pair each local
    query with all s keys, so they are (s/C) x s = C (s/C)^2, 1/C of the whole, not 1/C^2: the
    attention core's FLOPs (the formula's 4bs^2h, F; twice in B; re-run by selective or full
    recomputation) and eager attention's kept scores. The parameters are the whole model's (CP splits no
    weight; the learned position table stays whole). ``out_bytes`` stays the whole group's, bsh d, as
    with T alone: the simulator's rank is the T x C GPUs, each sending its bsh d / (T C) over its own
    link (:func:`cost_models.cluster.tensor_parallel_groups`), 1/C of a GPU's bytes without CP.

    Why the core is exactly 1/C of the causal attention on every GPU: with m = s/(2C) tokens a chunk,
    chunk q attends to chunks 0..q-1 whole (m^2 token pairs each) and to itself causally
    (m(m+1)/2). CP rank i holds chunks i and 2C-1-i: i m^2 + (2C-1-i) m^2 + 2 m(m+1)/2 =
    (2C-1) m^2 + m^2 + m = m (2Cm + 1) = s (s+1) / (2C), the same for every i and 1/C of the
    s (s+1)/2 pairs of the causal whole (a contiguous split would give the last rank (2C-1)/C times
    the mean). The formulas count the full square (Megatron's 4bs^2h convention), and there the
    share is (s/C) x s / s^2 = 1/C as well. In the ring each of the C steps pairs the local
    queries with one rank's K/V block and does the same work, 1/C of the GPU's core: the local
    block (diagonal: two half chunks and one whole), a block of a lower rank (both local chunks
    against its first chunk) or of a higher one (the local second chunk against both)."""
    C, tp, sp = parallel.cp, parallel.tp, parallel.sequence_parallel
    local = cp_local(spec, C)
    mask = 1 if (spec.has_dropout if dropout is None else dropout) else 0
    L = transformer_layers(local, parallel.recompute, dropout, tp, sp, replace(parallel, cp=1))
    core = (_attention_core_flops(spec) / C - _attention_core_flops(local)) / tp       # (C - 1) x the local core
    again = 0.0 if parallel.recompute == "none" else core
    scores = (_attention_score_bytes(spec, mask) / C - _attention_score_bytes(local, mask)) / tp \
        if parallel.recompute == "none" else 0.0
    embed = embedding_layer(spec, dropout, tp, sp).params       # the whole position table
    whole = boundary_bytes(spec)
    out = [replace(L[0], params=embed, out_bytes=whole)]
    out += [replace(x, flops_f=x.flops_f + core, flops_b_input=x.flops_b_input + 2 * core,
                    flops_recompute=x.flops_recompute + again, act_bytes=x.act_bytes + scores, out_bytes=whole)
            for x in L[1:-1]]
    return out + [L[-1]]


@dataclass(frozen=True)
class ContextParallelGroup:
    """The links of one context-parallel group: CP ranks 0..C-1 at stride T among T x C consecutive
    GPUs of ``cluster`` (unplaced), TP fastest. Its T GPUs of a CP rank move their 1/t shares side
    by side, so the group is priced as C consecutive devices of the cluster the tensor-parallel
    groups make (:func:`cost_models.cluster.tensor_parallel_groups`: a device T ports wide, the
    node's NICs shared out), each message T x the bytes of one GPU: inside a node when T x C <=
    devices per node, else across nodes (hierarchical rings, :func:`cost_models.comm.allreduce_time`).

    ``ring_step(nbytes)``: one step of the ring, every CP rank sending ``nbytes`` (per GPU) to the
    next at once (:func:`cost_models.comm.step_time`: each link's bandwidth shared by the transfers
    crossing it). ``all_gather(nbytes)``: an all-gather that leaves ``nbytes`` per GPU (a ring's
    (C-1)/C of it sent), half a ring all-reduce; a reduce-scatter of ``nbytes`` takes as long.
    ``all_reduce(nbytes)``: a ring (or hierarchical) all-reduce of ``nbytes`` per GPU."""

    cluster: Cluster
    tp: int
    size: int
    _memo: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    def _net(self) -> Cluster:
        net = self._memo.get("net")
        if net is None:
            net = self._memo["net"] = tensor_parallel_groups(self.cluster.with_device_map(None), self.tp)
            if net.num_devices < self.size:
                raise SpecError(f"--cp {self.size} needs {self.size * self.tp} GPUs per pipeline device; cluster "
                                f"{self.cluster.name} has {self.cluster.num_devices}")
        return net

    def ring_step(self, nbytes: float) -> float:
        key = ("ring", nbytes)
        if key not in self._memo:
            C = self.size
            self._memo[key] = step_time(self._net(), [(i, (i + 1) % C, nbytes * self.tp) for i in range(C)])
        return self._memo[key]

    def all_reduce(self, nbytes: float) -> float:
        key = ("ar", nbytes)
        if key not in self._memo:
            self._memo[key] = allreduce_time(self._net(), range(self.size), nbytes * self.tp)
        return self._memo[key]

    def all_gather(self, nbytes: float) -> float:
        return self.all_reduce(nbytes) / 2


@dataclass(frozen=True)
class CpExchange:
    """One attention block's K/V exchange on one GPU of a context-parallel group, per micro-batch:
    bytes it sends and seconds, in F and in the input backward (B, with a recomputation's
    forward exchange again), each split into ``*_exposed`` (added to the op) and hidden behind the
    attention core. :meth:`TransformerCostModel.cp_exchange` gives the closed forms."""

    f_bytes: float
    b_bytes: float
    f_time: float
    f_exposed: float
    b_time: float
    b_exposed: float

    @property
    def f_hidden(self) -> float:
        return self.f_time - self.f_exposed

    @property
    def b_hidden(self) -> float:
        return self.b_time - self.b_exposed


@dataclass(frozen=True)
class DataParallelGroup:
    """The links of one data-parallel group of ``size`` replicas on ``cluster`` (unplaced: replica k
    is the k-th block of ``stride`` consecutive GPUs, T x C x D of them under the sequential map,
    so the members of a stage's group sit ``stride`` GPUs apart): a ZeRO / FSDP shard group, or
    with HSDP a replicate group (stride: the shard group's GPUs). Collective times as
    :class:`TensorParallelGroup` gives them: :func:`cost_models.comm.allreduce_time` over the
    members (a ring inside a node, hierarchical across nodes), a reduce-scatter or an all-gather
    half an all-reduce of the same whole tensor; 0 for one member or no bytes."""

    cluster: Cluster
    size: int
    stride: int
    inner: int = 1
    inner_stride: int = 1

    @property
    def members(self) -> int:
        """GPUs in the group: ``size`` replicas x ``inner`` GPUs of each (with context parallelism
        the C GPUs of a pipeline device, ``inner_stride`` = T apart, hold the same weights and
        shard them too, as torchtitan's FSDP shards over dp_shard x cp)."""
        return self.size * self.inner

    def time(self, kind: str, nbytes: float) -> float:
        if kind not in COLLECTIVES:
            raise ValueError(f"unknown collective {kind!r}")
        if self.members <= 1 or nbytes <= 0:
            return 0.0
        fixed, per_byte = _allreduce_line(self.cluster, self.size, self.stride, self.inner, self.inner_stride)
        t = fixed + per_byte * nbytes
        return t if kind == "all-reduce" else t / 2


@lru_cache(maxsize=4096)
def _allreduce_line(cluster: Cluster, size: int, stride: int, inner: int = 1,
                    inner_stride: int = 1) -> tuple[float, float]:
    """(seconds, seconds per byte): :func:`cost_models.comm.allreduce_time` over ``size`` blocks
    ``stride`` GPUs apart, ``inner`` GPUs ``inner_stride`` apart in each, is affine in the bytes
    (latencies + bytes over bandwidths, every form), so it is found once per group (a group of
    hundreds of GPUs takes milliseconds to walk)."""
    ranks = sorted(r * stride + c * inner_stride for r in range(size) for c in range(inner))
    fixed = allreduce_time(cluster, ranks, 0.0)
    big = 2.0 ** 40
    return fixed, (allreduce_time(cluster, ranks, big) - fixed) / big


def static_bytes_split(dtype_bytes: float, grad_bytes: float, bytes_per_param: float) -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) bytes per parameter out of ``bytes_per_param`` in all."""
    w, g = float(dtype_bytes), float(grad_bytes)
    return w, g, max(0.0, bytes_per_param - w - g)


def mixed_precision_bytes(dtype_bytes: int) -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) bytes per parameter as Megatron-LM counts mixed
    precision with Adam: 16-bit weights (2), fp32 main gradients (4), fp32 master weights and the two
    Adam moments (4 + 8 = 12): 18 in all; an fp32 model has no master copy: 4 + 4 + 8 = 16."""
    if dtype_bytes == 2:
        return 2.0, 4.0, 12.0
    return float(dtype_bytes), float(dtype_bytes), 2.0 * dtype_bytes


@dataclass(frozen=True)
class TransformerCostModel:
    """Seconds and bytes for a transformer on a device, from the formulas above, per GPU of a
    tensor-parallel group.

    ``bind(schedule)`` gives :class:`StageCosts` in seconds ("s") and bytes ("B").

    parallel: the job's knobs (:class:`cost_models.parallel.Parallel`): ``recompute`` of the
      blocks, ``tp``, ``sequence_parallel``, ``tp_overlap``, ``zero``; its ``micro_batch`` and
      ``seq_len``, when given, are applied to ``model``.
    bytes_per_param: static bytes per parameter (weights + gradients + optimizer state); default
      :func:`mixed_precision_bytes` (18 for a 16-bit model). grad_bytes_per_param: bytes all-reduced
      per parameter (default the model's dtype_bytes: gradients reduced in 16 bits, then
      accumulated into the fp32 main gradients). precision: fp16 | bf16 | fp32 | ... (default bf16
      when the device has it for 2-byte models, else fp16; fp32 for 4-byte models). dropout: the
      masks count in the activations (None: the model's). partition: layers per stage over the
      L + 2 layers (default :func:`default_partition`). optimizer_bytes_touched: bytes the optimizer
      step reads and writes per parameter (default gradients + 2 x optimizer state + weights); its
      time is that over the device's memory bandwidth. The local hand-off of a V turn copies the
      boundary tensor once (read + write) at memory bandwidth. compute: ``linear`` (FLOPs at a fixed
      efficiency: per-sample costs independent of the micro-batch) or ``kernels`` (the kernel model
      of :mod:`cost_models.kernels`: costs depend on the micro-batch; needs the device's ``kernels:``
      constants).

    Tensor parallelism: ``tp`` GPUs per stage replica, ``sequence_parallel``, their collectives
    costed on ``tp_group`` (:class:`TensorParallelGroup`, required for ``tp`` > 1) and added to F
    and B, or with ``tp_overlap`` hidden behind the layer's compute (the phase takes
    max(compute, collectives): perfect overlap, the bound of what overlapping can gain).
    ``grad_accumulation`` (kernel model, gpt blocks): how Megatron-LM adds each micro-batch's weight
    gradients over micro-batches, ``fused`` into the weight-gradient GEMM (fp32 main gradients) or
    ``autograd`` into the 16-bit ``.grad`` (:data:`cost_models.kernels.GRAD_ACCUMULATION`).
    ``zero`` 1 with ``replicas`` R: the optimizer state (master weights and moments) is sharded
    over the R data-parallel replicas (each GPU keeps 1/R of it and updates 1/R of the parameters),
    and the gradient all-reduce becomes a reduce-scatter of the gradients plus an all-gather of
    the updated 16-bit weights: on a ring (R-1)/R (g + w) bytes per parameter, the bytes of an
    all-reduce of (g + w) / 2 per parameter, which is what the engines are given.

    ZeRO-2 / ZeRO-3 (FSDP), :meth:`fsdp_layer_times`: the shard group is S = ``dp_shard`` or all R
    replicas (``dp_group``, its links; HSDP: R / S groups replicate each other over
    ``replicate_group``). Per GPU at rest (:meth:`static_split`): optimizer state o / S (ZeRO >= 1),
    gradients g / S (ZeRO >= 2), weights w / S (ZeRO-3); a MoE block's routed experts over EDP the
    same way. ZeRO-3 also holds *gathered* weights, w per parameter of the whole (unsharded)
    tensor, counted in each rank's static memory (:meth:`gathered_bytes`). The gradients are
    reduce-scattered in every micro-batch's backward (in W where the schedule splits it), so a
    GPU never holds more than its 1/S of them: nothing is all-reduced by the engines at the step's
    end (``grad_bytes`` 0); the step's end runs, per rank after its last op, the optimizer on 1/S of
    the parameters, with HSDP first an all-reduce of the g_r / S shard over the replicate group,
    and (ZeRO-2, and ZeRO-3 without ``reshard_after_forward``) the all-gather of the updated
    weights, which a ZeRO-3 rank needs before its next step's first forward. The per-micro-batch
    collectives run on their own stream behind the layer's compute (FSDP's prefetch): a layer's F,
    input backward and W take max(compute, collectives).
    """

    model: ModelSpec
    device: DeviceSpec
    parallel: Parallel = field(default_factory=Parallel)
    bytes_per_param: float | None = None
    grad_bytes_per_param: float | None = None
    precision: str | None = None
    dropout: bool | None = None
    partition: tuple[int, ...] | None = None
    optimizer_bytes_touched: float | None = None
    compute: str = "linear"
    tp_group: TensorParallelGroup | None = None
    replicas: int = 1
    grad_accumulation: str = "fused"
    expert_group: ExpertGroup | None = None
    cp_group: ContextParallelGroup | None = None
    dp_group: DataParallelGroup | None = None
    replicate_group: DataParallelGroup | None = None
    # layers() and layer_costs() once per record (it is frozen: they cannot change); not a field of its value
    _memo: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    def __post_init__(self):
        if not isinstance(self.parallel, Parallel):
            raise SpecError(f"parallel must be a cost_models.parallel.Parallel; got {self.parallel!r}")
        if self.parallel.precision is not None:       # the job's, where this model was not given one
            if self.precision not in (None, self.parallel.precision):
                raise SpecError(f"precision {self.precision!r} differs from the job's --precision "
                                f"{self.parallel.precision}; give one")
            object.__setattr__(self, "precision", self.parallel.precision)
            self.device.peak(self.precision)            # one line naming the device's precisions
        # the job's micro-batch and sequence length, applied to the model once
        object.__setattr__(self, "model", self.parallel.sized(self.model))
        if self.grad_accumulation not in GRAD_ACCUMULATION:
            raise SpecError(f"grad_accumulation must be one of {', '.join(GRAD_ACCUMULATION)}; "
                            f"got {self.grad_accumulation!r}")
        if self.grad_accumulation != "fused" and (self.compute != "kernels" or self.model.kind != "gpt"):
            raise SpecError(f"--grad-accumulation {self.grad_accumulation} prices Megatron-LM's gpt block in the "
                            f"kernel model; this is a {self.model.kind} model with the {self.compute} cost model")
        if self.compute not in COST_MODELS:
            raise SpecError(f"cost model must be one of {', '.join(COST_MODELS)}; got {self.compute!r}")
        if self.compute == "kernels":
            DeviceRates.of(self.device, self.resolved_precision())   # fail fast: constants present
        if self.bytes_per_param is not None and self.bytes_per_param <= 0:
            raise SpecError(f"bytes_per_param must be > 0; got {self.bytes_per_param}")
        self.model.check_tensor_parallel(self.parallel.tp, sequence_parallel=self.parallel.sequence_parallel)
        if self.parallel.tp > 1 and (self.tp_group is None or self.tp_group.size != self.parallel.tp):
            raise SpecError(f"tensor parallel {self.parallel.tp} needs the group's links "
                            f"(tp_group of size {self.parallel.tp})")
        check_expert_parallel(self.model, self.parallel, self.replicas)
        self._check_context_parallel()
        edp = expert_data_parallel(self.parallel, self.replicas) if self.model.is_moe else 1
        group = self.expert_group
        if (self.parallel.ep > 1 or edp > 1) and (group is None or group.ep != self.parallel.ep):
            raise SpecError(f"expert parallel {self.parallel.ep} (EDP {edp}) needs the group's links "
                            f"(expert_group of {self.parallel.ep})")
        self._check_fsdp_groups()
        if self.compute == "kernels":
            check_priced(self.model)
        # fail fast on a device without a peak (e.g. cpu: use a calibration profile), and, for the
        # linear model, without an efficiency (the kernel model reads its constants instead)
        if self.compute == "kernels":
            self.device.peak(self.resolved_precision())
        else:
            self.flop_rate()

    @property
    def grad_bytes(self) -> float:
        """Bytes all-reduced per parameter by the engines at the step's end (ZeRO-1: the all-reduce
        equal to its reduce-scatter and all-gather; ZeRO-2/3: none, their collectives are in the
        layers' times and the step's end, :meth:`fsdp_layer_times`)."""
        if self.parallel.zero >= 2:
            return 0.0
        g = self.reduce_bytes
        return (g + self.model.dtype_bytes) / 2 if self.parallel.zero else g

    @property
    def reduce_bytes(self) -> float:
        """Bytes per parameter of the gradients as the data-parallel collectives move them (default the
        model's dtype_bytes: reduced in 16 bits)."""
        return float(self.model.dtype_bytes if self.grad_bytes_per_param is None else self.grad_bytes_per_param)

    @property
    def uses_dropout(self) -> bool:
        return self.model.has_dropout if self.dropout is None else self.dropout

    def resolved_precision(self) -> str:
        if self.precision is not None:
            return self.precision
        if self.model.dtype_bytes == 2:
            return "bf16" if self.device.has("bf16") else "fp16"
        if self.model.dtype_bytes == 4:
            return "fp32"
        raise SpecError(f"model {self.model.name!r}: no default precision for dtype_bytes "
                        f"{self.model.dtype_bytes}; pass precision=")

    def _attention_in_16_bits(self, L: list[Layer], f, b_in, rate: float):
        """fp8 runs the linear layers' GEMMs in 8 bits; the attention core (QK^T, x V) stays in 16
        (DeepSeek-V3, Transformer Engine): each block's core FLOPs at the 16-bit rate instead."""
        slow = self.device.achievable_flops("bf16" if self.device.has("bf16") else "fp16")
        core = _attention_core_flops(self.model) / (self.parallel.tp * self.parallel.cp)
        extra = core * (1 / slow - 1 / rate)
        again = {"none": 0, "selective": 1, "full": 1}[self.parallel.recompute]
        blocks = [l.kind == "block" for l in L]
        return (tuple(x + extra if blk else x for x, blk in zip(f, blocks)),
                tuple(x + (2 + again) * extra if blk else x for x, blk in zip(b_in, blocks)))

    def fp8_recipe(self) -> str | None:
        """The fp8 scaling recipe in force (None: not fp8)."""
        return (self.parallel.fp8_recipe or DEFAULT_RECIPE) if self.resolved_precision() == "fp8" else None

    def _fp8_overheads(self, L: list[Layer], f, b_in, w, rate: float | None):
        """What fp8 adds (:mod:`cost_models.fp8`): for the linear model (``rate``: its fp8 FLOP/s; the
        kernel model prices these as kernels) the output head back at the 16-bit rate (it is no
        Transformer Engine layer) and each block's quantize kernels' bytes at the memory
        bandwidth, the input casts in F and the output-gradient casts in B (the forward's again in
        B under full recomputation); for both, the recipe's amax all-reduces on the
        tensor-parallel group."""
        m, par, recipe = self.model, self.parallel, self.fp8_recipe()
        tp, d = par.tp, m.dtype_bytes
        rows = m.micro_batch * m.seq_len
        linears = [(_qkv_width(m) // tp, m.hidden), (m.hidden, m.heads * m.v_head_dim // tp)] + \
            [(m.ffn * (2 if m.kind == "llama" else 1) // tp, m.hidden), (m.hidden, m.ffn // tp)]
        cf = cb = 0.0
        if rate is not None:
            slow = 1 / self.device.achievable_flops("bf16" if self.device.has("bf16") else "fp16") - 1 / rate
            head = L[-1]
            f, b_in, w = (tuple(x[:-1]) + (x[-1] + fl * slow,) for x, fl in
                          ((f, head.flops_f), (b_in, head.flops_b_input + head.flops_recompute), (w, head.flops_w)))
        if rate is not None and self.device.memory_bandwidth:
            for n_out, n_in in linears:
                x, g = linear_cast_bytes(rows, n_out, n_in, recipe, d)
                cf, cb = cf + x / self.device.memory_bandwidth, cb + g / self.device.memory_bandwidth
            cb += cf if par.recompute == "full" else 0.0
        nf, nb = amax_reductions(recipe, tp, par.sequence_parallel)
        if nf or nb:
            one = self.tp_group.time("all-reduce", amax_bytes(len(linears)))
            cf, cb = cf + nf * one, cb + nb * one
        blocks = [l.kind == "block" for l in L]
        return (tuple(x + cf if blk else x for x, blk in zip(f, blocks)),
                tuple(x + cb if blk else x for x, blk in zip(b_in, blocks)), w)

    def flop_rate(self) -> float:
        """Achievable FLOP/s: the device's peak at the precision times its efficiency."""
        return self.device.achievable_flops(self.resolved_precision())

    def layers(self) -> list[Layer]:
        par = self.parallel       # a dense model's layers read none of the record but T, SP, recompute and C
        if par.cp > 1:
            return context_parallel_layers(self.model, par, self.uses_dropout)
        return list(_layers(self.model, par.recompute, self.uses_dropout, par.tp, par.sequence_parallel,
                            par if self.model.is_moe else None))

    @property
    def shard(self) -> int:
        """S: the replicas a ZeRO shard group spans (``dp_shard``, 0: all R)."""
        return self.parallel.dp_shard or self.replicas

    def _zero_shard(self, group: int | None = None) -> int:
        """The GPUs a parameter's sharded state is split over: its data-parallel ``group`` (default
        the shard group's S replicas of each of the C context-parallel ranks, which hold the same
        weights, as Megatron-LM's distributed optimizer shards over DP x CP; a MoE block's experts:
        EDP) with ZeRO, else 1."""
        return (self.shard * self.parallel.cp if group is None else group) if self.parallel.zero else 1

    def bytes_split(self) -> tuple[float, float, float]:
        """(weights, gradients, optimizer state) bytes per parameter, unsharded; the weights with the
        fp8 copies fp8 keeps for the step (:meth:`_fp8_weight_copies`)."""
        if self.bytes_per_param is None:
            w, g, o = mixed_precision_bytes(self.model.dtype_bytes)
        else:
            w, g, o = static_bytes_split(self.model.dtype_bytes, self.model.dtype_bytes, self.bytes_per_param)
        return w + self._fp8_weight_copies(), g, o

    def static_split(self, group: int | None = None) -> tuple[float, float, float]:
        """(weights, gradients, optimizer state) bytes per parameter held on one GPU at rest, over the
        shard group S (or ``group``): ZeRO-1 the optimizer state / S, ZeRO-2 also the gradients / S,
        ZeRO-3 also the weights / S (the weights ZeRO-3 gathers for the compute:
        :meth:`gathered_bytes`)."""
        w, g, o = self.bytes_split()
        shard = self._zero_shard(group)
        if shard == 1:
            return w, g, o
        zero = self.parallel.zero
        return (w / shard if zero >= 3 else w), (g / shard if zero >= 2 else g), o / shard

    def _fp8_weight_copies(self) -> float:
        """Bytes per parameter of the fp8 weight copies fp8 keeps for the step (row-wise and
        column-wise, :data:`cost_models.fp8.WEIGHT_COPY_BYTES`; counted on every parameter, the
        16-bit embedding's and head's too: an upper bound), written by the optimizer's pass."""
        return WEIGHT_COPY_BYTES if self.resolved_precision() == "fp8" else 0.0

    def optim_time_per_param(self, group: int | None = None) -> float:
        """Seconds of the optimizer step per parameter (ZeRO: 1/shard of the parameters updated: the
        gradients and weights read, the state read and written, (g + w) / S + 2 o / S)."""
        if not self.device.memory_bandwidth:
            return 0.0
        w, g, _ = self.bytes_split()
        o = self.static_split(group)[2]
        shard = self._zero_shard(group)
        touched = self.optimizer_bytes_touched / shard if self.optimizer_bytes_touched is not None else \
            (g + w) / shard + 2 * o
        return touched / self.device.memory_bandwidth

    # ------------------------------------------------------------------ ZeRO-2 / ZeRO-3 (FSDP)
    def _check_fsdp_groups(self) -> None:
        par = self.parallel
        if par.zero < 2:
            return
        S, R = self.shard, self.replicas
        if R % S:
            raise SpecError(f"--dp-shard {S} must divide the {R} replicas")
        if S * par.cp > 1 and (self.dp_group is None or (self.dp_group.size, self.dp_group.inner) != (S, par.cp)):
            times = f" x C={par.cp}" if par.cp > 1 else ""
            raise SpecError(f"ZeRO-{par.zero} over {S} replicas{times} needs the shard group's links (dp_group of "
                            f"size {S}{', inner ' + str(par.cp) if par.cp > 1 else ''})")
        if R // S > 1 and (self.replicate_group is None or self.replicate_group.size != R // S):
            raise SpecError(f"HSDP with {R // S} replicate groups needs their links (replicate_group of size "
                            f"{R // S})")

    def _edp_time(self, kind: str, nbytes: float) -> float:
        """A collective of ``nbytes`` (the whole tensor) over a MoE block's EDP group (as its ZeRO-1
        all-reduce is costed: EP x ETP GPUs apart on the expert group's cluster)."""
        par = self.parallel
        edp = expert_data_parallel(par, self.replicas)
        if edp <= 1 or nbytes <= 0 or self.expert_group is None:
            return 0.0
        return DataParallelGroup(self.expert_group.cluster, edp, par.ep * par.etp).time(kind, nbytes)

    def _dense_expert_params(self, L: list[Layer]) -> list[tuple[float, float]]:
        """Per layer: (parameters sharded over the shard group, routed experts' over EDP) on one GPU."""
        expert = self.moe_share().params_expert if self.model.is_moe else 0
        return [(float(l.params - (expert if m else 0)), float(expert if m else 0))
                for l, m in zip(L, self.moe_blocks())]

    @property
    def gather_bytes(self) -> float:
        """Bytes per parameter a ZeRO weight all-gather moves: the model's 16-bit (or 32-bit) weights,
        1 with ``fp8_gather`` (:func:`cost_models.fp8.gathered_weight_bytes`); the fp8 copies are made
        after the gather, not sent."""
        return gathered_weight_bytes(self.parallel, self.model.dtype_bytes)

    def fsdp_layer_times(self, L: list[Layer] | None = None) -> tuple[tuple[float, ...], ...]:
        """Per layer of :meth:`layers`, ZeRO-2/3's collective seconds ``(in F, in the input backward,
        in W, at the step's end)`` (all 0 below ZeRO-2). With p a layer's parameters on one GPU
        (T-sharded; a MoE block's routed experts over EDP instead of S), w :attr:`gather_bytes` and g_r
        :attr:`reduce_bytes` per parameter, whole-tensor sizes of each collective:

            every micro-batch:  reduce-scatter p g_r in W (the input backward's where unsplit)
            ZeRO-3, reshard_after_forward:  all-gather p w in F and again in the input backward
            step's end:  all-gather p w of the updated weights (ZeRO-2; ZeRO-3 without
                         reshard_after_forward: the next step's one gather, kept to its last B)
                         + HSDP: all-reduce p g_r / S over the R / S replicate groups

        so a GPU moves per step, on rings of S, (S-1)/S x p x [N g_r + w] (ZeRO-2, ZeRO-3 gathered
        once) or (S-1)/S x p x N (g_r + 2w) (reshard_after_forward), HSDP adding
        2 (R/S - 1)/(R/S) x p g_r / S (:meth:`fsdp_step_bytes`).

        Why per micro-batch: a GPU keeps only its 1/S of the gradients over a step of N
        micro-batches only if each micro-batch's are reduce-scattered as its backward makes them
        (DeepSpeed's ZeRO-2; Llama 3 shards optimizer state and gradients under its pipeline). The
        other choice, torchtitan's under ``torch.distributed.pipelining`` (``stage.py``:
        ``backward_maybe_with_nosync`` calls ``set_requires_gradient_sync(False)`` for every
        micro-batch, ``perform_reduce_grad`` reduce-scatters once after the stage's last B/W),
        sends 1/N of these bytes but holds the whole fp32 gradients through the step: ZeRO-1's
        gradient memory. ZeRO-3 gathered once (no ``reshard_after_forward``) gathers at the
        stage's first F and holds the weights to its last B; that gather is costed at the step's
        end, the same place on a rank's timeline between two steps (after its optimizer, before
        its next first F)."""
        if L is None:
            got = self._memo.get("fsdp")
            if got is None:
                got = self._memo["fsdp"] = self.fsdp_layer_times(self.layers())
            return got
        zero, n = self.parallel.zero, len(L)
        if zero < 2:
            return ((0.0,) * n,) * 4
        w, r = self.gather_bytes, self.reduce_bytes
        dp, rep, S = self.dp_group, self.replicate_group, self.shard

        def coll(kind: str, dense: float, expert: float) -> float:
            t = dp.time(kind, dense) if dp is not None else 0.0
            return t + self._edp_time(kind, expert)

        every = zero == 3 and self.parallel.reshard_after_forward
        times = {}          # the blocks are alike: each size of layer costed once
        for key in set(self._dense_expert_params(L)):
            dense, expert = key
            gather = coll("all-gather", dense * w, expert * w)
            rs = coll("reduce-scatter", dense * r, expert * r)
            hsdp = rep.time("all-reduce", dense * r / (S * self.parallel.cp)) if rep is not None else 0.0
            times[key] = (gather if every else 0.0, gather if every else 0.0, rs, hsdp + (0.0 if every else gather))
        rows = [times[key] for key in self._dense_expert_params(L)]
        return tuple(tuple(x[k] for x in rows) for k in range(4))

    def fsdp_step_bytes(self, params: float, microbatches: int) -> dict:
        """Bytes one GPU sends per step in ZeRO-2/3's collectives for ``params`` parameters held (a
        stage's, T-sharded; dense), by collective and where it runs, on rings (a ring's
        reduce-scatter or all-gather sends (n-1)/n of the whole tensor, its all-reduce twice that):
        ``per_microbatch`` (the reduce-scatters, and with ``reshard_after_forward`` the two
        gathers, times N), ``step_end`` (the gather of the updated weights, the HSDP all-reduce)."""
        zero, S, R, C = self.parallel.zero, self.shard, self.replicas, self.parallel.cp
        if zero < 2:
            return {"per_microbatch": 0.0, "step_end": 0.0}
        w, r = self.gather_bytes, self.reduce_bytes
        ring = (S * C - 1) / (S * C)
        every = zero == 3 and self.parallel.reshard_after_forward
        per_mb = ring * params * (r + (2 * w if every else 0.0))
        groups = R // S
        hsdp = 2 * (groups - 1) / groups * params * r / (S * C) if groups > 1 else 0.0
        end = (0.0 if every else ring * params * w) + hsdp
        return {"per_microbatch": microbatches * per_mb, "step_end": end}

    def fsdp_report(self, sched) -> dict:
        """What ZeRO-2/3's collectives cost on ``sched``, per stage: its parameters per GPU (dense
        part), seconds per micro-batch in F, B and W (each behind the layer's compute) and at the
        step's end, and bytes a GPU sends per step (:meth:`fsdp_step_bytes`); {} below ZeRO-2."""
        if self.parallel.zero < 2:
            return {}
        L = self.layers()
        fc, bc, wc, end = self.fsdp_layer_times()
        dense = [d for d, _ in self._dense_expert_params(L)]
        parts = layer_ranges(len(L), sched.num_stages, self.partition_for(sched.num_stages))
        N = sched.num_microbatches
        stages = []
        for r in parts:
            p = sum(dense[i] for i in r)
            stages.append({"params": p, "f": sum(fc[i] for i in r), "b": sum(bc[i] for i in r),
                           "w": sum(wc[i] for i in r), "step_end": sum(end[i] for i in r),
                           **{f"bytes_{k}": v for k, v in self.fsdp_step_bytes(p, N).items()}})
        return {"zero": self.parallel.zero, "shard": self.shard, "cp": self.parallel.cp,
                "replicate_groups": self.replicas // self.shard,
                "reshard_after_forward": self.parallel.reshard_after_forward, "stages": stages}

    def gathered_bytes(self, sched) -> tuple[float, ...]:
        """Per rank: the ZeRO-3 weights it holds gathered (whole tensors, w per parameter, beside
        its 1/S shard) at the peak. Without ``reshard_after_forward`` every stage it holds, from its
        first F to its last B (= the whole step's activations); with it, one layer at a time as
        FSDP gathers per module, and the next one prefetched: its two largest layers. 0 below
        ZeRO-3."""
        if self.parallel.zero < 3:
            return (0.0,) * sched.num_ranks
        w = self.bytes_split()[0]
        L = self.layers()
        parts = layer_ranges(len(L), sched.num_stages, self.partition_for(sched.num_stages))
        out = []
        for r in range(sched.num_ranks):
            held = held_stages(sched, r)
            if not self.parallel.reshard_after_forward:
                out.append(w * sum(L[i].params for s in held for i in parts[s]))
            else:
                sizes = sorted((L[i].params for s in set(held) for i in parts[s]), reverse=True)
                out.append(w * sum(sizes[:2]))
        return tuple(float(x) for x in out)

    def copy_time(self) -> float:
        if not self.device.memory_bandwidth:
            return 0.0
        return 2 * boundary_bytes(self.per_gpu_model) / self.device.memory_bandwidth

    def collectives(self) -> list[Collectives]:
        return layer_collectives(self.per_gpu_model, self.parallel.recompute, self.parallel.tp,
                                 self.parallel.sequence_parallel)

    def collective_times(self) -> list[tuple[float, float]]:
        """Per layer: seconds of its tensor-parallel collectives in F and in B."""
        if self.parallel.tp == 1:
            return [(0.0, 0.0)] * (self.model.layers + 2)
        g, cols = self.tp_group, self.collectives()
        times = {c: (g.phase_time(c.forward), g.phase_time(c.backward)) for c in set(cols)}   # blocks alike
        return [times[c] for c in cols]

    def layer_costs(self) -> LayerCosts:
        """Per-layer seconds and bytes (the input of :class:`PerLayerCostModel` and of planners)."""
        got = self._memo.get("layer_costs")
        if got is None:
            got = self._memo["layer_costs"] = self._layer_costs()
        return got

    def _layer_costs(self) -> LayerCosts:
        L = self.layers()
        if self.compute == "kernels":
            par = self.parallel
            t = _kernel_times(self.model, self.device, self.resolved_precision(), par.recompute, self.uses_dropout,
                              par.tp, par.sequence_parallel, self.grad_accumulation, par.fp8_recipe)
            f, b_in, w = (tuple(x[i] for x in t) for i in range(3))
            if self.resolved_precision() == "fp8":
                f, b_in, w = self._fp8_overheads(L, f, b_in, w, rate=None)   # the kernels hold the casts
        else:
            rate = self.flop_rate()
            f = tuple(l.flops_f / rate for l in L)
            b_in = tuple((l.flops_b_input + l.flops_recompute) / rate for l in L)
            w = tuple(l.flops_w / rate for l in L)
            if self.resolved_precision() == "fp8":
                f, b_in = self._attention_in_16_bits(L, f, b_in, rate)
                f, b_in, w = self._fp8_overheads(L, f, b_in, w, rate=rate)
        if self.parallel.tp > 1:
            comm = self.collective_times()
            join = max if self.parallel.tp_overlap else (lambda x, y: x + y)
            f = tuple(join(x, c) for x, (c, _) in zip(f, comm))
            b_in = tuple(join(x, c) for x, (_, c) in zip(b_in, comm))
        if self.parallel.cp > 1:
            f, b_in = self._with_cp_exchange(L, f, b_in)
        w_b, g_b, o_b = self.static_split()
        moe = self._cp_optim(L) if self.parallel.cp > 1 else {}
        if self.model.is_moe:
            a2a_f, a2a_b = self.all_to_all_times()
            f = tuple(x + y for x, y in zip(f, a2a_f))
            b_in = tuple(x + y for x, y in zip(b_in, a2a_b))
            moe = self._expert_memory(L, moe.get("optim_time"))
        if self.parallel.zero >= 2:     # FSDP's collectives behind each layer's compute, and at the step's end
            fc, bc, wc, end = self.fsdp_layer_times()
            f = tuple(max(x, c) for x, c in zip(f, fc))
            b_in = tuple(max(x, c) for x, c in zip(b_in, bc))
            w = tuple(max(x, c) for x, c in zip(w, wc))
            optim = moe.get("optim_time") or tuple(l.params * self.optim_time_per_param() for l in L)
            moe["optim_time"] = tuple(x + e for x, e in zip(optim, end))
            first = max((x for x, l in zip(fc, L) if l.kind == "block"), default=0.0)
            if first:       # the op's first block waits for its gather (FSDP prefetches the rest)
                moe["op_overhead"] = (("F", first), ("B", first))
        return LayerCosts(
            f=f,
            b_input=b_in,
            w=w,
            act=tuple(l.act_bytes for l in L),
            act_w=tuple(l.act_w_bytes for l in L),
            out_bytes=tuple(l.out_bytes for l in L),
            params=tuple(float(l.params) for l in L),
            bytes_per_param_static=w_b + g_b + o_b,
            grad_bytes_per_param=self.grad_bytes * self.parallel.tp,
            optim_time_per_param=self.optim_time_per_param(),
            copy_time=self.copy_time(),
            **moe,
        )

    # ------------------------------------------------------------------ context parallelism
    @property
    def per_gpu_model(self) -> ModelSpec:
        """The model at the tokens one GPU holds: s/C of each sequence with context parallelism
        (:func:`cp_local`), the model itself without."""
        return cp_local(self.model, self.parallel.cp)

    def _check_context_parallel(self) -> None:
        """C > 1: the model splits (:meth:`ModelSpec.check_context_parallel`), ZeRO at most 1 (its
        shards over R x C), the linear cost model prices it (the kernel model's attention kernels
        are whole-sequence ones) and the CP group's links are given."""
        par = self.parallel
        if par.cp == 1:
            return
        self.model.check_context_parallel(par.cp, par.tp, par.sequence_parallel)
        if self.compute == "kernels":
            raise SpecError(f"--cp {par.cp} is priced by --cost-model linear; the kernel model prices whole-sequence "
                            f"attention kernels (give --cost-model linear, the default with --cp)")
        if self.cp_group is None or self.cp_group.size != par.cp or self.cp_group.tp != par.tp:
            raise SpecError(f"context parallel {par.cp} needs the group's links (cp_group of size {par.cp} at "
                            f"tp {par.tp})")

    def _core_seconds(self) -> float:
        """Seconds of one block's attention core forward on one GPU (1/(T C) of the formula's
        4bs^2h, at the 16-bit rate where the linear layers run in fp8)."""
        rate = self.flop_rate()
        if self.resolved_precision() == "fp8":
            rate = self.device.achievable_flops("bf16" if self.device.has("bf16") else "fp16")
        return _attention_core_flops(self.model) / (self.parallel.tp * self.parallel.cp) / rate

    def cp_exchange(self) -> CpExchange:
        """One block's K/V exchange on one GPU per micro-batch (C > 1). With X = the GPU's K and V
        block (:func:`cp_kv_block_bytes`, 2 (s/C) b k e d / t), a = its attention core forward / C
        (the work of one ring step), p(n) = one ring step moving n bytes a GPU
        (:meth:`ContextParallelGroup.ring_step`):

        ``ring`` (C-1 steps, each hidden behind one step of attention compute):
            F bytes (C-1) X;  F time (C-1) p(X), exposed (C-1) max(0, p(X) - a)
            (the layer takes the first block's a + (C-1) max(a, p(X)) for its core);
            B bytes 2 (C-1) X: K,V travel the C-1 hops again and each block's dK,dV partial sums C-1
            hops home; C-2 steps move K,V and dK,dV together behind 2a (the core's backward is
            twice its forward), one step K,V alone, and the last dK,dV hop follows the last step:
            B time (C-2) p(2X) + 2 p(X), exposed (C-2) max(0, p(2X) - 2a) + max(0, p(X) - 2a) + p(X).
        ``allgather`` (Llama 3's: K,V all-gathered before the attention, exposed):
            F bytes (C-1) X, time AG(C X); B: K,V all-gathered again (only the local block is kept
            from F) and dK,dV reduce-scattered, bytes 2 (C-1) X, time AG(C X) + RS(C X), exposed.
        Selective or full recomputation re-runs the attention core in B with its exchange: B gains
        F's bytes and times."""
        par, g = self.parallel, self.cp_group
        C, X = par.cp, cp_kv_block_bytes(self.model, par.cp, par.tp)
        if par.cp_comm == "ring":
            a = self._core_seconds() / C
            p1, p2 = g.ring_step(X), g.ring_step(2 * X)
            f_time, f_exp = (C - 1) * p1, (C - 1) * max(0.0, p1 - a)
            b_time = (C - 2) * p2 + 2 * p1
            b_exp = (C - 2) * max(0.0, p2 - 2 * a) + max(0.0, p1 - 2 * a) + p1
        else:
            f_time = f_exp = g.all_gather(C * X)
            b_time = b_exp = 2 * g.all_gather(C * X)
        f_bytes, b_bytes = (C - 1) * X, 2 * (C - 1) * X
        if par.recompute != "none":
            b_bytes, b_time, b_exp = b_bytes + f_bytes, b_time + f_time, b_exp + f_exp
        return CpExchange(f_bytes, b_bytes, f_time, f_exp, b_time, b_exp)

    def _with_cp_exchange(self, L: list[Layer], f, b_in):
        """``f`` and ``b_in`` with each block's exposed K/V exchange added (:meth:`cp_exchange`)."""
        x = self.cp_exchange()
        blocks = [l.kind == "block" for l in L]
        return (tuple(t + x.f_exposed if blk else t for t, blk in zip(f, blocks)),
                tuple(t + x.b_exposed if blk else t for t, blk in zip(b_in, blocks)))

    def _cp_optim(self, L: list[Layer]) -> dict:
        """The LayerCosts field of the gradient reduction over the C GPUs of a pipeline device
        that hold the same weights. The R x C GPUs of a stage are reduced as a hierarchy: a
        reduce-scatter and an all-gather of each GPU's gradients inside the CP group (the ring time
        of an all-reduce of params x grad bytes, :meth:`ContextParallelGroup.all_reduce`; with ZeRO-1
        the gradients reduce-scattered and the 16-bit weights all-gathered, the same bytes as
        :attr:`grad_bytes`), charged at the step's end with the optimizer, and between them the
        all-reduce of each GPU's 1/C shard across the R replicas, which is the engine's
        ALLREDUCE of the collapsed rank: T x the GPU's gradient bytes over a port T x C GPUs wide."""
        per, g = self.optim_time_per_param(), self.cp_group
        if self.parallel.zero >= 2:       # the shard group's reduce-scatters span the C GPUs already
            return dict(optim_time=tuple(l.params * per for l in L))
        times = {p: p * per + g.all_reduce(p * self.grad_bytes) for p in {l.params for l in L}}
        return dict(optim_time=tuple(times[l.params] for l in L))

    def _cp_transient(self) -> float:
        """The K/V exchange's buffers on one GPU (0 without CP): ``ring`` two buffers of a K,V
        block and its dK,dV (one in use, one arriving), 4 X; ``allgather`` the gathered K,V and the
        whole dK,dV before its reduce-scatter, 2 C X; with recomputation under eager attention,
        the recomputed layer's scores beyond the local formula's ((s/C) x s of them, 1/C of the
        whole)."""
        par = self.parallel
        if par.cp == 1:
            return 0.0
        X = cp_kv_block_bytes(self.model, par.cp, par.tp)
        buffers = 4 * X if par.cp_comm == "ring" else 2 * par.cp * X
        scores = 0.0
        if par.recompute != "none":
            mask = 1 if self.uses_dropout else 0
            scores = (_attention_score_bytes(self.model, mask) / par.cp
                      - _attention_score_bytes(self.per_gpu_model, mask)) / par.tp
        return buffers + scores

    def cp_step_comm(self, sched) -> tuple[float, float]:
        """(exchange seconds, of which hidden) of the K/V exchange in one step on the busiest
        pipeline device of a built or lowered schedule: each F and B op of a stage runs its blocks'
        :meth:`cp_exchange`; (0, 0) without CP."""
        if self.parallel.cp == 1:
            return 0.0, 0.0
        x = self.cp_exchange()
        L = self.layers()
        parts = layer_ranges(len(L), sched.num_stages, self.partition_for(sched.num_stages))
        blocks = [sum(L[i].kind == "block" for i in r) for r in parts]
        best = (0.0, 0.0)
        for prog in sched.programs[:sched.num_devices]:
            t = h = 0.0
            for op in prog:
                if op.kind == "F":
                    t, h = t + blocks[op.stage] * x.f_time, h + blocks[op.stage] * x.f_hidden
                elif op.kind == "B":
                    t, h = t + blocks[op.stage] * x.b_time, h + blocks[op.stage] * x.b_hidden
            best = max(best, (t, h))
        return best

    # ------------------------------------------------------------------ mixtures of experts
    def moe_share(self):
        """One GPU's share of a MoE block's MLP (:func:`cost_models.moe.moe_share`)."""
        return moe_share(self.model, self.parallel)

    def a2a_times(self) -> tuple[float, float]:
        """Seconds of one MoE block's dispatch and combine all-to-alls on the expert group (0 with
        EP = 1: the experts are local)."""
        if self.expert_group is None:
            return 0.0, 0.0
        share = self.moe_share()
        return self.expert_group.time(share.dispatch_bytes), self.expert_group.time(share.combine_bytes)

    def moe_blocks(self) -> list[bool]:
        """Per layer of :meth:`layers` (embedding, blocks, head): whether it is a MoE block."""
        return [False] + [is_moe_block(self.model, i) for i in range(self.model.layers)] + [False]

    def all_to_all_times(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """Per layer, the all-to-all seconds in F (dispatch + combine) and in the input backward (their
        gradients, and the forward's again under full recomputation): 0 but in MoE blocks."""
        disp, comb = self.a2a_times()
        one = disp + comb
        back = one * (2 if self.parallel.recompute == "full" else 1)
        moe = self.moe_blocks()
        return tuple(one if m else 0.0 for m in moe), tuple(back if m else 0.0 for m in moe)

    def layer_segments(self, lc: LayerCosts) -> tuple[list[list[tuple[str, float]]], list[list[tuple[str, float]]]]:
        """Per layer, its F and its input backward as segments in order, ("compute" | "comm",
        seconds), summing to ``lc.f`` / ``lc.b_input``: a MoE block's F is the attention and the
        router, the dispatch, the experts (routed and shared), the combine; its B the combine's
        gradient, the experts' input gradients, the dispatch's gradient, the attention's (after
        the re-run forward's four under full recomputation); any other layer one compute segment.
        (The split DualPipe overlaps: the simulator's op phases.)"""
        disp, comb = self.a2a_times()
        share = self.moe_share() if self.model.is_moe else None
        experts = (share.flops_expert + share.flops_shared) / self.flop_rate() if share is not None else 0.0
        full = self.parallel.recompute == "full"
        fs, bs = [], []
        for f, b, moe in zip(lc.f, lc.b_input, self.moe_blocks()):
            if not moe:
                fs.append([("compute", f)])
                bs.append([("compute", b)])
                continue
            pre = f - disp - comb - experts
            fwd = [("compute", pre), ("comm", disp), ("compute", experts), ("comm", comb)]
            rest = b - (disp + comb) - experts - (f if full else 0.0)
            bs.append((fwd if full else []) + [("comm", comb), ("compute", experts), ("comm", disp),
                                              ("compute", rest)])
            fs.append(fwd)
        return fs, bs

    def _expert_memory(self, L: list[Layer], cp_optim: tuple[float, ...] | None = None) -> dict:
        """The LayerCosts fields of a MoE model's unlike parameters: its routed experts' optimizer
        state sharded over EDP with ZeRO-1 (the dense part's over R x C), their gradients all-reduced
        over EDP at the step's end (its ring time and the optimizer's share), and the pipeline's
        all-reduce of the dense part only. With C > 1 (``cp_optim``: :meth:`_cp_optim`'s per layer,
        the whole layer's) the dense part's reduction inside the CP group is charged as there, on
        the dense parameters alone (the experts' sum is EDP's, which spans the CP ranks)."""
        par = self.parallel
        edp = expert_data_parallel(par, self.replicas)
        dense, experts = sum(self.static_split()), sum(self.static_split(edp))
        expert = self.moe_share().params_expert
        mine = [expert if m else 0 for m in self.moe_blocks()]
        static = tuple((l.params - e) * dense + e * experts for l, e in zip(L, mine))
        per_param, exp_rate = self.optim_time_per_param(), self.optim_time_per_param(edp)
        reduce = 0.0
        if edp > 1 and self.expert_group is not None:
            group = range(0, edp * par.ep * par.etp, par.ep * par.etp)
            reduce = allreduce_time(self.expert_group.cluster, group, expert * self.grad_bytes)
        optim = tuple((l.params - e) * per_param + e * exp_rate + (reduce if e else 0.0) for l, e in zip(L, mine))
        if cp_optim is not None and par.zero < 2:      # the CP group's ring on the dense gradients
            optim = tuple(o + self.cp_group.all_reduce((l.params - e) * self.grad_bytes)
                          for o, l, e in zip(optim, L, mine))
        return dict(static_bytes=static, optim_time=optim,
                    reduced_params=tuple(float(l.params - e) for l, e in zip(L, mine)))

    def partition_for(self, num_stages: int) -> tuple[int, ...]:
        return self.partition if self.partition is not None else default_partition(self.model.layers, num_stages)

    def stage_params(self, num_stages: int) -> list[float]:
        """Parameter count of each stage on one GPU under :meth:`partition_for`."""
        parts = layer_ranges(self.model.layers + 2, num_stages, self.partition_for(num_stages))
        L = self.layers()
        return [float(sum(L[i].params for i in r)) for r in parts]

    def static_breakdown(self, sched) -> list[StaticMemory]:
        """Per rank (one GPU of its tensor-parallel group): parameters held and their weight /
        gradient / optimizer bytes at rest (ZeRO shards), and the weights ZeRO-3 gathers."""
        w, g, o = self.static_split()
        rows = static_memory(sched, self.stage_params(sched.num_stages), w, g, w + g + o)
        return [replace(m, gathered=x) for m, x in zip(rows, self.gathered_bytes(sched))]

    def transient_bytes(self) -> float:
        """What one GPU holds beyond the activation walk at its worst moment (see
        :mod:`cost_models.memory`): the layer being recomputed (full: all its activations from
        the re-run forward to its backward; selective: its attention scores) and the staging
        buffers of one send and one receive (bsh d / t each)."""
        m, tp, sp = self.per_gpu_model, self.parallel.tp, self.parallel.sequence_parallel
        layer = 0.0
        if self.parallel.recompute != "none" and m.layers:
            moe, par = is_moe_block(m, m.layers - 1), self.parallel
            layer = block_activation_bytes(m, "none", self.uses_dropout, tp, sp, moe, par) - \
                block_activation_bytes(m, par.recompute, self.uses_dropout, tp, sp, moe, par)
        buffers = 2 * self.moe_share().dispatch_bytes if m.is_moe and self.parallel.ep > 1 else 0.0
        return layer + 2 * boundary_bytes(m) / tp + buffers + self._cp_transient()

    def bind(self, sched) -> StageCosts:
        """The costs of ``sched``, with their floor: every op's FLOPs at the device's peak
        (:func:`cost_models.base.with_peak_floor`, the simulator's invariant)."""
        layers, lc = self.layers(), self.layer_costs()
        costs = with_peak_floor(PerLayerCostModel(lc, self.partition_for(sched.num_stages)).bind(sched), sched,
                                [x.flops_f for x in layers], [x.flops_b_input + x.flops_recompute for x in layers],
                                [x.flops_w for x in layers], self.partition_for(sched.num_stages),
                                self.device.peak(self.resolved_precision()))
        costs.meta.update(model="transformer", cost_model=self.compute, model_name=self.model.name,
                          device=self.device.name,
                          precision=self.resolved_precision(), recompute=self.parallel.recompute,
                          bytes_per_param=sum(self.static_split()), memory_capacity=self.device.memory_bytes,
                          tp=self.parallel.tp, sequence_parallel=self.parallel.sequence_parallel,
                          zero=self.parallel.zero, cp=self.parallel.cp,
                          memory_transient=self.transient_bytes())
        if self.parallel.zero >= 3:     # the weights gathered for the compute, held at the peak
            gathered = self.gathered_bytes(sched)
            costs = replace(costs, static_mem=tuple(x + g for x, g in zip(costs.static_mem, gathered)))
            costs.meta["memory_gathered"] = gathered
        if self.parallel.zero >= 2:
            costs.meta["fsdp"] = self.fsdp_report(sched)
        if self.parallel.overlap_fb and self.model.is_moe:
            costs = self._with_phases(costs, sched, lc)
        if self.parallel.p2p_scatter_gather:
            costs = replace(costs, recv_time=self.p2p_gather_time())
        return costs

    def p2p_gather_time(self) -> float:
        """Seconds a RECV holds its GPU under Megatron-LM's scatter-gather (``p2p_scatter_gather``):
        the all-gather of the boundary tensor, bsh d, over the receiver's tensor-parallel group
        (half a ring all-reduce on the group's links, :class:`TensorParallelGroup`), on the compute
        stream before the stage runs; 0 without it."""
        if not self.parallel.p2p_scatter_gather:
            return 0.0
        return self.tp_group.time("all-gather", boundary_bytes(self.model))

    def _with_phases(self, costs: StageCosts, sched, lc: LayerCosts) -> StageCosts:
        """``costs`` with each op's F and B split into compute and all-to-all phases (the layers'
        :meth:`layer_segments` over the stage, a backward's layers last to first; the F's data
        time and per-op overheads in its first compute phase) and the communication's share of the
        GPU, for the simulator to overlap the schedule's F&B pairs (:mod:`sim.overlap`); ``lc``: the
        layer costs the stage costs were summed from."""
        fs, bs = self.layer_segments(lc)
        return stage_phases(costs, sched, lc, fs, bs, self.partition_for(sched.num_stages),
                            self.parallel.overlap_sm_share)


def stage_phases(costs: StageCosts, sched, lc: LayerCosts, fs, bs, partition, sm_share: float = 0.0) -> StageCosts:
    """``costs`` with each op's F and B split into compute and all-to-all phases from the layers'
    segments ``fs`` / ``bs`` (per layer, ("compute" | "comm", seconds) in order, summing to ``lc.f``
    / ``lc.b_input``: :meth:`TransformerCostModel.layer_segments`, or a calibration profile's
    measured ones) over each stage (``partition``: layers per stage), a backward's layers last to
    first, a full backward's weight gradient after each layer's input gradient; what the stage adds
    to its layers (data time, per-op overheads) in its first compute phase; ``sm_share`` the
    communication's share of the device while it runs (:mod:`sim.overlap`)."""
    if not sched.split_backward:       # a full backward: each layer's weight gradient after its input's
        bs = [segs + [("compute", w)] for segs, w in zip(bs, lc.w)]
    parts = layer_ranges(len(lc.f), sched.num_stages, partition)

    def phases(segs, total):
        segs = [("compute", total - sum(x for _, x in segs))] + segs    # what the stage adds to its layers
        # the differences above are exact but for rounding: a -1e-18 is a 0
        return OpPhases.from_segments([(k, x if x > 0 or x < -1e-9 * total else 0.0) for k, x in segs])

    f = [[phases([x for i in r for x in fs[i]], costs.f[c][s]) for s, r in enumerate(parts)]
         for c in range(sched.num_copies)]
    b = [[phases([x for i in reversed(r) for x in bs[i]], costs.b[c][s]) for s, r in enumerate(parts)]
         for c in range(sched.num_copies)]
    return replace(costs, phases_f=tuple(map(tuple, f)), phases_b=tuple(map(tuple, b)), comm_sm_share=sm_share)
