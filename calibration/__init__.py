"""Calibration: everything about measuring this machine, with the executor's own code, and the
profile :mod:`cost_models.profile` loads.

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
from schedules._face import lazy_face

# module -> the names this package exports from it, imported on first use (schedules._face)
__all__, __getattr__, __dir__ = lazy_face(__name__, {
    "compare": ("HOST_SPEED", "UNSETTLED_PROFILE", "Comparison", "Refusal", "calibrate_and_compare",
                "compare_series", "profile_refusals", "refusals", "run_and_compare"),
    "fit": ("PROBE", "RUNTIME_SCHEDULES", "fit_allreduce", "fit_communication", "fit_latency_bandwidth", "fit_ranks",
            "fit_runtime", "fit_time_slice", "runtime_configs"),
    "host": ("HostMeasurements", "calibrate", "fit_profile", "host_profile", "kept_bytes", "measure_host",
             "measure_stack", "runtime_rules", "speed_yardstick"),
    "simulate": ("simulate_with_profile",),
    "sitting": ("BUSY_CORES", "HOST_BUSY", "NOISY_RUNS", "RunSeries", "SittingRules", "run_series",
                "sitting_problems", "sitting_record"),
})
