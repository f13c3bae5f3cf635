"""Simulator speed, as ratios to a bare SimPy loop measured in the same run.

Run: ``python -m experiments.bench_sim [--repeat 3] [--no-planner]``. Cases (each end to end:
build, lower, validate, bind the costs, place on the cluster, simulate, metrics; no per-op trace):

* ``bitpipe D=32 N=256`` (unit costs) against a bare SimPy loop with as many events (one
  process per device, one timeout per op of its program): aim <= 4x;
* a 1,024-GPU job, ``dapple D=16 R=64 N=128``, gpt-96 on ``dgx-a100-ib:128``, against a bare
  SimPy loop of 100,000 timeouts: aim <= 10x;
* a 10,240-GPU job, the same at R=640 on ``dgx-a100-ib:1280``: aim <= 50x;
* a 16,384-GPU tensor-parallel job, Llama-3-405B at TP 8 x PP 16 x DP 128 (interleaved, 2 chunks,
  N=16: Llama 3's 2,048 sequences per step, full recompute) on ``dgx-h100-ib:2048`` in Llama 3's
  rank order [TP, PP, DP] (``--device-map sequential``: a pipeline inside one rail group), through
  the typed job (:func:`sim.simulate_job`): aim <= 20x. (In Megatron's order [TP, DP, PP], the
  default, the data-parallel rings' hops between rail groups tell 32 kinds of replicas apart,
  and 32 replicas are simulated.)
* (unless ``--no-planner``) ``plan -m gpt-96 -G 1024`` on ``dgx-a100-ib:128`` (search, re-simulation
  and baselines): aim <= 10 s, shown also as a ratio to the 100k loop (run once: it takes minutes).

Each case runs ``--repeat`` times, interleaved with the bare loops so they share the machine's
noise; the best time of each counts and ``spread`` (slowest / fastest - 1) is the noise of the
sitting. ``peak MiB`` is the largest Python allocation of one run (tracemalloc, a separate
untimed run): bounded, since identical replicas keep no per-op records.
"""
from __future__ import annotations

import argparse
import time
import tracemalloc

import simpy

from cost_models import TransformerCostModel, UnitCostModel, load_cluster, load_model
from schedules import build, lower, validate
from sim import run


def bare_loop(ops_per_device: list[int]) -> float:
    """Seconds for one SimPy process per entry doing that many unit timeouts."""
    env = simpy.Environment()

    def dev(n):
        for _ in range(n):
            yield env.timeout(1.0)

    for n in ops_per_device:
        env.process(dev(n))
    t = time.perf_counter()
    env.run()
    return time.perf_counter() - t


def bitpipe_case(D: int = 32, N: int = 256):
    low = validate(lower(build("bitpipe", D, N)))
    res = run(low, UnitCostModel().bind(low))
    return res.metrics(), [len(p) for p in low.programs]


def cluster_case(R: int, D: int = 16, N: int = 128, model: str = "gpt-96", cluster: str = "dgx-a100-ib"):
    low = validate(lower(build("dapple", D, N), replicas=R))
    cl = load_cluster(f"{cluster}:{-(-D * R // 8)}")
    costs = TransformerCostModel(load_model(model), cl.device).bind(low)
    res = run(low, costs, cl.place(low))
    if res.simulated_replicas != 1:
        raise RuntimeError(f"R={R}: replicas were not simulated as one ({res.full_reason})")
    return res.metrics(), None


def tensor_parallel_case(R: int = 128):
    from cost_models.job import Job, Layout
    from sim import simulate_job
    job = Job(layout=Layout(schedule="interleaved", devices=16, microbatches=16, replicas=R, tp=8),
              model="llama3-405b", cluster=f"dgx-h100-ib:{16 * R}", recompute="full", device_map="sequential")
    _, res = simulate_job(job)
    if res.simulated_replicas != 1:
        raise RuntimeError(f"R={R}: replicas were not simulated as one ({res.full_reason})")
    return res.metrics(), None


def planner_case(G: int = 1024, cluster: str = "dgx-a100-ib:128"):
    from planner import plan_training
    # FLOP-rate costs, as the README's bench table was measured
    res = plan_training("gpt-96", load_cluster(cluster), G, progress=False, cost_model="linear")
    return res, None


def _timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def _peak_mib(fn) -> float:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1] / 2 ** 20
    finally:
        tracemalloc.stop()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--no-planner", action="store_true", help="leave the planner case out")
    p.add_argument("--no-memory", action="store_true", help="leave the tracemalloc pass out")
    a = p.parse_args(argv)
    if a.repeat < 1:
        raise SystemExit("bench_sim: --repeat must be >= 1")
    cases = [("bitpipe D=32 N=256 (unit costs)", bitpipe_case, "events", 4.0),
             ("1,024 GPUs: dapple D=16 R=64 N=128, gpt-96, dgx-a100-ib:128", lambda: cluster_case(64), "100k", 10.0),
             ("10,240 GPUs: dapple D=16 R=640 N=128, gpt-96, dgx-a100-ib:1280", lambda: cluster_case(640), "100k",
              50.0),
             ("16,384 GPUs: T=8 D=16 R=128 N=16, llama3-405b, dgx-h100-ib:2048",
              tensor_parallel_case, "100k", 20.0)]
    if not a.no_planner:
        cases.append(("plan gpt-96 G=1024 on 1,024 A100s (dgx-a100-ib:128)", planner_case, "100k", None))
    _, per_dev = bitpipe_case()
    times = {name: [] for name, *_ in cases}
    bare_events, bare_100k = [], []
    info = {}
    for rep in range(a.repeat):
        for name, fn, _, _ in cases:
            if "plan" in name and rep:      # minutes a run: once (its spread is then 0)
                continue
            bare_100k.append(bare_loop([100_000]))
            bare_events.append(bare_loop(per_dev))
            dt, out = _timed(fn)
            times[name].append(dt)
            info[name] = out[0]
    b100, bev = min(bare_100k), min(bare_events)
    spread = lambda xs: max(xs) / min(xs) - 1  # noqa: E731
    print(f"bare SimPy loop, 100,000 timeouts: {b100:.3f} s (spread {spread(bare_100k):.0%}); with as many events as "
          f"bitpipe D=32 N=256 ({sum(per_dev):,} ops on {len(per_dev)} processes): {bev:.3f} s "
          f"(spread {spread(bare_events):.0%})")
    rows = []
    for name, fn, ref, aim in cases:
        best = min(times[name])
        base = bev if ref == "events" else b100
        row = {"case": name, "seconds": best, "spread": spread(times[name]), "reference": ref,
               "ratio": best / base, "aim": (f"<= {aim:g}x" if aim else "<= 10 s")}
        if not a.no_memory and "plan" not in name:
            row["peak_MiB"] = _peak_mib(fn)
        rows.append(row)
    from .tables import fmt_table
    cols = ["case", "seconds", "spread", "reference", "ratio", "aim"] + ([] if a.no_memory else ["peak_MiB"])
    print(fmt_table(rows, cols, {"seconds": "{:.3f}", "spread": "{:.0%}", "ratio": "{:.2f}x", "peak_MiB": "{:.0f}"}))
    for name, out in info.items():
        if hasattr(out, "iteration_time") and not hasattr(out, "search"):
            print(f"  {name}: iteration {out.iteration_time:.6g}, bubble {out.bubble_ratio:.4f}")
        elif hasattr(out, "search"):
            print(f"  {name}: search {out.search.seconds:.2f} s, baselines {out.baseline_seconds:.2f} s; best "
                  f"{out.best.plan.describe()} ({out.best.time:.4g} s simulated)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
