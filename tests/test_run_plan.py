"""``pipetwin run --plan``: planner plans on the executor, against the single-process reference.

The DAPPLE planner plans the ``tiny`` GPT on two small V100 clusters: a uniform plan (2 replicas of
a 2-stage pipeline, uneven partition) and a non-uniform one (stage replicas 1:2:1, run through the
planner's model copies); a third job runs the uniform plan with the interleaved schedule (4 stages
per copy: the planner's own re-partition). The three share one spawn of 4 ranks, train 3 SGD steps
and must match the reference (same model, same global batch) within 1e-5 relative, losses and every
final parameter; each rank's static memory must be that of the blocks the plan puts on it (copies of
one stage on a rank share one module).
"""
import json

import pytest
import torch

from cost_models import LINK_TYPES, Cluster, load_device
from cost_models.partition import block_ranges, blocks_from_layers
from executor.config import RunConfig, lowered_schedule
from executor.launch import run_many
from executor.model import full_model, stage_module
from executor.reference import run_reference
from experiments.cli import main as cli_main
from experiments.plan_files import config_from_plan
from cost_models import load_workload
from planner import Plan, SearchSpace, StagePlan, Topology, plan_training, save_plan

V100 = load_device("v100")
BASE = dict(steps=3, optimizer="sgd", lr=0.05, collect_params=True, timeout=30.0)


def _cluster(nodes, dpn, inter):
    return Cluster(name="small", nodes=nodes, devices_per_node=dpn, device=V100, intra=LINK_TYPES["nvlink2"],
                   inter=LINK_TYPES[inter])


def _planned(cluster, G, space, wanted, fallback):
    """The planner's plan for tiny (analytical ranking: fast and deterministic); if a planner change
    ever picks another shape, the same shape built with the planner's placement instead."""
    res = plan_training("tiny", cluster, G, simulate=False, baselines=False, space=space, top_k=1, cost_model="linear")
    p = res.best.plan
    return (p if wanted(p) else fallback(Topology(cluster))), res.workload


def _plans(tmp):
    """{name: plan file}: uniform 2 x 2 (uneven), non-uniform 1:2:1, the uniform one interleaved."""
    out = {}
    cu = _cluster(2, 2, "ib-edr")
    pu, wu = _planned(cu, 8, SearchSpace(uniform=True, replicas=(2,)),
                      lambda p: p.uniform and p.dp == 2 and len(set(p.partition)) > 1,
                      lambda t: Plan("tiny", cu.name, 8, 4, tuple(StagePlan(a, b, d) for (a, b), d in zip(
                          [(0, 6), (6, 10)], t.place("fresh-first", [2, 2]))), "fresh-first"))
    cn = _cluster(1, 4, "eth-25g")
    pn, wn = _planned(cn, 8, SearchSpace(), lambda p: not p.uniform,
                      lambda t: Plan("tiny", cn.name, 8, 4, tuple(StagePlan(a, b, d) for (a, b), d in zip(
                          [(0, 4), (4, 8), (8, 10)], t.place("append-first", [1, 2, 1]))), "append-first"))
    for name, p, w, c in (("uniform", pu, wu, cu), ("nonuniform", pn, wn, cn),
                          ("interleaved", pu.with_schedule("interleaved", 2), wu, cu)):
        out[name] = tmp / f"{name}.json"
        save_plan(out[name], p, w, c)
    return out


@pytest.fixture(scope="module")
def plan_files(tmp_path_factory):
    return _plans(tmp_path_factory.mktemp("plans"))


