"""A user's layer stack (``--model PATH.py:FUNC``) on the executor, against the single-process reference.

The two example model files of ``notebooks/models`` (a small CNN, a transformer LM whose head is
tied to its embedding table) run under every schedule family at D = 2, two at D = 3 and Chimera
with data-parallel replicas (D = 2 x R = 2), three spawns in all (processes reused across jobs).
Each job trains 3 SGD steps: the per-step losses equal the reference's within 1e-5 and so does
every final parameter; the tied parameter's copies end bit-identical on every rank that holds one;
every rank's peak activation bytes equal the simulator's from the measured per-layer bytes. Then a
short real calibration of the tied LM (``pipetwin calibrate``, shared with its notebook:
tests/conftest.py) feeds the simulator (here and scaled onto a cluster) and the planner, whose
plan runs and equals the reference; bad model files fail in one line (exit 2).
"""
from pathlib import Path

import pytest
import torch

from cost_models.partition import balanced_counts, stack_partition
from executor.config import RunConfig, lowered_schedule
from executor.launch import run_many
from executor.user_model import StackLayout, build_stack, find_ties, stack_layout, tie_groups
from experiments.cli import main as cli_main
from schedules import ScheduleError, build, lower, names
from tests.helpers import reference_one_thread

MODELS = Path(__file__).resolve().parent.parent / "notebooks" / "models"
CNN, LM = f"{MODELS / 'cnn.py'}:build", f"{MODELS / 'tied_lm.py'}:build"
BASE = dict(steps=3, optimizer="sgd", lr=0.05, collect_params=True, timeout=30.0)
TIED = ("layers.0.tok.weight", "layers.5.proj.weight")     # one nn.Parameter in the embedding and the head


def _cases_world2():
    cases = {}
    for model, tag in ((CNN, "cnn"), (LM, "lm")):
        for s in names():       # every schedule family
            cfg = RunConfig.of(model=model, schedule=s, devices=2, microbatches=4, **BASE)
            try:
                lowered_schedule(cfg)
            except ScheduleError:
                continue
            cases[f"{tag}-{s}-D2"] = cfg
    # a stage without parameters (ReLU + pooling) held by both ranks: an empty all-reduce
    cases["cnn-bitpipe-paramfree-stage-D2"] = RunConfig.of(model=CNN, schedule="bitpipe", devices=2, microbatches=4,
                                                        partition=(1, 2, 3, 4), **BASE)
    cases["lm-zb-h1-adam-mb3-D2"] = RunConfig.of(model=LM, schedule="zb-h1", devices=2, microbatches=4, micro_batch=3,
                                              **dict(BASE, optimizer="adam", lr=1e-3))
    return cases


def _cases_world3():
    cases = {f"{tag}-{s}-D3": RunConfig.of(model=m, schedule=s, devices=3, microbatches=6, **BASE)
             for m, tag in ((CNN, "cnn"), (LM, "lm")) for s in ("dapple", "zb-v")}
    # the rank in the middle holds a ReLU and a pooling layer only: no parameters, no optimizer state
    cases["cnn-dapple-paramfree-rank-D3"] = RunConfig.of(model=CNN, schedule="dapple", devices=3, microbatches=3,
                                                      partition=(1, 2, 7), **BASE)
    return cases


def _cases_world4():
    # two model copies x two replicas: the tied table's gradient is summed over all four ranks
    return {"lm-chimera-D2R2": RunConfig.of(model=LM, schedule="chimera", devices=2, microbatches=4, replicas=2,
                                            **BASE)}


CASES = {2: _cases_world2(), 3: _cases_world3(), 4: _cases_world4()}
IDS = [(w, k) for w, cases in CASES.items() for k in cases]


@pytest.fixture(scope="module")
def references():
    cache = {}

    def get(cfg):
        key = cfg.with_(schedule="dapple", devices=1, replicas=1, microbatches=cfg.global_microbatches,
                        partition=None)   # the reference sees only the model, the global batch and the optimizer
        if key not in cache:
            cache[key] = reference_one_thread(key)
        return cache[key]
    return get


