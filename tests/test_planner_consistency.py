"""One plan, one split, one cost model everywhere: the command ``pipetwin plan`` prints runs as
printed and trains the split the plan and ``simulate --plan`` use; the planner's answer is never
slower than the default split of the shape it picked; Python and the CLI plan alike."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from cost_models import load_cluster
from cost_models.partition import blocks_from_layers
from experiments.cli import main
from experiments.plan_files import config_from_plan
from planner import load_plan, plan_training

ROOT = Path(__file__).resolve().parents[1]


def _cli(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    assert rc == 0, err
    return out


@pytest.fixture(scope="module")
def zbv(tmp_path_factory):
    path = tmp_path_factory.mktemp("zbv") / "zbv.json"
    rc = main(["plan", "-m", "tiny", "-c", "dgx-a100-ib:1", "-G", "8", "--schedules", "zb-v", "--gpus", "4",
               "--no-progress", "--no-baselines", "--out", str(path)])
    assert rc == 0
    return path


def test_zbv_plan_split_is_the_simulated_and_run_split(zbv, capsys):
    plan = load_plan(zbv)
    assert plan.plan.schedule == "zb-v" and plan.plan.num_stages == 2
    # zb-v holds 2 x D = 4 stages: the plan states their split, the simulator and the run use it
    assert plan.plan.split == (3, 2, 2, 3) and plan.record["run"]["partition"] == [3, 2, 2, 3]
    sim = json.loads(_cli(capsys, "simulate", "--plan", str(zbv), "--json"))
    assert sim["partition"] == [3, 2, 2, 3] and "3|2|2|3" in sim["plan"]
    cfg, low, info = config_from_plan(str(zbv), steps=1)
    assert low.num_stages == 4 and list(cfg.blocks) == blocks_from_layers([3, 2, 2, 3], 8)
    assert info["partition_layers"] == [3, 2, 2, 3]
    # the plan's simulated time is the plain simulate of the same job with the same split
    plain = json.loads(_cli(capsys, "simulate", "-s", "zb-v", "-D", "2", "-N", "1", "-m", "tiny", "-c",
                            "dgx-a100-ib:1", "--micro-batch", "8", "--partition", "3,2,2,3", "--json"))
    assert plain["iteration_time"] == pytest.approx(sim["iteration_time"], rel=1e-9)
    assert plan.record["simulated"]["iteration_time"] == pytest.approx(sim["iteration_time"], rel=1e-9)


@pytest.mark.slow
def test_printed_command_runs_as_printed(zbv, capsys, tmp_path):
    main(["plan", "-m", "tiny", "-c", "dgx-a100-ib:1", "-G", "8", "--schedules", "zb-v", "--gpus", "4",
          "--no-progress", "--no-baselines"])
    out = capsys.readouterr().out
    lines = out.splitlines()
    i = lines.index("executor (or pipetwin run --plan FILE):") + 1
    text = lines[i]
    while text.endswith("\\"):         # continued as a shell continues it
        i += 1
        text = text[:-1] + lines[i]
    assert max(map(len, lines)) <= 120
    cmd = shlex.split(text)
    assert cmd[:2] == ["pipetwin", "run"]
    argv = cmd[2:] + ["--steps", "1", "--json"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-m", "experiments", "run", *argv], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-2000:]
    rec = json.loads(p.stdout)
    cfg, low, _ = config_from_plan(str(zbv), steps=1)
    # the printed command trains what run --plan trains: schedule, layout, micro-batch, split
    assert (rec["schedule"], rec["devices"], rec["microbatches"], rec["replicas"], rec["micro_batch"]) == \
        (cfg.layout.schedule, cfg.layout.devices, cfg.layout.microbatches, cfg.layout.replicas,
         cfg.parallel.micro_batch) == ("zb-v", 2, 1, 1, 8)
    assert rec["partition"] == list(cfg.blocks) == [2, 2, 2, 2]
    assert len(rec["losses"]) == 1 and 0 < rec["losses"][0] < 10, shlex.join(cmd)


@pytest.mark.parametrize("sched, cl, G", [("dapple", "dgx-a100-ib:1", 16), ("zb-v", "dgx-a100-ib:2", 128)])
def test_best_plan_is_never_slower_than_the_default_split(sched, cl, G, capsys):
    # zb-v on 2 x 8 A100s: the plan R=16 x D=1, M=2; the work-balanced split of zb-v's 2 stages alone
    # was 0.70265 s, the default split 0.70155 s (the planner now tries both)
    cluster = load_cluster(cl)
    res = plan_training("gpt3-1.3b", cluster, G, schedules=(sched,), top_k=2, baselines=False)
    best = res.best.plan
    assert best.schedule == sched and best.uniform
    D, N, R = best.num_stages, best.microbatches, best.dp
    default = json.loads(_cli(capsys, "simulate", "-s", sched, "-D", str(D), "-N", str(N), "--dp", str(R),
                              "-m", "gpt3-1.3b", "-c", cl, "--micro-batch",
                              str(best.micro_batch // R), "--json"))
    assert res.best.time <= default["iteration_time"] * (1 + 1e-9)
    assert res.workload.cost_model == "kernels"     # every command's default on an A100


def test_python_and_cli_plan_with_one_cost_model(capsys):
    cluster = load_cluster("v100-2x8-25gbe")
    py = plan_training("bert-48", cluster, 32, top_k=2, baselines=False, space=None)
    cli = json.loads(_cli(capsys, "plan", "-m", "bert-48", "-c", "v100-2x8-25gbe", "-G", "32", "--top", "2",
                          "--no-baselines", "--no-progress", "--json"))
    assert py.workload.cost_model == "kernels"
    assert cli["plan"] == py.best.plan.to_dict()
    assert cli["simulated"]["iteration_time"] == pytest.approx(py.best.time, rel=1e-12)