@pytest.fixture(scope="module")
def plan_runs(plan_files):
    """{name: (plan file, config, lowered schedule, executor result, reference result)}."""
    files = plan_files
    jobs = {name: config_from_plan(path, **BASE) for name, path in files.items()}
    results = run_many([(cfg, low) for cfg, low, _ in jobs.values()])
    return {name: (files[name], cfg, low, res, run_reference(cfg))
            for (name, (cfg, low, _)), res in zip(jobs.items(), results)}


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["uniform", "nonuniform", "interleaved"])
def test_plan_run_equals_reference(plan_runs, name):
    path, cfg, low, res, ref = plan_runs[name]
    rec = json.loads(path.read_text())
    G = rec["plan"]["global_batch"]
    # the run and its reference train on the plan's global batch
    assert cfg.global_microbatches * cfg.spec().micro_batch == G
    assert low.replicas * low.num_microbatches == cfg.global_microbatches
    reps = [s["replicas"] for s in rec["plan"]["stages"]]
    if name == "uniform":
        assert reps == [2, 2] and cfg.layout.replicas == 2 and len(set(cfg.blocks)) > 1
        assert list(cfg.blocks) == blocks_from_layers([b - a for a, b in (s["layers"] for s in
                                                                              rec["plan"]["stages"])], 8)
    if name == "nonuniform":
        assert len(set(reps)) > 1 and low.num_copies > 1 and low.num_ranks == sum(reps)
    if name == "interleaved":
        assert low.num_stages == 4 and len(cfg.blocks) == 4
    assert len(res.losses) == len(ref.losses) == 3
    for got, want in zip(res.losses, ref.losses):
        assert abs(got - want) <= 1e-5 * abs(want), (res.losses, ref.losses)
    by_name = {}
    for key, t in res.params.items():
        by_name.setdefault(key.split("/", 1)[1], []).append(t)
    assert set(by_name) == set(ref.params)
    for pname, tensors in by_name.items():
        assert len(tensors) == low.num_copies * low.replicas, pname
        assert max(_rel(t, ref.params[pname]) for t in tensors) <= 1e-5, pname
    # each rank holds the blocks the plan gives it, once per stage however many copies of it it
    # runs (the planner's memory model): weights + gradients + SGD momentum, 12 B per parameter
    spec = cfg.spec()
    for dev in res.per_device:
        r = dev["device"]
        n = sum(p.numel() for s in {s for _, s in low.stages_on(low.rank_device(r))}
                for p in stage_module(spec, low.num_stages, s, partition=cfg.blocks).parameters())
        assert dev["static_bytes"] == 12 * n, (name, r)


def test_partition_conversion_and_checks():
    assert blocks_from_layers([6, 4], 8) == [5, 3]
    assert blocks_from_layers([1, 8, 1], 8) == [0, 8, 0]
    assert blocks_from_layers([10], 8) == [8]
    assert [len(r) for r in block_ranges(8, 3, [0, 8, 0])] == [0, 8, 0]
    for bad, msg in (([5, 4], "covers 9 layers"), ([0, 10], "without layers")):
        with pytest.raises(ValueError, match=msg):
            blocks_from_layers(bad, 8)
    for bad, msg in (([4, 4], "2 stage"), ([4, 0, 4], "stage 1 without layers"), ([3, 3, 3], "covers 9 blocks"),
                     ([4.5, 1.5, 2], "whole block counts")):
        with pytest.raises(ValueError, match=msg):
            block_ranges(8, 3, bad)
    with pytest.raises(ValueError, match="partition"):
        lowered_schedule(RunConfig.of(devices=2, microbatches=2, partition=(4, 3)))
    with pytest.raises(ValueError, match="--micro-batch must be an integer >= 1; got 0"):
        RunConfig.of(micro_batch=0)
    # identical initial weights for any split
    spec = RunConfig.of(micro_batch=1).spec()
    assert spec.micro_batch == 1
    full = dict(full_model(spec, seed=5).named_parameters())
    for part in ([5, 3], [0, 8, 0], [1, 2, 3, 2]):
        for s in range(len(part)):
            for n, p in stage_module(spec, len(part), s, seed=5, partition=part).named_parameters():
                assert torch.equal(p, full[n]), (part, n)


@pytest.mark.slow
def test_cli_run_and_reference_with_plan(plan_files, capsys):
    """``pipetwin run --plan`` end to end (4 spawned ranks, 2 steps) and with ``--reference``."""
    path = plan_files["nonuniform"]
    cfg, _, _ = config_from_plan(path, **BASE)
    ref = run_reference(cfg)
    common = ["run", "--plan", str(path), "--json", "--optimizer", "sgd", "--lr", "0.05"]
    assert cli_main(common + ["--reference"]) == 0
    io = capsys.readouterr()
    out = json.loads(io.out)
    assert out["losses"] == pytest.approx(ref.losses, rel=1e-6)
    assert out["plan"]["global_batch"] == 8 and out["partition"] == list(cfg.blocks)
    assert "stage replicas 1:2:1" in io.err and "running reference" in io.err
    assert cli_main(common + ["--steps", "2"]) == 0
    io = capsys.readouterr()
    out = json.loads(io.out)
    assert out["engine"] == "executor" and len(out["per_device"]) == 4
    assert out["losses"] == pytest.approx(ref.losses[:2], rel=1e-5)
    assert "running 4 processes" in io.err and "device map" in io.err and "ignored on the CPU" in io.err


