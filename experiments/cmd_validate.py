"""``pipetwin validate``: executor vs simulator, schedule by schedule, with a calibrated profile."""
from __future__ import annotations

from pathlib import Path

from .checks import check_run_size, input_file, nonneg_int, output_file, positive_int
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
    p.add_argument("--steps", type=positive_int, default=12, help="executor steps (default 12)")
    p.add_argument("--warmup", type=nonneg_int, default=2, help="steps dropped before the median (default 2)")
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="executor runs per schedule; the one with the lowest median counts (default 3)")
    p.add_argument("--profile", type=input_file,
                   help="calibration profile; default: calibrate now (pipetwin calibrate) and write it beside --plot")
    p.add_argument("--model", default=None,
                   help="model preset / YAML file or a model file PATH.py:FUNC (default: the profile's, else tiny)")
    p.add_argument("--micro-batch", type=positive_int, default=None,
                   help="samples per micro-batch when calibrating now (default: a model file's 4, a GPT spec's)")
    p.add_argument("--plot", default="out/validate.png", type=output_file,
                   help="overlay figure (default out/validate.png)")
    p.add_argument("--json", action="store_true")


def main(args) -> int:
    import sys

    from cost_models import is_model_ref, load_model, load_profile, save_profile
    from cost_models.files import check_output_path
    from schedules import ScheduleError, build

    from .cmd_calibrate import calibrate_with_progress
    from .costs import check_profile_model
    from .crossval import plot_overlay, run_and_compare

    D, R = args.devices, args.dp
    N = args.microbatches or 2 * D
    if args.steps <= args.warmup:
        raise ValueError(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    prof = None
    if args.profile:
        prof = load_profile(args.profile)
        check_profile_model(prof, args.model)
        if args.micro_batch is not None and args.micro_batch != prof.micro_batch:
            raise ValueError(f"profile {args.profile} was measured at micro-batch {prof.micro_batch}; drop "
                             f"--micro-batch or calibrate at {args.micro_batch}")
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
    if prof is None:
        print("calibrating this machine (pass --profile FILE to reuse one) ...", file=sys.stderr)
        prof = calibrate_with_progress(model, D * R, micro_batch=args.micro_batch)
        saved = save_profile(prof, profile_out)
        print(f"wrote the profile to {saved} (reuse it: --profile {saved})", file=sys.stderr)
    comps = run_and_compare(names, D, N, R, prof, steps=args.steps, warmup=args.warmup, model=model,
                            chunks=args.chunks, repeats=args.repeats)
    if args.plot:
        plot_overlay(comps, args.plot)
    recs = [c.record() for c in comps]
    if args.json:
        print_json({"schedules": recs, "skipped": skipped})
        return 0
    unit, div = byte_unit([max(c.measured_peak_activation_bytes) for c in comps])
    rows = [{"schedule": c.schedule, "measured_ms": c.measured_iteration_time * 1e3,
             "simulated_ms": c.simulated_iteration_time * 1e3, "error": c.error,
             "bubble_meas": sum(c.measured_bubble) / len(c.measured_bubble),
             "bubble_sim": sum(c.simulated_bubble) / len(c.simulated_bubble),
             f"peak_act_meas_{unit}": max(c.measured_peak_activation_bytes) / div,
             f"peak_act_sim_{unit}": max(c.simulated_peak_activation_bytes) / div, "mem_err": c.memory_error,
             "order_identical": c.order_identical, "run_spread": c.run_spread, "host_speed": c.host_speed,
             "err_drift_adj": c.drift_adjusted_error} for c in comps]
    fmts = {"measured_ms": "{:.2f}", "simulated_ms": "{:.2f}", "error": "{:+.1%}", "bubble_meas": "{:.3f}",
            "bubble_sim": "{:.3f}", f"peak_act_meas_{unit}": "{:.4g}", f"peak_act_sim_{unit}": "{:.4g}",
            "mem_err": "{:.2%}", "run_spread": "{:.1%}", "host_speed": "{:.2f}", "err_drift_adj": "{:+.1%}"}
    print(f"D={D} N={N} R={R}, model {model}, profile {prof.name}; executor {args.steps} steps, "
          f"first {args.warmup} dropped, median; best of {args.repeats} runs")
    print("iteration time, measured (best run) vs simulated:")
    print(fmt_table(rows, ["schedule", "measured_ms", "simulated_ms", "error", "run_spread", "host_speed",
                           "err_drift_adj"], fmts))
    print("bubbles, peak activation memory and op order:")
    print(fmt_table(rows, ["schedule", "bubble_meas", "bubble_sim", f"peak_act_meas_{unit}",
                           f"peak_act_sim_{unit}", "mem_err", "order_identical"], fmts))
    errs = sorted(abs(c.error) for c in comps)
    print(f"|error|: median {errs[len(errs) // 2]:.1%}, max {errs[-1]:.1%}")
    spreads = sorted(c.run_spread for c in comps if c.run_spread is not None)
    if spreads:
        print(f"run-to-run spread of the measured medians ({args.repeats} runs each, the host's own noise): "
              f"median {spreads[len(spreads) // 2]:.1%}, max {spreads[-1]:.1%}")
    speeds = [c.host_speed for c in comps if c.host_speed is not None]
    if speeds:
        adj = sorted(abs(c.drift_adjusted_error) for c in comps if c.drift_adjusted_error is not None)
        print(f"host speed during the runs vs calibration (block probe): {min(speeds):.2f}-{max(speeds):.2f}; "
              f"|error| with that drift taken out: median {adj[len(adj) // 2]:.1%}, max {adj[-1]:.1%}")
    for n, why in skipped.items():
        print(f"skipped {n}: {why}")
    if args.plot:
        print(f"wrote figure: {args.plot}")
    return 0
