"""Calibration fits, profile round trip with overheads, and a short executor-vs-simulator run."""
import pytest

from calibration.fit import fit_allreduce, fit_latency_bandwidth
from cost_models._spec import SpecError


def test_fit_recovers_known_latency_and_bandwidth():
    lat, bw = 60e-6, 2.5e9
    sizes = [1 << k for k in range(10, 23, 2)]
    times = [lat + s / bw for s in sizes]
    f_lat, f_bw = fit_latency_bandwidth(sizes, times)
    assert f_lat == pytest.approx(lat, rel=1e-9) and f_bw == pytest.approx(bw, rel=1e-9)
    # with +-3% multiplicative noise the fit stays within 10%
    noisy = [t * (1 + 0.03 * (-1) ** i) for i, t in enumerate(times)]
    f_lat, f_bw = fit_latency_bandwidth(sizes, noisy)
    assert f_bw == pytest.approx(bw, rel=0.1) and f_lat == pytest.approx(lat, rel=0.5)


def test_fit_allreduce_recovers_ring_parameters():
    lat, bw, n = 40e-6, 1.2e9, 4
    sizes = [1 << k for k in range(12, 23, 2)]
    times = [2 * (n - 1) * lat + 2 * (n - 1) / n * s / bw for s in sizes]
    f_lat, f_bw = fit_allreduce(sizes, times, n)
    assert f_lat == pytest.approx(lat, rel=1e-9) and f_bw == pytest.approx(bw, rel=1e-9)


def test_relative_allreduce_fit_holds_the_small_sizes():
    """Exact ring times are recovered either way; with the largest size 40% slow (a noisy
    measurement), the plain fit misses the small, latency-bound sizes by more than 20% and the
    relative one (TP all-reduces) keeps them within 5%."""
    lat, bw, n = 90e-6, 1.5e9, 2
    sizes = [1 << k for k in range(10, 23, 2)]
    times = [2 * (n - 1) * lat + 2 * (n - 1) / n * s / bw for s in sizes]
    assert fit_allreduce(sizes, times, n, relative=True) == (pytest.approx(lat, rel=1e-9), pytest.approx(bw, rel=1e-9))
    noisy = times[:-1] + [times[-1] * 1.4]
    small = times[:3]
    for relative, worst in ((False, 0.2), (True, 0.05)):
        f_lat, f_bw = fit_allreduce(sizes, noisy, n, relative=relative)
        fitted = [2 * f_lat + s / f_bw for s in sizes[:3]]
        miss = max(abs(f / t - 1) for f, t in zip(fitted, small))
        assert (miss > worst) if not relative else (miss < worst), (relative, miss)


def test_fit_refuses_flat_timings():
    with pytest.raises(SpecError, match="do not grow"):
        fit_latency_bandwidth([1, 2, 3], [5.0, 4.0, 3.0])


@pytest.fixture(scope="module")
def calibrated(tiny_sitting):
    """The tiny GPT's profile, calibrated in one sitting with its validation (tests/conftest.py):
    as measured, and read back from its file."""
    return tiny_sitting[:2]


@pytest.fixture(scope="module")
def profile(calibrated):
    return calibrated[1]


