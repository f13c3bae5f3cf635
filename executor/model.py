"""The executor's model: a GPT-style decoder built from a ModelSpec and split into stages.

The full model is a token + position embedding, ``spec.layers`` pre-norm transformer blocks
(causal self-attention and a GELU MLP, each wrapped in a residual) and a final LayerNorm with an
output head; the loss is the cross-entropy of next-token prediction.

Splitting (:func:`cost_models.partition.block_ranges`): a schedule has S stages per model copy. By default the L
blocks are divided contiguously and as evenly as possible over the S stages; the embedding is part
of stage 0 and the final norm, head and loss are part of stage S-1, so the stages that also carry
those get the smaller block counts when L is not a multiple of S. An explicit partition gives the
blocks per stage instead (a planner's plan: :func:`cost_models.partition.blocks_from_layers`
converts its counts over the L + 2 layers embedding, blocks, head); there stage 0 may hold the
embedding alone and stage S-1 the head alone (0 blocks), every other stage needs at least one block. A stage is a
:class:`StageModule`; the whole model is simply the stage that spans everything
(``stage_module(spec, 1, 0)``).

Parameter names are global (``blocks.5.attn.qkv.weight`` is block 5 wherever it lives), and
every parameter is initialised from its own generator seeded by (seed, name)
(:func:`init_parameters`), so the weights do not depend on how the model is split: a
single-process reference, each pipeline stage and both copies of a bidirectional schedule all get
bit-identical initial values.
"""
from __future__ import annotations

import math
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as Fn

from cost_models.model_spec import ModelSpec
from cost_models.partition import block_ranges

from .context_parallel import SINGLE as NO_CP, ContextParallel, attention as context_attention
from .expert_parallel import NO_ETP, etp_split_of
from .tensor_parallel import SINGLE, ColumnParallelLinear, RowParallelLinear, TensorParallel, shard, split_of, \
    vocab_parallel_cross_entropy, vocab_parallel_embedding


