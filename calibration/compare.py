"""Simulated against measured: the same lowered schedule run by the executor and by the simulator.

For each schedule: the executor trains ``steps`` steps per run, in interleaved rounds of runs
until its quiet runs agree (:func:`calibration.sitting.run_series`); its iteration time is the
median of its steps in the host's fast state, the same state for every schedule of the sitting
(judged from each step's op speed against the alone-measured op costs,
:func:`calibration.host.speed_yardstick`; where ranks outnumber the cores, the noise-free time of its
runs), which is what the simulator predicts and what the calibration fitted the runtime to; the
step closest to it is the one compared op by op. The simulator runs the same lowered schedule with the calibrated
profile (per-layer times, runtime overheads, P2P / all-reduce fits) on one host whose cores the
ranks share. Reported side by side: iteration time and its relative error, per-device bubble
ratio, peak activation bytes (measured by saved-tensor hooks vs simulated from the profile's
measured per-layer bytes) and whether each rank's executed op order equals the simulator's (the schedule's
program, each overlapped F&B pair run as one block, RECVs first, as both engines run it).

A time is only worth comparing from a usable sitting: :func:`refusals` says why one is not (a
busy calibration, a schedule whose runs did not settle, a host whose speed moved since
calibration); ``pipetwin validate`` then prints the reasons instead of an error figure.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

from cost_models.profile import CalibrationProfile
from cost_models.job import Job
from executor.config import RunConfig, lowered_schedule
from schedules import build
from schedules.trace import noise_free, op_orders, step_metrics

from .fit import fit_ranks, measured_run
from .host import fit_profile, host_yardstick, measure_host, speed_yardstick
from .simulate import simulate_with_profile
from .sitting import NOISY_RUNS, SittingRules, run_series, sitting_problems


@dataclass(kw_only=True)
class Comparison:
    """One schedule, measured (the noise-free step of its runs) and simulated."""

    schedule: str
    devices: int
    microbatches: int
    replicas: int
    measured_iteration_time: float
    simulated_iteration_time: float
    measured_iteration_times: list[float]
    measured_peak_activation_bytes: list[float]
    simulated_peak_activation_bytes: list[float]
    measured_bubble: list[float]
    simulated_bubble: list[float]
    order_identical: bool
    measured_probe: float | None = None     # host speed probe during the runs (s), see executor.worker
    run_times: list[float] = field(default_factory=list)     # low quantile step time of every run
    kept_runs: int = 0                      # runs that counted (quiet, agreeing)
    foreign_cores: list[float | None] = field(default_factory=list)   # other processes' load per run
    rank_cores: list[float | None] = field(default_factory=list)      # the ranks' own CPU per run (cores)
    problem: str | None = None              # why the runs did not settle (None: they did)
    cause: str | None = None                # the problem's cause: HOST_BUSY or NOISY_RUNS (calibration.sitting)
    spread: float | None = None             # run-to-run spread (calibration.sitting.RunSeries.spread)
    fitted: bool = False                    # the profile's runtime was fitted on these very runs
    state_steps: tuple[int, int] | None = None   # (fast-state steps counted, steps of the quiet runs); None: not judged
    state_cut: float | None = None          # the sitting's fast state: ops at up to this x their alone time
    profile_probe: float | None = None      # the same probe when the profile was calibrated
    partition: tuple[int, ...] | None = None    # the run's layers per stage (None: the executor's default split)
    slowdown: tuple[tuple[int, float], ...] = ()  # (rank, k) both engines slowed (a mixed cluster's emulated pools)
    measured_trace: pd.DataFrame = field(repr=False, default=None)
    simulated_trace: pd.DataFrame = field(repr=False, default=None)

    @property
    def error(self) -> float:
        return self.simulated_iteration_time / self.measured_iteration_time - 1.0

    @property
    def usable(self) -> bool:
        return self.problem is None

    @property
    def host_speed(self) -> float | None:
        """How fast the host ran compared with calibration (probe at calibration / probe now):
        0.9 means compute was 10% slower during this run than the profile assumes."""
        if not self.measured_probe or not self.profile_probe:
            return None
        return self.profile_probe / self.measured_probe

    @property
    def label(self) -> str:
        """The schedule, with its layers per stage where its ranks were slowed (a mixed cluster's
        typed and uniform splits are two rows of one schedule)."""
        return self.schedule + (f" {list(self.partition)}" if self.slowdown and self.partition else "")

    @property
    def memory_error(self) -> float:
        return max(abs(s / m - 1.0) if m else abs(s) for m, s in
                   zip(self.measured_peak_activation_bytes, self.simulated_peak_activation_bytes))

    def record(self) -> dict:
        return {"schedule": self.schedule, "devices": self.devices, "microbatches": self.microbatches,
                "replicas": self.replicas, "measured_iteration_time": self.measured_iteration_time,
                "simulated_iteration_time": self.simulated_iteration_time, "error": self.error,
                "measured_iteration_times": self.measured_iteration_times,
                "measured_peak_activation_bytes": self.measured_peak_activation_bytes,
                "simulated_peak_activation_bytes": self.simulated_peak_activation_bytes,
                "memory_error": self.memory_error, "measured_bubble": self.measured_bubble,
                "simulated_bubble": self.simulated_bubble, "order_identical": self.order_identical,
                "host_speed": self.host_speed, "run_times": self.run_times, "spread": self.spread,
                "kept_runs": self.kept_runs, "foreign_cores": self.foreign_cores, "rank_cores": self.rank_cores,
                "fast_state_steps": list(self.state_steps) if self.state_steps else None,
                "fast_state_cut": self.state_cut,
                "problem": self.problem,
                "fitted": self.fitted,
                "partition": None if self.partition is None else list(self.partition),
                "slowdown": {str(r): k for r, k in self.slowdown}}


def compare_series(series: list, profile: CalibrationProfile, fitted: frozenset = frozenset()) -> list[Comparison]:
    """``series``: the executor's runs of each schedule (:class:`calibration.sitting.RunSeries`);
    ``fitted``: the configs among them the profile's runtime was fitted on (marked in-sample)."""
    out = []
    for ser in series:
        cfg, warmup = ser.config, ser.rules.warmup
        low = lowered_schedule(cfg)
        part = cfg.stage_layers
        # both engines, one statistic: the noise-free step time after the warm-up (the
        # simulator's steps after it are all alike); the step closest to it represents the runs
        res, step = ser.representative()
        mtr = res.trace
        mm = step_metrics(mtr, step)
        str_ = simulate_with_profile(low, profile, steps=warmup + 2, partition=part, recompute=cfg.parallel.recompute,
                                     slowdown=cfg.job.faults.slowdown)
        sim_times = step_metrics(str_).iteration_times
        sim_t = noise_free(sim_times[warmup:])
        sim_step = min(range(warmup, len(sim_times)), key=lambda k: abs(sim_times[k] - sim_t))
        sm = step_metrics(str_, sim_step)
        orders = op_orders(mtr, step)
        # the simulator's own order (its trace's), which is the program's but where it runs an
        # overlapped F&B pair as one block (RECVs first: sim.engine), as the executor does
        sim_orders = op_orders(str_, sim_step)
        identical = all(orders.get(r) == sim_orders.get(r) for r in range(low.num_ranks))
        identical &= all(op_orders(run.trace, s) == orders for run in ser.runs
                         for s in sorted(run.trace["step"].unique()))
        own = bool(build(cfg.layout.schedule, cfg.layout.devices, cfg.layout.microbatches,
                         chunks=cfg.layout.chunks).meta.get("overlapped")) if cfg.parallel.overlap_fb else True
        label = cfg.layout.schedule + ("" if own else "+overlap")   # with --overlap-fb beside its plain run
        out.append(Comparison(schedule=label, devices=cfg.layout.devices,
                              microbatches=cfg.layout.microbatches, replicas=cfg.layout.replicas,
                              measured_iteration_time=ser.step_time,
                              simulated_iteration_time=sim_t, measured_iteration_times=list(res.iteration_times),
                              measured_peak_activation_bytes=[float(p["peak_activation_bytes"])
                                                              for p in res.per_device],
                              simulated_peak_activation_bytes=[p.peak_activation for p in sm.per_device],
                              measured_bubble=[p.bubble_ratio for p in mm.per_device],
                              simulated_bubble=[p.bubble_ratio for p in sm.per_device], order_identical=identical,
                              measured_probe=ser.probe_seconds, run_times=ser.run_times, kept_runs=len(ser.kept),
                              foreign_cores=[ser.foreign(i) for i in range(len(ser.runs))],
                              rank_cores=[ser.rank_cores(i) for i in range(len(ser.runs))], problem=ser.problem,
                              cause=ser.cause,
                              spread=ser.spread, fitted=cfg in fitted,
                              state_steps=ser.state_share() if ser.judges_state else None, state_cut=ser.cut,
                              partition=part, slowdown=tuple(cfg.job.faults.slowdown),
                              profile_probe=(profile.meta.get("probe_seconds") or {}).get(str(low.num_ranks)),
                              measured_trace=mtr[mtr["step"] == step], simulated_trace=str_[str_["step"] == sim_step]))
    return out