def test_bad_plan_and_flags_are_one_line_errors(plan_files, tmp_path, capsys):
    path = plan_files["uniform"]
    short = json.loads(path.read_text())
    short["plan"]["stages"][-1]["layers"][1] -= 1
    cl = _cluster(1, 4, "eth-25g")
    vgg = load_workload("vgg-19", cl.device)
    save_plan(tmp_path / "vgg.json", Plan("vgg-19", cl.name, 8, 4, (StagePlan(0, vgg.num_layers, (0,)),),
                                          "fresh-first"), vgg, cl)
    cases = {"bad.json": ("{ nope", "not valid JSON"), "short.json": (json.dumps(short), "covers layers"),
             "vgg.json": ((tmp_path / "vgg.json").read_text(), "vgg-19 is a layer-cost model")}
    for fname, (text, msg) in cases.items():
        (tmp_path / fname).write_text(text)
        assert cli_main(["run", "--plan", str(tmp_path / fname)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("pipetwin: error: ") and "\n" not in err and msg in err, err
    for argv, msg in ((["--plan", str(path), "-s", "dapple"], "drop --schedule"),
                      (["--plan", str(path), "--dp", "2", "--model", "tiny"], "drop --dp, --model"),
                      ([], "give --schedule, --devices, --microbatches (or --plan"),
                      (["--plan", str(tmp_path / "missing.json")], "does not exist")):
        assert cli_main(["run", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("pipetwin: error: ") and "\n" not in err and msg in err, err


@pytest.mark.slow
def test_run_plan_from_another_folder(tmp_path, monkeypatch, capsys):
    """A profile and a plan made in one folder, the model file named relative to it (cnn.py:build),
    run from any other folder: both store the model file's path absolute; a plan moved together
    with its model file (a relative name in it) finds the file beside the plan."""
    import shutil
    from pathlib import Path

    import yaml
    work, moved, other = tmp_path / "work", tmp_path / "moved", tmp_path / "elsewhere"
    for d in (work, moved, other):
        d.mkdir()
    models = Path(__file__).resolve().parent.parent / "notebooks" / "models"
    shutil.copy(models / "cnn.py", work / "cnn.py")
    names = ["Conv2d", "ReLU", "MaxPool2d", "Conv2d", "ReLU", "MaxPool2d", "Flatten", "Linear", "ReLU", "Linear"]
    n = len(names)
    (work / "prof.yaml").write_text(yaml.safe_dump({
        "model": {"file": "cnn.py:build", "micro_batch": 4, "layer_names": names, "params": [100.0] * n,
                  "out_bytes": [1024.0] * n, "act_first": [1024.0] * n, "act_w_first": [1024.0] * n},
        "per_layer": [{"f": 1e-3, "b_input": 1e-3, "w": 1e-3, "b": 2e-3}] * n, "act_bytes_per_layer": [1024.0] * n,
        "p2p": {"latency": 1e-5, "bandwidth": 1e9}, "allreduce": {"latency": 1e-5, "bandwidth": 1e9}, "cores": 2}))
    monkeypatch.chdir(work)
    assert cli_main(["plan", "--profile", "prof.yaml", "-G", "8", "--gpus", "2", "--no-progress",
                     "--no-baselines", "--out", "plan.json"]) == 0
    rec = json.loads((work / "plan.json").read_text())
    assert rec["model"]["name"] == f"{work / 'cnn.py'}:build"
    rec["model"]["name"] = "cnn.py:build"                       # as a plan written before, moved with its model
    (moved / "plan.json").write_text(json.dumps(rec))
    shutil.copy(work / "cnn.py", moved / "cnn.py")
    monkeypatch.chdir(other)
    capsys.readouterr()
    for plan in (work / "plan.json", moved / "plan.json"):
        assert cli_main(["run", "--plan", str(plan), "--steps", "1", "--json"]) == 0, capsys.readouterr().err
        losses = json.loads(capsys.readouterr().out)["losses"]
        assert len(losses) == 1 and 0 < losses[0] < 10


@pytest.mark.parametrize("name", ["uniform", "nonuniform", "interleaved"])
def test_a_plan_is_a_job_the_library_runs_without_the_command_layer(plan_files, name):
    """``LoadedPlan.run_job`` + ``placement`` are all ``RunConfig`` needs: the job lowers (through
    ``Job.build``) to the very programs the planner simulates, with the plan's device of every rank;
    a non-uniform plan is a layout field, DAPPLE's ``stage_replicas``."""
    from planner import load_plan
    loaded = load_plan(plan_files[name])
    ex = loaded.for_executor()
    cfg = RunConfig(job=loaded.run_job(), placement=loaded.placement, steps=1)
    low = lowered_schedule(cfg)
    assert [list(map(str, p)) for p in low.programs] == [list(map(str, p)) for p in ex["schedule"].programs]
    assert cfg.device_map == tuple(ex["device_map"]) and cfg.job.partition == tuple(ex["partition"])
    reps = tuple(s.replicas for s in loaded.plan.stages)
    if name == "nonuniform":
        assert cfg.layout.stage_replicas == reps == (1, 2, 1) and cfg.layout.devices == 4
        assert cfg.layout.microbatches == loaded.plan.microbatches * 2      # C = lcm(1, 2, 1) sub-batches
    else:
        assert cfg.layout.stage_replicas is None and cfg.layout.replicas == 2


def test_stage_replicas_are_checked_in_one_line():
    from cost_models.job import Layout
    for kw, msg in ((dict(schedule="gpipe", devices=4, microbatches=8, stage_replicas=(1, 2, 1)),
                     "stage replicas 1:2:1 run DAPPLE's schedule (dapple) only; got gpipe"),
                    (dict(schedule="dapple", devices=3, microbatches=8, stage_replicas=(1, 2, 1)),
                     "stage replicas 1:2:1 occupy 4 devices; -D is 3"),
                    (dict(schedule="dapple", devices=5, microbatches=4, stage_replicas=(2, 3)),
                     "stage replicas 2:3 cut a micro-batch into 6 sub-batches; -N 4 (sub-batches) is not a "
                     "multiple of 6"),
                    (dict(schedule="dapple", devices=2, microbatches=4, stage_replicas=(2, 0)),
                     "stage_replicas must be an integer >= 1; got 0")):
        with pytest.raises(ValueError) as e:
            Layout(**kw)
        assert str(e.value) == msg


def test_dapple_plan_files_are_version_2_with_their_job_and_version_1_still_reads(plan_files, tmp_path):
    from planner import load_plan
    rec = json.loads(plan_files["nonuniform"].read_text())
    job = rec["job"]
    assert (rec["version"], rec["planner"]) == (2, "dapple")
    assert job["layout"]["stage_replicas"] == [1, 2, 1] and job["layout"]["devices"] == 4
    assert job["layout"]["microbatches"] == 2 * rec["plan"]["microbatches"]          # C = 2 sub-batches
    assert job["parallel"]["micro_batch"] == rec["plan"]["micro_batch"] // 2
    assert job["placement"] == [d for s in rec["plan"]["stages"] for d in s["devices"]]
    v1 = {k: v for k, v in rec.items() if k not in ("planner", "job")} | {"version": 1}
    (tmp_path / "v1.json").write_text(json.dumps(v1))
    assert load_plan(tmp_path / "v1.json").planned_job() == load_plan(plan_files["nonuniform"]).planned_job()
    job["layout"]["microbatches"] += 2
    (tmp_path / "edited.json").write_text(json.dumps(rec))
    with pytest.raises(ValueError, match="edited.json: field 'job' disagrees with the plan's stages and "
                                         "micro-batches"):
        load_plan(tmp_path / "edited.json")


def test_a_stage_replicas_job_keeps_one_set_of_weights_per_device():
    """Copies of a stage on one device share its weights (the executor keeps one module): unit costs
    give every device of (1, 2, 1) one stage's weights, f = D / S = 4/3 Mw, not one per copy; the
    model's formulas the same weights on every device of a stage."""
    from cost_models.job import Job, Layout
    from sim import simulate_job
    lay = Layout(schedule="dapple", devices=4, microbatches=4, stage_replicas=(1, 2, 1))
    bound, _ = simulate_job(Job(layout=lay, unit_costs=True))
    assert bound.costs.static_mem == pytest.approx((4 / 3,) * 4, rel=1e-12)
    bound, _ = simulate_job(Job(layout=lay, model="gpt3-1.3b", cluster="dgx-a100-1x8", partition=(9, 8, 9)))
    one = simulate_job(Job(layout=Layout(schedule="dapple", devices=3, microbatches=4), model="gpt3-1.3b",
                           cluster="dgx-a100-1x8", partition=(9, 8, 9)))[0].costs.static_mem
    assert bound.costs.static_mem == (one[0], one[1], one[1], one[2])
