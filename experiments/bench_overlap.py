"""The F&B overlap in the executor, measured: the same expert-parallel layout with and without
``--overlap-fb`` side by side in one sitting, and what the simulator predicts for the same job.

One spawned world (gloo on the CPU) trains the job ``--reps`` times with the overlap and as many
times without, alternating (off, on, on, off, off, on, ...: neither always runs first), each run
``--steps`` optimizer steps of which the first is left out (warm-up). Per run the median step
time; the ratio on / off per adjacent pair of runs (a slow spell of the shared machine hits both
runs of a pair alike); the table shows each run, the median ratio and its range over the pairs
(the sitting's noise), and, from the overlapped runs' sub-phases (:mod:`executor.overlap`), the
seconds the pairs spent waiting for an all-to-all per step (what the overlap did not hide).

The simulator's prediction for the same job (``pipetwin simulate`` with the same flags, its
default cluster's costs: a GPU, so its size is the GPU's, not this CPU's; with a calibration of the
expert layers and the gloo all-to-all of this host, ``pipetwin calibrate --ep``, not yet there,
the two would compare in size): its step time with and without the overlap, the ratio and the
all-to-all seconds it hides.

    python -m experiments.bench_overlap [--model tiny-mixtral] [-s dualpipe-v] [-D 2] [-N 8] [--dp 2]
                                        [--ep 2] [--steps 4] [--reps 3]

Never a timed test: the numbers are this machine's in this sitting.
"""
from __future__ import annotations

import argparse
import statistics
import sys


def _median_step(res) -> float:
    times = res.iteration_times[1:] or res.iteration_times
    return statistics.median(times)


def _waits(res) -> float:
    """Seconds per step (rank mean) the overlapped pairs waited for an exchange (comm phases)."""
    phases = [p for p in res.extra.get("phases", ()) if p["step"] > 0]
    if not phases:
        return 0.0
    ranks = {p["device"] for p in phases}
    steps = {p["step"] for p in phases}
    return sum(p["end"] - p["start"] for p in phases if p["kind"] == "comm") / len(ranks) / len(steps)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.bench_overlap", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-mixtral")
    ap.add_argument("-s", "--schedule", default="dualpipe-v")
    ap.add_argument("-D", "--devices", type=int, default=2)
    ap.add_argument("-N", "--microbatches", type=int, default=8)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    if args.steps < 2 or args.reps < 1:
        raise SystemExit("pipetwin: error: --steps must be >= 2 (the first is warm-up) and --reps >= 1")

    from executor.config import RunConfig
    from executor.launch import run_many
    from sim.job import simulate_job

    base = dict(schedule=args.schedule, devices=args.devices, microbatches=args.microbatches, replicas=args.dp,
                ep=args.ep, model=args.model, steps=args.steps, optimizer="sgd", lr=0.05, timeout=120.0,
                measure_memory=False)
    off, on = RunConfig.of(overlap_fb=False, **base), RunConfig.of(overlap_fb=True, **base)
    order = [(on, off) if k % 2 else (off, on) for k in range(args.reps)]
    jobs = [c for pair in order for c in pair]
    results = run_many(jobs)
    print(f"{args.model} {args.schedule} D={args.devices} N={args.microbatches} R={args.dp} EP={args.ep}, "
          f"gloo on the CPU, {args.steps - 1} timed steps per run (median step)")
    print(f"{'pair':>4} {'off s':>9} {'on s':>9} {'on/off':>7} {'waits s/step':>13}")
    ratios = []
    offs = []
    for k in range(args.reps):
        a, b = results[2 * k], results[2 * k + 1]
        r_off, r_on = (a, b) if jobs[2 * k] is off else (b, a)
        t_off, t_on = _median_step(r_off), _median_step(r_on)
        ratios.append(t_on / t_off)
        offs.append(t_off)
        print(f"{k:>4} {t_off:9.4f} {t_on:9.4f} {t_on / t_off:7.3f} {_waits(r_on):13.4f}")
    print(f"median on/off {statistics.median(ratios):.3f} (range {min(ratios):.3f} .. {max(ratios):.3f}; "
          f"off runs' spread {(max(offs) - min(offs)) / statistics.median(offs):.1%})")
    sims = {}
    for name, cfg in (("off", off), ("on", on)):
        sims[name] = simulate_job(cfg.job).result
    s_off, s_on = sims["off"].iteration_time, sims["on"].iteration_time
    hidden = sum(sims["on"].a2a_hidden) / max(len(sims["on"].a2a_hidden), 1)
    a2a = sum(sims["on"].a2a_time) / max(len(sims["on"].a2a_time), 1)
    print(f"simulator (default cluster's costs): off {s_off:.6f} s, on {s_on:.6f} s, on/off {s_on / s_off:.3f}; "
          f"all-to-all {a2a:.6f} s per rank, {hidden:.6f} s of it hidden")
    return 0


if __name__ == "__main__":
    sys.exit(main())
