"""Measuring on a shared host: the noise-free statistic, interference detection, repeat or refuse."""
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest

from executor.config import RunConfig
from executor.host import CpuWindow, foreign_cores, host_busy_seconds, own_cpu_seconds
from calibration.sitting import RunSeries, SittingRules, run_series
from schedules.trace import fast_steps, noise_free


def _run(times, foreign=0.0, probe=None, schedule="dapple"):
    extra = {"foreign_cores": foreign}
    if probe is not None:
        extra["probe_seconds"] = probe
    return SimpleNamespace(config=RunConfig.of(schedule=schedule), iteration_times=list(times), extra=extra, trace=None)


def _times(base, n=12, seed=0, warm=(3.0, 2.0)):
    """Warm-up steps, then ``base`` plus positive noise (interference only adds time)."""
    g = np.random.default_rng(seed)
    return [base * w for w in warm] + list(base * (1 + g.exponential(0.05, n - len(warm))))


def test_noise_free_is_the_median_of_the_fast_steps_whatever_the_share_of_slow_ones():
    fast = [10.0, 10.4, 10.8, 11.2, 11.6, 12.3]      # within 30% of the floor (the lower quartile, 10.6): not 14.0
    assert fast_steps(fast + [14.0]) == [0, 1, 2, 3, 4, 5] and noise_free(fast + [14.0]) == pytest.approx(11.0)
    # a host slowed 1.6x for spells: the answer does not move while the fast steps are >= 25%
    for slow in (0, 10, 60):
        assert noise_free(fast[:5] * 12 + [16.0 + 0.1 * k for k in range(slow)]) == pytest.approx(10.8)
    # ... where the median of all steps would (the slow ones are half of them)
    assert np.median(fast[:5] * 12 + [16.0] * 60) == pytest.approx(13.8)
    # a few lucky steps (a short fast spell in one run) do not set it, as a 5th-percentile floor would
    lucky = fast[:5] * 4 + [16.0] * 6 + [7.0] * 3
    assert noise_free(lucky) == pytest.approx(10.8)
    cut = np.quantile(lucky, 0.05) * 1.3
    assert np.median([t for t in lucky if t <= cut]) == pytest.approx(7.0)


