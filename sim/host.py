"""Ranks of one CPU host, as a calibration profile describes them.

A profile (:mod:`cost_models.calibration`) is measured with every rank on one host: the ranks
share its cores (processor sharing), and the transport's threads (gloo) keep cores busy while
they move or reduce bytes. These two helpers set the simulator up that way; calibration (to
fit the runtime against traced runs) and validation (to predict them) both use them.
"""
from __future__ import annotations

from dataclasses import replace

from .engine import SimOptions, simulate


def on_one_host(opts: SimOptions, num_ranks: int, cores: int, oversubscribed_slowdown: float = 1.0) -> SimOptions:
    """Calibrated CPU ranks: all on one host whose ``cores`` they share, with transfers and
    all-reduces keeping cores busy too (the transport's threads). When the ranks outnumber the
    cores, every rank's compute is also ``oversubscribed_slowdown`` times slower (measured by
    calibration: OS time slicing, context switches and refilled caches cost more than ideal
    processor sharing), on top of any slowdown ``opts`` already has."""
    slow = dict(opts.slowdown)
    if num_ranks > cores and oversubscribed_slowdown != 1.0:
        slow = {r: slow.get(r, 1.0) * oversubscribed_slowdown for r in range(num_ranks)}
    return replace(opts, hosts=[0] * num_ranks, cores=float(cores), comm_uses_cores=True, slowdown=slow)


def simulate_with_profile(low, profile, steps: int = 1, partition=None):
    """Simulate ``steps`` back-to-back iterations of lowered schedule ``low`` with the costs of
    calibration ``profile``, on one host whose cores the ranks share (``partition``: layers per
    stage; default the executor's split for the profile's model)."""
    costs = profile.cost_model(low.num_stages, partition).bind(low)
    net = profile.cluster(low.num_ranks)
    return simulate(low, costs, net, on_one_host(SimOptions(steps=steps), low.num_ranks, profile.cores or 1,
                                                      profile.oversubscribed_slowdown))
