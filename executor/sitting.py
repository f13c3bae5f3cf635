"""Measuring step times on a shared host: repeated, interleaved runs, and when to give up.

The simulator predicts the step a host runs undisturbed. On this shared VM a step takes either
its own time or up to ~1.6x as long, in spells of seconds (other processes; other VMs on the same
machine, which no counter of this one shows), and the share of slow steps changes from minute to
minute; whole runs of a second or two also land in faster or slower host states (the same
config's runs spread by 20-30% with no process of this VM busy). So a run's time is the
noise-free time of its steps (:func:`schedules.trace.noise_free`: the median of the fast steps),
a config's time the median of its runs' times, and a sitting is only usable if it shows that
time reproducibly:

- every config is run in rounds, all configs once per round (one launch per world size), the
  order rotated from round to round, so every config meets the same mix of host states;
- a run counts only if other processes kept no more than ``max_foreign`` cores busy while its
  steps ran (``RunResult.extra["foreign_cores"]``, :mod:`executor.host`): those share the very
  cores the ranks run on, fast steps included;
- a config is settled once it has ``runs`` counting runs and its time does not hang on any one
  of them: the median with each counting run left out in turn stays within ``max_spread``
  (:attr:`RunSeries.spread`, the run-to-run spread). Unsettled configs are run again, up to
  ``max_runs`` rounds;
- what is left unsettled says why (:attr:`RunSeries.problem`): the caller refuses to report a
  time from it.

(The median of runs, not one statistic of all runs' steps pooled: measured here, a pooled
fast-step median moved by 6-18% when one of 3-8 runs was left out, because the fast band of a
pool of host states cuts through them; the median of the runs' own times moved by at most 5% at
five runs in the same sittings.) Calibration fits the runtime on the fast steps of the runs
around that median (:meth:`RunSeries.typical_steps`), so both sides use one statistic.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from schedules.trace import fast_steps, noise_free

from .config import RunConfig, RunResult


@dataclass(frozen=True, kw_only=True)
class SittingRules:
    """How many runs, and how much interference a sitting tolerates."""

    runs: int = 3               # counting runs per config, at least
    max_runs: int = 8           # rounds at most before a config is given up
    warmup: int = 2             # steps dropped at the start of every run
    max_spread: float = 0.05    # run-to-run spread allowed (the time with any one run left out)
    max_foreign: float = 0.15   # cores' worth of other processes' CPU a counting run may see

    def __post_init__(self):
        if self.runs < 1 or self.max_runs < self.runs:
            raise ValueError(f"need 1 <= runs <= max_runs; got runs={self.runs}, max_runs={self.max_runs}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0; got {self.warmup}")
        if not self.max_spread >= 0 or not self.max_foreign >= 0:
            raise ValueError("max_spread and max_foreign must be >= 0")


@dataclass(kw_only=True)
class RunSeries:
    """The runs of one config in a sitting, and what they add up to (:meth:`settle`)."""

    config: RunConfig
    runs: list[RunResult] = field(default_factory=list)
    rules: SittingRules = field(default_factory=SittingRules)
    kept: list[int] = field(default_factory=list)    # indices of the counting runs (once settled)
    problem: str | None = None                       # why the config is not settled (None: it is)
    brief: str | None = None                         # the problem in a few words

    def _steps(self, i: int) -> list[float]:
        times = self.runs[i].iteration_times
        return list(times[self.rules.warmup:]) if len(times) > self.rules.warmup else list(times)

    def foreign(self, i: int) -> float | None:
        return self.runs[i].extra.get("foreign_cores")

    def rank_cores(self, i: int) -> float | None:
        """Cores' worth of CPU run ``i``'s ranks used themselves while its steps ran (None: not metered)."""
        e = self.runs[i].extra
        cpu, wall = e.get("rank_cpu_seconds"), e.get("wall_seconds")
        return sum(cpu) / wall if cpu and wall else None

    def quiet(self) -> list[int]:
        """The runs other processes left alone (unknown counters count as quiet)."""
        return [i for i in range(len(self.runs)) if (self.foreign(i) or 0.0) <= self.rules.max_foreign]

    def _counting(self) -> list[int]:
        return self.kept or self.quiet() or list(range(len(self.runs)))

    def _run_time(self, i: int) -> float:
        """Run ``i``'s own noise-free step time."""
        return noise_free(self._steps(i))

    @property
    def run_times(self) -> list[float]:
        """Every run's own noise-free step time."""
        return [self._run_time(i) for i in range(len(self.runs))]

    @property
    def settled(self) -> bool:
        return bool(self.kept) and self.problem is None

    def _time_of(self, idx: list[int]) -> float:
        """The step time of runs ``idx``: the median of their own noise-free times."""
        return float(np.median([self._run_time(i) for i in idx]))

    @property
    def spread(self) -> float | None:
        """Run-to-run spread: the step time (the median of the runs' times) with each counting run
        left out in turn, largest / smallest - 1 (None with fewer than 2 runs)."""
        idx = self._counting()
        if len(idx) < 2:
            return None
        loo = [self._time_of([j for j in idx if j != i]) for i in idx]
        return max(loo) / min(loo) - 1.0

    def settle(self) -> "RunSeries":
        """Decide which runs count (see the module docstring); sets ``kept``, ``problem`` and
        ``brief`` (the problem in a few words)."""
        r, n = self.rules, len(self.runs)
        self.kept, self.problem, self.brief = [], None, None
        quiet = self.quiet()
        if len(quiet) < r.runs:
            loads = [self.foreign(i) for i in range(n) if i not in quiet]
            self.problem = (f"{len(quiet)} of {n} runs quiet, {r.runs} needed: other processes kept "
                            f"{_span(loads, '{:.2f}')} cores busy in {n - len(quiet)} (at most {r.max_foreign:g})"
                            if loads else f"{n} runs, {r.runs} needed")
            self.brief = f"{len(quiet)}/{n} runs quiet"
            return self
        self.kept = quiet
        spread = self.spread
        if spread is not None and spread > r.max_spread:
            self.problem = (f"run-to-run spread {spread:.0%} (the step time with any one of {len(quiet)} quiet runs "
                            f"left out; at most {r.max_spread:.0%} allowed)")
            self.brief = f"spread {spread:.0%}"
            self.kept = []
        return self

    def _pool(self) -> list[tuple[float, int, int]]:
        """(time, run, step) of the counting runs' steps after the warm-up."""
        w = self.rules.warmup
        out = []
        for i in self._counting():
            first = w if len(self.runs[i].iteration_times) > w else 0
            out += [(t, i, first + k) for k, t in enumerate(self._steps(i))]
        return out

    @property
    def step_time(self) -> float:
        """The step time: the median of the counting runs' own noise-free times (of the quiet runs,
        or all, while unsettled)."""
        return self._time_of(self._counting())

    def representative(self) -> tuple[RunResult, int]:
        """The run and step whose time is closest to :attr:`step_time` (compared op by op)."""
        val = self.step_time
        _, i, s = min(self._pool(), key=lambda x: abs(x[0] - val))
        return self.runs[i], s

    def typical_steps(self) -> list[tuple[RunResult, int]]:
        """The steps a fit should reproduce: of the counting runs in the middle of their times
        (the middle half, at least the median one), the fast steps around their median (the
        middle half of them)."""
        idx = sorted(self._counting(), key=self._run_time)
        m = len(idx)
        middle = set(idx[m // 4: max(m // 4 + 1, m - m // 4)])
        pool = [x for x in self._pool() if x[1] in middle]
        fast = sorted(pool[k] for k in fast_steps([t for t, _, _ in pool]))
        n = len(fast)
        return [(self.runs[i], s) for _, i, s in fast[n // 4: max(n // 4 + 1, n - n // 4)]]

    @property
    def probe_seconds(self) -> float | None:
        """The host speed probe over the counting runs: the noise-free time of their pooled probe
        times (``extra["probe_samples"]``; the runs' own summaries where those are missing)."""
        samples = []
        for i in self._counting():
            ex = self.runs[i].extra
            samples += ex.get("probe_samples") or ([ex["probe_seconds"]] if "probe_seconds" in ex else [])
        return noise_free(samples) if samples else None


def _span(values: list[float], fmt: str, sep: str = "-") -> str:
    lo, hi = fmt.format(min(values)), fmt.format(max(values))
    return lo if lo == hi else f"{lo}{sep}{hi}"


def run_series(configs: Sequence[RunConfig], rules: SittingRules = SittingRules(), *,
               progress: Callable[[str], None] | None = None) -> list[RunSeries]:
    """Run ``configs`` in rounds until each is settled or ``rules.max_runs`` rounds are done
    (module docstring). Each round is one launch per world size (D x R), so configs of several
    world sizes (a calibration's runs beside a validation's) meet the same host states."""
    from .launch import run_many
    report = progress or (lambda msg: None)
    series = [RunSeries(config=c, rules=rules) for c in configs]
    for rnd in range(rules.max_runs):
        todo = [s for s in series if len(s.runs) < rules.runs or not s.settled]
        if not todo:
            break
        k = rnd % len(todo)
        order = todo[k:] + todo[:k]
        t0 = time.perf_counter()
        for world in sorted({s.config.devices * s.config.replicas for s in order}):
            group = [s for s in order if s.config.devices * s.config.replicas == world]
            for s, res in zip(group, run_many([s.config for s in group])):
                s.runs.append(res)
        for s in order:
            if len(s.runs) >= rules.runs:
                s.settle()
        loads = [x for x in (s.foreign(len(s.runs) - 1) for s in order) if x is not None]
        unsettled = [s for s in series if len(s.runs) >= rules.runs and not s.settled]
        report(f"round {rnd + 1}: {len(order)} run(s) in {time.perf_counter() - t0:.1f} s"
               + (f", other processes {_span(loads, '{:.2f}')} cores" if loads else "")
               + ("; not settled: " + ", ".join(f"{s.config.schedule} ({s.brief})" for s in unsettled)
                  if unsettled else ""))
    return series