def _runs(jobs: list[Job], *, steps: int, model, micro_batch: int | None, dtype: str) -> list[RunConfig]:
    """The measured runs of ``jobs`` (:func:`calibration.fit.measured_run`), with the model and
    micro-batch a profile was measured for where a job leaves them open (None); a job's other
    micro-batch is refused (measured costs are not extrapolated)."""
    out = []
    for job in jobs:
        mine = job.parallel.micro_batch
        if mine is not None and micro_batch is not None and mine != micro_batch:
            raise ValueError(f"job {job.layout.schedule}: micro-batch {mine}, but the sitting measures "
                             f"{micro_batch}")
        filled = job.with_(model=job.model or model, micro_batch=mine or micro_batch)
        out.append(measured_run(filled, steps, dtype))
    return out


def run_and_compare(jobs: list[Job], profile: CalibrationProfile, *, steps: int = 20, rules=None,
                    progress=None) -> list[Comparison]:
    """Run each job in interleaved rounds until its quiet runs agree (ranks pinned to cores where
    the host allows; ``rules``: :class:`calibration.sitting.SittingRules`) and compare its
    noise-free step with the simulator's, with a profile calibrated earlier
    (:func:`calibration.sitting.run_series`). A job's layout and partition (layers per stage; None:
    the executor's own split, which the simulator uses too) are its own; its model and micro-batch
    are the profile's, and so is the precision of the runs."""
    cfgs = _runs(jobs, steps=steps, model=profile.model_name, micro_batch=profile.micro_batch,
                 dtype=profile.precision)
    return compare_series(run_series(cfgs, rules or SittingRules(), progress=progress,
                                     yardstick=speed_yardstick(profile)), profile)


