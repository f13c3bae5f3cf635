"""Context parallelism inside a stage (``--cp C``, ``--cp-comm ring|allgather``), on any backend.

A stage replica is T x C processes: C *CP ranks* (:class:`ContextParallel`), each a TP group of
T, that split the sequence (:mod:`executor.mesh` puts TP fastest, then CP). The sequence of s
tokens is cut into 2C chunks of m = s / 2C; CP rank i holds chunks i and 2C-1-i (the causal load
balance of Megatron-LM and Llama 3: every rank's queries see the same number of keys), s/C tokens
in all, in that order (:meth:`ContextParallel.positions`). Everything outside the attention core
is token-wise, so the stage modules run on the local s/C tokens unchanged: the embedding looks up
the rank's tokens (the GPT's position table at their positions, :class:`executor.model.Embedding`;
the Llama's rotary angles at their positions, :func:`executor.llama.rotary`), the loss is the mean
over the rank's tokens divided by C (summed over the CP ranks: the mean over the sequence), and a
stage boundary carries the local ``b x s/C x h`` (:func:`executor.model.boundary_shape`).

The attention core (:func:`attention`) sees the keys and values of all C ranks, exchanged by
``cp_comm``; both are one autograd function that keeps, as Transformer Engine's
``AttnFuncWithCPAndKVP2P`` / ``AttnFuncWithCPAndKVAllGather`` and PyTorch's ring attention do,
only this rank's Q, K, V, the output and the fp32 log-sum-exp of each query row (what a flash
kernel keeps: the ledger's S and 4as b at s/C tokens); the other ranks' K/V are received again in
the backward instead of kept:

- ``allgather`` (Llama 3): the forward all-gathers K and V over the CP group, computes, and drops
  them; the backward all-gathers them again and reduce-scatters dK, dV to their owners. On a ring
  algorithm a rank sends (C-1) X per block and micro-batch in F (X below) and 2 (C-1) X in B.
- ``ring``: C steps; at step r a rank holds the K/V block of rank i - r and, while it computes
  with it, sends it to rank i + 1 and receives the next from rank i - 1 (C-1 sends of
  X = 2 b (s/C) k e d bytes each). The backward circulates the blocks again, the local one last:
  at step r < C-1 rank i holds the block of rank i-1-r (C-1 sends of X) and the sum of the dK, dV
  the ranks before it computed for that block, adds its own and sends the sum on (C-1 sends of X);
  the sum of its own block arrives from rank i-1 at the last step. Per block and micro-batch a
  rank sends (C-1) X in F and 2 (C-1) X in B, as the all-gather's ring algorithm does
  (the cost model's closed forms, :meth:`cost_models.transformer.TransformerCostModel.cp_exchange`).

Per (query chunk, key chunk) pair: a key chunk after the query chunk is skipped, the same chunk
is causal, an earlier one is whole. The partial results are merged by their log-sum-exp (online
softmax, as flash and ring attention do); the backward uses the merged output and log-sum-exp
(FlashAttention's backward, block by block). The math runs in fp32 with plain matrix products
(device-neutral: the same code on gloo/CPU and NCCL/GPU); score blocks of m x m are transient.

The weights are the same on the C ranks of a stage; each rank's backward yields its share of
the gradients (its tokens' terms, the K/V terms other ranks' queries sent back included), so
they are summed over the C ranks: with the data-parallel replicas in one all-reduce over R x C
ranks where the schedule all-reduces the stage (the runtime's ALLREDUCE on the lifted stage
group, :class:`executor.worker.ProcessGroups`), else at OPTIM over the CP group alone
(:class:`GradientSums`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from cost_models.parallel import CP_COMMS


@dataclass(frozen=True)
class ContextParallel:
    """This process's place in its CP group: ``size`` C, ``rank`` i, ``group`` (None when C = 1),
    ``ranks``: the group's process-group ranks in CP-rank order (the ring's peers), ``comm``."""

    size: int = 1
    rank: int = 0
    group: object = None
    ranks: tuple[int, ...] = ()
    comm: str = "ring"

    def __post_init__(self):
        if self.comm not in CP_COMMS:
            raise ValueError(f"--cp-comm must be one of {', '.join(CP_COMMS)}; got {self.comm!r}")

    @property
    def on(self) -> bool:
        return self.size > 1

    def chunks(self, rank: int | None = None) -> tuple[int, int]:
        """The two of the 2C chunks CP rank ``rank`` (default this one) holds: i and 2C-1-i."""
        i = self.rank if rank is None else rank
        return i, 2 * self.size - 1 - i

    def positions(self, seq_len: int, device=None) -> torch.Tensor:
        """The sequence positions of this rank's s/C tokens, in the order it holds them."""
        m = seq_len // (2 * self.size)
        return torch.cat([torch.arange(c * m, (c + 1) * m, device=device) for c in self.chunks()])

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of ``t`` [b, s, ...] (dim 1 is the sequence): [b, s/C, ...]."""
        if not self.on:
            return t
        return t[:, self.positions(t.shape[1], t.device)]


SINGLE = ContextParallel()


# ---------------------------------------------------------------------------- the attention core
def _block(q, k, v, lse_or_none, scale, causal):
    """Scores of query chunk ``q`` [b, k, g, m, e] against key chunk ``k`` [b, k, 1, n, e]: with
    ``lse_or_none`` None the block's (output, log-sum-exp); else the probabilities under that
    (final) log-sum-exp."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        m, n = s.shape[-2], s.shape[-1]
        s = s.masked_fill(torch.ones(m, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    if lse_or_none is not None:
        return torch.exp(s - lse_or_none.unsqueeze(-1))
    lse = torch.logsumexp(s, -1)
    return torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v), lse


def _pairs(cp: ContextParallel, source: int):
    """(query half, key half, causal) of this rank's chunks against the block of CP rank ``source``
    that attend (a later key chunk is skipped)."""
    mine, theirs = cp.chunks(), cp.chunks(source)
    return [(a, b, theirs[b] == mine[a]) for a in range(2) for b in range(2) if theirs[b] <= mine[a]]


def _halves(t):
    m = t.shape[-2] // 2
    return t[..., :m, :], t[..., m:, :]


def _grouped(q, k, v):
    """[b, a, n, e] queries and [b, k, n, e] keys/values in fp32 at least, as [b, k, g, n, e] and [b, k, 1, n, e]."""
    b, a, n, e = q.shape
    kv = k.shape[1]
    return (_wide(q).reshape(b, kv, a // kv, n, e), _wide(k).unsqueeze(2), _wide(v).unsqueeze(2))


def _wide(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.element_size() < 4 else t


class _Online:
    """Per query half, the running output and log-sum-exp of the blocks merged so far."""

    def __init__(self, q):
        self.out = [torch.zeros_like(h) for h in _halves(q)]
        self.lse = [torch.full(h.shape[:-1], float("-inf"), dtype=h.dtype, device=h.device) for h in _halves(q)]

    def add(self, cp, source, q, k, v, scale):
        qs, ks, vs = _halves(q), _halves(k), _halves(v)
        for a, b, causal in _pairs(cp, source):
            o, lse = _block(qs[a], ks[b], vs[b], None, scale, causal)
            new = torch.logaddexp(self.lse[a], lse)
            self.out[a] = self.out[a] * torch.exp(self.lse[a] - new).unsqueeze(-1) + \
                o * torch.exp(lse - new).unsqueeze(-1)
            self.lse[a] = new


def _block_grads(cp, source, q, k, v, lse, dout, delta, dq, scale):
    """Add the block of CP rank ``source`` (``k``, ``v``) to ``dq`` and return its (dk, dv), from the
    merged log-sum-exp ``lse`` and ``delta`` = rowsum(dout x out) of this rank's queries."""
    qs, ks, vs = _halves(q), _halves(k), _halves(v)
    lses, douts, deltas, dqs = _halves(lse.unsqueeze(-1)), _halves(dout), _halves(delta.unsqueeze(-1)), _halves(dq)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    dks, dvs = _halves(dk), _halves(dv)
    for a, b, causal in _pairs(cp, source):
        p = _block(qs[a], ks[b], None, lses[a].squeeze(-1), scale, causal)
        dvs[b].add_(torch.matmul(p.transpose(-1, -2), douts[a]).sum(2, keepdim=True))
        dp = torch.matmul(douts[a], vs[b].transpose(-1, -2))
        ds = p * (dp - deltas[a]) * scale
        dqs[a].add_(torch.matmul(ds, ks[b]))
        dks[b].add_(torch.matmul(ds.transpose(-1, -2), qs[a]).sum(2, keepdim=True))
    return dk, dv


def _all_gather(t: torch.Tensor, cp: ContextParallel) -> list[torch.Tensor]:
    t = t.contiguous()
    parts = [torch.empty_like(t) for _ in range(cp.size)]
    dist.all_gather(parts, t, group=cp.group)
    return parts


def _shift(cp: ContextParallel, tensors: list[torch.Tensor]):
    """Start sending ``tensors`` to the next CP rank and receiving as many from the previous one;
    returns (received buffers, requests to wait for)."""
    nxt, prev = cp.ranks[(cp.rank + 1) % cp.size], cp.ranks[(cp.rank - 1) % cp.size]
    tensors = [t.contiguous() for t in tensors]
    bufs = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, nxt, cp.group) for t in tensors] + \
          [dist.P2POp(dist.irecv, b, prev, cp.group) for b in bufs]
    return bufs, dist.batch_isend_irecv(ops)


def _wait(reqs) -> None:
    """Wait for the requests (once each: gloo's wait on a finished request blocks); returns None."""
    for r in reqs or ():
        r.wait()
    return None


class _ContextAttention(torch.autograd.Function):
    """Causal attention of this rank's queries over the keys/values of all CP ranks (see the
    module docstring); keeps q, k, v, the output and the log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v, cp, scale):
        with torch.autocast(q.device.type, enabled=False):
            qg, kg, vg = _grouped(q, k, v)
            acc = _Online(qg)
            if cp.comm == "allgather":
                ks, vs = _all_gather(kg, cp), _all_gather(vg, cp)
                for j in range(cp.size):
                    acc.add(cp, j, qg, ks[j], vs[j], scale)
                del ks, vs
            else:
                kv = [kg, vg]
                for r in range(cp.size):
                    reqs = None
                    if r < cp.size - 1:
                        nxt, reqs = _shift(cp, kv)
                    acc.add(cp, (cp.rank - r) % cp.size, qg, kv[0], kv[1], scale)
                    if reqs is not None:
                        _wait(reqs)
                        kv = nxt
            out = torch.cat(acc.out, -2)                   # [b, k, g, n, e]
            lse = torch.cat(acc.lse, -1).reshape(q.shape[:-1])      # [b, a, n] fp32
            b, a, n, e = q.shape
            # laid out [b, n, a, e] (as a flash kernel's output): the caller's transpose + reshape
            # to the output projection's input is then a view of the same storage
            y = out.reshape(b, a, n, e).transpose(1, 2).to(q.dtype).contiguous().transpose(1, 2)
        ctx.save_for_backward(q, k, v, y, lse)
        ctx.cp, ctx.scale = cp, scale
        return y

    @staticmethod
    def backward(ctx, dy):
        q, k, v, y, lse = ctx.saved_tensors
        cp, scale = ctx.cp, ctx.scale
        with torch.autocast(q.device.type, enabled=False):
            qg, kg, vg = _grouped(q, k, v)
            b, a, n, e = q.shape
            kv = kg.shape[1]
            out = _wide(y).reshape(b, kv, a // kv, n, e)
            dout = _wide(dy).to(out.dtype).reshape(b, kv, a // kv, n, e)
            lse_g = lse.reshape(b, kv, a // kv, n)
            delta = (dout * out).sum(-1)
            dq = torch.zeros_like(qg)
            if cp.comm == "allgather":
                ks, vs = _all_gather(kg, cp), _all_gather(vg, cp)
                grads = [_block_grads(cp, j, qg, ks[j], vs[j], lse_g, dout, delta, dq, scale)
                         for j in range(cp.size)]
                del ks, vs
                dk, dv = torch.empty_like(kg, memory_format=torch.contiguous_format), \
                    torch.empty_like(vg, memory_format=torch.contiguous_format)
                dist.reduce_scatter(dk, [g[0].contiguous() for g in grads], group=cp.group)
                dist.reduce_scatter(dv, [g[1].contiguous() for g in grads], group=cp.group)
            else:       # the other ranks' blocks first (from rank i-1 on), the local one last
                received, reqs = _shift(cp, [kg, vg])
                acc = None
                for r in range(cp.size):
                    if r < cp.size - 1:
                        reqs = _wait(reqs)
                        block, source = received, (cp.rank - 1 - r) % cp.size
                        if r < cp.size - 2:          # passed on while this rank computes with it
                            received, reqs = _shift(cp, block)
                    else:
                        block, source = [kg, vg], cp.rank
                    dk, dv = _block_grads(cp, source, qg, block[0], block[1], lse_g, dout, delta, dq, scale)
                    if acc is not None:
                        dk, dv = dk + acc[0], dv + acc[1]
                    if r < cp.size - 1:
                        reqs = _wait(reqs)        # (the blocks' messages go first on the pair)
                        acc, sums = _shift(cp, [dk, dv])    # the block's gradient sum follows it round the ring
                        _wait(sums)
        return (dq.reshape(q.shape).to(q.dtype), dk.squeeze(2).to(k.dtype), dv.squeeze(2).to(v.dtype), None, None)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """Causal attention of this CP rank's queries ``q`` [b, a, s/C, e] over the keys and values
    ``k``, ``v`` [b, k, s/C, e] of all C ranks (k divides a: grouped-query heads ``i // (a / k)``);
    the output [b, a, s/C, e] as scaled_dot_product_attention(is_causal=True) of the whole
    sequence gives it at this rank's positions."""
    return _ContextAttention.apply(q, k, v, cp, 1.0 / math.sqrt(q.shape[-1]))


def warm_up(cp: ContextParallel, device) -> None:
    """One tiny exchange of the kind the attention uses, so a NCCL communicator for the ring's
    peers exists before the first step (the collectives' is made by the group's creation)."""
    if cp.on and cp.comm == "ring":
        bufs, reqs = _shift(cp, [torch.zeros(1, device=device)])
        _wait(reqs)


# ---------------------------------------------------------------------------- the gradients' sum
class GradientSums:
    """Several gradient sums at OPTIM, one after the other (each a
    :class:`executor.user_model.TiedGradients`): the CP group's sum of the stages the schedule
    does not all-reduce, then the sequence-parallel norms' over the TP group. The runtime's
    ``tied``: ``excluded`` (left out of the stages' all-reduces) is the union of theirs."""

    def __init__(self, sums: list):
        self.sums = [s for s in sums if s is not None]
        self.excluded = frozenset().union(*(s.excluded for s in self.sums))

    def sync(self, timeout: float, step: int) -> None:
        for s in self.sums:
            s.sync(timeout, step)
