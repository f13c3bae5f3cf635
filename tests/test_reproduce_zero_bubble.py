"""``pipetwin reproduce zero-bubble --quick``: the Zero Bubble paper's 8-GPU rows from Table 9's stage
times and from the model's dimensions, held against Tables 4 and 5 with the issue's aims: bubbles
within 0.01 of Table 5, throughput within 5% (profiled) / 10% (kernels), the schedules ranked as
measured."""
import pandas as pd
import pytest

from experiments.cli import main
from cost_models.stage_costs import load_stage_costs
from experiments.reproduce.zero_bubble import (COLUMNS, MEASUREMENTS, SEQ, kernel_stage_time, load_configs,
                                               message_fit, paper_cost, rankings, table, transferred_factor)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("zb")
    assert main(["reproduce", "zero-bubble", "--quick", "--out", str(out)]) == 0
    folder = out / "zero-bubble"
    return folder, pd.read_csv(folder / "zero-bubble.csv")


@pytest.mark.slow
def test_files_and_columns(quick):
    folder, df = quick
    assert list(df.columns) == COLUMNS
    for f in ("zero-bubble.png", "report.md", "stage-costs/1.5B-8gpus-b6-m24.yaml",
              "stage-costs/1.5B-8gpus-b6-m24-posted.yaml"):
        assert (folder / f).exists(), f
    # 2 models x 3 m x 4 schedules + one Table 6 config x 2 schedules, each from both sources
    assert len(df) == 2 * (24 + 2) and set(df.source) == {"profiled", "kernels"}
    assert "fitted on Table 4's 1F1B" in (folder / "report.md").read_text()
    # the fitted cells are Table 4's 1F1B column, every other cell a prediction
    fitted = (df.table == 4) & (df.schedule == "1F1B")
    assert (df.role[fitted] == "fitted").all() and (df.role[~fitted] == "predicted").all()
    # the profiled file: 1.5B, 3 layers a stage, b = 6: 34sbh + 5as^2b per layer, W keeping 32sbh
    st = load_stage_costs(folder / "stage-costs/1.5B-8gpus-b6-m24.yaml")
    s, b, h, a = 1024, 6, 2304, 24
    assert st.activation == pytest.approx(3 * (34 * s * b * h + 5 * a * s * s * b), rel=1e-5)
    assert st.activation_w == pytest.approx(3 * 32 * s * b * h, rel=1e-5)
    posted = load_stage_costs(folder / "stage-costs/1.5B-8gpus-b6-m24-posted.yaml")
    assert st.blocking_sends and not posted.blocking_sends and posted.f == st.f
    assert st.f == (0.018522,) and st.message == pytest.approx(0.000601)


@pytest.mark.slow
def test_bubbles_match_table5_from_the_profiled_times(quick):
    df = quick[1]
    p = df[(df.source == "profiled") & df.paper_bubble.notna()].set_index(["model", "microbatches", "schedule"])
    assert len(p) == 24
    gap = (p.predicted_bubble - p.paper_bubble).abs()
    assert gap.max() < 0.01                       # the aim, every cell
    # 1F1B, ZB-1p (= ZB-H1 in Table 5) and ZB-2p as Table 5 to 1e-3; 1F1B-I within 0.004 (its chunks' messages)
    for label in ("1F1B", "ZB-1p", "ZB-2p"):
        assert gap.xs(label, level="schedule").max() < 1e-3, label
    assert gap.xs("1F1B-I", level="schedule").max() < 0.004
    zb2 = p.xs("ZB-2p", level="schedule").predicted_bubble
    assert zb2.loc[("1.5B", 24)] == pytest.approx(0.0433, abs=0.001)
    assert zb2.loc[("6.2B", 64)] == pytest.approx(0.0010, abs=0.001)


@pytest.mark.slow
def test_throughput_against_table4(quick):
    df = quick[1]
    prof, ker = df[df.source == "profiled"], df[df.source == "kernels"]
    fit = prof[prof.role == "fitted"]
    assert len(fit) == 6 and fit.error.abs().max() < 0.01          # the fitted column
    aimed = prof[(prof.table == 4) | (prof.schedule == "ZB-V")]
    assert aimed.error.abs().max() < 0.05                           # the aim, every cell (1F1B-I included)
    assert prof[prof.schedule == "1F1B-I"].error.abs().max() < 0.025   # blocking sends: its chunks' messages
    assert ker[(ker.table == 4) | (ker.schedule == "ZB-V")].error.abs().max() < 0.10
    # the schedules ranked as measured in every Table 4 row: 1F1B-I beats ZB-1p at m = 24 for 1.5B,
    # loses at m = 64
    rk = rankings(df)
    assert rk[rk.source == "profiled"].same.all() and len(rk[rk.source == "profiled"]) == 6
    r = prof[prof.model == "1.5B"].set_index(["microbatches", "schedule"]).predicted_samples_per_gpu_s
    assert r[24, "ZB-2p"] > r[24, "1F1B-I"] > r[24, "ZB-1p"] > r[24, "1F1B"]
    assert r[64, "ZB-2p"] > r[64, "ZB-1p"] > r[64, "1F1B-I"] > r[64, "1F1B"]
    assert "ranked as measured (profiled): 6 of 6 rows" in (quick[0] / "report.md").read_text()


@pytest.mark.slow
def test_memory_from_the_model_within_10_percent(quick):
    df = quick[1]
    k = df[(df.source == "kernels") & df.measured_memory_gb.notna()]
    assert len(k) == 24
    assert (k.predicted_memory_gb / k.measured_memory_gb - 1).abs().max() < 0.10
    assert df[df.source == "profiled"].predicted_memory_gb.isna().all()     # the file gives no weights


