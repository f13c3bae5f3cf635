"""``pipetwin validate``: executor vs simulator, schedule by schedule, with a calibrated profile.

With ``--ep E`` the layout is a mixture of experts' (``--model tiny-mixtral``) with its routed
experts split over E of the ``--dp`` replicas, and the profile one calibrated at E (its all-to-all
fit prices the expert exchanges); ``--overlap-fb`` runs every schedule twice in the sitting,
without and with its F&B pairs overlapped (rows ``NAME+overlap``; dualpipe-v pairs its own, once).

The measured side is the noise-free step of every schedule (:mod:`calibration.sitting`: interleaved
rounds of runs, ranks pinned to cores, runs disturbed by other processes left out, the
run-to-run spread checked); a sitting whose runs do not settle is refused with its reasons, each
with its cause (:class:`calibration.compare.Refusal`: "unsettled profile", "host busy" where
other processes' measured CPU passed ``--max-foreign``, "noisy runs" where quiet runs disagree,
"host speed"), a remedy true for that cause (:data:`ADVICE`) and no error figure (exit status 3).

``--report DIR`` keeps a dated record of the sitting, ``DIR/validate-YYYY-MM-DD-HHMM.md`` (the
local time of its start): the command with every option as used, the host (platform, cores, load
at the start and at the end), the profile, the tables and figures validate prints, the sitting
line and, where the sitting was refused, why (:func:`render_report`). Sittings are logged there;
the folder is checked before anything runs.
"""
from __future__ import annotations

import os
import platform
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path

from cost_models.job import check_run_size

from .common import parse_schedules, print_json
from .jobs import job_from_args, layout_from_args
from .options import add_options
from .tables import byte_unit, fmt_table
from cost_models.stack import is_model_ref

NAME = "validate"
HELP = "run each schedule for real and in the simulator (calibrated profile); compare time, bubbles, memory"


def add_arguments(p):
    add_options(p, NAME)


REFUSED = 3   # exit status of a sitting refused for a busy host (not a user error: try again later)
TIME_COLS = ("schedule", "measured_ms", "simulated_ms", "error", "spread", "runs", "host_speed")
FITTED_NOTE = "* the profile's runtime was fitted on these runs (in-sample); the others are predictions"
NO_FIGURE = "no time or error figure from this sitting"
# what may settle a sitting refused for each cause (calibration.compare.Refusal), with the options as given
ADVICE = {
    "unsettled profile": "the profile's own calibration runs did not settle, which no option of validate changes: "
                         "calibrate again when the host is quiet (pipetwin calibrate --out FILE), or drop --profile "
                         "to calibrate in this sitting",
    "host busy": "other processes used the ranks' cores: run it when they are idle (a run counts with up to "
                 "--max-foreign {max_foreign:g} cores of theirs)",
    "noisy runs": "the runs were quiet but do not agree: longer runs (--steps, now {steps}) or more rounds "
                  "(--max-runs, now {max_runs}) may settle them; --max-spread (now {max_spread:g}) allows more",
    "host speed": "the host runs at another speed than when the profile was calibrated: calibrate again, or drop "
                  "--profile to calibrate in this sitting",
}


def advice(reasons, args) -> list[str]:
    """One remedy per cause among ``reasons`` (:class:`calibration.compare.Refusal`), in their order."""
    causes = dict.fromkeys(r.cause for r in reasons)
    return [ADVICE[c].format(**vars(args)) for c in causes]


def _say(msg: str) -> None:
    import sys
    print(msg, file=sys.stderr, flush=True)


