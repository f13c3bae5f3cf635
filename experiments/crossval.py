"""Cross-validation: the same lowered schedule run by the executor and by the simulator.

For each schedule: the executor trains ``steps`` steps per run, in interleaved rounds of runs
until its quiet runs agree (:func:`executor.sitting.run_series`); its iteration time is the low
quantile of the pooled steps after the warm-up (the noise-free step, which the simulator
predicts; the calibration fitted the runtime to the same statistic) and the step closest to it
is the one compared op by op. The simulator runs the same lowered schedule with the calibrated
profile (per-layer times, runtime overheads, P2P / all-reduce fits) on one host whose cores the
ranks share. Reported side by side: iteration time and its relative error, per-device bubble
ratio, peak activation bytes (measured by saved-tensor hooks vs simulated from the profile's
measured per-layer bytes) and whether each rank's executed op order equals the schedule's program.

A time is only worth comparing from a usable sitting: :func:`refusals` says why one is not (a
busy calibration, a schedule whose runs did not settle, a host whose speed moved since
calibration); ``pipetwin validate`` then prints the reasons instead of an error figure.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

from cost_models import CalibrationProfile
from schedules.trace import op_orders, quantile_step, step_metrics
from sim.host import simulate_with_profile


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
    problem: str | None = None              # why the runs did not settle (None: they did)
    spread: float | None = None             # slowest / fastest kept run - 1: the host's reproducibility
    profile_probe: float | None = None      # the same probe when the profile was calibrated
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
                "kept_runs": self.kept_runs, "foreign_cores": self.foreign_cores, "problem": self.problem}


def compare(series: list, profile: CalibrationProfile) -> list[Comparison]:
    """``series``: the executor's runs of each schedule (:class:`executor.sitting.RunSeries`)."""
    from executor.config import lowered_schedule
    out = []
    for ser in series:
        cfg, warmup, q = ser.config, ser.rules.warmup, ser.rules.quantile
        low = lowered_schedule(cfg)
        # both engines, one statistic: the low quantile of per-step makespans after the warm-up
        # (the simulator's steps after it are all alike); the step closest to it represents the run
        res, step = ser.representative()
        mtr = res.trace
        mm = step_metrics(mtr, step)
        str_ = simulate_with_profile(low, profile, steps=warmup + 2)
        sim_t, sim_step = quantile_step(step_metrics(str_).iteration_times, warmup, q)
        sm = step_metrics(str_, sim_step)
        orders = op_orders(mtr, step)
        identical = all(orders.get(r) == [str(o) for o in low.program(r)] for r in range(low.num_ranks))
        identical &= all(op_orders(run.trace, s) == orders for run in ser.runs
                         for s in sorted(run.trace["step"].unique()))
        out.append(Comparison(schedule=cfg.schedule, devices=cfg.devices, microbatches=cfg.microbatches,
                              replicas=cfg.replicas, measured_iteration_time=ser.step_time,
                              simulated_iteration_time=sim_t, measured_iteration_times=list(res.iteration_times),
                              measured_peak_activation_bytes=[float(p["peak_activation_bytes"])
                                                              for p in res.per_device],
                              simulated_peak_activation_bytes=[p.peak_activation for p in sm.per_device],
                              measured_bubble=[p.bubble_ratio for p in mm.per_device],
                              simulated_bubble=[p.bubble_ratio for p in sm.per_device], order_identical=identical,
                              measured_probe=ser.probe_seconds, run_times=ser.run_times, kept_runs=len(ser.kept),
                              foreign_cores=[ser.foreign(i) for i in range(len(ser.runs))], problem=ser.problem,
                              spread=ser.spread,
                              profile_probe=(profile.meta.get("probe_seconds") or {}).get(str(low.num_ranks)),
                              measured_trace=mtr[mtr["step"] == step], simulated_trace=str_[str_["step"] == sim_step]))
    return out


def run_and_compare(schedules: list[str], devices: int, microbatches: int, replicas: int, profile, *,
                    steps: int = 20, model: str | None = None, chunks: int = 2, rules=None,
                    progress=None) -> list[Comparison]:
    """Run each schedule in interleaved rounds until its quiet runs agree (ranks pinned to cores
    where the host allows; ``rules``: :class:`executor.sitting.SittingRules`; a run is quiet when
    its host speed probe matches the calibration's too) and compare the noise-free step with the
    simulator's (:func:`executor.sitting.run_series`)."""
    from calibration import PROBE
    from executor.config import RunConfig
    from executor.sitting import SittingRules, run_series
    cfgs = [RunConfig(schedule=s, devices=devices, microbatches=microbatches, replicas=replicas, chunks=chunks,
                      steps=steps, model=model or profile.model.name, probe=PROBE, pin_cores=True)
            for s in schedules]
    ref = (profile.meta.get("probe_seconds") or {}).get(str(devices * replicas))
    return compare(run_series(cfgs, rules or SittingRules(), reference_probe=ref, progress=progress), profile)


def refusals(comps: list[Comparison], profile: CalibrationProfile, *, max_drift: float = 0.05) -> list[str]:
    """Why the sitting cannot give an error figure (empty: it can): the profile's calibration
    sitting was busy, a schedule's runs did not settle, or the host speed probe moved by more
    than ``max_drift`` since calibration (the profile then describes another host state)."""
    from calibration import sitting_problems
    out = [f"calibration {p}" for p in sitting_problems(profile)]
    out += [f"{c.schedule}: {c.problem}" for c in comps if c.problem]
    speeds = [c.host_speed for c in comps if c.host_speed is not None and c.usable]
    if speeds and max(abs(x - 1.0) for x in speeds) > max_drift:
        out.append(f"host speed {min(speeds):.2f}-{max(speeds):.2f} of calibration's (block probe; at most "
                   f"{max_drift:.0%} off allowed): recalibrate")
    return out


def plot_overlay(comps: list[Comparison], path) -> None:
    """Simulated (outline) over measured (filled) timelines, one panel per schedule."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    n = len(comps)
    fig, axes = plt.subplots(n, 1, figsize=(12, sum(0.9 + 0.5 * c.devices * c.replicas for c in comps)),
                             squeeze=False)
    cmap = plt.get_cmap("tab10")
    for ax, c in zip(axes[:, 0], comps):
        for tr, filled in ((c.measured_trace, True), (c.simulated_trace, False)):
            t = tr[tr["kind"].isin(["F", "B", "W"])]
            t0 = tr["start"].min()
            for row in t.itertuples(index=False):
                y = row.device
                colour = cmap(row.microbatch % 10)
                if filled:
                    ax.barh(y, row.end - row.start, left=row.start - t0, height=0.8, color=colour,
                            alpha=0.45 if row.kind == "F" else 0.9, linewidth=0)
                else:
                    ax.barh(y, row.end - row.start, left=row.start - t0, height=0.8, fill=False,
                            edgecolor="black", linewidth=0.6)
        ax.set_title(f"{c.schedule}: measured {c.measured_iteration_time * 1e3:.1f} ms (filled) vs simulated "
                     f"{c.simulated_iteration_time * 1e3:.1f} ms (outlined), error {c.error:+.1%}", fontsize=9)
        ax.set_yticks(range(c.devices * c.replicas), [f"rank {r}" for r in range(c.devices * c.replicas)], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("seconds", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