def test_configs_and_paper_cost():
    cs = load_configs()
    assert len(cs) == 12 + 9
    t6 = [c for c in cs if c.table == 6 and c.model == "28.3B"][0]
    t4 = [c for c in cs if c.table == 4 and c.model == "28.3B"][0]
    # same depth per stage, twice the micro-batch: Table 9's times times the kernel model's ratio of a
    # full stage's time, below the linear 2 (a bigger micro-batch runs the GPU more efficiently)
    assert t6.scale == pytest.approx(kernel_stage_time(t6) / kernel_stage_time(t4))
    assert 1.5 < t6.scale < 2.0
    assert t6.profile[:3] == pytest.approx(tuple(t6.scale * x for x in t4.profile[:3]))
    # the message: Table 9's latency + bytes / bandwidth at twice the bytes, well below twice the time
    lat, bw = message_fit(_table9_rows())
    assert t6.profile[3] == pytest.approx(lat + 2 * 2 * SEQ * 6144 / bw)
    assert t6.profile[3] == pytest.approx(0.587e-3, abs=0.002e-3) and t6.profile[3] < 1.5 * t4.profile[3]
    assert t4.chunks("1F1B-I") == 2 and t4.chunks("ZB-1p") == 2
    # two devices, staggered: the cost is the longest own span (4), not the makespan (5)
    tr = pd.DataFrame({"device": [0, 0, 1, 1], "kind": ["F", "B", "F", "B"], "start": [0, 2, 1, 3],
                       "end": [1, 4, 3, 5]})
    cost, bubble = paper_cost(tr)
    assert cost == 4 and bubble == pytest.approx(1 - 3.5 / 4)


def test_bad_out_exits_2(capsys, tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    assert main(["reproduce", "zero-bubble", "--quick", "--out", str(f / "sub")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--out" in err[0] and "Traceback" not in err[0]


def _table9_rows():
    import csv
    from importlib import resources
    with resources.files("cost_models").joinpath(MEASUREMENTS).open() as f:
        return list(csv.DictReader(f))


def test_message_fit_on_table9():
    """T_comm = latency + bytes / bandwidth, least squares over Table 9's twelve rows: 0.237 ms and
    71.8 GB/s (the ordinary least-squares solution, checked against numpy), rms relative error 7%;
    a time proportional to the bytes cannot do better than 23%."""
    import numpy as np
    rows = _table9_rows()
    lat, bw = message_fit(rows)
    x = np.array([2.0 * int(r["micro_batch"]) * SEQ * int(r["hidden"]) for r in rows])
    y = np.array([float(r["T_comm_ms"]) / 1e3 for r in rows])
    (a, s), *_ = np.linalg.lstsq(np.c_[np.ones_like(x), x], y, rcond=None)
    assert lat == pytest.approx(a, rel=1e-9) and bw == pytest.approx(1 / s, rel=1e-9)
    assert lat == pytest.approx(0.2366e-3, rel=1e-3) and bw == pytest.approx(71.79e9, rel=1e-3)
    rms = float(np.sqrt(np.mean(((lat + x / bw) / y - 1) ** 2)))
    k = float(np.exp(np.mean(np.log(y / x))))              # the best proportional time (in log)
    rms_prop = float(np.sqrt(np.mean((k * x / y - 1) ** 2)))
    assert rms < 0.08 and rms_prop > 0.2


def test_transferred_factor():
    cs = load_configs()
    t4 = [c for c in cs if c.table == 4][0]
    t6 = [c for c in cs if c.table == 6 and c.model == "28.3B"][0]
    assert transferred_factor(1.08, t4) == 1.08
    # the same added time per micro-batch over ops scale times as long
    assert transferred_factor(1.08, t6) == pytest.approx(1 + 0.08 / t6.scale)
    assert t6.scale * (transferred_factor(1.08, t6) - 1) == pytest.approx(1.08 - 1)


@pytest.mark.slow
def test_table6_zbv_rows(tmp_path):
    """Table 6's ZB-V rows (and the Table 4 1F1B rows their factors are fitted on), both sources:
    the kernel model within 5% in every cell; from Table 9's profiled times within the 5% aim in 8
    of the 9 cells (before the message and the factor's transfer: 3 of 9, worst -9.1%); the one
    outside, 14.6B at m = 192, at -5.4%."""
    from dataclasses import replace
    cs = load_configs()
    models = {"6.2B", "14.6B", "28.3B"}
    sel = [replace(c, measured={"1F1B": c.measured["1F1B"]}) for c in cs if c.table == 4 and c.model in models]
    sel += [replace(c, measured={"ZB-V": c.measured["ZB-V"]}) for c in cs if c.table == 6]
    df, factors = table(sel, tmp_path)
    # what the fitted factor adds on Table 4's configuration, per micro-batch: 2.1-3.3 ms (the basis of
    # its transfer), for ops of 28-79 ms
    for c in sel[:9:3]:             # one Table 4 configuration per model
        added = (factors[(c.model, "profiled")] - 1) * sum(c.profile[:3])
        assert 2.1e-3 < added < 3.4e-3, c.model
    v = df[df.schedule == "ZB-V"].set_index(["source", "model", "microbatches"]).error
    assert len(v) == 18
    assert v["kernels"].abs().max() < 0.05
    prof = v["profiled"]
    assert (prof.abs() <= 0.05).sum() == 8
    assert prof.drop(("14.6B", 192)).abs().max() < 0.045
    assert prof[("14.6B", 192)] == pytest.approx(-0.054, abs=0.002)
    for model in ("6.2B", "28.3B"):            # -5.2% to -7.6% for 28.3B before
        assert prof[model].abs().max() < 0.03, model
