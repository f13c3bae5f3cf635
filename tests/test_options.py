"""The one option table (experiments/options.py): the same field takes the same grammar in every
command and lands in the same record field; plan's default search; one cluster namespace."""
from __future__ import annotations

import dataclasses
import json

import pytest

from cost_models import load_cluster
from cost_models.job import ClusterChoice, Faults, Job, Layout
from cost_models.parallel import Parallel
from executor.config import RunConfig
from experiments.cli import build_parser, main
from experiments.options import AUTO, COMMANDS, LIST, SCALAR, table

RECORDS = {"Layout": Layout, "Parallel": Parallel, "Job": Job, "ClusterChoice": ClusterChoice, "Faults": Faults,
           "RunConfig": RunConfig}


def parse(*argv):
    return build_parser().parse_args(list(argv))


def test_every_row_fills_a_field_of_its_record():
    for key, opt in table().items():
        if opt.field is None:
            continue
        names = {f.name for f in dataclasses.fields(RECORDS[opt.record])}
        assert opt.attr in names, (key, opt.field)


def test_each_command_takes_each_row_once_in_one_grammar():
    for cmd, uses in COMMANDS.items():
        keys = [u.key for u in uses]
        assert len(keys) == len(set(keys)), cmd
        assert {u.grammar for u in uses} <= {SCALAR, LIST, AUTO}
        flags = [f for u in uses for f in table()[u.key].flags + u.extra_flags]
        assert len(flags) == len(set(flags)), cmd


def test_tp_is_one_field_in_four_grammars():
    """--tp 2 in simulate and run, --tp 1,2 in sweep, --tp auto / 2,4 in plan: Parallel.tp."""
    from experiments.cmd_plan import search_of
    from experiments.cmd_run import job_of_run
    from experiments.cmd_sweep import grid_of
    from experiments.jobs import check_plan_args, job_from_args
    from experiments.plan_layout import space_from_args

    a = parse("simulate", "-s", "1f1b", "-D", "4", "-N", "8", "--tp", "2", "-m", "llama3-8b")
    check_plan_args(a)
    assert job_from_args(a).parallel.tp == 2
    r = parse("run", "-s", "1f1b", "-D", "2", "-N", "4", "--tp", "2")
    check_plan_args(r)
    assert job_of_run(r).parallel.tp == 2
    s = parse("sweep", "-s", "1f1b", "-D", "2,4", "-N", "8", "--tp", "1,2", "-m", "tiny", "--out", "/tmp/x")
    grid, base = grid_of(s)
    jobs = grid.jobs(base)
    assert [(j.layout.devices, j.parallel.tp) for j in jobs] == [(2, 1), (2, 2), (4, 1), (4, 2)]
    p = parse("plan", "-m", "llama3-8b", "-c", "dgx-h100-ib:2", "-G", "64", "--tp", "2,4", "-D", "2,4")
    space = space_from_args(p)
    assert (space.tp, space.devices) == ((2, 4), (2, 4)) and search_of(p) == "layout"
    from planner.layout import candidates
    from cost_models import load_model
    got = {(j.parallel.tp, j.layout.devices) for j in candidates(load_model("llama3-8b"),
                                                                 load_cluster("dgx-h100-ib:2"), 64, space)}
    assert got == {(2, 2), (2, 4), (4, 2), (4, 4)}
    auto = space_from_args(parse("plan", "-m", "llama3-8b", "-c", "dgx-h100-ib:2", "-G", "64", "--tp", "auto"))
    assert auto.tp is None and auto.devices is None
    # one help text: the row's
    helps = {cmd: next(a.help for a in _actions(cmd) if "--tp" in a.option_strings)
             for cmd in ("simulate", "run", "sweep", "plan", "validate", "calibrate", "compare")}
    assert all(h.startswith(table()["tp"].help) for h in helps.values())


def _actions(cmd):
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return sub.choices[cmd]._actions


@pytest.mark.parametrize("argv,err", [
    (["sweep", "-D", "2,0", "-N", "8", "--unit-costs", "--out", "o"],
     "argument --devices/-D: expected comma-separated integers >= 1 (e.g. 4,8); got '2,0' ('0' is not)"),
    (["plan", "-m", "tiny", "-G", "8", "--tp", "2,x"],
     "argument --tp: expected auto or comma-separated integers >= 1 (e.g. 4,8); got '2,x' ('x' is not)"),
    (["simulate", "-s", "1f1b", "-D", "4", "-N", "8", "--tp", "2,4"],
     "argument --tp: must be an integer >= 1; got '2,4'"),
    (["plan", "-m", "tiny", "-G", "8", "--recompute", "auto,full"],
     "argument --recompute: expected auto or comma-separated values out of none, selective, full; got 'auto,full'"),
])
def test_grammar_errors_name_the_option(capsys, argv, err):
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and err in lines[0]


