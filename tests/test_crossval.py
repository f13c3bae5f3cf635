"""Calibration fits, profile round trip with overheads, and a short executor-vs-simulator run."""
import pytest

from cost_models import load_profile, save_profile
from cost_models.calibration import fit_allreduce, fit_latency_bandwidth
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


def test_fit_refuses_flat_timings():
    with pytest.raises(SpecError, match="do not grow"):
        fit_latency_bandwidth([1, 2, 3], [5.0, 4.0, 3.0])


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    from executor.calibrate import calibrate
    prof = calibrate("tiny", ranks=2, repeats=5)
    path = tmp_path_factory.mktemp("cal") / "profile.yaml"
    save_profile(prof, path)
    return load_profile(path)


def test_calibrated_profile_round_trips(profile):
    assert profile.cores >= 1 and profile.p2p.bandwidth > 0 and profile.allreduce.latency >= 0
    kinds = dict(profile.overhead)
    assert set(kinds) >= {"SEND", "RECV", "OPTIM"}
    assert profile.data_time > 0 and profile.grad_copy_per_byte > 0
    blk = profile.layers[1]
    assert 0 < blk.f and 0 < blk.b and 0 < blk.b_input and 0 < blk.w
    assert len(profile.act_bytes) == profile.model.layers + 2 and profile.act_bytes[1] > 0


def test_short_validate_run_memory_is_exact(profile):
    from experiments.crossval import run_and_compare
    comps = run_and_compare(["gpipe", "dapple"], 2, 4, 1, profile, steps=3, warmup=1)
    for c in comps:
        assert c.order_identical, c.schedule
        assert c.measured_peak_activation_bytes == c.simulated_peak_activation_bytes, c.schedule
        assert c.simulated_iteration_time > 0 and c.measured_iteration_time > 0
        assert len(c.measured_iteration_times) == 3
    # GPipe keeps all N micro-batches, 1F1B at most D on the first rank
    g, d = comps
    assert g.measured_peak_activation_bytes[0] > d.measured_peak_activation_bytes[0]


def test_runtime_scale_is_robust_to_descheduled_ops():
    from executor.calibrate import fit_runtime, fit_scale
    samples = [(p, 1.3 * p) for p in (1e-3, 2e-3, 3e-3, 4e-3, 5e-3)] + [(2e-3, 9e-3)]  # one hiccup
    assert fit_scale(samples) == pytest.approx(1.3)
    scale, overhead = fit_runtime({"F": samples, "SEND": [(0.0, 1e-4), (0.0, 2e-4), (0.0, 3e-4)],
                                   "RECV": [(0.0, x * 1e-5) for x in range(1, 11)]})
    assert scale["F"] == pytest.approx(1.3) and overhead["SEND"] == pytest.approx(2e-4)
    assert overhead["RECV"] == pytest.approx(2e-5)   # the 20th percentile: a message already there