@pytest.mark.slow
def test_calibrated_profile_round_trips(calibrated):
    measured, profile = calibrated
    # every field (meta aside, free-form) comes back from the YAML file exactly
    assert profile == measured
    assert profile.layers == measured.layers and profile.overhead == measured.overhead
    assert profile.cores >= 1 and profile.p2p.bandwidth > 0 and profile.allreduce.latency >= 0
    # the in-run communication fitted on the step times sits on top of the lone measurements
    alone, in_run = profile.meta["alone"], profile.meta["in_run"]
    assert profile.p2p.latency == pytest.approx(alone["p2p_latency"] + in_run["p2p_latency_extra"], rel=1e-12)
    assert profile.allreduce.latency == pytest.approx(alone["allreduce_latency"] * in_run["allreduce_slowdown"],
                                                      rel=1e-12)
    assert 0 <= in_run["p2p_latency_extra"] <= 5e-3 and 0.1 <= in_run["allreduce_slowdown"] <= 10
    kinds = dict(profile.overhead)
    assert set(kinds) >= {"SEND", "RECV"} and profile.optimizer_seconds_per_param > 0
    assert profile.data_time > 0 and profile.grad_copy_per_byte > 0
    blk = profile.layers[1]
    assert 0 < blk.f and 0 < blk.b and 0 < blk.b_input and 0 < blk.w
    assert len(profile.act_bytes) == profile.model.layers + 2 and profile.act_bytes[1] > 0
    sit = profile.meta["sitting"]["2"]
    assert sit["runs"] == {"dapple": 2, "interleaved": 2, "zb-v": 2, "zb-h1": 2, "bitpipe": 2}
    assert sit["foreign_cores_max"] >= 0


@pytest.mark.slow
def test_one_sitting_shares_runs_between_calibration_and_validation(tiny_sitting):
    """dapple's runs are the calibration's too (in-sample, marked), gpipe is a prediction; the
    memory and op order checks hold whatever the host's load."""
    prof, _, comps, _ = tiny_sitting
    g, d = comps
    assert (g.schedule, g.fitted, d.schedule, d.fitted) == ("gpipe", False, "dapple", True)
    assert len(d.run_times) == len(g.run_times) == 2 == prof.meta["sitting"]["2"]["runs"]["dapple"]
    for c in comps:
        assert c.order_identical and c.measured_peak_activation_bytes == c.simulated_peak_activation_bytes
        assert c.simulated_iteration_time > 0 and c.measured_iteration_time > 0


@pytest.mark.slow
def test_short_validate_run_memory_is_exact(profile):
    from calibration.sitting import SittingRules
    from calibration import run_and_compare
    from cost_models.job import Job, Layout
    jobs = [Job(layout=Layout(schedule=s, devices=2, microbatches=4)) for s in ("gpipe", "dapple")]
    comps = run_and_compare(jobs, profile, steps=3, rules=SittingRules(runs=1, max_runs=1, warmup=1))
    for c in comps:
        assert len(c.run_times) == 1 and c.foreign_cores[0] >= 0.0
        assert c.order_identical, c.schedule
        assert c.measured_peak_activation_bytes == c.simulated_peak_activation_bytes, c.schedule
        assert c.simulated_iteration_time > 0 and c.measured_iteration_time > 0
        assert len(c.measured_iteration_times) == 3
    # GPipe keeps all N micro-batches, 1F1B at most D on the first rank
    g, d = comps
    assert g.measured_peak_activation_bytes[0] > d.measured_peak_activation_bytes[0]


def _synthetic_runs(profile, schedules, D, steps=5, disturbed=()):
    """Runs 'measured' by the simulator itself with a known profile (what the fits must recover),
    one series per schedule; the steps in ``disturbed`` are made 1.6x slower, every op of them
    (a busy spell of the host)."""
    from types import SimpleNamespace

    from executor.config import RunConfig, lowered_schedule
    from calibration.sitting import RunSeries, SittingRules
    from schedules.trace import step_metrics
    from calibration import simulate_with_profile
    out = []
    for s in schedules:
        cfg = RunConfig.of(schedule=s, devices=D, microbatches=2 * D, steps=steps, model="tiny")
        tr = simulate_with_profile(lowered_schedule(cfg), profile, steps=steps)
        times = list(step_metrics(tr).iteration_times)
        for k in disturbed:
            rows = tr["step"] == k
            t0 = tr.loc[rows, "start"].min()
            tr.loc[rows, "start"] = t0 + (tr.loc[rows, "start"] - t0) * 1.6
            tr.loc[rows, "end"] = t0 + (tr.loc[rows, "end"] - t0) * 1.6
            times[k] *= 1.6
        run = SimpleNamespace(config=cfg, trace=tr, iteration_times=times, extra={})
        out.append(RunSeries(config=cfg, runs=[run], rules=SittingRules(runs=1, max_runs=1)).settle())
    return out