@pytest.mark.slow
@pytest.mark.parametrize("world,case", IDS, ids=[k for _, k in IDS])
def test_losses_and_parameters_equal_reference(runs, references, world, case):
    cfg = CASES[world][case]
    (_, _, res), ref = runs(world)[case], references(cfg)
    assert len(res.losses) == 3 == len(ref.losses)
    for got, want in zip(res.losses, ref.losses):
        assert abs(got - want) <= 1e-5 * abs(want), (res.losses, ref.losses)
    held: dict[str, list[torch.Tensor]] = {}
    for key, t in res.params.items():
        held.setdefault(key.split("/", 1)[1], []).append(t)
    assert set(held) == set(ref.params)           # every parameter is held somewhere, under its global name
    if cfg.optimizer == "sgd":
        for name, tensors in held.items():
            scale = float(ref.params[name].abs().max().clamp_min(1e-12))
            assert max(float((t - ref.params[name]).abs().max()) for t in tensors) <= 1e-5 * scale, name
    else:
        assert res.losses[-1] < res.losses[0]


@pytest.mark.slow
@pytest.mark.parametrize("world,case", [x for x in IDS if x[1].startswith("lm-")],
                         ids=[k for _, k in IDS if k.startswith("lm-")])
def test_tied_weights_stay_equal_on_every_rank(runs, world, case):
    _, low, res = runs(world)[case]
    copies = [t for key, t in res.params.items() if key.split("/", 1)[1] in TIED]
    # every model copy on every replica holds the embedding, the head or both
    assert len(copies) >= low.num_copies * low.replicas
    assert all(torch.equal(t, copies[0]) for t in copies[1:])
    start = build_stack(LM, 0).layers[0].tok.weight
    assert not torch.equal(copies[0], start)      # and it trained


def test_shared_parameter_groups():
    """Which ranks sum a shared parameter: those holding any of its stages (copies, replicas)."""
    layout = stack_layout(LM, 2)
    assert layout.ties == (((0, "tok.weight"), (5, "proj.weight")),)
    assert tie_groups(layout, lower(build("dapple", 2, 4))) == [((0, 1), (0,))]
    assert tie_groups(layout, lower(build("dapple", 2, 4), replicas=2)) == [((0, 1, 2, 3), (0,))]
    # the V shape puts the embedding (stage 0) and the head (stage 3) on rank 0: nothing to sum
    v = lower(build("zb-v", 2, 4))
    assert tie_groups(stack_layout(LM, v.num_stages), v) == [((0,), (0,))]
    assert tie_groups(stack_layout(LM, 1), lower(build("dapple", 1, 2))) == []    # one stage: no copies
    assert find_ties(build_stack(CNN, 0).layers) == ()


def test_layout_shapes_and_default_partition():
    layout = stack_layout(CNN, 4, micro_batch=5)
    assert isinstance(layout, StackLayout) and layout.num_layers == 10
    assert layout.params == (80, 0, 0, 1168, 0, 0, 0, 4640, 0, 132)
    assert list(layout.counts) == stack_partition(layout.params, 4) == balanced_counts(layout.params, 4)
    assert layout.input_shape == (5, 1, 12, 12) and layout.out_shapes[6] == (5, 144)
    assert layout.out_shapes[-1] == (5, 4)


def test_balanced_counts_is_the_min_max_split():
    """Against brute force: the lightest heaviest stage, then the smallest sum of squares."""
    import itertools
    import random
    rng = random.Random(3)
    for _ in range(400):
        n = rng.randint(1, 8)
        parts = rng.randint(1, n)
        w = [rng.choice([0, 0, 1, 2, 3, 7]) for _ in range(n)]
        best = None
        for cuts in itertools.combinations(range(1, n), parts - 1):
            e = (0, *cuts, n)
            loads = [sum(w[a:b]) for a, b in zip(e, e[1:])]
            best = min(best or (float("inf"), 0), (max(loads), sum(x * x for x in loads)))
        counts = balanced_counts(w, parts)
        assert len(counts) == parts and min(counts) >= 1 and sum(counts) == n
        e = [0]
        for c in counts:
            e.append(e[-1] + c)
        loads = [sum(w[a:b]) for a, b in zip(e, e[1:])]
        assert (max(loads), sum(x * x for x in loads)) == best, (w, parts, counts)
    assert balanced_counts([1, 1, 1, 1, 1, 1, 1, 10], 3) == [3, 4, 1]
    with pytest.raises(ValueError, match="cannot split 2 layers into 3 stages"):
        balanced_counts([1, 2], 3)


