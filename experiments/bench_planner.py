"""Planner speed: the exact DAPPLE search for GPT-96 (98 layers with embedding and head) on 64 A100s,
and (``--layout``) the whole-layout search at the frontier.

Run: ``python -m experiments.bench_planner [--global-batch 128 512 1024] [--model gpt-96]``, or
``python -m experiments.bench_planner --layout [--repeat 1]``: ``plan --tp auto`` (T x D x R,
schedule family, chunks, variant, micro-batch, recompute, ZeRO-1, SP; :func:`planner.layout.plan_layouts`)
for Llama-3-70B on 1,024 H100s (G = 1,024 sequences of 8,192) and Llama-3-405B on 16,384 H100s
(G = 2,048, Llama 3's batch), aims <= 30 s and <= 60 s, and the mixtures of experts DeepSeek-V3 on
2,048 H100s (G = 15,360 of 4,096) and Qwen3-235B-A22B on 1,024 (G = 2,048), EP and the overlap
searched, aims <= 60 s; each case's best wall and CPU seconds
over the repeats, also as a ratio to a bare SimPy loop of 100,000 timeouts timed beside it (the
method of :mod:`experiments.bench_sim`), with the search's counts and the plan it found.
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
from cost_models.workloads.workload_sources import load_workload
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


# the mixtures of experts (issue 41): DeepSeek-V3 on 2,048 H100s at the batch that ended its ramp (15,360
# sequences of 4,096) and Qwen3-235B-A22B on 1,024
LAYOUT_CASES = (("llama3-70b", "dgx-h100-ib:128", 1024, 30.0), ("llama3-405b", "dgx-h100-ib:2048", 2048, 60.0),
                ("deepseek-v3", "dgx-h100-ib:256", 15360, 60.0), ("qwen3-235b-a22b", "dgx-h100-ib:128", 2048, 60.0))


def bare_loop_100k() -> float:
    """Seconds of a bare SimPy loop of 100,000 timeouts (one process)."""
    import simpy
    env = simpy.Environment()

    def dev():
        for _ in range(100_000):
            yield env.timeout(1.0)

    env.process(dev())
    t = time.perf_counter()
    env.run()
    return time.perf_counter() - t


def layout_cases(repeat: int = 1) -> int:
    """The whole-layout search's frontier cases (module docstring)."""
    from cost_models import load_model
    from planner.layout import plan_layouts
    print(f"{'case':<42}  {'wall_s':>7}  {'cpu_s':>6}  {'ratio':>8}  {'aim':>7}  candidates  simulated  best")
    for model, cluster, G, aim in LAYOUT_CASES:
        cl = resolve_cluster(cluster)
        walls, cpus, loops = [], [], []
        spec = load_model(model)
        for _ in range(repeat):
            loops.append(bare_loop_100k())
            w, c = time.perf_counter(), time.process_time()
            res = plan_layouts(spec, cl, G, top_k=1)
            walls.append(time.perf_counter() - w)
            cpus.append(time.process_time() - c)
        b = res.records()[0]
        ep = f" EP={b['ep']}" if spec.is_moe else ""
        best = (f"{b['schedule']} T={b['tp']} D={b['devices']} R={b['dp']} b={b['micro_batch']} {b['recompute']} "
                f"ZeRO-{b['zero']}{' SP' if b['sequence_parallel'] else ''}"
                f"{ep}{' overlap' if b['overlap_fb'] else ''} "
                f"{b['iteration_time']:.4g} s MFU {b['mfu']:.1%}")
        name = f"plan {spec.name} G={G} on {cl.num_devices:,} H100s"
        print(f"{name:<42}  {min(walls):7.2f}  {min(cpus):6.2f}  {min(walls) / min(loops):7.1f}x  "
              f"{f'<= {aim:g} s':>7}  {res.candidates:>10,}  {res.simulated:>9,}  {best}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt-96")
    p.add_argument("--cluster", default="a100-8x8-ib")
    p.add_argument("--global-batch", type=int, nargs="+", default=[128, 512, 1024])
    p.add_argument("--layout", action="store_true", help="the whole-layout search's frontier cases instead")
    p.add_argument("--repeat", type=int, default=1, help="with --layout: runs per case (the best counts)")
    a = p.parse_args(argv)
    if a.layout:
        return layout_cases(a.repeat)
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
