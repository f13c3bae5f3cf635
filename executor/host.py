"""The host the ranks share: pinning a rank to a core, and how much of the host other processes used.

Measurements on a shared machine need both. Pinning keeps a rank (and every thread it starts:
gloo's, torch's) on one core, so the OS does not migrate it between cores mid-op; it is only done
where every rank of the host gets a core of its own (with more ranks than cores the OS must time
slice them anyway, and pinning them in pairs measured slower, not steadier). The CPU time other
processes take while a run's steps execute is read from the kernel's counters: the host's busy
time (``/proc/stat``: user, nice, system, irq, softirq and the hypervisor's steal) minus the CPU
time of the ranks themselves (``getrusage``). It is what tells a slow run on a busy host from a
slow run (``RunResult.extra["foreign_cores"]``: cores' worth of other work, on average).
"""
from __future__ import annotations

import os
import resource
import socket
import time
from dataclasses import dataclass

_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)   # user nice system irq softirq steal (/proc/stat "cpu" line; idle, iowait out)


PROCESS_BYTES = 350 * 2 ** 20   # what one rank process costs before the model (python + torch + gloo)


def available_host_bytes() -> float | None:
    """MemAvailable of /proc/meminfo (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def pin_to_core(local_rank: int, local_world: int) -> int | None:
    """Pin this process, all its threads and those it starts later, to core ``local_rank`` of
    the cores it may use, when the ``local_world`` ranks of this host fit one per core. Returns
    the core, or None where the host does not allow it (too few cores, no affinity call, not
    permitted)."""
    try:
        cores = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None
    if local_world > len(cores) or not 0 <= local_rank < len(cores):
        return None
    core = cores[local_rank]
    try:
        tasks = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tasks = [0]
    try:
        for tid in tasks:   # a thread keeps its own affinity: set every one, new ones inherit it
            os.sched_setaffinity(tid, {core})
    except OSError:
        return None
    return core


def host_busy_seconds() -> float | None:
    """CPU seconds all processes of this host (and the hypervisor's steal) have used since boot,
    over all cores; None where ``/proc/stat`` cannot be read."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(x) for x in fields[1:]]
    return sum(ticks[i] for i in _BUSY_FIELDS if i < len(ticks)) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    """CPU seconds this process (all its threads) has used."""
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


@dataclass(frozen=True, kw_only=True)
class CpuWindow:
    """One rank's view of a stretch of time: wall seconds, the host's busy CPU seconds (None
    where unknown) and its own CPU seconds."""

    host: str
    wall: float
    host_busy: float | None
    own: float


class CpuMeter:
    """Start it, stop it: the :class:`CpuWindow` in between."""

    def __init__(self):
        self._t, self._busy, self._own = time.perf_counter(), host_busy_seconds(), own_cpu_seconds()

    def stop(self) -> CpuWindow:
        busy = host_busy_seconds()
        return CpuWindow(host=socket.gethostname(), wall=time.perf_counter() - self._t,
                         host_busy=None if busy is None or self._busy is None else busy - self._busy,
                         own=own_cpu_seconds() - self._own)


def foreign_cores(windows: list[CpuWindow]) -> float | None:
    """Cores' worth of CPU others used while the ranks of ``windows`` ran (the most loaded host):
    per host, its busy time (the median over its ranks' readings) minus what its ranks used,
    over the wall time. None when a host's counters are unknown."""
    by_host: dict[str, list[CpuWindow]] = {}
    for w in windows:
        by_host.setdefault(w.host, []).append(w)
    worst = 0.0
    for ws in by_host.values():
        busy = sorted(w.host_busy for w in ws if w.host_busy is not None)
        if len(busy) != len(ws):
            return None
        wall = sorted(w.wall for w in ws)[len(ws) // 2]
        if wall <= 0:
            return None
        worst = max(worst, (busy[len(busy) // 2] - sum(w.own for w in ws)) / wall)
    return max(0.0, worst)