class CausalSelfAttention(nn.Module):
    def __init__(self, spec: ModelSpec, tp: TensorParallel = SINGLE, cp: ContextParallel = NO_CP):
        super().__init__()
        self.cp = cp
        self.heads = spec.heads // tp.size        # this rank's heads
        self.head_dim = spec.hidden // spec.heads
        self.qkv = ColumnParallelLinear(spec.hidden, 3 * spec.hidden, tp)
        self.proj = RowParallelLinear(spec.hidden, spec.hidden, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.heads * self.head_dim
        qkv = self.qkv(x)               # the whole sequence (gathered with sequence parallelism)
        b, s, _ = qkv.shape
        q, k, v = qkv.split(h, dim=2)
        q, k, v = (t.view(b, s, self.heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        if self.cp.on:      # this CP rank's queries over every rank's keys (executor.context_parallel)
            y = context_attention(q, k, v, self.cp)
        else:
            y = Fn.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, h))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x)); with tensor parallelism
    (``tp``) the attention heads and the MLP's inner size are split over the TP group; with
    context parallelism (``cp``) the attention exchanges keys and values over the CP group."""

    def __init__(self, spec: ModelSpec, tp: TensorParallel = SINGLE, cp: ContextParallel = NO_CP):
        super().__init__()
        self.ln1 = nn.LayerNorm(spec.hidden)
        self.attn = CausalSelfAttention(spec, tp, cp)
        self.ln2 = nn.LayerNorm(spec.hidden)
        self.fc = ColumnParallelLinear(spec.hidden, spec.ffn_mult * spec.hidden, tp)
        self.out = RowParallelLinear(spec.ffn_mult * spec.hidden, spec.hidden, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(Fn.gelu(self.fc(self.ln2(x))))


class Embedding(nn.Module):
    """Token + position embedding (token only for the Llama kind: its positions are rotary); with
    tensor parallelism the token table is split over the vocabulary, with sequence parallelism the
    output is the rank's slice of the sequence (the position table read at its positions); with
    context parallelism the tokens are the CP rank's (its two chunks, read at their positions)."""

    def __init__(self, spec: ModelSpec, tp: TensorParallel = SINGLE, cp: ContextParallel = NO_CP):
        super().__init__()
        self.tp, self.cp = tp, cp
        self.tok = nn.Embedding(spec.vocab // tp.size, spec.hidden)
        self.pos = nn.Embedding(spec.seq_len, spec.hidden) if spec.kind == "gpt" else None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        tok = vocab_parallel_embedding(tokens, self.tok.weight, self.tp) if self.tp.on else self.tok(tokens)
        if self.pos is None:
            return tok
        n = tok.shape[1]                  # tokens.shape[1] / T with sequence parallelism
        first = self.tp.rank * n if self.tp.sequence else 0
        if self.cp.on:                    # the CP rank's positions (tokens.shape[1] = s / C), its TP slice
            whole = self.cp.positions(tokens.shape[1] * self.cp.size, tokens.device)
            return tok + self.pos(whole[first:first + n])
        return tok + self.pos(torch.arange(first, first + n, device=tokens.device))


KINDS = ("gpt", "llama")   # the model kinds the executor builds


def block(spec: ModelSpec, tp: TensorParallel = SINGLE, cp: ContextParallel = NO_CP, index: int = 0,
          moe=None) -> nn.Module:
    """Transformer block ``index`` of the spec's kind: :class:`Block` (GPT) or
    :class:`executor.llama.LlamaBlock` (a mixture of experts from ``dense_layers`` on, built as
    ``moe``, an :class:`executor.moe.MoeRun`, says)."""
    if spec.kind == "llama":
        from .llama import LlamaBlock
        attn = mlp = None
        if spec.is_mla:
            from .mla import LatentAttention
            attn = LatentAttention(spec, tp)
        if spec.is_moe and index >= spec.dense_layers:
            from .moe import NO_MOE, MoeMLP
            moe = moe or NO_MOE
            mlp = MoeMLP(spec, moe.ep, moe.capacity_factor, moe.loss_scale, tp, moe.etp, cp)
        return LlamaBlock(spec, tp, cp, attn, mlp)
    return Block(spec, tp, cp)


def final_norm(spec: ModelSpec) -> nn.Module:
    if spec.kind == "llama":
        from .llama import RMSNorm
        return RMSNorm(spec.hidden, eps=1e-5)
    return nn.LayerNorm(spec.hidden)


class StageModule(nn.Module):
    """A contiguous slice of the GPT: optional embedding, blocks ``first..last-1``, optional head.

    ``forward`` maps token ids (first stage) or hidden states [b, s, h] to hidden states, or to
    logits [b, s, V] on the last stage; :meth:`loss` turns logits into the mean cross-entropy.
    With context parallelism (``cp``) the first stage takes the whole sequence's token ids and
    keeps its CP rank's s/C; hidden states and logits are the rank's s/C tokens, and the loss
    (given the whole targets) is the mean over them divided by C: summed over the CP ranks, the
    sequence's mean (:mod:`executor.context_parallel`).

    A mixture of experts (:mod:`executor.moe`): after each forward ``aux_loss`` holds the sum
    of its MoE blocks' alpha * load-balancing loss (a detached scalar; None when it has none), which
    the runtime and the reference add to the step's loss; its gradient is already in the graph.
    """

    def __init__(self, spec: ModelSpec, blocks: range, *, first: bool, last: bool, tp: TensorParallel = SINGLE,
                 cp: ContextParallel = NO_CP, moe=None):
        super().__init__()
        self.spec = spec
        self.tp, self.cp = tp, cp
        self.block_range = blocks
        self.first, self.last = first, last
        self.embed = Embedding(spec, tp, cp) if first else None
        self.blocks = nn.ModuleDict({str(i): block(spec, tp, cp, i, moe) for i in blocks})
        self.aux_loss: torch.Tensor | None = None
        self.norm = final_norm(spec) if last else None
        self.head = ColumnParallelLinear(spec.hidden, spec.vocab, tp, bias=False) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for step in self.steps():
            x = step(x)
        return x

    def steps(self, split=None) -> list:
        """The forward as consecutive steps, one per block (the embedding folded into the first,
        the final norm and head into the last; a stage without blocks is one step): where the
        overlapped F&B runtime cuts it (:mod:`executor.overlap`). ``split(block, last)``: the block's
        own steps (a mixture of experts cut at its all-to-alls; ``last``: the stage's last block, whose
        steps end with the block's output), else the block is one."""
        parts = []
        n_blocks = len(self.blocks)
        for k, b in enumerate(self.blocks.values()):
            subs = split(b, k == n_blocks - 1) if split is not None else [b]
            parts += [(sub, b if k == 0 else None) for k, sub in enumerate(subs)]
        parts = parts or [(None, None)]
        n = len(parts)
        return [_StageStep(self, sub, owner, i == 0, i == n - 1) for i, (sub, owner) in enumerate(parts)]

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy (with tensor parallelism: of the logits split over the vocabulary; with
        context parallelism: of the CP rank's tokens, divided by C)."""
        if self.cp.on:
            targets = self.cp.local(targets)
        loss = vocab_parallel_cross_entropy(logits, targets, self.tp) if self.tp.on else lm_loss(logits, targets)
        return loss / self.cp.size if self.cp.on else loss


class _StageStep:
    """One step of a stage's forward (:meth:`StageModule.steps`): the embedding first on the first
    step, then ``sub`` (a block, or one of a block's steps: a callable or an
    :class:`executor.overlap.Step`, whose ``exchange`` it shows), then the final norm and head on
    the last. After the first step of a block (``aux_of``) the block's balance loss is added to
    the stage's ``StageModule.aux_loss`` (read at once: a recomputation rewrites it later)."""

    def __init__(self, stage: "StageModule", sub, aux_of, first: bool, last: bool):
        self.stage, self.sub, self.aux_of, self.first, self.last = stage, sub, aux_of, first, last
        self.exchange = getattr(sub, "exchange", None)

    def __call__(self, x):
        st = self.stage
        if self.first:
            st.aux_loss = None
            if st.embed is not None:
                x = st.embed(st.cp.local(x))
        if self.sub is not None:
            x = getattr(self.sub, "compute", self.sub)(x)
        v = getattr(self.aux_of, "aux_value", None) if self.aux_of is not None else None
        if v is not None:
            st.aux_loss = v if st.aux_loss is None else st.aux_loss + v
        if self.last and st.head is not None:
            x = st.head(st.norm(x))
        return x


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of whole logits [..., V]."""
    return Fn.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _param_seed(seed: int, name: str) -> int:
    return (seed * 0x9E3779B1 + zlib.crc32(name.encode())) % (2 ** 63)


@torch.no_grad()
def init_parameters(module: nn.Module, seed: int, num_layers: int, tp: TensorParallel = SINGLE,
                    etp=None) -> None:
    """GPT-2 style init from one generator per global parameter name: weights N(0, 0.02) (residual
    output projections scaled by 1/sqrt(2L)), biases 0, norm weights 1 (the Llama kind alike). A tensor-parallel
    rank draws the whole parameter and keeps its shard (:func:`executor.tensor_parallel.shard`), an
    expert-tensor-parallel rank (``etp``) its slice of each routed expert
    (:func:`executor.expert_parallel.etp_split_of`): every layout starts from the reference's weights."""
    etp = etp or NO_ETP
    for name, p in module.named_parameters():
        if name.endswith(".bias"):
            p.zero_()
            continue
        owner = module.get_submodule(name.rpartition(".")[0])
        if isinstance(owner, (nn.LayerNorm, nn.RMSNorm)):
            p.fill_(1.0)
            continue
        std = 0.02
        if name.endswith(("attn.proj.weight", ".out.weight", "mlp.down.weight", ".w2.weight")):
            std /= math.sqrt(2 * num_layers)
        g = torch.Generator().manual_seed(_param_seed(seed, name))
        split, size, rank = (split_of(name), tp.size, tp.rank) if tp.on else (None, 1, 0)
        if etp.size > 1 and etp_split_of(name) is not None:     # a routed expert's ETP slice
            split, size, rank = etp_split_of(name), etp.size, etp.rank
        shape = list(p.shape)
        if split is not None:
            shape[split[0]] *= size
        full = torch.randn(shape, generator=g, dtype=torch.float32) * std
        p.copy_(full if split is None else shard(full, rank, size, *split))


def stage_module(spec: ModelSpec, num_stages: int, stage: int, *, seed: int = 0, partition=None,
                 tp: TensorParallel = SINGLE, cp: ContextParallel = NO_CP, moe=None) -> StageModule:
    """Stage ``stage`` of ``num_stages`` (float32, on the CPU), initialised from ``seed``;
    ``partition``: blocks per stage (default: the even split of :func:`cost_models.partition.block_ranges`);
    ``tp``: this rank's place in its tensor-parallel group (its shards of the stage); ``cp``: in
    its context-parallel group (the same weights, its tokens); ``moe``: how its MoE MLPs are built
    (:class:`executor.moe.MoeRun`: EP group, capacity factor, loss scale; None: EP 1, dropless, 1)."""
    ranges = block_ranges(spec.layers, num_stages, partition)
    mod = StageModule(spec, ranges[stage], first=stage == 0, last=stage == num_stages - 1, tp=tp, cp=cp, moe=moe)
    init_parameters(mod, seed, spec.layers, tp, moe.etp if moe is not None else None)
    return mod


def full_model(spec: ModelSpec, *, seed: int = 0, moe=None) -> StageModule:
    """The whole GPT as one module, with the same initial weights as any split of it."""
    return stage_module(spec, 1, 0, seed=seed, moe=moe)


def boundary_shape(spec: ModelSpec, tp: TensorParallel = SINGLE, cp: ContextParallel = NO_CP) -> tuple[int, int, int]:
    """Shape of the activation (and of its gradient) passed between two stages: a CP rank's s/C
    tokens, of which a TP rank's slice with sequence parallelism."""
    s = spec.seq_len // cp.size
    return (spec.micro_batch, s // tp.size if tp.sequence else s, spec.hidden)


def make_optimizer(params, name: str, lr: float) -> torch.optim.Optimizer:
    """``adam`` (default betas, no weight decay) or ``sgd`` (momentum 0.9); the reference and every
    rank use the same one, so their updates agree element by element."""
    params = list(params)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    raise ValueError(f"unknown optimizer {name!r}; choose adam or sgd")
