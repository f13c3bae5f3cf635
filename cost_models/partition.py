"""Contiguous partitions of a layer stack into pipeline stages: the one place the rules live.

A partition is a list of counts, one per stage, of consecutive layers. Rules:

- **even** (:func:`even_counts`): as equal as possible; the extra layers go to the inner stages
  first (1, 2, ..., S-2), then to stage 0, then to stage S-1 (those two also carry the embedding
  and the head of a transformer, so they get the smaller counts).
- **transformer stacks** are [embedding, L blocks, head] (L + 2 layers). The executor partitions
  the blocks (:func:`block_ranges`: the embedding joins stage 0, the head stage S-1, and those two
  may hold no block); cost models and the planner count all L + 2 layers
  (:func:`default_partition`, :func:`blocks_from_layers` converts).
- **weighted** (:func:`balanced_edges`): cut where the cumulative weight (time, parameters)
  crosses k/S of the total.
- **min-max** (:func:`balanced_counts`): the contiguous split whose heaviest stage is as light as
  possible (exact), every stage with at least one layer. A user's layer stack (``--model
  PATH.py:FUNC``) is split this way by default over its parameter counts
  (:func:`stack_partition`), or over its measured times (forward + backward from a calibration
  profile); the executor and the cost models both call :func:`stack_partition`, so a simulation
  and a run of the same model split it the same way.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .files import short_list


def ranges(counts: Sequence[int]) -> list[range]:
    """Consecutive index ranges of the given sizes."""
    out, start = [], 0
    for n in counts:
        out.append(range(start, start + n))
        start += n
    return out


def even_counts(total: int, parts: int) -> list[int]:
    """``total`` items in ``parts`` near-equal counts (the module docstring's even rule)."""
    if parts < 1:
        raise ValueError(f"need at least one stage; got {parts}")
    base, extra = divmod(total, parts)
    inner = list(range(1, parts - 1))
    order = inner + [s for s in (0, parts - 1) if s not in inner]
    counts = [base] * parts
    for s in order[:extra]:
        counts[s] += 1
    return counts


def check_counts(counts, total: int, parts: int, *, what: str = "layer", empty_ends: bool = False) -> list[int]:
    """``counts`` as a list of ints, or ValueError saying what is wrong with it: ``parts`` whole
    counts (of ``what``, singular) summing to ``total``, each >= 1 (with ``empty_ends``, stages 0
    and S-1 may be 0)."""
    try:
        items = list(counts)
        out = [int(b) for b in items]
    except (TypeError, ValueError):
        raise ValueError(f"a partition is a list of {what} counts per stage; got {short_list(counts)}") from None
    if any(isinstance(b, bool) or c != b for b, c in zip(items, out)):
        raise ValueError(f"a partition is a list of whole {what} counts per stage; got {short_list(items)}")
    if len(out) != parts:
        raise ValueError(f"the partition {short_list(out)} has {len(out)} stage(s); the schedule has {parts} "
                         f"stages per model copy")
    if sum(out) != total:
        raise ValueError(f"the partition {short_list(out)} covers {sum(out)} {what}s; the model has {total}")
    if any(c < 0 for c in out):
        raise ValueError(f"the partition {short_list(out)} has a negative {what} count")
    empty = [s for s, c in enumerate(out) if c == 0 and not (empty_ends and parts > 1 and s in (0, parts - 1))]
    if empty:
        ends = (" (only the first stage, with the embedding, and the last, with the head, may hold no block)"
                if empty_ends else "")
        raise ValueError(f"the partition {short_list(out)} leaves stage {empty[0]} without layers{ends}")
    return out


def layer_ranges(num_layers: int, num_stages: int, counts: Sequence[int] | None = None) -> list[range]:
    """Layer ranges per stage: the given ``counts`` (validated) or the even rule."""
    if counts is not None:
        return ranges(check_counts(counts, num_layers, num_stages))
    if num_layers < num_stages:
        raise ValueError(f"cannot split {num_layers} layers into {num_stages} stages; "
                         f"use fewer devices/chunks or a deeper model")
    return ranges(even_counts(num_layers, num_stages))


def block_ranges(num_blocks: int, num_stages: int, blocks: Sequence[int] | None = None) -> list[range]:
    """Transformer block ranges per stage (the executor's split): the given blocks per stage
    (validated; the first and last stage may hold none) or the even rule over the blocks."""
    if num_stages < 1:
        raise ValueError(f"need at least one stage; got {num_stages}")
    if blocks is not None:
        return ranges(check_counts(blocks, num_blocks, num_stages, what="block", empty_ends=True))
    if num_blocks < num_stages:
        raise ValueError(f"the model has {num_blocks} layers but the schedule has {num_stages} stages per "
                         f"copy; use a model with at least {num_stages} layers (--model FILE.yaml) or fewer "
                         f"stages")
    return ranges(even_counts(num_blocks, num_stages))


def layers_from_blocks(blocks: Sequence[int]) -> list[int]:
    """Layer counts over [embedding, blocks, head] from blocks per stage (the embedding counts in
    stage 0, the head in the last)."""
    out = list(blocks)
    out[0] += 1
    out[-1] += 1
    return out


def default_partition(num_blocks: int, num_stages: int) -> tuple[int, ...]:
    """Layer counts per stage over [embedding, blocks..., head] of the executor's default split
    (:func:`block_ranges`). With fewer blocks than stages (which the executor refuses), the
    L + 2 layers are split by the even rule."""
    if num_stages < 1:
        raise ValueError(f"need at least one stage; got {num_stages}")
    if num_stages == 1:
        return (num_blocks + 2,)
    if num_blocks < num_stages:
        return tuple(even_counts(num_blocks + 2, num_stages))
    return tuple(layers_from_blocks(even_counts(num_blocks, num_stages)))


def blocks_from_layers(layers, num_blocks: int) -> list[int]:
    """Blocks per stage from layer counts over the L + 2 layers [embedding, blocks..., head] (how
    the planner and :func:`default_partition` count): stage 0's count includes the embedding, the
    last stage's the head."""
    try:
        counts = [int(c) for c in layers]
    except (TypeError, ValueError):
        raise ValueError(f"a layer partition is a list of layer counts per stage; got {short_list(layers)}") from None
    if not counts:
        raise ValueError("the layer partition is empty")
    if sum(counts) != num_blocks + 2:
        raise ValueError(f"the layer partition {short_list(counts)} covers {sum(counts)} layers; the model has "
                         f"{num_blocks + 2} ({num_blocks} blocks + embedding + head)")
    if any(c < 1 for c in counts):
        raise ValueError(f"the layer partition {short_list(counts)} has a stage without layers")
    out = list(counts)
    out[0] -= 1
    out[-1] -= 1
    return out


def balanced_edges(weights: Sequence[float], parts: int) -> list[int]:
    """Cut points (parts + 1 edges) of a contiguous split of ``weights`` where the cumulative weight
    crosses k / parts of the total (every part keeps at least one item)."""
    n = len(weights)
    total = sum(weights) or 1.0
    edges, acc, i = [0], 0.0, 0
    for k in range(1, parts):
        target = total * k / parts
        while i < n - (parts - k) and (acc + weights[i] / 2 < target or i < edges[-1] + 1):
            acc += weights[i]
            i += 1
        edges.append(i)
    edges.append(n)
    return edges


def balanced_counts(weights: Sequence[float], parts: int) -> list[int]:
    """Layer counts of the contiguous split of ``weights`` into ``parts`` stages (each at least one
    layer) whose heaviest stage is lightest: the exact optimum, the smallest feasible bottleneck
    among the sums of contiguous runs (binary search, a greedy feasibility check). Among the splits
    with that bottleneck, the one whose stage weights have the smallest sum of squares (the others
    as even as they can be; a dynamic programme, first cut on ties), or, for stacks too long for it
    (layers^2 x stages > 4e6), the greedy one (each stage takes as many layers as fit)."""
    n = len(weights)
    if parts < 1:
        raise ValueError(f"need at least one stage; got {parts}")
    if n < parts:
        raise ValueError(f"cannot split {n} layers into {parts} stages; use fewer devices/chunks or a deeper model")
    w = [float(x) for x in weights]
    if any(x < 0 or x != x or x == float("inf") for x in w):
        raise ValueError(f"layer weights must be finite and >= 0; got {short_list(weights)}")

    prefix = [0.0]
    for x in w:
        prefix.append(prefix[-1] + x)

    def split(limit: float) -> list[int] | None:
        # run sums as differences of the prefix sums: the same arithmetic as the candidates
        counts, start = [], 0
        for i in range(n):
            if prefix[i + 1] - prefix[i] > limit:
                return None
            opened = len(counts)
            must_open = opened < parts and n - i == parts - opened   # each stage left needs a layer
            if not counts or must_open or prefix[i + 1] - prefix[start] > limit:
                if opened == parts:
                    return None
                counts.append(0)
                start = i
            counts[-1] += 1
        return counts if len(counts) == parts else None

    candidates = sorted({prefix[j] - prefix[i] for i in range(n) for j in range(i + 1, n + 1)})
    lo, hi = 0, len(candidates) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if split(candidates[mid]) is not None:
            hi = mid
        else:
            lo = mid + 1
    limit = candidates[lo]
    if n * n * parts > 4_000_000:
        out = split(limit)
        assert out is not None   # the whole sum is always feasible
        return out
    inf = float("inf")
    # cost[k][i]: least sum of squares of the first i layers in k stages, each within the limit
    cost = [[inf] * (n + 1) for _ in range(parts + 1)]
    back = [[0] * (n + 1) for _ in range(parts + 1)]
    cost[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                run = prefix[i] - prefix[j]
                if run > limit or cost[k - 1][j] == inf:
                    continue
                c = cost[k - 1][j] + run * run
                if c < cost[k][i]:
                    cost[k][i], back[k][i] = c, j
    out, i = [], n
    for k in range(parts, 0, -1):
        j = back[k][i]
        out.append(i - j)
        i = j
    return out[::-1]


def stack_partition(params: Sequence[float], num_stages: int, counts: Sequence[int] | None = None) -> list[int]:
    """Layers per stage of a user's layer stack: the given ``counts`` (validated) or the min-max
    split of the layers' parameter counts (:func:`balanced_counts`)."""
    if counts is not None:
        return check_counts(counts, len(params), num_stages)
    return balanced_counts(params, num_stages)


# ---------------------------------------------------------------------- stages on devices of several kinds
INF = float("inf")


def speed_counts(weights: Sequence[float], speeds: Sequence[float]) -> list[int]:
    """Layer counts of the contiguous split of ``weights`` (seconds of each layer on a device of
    relative throughput 1) over stages whose devices run at relative throughputs ``speeds`` (stage
    s takes ``sum(weights of its layers) / speeds[s]``), each stage >= 1 layer, whose slowest stage
    is fastest (among those, the least sum of stage times): :func:`typed_split` with stage s's own
    kind. For L uniform layers of c seconds and two speeds s_a, s_h the continuous optimum gives
    layers in proportion to speed, L_a / L_h = s_a / s_h (every stage then takes L c / sum(s));
    this rounds it exactly."""
    if len(speeds) < 1 or any(not (x > 0 and x != INF) for x in speeds):
        raise ValueError(f"stage speeds must be finite and > 0; got {short_list(speeds)}")
    S = len(speeds)
    out = typed_split([[w / s for w in weights] for s in speeds], S, [1] * S, sequence=tuple(range(S)))
    if out is None:
        raise ValueError(f"cannot split {len(weights)} layers into {S} stages")
    return list(out.counts)


@dataclass(frozen=True)
class TypedSplit:
    """A contiguous split over stages of typed devices: ``counts`` layers per stage, ``kinds`` the
    device kind of each stage, ``slowest`` the largest stage time, ``total`` the sum of stage times."""

    counts: tuple[int, ...]
    kinds: tuple[int, ...]
    slowest: float
    total: float


def typed_split(times: Sequence[Sequence[float]], stages: int, limits: Sequence[int], *,
                static: Sequence[float] | None = None, act: Sequence[float] | None = None,
                inflight: Sequence[float] | None = None, caps: Sequence[float] | None = None,
                sequence: Sequence[int] | None = None) -> TypedSplit | None:
    """The split of L layers into ``stages`` contiguous stages (each >= 1 layer), each stage on one
    device kind k (at most ``limits[k]`` stages of kind k; ``sequence``: the kinds given, stage by
    stage), whose slowest stage is fastest and, among those, whose stage times sum least (the
    lexicographic optimum of (max_s t_s, sum_s t_s)); None when no split fits.

    ``times[k][l]``: seconds of layer l on kind k (a stage's time is the sum over its layers).
    Memory (optional): stage s on kind k holds ``sum static[l] + inflight[s] * sum act[l]`` bytes over
    its layers, within ``caps[k]``.

    Exact, by two dynamic programmes over (stages placed, stages of each kind used, layers placed):
    the least bottleneck B* = min over splits of max_s t_s (``B[s+1][n + e_k][j] = min_i max(B[s][n][i],
    t_k(i, j))``), then the least sum among the splits whose every stage is within B*
    (``C[s+1][n + e_k][j] = min_i C[s][n][i] + t_k(i, j)``, t_k <= B*). The stage count and the number of
    kinds are small (states: stages x kind-count vectors x L; each step an L x L minimum), so it runs
    in O(S^K L^2) array work. Stage times within a relative 1e-12 of B* count as B* (the same time
    summed in another order rounds differently). With one kind of speed 1 it is :func:`balanced_counts`' bottleneck."""
    import numpy as np
    K = len(times)
    L = len(times[0]) if K else 0
    if K < 1 or any(len(t) != L for t in times):
        raise ValueError("typed_split: times needs one list of per-layer seconds per kind, all of one length")
    if stages < 1 or L < stages:
        return None
    if len(limits) != K:
        raise ValueError(f"typed_split: {len(limits)} limits for {K} kinds")
    if sequence is not None and (len(sequence) != stages or any(not 0 <= k < K for k in sequence)):
        raise ValueError(f"typed_split: sequence {short_list(sequence)} must give each of {stages} stages a kind")
    idx = np.arange(L + 1)
    order = idx[:, None] < idx[None, :]                   # i < j: a stage [i, j) has a layer
    tabs = []
    for k in range(K):
        pre = np.concatenate(([0.0], np.cumsum(np.asarray(times[k], dtype=float))))
        tabs.append(np.where(order, pre[None, :] - pre[:, None], INF))
    mem = None
    if caps is not None:
        ps = np.concatenate(([0.0], np.cumsum(np.asarray(static if static is not None else [0.0] * L, dtype=float))))
        pa = np.concatenate(([0.0], np.cumsum(np.asarray(act if act is not None else [0.0] * L, dtype=float))))
        st_run, act_run = ps[None, :] - ps[:, None], pa[None, :] - pa[:, None]
        infl = list(inflight) if inflight is not None else [1.0] * stages
        mem = lambda s, k: st_run + infl[s] * act_run <= caps[k]  # noqa: E731

    def table(s: int, k: int, limit: float):
        t = tabs[k]
        if mem is not None:
            t = np.where(mem(s, k), t, INF)
        if limit < INF:
            t = np.where(t <= limit, t, INF)
        return t

    def run(combine, limit: float):
        start = np.full(L + 1, INF)
        start[0] = 0.0
        front = {(0,) * K: start}
        back = []
        for s in range(stages):
            new, how = {}, {}
            kinds = [sequence[s]] if sequence is not None else range(K)
            cache = {}
            for n, arr in front.items():
                for k in kinds:
                    if n[k] >= limits[k]:
                        continue
                    t = cache.get(k)
                    if t is None:
                        t = cache[k] = table(s, k, limit)
                    vals = combine(arr[:, None], t)          # (i, j)
                    arg = vals.argmin(axis=0)
                    best = vals[arg, idx]
                    n2 = tuple(c + (x == k) for x, c in enumerate(n))
                    cur = new.get(n2)
                    if cur is None:
                        new[n2], how[n2] = best, (np.full(L + 1, k), arg, [n] * (L + 1))
                    else:
                        better = best < cur
                        if better.any():
                            new[n2] = np.where(better, best, cur)
                            hk, ha, hn = how[n2]
                            how[n2] = (np.where(better, k, hk), np.where(better, arg, ha),
                                       [n if b else o for b, o in zip(better, hn)])
            back.append(how)
            front = new
        finals = [(arr[L], n) for n, arr in front.items() if arr[L] < INF]
        if not finals:
            return None
        val, n = min(finals, key=lambda x: x[0])
        counts, kinds, j = [], [], L
        for s in range(stages - 1, -1, -1):
            hk, ha, hn = back[s][n]
            k, i, n = int(hk[j]), int(ha[j]), hn[j]
            counts.append(j - i)
            kinds.append(k)
            j = i
        return val, tuple(counts[::-1]), tuple(kinds[::-1])

    first = run(np.maximum, INF)
    if first is None:
        return None
    bottleneck = first[0]
    second = run(np.add, bottleneck * (1 + 1e-12))     # within rounding of B*: sums in another order tie
    assert second is not None      # the first pass's split is within its own bottleneck
    total, counts, kinds = second
    stage_times = [tabs[k][i, i + c] for k, i, c in zip(kinds, np.cumsum((0, *counts[:-1])), counts)]
    return TypedSplit(counts, kinds, float(max(stage_times)), float(total))