def calibrate_and_compare(jobs: list[Job], *, steps: int = 20, repeats: int = 20, rules=None, progress=None,
                          dtype: str = "fp32") -> tuple[CalibrationProfile, list[Comparison]]:
    """Calibrate and validate in one sitting: measure the host for the jobs' model and micro-batch
    (:func:`calibration.host.measure_host`, as many ranks as a job has), then run the jobs and the
    calibration's traced runs (:func:`calibration.fit.runtime_configs`; those equal to a job's run
    are shared) in the same interleaved rounds, fit the profile on the traced ones and compare
    every job. Both sides meet the same host states: on a shared host the undisturbed speed
    itself moves by ~10% between sittings minutes apart, which is the error a profile from
    another sitting carries. The fitted runs are marked in-sample (``Comparison.fitted``);
    ``dtype`` the runs' precision. Returns (profile, comparisons)."""
    report = progress or (lambda msg: None)
    first = jobs[0]
    model = first.model or "tiny"
    world, tp = first.layout.devices * first.layout.replicas, first.parallel.tp
    if any((j.layout.devices * j.layout.replicas, j.parallel.tp) != (world, tp) for j in jobs):
        raise ValueError("calibrating in the sitting measures one rank count: give every job the same T, D x R")
    if any(j.parallel.ep != first.parallel.ep for j in jobs):
        raise ValueError("calibrating in the sitting measures one expert-parallel size: give every job the same EP")
    host = measure_host(model, ranks=world, repeats=repeats, progress=lambda m: report(f"calibrate: {m}"),
                        micro_batch=first.parallel.micro_batch, dtype=dtype, tp=tp, ep=first.parallel.ep)
    fit_base = host.runtime_configs(fit_ranks(world, tp), steps)
    val = _runs(jobs, steps=steps, model=model, micro_batch=host.micro_batch, dtype=dtype)
    every = list(dict.fromkeys(val + fit_base))
    report(f"runs: {len(val)} schedules and {len(every) - len(val)} more calibration runs, interleaved")
    by_cfg = dict(zip(every, run_series(every, rules or SittingRules(), progress=report,
                                        yardstick=host_yardstick(host))))
    profile = fit_profile(host, [by_cfg[c] for c in fit_base])
    return profile, compare_series([by_cfg[c] for c in val], profile, frozenset(fit_base))


UNSETTLED_PROFILE, HOST_SPEED = "unsettled profile", "host speed"


@dataclass(frozen=True)
class Refusal:
    """Why a sitting gives no error figure: its ``cause`` (:data:`UNSETTLED_PROFILE`: the profile's
    own calibration runs did not settle; ``HOST_BUSY``: other processes took the ranks' cores;
    ``NOISY_RUNS``: quiet runs that do not agree; :data:`HOST_SPEED`: the host's speed moved since
    calibration), each with its own remedy, and what was seen."""

    cause: str
    text: str

    def __str__(self) -> str:
        return f"{self.cause}: {self.text}"


def profile_refusals(profile: CalibrationProfile) -> list[Refusal]:
    """The profile's calibration sitting did not settle (empty: it did)."""
    return [Refusal(UNSETTLED_PROFILE, p) for p in sitting_problems(profile)]


def refusals(comps: list[Comparison], profile: CalibrationProfile, *,
             max_drift: float | None = 0.05) -> list[Refusal]:
    """Why the sitting cannot give an error figure (empty: it can): the profile's calibration
    runs did not settle, a schedule's runs did not settle (other processes busy, or the quiet
    runs' own noise), or (``max_drift``: for a profile calibrated in another sitting) the host
    speed probe moved by more than that since (the profile then describes another host state)."""
    mine = [Refusal(c.cause or NOISY_RUNS, f"{c.label}: {c.problem}") for c in comps if c.problem]
    # runs shared by calibration and validation (one sitting) are named once
    out = [r for r in profile_refusals(profile) if not any(r.text.endswith(": " + m.text) for m in mine)]
    out += mine
    speeds = sorted(c.host_speed for c in comps if c.host_speed is not None)
    if max_drift is not None and speeds:
        mid = speeds[len(speeds) // 2]
        if abs(mid - 1.0) > max_drift:
            out.append(Refusal(HOST_SPEED, f"{mid:.2f} of calibration's (block probe, median over the schedules; "
                                           f"at most {max_drift:.0%} off allowed)"))
    return out