def _toy_profile(scale=None, overhead=(), slowdown=1.0, cores=2):
    from dataclasses import replace

    from cost_models import CalibrationProfile
    from cost_models.profile import LayerTiming
    from cost_models.cluster import LinkSpec
    from cost_models.model_spec import load_model
    sc = {"F": 1.0, "B": 1.0, "Bi": 1.0, "W": 1.0, "OPTIM": 1.0, **(scale or {})}
    spec = load_model("tiny")
    base = [LayerTiming(1e-4, 0.0, 1.5e-4, 1.5e-4)] + [LayerTiming(4e-4, 3.5e-4, 4.5e-4, 6e-4)] * spec.layers \
        + [LayerTiming(2e-4, 1.5e-4, 1.5e-4, 2.5e-4)]
    layers = tuple(replace(t, f=t.f * sc["F"], b_input=t.b_input * sc["Bi"], w=t.w * sc["W"], b=t.b * sc["B"])
                   for t in base)
    return CalibrationProfile("toy", spec, layers, LinkSpec("p2p", 4e9, 8e-5), LinkSpec("ar", 1e9, 3e-4),
                              optimizer_seconds_per_param=5e-9 * sc["OPTIM"], overhead=tuple(sorted(overhead)),
                              cores=cores,
                              data_time=3e-4, grad_copy_per_byte=2e-10, oversubscribed_slowdown=slowdown)


def test_runtime_fit_through_the_simulator_recovers_known_costs():
    """Runs made by a profile whose ops cost 1.3x (F), 0.9x (split B), 1.2x (W) the layer times,
    1.5x the optimizer time, 60 us per compute op and 100 us per SEND: fitting from the plain
    layer times recovers them."""
    from calibration import fit_runtime
    truth = _toy_profile({"F": 1.3, "B": 1.1, "Bi": 0.9, "W": 1.2, "OPTIM": 1.5},
                         (("B", 6e-5), ("F", 6e-5), ("RECV", 2e-5), ("SEND", 1e-4), ("W", 6e-5)))
    # 12 steps, 5 of them in a busy spell: the fit reproduces the steps around the low quantile,
    # the undisturbed ones (a fit to all steps would find every cost about 25% too high)
    runs = _synthetic_runs(truth, ["dapple", "interleaved", "zb-v"], 2, steps=12, disturbed=(3, 5, 6, 9, 11))
    scale, overhead = fit_runtime(runs, lambda sc, ov: _toy_profile(sc, tuple(ov.items())), iterations=5)
    assert scale["F"] == pytest.approx(1.3, rel=0.02) and scale["B"] == pytest.approx(1.1, rel=0.02)
    assert scale["Bi"] == pytest.approx(0.9, rel=0.02) and scale["W"] == pytest.approx(1.2, rel=0.02)
    assert scale["OPTIM"] == pytest.approx(1.5, rel=0.02) and overhead["SEND"] == pytest.approx(1e-4, rel=0.05)
    assert overhead["F"] == overhead["B"] == overhead["W"] == pytest.approx(6e-5, rel=0.1)


def _with_comm(profile, p2p_extra: float, ar_slowdown: float):
    from dataclasses import replace

    from cost_models.cluster import LinkSpec
    return replace(profile, p2p=LinkSpec("p2p", profile.p2p.bandwidth, profile.p2p.latency + p2p_extra),
                   allreduce=LinkSpec("ar", profile.allreduce.bandwidth / ar_slowdown,
                                      profile.allreduce.latency * ar_slowdown))


