"""Where an overlapped F&B pair cuts a block, and the activation bytes each segment keeps.

The ONE statement of the memory rule of a segmented forward (:mod:`executor.overlap` cuts a stage's
forward at these points; the simulator books an overlapped pair's memory from these bytes,
:func:`cost_models.memory.pair_peak`). Notation of :mod:`cost_models.transformer` (b, s, h, d, t; R, S, A the
replicated, split and score bytes of a block; ``mask`` 1 byte with dropout) and of
:mod:`cost_models.moe` (n = bs / t tokens a GPU routes, k, E, f_e, f_s, ``pairs`` = n k x imbalance).

Segments of block i (:func:`block_segments`), summing to
:func:`cost_models.transformer.block_activation_bytes` of the block:

- dense block, t = 1: one segment, the whole block.
- dense block, t > 1: two, cut at the attention's row-parallel reduction (all-reduce; with SP a
  reduce-scatter). Segment 1 = ln1, QKV, the attention core, the output projection:
  ``sbh (2d) / t' + S_attn / t + A / t`` (ln1's input and QKV's input, t' = t with SP else 1;
  Q, K, V and the output projection's input; the scores). Segment 2 = the residual, ln2, the MLP
  up to its reduction: ``sbh (2d + 2 mask) / t' + n' sb f d / t`` (ln2's input, the MLP's input,
  the two dropout masks; the MLP's kept tensors). The block's last residual add (and the MLP's
  dropout) runs at the start of the next segment; its mask is booked in this block's segment 2
  (at most ``sbh / t'`` bytes early, none without dropout).
- MoE block: three, at its dispatch and combine all-to-alls (:func:`executor.overlap.block_steps`).
  (1) attention + route: ``R / t' + S / t + A / t + 4 n E + 8 n k + 16 pairs`` (the attention as a
  dense block's, ln2's input and the router's input; the router's fp32 scores, each token's k
  expert indices, each kept pair's two int64 indices, its place in expert order and its token's,
  which the gather into expert order keeps);
  (2) experts: ``pairs (ETP h + 3 f_e) d`` (each dispatched row, all-gathered over ETP, the
  SwiGLU's gate, up and product) plus, at EP x ETP > 1, the two int64 regrouping orders per row
  (:func:`cost_models.moe.regroup_bytes`);
  (3) unpermute + residual: ``pairs (h + 1) d + 3 n f_s d + shared gate`` (each combined row and
  its gate weight for the weighted sum; the shared expert).
  Selective recomputation drops A (segment 1); full recomputation keeps only the block's input,
  ``sbh d / t'``, in the first segment (the others 0: each segment is recomputed from its leaves).

The embedding and the head fold into the first and the last block's segments as
:meth:`executor.model.StageModule.steps` folds them (:func:`stage_segments`).

Split backward (B then W): what a segment's B keeps until W (:func:`segment_weight_grads`). A
plain segment (a tensor in, a tensor out: a dense block) keeps the linear layers' inputs and output
gradients, as the ledger books a block's ``act_w``
(:func:`cost_models.transformer.block_weight_grad_bytes`); at t > 1 segment 1 keeps QKV's input and
the output projection's output gradient ``2 sbh d / t'`` and ``(sbh + sb (a + 2k) e) d / t``,
segment 2 fc1's input and fc2's output gradient ``2 sbh d / t'`` and ``(1 + up) sb f d / t``. A tuple
segment (a MoE block's: a tuple crosses its cuts) keeps its whole graph until W
(:class:`executor.overlap.RetainedWeightGrad`): its own activation bytes, folded ones included,
and the gradients of the outputs it computed (:func:`segment_output_grads`).

Closed form of a pair (:func:`cost_models.memory.pair_peak`). The executor runs F's segment 1, B's last segment, F's
segment 2, B's next-to-last, ...: with F's segments f_1..f_n (allocated as each runs), B's
segments b_1..b_m (B walks them from b_m down; each frees ``b_j - w_j``, w_j what it keeps until W,
0 with a full backward), the pair adds over what was alive before it at most

    peak = max_{k=1..n} ( f_1 + .. + f_k - sum_{j=m-k+2..m} (b_j - w_j) )

(k = 1: F's first segment before B frees anything), and leaves ``sum f - sum (b - w)``.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from .base import LayerCosts, StageCosts, stage_segment_sums
from .model_spec import ModelSpec
from .moe import INDEX_BYTES, SCORE_BYTES, SWIGLU, effective_imbalance, regroup_bytes, shared_gate_bytes
from .parallel import Parallel
from .partition import layer_ranges
from .transformer import (_attention_score_bytes, _attention_split_bytes, _check_recompute, _mlp_matrices,
                          _moe_par, _qkv_width, _sp_div, block_activation_bytes, block_weight_grad_bytes,
                          is_moe_block, transformer_layers)


def _mask(spec: ModelSpec, dropout: bool | None) -> int:
    return 1 if (spec.has_dropout if dropout is None else dropout) else 0


def block_segments(spec: ModelSpec, i: int, *, tp: int = 1, sp: bool = False, recompute: str = "none",
                   dropout: bool | None = None, parallel: Parallel | None = None) -> tuple[float, ...]:
    """The activation bytes each segment of block ``i`` keeps until its backward, on one of ``tp``
    GPUs (module docstring); they sum to :func:`cost_models.transformer.block_activation_bytes`."""
    _check_recompute(recompute)
    moe = is_moe_block(spec, i)
    total = block_activation_bytes(spec, recompute, dropout, tp, sp, moe, parallel)
    if not moe and tp == 1:
        return (total,)
    b, s, h, d = spec.micro_batch, spec.seq_len, spec.hidden, spec.dtype_bytes
    sbh, div = s * b * h, _sp_div(tp, sp)
    n_segs = 3 if moe else 2
    if recompute == "full":
        return (total,) + (0.0,) * (n_segs - 1)
    mask = _mask(spec, dropout)
    scores = _attention_score_bytes(spec, mask) / tp if recompute == "none" else 0.0
    attn = _attention_split_bytes(spec) / tp + scores
    if not moe:
        first = sbh * 2 * d / div + attn
        second = sbh * (2 * d + 2 * mask) / div + _mlp_matrices(spec) * s * b * spec.ffn * d / tp
        return (float(first), float(second))
    par = _moe_par(tp, parallel)
    n = b * s / tp
    pairs = n * spec.top_k * effective_imbalance(spec, par)
    first = sbh * (4 * d + 2 * mask) / div + attn + n * SCORE_BYTES * spec.experts + \
        n * spec.top_k * INDEX_BYTES + pairs * 2 * INDEX_BYTES
    experts = pairs * (par.etp * h + SWIGLU * spec.expert_width) * d + regroup_bytes(par, pairs)
    out = pairs * (h + 1) * d + n * SWIGLU * spec.shared_ffn * d + shared_gate_bytes(spec, n)
    return (float(first), float(experts), float(out))


def is_tuple_block(spec: ModelSpec, i: int) -> bool:
    """Block ``i``'s segments pass tuples across their cuts (a MoE block's): a split B keeps their
    whole graphs until W."""
    return is_moe_block(spec, i)


def segment_output_grads(spec: ModelSpec, i: int, *, tp: int = 1, sp: bool = False,
                         parallel: Parallel | None = None) -> tuple[float, ...]:
    """The output gradients a tuple segment's split B hands to W with its graph
    (:class:`executor.overlap.RetainedWeightGrad` keeps those of the outputs the segment computed;
    one passed through is its input leaf, none): a MoE block's (1) x1, h (``2 n h d``), the rows in
    expert order and the gate weights (``pairs (h + 1) d``), the balance loss (d); (2) the experts'
    rows (``pairs h d``); (3) the block's output (``n h d``). A dense block's: none (0 each)."""
    if not is_tuple_block(spec, i):
        return (0.0,) * len(block_segments(spec, i, tp=tp, sp=sp, parallel=parallel))
    h, d = spec.hidden, spec.dtype_bytes
    n = spec.micro_batch * spec.seq_len / tp
    pairs = n * spec.top_k * effective_imbalance(spec, _moe_par(tp, parallel))
    return (float(2 * n * h * d + pairs * (h + 1) * d + d), float(pairs * h * d), float(n * h * d))


def fold_weight_grads(spec: ModelSpec, kind: str, act: float, act_w: float, into_tuple: bool, *, tp: int = 1,
                      sp: bool = False) -> float:
    """What a split B keeps until W of a layer folded into a block's segment (``kind`` embedding or
    head, keeping ``act`` and, unfolded, ``act_w``): into a plain segment ``act_w``; into a tuple
    segment its whole ``act`` (one graph), and for the head the loss's gradient (d) in place of the
    block output's (``n h d``: the segment's output is then the loss)."""
    if not into_tuple:
        return act_w
    if kind == "head":
        return act + spec.dtype_bytes - spec.micro_batch * spec.seq_len * spec.hidden * spec.dtype_bytes / tp
    return act


def segment_weight_grads(spec: ModelSpec, i: int, *, tp: int = 1, sp: bool = False, recompute: str = "none",
                         dropout: bool | None = None, parallel: Parallel | None = None) -> tuple[float, ...]:
    """What each segment of block ``i`` keeps from its split B until its W (module docstring): a
    plain segment its linear layers' inputs and output gradients, a tuple segment its whole graph
    and its output gradients (:func:`segment_output_grads`)."""
    segs = block_segments(spec, i, tp=tp, sp=sp, recompute=recompute, dropout=dropout, parallel=parallel)
    if is_tuple_block(spec, i):
        grads = segment_output_grads(spec, i, tp=tp, sp=sp, parallel=parallel)
        return tuple(a + g for a, g in zip(segs, grads))
    whole = block_weight_grad_bytes(spec, tp, sp)
    if len(segs) == 1:
        return (whole,)
    b, s, h, d, f = spec.micro_batch, spec.seq_len, spec.hidden, spec.dtype_bytes, spec.ffn
    sb, div = s * b, _sp_div(tp, sp)
    up = 2 if spec.kind == "llama" else 1
    first = 2 * sb * h * d / div + (sb * h + sb * _qkv_width(spec)) * d / tp
    second = 2 * sb * h * d / div + (1 + up) * sb * f * d / tp
    return (float(first), float(second))


def layer_segments(spec: ModelSpec, layers: Sequence, **kw) -> tuple[tuple, tuple, tuple]:
    """(per layer its segments' bytes, what each keeps from a split B until W, whether it folds) for
    ``layers`` (:class:`cost_models.transformer.Layer` of :func:`cost_models.transformer.transformer_layers`,
    embedding first and head last, any contiguous run of them): a block's :func:`block_segments` and
    :func:`segment_weight_grads`; the embedding and the head one part folded into the block next to
    them (:func:`fold_weight_grads`), as :meth:`executor.model.StageModule.steps` folds them
    (:func:`cost_models.base.stage_segment_sums` does the folding). ``kw``: tp, sp, recompute,
    dropout, parallel."""
    acts, ws, folds = [], [], []
    for lay in layers:
        if lay.kind == "block":
            i = int(lay.name[len("block"):])
            acts.append(block_segments(spec, i, **kw))
            ws.append(segment_weight_grads(spec, i, **kw))
            folds.append(False)
            continue
        nxt = 0 if lay.kind == "embedding" else spec.layers - 1       # the block it folds into
        tup = spec.layers > 0 and is_tuple_block(spec, nxt)
        acts.append((lay.act_bytes,))
        ws.append((fold_weight_grads(spec, lay.kind, lay.act_bytes, lay.act_w_bytes, tup, tp=kw.get("tp", 1),
                                     sp=kw.get("sp", False)),))
        folds.append(True)
    return tuple(acts), tuple(ws), tuple(folds)


def stage_segments(spec: ModelSpec, blocks: Sequence[int], *, first: bool, last: bool, tp: int = 1,
                   sp: bool = False, recompute: str = "none", dropout: bool | None = None,
                   parallel: Parallel | None = None) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(the bytes each segment of a stage keeps until its backward, what each keeps from a split B
    until W, a split backward's), the stage holding ``blocks`` (block indices, in order), with the
    embedding folded into the first segment where ``first`` and the head into the last where
    ``last`` (:func:`layer_segments`; a stage without blocks is one segment)."""
    kw = dict(tp=tp, sp=sp, recompute=recompute, dropout=dropout, parallel=parallel)
    every = transformer_layers(spec, recompute, dropout, tp, sp, parallel)
    mine = [every[0]] * first + [every[i + 1] for i in blocks] + [every[-1]] * last
    acts, ws, folds = layer_segments(spec, mine, **kw)
    zeros = (0.0,) * len(mine)
    lc = LayerCosts(f=zeros, b_input=zeros, w=zeros, act=tuple(x.act_bytes for x in mine),
                    act_w=tuple(x.act_w_bytes for x in mine), out_bytes=zeros, params=zeros,
                    act_segments=acts, act_w_segments=ws, folds=folds)
    a, w = stage_segment_sums(lc, [range(len(mine))], True)
    return a[0], w[0]


def with_segments(costs: StageCosts, sched, tcm) -> StageCosts:
    """``costs`` (bound by :class:`cost_models.transformer.TransformerCostModel` ``tcm`` for ``sched``)
    with each stage's segments (``act_segments``, ``act_w_segments``: :func:`layer_segments` folded
    over the stage's layers); unchanged with context parallelism (its layers are not cut)."""
    par, spec = tcm.parallel, tcm.model
    if par.cp > 1:
        return costs
    L = tcm.layers()
    acts, ws, folds = layer_segments(spec, L, tp=par.tp, sp=par.sequence_parallel, recompute=par.recompute,
                                     dropout=tcm.uses_dropout, parallel=par if spec.is_moe else None)
    lc = replace(tcm.layer_costs(), act_segments=acts, act_w_segments=ws, folds=folds)
    parts = layer_ranges(len(L), sched.num_stages, tcm.partition_for(sched.num_stages))
    got = stage_segment_sums(lc, parts, sched.split_backward)
    C = sched.num_copies
    return replace(costs, act_segments=tuple(tuple(got[0]) for _ in range(C)),
                   act_w_segments=tuple(tuple(got[1]) for _ in range(C)))
