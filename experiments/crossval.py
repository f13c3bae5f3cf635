"""Cross-validation: the same lowered schedule run by the executor and by the simulator.

For each schedule: the executor trains ``steps`` steps (the first ``warmup`` dropped); its
iteration time is the median of the rest and the step whose time is that median is the one
compared op by op. The simulator runs the same lowered schedule with the calibrated profile
(per-layer times, runtime overheads, P2P / all-reduce fits) on one host whose cores the ranks
share. Reported side by side: iteration time and its relative error, per-device bubble ratio,
peak activation bytes (measured by saved-tensor hooks vs simulated from the profile's measured
per-layer bytes) and whether each rank's executed op order equals the schedule's program.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

from cost_models import CalibrationProfile
from schedules.trace import median_step, op_orders, step_metrics
from sim.host import simulate_with_profile


@dataclass
class Comparison:
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
    measured_probe: float | None = None     # host speed probe during the run (s), see executor.worker
    run_medians: list[float] = field(default_factory=list)   # median step time of every repeat run
    profile_probe: float | None = None      # the same probe when the profile was calibrated
    measured_trace: pd.DataFrame = field(repr=False, default=None)
    simulated_trace: pd.DataFrame = field(repr=False, default=None)

    @property
    def error(self) -> float:
        return self.simulated_iteration_time / self.measured_iteration_time - 1.0

    @property
    def run_spread(self) -> float | None:
        """How far apart the repeat runs of this schedule were: slowest / fastest median - 1. The
        host's own reproducibility; an error of that size is noise, not the model."""
        return max(self.run_medians) / min(self.run_medians) - 1.0 if len(self.run_medians) > 1 else None

    @property
    def host_speed(self) -> float | None:
        """How fast the host ran compared with calibration (probe at calibration / probe now):
        0.9 means compute was 10% slower during this run than the profile assumes."""
        if not self.measured_probe or not self.profile_probe:
            return None
        return self.profile_probe / self.measured_probe

    @property
    def drift_adjusted_error(self) -> float | None:
        """The error with the simulated time divided by ``host_speed``: what is left once the
        host's drift since calibration is accounted for (an estimate: all time treated as compute)."""
        hs = self.host_speed
        return None if hs is None else self.simulated_iteration_time / hs / self.measured_iteration_time - 1.0

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
                "host_speed": self.host_speed, "drift_adjusted_error": self.drift_adjusted_error,
                "run_medians": self.run_medians, "run_spread": self.run_spread}


def compare(results: list, profile: CalibrationProfile, warmup: int = 2) -> list[Comparison]:
    """``results``: executor RunResults (with traces) of the schedules to compare."""
    from cost_models.partition import layers_from_blocks
    from executor.config import lowered_schedule
    out = []
    for res in results:
        cfg = res.config
        low = lowered_schedule(cfg)
        # the run's split, as layers per stage (a GPT's blocks plus its embedding and head)
        part = None if cfg.partition is None else \
            tuple(cfg.partition) if cfg.is_model_file else tuple(layers_from_blocks(cfg.partition))
        # both engines: the same number of back-to-back steps, the same statistic (the median
        # per-step makespan after the warm-up); the step closest to it represents the run
        med, step = median_step(res.iteration_times, warmup)
        mtr = res.trace
        mm = step_metrics(mtr, step)
        str_ = simulate_with_profile(low, profile, steps=len(res.iteration_times), partition=part)
        sim_med, sim_step = median_step(step_metrics(str_).iteration_times, warmup)
        sm = step_metrics(str_, sim_step)
        orders = op_orders(mtr, step)
        identical = all(orders.get(r) == [str(o) for o in low.program(r)] for r in range(low.num_ranks))
        identical &= all(op_orders(mtr, s) == orders for s in sorted(mtr["step"].unique()))
        out.append(Comparison(cfg.schedule, cfg.devices, cfg.microbatches, cfg.replicas, med, sim_med,
                              list(res.iteration_times), [float(p["peak_activation_bytes"]) for p in res.per_device],
                              [p.peak_activation for p in sm.per_device], [p.bubble_ratio for p in mm.per_device],
                              [p.bubble_ratio for p in sm.per_device], identical,
                              measured_probe=res.extra.get("probe_seconds"),
                              profile_probe=(profile.meta.get("probe_seconds") or {}).get(str(low.num_ranks)),
                              measured_trace=mtr[mtr["step"] == step], simulated_trace=str_[str_["step"] == sim_step]))
    return out


def run_and_compare(schedules: list[str], devices: int, microbatches: int, replicas: int, profile, *,
                    steps: int = 8, warmup: int = 2, model: str | None = None, chunks: int = 2,
                    repeats: int = 1, partitions: dict | None = None) -> list[Comparison]:
    """Run each schedule ``repeats`` times and compare the run with the lowest median step time
    (:func:`executor.launch.run_best_of`): the simulator predicts the machine undisturbed. The runs
    use the profile's micro-batch; ``partitions``: schedule -> the executor's partition (default:
    its own split, which the simulator uses too)."""
    from calibration import PROBE
    from executor.config import RunConfig
    from executor.launch import run_best_of
    cfgs = [RunConfig(schedule=s, devices=devices, microbatches=microbatches, replicas=replicas, chunks=chunks,
                      steps=steps, model=model or profile.model.name, probe=PROBE, micro_batch=profile.micro_batch,
                      partition=(partitions or {}).get(s)) for s in schedules]
    best = run_best_of(cfgs, repeats, warmup)
    comps = compare([res for res, _ in best], profile, warmup)
    for c, (_, meds) in zip(comps, best):
        c.run_medians = meds
    return comps


def plot_overlay(comps: list[Comparison], path) -> None:
    """Simulated (outline) over measured (filled) timelines, one panel per schedule
    (:func:`experiments.plots.plot_overlay`)."""
    from .plots import plot_overlay as draw
    draw([(f"{c.schedule}: measured {c.measured_iteration_time * 1e3:.1f} ms vs simulated "
           f"{c.simulated_iteration_time * 1e3:.1f} ms, error {c.error:+.1%}", c.measured_trace, c.simulated_trace)
          for c in comps], path)
