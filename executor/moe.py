"""The executor's mixture-of-experts MLP: a router, E routed SwiGLU experts, shared experts.

Built from the same :class:`cost_models.model_spec.ModelSpec` the simulator prices
(:mod:`cost_models.moe`): ``experts`` E, ``top_k`` k, ``expert_ffn`` f_e, ``shared_ffn`` f_s,
``shared_gate``, ``router`` softmax | sigmoid, ``aux_loss_coeff`` alpha. Parameter names are the
whole model's: ``mlp.router.weight`` [E, h] (and ``mlp.router.bias`` [E] with sigmoid scores),
``mlp.experts.{j}.w1 / w3 / w2.weight`` (gate, up, down of global expert j, Mixtral's names),
``mlp.shared.w1 / w3 / w2.weight`` and ``mlp.shared_gate.weight`` [1, h] (Qwen2-MoE).

Routing, per micro-batch over its n = b s tokens (:func:`route_tokens`):

* logits = x W_r^T in fp32 (autocast off: the router's scores are fp32 in bf16 runs too, the 4 E
  bytes per token the ledger counts); scores p = softmax(logits) (Mixtral, Qwen) or
  sigmoid(logits) (DeepSeek-V3);
* selection: the k experts of largest p + bias (the bias only with sigmoid scores: DeepSeek-V3's
  per-expert correction bias acts on the choice, never on the weights; it receives no gradient:
  zero at init, it stays as set); ties as ``torch.topk`` breaks them;
* weights: the selected scores renormalised over the k, w = p_sel / sum(p_sel) (Mixtral's softmax
  over the top-k logits; DeepSeek-V3's normalised sigmoid gates);
* dropless by default; with ``Parallel.capacity_factor`` c > 0 each expert keeps at most
  C = ceil(c n k / E) of its token-expert pairs: those of highest selection score (p + bias), ties
  to the lower token index; the others are dropped (the token gets only its other experts, and
  nothing if all its k are dropped: the residual carries it). With EP the capacity is per expert
  over the tokens this rank routes (its own micro-batch: the reference routes the same tokens, so
  it drops the same pairs).

Load-balancing loss (Switch Transformer / Megatron-LM's ``switch_load_balancing_loss_func``)::

    aux = E * sum_i f_i P_i,   f_i = (pairs routed to expert i, before dropping) / (n k),
                               P_i = mean over the n tokens of p'_{t,i}

with p' = p for softmax scores and p' = p / sum_i p (each token's sigmoid scores normalised, as
DeepSeek-V3's balance loss) for sigmoid ones; f carries no gradient. A balanced router gives
aux = 1. It is computed per micro-batch over the tokens the routing sees (a stage's micro-batch, the
reference's same micro-batch) and enters the loss as alpha * aux per MoE block: the micro-batch's
loss is cross-entropy + alpha * sum over the MoE blocks of aux.

How it reaches the loss on any stage (not only the last): the MLP's output passes an identity
autograd function (:class:`_AuxLossGrad`, Megatron-LM's ``MoEAuxLossAutoScaler``) whose backward
returns, beside the output's gradient, ``loss_scale`` as the gradient of alpha * aux, where
``loss_scale`` is the factor the driver scales a micro-batch's loss by (1/G: the runtime's and the
reference's ``loss / G``), so its gradient flows into the router exactly as if alpha * aux / G had
been added to the scaled loss. Its value is reported apart: the stage module sums its blocks'
``aux_value`` after each forward (``executor.model.StageModule.aux_loss``), the runtime and
the reference add it to the step's loss sum, so the reported loss is cross-entropy + aux terms on
every layout. It works through full and split backward (the gradient enters at the node whatever
runs it) and recomputation (the recomputed forward builds the same node; its value is not read).

The forward is written as five steps the overlap runtime can cut between (each a method; the plain
:meth:`MoeMLP.forward` calls them in order), carrying one micro-batch's tensors in a
:class:`MoeState`:

``route``      router, top-k, aux loss, capacity, the kept pairs permuted into expert order
               (expert-major, token order within an expert) and gathered: rows [m, h];
``dispatch``   the rows to the EP ranks holding their experts (``ep.all_to_all``; the per-expert
               counts first, so the receiver knows which rows are whose);
``experts``    each local expert's SwiGLU on its rows (rows from several sources grouped by expert
               and put back in arrival order);
``combine``    the rows back to the ranks they came from (``ep.all_to_all`` with the received counts);
``unpermute``  the weighted sum back into token order (index_add of w * rows), plus the shared
               expert (times Qwen2's sigmoid gate where the spec has one).

Tensor parallelism (``--tp T``, with sequence parallelism, Megatron-LM's rule for MoE): the block's
input is the TP rank's 1/T of the sequence, and the MoE MLP works on those tokens alone: the
router (replicated, its gradient summed over the TP group as a norm's) routes them, the EP group is
folded from the stage's T x R processes (:meth:`executor.mesh.Mesh.expert_fold`), the shared expert
is split over the TP group as a dense MLP (:class:`SharedExpert`). The load-balancing loss's load f
is all-reduced over the TP group and each rank's P divided by the micro-batch's T n tokens
(:func:`route_tokens`), so the ranks' terms sum to the micro-batch's aux; the reported value is
that sum. Expert tensor parallelism (``--etp U``, :class:`executor.expert_parallel.ExpertTensorParallel`):
each routed expert's w1/w3 column- and w2 row-split over the ETP group; after the dispatch the
members' rows (and per-expert counts) are all-gathered over ETP, each member runs its slice on all
of them, and the partial outputs are reduce-scattered back before the combine (Megatron's order),
all inside the ``experts`` step. A capacity factor with T > 1 is refused (each rank would drop over
its 1/T of the tokens, not the micro-batch's).

At EP 1 (:data:`executor.expert_parallel.NO_EP`) dispatch and combine are identities. What autograd
keeps per micro-batch (the saved-tensor meter's count): the router's fp32 scores (4 E per token),
per kept pair the dispatched row and the combined row (2 h d) and the expert's gate, up and product
(3 f_e d), the shared expert's 3 f_s d per token, and the routing's indices and weights (int64
token and slot indices, the weights: :func:`cost_models.moe.routing_bytes`); with EP > 1 the
experts' two int64 orders per received row (:func:`cost_models.moe.regroup_bytes`).

Load: each MLP counts the tokens it routes to each expert (the top-k choices, before a capacity
drop; not a recomputation's, which runs inside a backward); the worker takes the tallies after
every step (:func:`take_expert_load`) and a run reports them (``RunResult.extra["expert_load"]``:
pipeline rank -> stage -> per step); :func:`run_expert_load` totals them for ``--expert-load``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as Fn

from cost_models.model_spec import ModelSpec

from .expert_parallel import NO_EP, NO_ETP, ExpertParallel, ExpertTensorParallel
from .tensor_parallel import SINGLE, RowParallelLinear, TensorParallel, gather_linears


@dataclass(frozen=True)
class Routing:
    """The routing of n tokens to k of E experts (:func:`route_tokens`).

    ``scores`` [n, E] the router's scores p (fp32, differentiable); ``topk`` [n, k] the selected
    experts; ``expert``, ``token``, ``slot`` [m] the kept pairs in dispatch order (expert-major,
    token order within an expert; ``slot`` the pair's place 0..k-1 among its token's); ``weight``
    [m] their gate weights (differentiable); ``counts`` kept pairs per expert (E ints); ``aux`` the
    load-balancing loss (differentiable, module docstring); ``dropped`` pairs over capacity."""

    scores: torch.Tensor
    topk: torch.Tensor
    expert: torch.Tensor
    token: torch.Tensor
    slot: torch.Tensor
    weight: torch.Tensor
    counts: tuple[int, ...]
    aux: torch.Tensor
    dropped: int


def capacity(capacity_factor: float, tokens: int, top_k: int, experts: int) -> int:
    """Pairs an expert keeps: ceil(c n k / E) (0: no limit; c = 0 is dropless)."""
    return math.ceil(capacity_factor * tokens * top_k / experts) if capacity_factor else 0


def route_tokens(logits: torch.Tensor, top_k: int, router: str = "softmax", bias: torch.Tensor | None = None,
                 capacity_factor: float = 0.0, tokens=None) -> Routing:
    """The routing of the module docstring for ``logits`` [n, E] (fp32). ``tokens``: the group whose
    ranks each route n of the micro-batch's tokens (the TP group with sequence parallelism, or the
    :class:`executor.context_parallel.ContextParallel` group; None, or size 1: these n are all of
    them). The aux loss is then this rank's term of the micro-batch's, as Megatron-LM computes it
    over its TP x CP group: the load summed over the group (one all-reduce of E integers),
    f_i = load_i / (P n k) for a group of P, and P_i summed over the rank's tokens / (P n), so the
    ranks' terms (and their gradients) sum to the whole micro-batch's."""
    n, E = logits.shape
    scores = torch.softmax(logits, -1) if router == "softmax" else torch.sigmoid(logits)
    choose = scores.detach() if bias is None else scores.detach() + bias.detach()
    sel_score, topk = choose.topk(top_k, dim=-1)                      # [n, k]
    weights = _Gates.apply(scores, topk)                              # [n, k]
    expert = topk.reshape(-1)                                         # pairs token-major: t * k + slot
    load = torch.bincount(expert, minlength=E)
    every, parts = load, 1
    if tokens is not None and tokens.on:        # the micro-batch's load over the group's tokens
        every, parts = load.clone(), tokens.size
        dist.all_reduce(every, group=tokens.group)
    aux = _AuxLoss.apply(scores, every.to(scores.dtype) / (n * parts * top_k), router == "sigmoid", parts)
    pair = torch.arange(n * top_k, device=logits.device)
    cap = capacity(capacity_factor, n, top_k, E)
    dropped = 0
    if cap:
        # highest selection score first, ties to the lower pair index (= lower token); then by expert
        order = torch.argsort(-sel_score.reshape(-1), stable=True)
        order = order[torch.argsort(expert[order], stable=True)]
        start = torch.cumsum(load, 0) - load
        rank = torch.empty_like(order)
        rank[order] = torch.arange(n * top_k, device=logits.device) - start[expert[order]]
        kept = rank < cap
        dropped = int((~kept).sum())
        pair = pair[kept]
    pair = pair[torch.argsort(expert[pair], stable=True)]             # expert-major, token order within
    counts = torch.bincount(expert[pair], minlength=E)
    return Routing(scores, topk, expert[pair], pair // top_k, pair % top_k, weights.reshape(-1)[pair],
                   tuple(int(c) for c in counts.tolist()), aux, dropped)


class _Gates(torch.autograd.Function):
    """w = p_sel / sum(p_sel) of each token's k selected scores; keeps the scores (autograd keeps
    them for the softmax or sigmoid anyway) and the top-k indices, nothing else."""

    @staticmethod
    def forward(ctx, scores, topk):
        ctx.save_for_backward(scores, topk)
        picked = scores.gather(1, topk)
        return picked / picked.sum(-1, keepdim=True)

    @staticmethod
    def backward(ctx, g):
        scores, topk = ctx.saved_tensors
        picked = scores.gather(1, topk)
        total = picked.sum(-1, keepdim=True)
        w = picked / total
        gp = (g - (g * w).sum(-1, keepdim=True)) / total               # d(p / sum p) / dp
        return torch.zeros_like(scores).scatter_add_(1, topk, gp), None


class _AuxLoss(torch.autograd.Function):
    """E sum_i f_i P_i (module docstring) of ``scores`` [n, E] and the load fractions ``f`` [E];
    keeps the scores (kept anyway) and f. ``parts`` T: the n rows are one TP rank's of T n tokens
    (P_i summed over them / T n: this rank's term)."""

    @staticmethod
    def forward(ctx, scores, f, normalise, parts=1):
        ctx.normalise, ctx.parts = normalise, parts
        ctx.save_for_backward(scores, f)
        probs = scores / scores.sum(-1, keepdim=True) if normalise else scores
        mean = probs.mean(0) if parts == 1 else probs.sum(0) / (scores.shape[0] * parts)
        return scores.shape[1] * (f * mean).sum()

    @staticmethod
    def backward(ctx, g):
        scores, f = ctx.saved_tensors
        n, E = scores.shape
        gs = (g * E / (n * ctx.parts)) * f.expand(n, E)                 # d aux / d p'
        if ctx.normalise:                                               # p' = s / S: (g_j - sum_i g_i p'_i) / S
            total = scores.sum(-1, keepdim=True)
            gs = (gs - (gs * scores / total).sum(-1, keepdim=True)) / total
        return gs, None, None, None


class _WeightedSum(torch.autograd.Function):
    """y[t] = sum over the pairs p of token t of w_p rows_p (``index_add``); keeps the rows, the
    weights and the token indices (autograd's ``index_add`` would also keep the weighted rows)."""

    @staticmethod
    def forward(ctx, rows, w, token, n):
        ctx.save_for_backward(rows, w, token)
        y = rows.new_zeros(n, rows.shape[-1])
        return y.index_add_(0, token, rows * w.unsqueeze(-1))

    @staticmethod
    def backward(ctx, g):
        rows, w, token = ctx.saved_tensors
        gt = g.index_select(0, token)
        return gt * w.unsqueeze(-1), (gt * rows).sum(-1), None, None


class _AuxLossGrad(torch.autograd.Function):
    """y unchanged; backward: y's gradient and ``scale`` as the gradient of ``aux`` (module docstring)."""

    @staticmethod
    def forward(ctx, y, aux, scale):
        ctx.scale = scale
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g):
        return g, torch.full((), ctx.scale, dtype=torch.float32, device=g.device), None