def test_series_takes_the_median_of_the_quiet_runs_and_measures_the_run_to_run_spread():
    rules = SittingRules(runs=3, max_spread=0.05, max_foreign=0.15)
    runs = [_run(_times(10.0, seed=1)), _run(_times(10.2, seed=2)), _run(_times(16.0, seed=3)),   # slow spell
            _run(_times(8.0, seed=4), foreign=0.9),                                             # busy: no count
            _run(_times(10.1, seed=5))]
    s = RunSeries(config=runs[0].config, runs=runs, rules=rules).settle()
    assert s.settled and s.kept == [0, 1, 2, 4] and s.problem is None
    own = {i: noise_free(runs[i].iteration_times[2:]) for i in (0, 1, 2, 4)}
    assert s.run_times[2] == pytest.approx(own[2]) and own[2] > 15.0
    # the median of the four runs' own times: the slow run does not pull it (a mean would: +13%)
    assert s.step_time == pytest.approx(np.median(list(own.values()))) and 10.0 <= s.step_time <= 10.2 * 1.1
    loo = [np.median([own[i] for i in own if i != j]) for j in own]
    assert s.spread == pytest.approx(max(loo) / min(loo) - 1) and s.spread < 0.05
    pool = [t for i in (0, 1, 2, 4) for t in runs[i].iteration_times[2:]]
    res, step = s.representative()
    assert step >= 2 and res.iteration_times[step] == min(pool, key=lambda t: abs(t - s.step_time))
    # the fit's steps: the fast steps (middle half) of the runs in the middle of the times (not the slow one)
    middle = sorted(own, key=own.get)[1:3]
    assert 2 not in middle
    typical = sorted(r.iteration_times[k] for r, k in s.typical_steps())
    mid_pool = [t for i in middle for t in runs[i].iteration_times[2:]]
    fast = sorted(mid_pool[k] for k in fast_steps(mid_pool))
    assert typical == fast[len(fast) // 4: len(fast) - len(fast) // 4]
    assert {id(r) for r, _ in s.typical_steps()} == {id(runs[i]) for i in middle}


def test_series_refuses_a_spread_or_a_busy_host_with_the_figures():
    rules = SittingRules(runs=3, max_spread=0.05, max_foreign=0.15)
    # three runs at 10, 12 and 14.7: leaving out the fast one moves the median of the other two to
    # 13.35, the slow one to 11: 13.35 / 11 - 1 = 21%
    spread = RunSeries(config=RunConfig.of(), rules=rules,
                       runs=[_run([1, 1] + [10.0] * 8), _run([1, 1] + [12.0] * 8), _run([1, 1] + [14.7] * 8)]).settle()
    assert not spread.settled and spread.kept == [] and spread.spread == pytest.approx(13.35 / 11.0 - 1)
    assert spread.problem == ("run-to-run spread 21% (the step time with any one of 3 quiet runs left out; at most 5% "
                              "allowed), other processes at 0.00 cores (the runs' own noise)")
    assert spread.brief == "spread 21%" and spread.cause == "noisy runs"
    busy = RunSeries(config=RunConfig.of(), rules=rules,
                     runs=[_run([1, 1] + [10.0] * 8, foreign=f) for f in (0.05, 0.9, 1.3)]).settle()
    assert busy.problem == "1 of 3 runs quiet, 3 needed: other processes kept 0.90-1.30 cores busy in 2 (at most 0.15)"
    assert busy.brief == "1/3 runs quiet"


def test_host_busy_is_other_processes_cpu_measured_and_a_quiet_hosts_spread_is_the_runs_own_noise():
    """The default rules: a run counts with up to 0.5 cores of other processes' CPU (BUSY_CORES); a
    small model's runs that saw 0.00-0.41 cores and agree are settled (0.15 refused them); those
    that disagree are "noisy runs", never "host busy"; 0.6 and 1.3 cores in two of three runs is."""
    from calibration import BUSY_CORES, HOST_BUSY, NOISY_RUNS
    rules = SittingRules(runs=3)
    assert rules.max_foreign == BUSY_CORES == 0.5
    agree = RunSeries(config=RunConfig.of(), rules=rules,
                      runs=[_run([1, 1] + [10.0] * 8, foreign=f) for f in (0.0, 0.41, 0.2)]).settle()
    assert agree.settled and agree.kept == [0, 1, 2] and agree.cause is None and agree.step_time == 10.0
    noisy = RunSeries(config=RunConfig.of(), rules=rules,
                      runs=[_run([1, 1] + [t] * 8, foreign=f) for t, f in ((10.0, 0.0), (12.0, 0.41), (14.7, 0.2))])
    noisy.settle()
    assert not noisy.settled and noisy.cause == NOISY_RUNS and noisy.spread == pytest.approx(13.35 / 11.0 - 1)
    assert noisy.problem == ("run-to-run spread 21% (the step time with any one of 3 quiet runs left out; at most 5% "
                             "allowed), other processes at 0.00-0.41 cores (the runs' own noise)")
    busy = RunSeries(config=RunConfig.of(), rules=rules,
                     runs=[_run([1, 1] + [10.0] * 8, foreign=f) for f in (0.41, 0.6, 1.3)]).settle()
    assert busy.cause == HOST_BUSY and busy.problem == ("1 of 3 runs quiet, 3 needed: other processes kept 0.60-1.30 "
                                                        "cores busy in 2 (at most 0.5)")


def test_validate_advice_follows_the_cause_with_the_options_as_given():
    """One remedy per cause, in the order the causes first appear; each names the options that act
    on its cause with the values given (two settings: no value is written into the text); the
    remedies of an unsettled profile and of a host at another speed name none of validate's run
    options (they do not help) and send the user to calibrate again."""
    import re
    from argparse import Namespace

    from calibration import Refusal
    from experiments.cmd_validate import advice
    reasons = [Refusal("noisy runs", "gpipe: spread"), Refusal("host busy", "dapple: 1 of 3"),
               Refusal("noisy runs", "zb-v: spread")]
    runs_options = {"--steps", "--max-runs", "--max-spread", "--max-foreign"}
    for steps, max_runs, spread, foreign in ((20, 12, 0.05, 0.5), (7, 3, 0.2, 1.5)):
        args = Namespace(steps=steps, max_runs=max_runs, max_spread=spread, max_foreign=foreign)
        noisy, busy = advice(reasons, args)
        assert set(re.findall(r"--[a-z-]+", noisy)) == {"--steps", "--max-runs", "--max-spread"}
        assert f"--steps, now {steps})" in noisy and f"--max-runs, now {max_runs})" in noisy
        assert f"--max-spread (now {spread:g})" in noisy
        assert set(re.findall(r"--[a-z-]+", busy)) == {"--max-foreign"} and f"--max-foreign {foreign:g} " in busy
        later = advice([Refusal("unsettled profile", "D=2: x"), Refusal("host speed", "0.80"),
                        Refusal("unsettled profile", "D=4: y")], args)
        assert len(later) == 2 and all("calibrate again" in a for a in later)
        assert not runs_options & {w for a in later for w in re.findall(r"--[a-z-]+", a)}


def test_probe_of_a_series_pools_its_runs_samples():
    runs = [_run([1, 1, 5], probe=9.0), _run([1, 1, 5], probe=9.0)]
    runs[0].extra["probe_samples"] = [1.0, 1.1, 1.6, 1.7]
    runs[1].extra["probe_samples"] = [1.05, 1.65, 1.6]
    s = RunSeries(config=RunConfig.of(), runs=runs, rules=SittingRules(runs=2)).settle()
    assert s.probe_seconds == pytest.approx(noise_free([1.0, 1.1, 1.6, 1.7, 1.05, 1.65, 1.6])) == pytest.approx(1.05)


def test_run_series_repeats_unsettled_configs_and_rotates_the_order(monkeypatch):
    """Scripted runs: dapple's third run lands in a slow host state (14 against 10), which leaves
    its time hanging on one run (the median of the other two: 10 or 12, spread 20%); a fourth run
    at 10 settles it at 10; gpipe's runs alternate between two states and never agree (after five:
    14 / 12 - 1 = 17%), so it is given up after max_runs rounds;
    zb-v settles at once; every round starts with another config."""
    import executor.launch as launch
    script = {"dapple": iter([10.0, 10.0, 14.0, 10.0]), "gpipe": iter([10.0, 14.0, 10.0, 14.0, 14.0]),
              "zb-v": iter([10.0, 10.0, 10.0])}
    rounds = []

    def fake_run_many(cfgs):
        rounds.append([c.layout.schedule for c in cfgs])
        return [_run([1.0, 1.0] + [next(script[c.layout.schedule])] * 5, schedule=c.layout.schedule) for c in cfgs]

    monkeypatch.setattr(launch, "run_many", fake_run_many)
    msgs = []
    cfgs = [RunConfig.of(schedule=s) for s in ("dapple", "gpipe", "zb-v")]
    out = run_series(cfgs, SittingRules(runs=3, max_runs=5), progress=msgs.append)
    assert rounds == [["dapple", "gpipe", "zb-v"], ["gpipe", "zb-v", "dapple"], ["zb-v", "dapple", "gpipe"],
                      ["gpipe", "dapple"], ["gpipe"]]
    d, g, z = out
    assert d.settled and d.kept == [0, 1, 2, 3] and d.step_time == 10.0 and z.settled and len(z.runs) == 3
    assert not g.settled and len(g.runs) == 5 and g.problem.startswith("run-to-run spread 17%")
    assert len(msgs) == 5 and msgs[2].startswith("round 3: 3 run(s)")
    assert msgs[2].endswith("; not settled: dapple (spread 20%), gpipe (spread 20%)")


def test_run_series_runs_each_world_size_in_every_round(monkeypatch):
    import executor.launch as launch
    worlds = []

    def fake_run_many(cfgs):
        worlds.append(sorted({c.layout.devices for c in cfgs}))
        return [_run([1.0, 1.0, 5.0, 5.0], schedule=c.layout.schedule) for c in cfgs]

    monkeypatch.setattr(launch, "run_many", fake_run_many)
    cfgs = [RunConfig.of(schedule="dapple", devices=2), RunConfig.of(schedule="dapple", devices=4, microbatches=8)]
    run_series(cfgs, SittingRules(runs=2, max_runs=2))
    assert worlds == [[2], [4], [2], [4]]


def test_foreign_cores_subtracts_the_ranks_own_cpu():
    w = [CpuWindow(host="a", wall=2.0, host_busy=3.0, own=1.0), CpuWindow(host="a", wall=2.0, host_busy=3.1, own=0.9)]
    assert foreign_cores(w) == pytest.approx((3.1 - 1.9) / 2.0)   # median busy reading (upper) minus both ranks
    two_hosts = w + [CpuWindow(host="b", wall=1.0, host_busy=1.0, own=0.2)]
    assert foreign_cores(two_hosts) == pytest.approx(0.8)          # the most loaded host
    assert foreign_cores([CpuWindow(host="a", wall=1.0, host_busy=None, own=0.5)]) is None


@pytest.mark.slow
@pytest.mark.skipif(host_busy_seconds() is None, reason="no /proc/stat")
def test_host_counters_see_this_process_and_a_busy_child():
    # this process spins 0.3 s of CPU: the host's busy time grows by at least that much
    b0, o0 = host_busy_seconds(), own_cpu_seconds()
    while own_cpu_seconds() - o0 < 0.3:
        pass
    assert host_busy_seconds() - b0 >= 0.3 - 0.05   # tick rounding
    # a child spinning for 1.5 s is another process: at least most of one core's worth of foreign CPU
    from executor.host import CpuMeter
    child = subprocess.Popen([sys.executable, "-c", "import time\nt=time.time()\nwhile time.time()-t<1.5: pass"])
    meter = CpuMeter()
    time.sleep(1.0)
    win = meter.stop()
    child.wait()
    assert foreign_cores([win]) >= 0.5 * min(1.0, 2.0 / max(1.0, os.getloadavg()[0]))


@pytest.mark.slow
def test_pin_to_core_pins_every_thread_and_declines_without_a_core_per_rank():
    code = """
import os, threading
from executor.host import pin_to_core
cores = sorted(os.sched_getaffinity(0))
assert pin_to_core(0, len(cores) + 1) is None and sorted(os.sched_getaffinity(0)) == cores
core = pin_to_core(len(cores) - 1, len(cores))
assert core == cores[-1], core
seen = []
t = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
t.start(); t.join()
tasks = [int(x) for x in os.listdir('/proc/self/task')]
assert seen == [{core}] and all(os.sched_getaffinity(x) == {core} for x in tasks), seen
print('ok')
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=os.getcwd())
    assert out.stdout.strip() == "ok", out.stderr


@pytest.mark.slow
def test_a_probed_pinned_run_reports_its_host():
    """Two jobs on one launch of 2 pinned ranks: probed 2 times before and 2 after its steps, the
    run reports each rank's 4 probe samples (8), their noise-free time, the other processes' cores
    and each rank's CPU seconds; without a probe, none of that."""
    from executor.launch import run_many
    base = RunConfig.of(schedule="dapple", devices=2, microbatches=2, steps=2, model="tiny", pin_cores=True)
    res, plain = run_many([base.with_(probe=2), base.with_(steps=1)])
    samples = res.extra["probe_samples"]
    assert len(samples) == 2 * (2 + 2) and res.extra["probe_seconds"] == noise_free(samples)
    assert res.extra["foreign_cores"] >= 0.0 and len(res.extra["rank_cpu_seconds"]) == 2
    assert res.extra["pinned"] is plain.extra["pinned"] is (len(os.sched_getaffinity(0)) >= 2)
    assert not {"probe_seconds", "probe_samples", "foreign_cores", "rank_cpu_seconds"} & set(plain.extra)


def _profile(meta):
    from dataclasses import replace

    from cost_models import CalibrationProfile
    from cost_models.profile import LayerTiming
    from cost_models.cluster import LinkSpec
    from cost_models.model_spec import load_model
    spec = load_model("tiny")
    prof = CalibrationProfile("toy", spec, (LayerTiming(1e-4, 0.0, 1.5e-4, 1.5e-4),) * (spec.layers + 2),
                              LinkSpec("p2p", 4e9, 8e-5), LinkSpec("ar", 1e9, 3e-4), optimizer_seconds_per_param=5e-9,
                              cores=2, data_time=3e-4, grad_copy_per_byte=2e-10)
    return replace(prof, meta=meta)


def test_refusals_name_calibration_unsettled_runs_and_probe_drift():
    from calibration import Comparison, Refusal, refusals

    def comp(name, problem=None, probe=1.0):
        return Comparison(schedule=name, devices=2, microbatches=4, replicas=1, measured_iteration_time=1.0,
                          simulated_iteration_time=1.0, measured_iteration_times=[1.0],
                          measured_peak_activation_bytes=[1.0], simulated_peak_activation_bytes=[1.0],
                          measured_bubble=[0.1], simulated_bubble=[0.1], order_identical=True, problem=problem,
                          measured_probe=probe, profile_probe=1.0)
    quiet = _profile({"sitting": {"2": {"problems": []}}, "probe_seconds": {"2": 1.0}})
    assert refusals([comp("dapple"), comp("gpipe", probe=1.04)], quiet) == []
    assert refusals([comp("dapple"), comp("gpipe", problem="run-to-run spread 47% (...)")], quiet) == \
        [Refusal("noisy runs", "gpipe: run-to-run spread 47% (...)")]
    slow = [comp("dapple", probe=1.25), comp("gpipe", probe=1.3), comp("zb-v", probe=1.0)]
    assert refusals(slow, quiet) == \
        [Refusal("host speed", "0.80 of calibration's (block probe, median over the schedules; at most 5% off "
                               "allowed)")]
    assert refusals(slow, quiet, max_drift=None) == []   # calibrated in the same sitting
    busy = _profile({"sitting": {"2": {"problems": ["zb-v: run-to-run spread 31% (...)"]}}})
    assert refusals([comp("dapple")], busy) == [Refusal("unsettled profile", "D=2: zb-v: run-to-run spread 31% (...)")]
    # a run shared by calibration and validation is named once
    assert refusals([comp("zb-v", problem="run-to-run spread 31% (...)")], busy) == \
        [Refusal("noisy runs", "zb-v: run-to-run spread 31% (...)")]


def test_validate_refuses_a_profile_calibrated_on_a_busy_host(capsys, tmp_path, no_ranks):
    """No runs (no_ranks), no error figure: one line saying why, exit status 3."""
    from cost_models import save_profile
    from experiments.cli import main
    path = tmp_path / "busy.yaml"
    save_profile(_profile({"sitting": {"2": {"problems": ["dapple: other processes kept 0.90-1.10 cores busy"]}}}),
                 path)
    assert main(["validate", "--profile", str(path), "--plot", str(tmp_path / "v.png")]) == 3
    assert not (tmp_path / "v.png").exists()
    out = capsys.readouterr().out
    assert out.splitlines()[:3] == [
        "refused: unsettled profile: D=2: dapple: other processes kept 0.90-1.10 cores busy",
        "no time or error figure from this sitting; to settle it:",
        "- the profile's own calibration runs did not settle, which no option of validate changes: calibrate again "
        "when the host is quiet (pipetwin calibrate --out FILE), or drop --profile to calibrate in this sitting"]
    assert "--max-runs" not in out
    assert "error" not in out.replace("no time or error figure", "") and "%" not in out



class _Yard:
    """A yardstick: F costs 1 ms and B 2 ms alone on every stage; W nothing (not judged)."""

    def compute_time(self, kind, copy, stage):
        return {"F": 1e-3, "B": 2e-3, "W": 0.0}[kind]


def _traced_run(speeds, times, schedule="dapple", foreign=0.0):
    """A run whose step k has iteration time ``times[k]`` and two ranks' F, B, W ops taking
    ``speeds[k]`` x their yardstick time (W 0.1 ms whatever the speed: not judged); step 0 and 1
    the warm-up."""
    import pandas as pd
    rows = []
    for k, h in enumerate(speeds):
        for dev in (0, 1):
            clock = 0.0
            for kind, d in (("F", 1e-3 * h), ("B", 2e-3 * h), ("W", 1e-4)):
                rows.append({"device": dev, "step": k, "kind": kind, "copy": 0, "stage": dev, "start": clock,
                             "end": clock + d})
                clock += d
    return SimpleNamespace(config=RunConfig.of(schedule=schedule), iteration_times=list(times),
                           extra={"foreign_cores": foreign}, trace=pd.DataFrame(rows))


def test_one_host_state_for_every_config_from_the_ops_speed():
    """A step's speed is its ops' time over their yardstick time (the median over the step's F and B
    of both ranks; W has no yardstick time and does not count). The sitting's fast state is shared:
    up to 1.15 x the 20th percentile of all configs' step speeds. dapple's runs hold both host
    states; gpipe's runs ran slow (1.5x) but for a few steps: its time comes from those steps, not
    from its slow ones, which the noise-free time of its runs would have taken."""
    from calibration.sitting import fast_state_cut
    rules = SittingRules(runs=3, max_spread=0.05, state_band=0.15, state_steps=3)
    fast, slow = 1.0, 1.5
    d_runs = [_traced_run([fast] * 2 + [fast] * 9 + [slow] * 9, [30e-3] * 2 + [10e-3 + 1e-4 * j for j in range(9)]
                          + [15e-3] * 9) for _ in range(3)]
    g_runs = [_traced_run([fast] * 2 + [fast] * 4 + [slow] * 14, [30e-3] * 2 + [11e-3 + 1e-4 * j for j in range(4)]
                          + [16e-3 + 1e-5 * j for j in range(14)], schedule="gpipe") for _ in range(3)]
    d = RunSeries(config=d_runs[0].config, runs=d_runs, rules=rules, yardstick=_Yard())
    g = RunSeries(config=g_runs[0].config, runs=g_runs, rules=rules, yardstick=_Yard())
    assert d.speeds(0) == {k: pytest.approx(fast if k < 11 else slow) for k in range(2, 20)}
    # of the 2 x 3 x 18 step speeds, 27 + 12 are fast: the 20th percentile is 1.0, the cut 1.15
    assert fast_state_cut([d, g], rules) == pytest.approx(1.15) and d.cut == g.cut == pytest.approx(1.15)
    for s in (d, g):
        s.settle()
    assert d.settled and d.in_state(0) == list(range(2, 11)) and d.step_time == pytest.approx(10.4e-3)
    assert g.settled and g.in_state(1) == [2, 3, 4, 5] and g.step_time == pytest.approx(11.15e-3)
    assert noise_free(g._steps(0)) > 16e-3     # the per-run statistic would report the slow state
    assert g.state_share() == (12, 54) and g.spread == pytest.approx(0.0)
    assert sorted(r.iteration_times[k] for r, k in g.typical_steps()) == pytest.approx([11.1e-3] * 3 + [11.2e-3] * 3)
    res, step = g.representative()
    assert step in (2, 3, 4, 5)
    # a config that never met the fast state is not settled, and says so
    late = RunSeries(config=RunConfig.of(schedule="zb-v"), rules=rules, yardstick=_Yard(),
                     runs=[_traced_run([slow] * 20, [15e-3] * 20, schedule="zb-v") for _ in range(3)])
    fast_state_cut([d, g, late], rules)
    assert not late.settle().settled and late.brief == "0/3 runs fast"
    assert late.problem == ("0 of 3 quiet runs had 3+ steps in the sitting's fast state (ops at <= 1.15x their "
                            "alone time), 3 needed: the host ran slow, other processes at 0.00 cores (not their "
                            "load)") and late.cause == "noisy runs"
    # without a yardstick the host state is not judged: the per-run noise-free time as before
    plain = RunSeries(config=g_runs[0].config, runs=g_runs, rules=rules).settle()
    assert not plain.judges_state and plain.step_time == pytest.approx(np.median([noise_free(r.iteration_times[2:])
                                                                                   for r in g_runs]))


def test_run_series_shares_the_fast_state_and_waits_for_a_config_to_meet_it(monkeypatch):
    """dapple runs fast from the first round; gpipe's first three runs are slow throughout, so it
    is not settled (and runs again) until three of its runs had fast steps; its time is theirs."""
    import executor.launch as launch
    calls = {"dapple": 0, "gpipe": 0}

    def fake_run_many(cfgs):
        out = []
        for c in cfgs:
            calls[c.layout.schedule] += 1
            h = 1.0 if c.layout.schedule == "dapple" or calls["gpipe"] > 3 else 1.6
            out.append(_traced_run([h] * 12, [10e-3 * h] * 12, schedule=c.layout.schedule))
        return out

    monkeypatch.setattr(launch, "run_many", fake_run_many)
    msgs = []
    d, g = run_series([RunConfig.of(schedule="dapple"), RunConfig.of(schedule="gpipe")],
                      SittingRules(runs=3, max_runs=8),
                      progress=msgs.append, yardstick=lambda cfg: _Yard())
    assert len(d.runs) == 3 and d.settled and d.step_time == pytest.approx(10e-3)
    assert len(g.runs) == 6 and g.settled and g.kept == [3, 4, 5] and g.step_time == pytest.approx(10e-3)
    assert msgs[0].endswith(", fast state: ops at <= 1.15x their alone time")
    assert "gpipe (0/3 runs fast)" in msgs[2] and "not settled" not in msgs[5]


def test_speed_yardstick_is_the_alone_cost_of_each_op_and_skips_oversubscribed_configs():
    """The profile's layer times over the scale its runtime fit applied, summed over each stage's
    layers (the run's own split; the first and the last stage's F also draw the micro-batch's
    inputs and targets: the profile's data time, 0.3 ms), no per-op overhead; none for more ranks
    than cores."""
    from dataclasses import replace

    from calibration import speed_yardstick
    from cost_models.profile import LayerTiming
    base = _profile({})
    n = len(base.layers)
    layers = tuple(LayerTiming(1e-4 * (i + 1), 3e-4 * (i + 1), 5e-5, 4e-4 * (i + 1)) for i in range(n))
    prof = replace(base, layers=layers, overhead=(("F", 1e-3), ("B", 1e-3)),
                   meta={"runtime_scale": {"F": 2.0, "B": 4.0, "Bi": 3.0, "W": 0.5}})
    yard = speed_yardstick(prof)
    d = yard(RunConfig.of(schedule="dapple", devices=2, microbatches=4, model="tiny"))
    # tiny: embedding + 8 blocks + head; dapple's even split: embedding + 4 blocks | 4 blocks + head
    assert d.compute_time("F", 0, 0) == pytest.approx(sum(1e-4 * (i + 1) for i in range(5)) / 2.0 + 3e-4)
    assert d.compute_time("F", 0, 1) == pytest.approx(sum(1e-4 * (i + 1) for i in range(5, 10)) / 2.0 + 3e-4)
    assert d.compute_time("B", 0, 1) == pytest.approx(sum(4e-4 * (i + 1) for i in range(5, 10)) / 4.0)
    split = yard(RunConfig.of(schedule="dapple", devices=2, microbatches=4, model="tiny",
                               partition=(4, 6)))      # layers: embedding + 3 blocks | 5 blocks + head
    assert split.compute_time("F", 0, 0) == pytest.approx(sum(1e-4 * (i + 1) for i in range(4)) / 2.0 + 3e-4)
    zb = yard(RunConfig.of(schedule="zb-h1", devices=2, microbatches=4, model="tiny"))
    assert zb.compute_time("B", 0, 1) == pytest.approx(sum(3e-4 * (i + 1) for i in range(5, 10)) / 3.0)
    assert zb.compute_time("W", 0, 1) == pytest.approx(5 * 5e-5 / 0.5)
    assert yard(RunConfig.of(schedule="dapple", devices=4, microbatches=8, model="tiny")) is None   # 4 ranks, 2 cores
