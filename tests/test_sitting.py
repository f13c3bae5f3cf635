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
from executor.sitting import RunSeries, SittingRules, run_series
from schedules.trace import quantile_step


def _run(times, foreign=0.0, probe=None, schedule="dapple"):
    extra = {"foreign_cores": foreign}
    if probe is not None:
        extra["probe_seconds"] = probe
    return SimpleNamespace(config=RunConfig(schedule=schedule), iteration_times=list(times), extra=extra, trace=None)


def _times(base, n=12, seed=0, warm=(3.0, 2.0)):
    """Warm-up steps, then ``base`` plus positive noise (interference only adds time)."""
    g = np.random.default_rng(seed)
    return [base * w for w in warm] + list(base * (1 + g.exponential(0.05, n - len(warm))))


def test_quantile_step_is_the_low_quantile_after_warmup():
    times = [9.0, 8.0] + [float(x) for x in range(1, 11)]   # steps 2..11 hold 1..10
    val, step = quantile_step(times, 2, 0.2)
    assert val == pytest.approx(np.quantile(range(1, 11), 0.2)) == pytest.approx(2.8)
    assert step == 4   # the step holding 3.0, the closest to 2.8


def test_series_keeps_the_fastest_agreeing_quiet_runs():
    rules = SittingRules(runs=3, max_spread=0.05, max_foreign=0.15)
    runs = [_run(_times(10.0, seed=1)), _run(_times(10.2, seed=2)), _run(_times(13.0, seed=3)),   # slow spell
            _run(_times(8.0, seed=4), foreign=0.9),                                             # busy: no count
            _run(_times(10.1, seed=5))]
    s = RunSeries(config=runs[0].config, runs=runs, rules=rules).settle()
    assert s.settled and s.kept == [0, 1, 4]
    assert s.spread == pytest.approx(max(s.run_time(i) for i in (0, 1, 4)) / min(s.run_time(i) for i in (0, 1, 4))
                                     - 1)
    pooled = [t for i in (0, 1, 4) for t in runs[i].iteration_times[2:]]
    assert s.step_time == pytest.approx(np.quantile(pooled, 0.2))
    res, step = s.representative()
    assert res in (runs[0], runs[1], runs[4]) and step >= 2
    assert res.iteration_times[step] == min(pooled, key=lambda t: abs(t - s.step_time))
    typical = s.typical_steps()
    ranked = sorted(pooled)
    lo, hi = int(np.floor(0.1 * (len(ranked) - 1))), int(np.ceil(0.3 * (len(ranked) - 1)))
    assert sorted(r.iteration_times[k] for r, k in typical) == ranked[lo:hi + 1]


def test_series_refuses_a_spread_or_a_busy_host_with_the_figures():
    rules = SittingRules(runs=3, max_spread=0.05, max_foreign=0.15)
    spread = RunSeries(config=RunConfig(), rules=rules,
                       runs=[_run([1, 1] + [10.0] * 8), _run([1, 1] + [12.0] * 8), _run([1, 1] + [14.7] * 8)]).settle()
    assert not spread.settled and spread.kept == []
    assert spread.problem.startswith("run-to-run spread 47% (fastest 3 of 3 quiet runs")
    busy = RunSeries(config=RunConfig(), rules=rules,
                     runs=[_run([1, 1] + [10.0] * 8, foreign=f) for f in (0.05, 0.9, 1.3)]).settle()
    assert busy.problem == "1 of 3 runs quiet, 3 needed: other processes kept 0.90-1.30 cores busy in 2 (at most 0.15)"
    assert busy.brief == "1/3 runs quiet"


def test_a_run_counts_only_at_the_reference_host_speed():
    """The probe tells a slow host (another VM on the machine) that the CPU counters do not see:
    runs whose probe is over 5% off calibration's do not count, however quiet the counters."""
    rules = SittingRules(runs=2, max_drift=0.05)
    runs = [_run([1, 1] + [10.0] * 8, probe=1.02), _run([1, 1] + [14.0] * 8, probe=1.45),
            _run([1, 1] + [10.3] * 8, probe=0.98), _run([1, 1] + [9.0] * 8, probe=0.90)]
    s = RunSeries(config=RunConfig(), rules=rules, reference_probe=1.0, reference_label="calibration's").settle()
    assert s.problem == "0 of 0 runs quiet, 2 needed"
    s.runs = runs
    s.settle()
    assert s.settled and s.kept == [0, 2] and s.spread == pytest.approx(0.03)
    assert s.probe_seconds == pytest.approx(1.0)
    s.runs = runs[1:2] + runs[3:]
    s.settle()
    assert s.problem == ("0 of 2 runs quiet, 2 needed: the host speed probe was -10% to +45% off calibration's "
                         "in 2 (at most 5%)")


def test_run_series_repeats_unsettled_configs_and_rotates_the_order(monkeypatch):
    """Scripted runs: dapple's third run is disturbed, so it needs a fourth; gpipe's runs never
    agree, so it is given up after max_runs rounds; every round starts with another config."""
    import executor.launch as launch
    script = {"dapple": iter([10.0, 10.1, 14.0, 10.2]), "gpipe": iter([10.0, 12.0, 14.0, 16.0, 18.0]),
              "zb-v": iter([10.0, 10.0, 10.0])}
    rounds = []

    def fake_run_many(cfgs):
        rounds.append([c.schedule for c in cfgs])
        return [_run([1.0, 1.0] + [next(script[c.schedule])] * 5, schedule=c.schedule) for c in cfgs]

    monkeypatch.setattr(launch, "run_many", fake_run_many)
    msgs = []
    # without a reference, the runs are held to the sitting's fastest probe (here all alike)
    cfgs = [RunConfig(schedule=s) for s in ("dapple", "gpipe", "zb-v")]
    out = run_series(cfgs, SittingRules(runs=3, max_runs=5), progress=msgs.append)
    assert rounds == [["dapple", "gpipe", "zb-v"], ["gpipe", "zb-v", "dapple"], ["zb-v", "dapple", "gpipe"],
                      ["gpipe", "dapple"], ["gpipe"]]
    d, g, z = out
    assert d.settled and d.kept == [0, 1, 3] and z.settled and len(z.runs) == 3
    assert not g.settled and len(g.runs) == 5 and g.problem.startswith("run-to-run spread 40%")
    assert len(msgs) == 5 and msgs[2].startswith("round 3: 3 run(s)")
    assert msgs[2].endswith("; not settled: dapple (spread 40%), gpipe (spread 40%)")


