"""``pipetwin validate``: executor vs simulator, schedule by schedule, with a calibrated profile.

The measured side is the noise-free step of every schedule (:mod:`calibration.sitting`: interleaved
rounds of runs, ranks pinned to cores, runs disturbed by other processes left out, the
run-to-run spread checked); a sitting whose runs do not settle is refused with its reason
("host busy: ...") and no error figure (exit status 3).
"""
from __future__ import annotations

from pathlib import Path

from .checks import check_run_size, float_in, input_file, int_in, nonneg_int, output_file, positive_int
from .common import parse_schedules, print_json
from .tables import byte_unit, fmt_table

NAME = "validate"
HELP = "run each schedule for real and in the simulator (calibrated profile); compare time, bubbles, memory"


def add_arguments(p):
    p.add_argument("--schedules", default="all", help="comma-separated names or 'all'")
    p.add_argument("--devices", "-D", type=positive_int, default=2)
    p.add_argument("--microbatches", "-N", type=positive_int, default=None, help="default 2D")
    p.add_argument("--dp", type=positive_int, default=1)
    p.add_argument("--chunks", "-v", type=positive_int, default=2)
    p.add_argument("--steps", type=positive_int, default=20, help="executor steps per run (default 20)")
    p.add_argument("--warmup", type=nonneg_int, default=2, help="steps dropped at the start of every run (default 2)")
    p.add_argument("--repeats", type=int_in(1, 100), default=3,
                   help="quiet runs per schedule at least (default 3); the step time is the median of the runs' "
                        "noise-free times (each the median of its fast steps)")
    p.add_argument("--max-runs", type=int_in(1, 100), default=12,
                   help="runs per schedule at most before the sitting is refused (default 12)")
    p.add_argument("--max-spread", type=float_in(0.0, 10.0), default=0.05,
                   help="largest run-to-run spread allowed: the step time with any one run left out (default 0.05)")
    p.add_argument("--max-foreign", type=float_in(0.0, 10.0), default=0.15,
                   help="cores' worth of other processes' CPU a run may see and still count (default 0.15)")
    p.add_argument("--max-drift", type=float_in(0.0, 10.0), default=0.05,
                   help="with --profile: largest change of the host speed probe since calibration (default 0.05)")
    p.add_argument("--profile", type=input_file,
                   help="calibration profile; default: calibrate now, in the same sitting as the runs, and write "
                        "it beside --plot")
    p.add_argument("--model", default=None,
                   help="model preset / YAML file or a model file PATH.py:FUNC (default: the profile's, else tiny)")
    p.add_argument("--micro-batch", type=positive_int, default=None,
                   help="samples per micro-batch when calibrating now (default: a model file's 4, a GPT spec's)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default=None,
                   help="precision of the runs (default: the profile's, else fp32); calibrates in it")
    p.add_argument("--plot", default="out/validate.png", type=output_file,
                   help="overlay figure (default out/validate.png)")
    p.add_argument("--json", action="store_true")


REFUSED = 3   # exit status of a sitting refused for a busy host (not a user error: try again later)


def _say(msg: str) -> None:
    import sys
    print(msg, file=sys.stderr, flush=True)