BAD = {
    "missing": ("import types\nfrom torch import nn\n\ndef build():\n"
                "    return types.SimpleNamespace(layers=[nn.Linear(4, 2)], loss=nn.functional.cross_entropy)\n",
                "build() returned a SimpleNamespace without 'sample'; it must return an object with layers"),
    "notalist": ("import types, torch\nfrom torch import nn\n\ndef build():\n"
                 "    return types.SimpleNamespace(layers=nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)),\n"
                 "        loss=nn.functional.cross_entropy, sample=lambda g, b: (torch.randn(b, 4, generator=g),\n"
                 "        torch.randint(0, 2, (b,), generator=g)))\n",
                 "'layers' must be a list of torch.nn.Module (pass list(...) of it); got a Sequential"),
    "shape": ("import types, torch\nfrom torch import nn\n\ndef build():\n"
              "    return types.SimpleNamespace(layers=[nn.Linear(4, 8), nn.ReLU(), nn.Linear(6, 2)],\n"
              "        loss=nn.functional.cross_entropy, sample=lambda g, b: (torch.randn(b, 4, generator=g),\n"
              "        torch.randint(0, 2, (b,), generator=g)))\n",
              "layer 2 (Linear) cannot take the output of layer 1 (ReLU) (shape [4, 8], float32): RuntimeError: "
              "mat1 and mat2 shapes cannot be multiplied"),
    "raises": ("def build():\n    return undefined_name\n",
               "build() failed (raises.py line 2): NameError: name 'undefined_name' is not defined"),
    "global_rng": ("import types, torch\nfrom torch import nn\n\ndef build():\n"
                   "    return types.SimpleNamespace(layers=[nn.Linear(4, 4), nn.Linear(4, 2)],\n"
                   "        loss=nn.functional.cross_entropy,\n"
                   "        sample=lambda g, b: (torch.randn(b, 4), torch.randint(0, 2, (b,), generator=g)))\n",
                   "draw every random number from the generator it is given"),
    "int_boundary": ("import types, torch\nfrom torch import nn\n\nclass Ids(nn.Module):\n"
                     "    def forward(self, x):\n        return x\n\ndef build():\n"
                     "    return types.SimpleNamespace(\n"
                     "        layers=[Ids(), nn.Embedding(8, 4), nn.Flatten(), nn.Linear(8, 2)],\n"
                     "        loss=nn.functional.cross_entropy, sample=lambda g, b: (torch.randint(0, 8, (b, 2), "
                     "generator=g),\n        torch.randint(0, 2, (b,), generator=g)))\n",
                     "carries a int64 tensor; gradients flow back only through floating-point tensors"),
}


@pytest.mark.parametrize("kind", sorted(BAD))
def test_bad_model_file_is_one_line_and_exit_2(kind, tmp_path, capsys):
    src, message = BAD[kind]
    path = tmp_path / f"{kind}.py"
    path.write_text(src)
    partition = ["--partition", "1,3"] if kind == "int_boundary" else []
    rc = cli_main(["run", "--model", f"{path}:build", "-s", "dapple", "-D", "2", "-N", "2", *partition])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith(f"pipetwin: error: model {path}:build: ") and "Traceback" not in err
    assert message in err, err


def test_missing_model_file_and_function(tmp_path, capsys):
    assert cli_main(["run", "--model", f"{tmp_path}/nope.py:build", "-s", "dapple", "-D", "2", "-N", "2"]) == 2
    assert capsys.readouterr().err == f"pipetwin: error: model file {tmp_path}/nope.py does not exist\n"
    assert cli_main(["run", "--model", f"{CNN[:-6]}:nope", "-s", "dapple", "-D", "2", "-N", "2"]) == 2
    assert "has no function 'nope'" in capsys.readouterr().err
    assert cli_main(["run", "--model", CNN, "-s", "zb-v", "-D", "8", "-N", "8"]) == 2
    assert "(10 layers): cannot split 10 layers into 16 stages" in capsys.readouterr().err