def test_in_run_communication_is_recovered_from_step_times():
    """Runs whose messages arrive 0.5 ms later than the ping-pong's latency and whose all-reduces
    take 2.2x their lone time (BitPipe's two copies): fitting on step times recovers both; without
    an all-reducing run the slowdown is not fitted (1), and the latency still is."""
    from calibration import fit_communication
    base = _toy_profile()
    truth = _with_comm(base, 5e-4, 2.2)
    runs = _synthetic_runs(truth, ["dapple", "zb-v", "bitpipe"], 2, steps=8, disturbed=(3, 6))
    extra, slowdown = fit_communication(runs, lambda p, a: _with_comm(base, p, a))
    assert extra == pytest.approx(5e-4, rel=0.03) and slowdown == pytest.approx(2.2, rel=0.03)
    extra, slowdown = fit_communication(runs[:2], lambda p, a: _with_comm(base, p, a))
    assert extra == pytest.approx(5e-4, rel=0.03) and slowdown == 1.0
    # runs that match the lone measurements: nothing to add
    runs = _synthetic_runs(base, ["dapple", "bitpipe"], 2, steps=6)
    extra, slowdown = fit_communication(runs, lambda p, a: _with_comm(base, p, a))
    assert extra == pytest.approx(0.0, abs=2e-6) and slowdown == pytest.approx(1.0, abs=0.01)
    # all-reduces faster in the runs than the lone median said (its samples spread 3x): below 1
    runs = _synthetic_runs(_with_comm(base, 3e-4, 0.6), ["dapple", "bitpipe"], 2, steps=6)
    extra, slowdown = fit_communication(runs, lambda p, a: _with_comm(base, p, a))
    assert extra == pytest.approx(3e-4, rel=0.03) and slowdown == pytest.approx(0.6, rel=0.03)


def test_oversubscribed_slowdown_only_applies_beyond_the_cores():
    """A profile of an earlier version (compute slowdown instead of time slices) still predicts as
    it did: the factor applies to every rank when the ranks outnumber the cores, never below."""
    from sim import SimOptions
    from sim.host import HostCores, on_one_host
    assert on_one_host(SimOptions(), 2, HostCores(cores=2, oversubscribed_slowdown=1.4)).slowdown == {}
    opts = on_one_host(SimOptions(slowdown={1: 2.0}), 4, HostCores(cores=2, oversubscribed_slowdown=1.5))
    assert opts.slowdown == {0: 1.5, 1: 3.0, 2: 1.5, 3: 1.5} and opts.time_slice is None
    sliced = HostCores(cores=2, time_slice=4e-3)
    assert on_one_host(SimOptions(), 2, sliced).time_slice is None       # a core per rank: no slicing
    assert on_one_host(SimOptions(), 3, sliced).time_slice == 4e-3


def test_time_slice_is_recovered_from_runs_with_more_ranks_than_cores():
    """Runs made by a profile whose 4 ranks share 2 cores in 6 ms slices: of the candidate slices
    the fit picks 6 ms whatever their order (a slice too long to preempt the ops would have
    predicted them 2% or more off, so the choice is informed)."""
    from dataclasses import replace

    from calibration import fit_time_slice
    from calibration.fit import simulated_step
    from executor.config import lowered_schedule
    # ops of 6-12 ms: a 6 ms slice preempts them, a 30 ms one does not
    truth = replace(_toy_profile({"F": 15.0, "B": 20.0, "Bi": 15.0, "W": 15.0}), time_slice=6e-3)
    runs = _synthetic_runs(truth, ["gpipe", "zb-v", "dapple"], 4, steps=6)
    long = replace(truth, time_slice=30e-3)
    gaps = [simulated_step(lowered_schedule(x.config), long, 2) / x.step_time - 1 for x in runs]
    assert max(abs(g) for g in gaps) > 0.02
    for order in ((1e-3, 6e-3, 30e-3), (30e-3, 6e-3, 1e-3)):
        q, prof = fit_time_slice(runs, lambda s: replace(truth, time_slice=s), slices=order)
        assert q == 6e-3 and prof.time_slice == 6e-3
