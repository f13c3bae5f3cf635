"""Schedules when stage times differ (issue 45, item 4): 1F1B's closed form with non-uniform stages
against the simulator, zb-auto against ZB-H1 and the slowest device's work, and the comparison
report on the mixed A100 + H100 cluster."""
import csv

import pytest

from cost_models import Job, Layout
from cost_models.bind import bind, costed_family, load_inputs
from cost_models.parallel import Parallel
from experiments.hetero_schedules import D, SCHEDULES, dapple_closed_form, pool_ratio, run
from sim import simulate_job


def _step(tmp_path, schedule, f, N, message):
    path = tmp_path / "s.yaml"
    path.write_text("stages:\n" + "\n".join(f"  - {{f: {x}, b: {x}, w: {x}}}" for x in f) + f"\nmessage: {message}\n")
    return simulate_job(Job(layout=Layout(schedule=schedule, devices=len(f), microbatches=N),
                            stage_costs=str(path))).result.metrics().iteration_time


def test_dapple_closed_form_worked():
    """D = 4, stage 0 twice as slow (F = 2, B = 4 against 1 and 2), N = 8, no message: s = 0, the
    wait for micro-batch 0's gradient is 3 x 3 - 3 x 2 = 3, so T = 8 x 6 + 3 = 51 (the classic
    sum + (N - 1) max = 15 + 42 = 57 overstates it by the slow stage's three warm-up forwards)."""
    assert dapple_closed_form([2, 1, 1, 1], [4, 2, 2, 2], 8, 0.0) == 51
    assert dapple_closed_form([1, 1, 1, 2], [2, 2, 2, 4], 8, 0.0) == 3 * 3 + 8 * 6 == 57


@pytest.mark.parametrize("slow", [(0,), (1,), (2,), (3,), (0, 1), (2, 3)])
def test_dapple_matches_its_closed_form(tmp_path, slow):
    """The simulator's 1F1B on stage costs with slow stages (k = 1.93, the A100 / H100 ratio of a
    llama3-8b stage) equals the closed form: one slow stage with or without message time, a slow
    pool of two adjacent stages without."""
    k = 1.93
    f = [k if d in slow else 1.0 for d in range(4)]
    for N in (4, 8, 16):
        for m in ((0.0, 0.05) if len(slow) == 1 else (0.0,)):
            assert _step(tmp_path, "dapple", f, N, m) == pytest.approx(dapple_closed_form(f, [2 * x for x in f], N, m))


def test_report_numbers(tmp_path):
    """reproduce hetero-schedules --quick: the stage-cost rows' 1F1B is its closed form at the kernel
    model's ratio; every schedule takes at least the slowest device's work N x 3k; zb-auto is no
    slower than ZB-H1 there; each pool's busy share is its devices' busy time over the step."""
    run(tmp_path, quick=True)
    rows = list(csv.DictReader((tmp_path / "hetero_schedules.csv").open()))
    k = pool_ratio()
    assert k == pytest.approx(1.930, abs=5e-4)
    stage = {r["schedule"]: r for r in rows if r["setting"].startswith("stage costs")}
    cluster = {r["schedule"]: r for r in rows if r["setting"].startswith("llama3-8b")}
    assert set(stage) == set(cluster) == set(SCHEDULES)
    f = [k] * (D // 2) + [1.0] * (D // 2)
    assert float(stage["dapple"]["step_time"]) == pytest.approx(dapple_closed_form(f, [2 * x for x in f], 8, 0.0))
    for r in stage.values():
        assert float(r["step_time"]) >= 8 * 3 * k - 1e-9
        busy = (float(r["busy_a100"]) + float(r["busy_h100"])) / 2
        assert 1 - busy == pytest.approx(float(r["bubble"]))
    assert float(stage["zb-auto"]["step_time"]) <= float(stage["zb-h1"]["step_time"]) + 1e-9
    assert float(cluster["dapple"]["step_time"]) == pytest.approx(0.7994, rel=1e-3)


def test_zb_auto_orders_from_each_pools_times():
    """On the mixed cluster zb-auto is given each stage's times on its own device (ZB-H1's costs of
    rank d, stage d): stages 1 (A100) and 2 (H100) hold the same layers, so their forwards differ by
    the pool ratio."""
    job = Job(layout=Layout(schedule="zb-auto", devices=D, microbatches=8), model="llama3-8b", cluster="a100-h100",
              parallel=Parallel(tp=8))
    c = costed_family(job, load_inputs(job))["costs"]
    h1 = bind(job.with_layout(schedule="zb-h1", variant=None)).costs
    for x in ("f", "b", "w"):
        assert getattr(c, x) == tuple(getattr(h1.for_rank(d), x)[0][d] for d in range(D))
    assert c.f[1] / c.f[2] == pytest.approx(pool_ratio(), rel=1e-9)