# ---------------------------------------------------------------------------- profiles of a layer stack
def _stack_profile(ref: str, micro_batch: int = 4):
    """A profile with the model's measured layers (times from 3 repeats) and placeholder links:
    what memory is simulated from does not depend on the times."""
    from calibration import measure_stack
    from cost_models import CalibrationProfile, LayerTiming, LinkSpec
    rows, spec, act, act_w = measure_stack(ref, micro_batch, threads=1, repeats=3)
    return CalibrationProfile(name="test", model=spec, layers=tuple(LayerTiming(r["f"], r["b_input"], r["w"], r["b"])
                                                                   for r in rows),
                              p2p=LinkSpec("custom", 1e9, 1e-5), allreduce=LinkSpec("custom", 1e9, 1e-5),
                              act_bytes=act, act_w_bytes=act_w, cores=2)


@pytest.fixture(scope="module")
def stack_profiles():
    return {CNN: _stack_profile(CNN), LM: _stack_profile(LM)}


@pytest.mark.slow
@pytest.mark.parametrize("case", [k for k, c in CASES[2].items() if c.parallel.micro_batch is None])
def test_simulated_activation_memory_equals_measured(runs, stack_profiles, case):
    """Every rank's peak activation bytes, measured by the runtime's saved-tensor meter, equal the
    simulator's from the profile's per-layer bytes (alone at a stage's start, added after the
    layer before it elsewhere), split backward and parameter-free stages included. DualPipe-V too:
    the executor runs its pairs' F and B interleaved layer by layer (a layer stack's segments), so
    B frees layers while F keeps others, and the simulator books the pair so
    (:func:`cost_models.memory.pair_memory`; before, it booked the F whole before the B freed
    anything: 2,688 B over the measured 699,268 on rank 0 of the LM)."""
    from calibration import simulate_with_profile
    cfg = CASES[2][case]
    _, low, res = runs(2)[case]
    sim = simulate_with_profile(low, stack_profiles[cfg.model], partition=cfg.blocks)
    from schedules.trace import step_metrics
    assert [p.peak_activation for p in step_metrics(sim).per_device] == \
        [float(p["peak_activation_bytes"]) for p in res.per_device]


@pytest.mark.slow
def test_measured_layer_facts(stack_profiles):
    """Parameters, output bytes, FLOPs (2 per multiply-accumulate) and kept bytes of the CNN at a
    micro-batch of 4, against closed forms."""
    st = stack_profiles[CNN].model
    assert st.params == (80, 0, 0, 1168, 0, 0, 0, 4640, 0, 132)
    assert st.out_bytes == (4 * 8 * 144 * 4, 4 * 8 * 144 * 4, 4 * 8 * 36 * 4, 4 * 16 * 36 * 4, 4 * 16 * 36 * 4,
                            4 * 16 * 9 * 4, 4 * 144 * 4, 4 * 32 * 4, 4 * 32 * 4, 0)
    conv1 = 2 * (4 * 8 * 144) * 9            # outputs x (in channels x 3 x 3) multiply-accumulates
    f, b, bi, w = st.flops[0]
    assert (f, bi, w, b) == (conv1, 0, conv1, conv1)      # the first layer computes no input gradient
    fc = 2 * 4 * 144 * 32
    assert st.flops[7] == (fc, 2 * fc, fc, fc)            # B = input + weight gradient, each one product
    # conv1 keeps its input; the ReLU its output; the pooling its input (the ReLU's output) and indices
    assert st.act_first[:3] == (4 * 144 * 4, 4 * 8 * 144 * 4, 4 * 8 * 144 * 4 + 4 * 8 * 36 * 8)
    assert stack_profiles[CNN].act_bytes[2] == 4 * 8 * 36 * 8    # after the ReLU only the indices are new


