"""The F&B overlap in the executor, measured and predicted in one sitting: the same expert-parallel
layout with and without ``--overlap-fb`` side by side over an emulated wire, and what the simulator
predicts for the same job on this host's calibration with the same wire.

*Why a wire.* Over gloo on one host an expert all-to-all is a CPU copy, not wire time: a rank
waiting for it gives its core to another rank (4 ranks on a 2-core host), so there is little for
the overlap to hide. On a cluster the all-to-all is wire time the processor does not spend.
``--a2a-wire W`` (:class:`cost_models.job.Faults`, one knob of run and simulate) emulates it: each
exchange of a MoE block's rows ends no earlier than its bytes / W after its issue, the rest slept
in its wait (:mod:`executor.expert_parallel`), so under the overlap the other micro-batch's compute
segment runs meanwhile; the simulator prices the same exchange max(the profile's fit, bytes / W)
(:meth:`cost_models.profile.CalibrationProfile.a2a_times`). The default W makes the all-to-alls
a clear share of the step (the table prints the simulator's share: about a quarter at 2 MB/s).

*Which layout.* One whose program ``--overlap-fb`` changes: interleaved, zb-v, dapple. DualPipe-V
overlaps its own pairs with or without the flag (the same program both ways: refused here). The
default, interleaved (2 chunks) at D 1 x R 2 with EP 2, puts two stages on each of 2 ranks, on
this host's 2 cores, and overlaps 7 of each rank's 8 F&B pairs. With more ranks than cores (D 2 x
R 2: 4 ranks) a rank's wait frees its core for another rank, which already fills it, and the
pair (its F's send after the B) only delays the next stage: the simulator predicts on/off 1.17 for
zb-v at D 2 and 2 MB/s, a sitting measured 1.29 (1.11 .. 1.65). A split backward (zb-v) pays more
under the overlap than the simulator knows: an overlapped F is cut into segments whose input
gradients B takes with the graph kept, and W runs the chain again
(:class:`executor.overlap.RetainedWeightGrad`), while an unpaired F's B and W use the split
templates (at D 1, 2 MB/s: predicted 0.854, measured 1.05, range 0.995 .. 1.64).

*The sitting.* A calibration of this host at EP 2 (``--profile FILE`` of ``pipetwin calibrate -m
tiny-mixtral --ep 2 --ranks 4``, else one is measured first, minutes); then one spawned world
(gloo on the CPU) per run trains the job ``--reps`` times with the overlap and as many times
without, alternating (off, on, on, off, off, on, ...: neither always runs first), each run
``--steps`` optimizer steps of which the first is left out (warm-up). Per run the median step
time; the ratio on / off per adjacent pair of runs (a slow spell of the shared machine hits both
runs of a pair alike); the median ratio and its range over the pairs (the sitting's noise); from
the overlapped runs' sub-phases (:mod:`executor.overlap`) the seconds per step the pairs waited for
an exchange (what the overlap did not hide). The simulator's prediction: the same two jobs on the
profile with the same wire, ``--steps`` back-to-back iterations, the median after the first.

    python -m experiments.bench_overlap [--profile FILE] [--a2a-wire '2 MB/s'] [--model tiny-mixtral]
                                        [-s interleaved] [-D 1] [-N 8] [--dp 2] [--ep 2] [--steps 4]
                                        [--reps 3] [--out-dir out/bench_overlap]

writes ``overlap.csv`` (one row per pair, then the summary), ``overlap.png`` (the measured
on/off ratio per pair as bars, the prediction as a line) and ``calibration.yaml`` (the profile the
prediction used, so that ``--profile`` can predict the sitting again) into ``--out-dir``.

Never a timed test: the numbers are this machine's in this sitting.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace
from pathlib import Path

DEFAULT_WIRE = "2 MB/s"
PROFILE_FILE = "calibration.yaml"   # the sitting's profile (calibrated here, or --profile's), saved beside the CSV


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


def predict(cfg, profile, steps: int):
    """The simulator on ``profile`` (the host's cores shared by the ranks, as validate runs it) for
    run ``cfg``'s lowered program with cfg's ``--a2a-wire``: (median iteration time after the first,
    the SimResult)."""
    from cost_models.bind import calibrated
    from executor.config import lowered_schedule
    from sim.engine import SimOptions, run
    from sim.host import HostCores, on_one_host

    prof = replace(profile, a2a_wire=cfg.job.faults.a2a_wire)
    low = lowered_schedule(cfg)
    bound = calibrated(prof, low)
    host = HostCores.of(prof) or HostCores(cores=1)
    res = run(low, bound.costs, bound.network, on_one_host(SimOptions(steps=steps), low.num_ranks, host))
    return statistics.median(res.iteration_times[1:] or res.iteration_times), res


def predicted_waits(cfg, profile) -> float:
    """Seconds per step a rank's overlapped pairs wait for an exchange in the simulator (the pairs'
    exposed all-to-all: :func:`sim.overlap.overlapped_pair`'s time less both ops' compute), the
    counterpart of :func:`_waits` (the executor's comm sub-phases)."""
    from cost_models.bind import calibrated
    from executor.config import lowered_schedule
    from sim.overlap import overlapped_pair

    low = lowered_schedule(cfg)
    costs = calibrated(replace(profile, a2a_wire=cfg.job.faults.a2a_wire), low).costs
    total = 0.0
    for (_, sf, _), (_, sb, _) in low.meta.get("overlapped", ()):
        pf, pb = costs.phases_f[0][sf], costs.phases_b[0][sb]
        pt = overlapped_pair(pf, pb, costs.comm_sm_share)
        total += pt.time - sum(pf.compute) - sum(pb.compute)
    return total / low.num_devices


def plot(path: Path, ratios: list[float], predicted: float, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(range(len(ratios)), ratios, color="tab:blue", label="measured on/off, per pair")
    ax.axhline(predicted, color="tab:red", linestyle="--", label=f"simulator {predicted:.3f}")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(range(len(ratios)))
    ax.set_xlabel("pair of runs")
    ax.set_ylabel("step time, overlap on / off")
    ax.set_ylim(0, max(1.1, max(ratios) * 1.05))
    ax.set_title(title, fontsize=9)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    from .checks import bandwidth
    ap = argparse.ArgumentParser(prog="python -m experiments.bench_overlap", description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", help="a calibration of this host at --ep (default: measure one first)")
    ap.add_argument("--a2a-wire", type=bandwidth("--a2a-wire"), default=DEFAULT_WIRE, metavar="BANDWIDTH",
                    help=f"the emulated wire under the expert all-to-alls (default {DEFAULT_WIRE})")
    ap.add_argument("--model", default="tiny-mixtral")
    ap.add_argument("-s", "--schedule", default="interleaved")
    ap.add_argument("-D", "--devices", type=int, default=1)
    ap.add_argument("-N", "--microbatches", type=int, default=8)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out-dir", default="out/bench_overlap")
    args = ap.parse_args(argv)
    if args.steps < 2 or args.reps < 1:
        raise SystemExit("pipetwin: error: --steps must be >= 2 (the first is warm-up) and --reps >= 1")

    import pandas as pd

    from cost_models import load_profile, save_profile
    from cost_models.bind import check_profile_ep, check_profile_model
    from cost_models.job import Faults
    from executor.config import RunConfig
    from executor.launch import run_many

    from .common import write_csv

    if args.profile:
        prof = load_profile(args.profile)
    else:
        from .cmd_calibrate import calibrate_with_progress
        prof = calibrate_with_progress(args.model, args.devices * args.dp, 5, runtime_steps=5, runtime_repeats=2,
                                       ep=args.ep)
    check_profile_model(prof, args.model)
    check_profile_ep(prof, args.ep)
    base = dict(schedule=args.schedule, devices=args.devices, microbatches=args.microbatches, replicas=args.dp,
                ep=args.ep, model=args.model, steps=args.steps, optimizer="sgd", lr=0.05, timeout=120.0,
                measure_memory=False, faults=Faults(a2a_wire=args.a2a_wire))
    off, on = RunConfig.of(overlap_fb=False, **base), RunConfig.of(overlap_fb=True, **base)
    from executor.config import lowered_schedule
    if lowered_schedule(off).meta.get("overlapped") == lowered_schedule(on).meta.get("overlapped"):
        raise SystemExit(f"pipetwin: error: -s {args.schedule} runs the same F&B pairs with and without --overlap-fb "
                         f"(nothing to compare); use zb-v, interleaved or dapple")
    order = [(on, off) if k % 2 else (off, on) for k in range(args.reps)]
    jobs = [c for pair in order for c in pair]
    results = run_many(jobs)
    wire = f"--a2a-wire {args.a2a_wire / 1e6:g} MB/s"
    head = (f"{args.model} {args.schedule} D={args.devices} N={args.microbatches} R={args.dp} EP={args.ep}, "
            f"gloo on the CPU, {wire}, {args.steps - 1} timed steps per run (median step)")
    print(head)
    print(f"{'pair':>4} {'off s':>9} {'on s':>9} {'on/off':>7} {'waits s/step':>13}")
    rows, ratios, offs = [], [], []
    for k in range(args.reps):
        a, b = results[2 * k], results[2 * k + 1]
        r_off, r_on = (a, b) if jobs[2 * k] is off else (b, a)
        t_off, t_on = _median_step(r_off), _median_step(r_on)
        ratios.append(t_on / t_off)
        offs.append(t_off)
        rows.append({"pair": k, "first": "off" if jobs[2 * k] is off else "on", "off_s": t_off, "on_s": t_on,
                     "on_off": t_on / t_off, "waits_s_per_step": _waits(r_on)})
        print(f"{k:>4} {t_off:9.4f} {t_on:9.4f} {t_on / t_off:7.3f} {_waits(r_on):13.4f}")
    med = statistics.median(ratios)
    spread = (max(offs) - min(offs)) / statistics.median(offs)
    print(f"measured on/off {med:.3f} (range {min(ratios):.3f} .. {max(ratios):.3f} over {args.reps} pairs; "
          f"off runs' spread {spread:.1%})")
    s_off, sim_off = predict(off, prof, args.steps)
    s_on, sim_on = predict(on, prof, args.steps)
    share = statistics.mean(sim_off.a2a_time) / s_off
    hidden = statistics.mean(sim_on.a2a_hidden)
    print(f"simulator (profile {prof.name}, same wire): off {s_off:.4f} s, on {s_on:.4f} s, predicted on/off "
          f"{s_on / s_off:.3f}; all-to-alls {statistics.mean(sim_off.a2a_time):.4f} s per rank a step "
          f"({share:.0%} of the off step), {hidden:.4f} s of it hidden with the overlap")
    waits = predicted_waits(on, prof)
    print(f"overlapped pairs' waits for an exchange, s per rank a step: measured "
          f"{statistics.median(r['waits_s_per_step'] for r in rows):.4f} (median), simulated {waits:.4f}")
    inside = min(ratios) <= s_on / s_off <= max(ratios)
    print(f"prediction {'inside' if inside else 'outside'} the sitting's range")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = {"pair": "summary", "first": "", "off_s": statistics.median(offs),
               "on_s": statistics.median(r["on_s"] for r in rows), "on_off": med,
               "waits_s_per_step": statistics.median(r["waits_s_per_step"] for r in rows),
               "range_lo": min(ratios), "range_hi": max(ratios), "predicted_off_s": s_off, "predicted_on_s": s_on,
               "predicted_on_off": s_on / s_off, "predicted_a2a_share": share,
               "predicted_waits_s_per_step": waits, "a2a_wire_Bps": args.a2a_wire,
               "profile": prof.name}
    write_csv(pd.DataFrame(rows + [summary]), out / "overlap.csv")
    plot(out / "overlap.png", ratios, s_on / s_off, head.replace(", gloo", "\ngloo", 1))
    save_profile(prof, out / PROFILE_FILE)
    print(f"wrote {out / 'overlap.csv'}, {out / 'overlap.png'}, {out / PROFILE_FILE} (the sitting's calibration: "
          f"--profile it to predict again)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