def test_foreign_cores_subtracts_the_ranks_own_cpu():
    w = [CpuWindow(host="a", wall=2.0, host_busy=3.0, own=1.0), CpuWindow(host="a", wall=2.0, host_busy=3.1, own=0.9)]
    assert foreign_cores(w) == pytest.approx((3.1 - 1.9) / 2.0)   # median busy reading (upper) minus both ranks
    two_hosts = w + [CpuWindow(host="b", wall=1.0, host_busy=1.0, own=0.2)]
    assert foreign_cores(two_hosts) == pytest.approx(0.8)          # the most loaded host
    assert foreign_cores([CpuWindow(host="a", wall=1.0, host_busy=None, own=0.5)]) is None


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


def test_a_probed_pinned_run_reports_its_host():
    from executor.launch import run
    res = run(RunConfig(schedule="dapple", devices=2, microbatches=2, steps=2, model="tiny", probe=2,
                        pin_cores=True))
    assert res.extra["probe_seconds"] > 0 and res.extra["foreign_cores"] >= 0.0
    assert res.extra["pinned"] is (len(os.sched_getaffinity(0)) >= 2)
    assert "foreign_cores" not in run(RunConfig(schedule="dapple", devices=2, microbatches=2, steps=1,
                                                model="tiny")).extra


def _profile(meta):
    from dataclasses import replace

    from cost_models import CalibrationProfile
    from cost_models.calibration import LayerTiming
    from cost_models.cluster import LinkSpec
    from cost_models.model_spec import load_model
    spec = load_model("tiny")
    prof = CalibrationProfile("toy", spec, (LayerTiming(1e-4, 0.0, 1.5e-4, 1.5e-4),) * (spec.layers + 2),
                              LinkSpec("p2p", 4e9, 8e-5), LinkSpec("ar", 1e9, 3e-4), optimizer_seconds_per_param=5e-9,
                              cores=2, data_time=3e-4, grad_copy_per_byte=2e-10)
    return replace(prof, meta=meta)


def test_refusals_name_calibration_unsettled_runs_and_probe_drift():
    from experiments.crossval import Comparison, refusals

    def comp(name, problem=None, probe=1.0):
        return Comparison(schedule=name, devices=2, microbatches=4, replicas=1, measured_iteration_time=1.0,
                          simulated_iteration_time=1.0, measured_iteration_times=[1.0],
                          measured_peak_activation_bytes=[1.0], simulated_peak_activation_bytes=[1.0],
                          measured_bubble=[0.1], simulated_bubble=[0.1], order_identical=True, problem=problem,
                          measured_probe=probe, profile_probe=1.0)
    quiet = _profile({"sitting": {"2": {"problems": []}}, "probe_seconds": {"2": 1.0}})
    assert refusals([comp("dapple"), comp("gpipe", probe=1.04)], quiet) == []
    assert refusals([comp("dapple"), comp("gpipe", problem="run-to-run spread 47% (...)")], quiet) == \
        ["gpipe: run-to-run spread 47% (...)"]
    assert refusals([comp("dapple", probe=1.25)], quiet) == \
        ["host speed 0.80-0.80 of calibration's (block probe; at most 5% off allowed): recalibrate"]
    busy = _profile({"sitting": {"2": {"problems": ["zb-v: run-to-run spread 31% (...)"]}}})
    assert refusals([comp("dapple")], busy) == ["calibration D=2: zb-v: run-to-run spread 31% (...)"]


def test_validate_refuses_a_profile_calibrated_on_a_busy_host(capsys, tmp_path):
    """No runs, no error figure: one line saying why, exit status 3."""
    from cost_models import save_profile
    from experiments.cli import main
    path = tmp_path / "busy.yaml"
    save_profile(_profile({"sitting": {"2": {"problems": ["dapple: other processes kept 0.90-1.10 cores busy"]}}}),
                 path)
    t0 = time.perf_counter()
    assert main(["validate", "--profile", str(path), "--plot", ""]) == 3
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "refused: host busy: calibration D=2: dapple: other processes kept 0.90-1.10 " \
                                  "cores busy"
    assert "error" not in out.replace("no time or error figure", "") and "%" not in out
    assert time.perf_counter() - t0 < 5.0


def test_run_series_without_a_reference_holds_runs_to_the_sittings_fastest_probe(monkeypatch):
    import executor.launch as launch
    probes = iter([1.0, 1.5, 1.0, 1.0, 1.0, 1.0])   # dapple's 1st, gpipe's 1st, then ...

    def fake_run_many(cfgs):
        return [_run([1.0, 1.0] + [10.0] * 5, probe=next(probes), schedule=c.schedule) for c in cfgs]

    monkeypatch.setattr(launch, "run_many", fake_run_many)
    d, g = run_series([RunConfig(schedule="dapple"), RunConfig(schedule="gpipe")], SittingRules(runs=2, max_runs=3))
    assert d.reference_probe == g.reference_probe == 1.0 and d.kept == [0, 1] and g.kept == [1, 2]
