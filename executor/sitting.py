"""Measuring step times on a shared host: repeated, interleaved runs, and when to give up.

The simulator predicts the step a host runs undisturbed. On a shared machine other processes,
the OS and the hypervisor only ever add time, so a run is summarised by a low quantile of its
step times (:data:`schedules.trace.STEP_QUANTILE`), not by their median or mean. And a sitting
is only usable if the host was quiet enough to show that step:

- every config is run in rounds, all configs once per round, the order rotated from round to
  round (a slow spell hits different configs, and none is always first after a spawn);
- a run counts only if other processes kept no more than ``max_foreign`` cores busy while its
  steps ran (``RunResult.extra["foreign_cores"]``, :mod:`executor.host`), and only if the host
  ran at the reference speed: its speed probe (one block's forward + backward on every rank,
  before and after the steps: ``extra["probe_seconds"]``) within ``max_drift`` of the
  calibration's, or, while calibrating, of the fastest probe of the sitting. The probe sees what
  the CPU counters cannot: this VM's cores slow down by up to 1.5x for seconds at a time with no
  process of its own to blame (other VMs on the same machine);
- a config is settled once its fastest ``runs`` counting runs agree: their low quantiles within
  ``max_spread`` of each other (the host reproduced its noise-free step; slower runs were
  disturbed and are left out). Unsettled configs are run again, up to ``max_runs`` rounds;
- what is left unsettled says why (:attr:`RunSeries.problem`): the caller refuses to report a
  time from it.

The statistic of a settled config is the low quantile of the pooled steps of its counting runs
(:attr:`RunSeries.step_time`); calibration fits the runtime on the steps around it
(:meth:`RunSeries.typical_steps`), so both sides use one statistic.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from schedules.trace import STEP_QUANTILE, quantile_step

from .config import RunConfig, RunResult


@dataclass(frozen=True, kw_only=True)
class SittingRules:
    """How many runs, which statistic, and how much interference a sitting tolerates."""

    runs: int = 3               # counting runs per config that must agree
    max_runs: int = 6           # rounds at most before a config is given up
    warmup: int = 2             # steps dropped at the start of every run
    quantile: float = STEP_QUANTILE
    max_spread: float = 0.05    # fastest `runs` counting runs: slowest / fastest low quantile - 1
    max_foreign: float = 0.15   # cores' worth of other processes' CPU a counting run may see
    max_drift: float = 0.05     # a counting run's host speed probe: at most this far off the reference

    def __post_init__(self):
        if self.runs < 1 or self.max_runs < self.runs:
            raise ValueError(f"need 1 <= runs <= max_runs; got runs={self.runs}, max_runs={self.max_runs}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0; got {self.warmup}")
        if not 0.0 < self.quantile < 1.0:
            raise ValueError(f"quantile must be in (0, 1); got {self.quantile}")
        if not self.max_spread >= 0 or not self.max_foreign >= 0 or not self.max_drift >= 0:
            raise ValueError("max_spread, max_foreign and max_drift must be >= 0")


@dataclass(kw_only=True)
class RunSeries:
    """The runs of one config in a sitting, and what they add up to (:meth:`settle`)."""

    config: RunConfig
    runs: list[RunResult] = field(default_factory=list)
    kept: list[int] = field(default_factory=list)    # indices of the counting runs that agree
    problem: str | None = None                       # why the config is not settled (None: it is)
    brief: str | None = None                         # the problem in a few words
    rules: SittingRules = field(default_factory=SittingRules)
    reference_probe: float | None = None             # the host speed probe a run must match (s)
    reference_label: str = "the reference"

    def run_time(self, i: int) -> float:
        """Run ``i``'s low quantile step time."""
        return quantile_step(self.runs[i].iteration_times, self.rules.warmup, self.rules.quantile)[0]

    def foreign(self, i: int) -> float | None:
        return self.runs[i].extra.get("foreign_cores")

    @property
    def run_times(self) -> list[float]:
        return [self.run_time(i) for i in range(len(self.runs))]

    @property
    def settled(self) -> bool:
        return bool(self.kept) and self.problem is None

    @property
    def spread(self) -> float | None:
        """Slowest / fastest low quantile of the kept runs - 1 (of all runs while unsettled)."""
        idx = self.kept or list(range(len(self.runs)))
        t = [self.run_time(i) for i in idx]
        return max(t) / min(t) - 1.0 if len(t) > 1 else None

    def drift(self, i: int) -> float | None:
        """How much slower the host speed probe was in run ``i`` than the reference (negative:
        faster); None without a probe or a reference."""
        p = self.runs[i].extra.get("probe_seconds")
        return None if p is None or not self.reference_probe else p / self.reference_probe - 1.0

    def settle(self) -> "RunSeries":
        """Decide which runs count (see the module docstring); sets ``kept``, ``problem`` and
        ``brief`` (the problem in a few words)."""
        r, n = self.rules, len(self.runs)
        self.kept, self.problem, self.brief = [], None, None
        busy = [i for i in range(n) if (self.foreign(i) or 0.0) > r.max_foreign]
        off = [i for i in range(n) if i not in busy and abs(self.drift(i) or 0.0) > r.max_drift]
        quiet = [i for i in range(n) if i not in busy and i not in off]
        if len(quiet) < r.runs:
            why = []
            if busy:
                f = [self.foreign(i) for i in busy]
                why.append(f"other processes kept {_span(f, '{:.2f}')} cores busy in {len(busy)} "
                           f"(at most {r.max_foreign:g})")
            if off:
                d = [self.drift(i) for i in off]
                why.append(f"the host speed probe was {_span(d, '{:+.0%}', ' to ')} off {self.reference_label} "
                           f"in {len(off)} (at most {r.max_drift:.0%})")
            self.problem = f"{len(quiet)} of {n} runs quiet, {r.runs} needed" + (": " + "; ".join(why) if why else "")
            self.brief = f"{len(quiet)}/{n} runs quiet"
            return self
        fastest = sorted(quiet, key=self.run_time)[:r.runs]
        t = [self.run_time(i) for i in fastest]
        spread = max(t) / min(t) - 1.0
        if spread > r.max_spread:
            self.problem = (f"run-to-run spread {spread:.0%} (fastest {r.runs} of {len(quiet)} quiet runs; "
                            f"at most {r.max_spread:.0%} allowed)")
            self.brief = f"spread {spread:.0%}"
            return self
        self.kept = sorted(fastest)
        return self

    def _pooled(self) -> list[tuple[float, int, int]]:
        idx = self.kept or list(range(len(self.runs)))
        out = []
        for i in idx:
            times = self.runs[i].iteration_times
            steps = range(self.rules.warmup, len(times)) if len(times) > self.rules.warmup else range(len(times))
            out += [(times[s], i, s) for s in steps]
        return sorted(out)

    @property
    def step_time(self) -> float:
        """The low quantile of the pooled steps of the kept runs (all runs while unsettled)."""
        return float(np.quantile([t for t, _, _ in self._pooled()], self.rules.quantile))

    def representative(self) -> tuple[RunResult, int]:
        """The run and step whose time is closest to :attr:`step_time` (compared op by op)."""
        val = self.step_time
        _, i, s = min(self._pooled(), key=lambda x: abs(x[0] - val))
        return self.runs[i], s

    def typical_steps(self, band: float = 0.1) -> list[tuple[RunResult, int]]:
        """The pooled steps ranked within ``band`` of the quantile (by default the 10th-30th
        percentile around the 20th): the steps a fit should reproduce, several of them."""
        pool = self._pooled()
        n = len(pool)
        lo = int(np.floor(max(0.0, self.rules.quantile - band) * (n - 1)))
        hi = int(np.ceil(min(1.0, self.rules.quantile + band) * (n - 1)))
        return [(self.runs[i], s) for _, i, s in pool[lo:hi + 1]]

    @property
    def probe_seconds(self) -> float | None:
        """The host speed probe over the kept runs (median of their probes)."""
        idx = self.kept or list(range(len(self.runs)))
        p = [self.runs[i].extra["probe_seconds"] for i in idx if "probe_seconds" in self.runs[i].extra]
        return float(np.median(p)) if p else None


