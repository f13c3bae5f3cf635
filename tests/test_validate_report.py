"""``pipetwin validate --report DIR``: the dated markdown record of a sitting, rendered from
comparisons built here (no sitting), the command through it with the runs replaced by those
comparisons, and the option's refusal before anything runs."""
import time

import pytest

from calibration import Comparison
from experiments import cmd_validate
from experiments.cli import build_parser
from experiments.cli import main as cli_main


def _profile(meta=None):
    from cost_models import CalibrationProfile, LayerTiming, LinkSpec, load_model
    spec = load_model("tiny")
    layers = tuple([LayerTiming(1e-4, 0.0, 1.5e-4, 1.5e-4)] + [LayerTiming(4e-4, 3.5e-4, 4.5e-4, 6e-4)] * spec.layers
                   + [LayerTiming(2e-4, 1.5e-4, 1.5e-4, 2.5e-4)])
    return CalibrationProfile("toy", spec, layers, LinkSpec("p2p", 4e9, 8e-5), LinkSpec("ar", 1e9, 3e-4),
                              optimizer_seconds_per_param=5e-9, cores=2, data_time=3e-4, grad_copy_per_byte=2e-10,
                              meta=meta if meta is not None else {"sitting": {"2": {"problems": []}},
                                                                  "probe_seconds": {"2": 1.0},
                                                                  "date": "2026-01-02 03:04:05", "host": "lab"})


def _comps(problem=None, traces=None, cause="noisy runs"):
    """gpipe (a prediction, 10.0 ms measured vs 10.5 ms simulated) and dapple (fitted on, 11.0 vs 11.7 ms)."""
    out = []
    for i, s in enumerate(["gpipe", "dapple"]):
        tr = traces[s] if traces else None
        out.append(Comparison(
            schedule=s, devices=2, microbatches=4, replicas=1, measured_iteration_time=0.010 + i * 1e-3,
            simulated_iteration_time=0.0105 + i * 1.2e-3, measured_iteration_times=[0.01] * 4,
            measured_peak_activation_bytes=[3 * 2 ** 20, 2 * 2 ** 20],
            simulated_peak_activation_bytes=[3 * 2 ** 20, 2 * 2 ** 20 if i else 2.2 * 2 ** 20],
            measured_bubble=[0.30, 0.36], simulated_bubble=[0.31, 0.33], order_identical=True, measured_probe=1.02,
            run_times=[0.01, 0.0101, 0.0099], kept_runs=3, foreign_cores=[0.01, 0.05, 0.0],
            rank_cores=[1.90, 1.95, 2.00], spread=0.012 * (i + 1), fitted=i == 1, state_steps=(30, 51),
            state_cut=0.83, profile_probe=1.0, problem=problem if i == 0 else None,
            cause=cause if problem and i == 0 else None, measured_trace=tr,
            simulated_trace=tr))
    return out


def _record(**kw):
    return cmd_validate.SittingRecord(
        started=time.mktime((2026, 3, 4, 15, 6, 0, 0, 0, -1)), command="pipetwin validate --devices 2",
        host={"platform": "Linux-x", "node": "box", "cores": 2}, load_start=(0.5, 0.25, 0.125),
        load_end=(1.5, 0.5, 0.25), setting="D=2 N=4 R=1, model tiny", profile=_profile(), profile_file="p.yaml",
        measured="measured: how", skipped={"chimera": "needs D even"}, seconds=42.4, **kw)


def test_report_of_a_compared_sitting_holds_its_tables_and_figures():
    md = cmd_validate.render_report(_record(comps=_comps(), figure="out/v.png"))
    lines = md.splitlines()
    assert lines[0].startswith("# pipetwin validate, 2026-03-04 15:06")
    assert "- command: `pipetwin validate --devices 2`" in lines
    assert ("- host: box (Linux-x), 2 cores; load average (1 / 5 / 15 min) 0.50 / 0.25 / 0.12 at the start, "
            "1.50 / 0.50 / 0.25 at the end") in lines
    assert ("- profile: toy (fp32, 2 cores, no time slice), calibrated 2026-01-02 03:04:05 on lab; file `p.yaml`"
            in lines)
    assert "- result: compared, 2 schedules in 42 s" in lines and "- skipped chimera: needs D even" in lines
    # the tables validate prints, as markdown tables, the fitted schedule starred
    assert "| schedule | measured_ms | simulated_ms | error | spread | runs | host_speed |" in lines
    assert "| gpipe | 10.00 | 10.50 | +5.0% | 1.2% | 3/3 | 0.98 |" in lines
    assert "| dapple* | 11.00 | 11.70 | +6.4% | 2.4% | 3/3 | 0.98 |" in lines
    assert "\\* the profile's runtime was fitted on these runs (in-sample); the others are predictions" in lines
    assert ("| schedule | bubble_meas | bubble_sim | peak_act_meas_MiB | peak_act_sim_MiB | mem_err | "
            "order_identical |") in lines
    assert "| gpipe | 0.330 | 0.320 | 3 | 3 | 10.00% | True |" in lines
    # the figures: |error| over all and over the predictions alone, the spread, the sitting line
    assert "- |error|: median 6.4%, max 6.4% (predictions only: median 5.0%, max 5.0%)" in lines
    assert "- run-to-run spread (the host's own noise): median 2.4%, max 2.4%" in lines
    assert ("sitting: 6 runs, other processes 0.00-0.05 cores, the ranks' own CPU 1.90-2.00 cores, host speed "
            "0.98-0.98 of calibration's, the host's fast state (ops at <= 0.83x their alone time) in 60 of 102 "
            "steps") in lines
    assert "measured: how" in lines and "Overlay figure: `out/v.png`" in lines and "## Refused" not in md


