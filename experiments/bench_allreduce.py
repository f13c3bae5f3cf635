"""What a gloo all-reduce costs this host's cores, against the wall time it takes: the model
:mod:`sim.engine` uses on calibrated CPU ranks (the ring's latency passes in wall time, only its
bytes hold the members' cores, shared with compute).

``--ranks`` ranks (2), pinned a core each where the host allows (:func:`executor.host.pin_to_core`),
gloo, one spawned world. The compute is a fixed amount of work (matrix products sized once to take
``--compute-ms`` on rank 0, the same count on every rank), so a core taken from it shows as a longer
time. Each round, every case once, all ranks together, after a barrier:

- ``lone``: the all-reduce of ``--bytes`` (a fresh buffer, async, then waited for), as calibration
  times it;
- ``after compute``: the compute, then the all-reduce with the ranks idle while it runs, as at the
  end of a step (Chimera's last all-reduce);
- ``compute alone``: the compute;
- ``compute, all-reduce in flight``: the all-reduce launched, the compute, then the wait; the
  compute's own time, and the all-reduce's from launch to completion.

Prints rank 0's medians and quartiles over ``--rounds``, and two differences of medians: what the
compute lost to an all-reduce in flight (the cores' share of it) and the idle all-reduce's excess
over the lone one (time that holds no core). On a 2-core host with the defaults (853 KB, 4 ms,
40 rounds) the compute loses 0.4-0.5 ms to an all-reduce in flight that itself takes 7.3-7.6 ms
from launch to completion; the lone all-reduce takes about 3.5 ms, after compute 0.7-2 ms (both
bimodal, 0.5 or 3.7-4.2 ms: gloo's thread wake-ups). The time an all-reduce takes is mostly not
the cores': that is why the simulator keeps only its bytes on them.

    python -m experiments.bench_allreduce [--bytes 873472] [--compute-ms 4] [--rounds 40] [--ranks 2]
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

from experiments.checks import positive_float, positive_int

CASES = ("lone", "after compute", "compute alone", "compute, all-reduce in flight",
         "all-reduce in flight: launch to completion")


def _compute(steps: int):
    import torch
    a, w = torch.full((64, 256), 0.01), torch.full((256, 256), 0.01)
    for _ in range(steps):
        a = torch.tanh(a @ w)
    return a


def _steps_for(ms: float) -> int:
    """Matrix-product steps that take ``ms`` here (the fastest of five timings of 50)."""
    best = math.inf
    for _ in range(5):
        t0 = time.perf_counter()
        _compute(50)
        best = min(best, time.perf_counter() - t0)
    return max(1, round(ms * 1e-3 / (best / 50)))


def worker(payload, rank, world, local_rank, local_world):
    """Spawned rank: the cases of the module docstring, ``payload["rounds"]`` times."""
    import torch
    import torch.distributed as dist

    from executor.host import pin_to_core
    from executor.worker import init_world
    core = pin_to_core(local_rank, local_world)
    init_world("cpu", rank, world, local_rank, local_world)
    group = dist.new_group(list(range(world)))
    n = payload["bytes"] // 4
    steps = torch.tensor([_steps_for(payload["compute_ms"]) if rank == 0 else 0])
    dist.broadcast(steps, 0)
    steps = int(steps.item())
    times: dict[str, list[float]] = {c: [] for c in CASES}

    def allreduce():
        return dist.all_reduce(torch.ones(n), group=group, async_op=True)

    for _ in range(payload["rounds"]):
        dist.barrier()
        t0 = time.perf_counter()
        allreduce().wait()
        times["lone"].append(time.perf_counter() - t0)
        dist.barrier()
        _compute(steps)
        t0 = time.perf_counter()
        allreduce().wait()
        times["after compute"].append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        _compute(steps)
        times["compute alone"].append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        work = allreduce()
        done = [None]
        work.get_future().then(lambda _f, box=done: box.__setitem__(0, time.perf_counter()))
        _compute(steps)
        t1 = time.perf_counter()
        work.wait()
        while done[0] is None:      # the callback runs on gloo's thread just after completion
            time.sleep(1e-5)
        times["compute, all-reduce in flight"].append(t1 - t0)
        times["all-reduce in flight: launch to completion"].append(done[0] - t0)
    dist.barrier()
    dist.destroy_process_group()
    return {"times": times, "core": core, "steps": steps}


def summarize(times: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Per case: median and quartiles in ms."""
    out = {}
    for case, ts in times.items():
        q = statistics.quantiles([t * 1e3 for t in ts], n=4) if len(ts) > 1 else [ts[0] * 1e3] * 3
        out[case] = {"p25": q[0], "median": q[1], "p75": q[2]}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bytes", type=positive_int, default=873472, help="all-reduce size (default: Chimera's "
                   "stage 0 of the tiny GPT at D = 2)")
    p.add_argument("--compute-ms", type=positive_float, default=4.0, help="compute per case on rank 0 (ms)")
    p.add_argument("--rounds", type=positive_int, default=40)
    p.add_argument("--ranks", type=positive_int, default=2)
    a = p.parse_args(argv)
    if a.ranks < 2:
        p.error("--ranks must be at least 2 (an all-reduce needs two members)")
    if a.bytes < 4:
        p.error("--bytes must be at least 4 (one float)")
    from executor.launch import launch
    print(f"all-reduce of {a.bytes} B over {a.ranks} gloo ranks, {a.rounds} rounds ...", file=sys.stderr)
    res = launch("experiments.bench_allreduce:worker",
                 {"bytes": a.bytes, "compute_ms": a.compute_ms, "rounds": a.rounds}, a.ranks)
    s = summarize(res["times"])
    pinned = f"pinned to core {res['core']}" if res["core"] is not None else "not pinned (too few cores)"
    print(f"rank 0 ({pinned}), compute = {res['steps']} matrix products, medians [p25-p75] in ms:")
    for case in CASES:
        x = s[case]
        print(f"  {case:44s} {x['median']:7.2f}  [{x['p25']:.2f}-{x['p75']:.2f}]")
    lost = s["compute, all-reduce in flight"]["median"] - s["compute alone"]["median"]
    idle = s["after compute"]["median"] - s["lone"]["median"]
    print(f"the compute lost {lost:.2f} ms to the all-reduce in flight; after compute the all-reduce took "
          f"{idle:+.2f} ms over the lone one, with the ranks idle")
    return 0


if __name__ == "__main__":
    sys.exit(main())