class Expert(nn.Module):
    """One SwiGLU expert of inner size ``ffn``: w2(silu(w1 x) * w3 x), no biases (Mixtral's names).
    ``parts`` > 1: this process's 1/parts of it (w1, w3 its output rows, w2 its input columns: a routed
    expert under ETP, whose caller gathers and reduce-scatters the rows)."""

    def __init__(self, hidden: int, ffn: int, parts: int = 1):
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn // parts, bias=False)
        self.w3 = nn.Linear(hidden, ffn // parts, bias=False)
        self.w2 = nn.Linear(ffn // parts, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from .llama import swiglu
        return self.w2(swiglu(self.w1(x), self.w3(x)))


class SharedExpert(nn.Module):
    """The shared experts' SwiGLU, split over the TP group as a dense MLP (w1, w3 column-parallel, w2
    row-parallel; with sequence parallelism the input gathered and the output reduce-scattered over
    the sequence, :mod:`executor.tensor_parallel`); at T = 1 an :class:`Expert`. Takes [b, s', h]."""

    def __init__(self, hidden: int, ffn: int, tp: TensorParallel = SINGLE):
        super().__init__()
        self.tp = tp
        self.w1 = nn.Linear(hidden, ffn // tp.size, bias=False)
        self.w3 = nn.Linear(hidden, ffn // tp.size, bias=False)
        self.w2 = RowParallelLinear(ffn, hidden, tp, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from .llama import swiglu
        if self.tp.on:      # with sequence parallelism (a MoE run at T > 1 has it: executor.config)
            if x.is_leaf and x.requires_grad:   # a segment's input under --overlap-fb (executor.overlap): the
                x = x.view_as(x)                # split backward asks autograd about the node after it, not a leaf
            gate, up = gather_linears(x, self.tp, [(self.w1.weight, None), (self.w3.weight, None)])
        else:
            gate, up = self.w1(x), self.w3(x)
        return self.w2(swiglu(gate, up))


class Router(nn.Module):
    """The gate W_r [E, h] and, with sigmoid scores, DeepSeek's per-expert selection bias [E]."""

    def __init__(self, hidden: int, experts: int, sigmoid: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, hidden))
        self.bias = nn.Parameter(torch.zeros(experts)) if sigmoid else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 logits [n, E] of rows ``x`` [n, h] (autocast off)."""
        wide = (lambda t: t.float() if t.element_size() < 4 else t)      # fp32 at least
        with torch.autocast(x.device.type, enabled=False):
            return Fn.linear(wide(x), wide(self.weight))


class LocalExperts(nn.ModuleDict):
    """This rank's routed experts by global index (``experts.{j}``); called on a :class:`MoeState`
    it is the ``experts`` step: each local expert's SwiGLU on its rows, the rows of several EP
    sources grouped by expert and the outputs put back in arrival order."""

    def __init__(self, local: range, hidden: int, ffn: int, etp: ExpertTensorParallel = NO_ETP):
        super().__init__({str(j): Expert(hidden, ffn, etp.size) for j in local})
        self.local, self.etp = local, etp

    def forward(self, st: "MoeState") -> "MoeState":
        """With ETP the members' rows are gathered first (each member's counts beside its own, so the
        sources are EP x ETP) and the partial outputs reduce-scattered back after (:class:`ExpertTensorParallel`)."""
        etp = self.etp
        if etp.size > 1:
            every = etp.gather_counts(st.counts, st.rows.device)
            rows_of = [sum(c) for c in every]
            own = st.counts
            st.counts = [c for cs in every for c in cs]
            st.rows = etp.gather_rows(st.rows, rows_of)
            st = self._compute(st)
            st.rows, st.counts = etp.scatter_rows(st.rows, rows_of), own
            return st
        return self._compute(st)

    def _compute(self, st: "MoeState") -> "MoeState":
        per = len(self.local)
        sources = len(st.counts) // per
        order = None
        if sources > 1:
            group = torch.arange(per, device=st.rows.device).repeat(sources)
            owner = torch.repeat_interleave(group, torch.tensor(st.counts, device=st.rows.device))
            order = torch.argsort(owner, stable=True)
        rows = st.rows if order is None else st.rows.index_select(0, order)
        per_expert = [sum(st.counts[s * per + j] for s in range(sources)) for j in range(per)]
        # an expert without rows is skipped (an empty input would be kept as a storage of its own)
        outs = [self[str(j)](part) for j, part in zip(self.local, rows.split(per_expert)) if part.shape[0]]
        out = torch.cat(outs) if outs else rows
        if order is not None:
            out = out.index_select(0, torch.argsort(order))
        st.rows = out
        return st


@dataclass
class MoeState:
    """One micro-batch between the MoE steps (mutable: each step fills its part). ``x`` the
    block's input [b, s, h]; ``routing``; ``rows`` the rows the next step takes; ``counts`` the
    per-expert counts of the rows received (EP sources x local experts); ``recv`` the row counts
    received per EP rank."""

    x: torch.Tensor
    routing: Routing | None = None
    rows: torch.Tensor | None = None
    counts: list[int] | None = None
    recv: list[int] | None = None


class MoeMLP(nn.Module):
    """The MoE MLP of one block (module docstring). ``ep``: this rank's expert-parallel group (it
    holds experts ``ep.experts(E)`` only); ``capacity_factor``: 0 dropless, else c >= 1;
    ``loss_scale``: the factor the driver scales each micro-batch's loss by (1/G); ``cp``: the
    context-parallel group whose ranks route the micro-batch's other tokens (:func:`route_tokens`)."""

    def __init__(self, spec: ModelSpec, ep: ExpertParallel = NO_EP, capacity_factor: float = 0.0,
                 loss_scale: float = 1.0, tp: TensorParallel = SINGLE, etp: ExpertTensorParallel = NO_ETP, cp=None):
        super().__init__()
        self.ep, self.capacity_factor, self.loss_scale = ep, capacity_factor, loss_scale
        self.tp, self.cp = tp, cp
        # the group whose ranks split the micro-batch's tokens (TP with SP, or CP; both at once are refused)
        self.tokens = cp if cp is not None and cp.on else (tp if tp.on else None)
        self.num_experts, self.top_k, self.router_kind = spec.experts, spec.top_k, spec.router
        self.coeff = float(spec.aux_loss_coeff)
        self.local = ep.experts(spec.experts)
        self.router = Router(spec.hidden, spec.experts, spec.router == "sigmoid")
        self.experts = LocalExperts(self.local, spec.hidden, spec.expert_width, etp)
        self.shared = SharedExpert(spec.hidden, spec.shared_ffn, tp) if spec.shared_ffn else None
        self.shared_gate = nn.Linear(spec.hidden, 1, bias=False) if spec.shared_ffn and spec.shared_gate else None
        self.aux_value: torch.Tensor | None = None    # alpha * aux of the last forward (detached)
        self.load = [0] * spec.experts      # tokens routed to each expert since the last take_expert_load

    # ------------------------------------------------------------------ the steps
    def route(self, x: torch.Tensor) -> MoeState:
        """Router, top-k, aux loss, capacity; the kept pairs' rows gathered in expert order."""
        flat = x.reshape(-1, x.shape[-1])
        r = route_tokens(self.router(flat), self.top_k, self.router_kind, self.router.bias, self.capacity_factor,
                         self.tokens)
        aux = (self.coeff * r.aux).detach() if self.coeff else None
        if aux is not None and self.tp.on:      # each TP rank's term of the micro-batch's aux: their sum
            aux = aux.clone()
            dist.all_reduce(aux, group=self.tp.group)
        self.aux_value = aux
        if torch._C._current_graph_task_id() == -1:     # a forward, not its recomputation inside a backward
            self.load = [a + b for a, b in zip(self.load, torch.bincount(r.topk.reshape(-1), minlength=len(self.load))
                                               .tolist())]
        return MoeState(x, r, flat.index_select(0, r.token))

    def dispatch(self, st: MoeState) -> MoeState:
        """The rows to the EP ranks of their experts; first each expert's count (so a receiver knows
        which of its rows belong to which local expert)."""
        send = self.dispatch_counts(st)
        st.rows, st.recv = self.ep.all_to_all(st.rows, send)
        return st

    def dispatch_counts(self, st: MoeState) -> list[int]:
        """The first half of :meth:`dispatch`: each expert's count exchanged (``st.counts``, source-major,
        local expert minor); returns the rows to send to each EP rank (the overlap runtime sends
        them asynchronously, :mod:`executor.overlap`)."""
        E, ep = self.num_experts, self.ep
        per = E // ep.size
        counts = torch.tensor(st.routing.counts, dtype=torch.int64, device=st.rows.device).view(E, 1)
        got, _ = ep.all_to_all(counts, [per] * ep.size)
        st.counts = [int(c) for c in got.view(-1).tolist()]
        return [sum(st.routing.counts[e * per:(e + 1) * per]) for e in range(ep.size)]

    def combine(self, st: MoeState) -> MoeState:
        """The expert outputs back to the ranks their rows came from."""
        st.rows, _ = self.ep.all_to_all(st.rows, st.recv)
        return st

    def unpermute(self, st: MoeState) -> torch.Tensor:
        """sum over a token's kept pairs of w * row, in token order; plus the shared expert."""
        x, r = st.x, st.routing
        flat = x.reshape(-1, x.shape[-1])
        rows = st.rows
        y = _WeightedSum.apply(rows, r.weight.to(rows.dtype), r.token, flat.shape[0])
        if self.shared is not None:
            s = self.shared(x).reshape(flat.shape)
            if self.shared_gate is not None:
                s = s * torch.sigmoid(self.shared_gate(flat))
            y = y + s
        y = y.view(*x.shape[:-1], y.shape[-1])
        if self.coeff:
            y = _AuxLossGrad.apply(y, self.coeff * r.aux, self.loss_scale)
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.unpermute(self.combine(self.experts(self.dispatch(self.route(x)))))


def take_expert_load(modules) -> list[int] | None:
    """Tokens routed to each expert (before any capacity drop: the top-k choices) by the MoE MLPs
    in ``modules`` since the last call, summed over them; their tallies restart at 0. None where
    none holds a MoE MLP. What ``--expert-load`` reads (:func:`cost_models.moe.read_expert_load`):
    a run's load summed over its processes and steps prices the simulator's imbalance."""
    mlps = {id(m): m for mod in modules for m in mod.modules() if isinstance(m, MoeMLP)}
    if not mlps:
        return None
    total = [0] * next(iter(mlps.values())).num_experts
    for m in mlps.values():
        total = [a + b for a, b in zip(total, m.load)]
        m.load = [0] * len(m.load)
    return total


def expert_load_by_rank(reports) -> dict:
    """The ranks' recorded loads (each process's ``expert_load``: stage -> per step, tokens per
    expert) as a run reports them (``RunResult.extra["expert_load"]``): pipeline rank -> stage ->
    per step, summed over the rank's processes (its TP / CP ranks route their own tokens, with TP
    the sequence-parallel slices). Empty for a dense model."""
    out: dict = {}
    for rep in reports:
        for st, steps in rep.get("expert_load", {}).items():
            have = out.setdefault(rep["rank"], {}).setdefault(st, None)
            out[rep["rank"]][st] = steps if have is None else \
                [[a + b for a, b in zip(x, y)] for x, y in zip(have, steps)]
    return out


def run_expert_load(extra: dict) -> tuple[int, ...]:
    """A run's tokens per expert (``RunResult.extra["expert_load"]``) summed over its ranks, stages,
    steps and MoE blocks: the histogram ``pipetwin simulate --expert-load`` reads
    (:func:`cost_models.moe.write_expert_load` writes it)."""
    steps = [load for stages in extra["expert_load"].values() for per in stages.values() for load in per]
    return tuple(sum(col) for col in zip(*steps))


@dataclass(frozen=True)
class MoeRun:
    """How a run builds its MoE MLPs: the rank's expert-parallel group, the capacity factor
    (``Parallel.capacity_factor``: 0 dropless) and the loss scale 1/G (module docstring)."""

    ep: ExpertParallel = NO_EP
    capacity_factor: float = 0.0
    loss_scale: float = 1.0
    etp: ExpertTensorParallel = NO_ETP      # the routed experts' ETP group


NO_MOE = MoeRun()