@pytest.mark.slow
def test_calibrate_then_simulate(tied_lm_profile, capsys):
    import json

    from cost_models import load_profile, scaled_layer_costs
    from cost_models.device import load_device
    prof, path = tied_lm_profile
    assert load_profile(path) == prof and prof.is_stack and prof.micro_batch == 4
    assert set(prof.meta["runtime_schedules"]) == {"dapple", "interleaved", "zb-v", "zb-h1", "bitpipe"}
    assert cli_main(["simulate", "--profile", str(path), "-s", "zb-v", "-D", "2", "-N", "4", "--json"]) == 0
    here = json.loads(capsys.readouterr().out)
    assert here["cluster"] == f"{prof.name}-2"      # this machine, 2 ranks
    # the command's time is the profile's simulation of the model file's ZB-V (calibration's API)
    from calibration import simulate_with_profile
    from schedules.trace import step_metrics
    low = lowered_schedule(RunConfig.of(model=LM, schedule="zb-v", devices=2, microbatches=4))
    assert here["iteration_time"] == step_metrics(simulate_with_profile(low, prof)).iteration_times[0]
    # scaled onto an A100: every time x (FLOPs / seconds measured here) / (19.5 TFLOP/s fp32 x 0.5)
    a100 = load_device("a100")
    flops = sum(f + b for f, b, _, _ in prof.model.flops)
    secs = sum(t.f + t.b for t in prof.layers)
    lc, factor = scaled_layer_costs(prof, a100)
    assert factor == pytest.approx(flops / secs / (19.5e12 * 0.5), rel=1e-12)
    assert lc.f == pytest.approx(tuple(t.f * factor for t in prof.layers), rel=1e-12)
    assert cli_main(["simulate", "--profile", str(path), "--cluster", "dgx-a100-1x8", "-s", "dapple", "-D", "4",
                     "-N", "8", "--partition", "time", "--json"]) == 0
    there = json.loads(capsys.readouterr().out)
    assert there["cluster"] == "dgx-a100-1x8" and there["out_of_memory"] is False
    assert there["iteration_time"] < here["iteration_time"] / 10
    assert cli_main(["bubbles", "--profile", str(path), "-D", "2", "--max-k", "2", "--schedules", "dapple,zb-v"]) == 0
    assert "simulated with profile" in capsys.readouterr().out


@pytest.mark.slow
def test_readme_compare_examples_run_as_printed(tied_lm_profile, capsys):
    """The README's ``compare --profile out/lm.yaml`` lines, word for word but the profile's path: at
    D = 4 the 6-layer model has too few layers for the 8-stage schedules, which are skipped with why."""
    import json
    import shlex
    from pathlib import Path
    _, path = tied_lm_profile
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text().splitlines()
    lines = [x.split("#")[0] for x in readme if x.startswith("pipetwin compare --profile out/lm.yaml")]
    assert len(lines) == 2 and "-D 4 -N 8" in lines[1]
    results = []
    for line in lines:
        argv = [str(path) if w == "out/lm.yaml" else w for w in shlex.split(line)[1:]]
        assert cli_main(argv + ["--json"]) == 0
        results.append(json.loads(capsys.readouterr().out))
    here, there = results
    assert len(here["schedules"]) >= 10
    eight = {"interleaved", "bitpipe", "zb-v", "dualpipe-v", "bitpipe-zb"}
    assert set(there["skipped"]) == eight and {r["schedule"] for r in there["schedules"]}.isdisjoint(eight)
    why = there["skipped"]["zb-v"]
    assert why.startswith("zb-v has 8 stages at D=4; model ") and why.endswith("tied_lm.py:build has 6 layers")
    assert {"gpipe", "dapple", "zb-h1"} <= {r["schedule"] for r in there["schedules"]}
    assert all(r["iteration_time"] > 0 for r in there["schedules"])


@pytest.mark.slow
def test_plan_from_a_profile_runs_and_equals_the_reference(tied_lm_profile, tmp_path):
    from experiments.plan_files import config_from_plan
    from planner import plan_training, save_plan
    from cost_models.workloads.paper_models import calibrated_workload
    prof, _ = tied_lm_profile
    res = plan_training(calibrated_workload(prof), prof.cluster(2), 8, baselines=False, top_k=2)
    path = tmp_path / "plan.json"
    save_plan(path, res.best.plan, res.workload, prof.cluster(2))
    cfg, low, info = config_from_plan(path, steps=3, optimizer="sgd", lr=0.05)
    assert cfg.model == LM and sum(cfg.blocks) == 6 and cfg.global_microbatches * cfg.samples_per_microbatch == 8
    (got,), want = run_many([(cfg, low)]), reference_one_thread(cfg)
    for a, b in zip(got.losses, want.losses):
        assert abs(a - b) <= 1e-5 * abs(b)


