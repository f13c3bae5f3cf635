"""The simulator as a calibration profile describes the host: what calibration fits against
traced runs and what validation compares with measured ones.

Every rank of a profile was measured on one host: the simulator puts them all there, sharing its
cores (:class:`sim.host.HostCores`, :func:`sim.host.on_one_host`: processor sharing while every
rank has a core, the profile's OS time slice beyond), with the profile's per-layer costs and its
P2P and all-reduce fits, bound as every job with a profile is (:func:`cost_models.bind.calibrated`,
the one path from a profile to costs: ``simulate --profile``, validation and calibration alike).
"""
from __future__ import annotations

from cost_models.bind import calibrated
from sim.engine import SimOptions, simulate
from sim.host import HostCores, on_one_host


def simulate_with_profile(low, profile, steps: int = 1, partition=None, recompute: str = "none", slowdown=()):
    """Simulate ``steps`` back-to-back iterations of lowered schedule ``low`` with the costs of
    calibration ``profile`` (under activation recomputation ``recompute``), on one host whose
    cores the ranks share (``partition``: layers per stage; default the executor's split for the
    profile's model). ``slowdown``: (rank, k) pairs, each such rank's compute k x slower (the
    run's ``--slowdown``, or a mixed cluster's emulated pools: :class:`cost_models.job.Faults`)."""
    bound = calibrated(profile, low, partition=partition, recompute=recompute)
    host = HostCores.of(profile) or HostCores(cores=1)
    opts = SimOptions(steps=steps, slowdown=dict(slowdown))
    return simulate(low, bound.costs, bound.network, on_one_host(opts, low.num_ranks, host))
