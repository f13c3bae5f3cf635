import json
import subprocess
import sys

import pytest

from experiments.cli import main


def run_cli(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_simulate_json_unit_costs(capsys):
    rc, out, _ = run_cli(capsys, "simulate", "--schedule", "bitpipe", "--devices", "4", "--microbatches", "4",
                         "--unit-costs", "--json")
    assert rc == 0
    rec = json.loads(out)
    assert rec["schedule"] == "bitpipe" and rec["devices"] == 4 and rec["microbatches"] == 4
    assert rec["iteration_time"] == pytest.approx(14.0)
    assert rec["bubble_ratio"] == pytest.approx(2 / 14)
    assert [p["peak_activation"] for p in rec["per_device"]] == [3.5, 4.0, 4.0, 3.5]
    assert set(rec["per_device"][0]) >= {"device", "busy", "bubble_ratio", "peak_activation", "peak_memory"}


def test_simulate_writes_outputs(capsys, tmp_path):
    png, js = tmp_path / "t.png", tmp_path / "t.json"
    rc, out, _ = run_cli(capsys, "simulate", "-s", "chimera", "-D", "4", "-N", "8", "--unit-costs",
                         "--plot", str(png), "--chrome-trace", str(js))
    assert rc == 0 and "bubble 0.2000" in out   # released direct concatenation: (K+1)(D-2) = 6 of 30
    assert png.stat().st_size > 10_000 and json.loads(js.read_text())["traceEvents"]


def test_compare_table_and_figure(capsys, tmp_path):
    rc, out, _ = run_cli(capsys, "compare", "-D", "4", "-N", "4", "--unit-costs", "--json",
                         "--plot", str(tmp_path / "c.png"))
    assert rc == 0
    rows = {r["schedule"]: r for r in json.loads(out)["schedules"]}
    assert rows["gpipe"]["bubble_ratio"] == pytest.approx(3 / 7)
    assert rows["interleaved"]["bubble_ratio"] == pytest.approx(3 / 11)
    assert (tmp_path / "c.png").exists()


def test_compare_skips_inadmissible(capsys):
    rc, out, _ = run_cli(capsys, "compare", "-D", "3", "-N", "3", "--unit-costs", "--schedules", "dapple,bitpipe")
    assert rc == 0 and "skipped bitpipe: bitpipe needs an even number of devices; got 3" in out


def test_demo_writes_every_schedule_at_its_closed_form(capsys, tmp_path):
    """``pipetwin demo`` (D = 4, N = 8, unit costs F = 1, B = 2 = B + W): its table holds every
    family, GPipe and 1F1B at (N + D - 1)(F + B) = 33 (bubble (D - 1) / (N + D - 1) = 3/11) with
    peak activations N and D, the interleaved 1F1B at 3N + 3(D - 1)/2 = 28.5 and ZB-H1 at
    3N + (D - 1)(F + B - W) = 27; each schedule's Chrome trace holds one F and one B per stage and
    micro-batch (and one W with a split backward) and two messages per micro-batch and stage
    boundary between devices; the bubble table is GPipe's (D - 1)(F + B) = 9 at every N."""
    import csv
    from schedules import names
    rc, _, _ = run_cli(capsys, "demo", "--out", str(tmp_path))
    assert rc == 0
    with open(tmp_path / "table.csv", newline="") as fh:
        rows = {r["schedule"]: r for r in csv.DictReader(fh)}
    assert list(rows) == names()
    D, N = 4, 8
    for name, time, peak in (("gpipe", 33.0, N), ("dapple", 33.0, D), ("interleaved", 28.5, None), ("zb-h1", 27.0, D)):
        assert float(rows[name]["iteration_time"]) == time, name
        assert float(rows[name]["bubble_ratio"]) == pytest.approx(1 - 3 * N / time, abs=1e-12), name
        if peak is not None:
            assert float(rows[name]["peak_activation_max"]) == peak, name
    for name, stages, local, split in (("gpipe", D, 0, False), ("interleaved", 2 * D, 0, False),
                                       ("zb-v", 2 * D, 1, True)):
        events = json.loads((tmp_path / f"{name}.chrome.json").read_text())["traceEvents"]
        count = {k: sum(e.get("cat") == k for e in events) for k in ("F", "B", "W", "SEND", "RECV", "COPY")}
        boundaries = stages - 1 - local
        assert count == {"F": stages * N, "B": stages * N, "W": stages * N if split else 0,
                         "SEND": 2 * N * boundaries, "RECV": 2 * N * boundaries, "COPY": 2 * N * local}, name
    with open(tmp_path / "bubbles.csv", newline="") as fh:
        gpipe = [r for r in csv.DictReader(fh) if r["schedule"] == "gpipe"]
    assert [(int(r["N"]), float(r["bubble"]), float(r["makespan"])) for r in gpipe] == \
        [(n, 9.0, 3.0 * n + 9.0) for n in (4, 8, 12, 16)]


@pytest.mark.slow
@pytest.mark.parametrize("argv,msg", [
    (["simulate", "-s", "bitpipe", "-D", "5", "-N", "10", "--unit-costs"],
     "bitpipe needs an even number of devices; got 5"),
    (["simulate", "-s", "nope", "-D", "2", "-N", "2", "--unit-costs"], "unknown schedule 'nope'"),
    (["simulate", "-s", "interleaved", "-D", "4", "-N", "6", "--unit-costs"], "multiple of the number of devices"),
    (["simulate", "-s", "dapple", "-D", "2", "-N", "2", "--unit-costs", "--slowdown", "9=2"], "ranks 0..1"),
])
def test_user_errors_exit_nonzero_one_line(argv, msg):
    p = subprocess.run([sys.executable, "-m", "experiments", *argv], capture_output=True, text=True)
    assert p.returncode == 2
    assert msg in p.stderr
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_schedules_lists_the_requirements_build_enforces(capsys):
    """Every family is listed once, in order, with its requirement on D and N; for D in 1..6 and N
    in 1..12 a family builds exactly where its listed requirement holds (D even, N a multiple of
    D, N >= 2D; a parenthesis is a remark)."""
    import re

    from schedules import ScheduleError, build, names
    rc, out, _ = run_cli(capsys, "schedules")
    assert rc == 0
    listed = {}
    for line in out.splitlines():
        m = re.match(r"^(\S+)\s+(.*?)\s{2,}", line)
        if m and m.group(1) in names():
            listed[m.group(1)] = m.group(2)
    assert list(listed) == names()
    rules = {"D even": lambda D, N: D % 2 == 0, "N multiple of D": lambda D, N: N % D == 0,
             "N >= 2D": lambda D, N: N >= 2 * D, "D >= 1": lambda D, N: True, "N >= 1": lambda D, N: True,
             "chunks v >= 1": lambda D, N: True}
    assert listed["chimera"] == listed["bitpipe"] == "D even, N multiple of D"
    for name, req in listed.items():
        clauses = [c.strip() for c in re.sub(r"\(.*?\)", "", req).split(",")]
        assert set(clauses) <= set(rules), (name, req)
        for D in range(1, 7):
            for N in range(1, 13):
                try:
                    build(name, D, N)
                    built = True
                except ScheduleError:
                    built = False
                assert built == all(rules[c](D, N) for c in clauses), (name, req, D, N)


def test_simulate_real_costs_reports_out_of_memory(capsys):
    rc, out, _ = run_cli(capsys, "simulate", "-s", "gpipe", "-D", "8", "-N", "64", "-m", "gpt-96",
                         "-c", "dgx-a100-4x8-ib", "--json")
    rec = json.loads(out)
    assert rc == 0 and rec["time_unit"] == "s" and rec["memory_unit"] == "B"
    assert rec["out_of_memory"] is True and "OUT OF MEMORY" in rec["memory_verdict"]
    rc, out, _ = run_cli(capsys, "simulate", "-s", "dapple", "-D", "8", "-N", "64", "-m", "gpt-96", "--json")
    assert json.loads(out)["out_of_memory"] is False


def test_slow_link_slows_the_run(capsys):
    base = ["simulate", "-s", "dapple", "-D", "16", "-N", "16", "-m", "bert-48", "-c", "v100-2x8-25gbe", "--json"]
    rc, out, _ = run_cli(capsys, *base)
    t0 = json.loads(out)["iteration_time"]
    rc, out, _ = run_cli(capsys, *base, "--slow-link", "n0.nic0.out=10")
    assert json.loads(out)["iteration_time"] > t0


@pytest.mark.parametrize("argv,msg", [
    (["--slow-link", "nope=2"], "no link named 'nope'"),
    (["--slow-link", "x"], "expects LINK=FACTOR"),
    (["--cluster", "nope"], "unknown cluster"),
    (["--model", "nope"], "unknown model preset"),
])
def test_real_cost_user_errors(capsys, argv, msg):
    rc, _, err = run_cli(capsys, "simulate", "-s", "dapple", "-D", "4", "-N", "4", *argv)
    assert rc == 2 and msg in err


def test_bubbles_vs_n(capsys, tmp_path):
    rc, out, _ = run_cli(capsys, "bubbles", "-D", "4", "--max-k", "3", "--json", "--plot", str(tmp_path / "b.png"))
    assert rc == 0 and (tmp_path / "b.png").exists()
    rows = {(r["schedule"], r["N"]): r for r in json.loads(out)}
    # Chimera pays D-2 per junction, half a unit's 2(D-2): (K+1)(D-2) = 8 at K = 3, twice K = 1's
    assert rows[("chimera", 12)]["bubble"] == pytest.approx(2 * rows[("chimera", 4)]["bubble"])
    assert rows[("bitpipe-zb", 12)]["bubble"] == pytest.approx(rows[("bitpipe-zb", 4)]["bubble"])
    assert rows[("gpipe", 4)]["bubble_ratio"] == pytest.approx(3 / 7)


def test_simulate_replica_symmetry_and_exact(capsys):
    base = ("simulate", "-s", "dapple", "-D", "4", "-N", "8", "--dp", "4", "-m", "gpt3-1.3b", "--json")
    rc, out, _ = run_cli(capsys, *base)
    one = json.loads(out)
    rc2, out, _ = run_cli(capsys, *base, "--exact")
    full = json.loads(out)
    assert rc == rc2 == 0 and one["simulated_replicas"] == 1 and "full_simulation" not in one
    assert full["simulated_replicas"] == 4 and full["full_simulation"] == "exact simulation asked for"
    assert one["iteration_time"] == pytest.approx(full["iteration_time"], rel=1e-3)
    assert [p["peak_memory"] for p in one["per_device"]] == [p["peak_memory"] for p in full["per_device"]]
    assert len(one["per_device"]) == 16


def test_sized_cluster_and_fabric_options(capsys):
    base = ("simulate", "-s", "dapple", "-D", "8", "-N", "8", "--dp", "4", "-m", "gpt3-1.3b", "--json")
    rc, out, _ = run_cli(capsys, *base, "-c", "dgx-a100-ib:4")
    assert rc == 0 and json.loads(out)["cluster"] == "dgx-a100-ib:4"
    rc, out, _ = run_cli(capsys, *base, "--nodes", "4", "--fabric", "fat-tree", "--nodes-per-leaf", "2",
                         "--oversubscription", "8")
    over = json.loads(out)["iteration_time"]
    rc, out, _ = run_cli(capsys, *base)
    assert over > json.loads(out)["iteration_time"]      # the leaves' uplinks are shared
    rc, _, err = run_cli(capsys, *base, "--nodes", "2")
    assert rc == 2 and "32 ranks" in err and "do not fit" in err


@pytest.mark.parametrize("argv,msg", [
    (("-c", "dgx-h100-ib:0"), "whole number >= 1"),
    (("-c", "dgx-h100-ib:many"), "whole number >= 1"),
    (("--nodes", "0"), "argument --nodes: must be an integer >= 1"),
    (("--oversubscription", "nan", "--fabric", "rail"), "argument --oversubscription: must be a number in [1, 1e+06]"),
    (("--oversubscription", "0.5"), "argument --oversubscription: must be a number in [1, 1e+06]"),
    (("--nodes-per-leaf", "-1"), "argument --nodes-per-leaf: must be an integer >= 1"),
    (("--unit-costs", "--nodes", "4"), "--unit-costs replaces every cost model; drop --nodes"),
])
def test_cluster_option_errors(capsys, argv, msg):
    rc, _, err = run_cli(capsys, "simulate", "-s", "dapple", "-D", "4", "-N", "4", *argv)
    assert rc == 2 and msg in err and len(err.strip().splitlines()) == 1


def test_simulate_output_path_checked_first(capsys, tmp_path):
    rc, _, err = run_cli(capsys, "simulate", "-s", "dapple", "-D", "2", "-N", "2", "--unit-costs",
                         "--trace", str(tmp_path))
    assert rc == 2 and "argument --trace" in err and len(err.strip().splitlines()) == 1


def test_simulate_thousands_of_replicas_as_one(capsys):
    # 2,400 GPUs: beyond the rank limit of a full simulation, fine for one replica standing for all
    rc, out, _ = run_cli(capsys, "simulate", "-s", "dapple", "-D", "4", "-N", "8", "--dp", "600", "-m", "gpt3-1.3b",
                         "-c", "dgx-a100-ib:300", "--json")
    rec = json.loads(out)
    assert rc == 0 and rec["simulated_replicas"] == 1 and len(rec["per_device"]) == 2400


@pytest.mark.slow
def test_run_says_when_the_spec_has_what_the_executor_does_not_train(tmp_path, capsys):
    """The executor's GPT blocks have no dropout and fused attention: a spec with dropout (the gpt
    default) is told so in one line; the tiny preset says what the executor trains, and is not."""
    spec = tmp_path / "gpt-dropout.yaml"
    spec.write_text("name: gd\nkind: gpt\nlayers: 2\nhidden: 32\nheads: 4\nseq_len: 8\nvocab: 64\nmicro_batch: 2\n"
                    "dtype_bytes: 4\n")
    note = "note: trained without dropout, with fused attention"
    assert main(["run", "-s", "dapple", "-D", "2", "-N", "2", "--steps", "1", "-m", str(spec)]) == 0
    assert note in capsys.readouterr().out
    assert main(["run", "-s", "dapple", "-D", "2", "-N", "2", "--steps", "1"]) == 0
    assert note not in capsys.readouterr().out
