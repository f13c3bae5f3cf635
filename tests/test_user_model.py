"""A user's layer stack (``--model PATH.py:FUNC``) on the executor, against the single-process reference.

The two example model files of ``notebooks/models`` (a small CNN, a transformer LM whose head is
tied to its embedding table) run under every schedule family at D = 2, two at D = 3 and two with
data-parallel replicas (D = 2 x R = 2), three spawns in all (processes reused across jobs). Each
job trains 3 SGD steps: the per-step losses equal the reference's within 1e-5 and so does every
final parameter; the tied parameter's copies end bit-identical on every rank that holds one.
"""
from pathlib import Path

import pytest
import torch

from cost_models.partition import balanced_counts, stack_partition
from executor.config import RunConfig, lowered_schedule
from executor.launch import run_many
from executor.reference import run_reference
from executor.user_model import StackLayout, build_stack, find_ties, stack_layout, tie_groups
from experiments.cli import main as cli_main
from schedules import ScheduleError, build, lower, names

MODELS = Path(__file__).resolve().parent.parent / "notebooks" / "models"
CNN, LM = f"{MODELS / 'cnn.py'}:build", f"{MODELS / 'tied_lm.py'}:build"
BASE = dict(steps=3, optimizer="sgd", lr=0.05, collect_params=True, timeout=30.0)
TIED = ("layers.0.tok.weight", "layers.5.proj.weight")     # one nn.Parameter in the embedding and the head


def _cases_world2():
    cases = {}
    for model, tag in ((CNN, "cnn"), (LM, "lm")):
        for s in names():       # every schedule family
            cfg = RunConfig(model=model, schedule=s, devices=2, microbatches=4, **BASE)
            try:
                lowered_schedule(cfg)
            except ScheduleError:
                continue
            cases[f"{tag}-{s}-D2"] = cfg
    # a stage without parameters (ReLU + pooling) held by both ranks: an empty all-reduce
    cases["cnn-bitpipe-paramfree-stage-D2"] = RunConfig(model=CNN, schedule="bitpipe", devices=2, microbatches=4,
                                                        partition=(1, 2, 3, 4), **BASE)
    cases["lm-zb-h1-adam-mb3-D2"] = RunConfig(model=LM, schedule="zb-h1", devices=2, microbatches=4, micro_batch=3,
                                              **dict(BASE, optimizer="adam", lr=1e-3))
    return cases


def _cases_world3():
    cases = {f"{tag}-{s}-D3": RunConfig(model=m, schedule=s, devices=3, microbatches=6, **BASE)
             for m, tag in ((CNN, "cnn"), (LM, "lm")) for s in ("dapple", "zb-v")}
    # the rank in the middle holds a ReLU and a pooling layer only: no parameters, no optimizer state
    cases["cnn-dapple-paramfree-rank-D3"] = RunConfig(model=CNN, schedule="dapple", devices=3, microbatches=3,
                                                      partition=(1, 2, 7), **BASE)
    return cases


def _cases_world4():
    return {f"lm-{s}-D2R2": RunConfig(model=LM, schedule=s, devices=2, microbatches=4, replicas=2, **BASE)
            for s in ("dapple", "chimera")}


CASES = {2: _cases_world2(), 3: _cases_world3(), 4: _cases_world4()}
IDS = [(w, k) for w, cases in CASES.items() for k in cases]


@pytest.fixture(scope="module")
def runs():
    cache = {}

    def get(world):
        if world not in cache:
            cases = CASES[world]
            cache[world] = dict(zip(cases, run_many(list(cases.values()))))
        return cache[world]
    return get


@pytest.fixture(scope="module")
def references():
    cache = {}

    def get(cfg):
        key = cfg.with_(schedule="dapple", devices=1, replicas=1, microbatches=cfg.global_microbatches,
                        partition=None)   # the reference sees only the model, the global batch and the optimizer
        if key not in cache:
            cache[key] = run_reference(key)
        return cache[key]
    return get


@pytest.mark.parametrize("world,case", IDS, ids=[k for _, k in IDS])
def test_losses_and_parameters_equal_reference(runs, references, world, case):
    cfg = CASES[world][case]
    res, ref = runs(world)[case], references(cfg)
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


@pytest.mark.parametrize("world,case", [x for x in IDS if x[1].startswith("lm-")],
                         ids=[k for _, k in IDS if k.startswith("lm-")])
def test_tied_weights_stay_equal_on_every_rank(runs, world, case):
    res = runs(world)[case]
    low = lowered_schedule(CASES[world][case])
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
                     "    return types.SimpleNamespace(layers=[Ids(), nn.Embedding(8, 4), nn.Flatten(), nn.Linear(8, 2)],\n"
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