def main(args) -> int:
    from calibration import SittingRules, calibrate_and_compare, profile_refusals, refusals, run_and_compare
    from cost_models import is_model_ref, load_model, load_profile, save_profile
    from cost_models.files import check_output_path
    from schedules import ScheduleError, build

    from calibration.host import check_ep
    from cost_models.bind import check_profile_ep, check_profile_model, check_profile_tp

    t_start = time.perf_counter()
    record = SittingRecord(started=time.time(), command=command_line(args), host=host_facts(), load_start=_load())
    from .jobs import SCHEDULE_DEFAULTS, check_chunks
    check_chunks(args.chunks, parse_schedules(args.schedules))
    chunks = args.chunks or SCHEDULE_DEFAULTS["chunks"]   # args keep None: --chunks is refused where it does nothing
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
        check_profile_tp(prof, args.tp or prof.tp)
        check_profile_ep(prof, args.ep or prof.ep)
        if args.dtype is not None and args.dtype != prof.precision:
            raise ValueError(f"profile {args.profile} was measured in {prof.precision}, not {args.dtype}; "
                             f"calibrate with --dtype {args.dtype} (or drop --dtype)")
        if args.micro_batch is not None and args.micro_batch != prof.micro_batch:
            raise ValueError(f"profile {args.profile} was measured at micro-batch {prof.micro_batch}; drop "
                             f"--micro-batch or calibrate at {args.micro_batch}")
        if prof.cores and D * R * prof.tp > prof.cores and prof.time_slice is None and \
                prof.oversubscribed_slowdown == 1.0:
            what = f"{D * R} ranks" if prof.tp == 1 else f"{D * R * prof.tp} processes ({D * R} ranks x T={prof.tp})"
            raise ValueError(f"profile {args.profile} does not model {what} on {prof.cores} cores (calibrated for "
                             f"{prof.meta.get('ranks', '?')} ranks, no time slice): calibrate with --ranks {D * R}, "
                             f"or drop --profile")
    model = args.model or (prof.model_name if prof is not None else "tiny")
    T = args.tp or (prof.tp if prof is not None else 1)
    E = args.ep or (prof.ep if prof is not None else 1)
    if is_model_ref(model):     # the model's own checks now, and its layer count for the schedules' stages
        if T > 1:
            raise ValueError(f"--tp {T} splits the built-in GPT's layers; a model file's layers are not split "
                             f"(use --tp 1 with {model})")
        from executor.user_model import DEFAULT_MICRO_BATCH, stack_layout
        mb = prof.micro_batch if prof is not None else args.micro_batch or DEFAULT_MICRO_BATCH
        layers, name = stack_layout(model, 1, micro_batch=mb).num_layers, model
    else:
        spec = load_model(model)
        layers, name = spec.layers, spec.name
        if T > 1:
            from executor.config import check_tensor_parallel
            check_tensor_parallel(spec, T)
        check_ep(spec, E, T)
        if R % E:
            raise ValueError(f"--ep {E} folds the experts over the {R} data-parallel replicas: give --dp a "
                             f"multiple of {E}")
    check_run_size(devices=D, microbatches=N, replicas=R, chunks=chunks, layers=layers, model_name=name)
    profile_out = Path(args.plot or "out/validate.png").with_name("calibration.yaml")
    if not args.profile:
        check_output_path(profile_out, "calibration profile")
    names, skipped = [], {}
    for n in parse_schedules(args.schedules):
        try:
            stages = build(n, D, N, chunks=chunks).num_stages
        except ScheduleError as e:
            skipped[n] = str(e)
            continue
        if is_model_ref(model) and stages > layers:
            skipped[n] = f"{n} has {stages} stages at D={D}; model {model} has {layers} layers"
            continue
        names.append(n)
    if not names:
        raise ValueError("no schedule accepts these settings: " + "; ".join(skipped.values()))
    base = job_from_args(args, layout=layout_from_args(args, schedules=names, schedule=names[0], microbatches=N),
                         model=model, tp=T, micro_batch=args.micro_batch, ep=E)
    jobs = [base.with_layout(schedule=n).with_(overlap_fb=False) for n in names]
    if args.overlap_fb:     # beside each schedule, its overlapped run (dualpipe-v's pairs are its own: run once)
        jobs = [x for n, j in zip(names, jobs) for x in
                ((j,) if build(n, D, N, chunks=chunks).meta.get("overlapped") else (j, j.with_(overlap_fb=True)))]
    emulated = []
    if base.cluster.name is not None:
        jobs, emulated = mixed_jobs(jobs, layers)
    progress = lambda m: _say(f"  {m}")   # noqa: E731
    record.setting, record.skipped = (f"{f'T={T} ' if T > 1 else ''}D={D} N={N} R={R}"
                                      + (f" EP={E}" if E > 1 else "") + (" overlap-fb" if args.overlap_fb else "")
                                      + f", model {model}", skipped)
    record.emulated = emulated
    if prof is not None:
        record.profile, record.profile_file = prof, args.profile
        busy = profile_refusals(prof)
        if busy:   # a profile from a busy sitting predicts another host: nothing to compare it with
            record.reasons, record.seconds = busy, time.perf_counter() - t_start
            return _refuse(record, args)
        _say(f"running {len(names)} schedules in rounds until {args.repeats} quiet runs of each agree "
             f"(at most {args.max_runs}) ...")
        comps = run_and_compare(jobs, prof, steps=args.steps, rules=rules, progress=progress)
        reasons = refusals(comps, prof, max_drift=args.max_drift)
    else:
        _say(f"calibrating and running {len(names)} schedules in one sitting, in rounds until {args.repeats} quiet "
             f"runs of each agree (at most {args.max_runs}; pass --profile FILE to use an earlier calibration) ...")
        prof, comps = calibrate_and_compare(jobs, steps=args.steps, rules=rules, progress=progress,
                                            dtype=args.dtype or "fp32")
        saved = save_profile(prof, profile_out)
        _say(f"wrote the profile to {saved} (reuse it: --profile {saved})")
        reasons = refusals(comps, prof, max_drift=None)
        record.profile, record.profile_file, record.calibrated_now = prof, str(saved), True
    seconds = time.perf_counter() - t_start
    record.comps, record.reasons, record.seconds = comps, reasons, seconds
    record.measured = _measured_line(comps, args, rules)
    if reasons:
        return _refuse(record, args)
    if args.plot:
        from .plots import plot_overlay
        plot_overlay(comps, args.plot)
        record.figure = args.plot
    if args.json:
        print_json({"schedules": [c.record() for c in comps], "skipped": skipped, "refused": [],
                    "seconds": seconds})
        if args.report:
            _say(f"wrote report: {write_report(record, args.report)}")
        return 0
    rows, fmts, unit = _rows(comps)
    print(_header(record))
    print(record.measured)
    print("iteration time, measured vs simulated:")
    print(fmt_table(rows, TIME_COLS, fmts))
    if any(c.fitted for c in comps):
        print(FITTED_NOTE)
    print("bubbles, peak activation memory and op order:")
    print(fmt_table(rows, _mem_cols(unit), fmts))
    for line in _figures(comps):
        print(line)
    print(_sitting_line(comps))
    for n, why in skipped.items():
        print(f"skipped {n}: {why}")
    if args.plot:
        print(f"wrote figure: {args.plot}")
    if args.report:
        print(f"wrote report: {write_report(record, args.report)}")
    print(f"validate took {seconds:.0f} s")
    return 0