def test_report_of_a_refused_sitting_says_why_and_keeps_no_time():
    from calibration import Refusal
    md = cmd_validate.render_report(_record(comps=_comps("run-to-run spread 9% (...)"),
                                            reasons=[Refusal("noisy runs", "gpipe: run-to-run spread 9% (...)"),
                                                     Refusal("host speed", "0.80")],
                                            remedies=["longer runs", "calibrate again"], calibrated_now=True))
    lines = md.splitlines()
    assert "- result: refused (exit status 3), 2 schedules in 42 s" in lines
    assert lines[lines.index("## Refused") + 2:lines.index("## Refused") + 4] == [
        "- noisy runs: gpipe: run-to-run spread 9% (...)", "- host speed: 0.80"]
    assert lines[lines.index("## Refused") + 5:lines.index("## Refused") + 9] == [
        f"{cmd_validate.NO_FIGURE}; to settle it:", "", "- longer runs", "- calibrate again"]
    assert "- profile: toy (fp32, 2 cores, no time slice), calibrated in this sitting; file `p.yaml`" in lines
    # what does not depend on timing is kept; no iteration time, error or bubble
    assert "| schedule | peak_act_meas_MiB | peak_act_sim_MiB | mem_err | order_identical |" in lines
    assert ("timing-free checks: peak activation bytes exact in 1 of 2 schedules, op order identical in 2 of 2"
            in lines)
    assert "measured_ms" not in md and "|error|" not in md and "bubble" not in md
    # refused before any run (a profile from a busy sitting): the reasons alone
    md = cmd_validate.render_report(_record(reasons=[Refusal("unsettled profile", "D=2: dapple: busy")]))
    assert "- unsettled profile: D=2: dapple: busy" in md.splitlines() and "sitting:" not in md


def test_command_line_repeats_the_sitting():
    """The recorded command parses back to the same options (every option's flag is its name)."""
    parser = build_parser()
    args = parser.parse_args(["validate", "-D", "4", "--schedules", "gpipe,zb-v", "--max-spread", "0.08",
                              "--json", "--model", "notebooks/models/cnn.py:build", "--plot", "out/a b.png"])
    line = cmd_validate.command_line(args)
    assert line.startswith("pipetwin validate --schedules gpipe,zb-v --devices 4 ")
    assert "--json" in line.split() and "'out/a b.png'" in line and "--profile" not in line
    import shlex
    again = parser.parse_args(shlex.split(line)[1:])
    assert {k: v for k, v in vars(again).items() if k != "_main"} == \
        {k: v for k, v in vars(args).items() if k != "_main"}


def test_write_report_names_the_file_by_the_start_and_keeps_earlier_ones(tmp_path):
    rec = _record(comps=_comps())
    first = cmd_validate.write_report(rec, tmp_path / "log")
    second = cmd_validate.write_report(rec, tmp_path / "log")
    assert (first.name, second.name) == ("validate-2026-03-04-1506.md", "validate-2026-03-04-1506-2.md")
    assert first.read_text() == second.read_text() == cmd_validate.render_report(rec)