def main(args) -> int:
    import time

    from calibration import SittingRules, calibrate_and_compare, refusals, run_and_compare, sitting_problems
    from cost_models import is_model_ref, load_model, load_profile, save_profile
    from cost_models.files import check_output_path
    from schedules import ScheduleError, build

    from .costs import check_profile_model

    t_start = time.perf_counter()
    D, R = args.devices, args.dp
    N = args.microbatches or 2 * D
    if args.steps <= args.warmup:
        raise ValueError(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    if args.max_runs < args.repeats:
        raise ValueError(f"need --repeats <= --max-runs; got {args.repeats} and {args.max_runs}")
    rules = SittingRules(runs=args.repeats, max_runs=args.max_runs, warmup=args.warmup, max_spread=args.max_spread,
                         max_foreign=args.max_foreign)
    prof = None
    if args.profile:
        prof = load_profile(args.profile)
        check_profile_model(prof, args.model)
        if args.dtype is not None and args.dtype != prof.precision:
            raise ValueError(f"profile {args.profile} was measured in {prof.precision}, not {args.dtype}; "
                             f"calibrate with --dtype {args.dtype} (or drop --dtype)")
        if args.micro_batch is not None and args.micro_batch != prof.micro_batch:
            raise ValueError(f"profile {args.profile} was measured at micro-batch {prof.micro_batch}; drop "
                             f"--micro-batch or calibrate at {args.micro_batch}")
        if prof.cores and D * R > prof.cores and prof.time_slice is None and prof.oversubscribed_slowdown == 1.0:
            raise ValueError(f"profile {args.profile} does not model {D * R} ranks on {prof.cores} cores (calibrated "
                             f"for {prof.meta.get('ranks', '?')} ranks, no time slice): calibrate with --ranks "
                             f"{D * R}, or drop --profile")
    model = args.model or (prof.model_name if prof is not None else "tiny")
    if is_model_ref(model):     # the model's own checks now, and its layer count for the schedules' stages
        from executor.user_model import DEFAULT_MICRO_BATCH, stack_layout
        mb = prof.micro_batch if prof is not None else args.micro_batch or DEFAULT_MICRO_BATCH
        layers, name = stack_layout(model, 1, micro_batch=mb).num_layers, model
    else:
        spec = load_model(model)
        layers, name = spec.layers, spec.name
    check_run_size(devices=D, microbatches=N, replicas=R, chunks=args.chunks, layers=layers, model_name=name)
    profile_out = Path(args.plot or "out/validate.png").with_name("calibration.yaml")
    if not args.profile:
        check_output_path(profile_out, "calibration profile")
    names, skipped = [], {}
    for n in parse_schedules(args.schedules):
        try:
            stages = build(n, D, N, chunks=args.chunks).num_stages
        except ScheduleError as e:
            skipped[n] = str(e)
            continue
        if is_model_ref(model) and stages > layers:
            skipped[n] = f"{n} has {stages} stages at D={D}; model {model} has {layers} layers"
            continue
        names.append(n)
    if not names:
        raise ValueError("no schedule accepts these settings: " + "; ".join(skipped.values()))
    progress = lambda m: _say(f"  {m}")   # noqa: E731
    if prof is not None:
        busy = [f"calibration {p}" for p in sitting_problems(prof)]
        if busy:   # a profile from a busy sitting predicts another host: nothing to compare it with
            return _refuse(busy, [], args, skipped, time.perf_counter() - t_start)
        _say(f"running {len(names)} schedules in rounds until {args.repeats} quiet runs of each agree "
             f"(at most {args.max_runs}) ...")
        comps = run_and_compare(names, D, N, R, prof, steps=args.steps, model=model, chunks=args.chunks,
                                rules=rules, progress=progress)
        reasons = refusals(comps, prof, max_drift=args.max_drift)
    else:
        _say(f"calibrating and running {len(names)} schedules in one sitting, in rounds until {args.repeats} quiet "
             f"runs of each agree (at most {args.max_runs}; pass --profile FILE to use an earlier calibration) ...")
        prof, comps = calibrate_and_compare(names, D, N, R, model=model, steps=args.steps, chunks=args.chunks,
                                            rules=rules, progress=progress, micro_batch=args.micro_batch,
                                            dtype=args.dtype or "fp32")
        saved = save_profile(prof, profile_out)
        _say(f"wrote the profile to {saved} (reuse it: --profile {saved})")
        reasons = refusals(comps, prof, max_drift=None)
    seconds = time.perf_counter() - t_start
    if reasons:
        return _refuse(reasons, comps, args, skipped, seconds)
    if args.plot:
        from .plots import plot_overlay
        plot_overlay(comps, args.plot)
    if args.json:
        print_json({"schedules": [c.record() for c in comps], "skipped": skipped, "refused": [],
                    "seconds": seconds})
        return 0
    unit, div = byte_unit([max(c.measured_peak_activation_bytes) for c in comps])
    rows = [{"schedule": c.schedule + ("*" if c.fitted else ""), "measured_ms": c.measured_iteration_time * 1e3,
             "simulated_ms": c.simulated_iteration_time * 1e3, "error": c.error, "spread": c.spread,
             "runs": f"{c.kept_runs}/{len(c.run_times)}", "host_speed": c.host_speed,
             "bubble_meas": sum(c.measured_bubble) / len(c.measured_bubble),
             "bubble_sim": sum(c.simulated_bubble) / len(c.simulated_bubble),
             f"peak_act_meas_{unit}": max(c.measured_peak_activation_bytes) / div,
             f"peak_act_sim_{unit}": max(c.simulated_peak_activation_bytes) / div, "mem_err": c.memory_error,
             "order_identical": c.order_identical} for c in comps]
    fmts = {"measured_ms": "{:.2f}", "simulated_ms": "{:.2f}", "error": "{:+.1%}", "spread": "{:.1%}",
            "host_speed": "{:.2f}", "bubble_meas": "{:.3f}", "bubble_sim": "{:.3f}",
            f"peak_act_meas_{unit}": "{:.4g}", f"peak_act_sim_{unit}": "{:.4g}", "mem_err": "{:.2%}"}
    print(f"D={D} N={N} R={R}, model {model} ({prof.precision}), profile {prof.name}"
          + ("" if args.profile else " (calibrated in this sitting)"))
    if all(c.state_steps for c in comps):
        print(f"measured: median of each schedule's steps in the host's fast state, over {args.repeats}+ quiet runs "
              f"with {rules.state_steps}+ such steps, {args.steps} steps each, first {args.warmup} dropped")
    else:
        print(f"measured: median over {args.repeats}+ quiet runs per schedule of each run's noise-free step (the "
              f"median of its fast steps), {args.steps} steps each, first {args.warmup} dropped")
    print("iteration time, measured vs simulated:")
    print(fmt_table(rows, ["schedule", "measured_ms", "simulated_ms", "error", "spread", "runs", "host_speed"], fmts))
    if any(c.fitted for c in comps):
        print("* the profile's runtime was fitted on these runs (in-sample); the others are predictions")
    print("bubbles, peak activation memory and op order:")
    print(fmt_table(rows, ["schedule", "bubble_meas", "bubble_sim", f"peak_act_meas_{unit}",
                           f"peak_act_sim_{unit}", "mem_err", "order_identical"], fmts))
    errs = sorted(abs(c.error) for c in comps)
    out_errs = sorted(abs(c.error) for c in comps if not c.fitted)
    spreads = sorted(c.spread for c in comps if c.spread is not None)
    print(f"|error|: median {errs[len(errs) // 2]:.1%}, max {errs[-1]:.1%}"
          + (f" (predictions only: median {out_errs[len(out_errs) // 2]:.1%}, max {out_errs[-1]:.1%})"
             if out_errs and len(out_errs) < len(errs) else ""))
    if spreads:
        print(f"run-to-run spread (the host's own noise): median {spreads[len(spreads) // 2]:.1%}, "
              f"max {spreads[-1]:.1%}")
    print(_sitting_line(comps))
    for n, why in skipped.items():
        print(f"skipped {n}: {why}")
    if args.plot:
        print(f"wrote figure: {args.plot}")
    print(f"validate took {seconds:.0f} s")
    return 0


def _sitting_line(comps) -> str:
    loads = [f for c in comps for f in c.foreign_cores if f is not None]
    speeds = [c.host_speed for c in comps if c.host_speed is not None]
    own = [x for c in comps for x in c.rank_cores if x is not None]
    runs = sum(len(c.run_times) for c in comps)
    judged = [c for c in comps if c.state_steps]
    fast = (f", the host's fast state (ops at <= {judged[0].state_cut:.2f}x their alone time) in "
            f"{sum(c.state_steps[0] for c in judged)} of {sum(c.state_steps[1] for c in judged)} steps"
            if judged else "")
    return (f"sitting: {runs} runs" + (f", other processes {min(loads):.2f}-{max(loads):.2f} cores" if loads else "")
            + (f", the ranks' own CPU {min(own):.2f}-{max(own):.2f} cores" if own else "")
            + (f", host speed {min(speeds):.2f}-{max(speeds):.2f} of calibration's" if speeds else "") + fast)


def _refuse(reasons: list[str], comps, args, skipped, seconds: float) -> int:
    """Say why no error figure comes from this sitting; what does not depend on timing (peak
    activation bytes, op order) is still reported."""
    if args.json:
        recs = []
        for c in comps:
            r = c.record()
            for k in ("error", "measured_iteration_time"):
                r.pop(k)
            recs.append(r)
        print_json({"schedules": recs, "skipped": skipped, "refused": reasons, "seconds": seconds})
        return REFUSED
    print("refused: host busy: " + reasons[0])
    for r in reasons[1:]:
        print("         host busy: " + r)
    print("no time or error figure from this sitting (pass --max-runs to wait longer, or run it when the host is "
          "quiet)")
    if comps:
        exact = sum(1 for c in comps if c.memory_error == 0.0)
        same = sum(1 for c in comps if c.order_identical)
        print(f"timing-free checks: peak activation bytes exact in {exact} of {len(comps)} schedules, op order "
              f"identical in {same} of {len(comps)}")
        print(_sitting_line(comps))
    print(f"validate took {seconds:.0f} s")
    return REFUSED