@pytest.mark.slow
def test_model_file_costs_need_its_profile(tied_lm_profile, capsys):
    _, path = tied_lm_profile
    assert cli_main(["simulate", "--model", CNN, "-s", "dapple", "-D", "2", "-N", "4"]) == 2
    assert f"model {CNN} is a Python model file: its costs are measured" in capsys.readouterr().err
    assert cli_main(["simulate", "--model", CNN, "--profile", str(path), "-s", "dapple", "-D", "2", "-N", "4"]) == 2
    assert f"was measured for model {LM}, not {CNN}" in capsys.readouterr().err
    assert cli_main(["simulate", "--profile", str(path), "-s", "dapple", "-D", "2", "-N", "4", "--micro-batch",
                     "8"]) == 2
    assert "measured at micro-batch 4" in capsys.readouterr().err


def test_stack_profile_file_and_stage_bytes():
    """A layer-stack profile written by hand: read, checked, and its stage bytes summed with the
    first layer of each stage counted alone."""
    from cost_models import profile_from_dict
    from cost_models._spec import SpecError
    d = {"model": {"file": "m.py:build", "micro_batch": 2, "layer_names": ["A", "B", "C"], "params": [10, 0, 5],
                   "out_bytes": [8, 8, 0], "act_first": [4, 16, 8], "act_w_first": [4, 16, 8],
                   "flops": [{"f": 1, "b": 2, "b_input": 1, "w": 1}] * 3},
         "per_layer": [{"f": 1e-3, "b_input": 1e-3, "w": 1e-3, "b": 2e-3}] * 3,
         "act_bytes_per_layer": [4, 8, 8], "p2p": {"latency": 1e-5, "bandwidth": 1e9},
         "allreduce": {"latency": 1e-5, "bandwidth": 1e9}}
    prof = profile_from_dict(d, "p.yaml")
    assert prof.is_stack and prof.default_partition(2) == (1, 2)
    costs = prof.cost_model(2).bind(lower(build("dapple", 2, 2)))
    assert costs.act[0] == (4.0, 16.0 + 8.0)                   # stage 1 = [B alone, C after B]
    assert prof.cost_model(2, (2, 1)).bind(lower(build("dapple", 2, 2))).act[0] == (4.0 + 8.0, 8.0)
    assert profile_from_dict(prof.to_dict(), "again") == prof
    with pytest.raises(SpecError, match="needs fields 'per_layer' and 'act_bytes_per_layer'"):
        profile_from_dict({k: v for k, v in d.items() if k != "act_bytes_per_layer"}, "p.yaml")
    with pytest.raises(SpecError, match="recomputation is modelled for transformers"):
        prof.layer_costs(recompute="selective")


@pytest.mark.slow
def test_sweep_a_model_file_with_its_profile(tied_lm_profile, capsys, tmp_path):
    import csv
    import json
    _, path = tied_lm_profile
    out = tmp_path / "sw"
    assert cli_main(["sweep", "--model", LM, "--profile", str(path), "-s", "dapple,zb-v", "-D", "2", "-N", "4,8",
                     "--out", str(out), "--workers", "1", "--no-figures"]) == 0
    capsys.readouterr()
    with open(out / "sweep.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 4 and not any(r["error"] for r in rows)
    for r in rows:      # each point is `simulate --profile --json` of that point
        assert cli_main(["simulate", "--profile", str(path), "--model", LM, "-s", r["schedule"], "-D", "2", "-N",
                         r["microbatches"], "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["iteration_time"] == pytest.approx(float(r["iteration_time"]))
    assert cli_main(["sweep", "--model", CNN, "--profile", str(path), "-D", "2", "-N", "4", "--out", str(out)]) == 2
    assert f"was measured for model {LM}, not {CNN}" in capsys.readouterr().err