def mixed_jobs(jobs, layers: int) -> tuple[list, list[str]]:
    """A mixed ``--cluster``: each schedule's job twice, with the planner's typed split and with the
    executor's uniform split (:func:`cost_models.partition.default_partition`), both emulated as
    ``run --cluster`` emulates it (:func:`cost_models.bind.pool_slowdowns`: the same slowdowns then
    slow the simulated ranks, :func:`calibration.simulate.simulate_with_profile`); and one line per
    job saying how. A one-pool cluster, a model file or a given profile of another model is refused
    in one line."""
    from dataclasses import replace

    from cost_models.bind import pool_slowdowns
    from cost_models.partition import default_partition
    from schedules import build
    job = jobs[0]
    name = job.cluster.name
    if not job.cluster.load().is_mixed:
        raise ValueError(f"validate --cluster emulates a mixed cluster's pools; {name} has one pool: drop --cluster")
    if not isinstance(job.model, str) or is_model_ref(job.model):
        raise ValueError(f"validate --cluster {name} prices the model on each pool: give a built-in --model "
                         f"(not the model file {job.model})")
    out, lines = [], []
    for j in jobs:
        lay = j.layout
        stages = build(lay.schedule, lay.devices, lay.microbatches, chunks=lay.chunks).num_stages
        for part in (None, default_partition(layers, stages)):
            emu = pool_slowdowns(replace(j, partition=part))
            if not emu.slowdown:
                raise ValueError(f"the ranks of {lay.schedule} sit on pools {list(emu.pools)} of {name}, which price "
                                 f"its ops alike ({emu.cost_model} cost model): nothing to emulate; drop --cluster")
            out.append(replace(j, partition=part))
            lines.append(f"{lay.schedule}: {emu.line()}; slowed "
                         + ", ".join(f"rank {r} x{k:.3f}" for r, k in emu.slowdown))
    return out, lines


def _header(record: "SittingRecord") -> str:
    return (f"{record.setting} ({record.profile.precision}), profile {record.profile.name}"
            + (" (calibrated in this sitting)" if record.calibrated_now else "")
            + "".join(f"\n{line}" for line in record.emulated))


def _measured_line(comps, args, rules) -> str:
    """How the measured side was taken."""
    if all(c.state_steps for c in comps):
        return (f"measured: median of each schedule's steps in the host's fast state, over {args.repeats}+ quiet "
                f"runs with {rules.state_steps}+ such steps, {args.steps} steps each, first {args.warmup} dropped")
    return (f"measured: median over {args.repeats}+ quiet runs per schedule of each run's noise-free step (the "
            f"median of its fast steps), {args.steps} steps each, first {args.warmup} dropped")


