"""Planning on clusters of mixed devices (issue 45, item 3): the typed partition against its brute
force, the type-aware planner against a brute force over pool assignments and layer splits, and the
gain over the type-blind plan that the stage-time imbalance predicts."""
from __future__ import annotations

import itertools
import random

import pytest

from cost_models.partition import speed_counts, typed_split
from planner.search import compositions


def brute_split(times, S, limits, static=None, act=None, inflight=None, caps=None, sequence=None):
    """(max, sum) of the lexicographically best split, over every kind sequence and composition."""
    L, K = len(times[0]), len(times)
    best = None
    seqs = [tuple(sequence)] if sequence is not None else itertools.product(range(K), repeat=S)
    for kinds in seqs:
        if any(kinds.count(k) > limits[k] for k in range(K)):
            continue
        for counts in compositions(L, S):
            edges = list(itertools.accumulate((0, *counts)))
            ts, ok = [], True
            for s, k in enumerate(kinds):
                i, j = edges[s], edges[s + 1]
                if caps is not None and sum(static[i:j]) + inflight[s] * sum(act[i:j]) > caps[k]:
                    ok = False
                    break
                ts.append(sum(times[k][i:j]))
            if ok and (best is None or (max(ts), sum(ts)) < best):
                best = (max(ts), sum(ts))
    return best


@pytest.mark.parametrize("seed", range(40))
def test_typed_split_is_the_brute_force(seed):
    rng = random.Random(seed)
    K = rng.choice((1, 2, 3))
    L = rng.randint(1, 8)
    S = rng.randint(1, min(L, 4) + 1)
    base = [rng.choice((1.0, 2.0, 3.0, 0.5)) for _ in range(L)]
    speeds = [rng.choice((1.0, 1.5, 2.0, 3.0)) for _ in range(K)]
    times = [[b / sp for b in base] for sp in speeds]
    limits = [rng.randint(0, S) for _ in range(K)]
    mem = rng.random() < 0.5
    static = [rng.choice((1.0, 2.0)) for _ in range(L)] if mem else None
    act = [rng.choice((0.5, 1.0)) for _ in range(L)] if mem else None
    inflight = [min(S - s, 3) for s in range(S)] if mem else None
    caps = [rng.choice((3.0, 5.0, 9.0)) for _ in range(K)] if mem else None
    got = typed_split(times, S, limits, static=static, act=act, inflight=inflight, caps=caps)
    want = brute_split(times, S, limits, static, act, inflight, caps)
    if want is None:
        assert got is None
        return
    assert got is not None
    assert (got.slowest, got.total) == pytest.approx(want, rel=1e-12)
    assert sum(got.counts) == L and min(got.counts) >= 1
    assert all(got.kinds.count(k) <= limits[k] for k in range(K))
    # the split it returns has the value it claims
    edges = list(itertools.accumulate((0, *got.counts)))
    ts = [sum(times[k][edges[s]:edges[s + 1]]) for s, k in enumerate(got.kinds)]
    assert (max(ts), sum(ts)) == pytest.approx((got.slowest, got.total), rel=1e-12)


def test_speed_counts_puts_layers_in_proportion_to_speed():
    """24 uniform layers over 2 stages at speed 1 and 2 at speed 3: L_a / L_h = 1 / 3 exactly, so
    3, 3, 9, 9 (every stage 3 s); at speeds 1 and 2 the continuous optimum, 4 and 8, is whole too."""
    assert speed_counts([1.0] * 24, [1, 1, 3, 3]) == [3, 3, 9, 9]
    assert speed_counts([1.0] * 24, [1, 2, 1, 2]) == [4, 8, 4, 8]
    # 10 layers at speeds 1 and 2: continuous 3.33 | 6.67; whole: 3 | 7 (7 / 2 = 3.5 s) beats 4 | 6 (4 s)
    assert speed_counts([1.0] * 10, [1, 2]) == [3, 7]
