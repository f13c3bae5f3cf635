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
