"""Planner speed: the exact DAPPLE search for GPT-96 (98 layers with embedding and head) on 64 A100s.

Run: ``python -m experiments.bench_planner [--global-batch 128 512 1024] [--model gpt-96]``.
The cluster is 8 DGX A100 nodes of 8 GPUs (NVLink 3 inside, 8 x 200 Gb/s InfiniBand per node). For
each global batch it prints the search time, how many stage placements (partial plans) the search
evaluated, how many complete plans it reached, how many partial plans it kept, the number of
(micro-batch count, placement policy) configurations, the size of the space it searched exactly
(plans before the memory check) and the best plan; then the same for the PipeDream objective.
"""
from __future__ import annotations

import argparse
import math
import time

from planner import SearchSpace, Topology, search_plans
from planner.clusters import resolve_cluster
from cost_models.workload_sources import load_workload
from planner.search import _policies, _rep_values, divisors


def space_size(L: int, topo: Topology, G: int, space: SearchSpace) -> int:
    """Plans in the space: sum over M, policies and S of C(L-1, S-1) partitions times the replica
    vectors of length S whose slots fit on the cluster."""
    P = topo.num_devices
    total = 0
    for M in divisors(G):
        reps = _rep_values(space, G // M, P)
        for pol in _policies(topo, space.policies):
            sl = [topo.slots(pol, r) for r in reps]
            ways = [1] + [0] * P                  # ways[k]: vectors so far taking k slots
            for S in range(1, min(L, P) + 1):
                nxt = [0] * (P + 1)
                for k, w in enumerate(ways):
                    if w:
                        for s in sl:
                            if k + s <= P:
                                nxt[k + s] += w
                ways = nxt
                n = sum(ways)
                if n == 0:
                    break
                total += math.comb(L - 1, S - 1) * n
    return total


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt-96")
    p.add_argument("--cluster", default="a100-8x8-ib")
    p.add_argument("--global-batch", type=int, nargs="+", default=[128, 512, 1024])
    a = p.parse_args(argv)
    cl = resolve_cluster(a.cluster)
    work = load_workload(a.model, cl.device)
    topo = Topology(cl)
    print(f"{a.model} ({work.num_layers} layers incl. embedding and head) on {cl.describe()}")
    for G in a.global_batch:
        size = space_size(work.num_layers, topo, G, SearchSpace())
        for obj in ("dapple", "pipedream"):
            t = time.perf_counter()
            r = search_plans(work, topo, G, objective=obj)
            dt = time.perf_counter() - t
            b = r.best
            print(f"G={G:<5d} {obj:9s} search {dt:6.2f} s  evaluated {r.evaluated:>10,} stage placements  "
                  f"{r.complete:>6,} complete plans  {r.labels:>9,} kept  {r.configurations} configurations  "
                  f"space {size:.2e} plans")
            why = (f"slowest element {b.value:.4g} s" if obj == "pipedream" else f"pivot {b.estimate.pivot}")
            print(f"          best: {b.plan.describe()}  L = {b.estimate.latency:.4g} s  ({why})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
