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


def test_context_parallel_case_is_llama3s_long_context_layout_within_its_aim():
    """The 16,384-GPU long-context case: Llama-3-405B at TP 8 x CP 16 x PP 16 x DP 8 on 131,072-token
    sequences in Llama 3's order, one replica simulated for all, the same iteration as ``pipetwin
    simulate`` of the same options, and within its aim of 20x a bare SimPy loop of 100k timeouts (best
    of two each; the case takes about 1x on this host)."""
    import time

    from cost_models.job import Job
    from sim import simulate_job

    job = Job.of(schedule="interleaved", devices=16, microbatches=16, replicas=8, tp=8, cp=16, recompute="full",
                 seq_len=131072, model="llama3-405b", cluster="dgx-h100-ib:2048", device_map="sequential")
    assert job.gpus == 16384
    bound, res = simulate_job(job)
    assert res.simulated_replicas == 1 and bound.report["gpus"] == 16384 and bound.report["cp"] == 16
    runs, loops = [], []
    for _ in range(2):
        loops.append(bench_sim.bare_loop([100_000]))
        t = time.perf_counter()
        metrics, _ = bench_sim.context_parallel_case()
        runs.append(time.perf_counter() - t)
    assert metrics.iteration_time == res.iteration_time
    assert min(runs) / min(loops) <= 20.0, (runs, loops)
