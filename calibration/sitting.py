"""The statistics of a sitting: step times measured on a shared host, from repeated, interleaved
runs, and when to give up.

The simulator predicts the step a host runs undisturbed. On a shared host (a VM beside others
on one machine, which no counter of this one sees) a step takes either its own time or up to
~1.6x as long, in spells of seconds, and the share of slow steps changes from minute to minute;
whole runs of a second or two also land in faster or slower host states (the same config's runs
spread by 20-30% with no process of this VM busy). So a run's time is the noise-free time of its
steps (:func:`schedules.trace.noise_free`: the median of the fast steps), a config's time the
median of its runs' times, and a sitting is only usable if it shows that time reproducibly:

- every config is run in rounds, all configs once per round (one launch per world size), the
  order rotated from round to round, so every config meets the same mix of host states;
- a run counts only if other processes kept no more than ``max_foreign`` cores busy while its
  steps ran (``RunResult.extra["foreign_cores"]``, :mod:`executor.host`): those share the very
  cores the ranks run on, fast steps included;
- a config is settled once it has ``runs`` counting runs and its time does not hang on any one
  of them: the median with each counting run left out in turn stays within ``max_spread``
  (:attr:`RunSeries.spread`, the run-to-run spread). Unsettled configs are run again, up to
  ``max_runs`` rounds;
- what is left unsettled says why (:attr:`RunSeries.problem`) and whose doing it is
  (:attr:`RunSeries.cause`): :data:`HOST_BUSY` only where too few runs had other processes at or
  below ``max_foreign`` (default :data:`cost_models.profile.BUSY_CORES`, 0.5 cores, measured),
  else :data:`NOISY_RUNS` (quiet runs that disagree: a small model's own noise, or a host state no
  counter of this VM sees); the caller refuses to report a time from it.

(The median of runs, not one statistic of all runs' steps pooled: the fast band of a pool of
host states cuts through them, so a pooled fast-step median moves by 6-18% when one of 3-8 runs
is left out, where the median of the runs' own times moves by at most 5% at five runs.)
Calibration fits the runtime on the fast steps of the runs around that median
(:meth:`RunSeries.typical_steps`), so both sides use one statistic.

*One host state for every config* (where the runs' op costs are known: a ``yardstick``, the
compute ops' costs measured alone, and each rank has a core of its own). A slow spell slows the
ops themselves: a step's F, B and W run at 0.65-0.8x their alone times in the host's fast state
and up to 1.5x slower in its slow spells, in spells of a few steps, so the runs that settle one
config can come from another host state than another config's (GPipe and ZB-H1, nearly the same
program, can settle 12% apart). So each step's *speed* is taken from its own ops: the median over
its compute ops of measured / alone time (:meth:`RunSeries.speeds`), the same yardstick for every
config; the sitting's fast state is every step within ``state_band`` of the
:data:`STATE_QUANTILE` of all configs' step speeds (:func:`fast_state_cut`, recomputed after every
round); a config's time is then the median of its fast-state steps over its counting runs, a run
counts once it has ``state_steps`` of them, and the spread is that time with each run left out.
That takes the host-state mixture out of a comparison, not the schedules' own differences from
the model. Where ranks outnumber the cores an op's duration includes its waits for a core (what
:mod:`sim.slicing` models), not the host's speed: those configs keep the statistic above.

How a sitting went is kept with what it measured: :func:`sitting_record` (a calibration profile's
``meta["sitting"]``) and :func:`sitting_problems` (why a profile's sitting is unusable).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from cost_models.profile import BUSY_CORES, CalibrationProfile
from executor import launch
from executor.config import RunConfig, RunResult
from schedules.ir import B, F, W
from schedules.trace import fast_steps, noise_free

# the sitting's fast state: steps within SittingRules.state_band of this quantile of all step speeds
STATE_QUANTILE = 0.2
HOST_BUSY, NOISY_RUNS = "host busy", "noisy runs"    # RunSeries.cause
OWN_NOISE, NOT_THEIR_LOAD = "the runs' own noise", "not their load"   # why a quiet host's config is unsettled


@dataclass(frozen=True, kw_only=True)
class SittingRules:
    """How many runs, and how much interference a sitting tolerates."""

    runs: int = 3               # counting runs per config, at least
    max_runs: int = 8           # rounds at most before a config is given up
    warmup: int = 2             # steps dropped at the start of every run
    max_spread: float = 0.05    # run-to-run spread allowed (the time with any one run left out)
    max_foreign: float = BUSY_CORES   # cores' worth of other processes' CPU a counting run may see
    state_band: float = 0.15    # a step is in the host's fast state within this of the sitting's fast speed
    state_steps: int = 3        # fast-state steps a run needs to count (configs with a yardstick)

    def __post_init__(self):
        if self.runs < 1 or self.max_runs < self.runs:
            raise ValueError(f"need 1 <= runs <= max_runs; got runs={self.runs}, max_runs={self.max_runs}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0; got {self.warmup}")
        if not self.max_spread >= 0 or not self.max_foreign >= 0 or not self.state_band >= 0:
            raise ValueError("max_spread, max_foreign and state_band must be >= 0")
        if self.state_steps < 1:
            raise ValueError(f"state_steps must be >= 1; got {self.state_steps}")


@dataclass(kw_only=True)
class RunSeries:
    """The runs of one config in a sitting, and what they add up to (:meth:`settle`)."""

    config: RunConfig
    runs: list[RunResult] = field(default_factory=list)
    rules: SittingRules = field(default_factory=SittingRules)
    kept: list[int] = field(default_factory=list)    # indices of the counting runs (once settled)
    problem: str | None = None                       # why the config is not settled (None: it is)
    cause: str | None = None                         # HOST_BUSY or NOISY_RUNS (None: settled)
    brief: str | None = None                         # the problem in a few words
    # the compute ops' costs alone (cost_models.base.StageCosts: compute_time(kind, copy, stage)), the
    # yardstick of a step's speed; None: the host state is not judged (module docstring)
    yardstick: object | None = field(default=None, repr=False)
    cut: float | None = None                         # the sitting's fast state: speeds up to this (fast_state_cut)
    _speeds: list = field(default_factory=list, repr=False, compare=False)   # per run: {step: speed}

    def _steps(self, i: int) -> list[float]:
        times = self.runs[i].iteration_times
        return [times[k] for k in self._after_warmup(i)]

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

    def speeds(self, i: int) -> dict[int, float]:
        """Run ``i``'s steps after the warm-up: {step: speed}, the median over the step's compute ops
        (F, B, W; those the yardstick gives a time) of measured / yardstick time, the yardstick of a
        rank slowed k x (``--slowdown``, a mixed cluster's emulated pools) k x its own. Empty without a
        yardstick or a trace."""
        while len(self._speeds) <= i:
            self._speeds.append(self._speeds_of(self.runs[len(self._speeds)]))
        return self._speeds[i]

    def _speeds_of(self, run: RunResult) -> dict[int, float]:
        t = run.trace
        if self.yardstick is None or t is None or not len(t):
            return {}
        t = t[(t["step"] >= self.rules.warmup) & t["kind"].isin((F, B, W))]
        slow = dict(self.config.job.faults.slowdown)    # a slowed rank's op sleeps (k - 1) x its time inside it
        ratios: dict[int, list[float]] = {}
        for step, kind, copy, stage, dev, start, end in zip(t["step"], t["kind"], t["copy"], t["stage"], t["device"],
                                                            t["start"], t["end"]):
            y = self.yardstick.compute_time(kind, int(copy), int(stage)) * slow.get(int(dev), 1.0)
            if y > 0:
                ratios.setdefault(int(step), []).append((end - start) / y)
        return {k: float(np.median(v)) for k, v in ratios.items()}

    @property
    def judges_state(self) -> bool:
        """Whether the host state is judged (a yardstick, and the sitting's cut is known)."""
        return self.yardstick is not None and self.cut is not None

    def _after_warmup(self, i: int) -> list[int]:
        """Run ``i``'s step indices after the warm-up (all of them in a run no longer than it)."""
        n = len(self.runs[i].iteration_times)
        return list(range(self.rules.warmup if n > self.rules.warmup else 0, n))

    def in_state(self, i: int) -> list[int]:
        """Run ``i``'s steps in the sitting's fast state (every step after the warm-up when the state is not judged)."""
        if not self.judges_state:
            return self._after_warmup(i)
        return sorted(k for k, v in self.speeds(i).items() if v <= self.cut)

    def _state_runs(self, idx: list[int]) -> list[int]:
        return [i for i in idx if len(self.in_state(i)) >= self.rules.state_steps]

    def _state_times(self, idx) -> list[float]:
        return [self.runs[i].iteration_times[k] for i in idx for k in self.in_state(i)]

    def _run_time(self, i: int) -> float:
        """Run ``i``'s own step time: the median of its fast-state steps where the state is judged
        and it has some, else its noise-free time."""
        if self.judges_state:
            mine = self._state_times([i])
            if mine:
                return float(np.median(mine))
        return noise_free(self._steps(i))

    @property
    def run_times(self) -> list[float]:
        """Every run's own noise-free step time."""
        return [self._run_time(i) for i in range(len(self.runs))]

    @property
    def settled(self) -> bool:
        return bool(self.kept) and self.problem is None

    def _time_of(self, idx: list[int]) -> float:
        """The step time of runs ``idx``: the median of their fast-state steps where the state is
        judged (and they have some), else the median of their own noise-free times."""
        if self.judges_state:
            pooled = self._state_times(idx)
            if pooled:
                return float(np.median(pooled))
        return float(np.median([self._run_time(i) for i in idx]))

    @property
    def spread(self) -> float | None:
        """Run-to-run spread: the step time with each counting run left out in turn, largest /
        smallest - 1 (None with fewer than 2 runs; where the state is judged, of the runs with
        fast-state steps)."""
        idx = self._counting()
        if self.judges_state:
            idx = self._state_runs(idx) or idx
        if len(idx) < 2:
            return None
        loo = [self._time_of([j for j in idx if j != i]) for i in idx]
        return max(loo) / min(loo) - 1.0

    def settle(self) -> "RunSeries":
        """Decide which runs count (see the module docstring); sets ``kept``, ``problem`` and
        ``brief`` (the problem in a few words)."""
        r, n = self.rules, len(self.runs)
        self.kept, self.problem, self.brief, self.cause = [], None, None, None
        quiet = self.quiet()
        if len(quiet) < r.runs:
            self.cause = HOST_BUSY if len(quiet) < n else NOISY_RUNS   # too few runs at all: not the host's fault
            loads = [self.foreign(i) for i in range(n) if i not in quiet]
            self.problem = (f"{len(quiet)} of {n} runs quiet, {r.runs} needed: other processes kept "
                            f"{_span(loads, '{:.2f}')} cores busy in {n - len(quiet)} (at most {r.max_foreign:g})"
                            if loads else f"{n} runs, {r.runs} needed")
            self.brief = f"{len(quiet)}/{n} runs quiet"
            return self
        if self.judges_state:
            fast = self._state_runs(quiet)
            if len(fast) < r.runs:
                self.problem = (f"{len(fast)} of {len(quiet)} quiet runs had {r.state_steps}+ steps in the sitting's "
                                f"fast state (ops at <= {self.cut:.2f}x their alone time), {r.runs} needed: the host "
                                f"ran slow{self._quiet_host(quiet, NOT_THEIR_LOAD)}")
                self.brief, self.cause = f"{len(fast)}/{len(quiet)} runs fast", NOISY_RUNS
                return self
            quiet = fast
        self.kept = quiet
        spread = self.spread
        if spread is not None and spread > r.max_spread:
            self.problem = (f"run-to-run spread {spread:.0%} (the step time with any one of {len(quiet)} quiet runs "
                            f"left out; at most {r.max_spread:.0%} allowed){self._quiet_host(quiet, OWN_NOISE)}")
            self.brief, self.cause = f"spread {spread:.0%}", NOISY_RUNS
            self.kept = []
        return self

    def _quiet_host(self, idx: list[int], why: str) -> str:
        """What other processes used in runs ``idx`` (all below ``max_foreign``: quiet), as the tail
        of a problem that is not theirs (``why``: whose it is)."""
        loads = [x for x in (self.foreign(i) for i in idx) if x is not None]
        return f", other processes at {_span(loads, '{:.2f}')} cores ({why})" if loads else ""

    def _pool(self) -> list[tuple[float, int, int]]:
        """(time, run, step) of the counting runs' steps after the warm-up (in the fast state, where
        it is judged and they have some)."""
        idx = self._counting()
        out = [(self.runs[i].iteration_times[k], i, k) for i in idx for k in self.in_state(i)]
        return out or [(self.runs[i].iteration_times[k], i, k) for i in idx for k in self._after_warmup(i)]

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
        """The steps a fit should reproduce: where the host state is judged, the counting runs'
        fast-state steps around their median (the middle half of them); else, of the counting runs
        in the middle of their times (the middle half, at least the median one), the fast steps
        around their median (the middle half of them)."""
        if self.judges_state:
            pool = sorted(self._pool())
            n = len(pool)
            return [(self.runs[i], s) for _, i, s in pool[n // 4: max(n // 4 + 1, n - n // 4)]]
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

    def state_share(self) -> tuple[int, int]:
        """(fast-state steps of the counting runs, steps after the warm-up of the quiet runs)."""
        return (sum(len(self.in_state(i)) for i in self._counting()),
                sum(len(self._steps(i)) for i in self.quiet()))


def fast_state_cut(series: Sequence[RunSeries], rules: SittingRules) -> float | None:
    """The sitting's fast state, shared by every config with a yardstick: step speeds up to
    (1 + ``rules.state_band``) x the :data:`STATE_QUANTILE` of the speeds of all their quiet runs'
    steps (None: no such config or no traced step yet). Sets each such series' ``cut``."""
    pool = [v for s in series if s.yardstick is not None for i in s.quiet() for v in s.speeds(i).values()]
    cut = float(np.quantile(pool, STATE_QUANTILE)) * (1.0 + rules.state_band) if pool else None
    for s in series:
        if s.yardstick is not None:
            s.cut = cut
    return cut


def _span(values: list[float], fmt: str, sep: str = "-") -> str:
    lo, hi = fmt.format(min(values)), fmt.format(max(values))
    return lo if lo == hi else f"{lo}{sep}{hi}"


def run_series(configs: Sequence[RunConfig], rules: SittingRules = SittingRules(), *,
               progress: Callable[[str], None] | None = None,
               yardstick: Callable[[RunConfig], object | None] | None = None) -> list[RunSeries]:
    """Run ``configs`` in rounds until each is settled or ``rules.max_runs`` rounds are done
    (module docstring). Each round is one launch per world size (D x R), so configs of several
    world sizes (a calibration's runs beside a validation's) meet the same host states.
    ``yardstick(config)``: the config's compute op costs alone (``StageCosts``; None: its host
    state is not judged), for one host state across the configs (:func:`fast_state_cut`)."""
    report = progress or (lambda msg: None)
    series = [RunSeries(config=c, rules=rules, yardstick=yardstick(c) if yardstick else None) for c in configs]
    for rnd in range(rules.max_runs):
        todo = [s for s in series if len(s.runs) < rules.runs or not s.settled]
        if not todo:
            break
        k = rnd % len(todo)
        order = todo[k:] + todo[:k]
        t0 = time.perf_counter()
        for world in sorted({s.config.layout.devices * s.config.layout.replicas for s in order}):
            group = [s for s in order if s.config.layout.devices * s.config.layout.replicas == world]
            for s, res in zip(group, launch.run_many([s.config for s in group])):
                s.runs.append(res)
        cut = fast_state_cut(series, rules)
        for s in series:    # all of them: the sitting's fast state moves with every round
            if len(s.runs) >= rules.runs:
                s.settle()
        loads = [x for x in (s.foreign(len(s.runs) - 1) for s in order) if x is not None]
        unsettled = [s for s in series if len(s.runs) >= rules.runs and not s.settled]
        report(f"round {rnd + 1}: {len(order)} run(s) in {time.perf_counter() - t0:.1f} s"
               + (f", other processes {_span(loads, '{:.2f}')} cores" if loads else "")
               + (f", fast state: ops at <= {cut:.2f}x their alone time" if cut is not None else "")
               + ("; not settled: " + ", ".join(f"{s.config.layout.schedule} ({s.brief})" for s in unsettled)
                  if unsettled else ""))
    return series



def sitting_record(series: list[RunSeries]) -> dict:
    """How a sitting's traced runs went, for the profile's meta: the largest spread of the kept
    runs, the most CPU other processes took in any run, runs per config, and every unsettled
    config's problem."""
    spreads = [x.spread for x in series if x.spread is not None]
    loads = [f for x in series for f in (x.foreign(i) for i in range(len(x.runs))) if f is not None]
    cuts = [x.cut for x in series if x.judges_state]
    return {"spread_max": max(spreads) if spreads else None, "foreign_cores_max": max(loads) if loads else None,
            "fast_state_cut": cuts[0] if cuts else None,
            "runs": {x.config.layout.schedule: len(x.runs) for x in series},
            "problems": [f"{x.config.layout.schedule}: {x.problem}" for x in series if x.problem]}


def sitting_problems(profile: CalibrationProfile) -> list[str]:
    """Why the profile's calibration sitting is unusable (empty: it is usable)."""
    return [f"D={d}: {p}" for d, rec in sorted((profile.meta.get("sitting") or {}).items())
            for p in rec.get("problems", [])]
