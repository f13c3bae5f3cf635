"""--stage-costs FILE.yaml: the reader (good and bad files), its binding to schedules of every
shape, and the bubbles it gives against the Zero Bubble paper's Table 5 (computed there from the
same Table 9 stage times)."""
import csv
from importlib import resources

import pytest

from cost_models import Job, Layout
from cost_models.stage_costs import load_stage_costs
from experiments.cli import main
from sim import simulate_job

ONE = "stages:\n  - {f: 0.0185, b: 0.0181, w: 0.0093}\nmessage: 0.0006\n"


def _file(tmp_path, text, name="sc.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def _sim(path, schedule, D, N, **kw):
    job = Job(layout=Layout(schedule=schedule, devices=D, microbatches=N, **kw), stage_costs=path)
    return simulate_job(job)


def test_read_one_entry_units_and_activation(tmp_path):
    st = load_stage_costs(_file(tmp_path, "stages:\n  - {f: 18.5 ms, b: 0.0181, w: 9.3 ms}\n"
                                          "message: 600 us\nactivation: 1 GiB\n"))
    assert st.f == (0.0185,) and st.b == (0.0181,) and st.w == pytest.approx((0.0093,))
    assert st.message == pytest.approx(6e-4) and st.activation == 2 ** 30


def test_full_backward_runs_b_plus_w_and_messages_cost_their_time(tmp_path):
    path = _file(tmp_path, "stages:\n  - {f: 1.0, b: 1.5, w: 0.5}\nmessage: 0.0\n")
    # 1F1B, no message time: (N + D - 1)(f + b + w)
    assert _sim(path, "dapple", 4, 8).result.iteration_time == pytest.approx(11 * 3.0)
    # GPipe D=2 N=1 with a message of 0.25 s: f, msg, f, B, msg, B
    path = _file(tmp_path, "stages:\n  - {f: 1.0, b: 1.5, w: 0.5}\nmessage: 0.25\n", "m.yaml")
    assert _sim(path, "gpipe", 2, 1).result.iteration_time == pytest.approx(2 * 1.0 + 2 * 2.0 + 2 * 0.25)
    # a split backward runs b and w: ZB-H1 D=2 N=1 = f, msg, f, b, msg, b, w
    assert _sim(path, "zb-h1", 2, 1).result.iteration_time == pytest.approx(2 + 2 * 1.5 + 0.5 + 2 * 0.25)


def test_per_stage_entries_and_chunks(tmp_path):
    path = _file(tmp_path, "stages:\n  - {f: 1, b: 1, w: 1}\n  - {f: 2, b: 2, w: 2}\nmessage: 0\n"
                           "activation: 100\n")
    bound = _sim(path, "dapple", 2, 2).bound
    assert bound.costs.f[0] == (1.0, 2.0) and bound.costs.b[0] == (2.0, 4.0) and bound.costs.w[0] == (0.0, 0.0)
    assert bound.costs.mem_unit == "B" and bound.costs.act[0] == (100.0, 100.0)
    inter = _sim(path, "interleaved", 2, 2, chunks=2).bound.costs      # 4 stages: its device's entry halved
    assert inter.f[0] == (0.5, 1.0, 0.5, 1.0) and inter.act[0] == (50.0,) * 4
    zbv = _sim(path, "zb-v", 2, 4).bound.costs       # V shape: stages 0, 3 on device 0; 1, 2 on device 1
    assert zbv.f[0] == (0.5, 1.0, 1.0, 0.5) and zbv.w[0] == (0.5, 1.0, 1.0, 0.5)
    assert _sim(path, "zb-h1", 2, 2).bound.costs.mem_unit == "B"


def test_activation_w_is_what_w_keeps(tmp_path):
    """B frees all but activation_w, W frees that; a full backward frees it all at B."""
    path = _file(tmp_path, "stages:\n  - {f: 1, b: 1, w: 1}\nmessage: 0\nactivation: 100\nactivation_w: 30\n")
    st = load_stage_costs(path)
    assert st.activation == 100 and st.activation_w == 30 and st.blocking_sends is False
    c = _sim(path, "zb-h1", 2, 2).bound.costs
    assert c.act[0] == (100.0, 100.0) and c.act_w[0] == (30.0, 30.0)
    assert _sim(path, "dapple", 2, 2).bound.costs.act_w[0] == (0.0, 0.0)     # no split: B frees it all
    assert _sim(path, "interleaved", 2, 4, chunks=2).bound.costs.act_w[0] == (0.0,) * 4
    # without activation_w W keeps all of it
    assert _sim(_file(tmp_path, "stages:\n  - {f: 1, b: 1, w: 1}\nmessage: 0\nactivation: 100\n", "a.yaml"),
                "zb-h1", 2, 2).bound.costs.act_w[0] == (100.0, 100.0)
    # zb-auto is told: under 150 bytes, W's that keep 30 may wait while the next F runs (130 kept);
    # W's that keep all 100 may not (one micro-batch at a time, 5 each: 30)
    whole = _file(tmp_path, "stages:\n  - {f: 1, b: 1, w: 1}\nmessage: 0\nactivation: 100\n", "w.yaml")
    lim = Layout(schedule="zb-auto", devices=2, microbatches=6, memory_limit=(150.0, "B"))
    part, full = (simulate_job(Job(layout=lim, stage_costs=p)).result for p in (path, whole))
    assert part.iteration_time == 25 and part.peak_activation == [130, 100]
    assert full.iteration_time == 30 and full.peak_activation == [100, 100]


def test_blocking_sends_hold_the_sender(tmp_path):
    """1F1B D=2 N=2, f=1, b+w=2, message 0.25: posted, device 1's second F starts as its first B ends
    (9.5); blocking, device 1 waits 0.25 after that B's send, so everything after it is 0.25 later
    (9.75). A blocking SEND lasts the message time in the trace, a posted one no time."""
    text = "stages:\n  - {f: 1, b: 1.5, w: 0.5}\nmessage: 0.25\n"
    runs = {}
    for name, extra in (("posted", ""), ("held", "blocking_sends: true\n")):
        job = Job(layout=Layout(schedule="dapple", devices=2, microbatches=2),
                  stage_costs=_file(tmp_path, text + extra, f"{name}.yaml"))
        runs[name] = simulate_job(job, trace=True).result
    assert runs["posted"].iteration_time == pytest.approx(9.5) and runs["held"].iteration_time == pytest.approx(9.75)
    for name, took in (("posted", 0.0), ("held", 0.25)):
        t = runs[name].trace()
        sends = t[t.kind == "SEND"]
        assert list(sends.end - sends.start) == pytest.approx([took] * 4), name
    assert load_stage_costs(_file(tmp_path, text + "blocking_sends: false\n", "f.yaml")).blocking_sends is False


def test_memory_in_ma_without_activation(tmp_path):
    res = _sim(_file(tmp_path, ONE), "dapple", 4, 8).result
    assert res.peak_activation == [4, 3, 2, 1]


def _table9():
    with resources.files("cost_models").joinpath("presets/measurements/zero-bubble/zero-bubble.csv").open() as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("row", _table9()[:6], ids=lambda r: f"{r['model']}-m{r['microbatches']}")
def test_bubbles_match_the_papers_table5(tmp_path, row):
    ms = {k: float(row[f"T_{k}_ms"]) / 1e3 for k in ("F", "B", "W", "comm")}
    path = _file(tmp_path, f"stages:\n  - {{f: {ms['F']}, b: {ms['B']}, w: {ms['W']}}}\nmessage: {ms['comm']}\n")
    D, N = int(row["pipeline_stages"]), int(row["microbatches"])
    got = {}
    for schedule, col in (("dapple", "bubble_1f1b"), ("zb-h1", "bubble_zbh1"), ("zb-h2", "bubble_zbh2")):
        got[schedule] = bubble = _sim(path, schedule, D, N).result.metrics().bubble_ratio
        if schedule != "zb-h2" or row["model"] == "1.5B":
            assert bubble == pytest.approx(float(row[col]), abs=0.002), (schedule, bubble, row[col])
    # the paper's ZB-H2 leaves (D-1)(F + B - 2W); ours (a fixed 2d W lag) matches it where W ~ B/2 (1.5B)
    # and stays between it and ZB-H1 where W is larger (6.2B: 0.100 vs 0.070 at m = 24)
    assert float(row["bubble_zbh2"]) - 0.002 < got["zb-h2"] < got["zb-h1"]


@pytest.mark.parametrize("text,words", [
    ("", ["sc.yaml", "empty"]),
    ("stages: []\nmessage: 0\n", ["'stages'", "non-empty list"]),
    ("stages:\n  - {f: 1, b: 1}\nmessage: 0\n", ["missing field", "stages[0].w"]),
    ("stages:\n  - {f: .nan, b: 1, w: 1}\nmessage: 0\n", ["stages[0].f"]),
    ("stages:\n  - {f: 1, b: -1, w: 1}\nmessage: 0\n", ["stages[0].b"]),
    ("stages:\n  - {f: 1, b: 1, w: 1, x: 2}\nmessage: 0\n", ["unknown field", "stages[0].x"]),
    ("stages:\n  - {f: 1, b: 1, w: 1}\n", ["missing field", "message"]),
    ("stages:\n  - {f: 1, b: 1, w: 1}\nmessage: fast\n", ["'message'", "seconds"]),
    ("stages:\n  - {f: 1, b: 1, w: 1}\nmessage: 0\nactivation: 0\n", ["'activation'"]),
    ("stages:\n  - {f: 1, b: 1, w: 1}\nmessage: 0\nactivation_w: 5\n", ["'activation_w'", "needs 'activation'"]),
    ("stages:\n  - {f: 1, b: 1, w: 1}\nmessage: 0\nactivation: 4\nactivation_w: 5\n", ["'activation_w'", "at most"]),
    ("stages:\n  - {f: 1, b: 1, w: 1}\nmessage: 0\nactivation: 4\nactivation_w: .nan\n", ["'activation_w' must be"]),
    ("stages:\n  - {f: 1, b: 1, w: 1}\nmessage: 0\nactivation: 4\nactivation_w: -1\n", ["'activation_w' must be"]),
    ("stages:\n  - {f: 1, b: 1, w: 1}\nmessage: 0\nblocking_sends: yes please\n",
     ["'blocking_sends'", "true or false"]),
    ("stages:\n  - {f: 1, b: 1, w: 1}\n  - {f: 1, b: 1, w: 1}\nmessage: 0\n", ["2 stage entries", "-D 4"]),
    ("stages: {f: 1}\nmessage: 0\n", ["'stages'", "list"]),
    ("[1, 2]\n", ["mapping"]),
])
def test_bad_files_exit_2_with_one_line(capsys, tmp_path, text, words):
    path = _file(tmp_path, text)
    capsys.readouterr()
    assert main(["simulate", "-s", "dapple", "-D", "4", "-N", "8", "--stage-costs", path]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pipetwin: error: "), err
    for w in words:
        assert w in err[0], (w, err[0])


@pytest.mark.parametrize("extra,words", [
    (["-m", "tiny"], ["--stage-costs", "--model"]),
    (["--unit-costs"], ["--stage-costs", "--unit-costs"]),
    (["--recompute", "full"], ["--stage-costs", "--recompute"]),
    (["--dp", "2"], ["--stage-costs", "--dp 2"]),
])
def test_other_cost_options_are_refused(capsys, tmp_path, extra, words):
    capsys.readouterr()
    assert main(["simulate", "-s", "dapple", "-D", "4", "-N", "8", "--stage-costs", _file(tmp_path, ONE)] + extra) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and all(w in err[0] for w in words), err


def test_compare_and_sweep_take_stage_costs(capsys, tmp_path):
    path = _file(tmp_path, ONE)
    assert main(["compare", "-D", "4", "-N", "8", "--schedules", "dapple,zb-h1", "--stage-costs", path]) == 0
    assert "zb-h1" in capsys.readouterr().out
    assert main(["sweep", "--schedules", "dapple", "-D", "2,4", "-N", "8", "--stage-costs", path, "--workers", "1",
                 "--no-figures", "--out", str(tmp_path / "sw")]) == 0
    assert "2 points (2 ran" in capsys.readouterr().out