def _span(values: list[float], fmt: str, sep: str = "-") -> str:
    lo, hi = fmt.format(min(values)), fmt.format(max(values))
    return lo if lo == hi else f"{lo}{sep}{hi}"


def run_series(configs: Sequence[RunConfig], rules: SittingRules = SittingRules(), *,
               reference_probe: float | None = None, progress: Callable[[str], None] | None = None) -> list[RunSeries]:
    """Run ``configs`` in rounds until each is settled or ``rules.max_runs`` rounds are done
    (module docstring); one launch per round, so each round's report can say how it went.
    ``reference_probe``: the host speed probe (s) the runs must match (validation: the one of
    calibration); None: the fastest probe of this sitting so far (calibration)."""
    from .launch import run_many
    report = progress or (lambda msg: None)
    label = "calibration's" if reference_probe else "the sitting's fastest"
    series = [RunSeries(config=c, rules=rules, reference_probe=reference_probe, reference_label=label)
              for c in configs]
    for rnd in range(rules.max_runs):
        todo = [s for s in series if len(s.runs) < rules.runs or not s.settled]
        if not todo:
            break
        k = rnd % len(todo)
        order = todo[k:] + todo[:k]
        t0 = time.perf_counter()
        for s, res in zip(order, run_many([s.config for s in order])):
            s.runs.append(res)
        probes = [r.extra["probe_seconds"] for s in series for r in s.runs if "probe_seconds" in r.extra]
        for s in series:
            if reference_probe is None and probes:
                s.reference_probe = min(probes)
            if len(s.runs) >= rules.runs:
                s.settle()
        loads = [s.foreign(len(s.runs) - 1) for s in order]
        loads = [x for x in loads if x is not None]
        unsettled = [s for s in series if len(s.runs) >= rules.runs and not s.settled]
        report(f"round {rnd + 1}: {len(order)} run(s) in {time.perf_counter() - t0:.1f} s"
               + (f", other processes {min(loads):.2f}-{max(loads):.2f} cores" if loads else "")
               + ("; not settled: " + ", ".join(f"{s.config.schedule} ({s.brief})" for s in unsettled)
                  if unsettled else ""))
    return series