@pytest.mark.parametrize("problem", [None, "run-to-run spread 9% (...)"])
def test_validate_report_writes_the_sitting(monkeypatch, tmp_path, capsys, problem):
    """The whole command with the runs replaced by comparisons built here: the output is the same
    with --report and without but for the line naming the report, which holds what was printed."""
    import calibration
    from calibration import simulate_with_profile
    from cost_models import save_profile
    from executor.config import RunConfig, lowered_schedule
    prof = _profile()
    traces = {s: simulate_with_profile(lowered_schedule(RunConfig.of(schedule=s, devices=2, microbatches=4)), prof)
              for s in ("gpipe", "dapple")}
    monkeypatch.setattr(calibration, "run_and_compare", lambda *a, **k: _comps(problem, traces))
    path = save_profile(prof, tmp_path / "p.yaml")
    argv = ["validate", "--profile", str(path), "--schedules", "gpipe,dapple", "--plot", str(tmp_path / "v.png")]
    assert cli_main(argv) == (3 if problem else 0)
    plain = capsys.readouterr().out.splitlines()
    assert cli_main(argv + ["--report", str(tmp_path / "log")]) == (3 if problem else 0)
    out = capsys.readouterr().out.splitlines()
    (report,) = (tmp_path / "log").iterdir()
    assert report.name.startswith("validate-") and report.suffix == ".md"
    assert out[-2] == f"wrote report: {report}" and out[:-2] == plain[:-1]
    md = report.read_text()
    assert f"--report {tmp_path / 'log'}" in md and f"file `{path}`" in md
    if problem:
        assert "- noisy runs: gpipe: run-to-run spread 9% (...)" in md and "measured_ms" not in md
        assert "- the runs were quiet but do not agree: longer runs (--steps, now 20) or more rounds (--max-runs, " \
               "now 12) may settle them; --max-spread (now 0.05) allows more" in md
    else:
        assert "| gpipe | 10.00 | 10.50 | +5.0% | 1.2% | 3/3 | 0.98 |" in md
        assert next(x for x in plain if x.startswith("|error|")) in md


def test_report_folder_is_refused_before_anything_runs(tmp_path, capsys, no_ranks):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for target, why in ((blocker, "is a file, not a folder"), (blocker / "sub", "is a file, not a folder")):
        assert cli_main(["validate", "--report", str(target)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("pipetwin: error: argument --report: ") and why in err, err


def _overlaps(boxes) -> list:
    return [(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:] if a.overlaps(b)]


def test_overlay_figure_holds_every_op_and_no_label_covers_another():
    """validate.png: the last panel's measured step 1.6x longer than the first's; every panel's x
    axis reaches the last op's end of all panels, and no two tick labels, titles, the legend or
    micro-batch numbers overlap (their bounding boxes as drawn); the numbers sit inside their axes."""
    from calibration import simulate_with_profile
    from executor.config import RunConfig, lowered_schedule
    from experiments.plots import overlay_figure
    prof = _profile()
    traces = {s: simulate_with_profile(lowered_schedule(RunConfig.of(schedule=s, devices=2, microbatches=4)), prof)
              for s in ("gpipe", "dapple")}
    comps = _comps(None, traces)
    slow = comps[1].measured_trace.copy()
    slow["start"], slow["end"] = slow["start"] * 1.6, slow["end"] * 1.6
    comps[1].measured_trace = slow
    ends = [float((t["end"] - t["start"].min()).max()) * 1e3 for c in comps
            for t in (c.measured_trace, c.simulated_trace)]
    assert ends[2] > 1.5 * ends[0]
    fig = overlay_figure(comps)
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    axes = fig.axes
    assert len(axes) == 2
    for ax in axes:
        lo, hi = ax.get_xlim()
        assert lo == 0.0 and max(ends) <= hi <= 1.05 * max(ends)
        # every tick label drawn, on both axes, clear of the others
        for ticks in (ax.get_xticklabels(), ax.get_yticklabels()):
            boxes = [t.get_window_extent(r) for t in ticks if t.get_visible() and t.get_text()]
            assert _overlaps(boxes) == []
    shown = [t for t in axes[-1].get_xticklabels() if t.get_text()]
    assert len(shown) >= 4
    # titles, the legend, the x label and every axes' tick labels: no two overlap
    deco = [ax.title.get_window_extent(r) for ax in axes] + [fig.legends[0].get_window_extent(r),
                                                             axes[-1].xaxis.label.get_window_extent(r)]
    deco += [ax.get_yticklabels()[0].get_window_extent(r) for ax in axes]
    assert _overlaps(deco) == []
    # the micro-batch numbers: inside their axes, none over another; at least one per measured op of gpipe
    for ax in axes:
        box = ax.get_window_extent(r)
        nums = [t.get_window_extent(r) for t in ax.texts]
        assert nums and _overlaps(nums) == []
        assert all(box.x0 <= b.x0 and b.x1 <= box.x1 for b in nums)
    assert len(axes[0].texts) == len(comps[0].measured_trace.query("kind in ['F', 'B', 'W']"))
    import matplotlib.pyplot as plt
    plt.close(fig)
