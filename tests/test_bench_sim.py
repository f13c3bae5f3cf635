"""experiments.bench_sim's growth report: log-log slopes, the figure, a bad --figure refused first."""
import pytest

from experiments import bench_sim


def test_slope_is_the_log_log_exponent():
    assert bench_sim.slope([1, 2, 4, 8], [3, 6, 12, 24]) == pytest.approx(1.0, rel=1e-12)
    assert bench_sim.slope([2, 4, 8], [5, 20, 80]) == pytest.approx(2.0, rel=1e-12)
    assert bench_sim.slope([16, 32, 64, 128], [7, 7, 7, 7]) == pytest.approx(0.0, abs=1e-12)


def test_scaling_figure_and_rows(tmp_path):
    rows = [{"series": name, "x": x, "seconds": 0.1 * (i + 1) * x, "ratio": (i + 1) * x, "peak_MiB": 2.0 * x}
            for i, (name, _, points) in enumerate(bench_sim.SCALING) for x, _ in points]
    bench_sim.scaling_figure(rows, tmp_path / "b.png")
    assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # every series of the figure is the Llama-3-405B job on 8 x D x R GPUs
    gpus = next(points for name, _, points in bench_sim.SCALING if name.startswith("GPUs"))
    assert [x for x, _ in gpus] == [8192, 16384, 32768, 65536, 131072]
    assert all(x == 8 * 16 * kw["R"] for x, kw in gpus)


def test_a_figure_under_a_file_is_refused_before_any_case(tmp_path, capsys):
    f = tmp_path / "a_file"
    f.write_text("x")
    assert bench_sim.main(["--figure", str(f / "b.png"), "--no-planner"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a file" in err[0]
