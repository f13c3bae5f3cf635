"""Simulator speed: BitPipe at D = 32, N = 256 against a bare SimPy loop with as many events.

Run: ``python -m experiments.bench_sim [--devices 32 --microbatches 256 --repeat 3]``.
Prints build/lower time, simulated ops per second, the bare loop's ops per second (one SimPy
process per device doing one timeout per op, same op count, same process) and their ratio
(aim: >= 0.5). Best of ``--repeat`` runs each, interleaved to share the machine's noise.
"""
from __future__ import annotations

import argparse
import time

import simpy

from cost_models import UnitCostModel
from schedules import build, lower
from sim import simulate


def bare_loop(ops_per_device: list[int]) -> float:
    env = simpy.Environment()

    def dev(n):
        for _ in range(n):
            yield env.timeout(1.0)

    for n in ops_per_device:
        env.process(dev(n))
    t = time.perf_counter()
    env.run()
    return time.perf_counter() - t


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schedule", default="bitpipe")
    p.add_argument("--devices", type=int, default=32)
    p.add_argument("--microbatches", type=int, default=256)
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    sched = build(a.schedule, a.devices, a.microbatches)
    t1 = time.perf_counter()
    low = lower(sched)
    t2 = time.perf_counter()
    costs = UnitCostModel().bind(low)
    per_dev = [len(prog) for prog in low.programs]
    n_ops = sum(per_dev)
    sim_best, bare_best = float("inf"), float("inf")
    for _ in range(a.repeat):
        t = time.perf_counter()
        simulate(low, costs)
        sim_best = min(sim_best, time.perf_counter() - t)
        bare_best = min(bare_best, bare_loop(per_dev))
    print(f"{a.schedule} D={a.devices} N={a.microbatches}: {n_ops} ops "
          f"(build {t1 - t0:.2f} s, lower {t2 - t1:.2f} s)")
    print(f"simulator : {sim_best:.3f} s  {n_ops / sim_best:,.0f} ops/s")
    print(f"bare SimPy: {bare_best:.3f} s  {n_ops / bare_best:,.0f} ops/s")
    print(f"ratio (simulator / bare loop ops per second): {bare_best / sim_best:.2f}  (aim >= 0.5)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