def _rows(comps) -> tuple[list[dict], dict, str]:
    """The rows of validate's two tables (one per schedule; ``*``: its runs were fitted on), their
    formats, and the byte unit of the memory columns."""
    unit, div = byte_unit([max(c.measured_peak_activation_bytes) for c in comps])
    rows = [{"schedule": c.label + ("*" if c.fitted else ""), "measured_ms": c.measured_iteration_time * 1e3,
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
    return rows, fmts, unit


def _mem_cols(unit: str) -> list[str]:
    return ["schedule", "bubble_meas", "bubble_sim", f"peak_act_meas_{unit}", f"peak_act_sim_{unit}", "mem_err",
            "order_identical"]


def _figures(comps) -> list[str]:
    """|error| (median and max; of the predictions alone too, where some runs were fitted on) and
    the run-to-run spread."""
    errs = sorted(abs(c.error) for c in comps)
    out_errs = sorted(abs(c.error) for c in comps if not c.fitted)
    spreads = sorted(c.spread for c in comps if c.spread is not None)
    out = [f"|error|: median {errs[len(errs) // 2]:.1%}, max {errs[-1]:.1%}"
           + (f" (predictions only: median {out_errs[len(out_errs) // 2]:.1%}, max {out_errs[-1]:.1%})"
              if out_errs and len(out_errs) < len(errs) else "")]
    if spreads:
        out.append(f"run-to-run spread (the host's own noise): median {spreads[len(spreads) // 2]:.1%}, "
                   f"max {spreads[-1]:.1%}")
    return out


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


def _timing_free(comps) -> str:
    exact = sum(1 for c in comps if c.memory_error == 0.0)
    same = sum(1 for c in comps if c.order_identical)
    return (f"timing-free checks: peak activation bytes exact in {exact} of {len(comps)} schedules, op order "
            f"identical in {same} of {len(comps)}")


def _refuse(record: "SittingRecord", args) -> int:
    """Say why no error figure comes from this sitting; what does not depend on timing (peak
    activation bytes, op order) is still reported."""
    reasons, comps = record.reasons, record.comps
    record.remedies = advice(reasons, args)
    if args.json:
        recs = []
        for c in comps:
            r = c.record()
            for k in ("error", "measured_iteration_time"):
                r.pop(k)
            recs.append(r)
        print_json({"schedules": recs, "skipped": record.skipped, "refused": [str(r) for r in reasons],
                    "seconds": record.seconds})
        if args.report:
            _say(f"wrote report: {write_report(record, args.report)}")
        return REFUSED
    for line in record.emulated:
        print(line)
    print(f"refused: {reasons[0]}")
    for r in reasons[1:]:
        print(f"         {r}")
    print(f"{NO_FIGURE}; to settle it:")
    for line in record.remedies:
        print(f"- {line}")
    if comps:
        print(_timing_free(comps))
        print(_sitting_line(comps))
    if args.report:
        print(f"wrote report: {write_report(record, args.report)}")
    print(f"validate took {record.seconds:.0f} s")
    return REFUSED


# ---------------------------------------------------------------------------------- --report DIR
@dataclass(kw_only=True)
class SittingRecord:
    """One sitting of validate, as ``--report`` records it (filled in as the sitting goes)."""

    started: float                  # time.time() at the start
    command: str                    # the command, every option as used (:func:`command_line`)
    host: dict                      # platform, node, cores (:func:`host_facts`)
    load_start: tuple | None        # the load average (1, 5, 15 min) at the start
    load_end: tuple | None = None   # ... and at the end (set when the report is written)
    setting: str = ""               # D, N, R and the model
    profile: object = None          # the calibration profile compared with (None: refused before)
    profile_file: str | None = None  # --profile, or where this sitting's calibration was written
    calibrated_now: bool = False
    comps: list = field(default_factory=list)        # calibration.compare.Comparison per schedule
    reasons: list = field(default_factory=list)   # why no error figure (calibration.compare.Refusal; empty: compared)
    remedies: list[str] = field(default_factory=list)  # what may settle it (advice)
    skipped: dict = field(default_factory=dict)      # schedule -> why it was not run
    emulated: list[str] = field(default_factory=list)  # a mixed --cluster: how each job emulates it (mixed_jobs)
    measured: str | None = None     # how the measured side was taken
    figure: str | None = None       # the overlay figure written
    seconds: float = 0.0


def command_line(args) -> str:
    """``pipetwin validate`` with every option as used (each option's flag is ``--`` and its
    name): the command that repeats the sitting."""
    words = ["pipetwin", "validate"]
    for name, value in vars(args).items():
        if name.startswith("_") or name == "command" or value is None or value is False:
            continue
        flag = "--" + name.replace("_", "-")
        words += [flag] if value is True else [flag, str(value)]
    return shlex.join(words)


def host_facts() -> dict:
    return {"platform": platform.platform(), "node": platform.node() or "?", "cores": os.cpu_count() or 1}


def _load() -> tuple | None:
    try:
        return tuple(round(x, 2) for x in os.getloadavg())
    except OSError:
        return None


def _md_line(text: str) -> str:
    """A line of validate's output as markdown text (a leading ``|`` or ``*`` would start a table or
    a list)."""
    return "\\" + text if text[:1] in "|*" else text


def render_report(record: SittingRecord) -> str:
    """The markdown record of a sitting: what was run where, with which profile, and what came out
    (validate's tables as markdown tables, its figures, the sitting line, or why it was refused)."""
    when = time.strftime("%Y-%m-%d %H:%M %Z", time.localtime(record.started))
    h = record.host

    def load(x):
        return " / ".join(f"{v:.2f}" for v in x) if x else "unknown"

    out = [f"# pipetwin validate, {when}", "",
           f"- command: `{record.command}`",
           f"- host: {h['node']} ({h['platform']}), {h['cores']} cores; load average (1 / 5 / 15 min) "
           f"{load(record.load_start)} at the start, {load(record.load_end)} at the end",
           f"- setting: {record.setting}"] + [f"- {line}" for line in record.emulated]
    prof = record.profile
    if prof is not None:
        meta = prof.meta or {}
        where = ("calibrated in this sitting" if record.calibrated_now else
                 f"calibrated {meta.get('date', 'at an unknown time')} on {meta.get('host', 'an unknown host')}")
        out.append(f"- profile: {prof.name} ({prof.precision}, {prof.cores or '?'} cores, "
                   + (f"{prof.time_slice * 1e3:g} ms time slice" if prof.time_slice else "no time slice")
                   + f"), {where}" + (f"; file `{record.profile_file}`" if record.profile_file else ""))
    out.append(f"- result: {'refused (exit status 3)' if record.reasons else 'compared'}, "
               f"{len(record.comps)} schedules in {record.seconds:.0f} s")
    out += [f"- skipped {n}: {why}" for n, why in record.skipped.items()]
    comps = record.comps
    if record.reasons:
        out += ["", "## Refused", ""] + [f"- {r}" for r in record.reasons] + ["", f"{NO_FIGURE}; to settle it:", ""]
        out += [f"- {x}" for x in record.remedies]
    if comps:
        rows, fmts, unit = _rows(comps)
        if not record.reasons:
            out += ["", "## Iteration time, measured vs simulated", ""]
            out += ([_md_line(record.measured), ""] if record.measured else [])
            out += [fmt_table(rows, TIME_COLS, fmts, markdown=True)]
            if any(c.fitted for c in comps):
                out += ["", _md_line(FITTED_NOTE)]
            out += ["", "## Bubbles, peak activation memory and op order", "",
                    fmt_table(rows, _mem_cols(unit), fmts, markdown=True),
                    "", "## Error and run-to-run spread", ""] + [f"- {x}" for x in _figures(comps)]
        else:   # what does not depend on timing
            out += ["", "## Peak activation memory and op order", "",
                    fmt_table(rows, ["schedule"] + _mem_cols(unit)[3:], fmts, markdown=True),
                    "", _timing_free(comps)]
        out += ["", _sitting_line(comps)]
    if record.figure:
        out += ["", f"Overlay figure: `{record.figure}`"]
    return "\n".join(out) + "\n"


def write_report(record: SittingRecord, folder) -> Path:
    """Write :func:`render_report` to ``folder/validate-YYYY-MM-DD-HHMM.md`` (the local time of the
    sitting's start; ``-2``, ``-3`` ... after it when a sitting of the same minute is there) and
    return the path. The load at the end is taken now."""
    from cost_models.files import write_output
    record.load_end = _load()
    stem = "validate-" + time.strftime("%Y-%m-%d-%H%M", time.localtime(record.started))
    path, k = Path(folder) / f"{stem}.md", 1
    while path.exists():
        k += 1
        path = Path(folder) / f"{stem}-{k}.md"
    write_output(path, render_report(record), "report")
    return path
