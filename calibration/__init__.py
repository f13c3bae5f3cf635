"""Calibration: everything about measuring this machine, with the executor's own code, and the
profile :mod:`cost_models.calibration` loads.

It sits above both engines (it runs the executor and the simulator; neither knows about it).
Its modules:

- :mod:`calibration.measure`: layers, communication, data and the optimizer step, measured;
- :mod:`calibration.host`: what a calibration is, step by step (:func:`measure_host`, the traced
  runs, :func:`fit_profile`; :func:`calibrate` does all of it) and the profile made of it;
- :mod:`calibration.sitting`: the statistics of a sitting of repeated, interleaved runs on a
  shared host, and when to give up;
- :mod:`calibration.fit`: the fits (the lone link costs; the runtime, the in-run communication
  and the OS time slice through the simulator);
- :mod:`calibration.simulate`: the simulator as a profile describes the host;
- :mod:`calibration.compare`: simulated against measured, schedule by schedule (what ``pipetwin
  validate`` reports), and why a sitting cannot give an error figure.

This module only re-exports.
"""
from .compare import (HOST_SPEED, UNSETTLED_PROFILE, Comparison, Refusal, calibrate_and_compare, compare_series,
                      profile_refusals, refusals, run_and_compare)
from .fit import (PROBE, RUNTIME_SCHEDULES, fit_allreduce, fit_communication, fit_latency_bandwidth, fit_ranks,
                  fit_runtime, fit_time_slice, runtime_configs)
from .host import (HostMeasurements, calibrate, fit_profile, host_profile, kept_bytes, measure_host, measure_stack,
                   runtime_rules, speed_yardstick)
from .simulate import simulate_with_profile
from .sitting import (BUSY_CORES, HOST_BUSY, NOISY_RUNS, RunSeries, SittingRules, run_series, sitting_problems,
                      sitting_record)

__all__ = ["BUSY_CORES", "HOST_BUSY", "HOST_SPEED", "NOISY_RUNS", "PROBE", "RUNTIME_SCHEDULES", "UNSETTLED_PROFILE",
           "Comparison", "Refusal", "profile_refusals", "HostMeasurements", "RunSeries", "SittingRules", "calibrate",
           "calibrate_and_compare", "compare_series", "fit_allreduce", "fit_communication", "fit_latency_bandwidth",
           "fit_profile", "fit_ranks", "fit_runtime", "fit_time_slice", "host_profile", "kept_bytes", "measure_host",
           "measure_stack", "refusals", "run_and_compare", "run_series", "runtime_configs", "runtime_rules",
           "simulate_with_profile", "sitting_problems", "sitting_record", "speed_yardstick"]
