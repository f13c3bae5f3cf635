"""Ranks of one CPU host, as a calibration profile describes them.

A profile (:mod:`cost_models.profile`) is measured with every rank on one host: the ranks
share its cores, and the transport's threads (gloo) keep cores busy while they move or reduce
bytes. With no more ranks than cores each rank has a core of its own (pinned) and the sharing is
processor sharing; with more ranks than cores the OS time-slices them (:mod:`sim.slicing`), the
profile's ``time_slice``. These helpers set the simulator up that way, for every simulation with a
profile (:func:`calibration.simulate.simulate_with_profile`, ``pipetwin simulate --profile``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .engine import SimOptions


@dataclass(frozen=True, kw_only=True)
class HostCores:
    """How the ranks of one CPU host share it: ``cores``; with more ranks than cores, the OS's
    ``time_slice`` (seconds; None: processor sharing) and a compute ``oversubscribed_slowdown``
    (a factor a profile may carry; 1 when the time slices account for the sharing)."""

    cores: int
    time_slice: float | None = None
    oversubscribed_slowdown: float = 1.0

    @classmethod
    def of(cls, profile) -> "HostCores | None":
        """The host of a calibration profile (None: the profile names no core count)."""
        fields = profile.host_cores()
        return None if fields is None else cls(**fields)


def on_one_host(opts: SimOptions, num_ranks: int, host: HostCores) -> SimOptions:
    """Calibrated CPU ranks: all on one host whose cores they share, with transfers and
    all-reduces keeping cores busy too (the transport's threads). When the ranks outnumber the
    cores, the cores are time-sliced (``host.time_slice``) and every rank's compute is
    ``host.oversubscribed_slowdown`` times slower, on top of any slowdown ``opts`` already has."""
    slow = dict(opts.slowdown)
    over = num_ranks > host.cores
    if over and host.oversubscribed_slowdown != 1.0:
        slow = {r: slow.get(r, 1.0) * host.oversubscribed_slowdown for r in range(num_ranks)}
    return replace(opts, hosts=[0] * num_ranks, cores=float(host.cores), comm_uses_cores=True, slowdown=slow,
                   time_slice=host.time_slice if over else None)

