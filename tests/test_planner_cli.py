"""``pipetwin plan``, ``pipetwin simulate --plan`` and ``pipetwin reproduce dapple-planner --quick``."""
from __future__ import annotations

import json

import pytest

from experiments.cli import main
from planner import load_plan


def run_cli(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    rc = main(["plan", "-m", "bert-48", "-c", "v100-2x8-25gbe", "-G", "32", "--uniform", "--top", "2",
               "--no-progress", "--out", str(path), "--json"])
    assert rc == 0
    return path


def test_plan_json_and_file(plan_file, capsys):
    rc, out, _ = run_cli(capsys, "plan", "-m", "bert-48", "-c", "v100-2x8-25gbe", "-G", "32", "--uniform",
                         "--top", "2", "--no-progress", "--json")
    rec = json.loads(out)
    assert rc == 0 and rec["format"] == "pipetwin-plan" and rec["uniform"] is True
    run = rec["run"]
    assert run["devices"] * run["dp"] <= 16 and run["micro_batch"] * run["dp"] * run["microbatches"] == 32
    assert rec["simulated"]["iteration_time"] > 0 and not rec["simulated"]["out_of_memory"]
    base = rec["baselines"]
    assert set(base) == {"dapple", "pipedream", "data_parallel"}
    # the DAPPLE plan is the fastest simulated candidate; the baselines are simulated the same way
    assert base["dapple"]["iteration_time"] == rec["simulated"]["iteration_time"]
    assert base["data_parallel"]["speedup_of_dapple"] > 1
    assert rec["search"]["stage_placements_evaluated"] > 0
    lp = load_plan(plan_file)
    assert lp.plan.uniform and lp.plan.global_batch == 32


def test_plan_human_output(capsys):
    """The human output says what --json says: each stage's layers and replicas, the simulated
    iteration and G / iteration samples per second, each baseline's time and DAPPLE's speedup over it."""
    argv = ["plan", "-m", "vgg-19", "-c", "v100-16x1-25gbe", "-G", "32", "--top", "2", "--no-progress",
            "--schedules", "dapple,gpipe"]
    rc, out, _ = run_cli(capsys, *argv)
    assert rc == 0
    rc, js, _ = run_cli(capsys, *argv, "--json")
    rec = json.loads(js)
    stages = rec["plan"]["stages"]
    lines = out.splitlines()
    head = lines.index(next(x for x in lines if x.startswith("stage ")))
    for k, st in enumerate(stages):      # a row per stage: index, first-last layer, (names,) replicas
        row = lines[head + 2 + k].split()
        assert [row[0], row[1], row[3]] == [str(k), f"{st['layers'][0]}-{st['layers'][1] - 1}", str(st["replicas"])]
    t = rec["simulated"]["iteration_time"]
    assert f"simulated: iteration {t:.3g} s ({32 / t:.1f} samples/s)" in out
    names = {"dapple": "DAPPLE planner", "pipedream": "PipeDream planner", "data_parallel": "data parallel"}
    for key, name in names.items():
        b = rec["baselines"][key]
        row = next(x for x in lines if x.startswith(name + " ") and x.endswith("x"))
        assert row.split()[-2:] == [f"{b['iteration_time']:.4g}", f"{b['speedup_of_dapple']:.2f}x"], row


def test_simulate_plan(plan_file, capsys):
    rc, out, _ = run_cli(capsys, "simulate", "--plan", str(plan_file), "--json")
    rec = json.loads(out)
    assert rc == 0 and rec["plan_file"] == str(plan_file) and rec["cost_model"] == "planner"
    want = json.loads(plan_file.read_text())["simulated"]["iteration_time"]
    assert rec["iteration_time"] == pytest.approx(want)
    assert rec["out_of_memory"] is False


@pytest.mark.parametrize("argv,msg", [
    (["simulate", "-D", "2", "-N", "2", "--unit-costs"], "give --schedule (or --plan PLAN.json)"),
    (["plan", "-m", "bert-48", "-c", "v100-2x8-25gbe", "-G", "16", "--schedules", "nope"], "unknown schedule 'nope'"),
    (["plan", "-m", "nope", "-c", "v100-2x8-25gbe", "-G", "16"], "unknown model preset 'nope'"),
    (["plan", "-m", "bert-48", "-c", "v100-2x8-25gbe", "-G", "16", "--memory-limit", "lots"], "memory-limit"),
])
def test_errors_are_one_line(capsys, argv, msg):
    rc, _, err = run_cli(capsys, *argv)
    assert rc == 2 and msg in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_reproduce_quick(tmp_path, capsys):
    rc, out, _ = run_cli(capsys, "reproduce", "dapple-planner", "--quick", "--out", str(tmp_path))
    assert rc == 0 and "up to 3.23x" in out
    d = tmp_path / "dapple-planner"
    for f in ("report.md", "planner_comparison.csv", "scaling_25gbe.csv", "dapple_planner.png"):
        assert (d / f).exists()
    import pandas as pd
    t = pd.read_csv(d / "planner_comparison.csv")
    # the DAPPLE plan is never slower than the baselines it is searched against
    assert (t.speedup_over_data_parallel >= 1 - 1e-9).all()
    assert (t.speedup_over_pipedream_best_m >= 0.97).all()
    # DAPPLE's own profiles, both cost models, the paper's numbers beside ours and the term per row
    assert set(t.cost_model) == {"linear", "kernels"} and (t.paper_dp_mean == 1.71).all()
    assert t.data_parallel_term.str.contains("all-reduce").all()
    k = t.set_index(["model", "cost_model"]).dapple_M
    assert k["bert-48", "kernels"] < k["bert-48", "linear"]
    assert "Where we differ from the paper" in out
