"""pipetwin sweep: grid rows equal simulate --json, resume, workers, impossible points, Ray."""
import contextlib
import csv
import json
import os

import pytest

from experiments.cli import main
from cost_models.job import Job, Layout
from experiments.sweep import COLUMNS, Grid, pareto_front, run_sweep


def run_cli(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def read_rows(path):
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


BASE = ("--schedules", "dapple,bitpipe", "--devices", "2,3", "--microbatches", "4", "--dp", "1,2",
        "-m", "gpt3-1.3b", "--no-figures")


def test_sweep_rows_equal_simulate_json(capsys, tmp_path):
    out = tmp_path / "sw"
    rc, text, _ = run_cli(capsys, "sweep", *BASE, "--micro-batch", "1,2", "--out", str(out), "--workers", "1")
    assert rc == 0 and "16 points (12 ran, 4 impossible)" in text
    rows = read_rows(out / "sweep.csv")
    assert list(rows[0]) == COLUMNS and len(rows) == 16
    bad = [r for r in rows if r["error"]]
    assert len(bad) == 4 and all(r["schedule"] == "bitpipe" and r["devices"] == "3" for r in bad)
    assert bad[0]["error"] == "bitpipe needs an even number of devices; got 3" and bad[0]["iteration_time"] == ""
    records = [json.loads(line) for line in (out / "sweep.jsonl").read_text().splitlines()]
    assert len(records) == 12
    for point in ({"schedule": "bitpipe", "devices": "2", "microbatches": "4", "dp": "2", "tp": "1", "zero": "0",
                   "recompute": "none", "micro_batch": "2", "ep": "1"},
                  {"schedule": "dapple", "devices": "3", "microbatches": "4", "dp": "1", "tp": "1", "zero": "0",
                   "recompute": "none", "micro_batch": "1", "ep": "1"}):
        rc, js, _ = run_cli(capsys, "simulate", "-s", point["schedule"], "-D", point["devices"], "-N", "4",
                            "--dp", point["dp"], "--micro-batch", point["micro_batch"], "-m", "gpt3-1.3b", "--json")
        want = json.loads(js)
        got = next(r["record"] for r in records if r["point"] == point)
        assert got == want
        row = next(r for r in rows if all(r[k] == v for k, v in point.items()))
        assert float(row["iteration_time"]) == want["iteration_time"]
        assert float(row["peak_memory"]) == max(p["peak_memory"] for p in want["per_device"])
        assert row["out_of_memory"] == str(want["out_of_memory"])
        samples = 4 * int(point["dp"]) * int(point["micro_batch"])
        assert float(row["throughput"]) == pytest.approx(samples / want["iteration_time"])


def test_sweep_axes_tp_zero_recompute_equal_simulate_json(capsys, tmp_path):
    """T, ZeRO and recompute are axes: 2 x 2 x 3 points of interleaved D=2 N=4 R=2, each row and record
    that of `simulate --json` with the same options; ZeRO-1 shrinks the memory, full recompute more."""
    out = tmp_path / "sw"
    rc, text, _ = run_cli(capsys, "sweep", "-s", "interleaved", "-D", "2", "-N", "4", "--dp", "2", "--tp", "1,2",
                          "--zero", "0,1", "--recompute", "none,selective,full", "-m", "gpt3-1.3b",
                          "-c", "dgx-a100-4x8-ib", "--no-figures", "--workers", "2", "--out", str(out))
    assert rc == 0 and "12 points (12 ran, 0 impossible)" in text
    rows = read_rows(out / "sweep.csv")
    assert [(r["tp"], r["zero"], r["recompute"]) for r in rows] == [
        (t, z, c) for t in ("1", "2") for z in ("0", "1") for c in ("none", "selective", "full")]
    records = {tuple(r["point"][k] for k in ("tp", "zero", "recompute")): r["record"]
               for r in map(json.loads, (out / "sweep.jsonl").read_text().splitlines())}
    for t, z, c in (("2", "1", "full"), ("1", "1", "selective"), ("2", "0", "none")):
        rc, js, _ = run_cli(capsys, "simulate", "-s", "interleaved", "-D", "2", "-N", "4", "--dp", "2", "--tp", t,
                            "--zero", z, "--recompute", c, "-m", "gpt3-1.3b", "-c", "dgx-a100-4x8-ib", "--json")
        want = json.loads(js)
        assert rc == 0 and records[(t, z, c)] == want
        row = next(r for r in rows if (r["tp"], r["zero"], r["recompute"]) == (t, z, c))
        assert float(row["iteration_time"]) == want["iteration_time"]
        assert float(row["peak_memory"]) == max(p["peak_memory"] for p in want["per_device"])
    peak = {(r["tp"], r["zero"], r["recompute"]): float(r["peak_memory"]) for r in rows}
    assert peak[("1", "1", "none")] < peak[("1", "0", "none")]
    assert peak[("1", "0", "full")] < peak[("1", "0", "selective")] < peak[("1", "0", "none")]
    # ZeRO-1 without replicas: an impossible point (a row with the reason), the others run
    rc, text, _ = run_cli(capsys, "sweep", "-s", "dapple", "-D", "2", "-N", "4", "--dp", "1,2", "--zero", "0,1",
                          "-m", "tiny", "--no-figures", "--workers", "1", "--out", str(tmp_path / "z"))
    assert rc == 0 and "4 points (3 ran, 1 impossible)" in text
    bad = [r for r in read_rows(tmp_path / "z" / "sweep.csv") if r["error"]]
    assert [(r["dp"], r["zero"]) for r in bad] == [("1", "1")] and "give --dp > 1" in bad[0]["error"]


def test_sweep_resumes_and_workers_agree(capsys, tmp_path):
    out = tmp_path / "sw"
    rc, _, _ = run_cli(capsys, "sweep", *BASE, "--out", str(out), "--workers", "1")
    rows = read_rows(out / "sweep.csv")
    assert rc == 0 and len(rows) == 8
    # mark a finished point: a rerun with a bigger grid must keep it (skipped), and add only the new ones
    rows[0]["iteration_time"] = "123.0"
    with open(out / "sweep.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, COLUMNS)
        w.writeheader()
        w.writerows(rows)
    rc, text, _ = run_cli(capsys, "sweep", *BASE[:5], "2,4", *BASE[6:], "--out", str(out), "--workers", "2")
    again = read_rows(out / "sweep.csv")
    key = lambda r: tuple(r[k] for k in ("schedule", "devices", "microbatches", "dp", "micro_batch"))  # noqa: E731
    marked = key(rows[0])
    assert rc == 0 and len(again) == 16 and "16 points" in text
    assert next(r for r in again if key(r) == marked)["iteration_time"] == "123.0"
    # what the two processes ran equals what one process runs
    fresh = tmp_path / "one"
    run_cli(capsys, "sweep", *BASE[:5], "2,4", *BASE[6:], "--out", str(fresh), "--workers", "1")
    ref = read_rows(fresh / "sweep.csv")
    assert [r for r in again if key(r) != marked] == [r for r in ref if key(r) != marked]


def test_sweep_figures_and_pareto(tmp_path):
    rows = run_sweep(Grid(schedules=("dapple", "zb-v"), devices=(2, 4), microbatches=(4,), dp=(1,)),
                     Job(layout=Layout(schedule="dapple", devices=2, microbatches=4), unit_costs=True), tmp_path,
                     workers=1)
    # each point's time is the dependency timing of its schedule under unit costs (schedules.analysis)
    from schedules import build
    from schedules.analysis import unit_summary
    assert [(r["schedule"], int(r["devices"]), float(r["iteration_time"])) for r in rows] == [
        (s, D, unit_summary(build(s, D, 4))["makespan"]) for s in ("dapple", "zb-v") for D in (2, 4)]
    assert not any(r["error"] for r in rows)
    for fig in ("throughput.png", "pareto.png"):      # drawn figures, not empty files
        data = (tmp_path / fig).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, fig
    # (time, memory): b and c are on the front, a is beaten by b in both, d ties c's time with more memory
    assert pareto_front([(2.0, 5.0), (1.0, 4.0), (3.0, 1.0), (3.0, 2.0)]) == [1, 2]


@pytest.mark.parametrize("argv,msg", [
    (("--devices", "4,x"), "--devices/-D: expected comma-separated integers >= 1"),
    (("--devices", "0"), "--devices/-D: expected comma-separated integers >= 1"),
    (("--workers", "0"), "argument --workers: must be an integer >= 1"),
    (("-c", "dgx-a100-ib:0"), "whole number >= 1"),
    (("--nodes", "-2"), "argument --nodes: must be an integer >= 1"),
    (("--oversubscription", "nan"), "argument --oversubscription: must be a number in [1, 1e+06]"),
    (("--schedules", "nope"), "unknown schedule 'nope'"),
    (("--zero", "0,4"), "--zero: expected comma-separated values out of 0, 1, 2, 3; got '0,4'"),
    (("--recompute", "none,most"), "--recompute: expected comma-separated values out of none, selective, full"),
    (("--tp", "1,0"), "--tp: expected comma-separated integers >= 1"),
])
def test_sweep_user_errors(capsys, tmp_path, argv, msg):
    args = {"--devices": "4", "--microbatches": "8", "--out": str(tmp_path / "o")}
    for k, v in zip(argv[::2], argv[1::2]):
        args[k] = v
    rc, _, err = run_cli(capsys, "sweep", *[x for kv in args.items() for x in kv], "--no-figures")
    assert rc == 2 and msg in err and len(err.strip().splitlines()) == 1


def test_sweep_out_must_be_writable(capsys, tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    rc, _, err = run_cli(capsys, "sweep", "--devices", "2", "--microbatches", "2", "--out", str(f))
    assert rc == 2 and "argument --out" in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_sweep_on_a_local_ray(tmp_path):
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        grid = Grid(schedules=("dapple", "bitpipe"), devices=(2, 3), microbatches=(4,), dp=(1, 2))
        common = Job(layout=Layout(schedule="dapple", devices=2, microbatches=4), model="gpt3-1.3b",
                     cluster="dgx-a100-4x8-ib")
        on_ray = run_sweep(grid, common, tmp_path / "ray", use_ray=True, figures=False)
    finally:
        ray.shutdown()
    local = run_sweep(grid, common, tmp_path / "local", workers=1, figures=False)
    assert on_ray == local and len(on_ray) == 8 and sum(bool(r["error"]) for r in on_ray) == 2


def test_ray_missing_is_one_line_and_exit_2(capsys, tmp_path, monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "ray", None)       # import ray -> ImportError, as without it installed
    rc, _, err = run_cli(capsys, "sweep", "-s", "dapple", "-D", "2", "-N", "2", "-m", "tiny", "--ray",
                         "--no-figures", "--out", str(tmp_path / "sw"))
    assert rc == 2 and err.strip() == "pipetwin: error: --ray needs Ray: pip install 'pipetwin[ray]'"


@pytest.mark.long
def test_sweep_on_ray_resumes_after_a_kill(tmp_path):
    """A sweep on a local Ray killed (SIGKILL of its main process) once some rows are in: Ray's
    processes end after it (its workers at once, its agents once they see their raylet gone: about
    a minute here), a rerun on Ray completes the folder, and the table and records are those of a
    sweep run whole on one local process."""
    import signal
    import subprocess
    import sys
    import time

    from tests.test_any_folder_and_kill import MAIN, _descendants, _survivors
    pytest.importorskip("ray")
    grid = ["sweep", "-s", "dapple,gpipe,zb-h1", "-D", "2,4", "-N", "8,16,32", "--dp", "1,2", "--zero", "0,1",
            "-m", "gpt3-1.3b", "-c", "dgx-a100-4x8-ib", "--no-figures", "--no-progress"]
    out = tmp_path / "ray"
    p = subprocess.Popen([sys.executable, "-c", MAIN, *grid, "--ray", "--out", str(out)], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True)
    below: dict[int, int] = {}
    try:
        deadline = time.monotonic() + 180
        table = out / "sweep.csv"
        while time.monotonic() < deadline and p.poll() is None:
            if table.exists() and table.read_text().count("\n") >= 4:
                break
            time.sleep(0.1)
        below = _descendants(p.pid)
        assert p.poll() is None, "the sweep ended before it could be killed"
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=15)
        deadline = time.monotonic() + 120
        while (left := _survivors(below)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert left == [], f"left running after SIGKILL of the sweep: {left}"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)        # nothing of a failed test left behind
    before = read_rows(out / "sweep.csv")
    assert 3 <= len(before) < 72
    rc = subprocess.run([sys.executable, "-c", MAIN, *grid, "--ray", "--out", str(out)], capture_output=True,
                        text=True, timeout=600)
    assert rc.returncode == 0, rc.stderr
    assert "sweep: 72 points" in rc.stdout
    ref = tmp_path / "ref"
    assert main(grid + ["--workers", "1", "--out", str(ref)]) == 0
    assert read_rows(out / "sweep.csv") == read_rows(ref / "sweep.csv")
    assert _records(out / "sweep.jsonl") == _records(ref / "sweep.jsonl")


SMALL = ("sweep", "-s", "dapple,gpipe", "-D", "2", "-N", "2,4", "-m", "tiny", "--no-figures", "--workers", "1")


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_sweep_folder_holds_one_experiment(capsys, tmp_path):
    """Another model (cluster, recompute, ...) into the same --out is refused and changes nothing;
    the same experiment with its defaults written out resumes (a marked row is kept, not rerun)."""
    out = tmp_path / "sw"
    assert run_cli(capsys, *SMALL, "--out", str(out))[0] == 0
    rows = read_rows(out / "sweep.csv")
    rows[1]["iteration_time"] = "123.0"
    with open(out / "sweep.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, COLUMNS)
        w.writeheader()
        w.writerows(rows)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    rc, _, err = run_cli(capsys, *SMALL[:-4], "gpt-96", *SMALL[-3:], "--out", str(out))
    assert rc == 2 and err.count("\n") == 1
    assert f"--out {out} holds the results of another experiment (model 'tiny' there, 'gpt-96' here)" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    rc, text, _ = run_cli(capsys, *SMALL, "-c", "dgx-a100-4x8-ib", "--cost-model", "kernels", "--out", str(out))
    assert rc == 0 and "4 points (4 ran" in text
    assert read_rows(out / "sweep.csv")[1]["iteration_time"] == "123.0"
    meta = json.loads((out / "sweep.json").read_text())
    assert meta["job"]["model"] == "tiny" and meta["job"]["cluster"]["name"] == "dgx-a100-4x8-ib"
    assert meta["grid"]["microbatches"] == [2, 4]


def test_sweep_drops_a_half_written_row_and_reruns_it(capsys, tmp_path):
    """A sweep killed in the middle of a write: the cut row (and a cut JSONL line, and a record
    whose row never came) are dropped, the point is run again, nothing is counted twice."""
    out, ref = tmp_path / "sw", tmp_path / "ref"
    grid = ("sweep", "-s", "dapple,bitpipe", "-D", "2,3", "-N", "2", "-m", "tiny", "--no-figures", "--workers", "1")
    assert run_cli(capsys, *grid, "--out", str(ref))[0] == 0
    assert run_cli(capsys, *grid, "--out", str(out))[0] == 0
    table, jsonl = out / "sweep.csv", out / "sweep.jsonl"
    text = table.read_text()
    last = text.rstrip("\r\n").rsplit("\n", 1)[1]
    assert last.startswith("bitpipe,3,2,1,1,0,none,,1,,,,,,bitpipe needs")   # the impossible point comes last
    table.write_text(text[:len(text) - len(last) // 2 - 2])         # cut in its error: all 15 fields there
    lines = jsonl.read_text().splitlines()
    jsonl.write_text("\n".join(lines) + "\n" + lines[-1][:50])      # a record repeated and cut
    rc, out_text, err = run_cli(capsys, *grid, "--out", str(out))
    assert rc == 0, err
    assert "4 points (3 ran, 1 impossible)" in out_text
    assert read_rows(table) == read_rows(ref / "sweep.csv")
    assert read_rows(table)[-1]["error"] == "bitpipe needs an even number of devices; got 3"
    assert _records(jsonl) == _records(ref / "sweep.jsonl") and len(_records(jsonl)) == 3


def test_a_second_sweep_on_the_same_folder_is_refused(capsys, tmp_path):
    """While one sweep holds --out (its lock), another is refused with one line; after it, it runs."""
    from experiments.sweep import folder_lock
    out = tmp_path / "sw"
    out.mkdir()
    with folder_lock(out):
        rc, _, err = run_cli(capsys, *SMALL, "--out", str(out))
        assert rc == 2 and err.count("\n") == 1
        assert f"--out {out} is being written by another sweep (pid {os.getpid()})" in err
        assert not (out / "sweep.csv").exists()
    rc, text, _ = run_cli(capsys, *SMALL, "--out", str(out))
    assert rc == 0 and len(read_rows(out / "sweep.csv")) == 4 and len(_records(out / "sweep.jsonl")) == 4


def test_a_sweep_of_impossible_points_only_exits_2(tmp_path, capsys):
    """Every point impossible (T = 16 does not divide tiny's 4 heads): the reasons, then one error
    line and exit status 2, and no figures claimed."""
    rc = main(["sweep", "-s", "dapple", "-D", "2", "-N", "2", "--tp", "16", "-c", "dgx-a100-4x8-ib", "-m", "tiny",
               "--out", str(tmp_path / "sw"), "--no-progress", "--workers", "1"])
    out, err = capsys.readouterr()
    assert rc == 2 and "impossible: dapple D=2 N=2" in out and "wrote figures" not in out
    assert err.strip().splitlines() == ["pipetwin: error: none of the 1 points can run (each is listed above with its "
                                        "reason); change the grid"]


def _moe_yaml(tmp_path):
    from tests.test_planner_moe import MOE
    path = tmp_path / "moe.yaml"
    path.write_text("\n".join(f"{k}: {v}" for k, v in MOE.__dict__.items() if v is not None and v is not False)
                    + "\n")
    return str(path)


def test_sweep_ep_axis_equals_simulate_json(capsys, tmp_path):
    """EP is an axis (CSV column ep): each point's record is `simulate --json --ep E`; an EP that does
    not fold onto the point's T x R is that point's error."""
    out, model = tmp_path / "sw", _moe_yaml(tmp_path)
    rc, text, _ = run_cli(capsys, "sweep", "-s", "dapple", "-D", "2", "-N", "4", "--dp", "2", "--ep", "1,2,4",
                          "-m", model, "-c", "dgx-h100-ib:1", "--no-figures", "--workers", "1", "--out", str(out))
    assert rc == 0 and "3 points (2 ran, 1 impossible)" in text
    rows = read_rows(out / "sweep.csv")
    assert list(rows[0]) == COLUMNS and [r["ep"] for r in rows] == ["1", "2", "4"]
    assert rows[2]["error"] == ("--ep 4 x --etp 1 must divide the stage's T x R = 1 x 2 GPUs the experts fold onto; "
                                "pick --ep/--etp that divide 2, or more --dp")
    assert "impossible: dapple D=2 N=4 R=2 T=1 zero=0 recompute=none EP=4: --ep 4 x --etp 1" in text
    rec = next(json.loads(line)["record"] for line in (out / "sweep.jsonl").read_text().splitlines()
               if json.loads(line)["point"]["ep"] == "2")
    rc, js, _ = run_cli(capsys, "simulate", "-s", "dapple", "-D", "2", "-N", "4", "--dp", "2", "--ep", "2",
                        "-m", model, "-c", "dgx-h100-ib:1", "--json")
    assert rc == 0 and rec == json.loads(js) and rec["ep"] == 2
    assert float(rows[1]["iteration_time"]) == rec["iteration_time"]


def test_a_sweep_folder_of_an_older_grid_is_refused(capsys, tmp_path):
    """A folder written before EP was an axis (its grid without ep, its table without the column) is
    refused with one line, and left as it was."""
    out = tmp_path / "sw"
    assert run_cli(capsys, *SMALL, "--out", str(out))[0] == 0
    meta = json.loads((out / "sweep.json").read_text())
    del meta["grid"]["ep"]
    (out / "sweep.json").write_text(json.dumps(meta))
    rows = read_rows(out / "sweep.csv")
    with open(out / "sweep.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, [c for c in COLUMNS if c != "ep"], extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    rc, _, err = run_cli(capsys, *SMALL, "--out", str(out))
    assert rc == 2 and err.count("\n") == 1
    assert err.startswith(f"pipetwin: error: --out {out} holds a sweep whose grid has other axes (devices, dp, "
                          f"micro_batch, microbatches, recompute, schedules, tp, zero; this pipetwin's: devices, dp, "
                          f"ep, micro_batch, microbatches, recompute, schedules, tp, zero), written by another "
                          f"version of pipetwin; give another --out"), err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