def test_devices_is_pipeline_d_everywhere(capsys):
    from experiments.jobs import check_plan_args, job_from_args
    a = parse("simulate", "-s", "1f1b", "-D", "4", "-N", "8", "--unit-costs")
    check_plan_args(a)
    assert job_from_args(a).layout.devices == 4
    s = parse("sweep", "-D", "2,4", "-N", "8", "--unit-costs", "--out", "o")
    assert s.devices == (2, 4)
    # the GPU budget of old: refused in one line that names --gpus
    assert main(["plan", "-m", "llama3-8b", "-c", "dgx-h100-ib:2", "-G", "64", "--devices", "512"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["pipetwin: error: --devices 512: -D is the pipeline's devices D (at most 16: llama3-8b has 32 "
                   "layers, dgx-h100-ib:2 16 GPUs); the GPU budget is --gpus N"]


def test_plan_with_no_other_option_searches_the_whole_layout(capsys, tmp_path):
    out = tmp_path / "p.json"
    assert main(["plan", "-m", "llama3-8b", "-c", "dgx-h100-ib:2", "-G", "64", "--no-progress", "--top", "1",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("whole-layout plan for llama3-8b on dgx-h100-ib:2 (16 x h100), global batch 64")
    assert printed[1] == "  assumed: sequence 8,192 tokens, precision bf16, cost model kernels"   # then the device
    assert printed[4].split()[:4] == ["tp", "devices", "dp", "schedule"]
    rec = json.loads(out.read_text())
    assert rec["planner"] == "layout"       # a whole-layout plan file (a job), not a DAPPLE plan
    # the same search as --search layout and as --tp auto: the same best layout and time
    assert main(["plan", "-m", "llama3-8b", "-c", "dgx-h100-ib:2", "-G", "64", "--no-progress", "--top", "1",
                 "--tp", "auto", "--json"]) == 0
    best = json.loads(capsys.readouterr().out)["top"][0]
    assert best["iteration_time"] == pytest.approx(rec["simulated"]["iteration_time"], rel=1e-12)


@pytest.mark.parametrize("argv,search", [
    (["-m", "llama3-8b"], "layout"),
    (["-m", "bert-48"], "dapple"),              # a DAPPLE paper model: only the DAPPLE search applies
    (["-m", "vgg-19"], "dapple"),
    (["-m", "tiny", "--no-baselines"], "dapple"),  # an option only the DAPPLE search takes
    (["-m", "tiny", "--search", "dapple"], "dapple"),
    (["-m", "bert-48", "--tp", "auto"], "layout"),
])
def test_which_search(argv, search):
    from experiments.cmd_plan import search_of
    assert search_of(parse("plan", "-c", "v100-2x8-25gbe", "-G", "16", *argv)) == search


def test_clusters_are_one_namespace(capsys):
    """The planner's extra clusters are presets: simulate takes them as plan does, with the same costs
    as the preset they double."""
    assert load_cluster("a100-8x8-ib").num_devices == 64 and load_cluster("v100-4x8-25gbe").num_devices == 32
    times = []
    for c in (["-c", "a100-8x8-ib"], ["-c", "dgx-a100-4x8-ib", "--nodes", "8"]):
        assert main(["simulate", "-s", "1f1b", "-D", "8", "-N", "16", "--dp", "8", "-m", "gpt3-1.3b", "--json",
                     *c]) == 0
        times.append(json.loads(capsys.readouterr().out)["iteration_time"])
    assert times[0] == times[1]


def test_every_parallel_knob_is_fixed_by_a_plan_without_a_line_of_its_own():
    """A knob added to Parallel is refused with --plan (the plan fixes it) with no edit of
    PLAN_FIXES or plan_facts: both take the record's fields; a whole-layout plan at T > 1 still
    takes the --tp-overlap what-if."""
    from dataclasses import fields
    from cost_models import load_model
    from experiments.jobs import PLAN_FIXES, plan_facts
    from planner.plan_io import LayoutPlan
    knobs = {f.name for f in fields(Parallel)}
    assert knobs <= {d for d, _ in PLAN_FIXES}
    par = Parallel(tp=2, micro_batch=1, zero=1)
    lay = Job.of(schedule="dapple", devices=2, microbatches=4, replicas=2).layout
    plan = LayoutPlan({"layout": lay, "parallel": par, "device_map": "megatron"}, load_model("tiny"),
                      load_cluster("dgx-h100-ib:1"), {})
    facts = plan_facts(plan)
    assert knobs - set(facts) == {"tp_overlap"}
    assert (facts["tp"], facts["zero"], facts["micro_batch"]) == ("T 2", "zero 1", "micro-batch 1")
